"""The shared API (gdskv/kvstore.py): Store and Client implement every method of KVStore."""

import inspect

import numpy as np
import pytest

import gdskv
from gdskv.kvstore import KVStore
from gdskv.local import AttachedStore

PROTOCOL_METHODS = sorted(
    name for name, member in vars(KVStore).items()
    if callable(member) and (not name.startswith("_") or name in ("__enter__", "__exit__"))
)


def test_the_protocol_names_the_whole_shared_api():
    assert PROTOCOL_METHODS == sorted([
        "put", "batch_put", "get", "batch_get", "get_into", "batch_get_into", "exists",
        "batch_exists", "remove", "batch_remove", "stats", "close", "__enter__", "__exit__",
    ])


@pytest.mark.parametrize("cls", [gdskv.Store, gdskv.Client, AttachedStore], ids=["Store", "Client", "AttachedStore"])
def test_both_kinds_implement_every_method_with_its_parameters(cls):
    for name in PROTOCOL_METHODS:
        method = getattr(cls, name, None)
        assert method is not None, f"{cls.__name__} lacks {name}"
        wanted = list(inspect.signature(getattr(KVStore, name)).parameters)
        got = list(inspect.signature(method).parameters)
        assert got[: len(wanted)] == wanted, (cls.__name__, name, got)


def test_an_open_store_is_a_kvstore_and_its_batch_forms_work(tmp_path):
    with gdskv.open(tmp_path / "kv", dram="4MiB", ssd="16MiB") as store:
        assert isinstance(store, KVStore)
        a, b = np.full(1000, 1, np.uint8), np.full(2000, 2, np.uint8)
        store.batch_put(["a", "b"], [a, b])
        assert store.batch_get(["a", "missing", "b"]) == [bytearray(a.tobytes()), None, bytearray(b.tobytes())]
        assert store.batch_remove(["a", "missing"]) == [True, False]
        assert store.batch_exists(["a", "b"]) == [False, True]
        store.flush()
        store.close()
        with pytest.raises(gdskv.StoreClosedError):
            store.batch_get(["b"])
