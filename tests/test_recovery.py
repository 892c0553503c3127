"""Recovery: what a reopened store serves must match a record of what must remain."""

from __future__ import annotations

import threading

import gdskv
from conftest import block
from gates import After, Gate
from ondisk import disk_objects

KiB = 1024


def test_remove_of_a_key_whose_bucket_is_being_written_is_durable_on_return(make_store, tmp_path):
    # The offloader is held inside the write of the bucket that holds "k" (first gate), then
    # just after that bucket is sealed and indexed (second gate). A remove() that returned
    # while the write was under way must not leave "k" readable or in an index on disk.
    store = make_store(bucket_max_age_s=0.001)
    backend = store._backend
    writing = backend.engine.run = Gate(backend.engine.run)
    sealed = backend.write = After(backend.write)
    value = block(1, 64 * KiB)
    store.put("k", value)
    writing.wait_reached()

    result = []
    returned = threading.Event()
    remover = threading.Thread(target=lambda: (result.append(store.remove("k")), returned.set()))
    remover.start()
    returned.wait(0.5)  # a remove that does not wait for the write returns in this time
    writing.open()
    sealed.wait_reached()
    early = None
    if returned.is_set():
        early = (store.get("k"), b"k" in disk_objects(tmp_path / "store"))
    sealed.open()
    remover.join(10)
    if early is not None:
        assert early[0] is None, "removed key served from the bucket sealed after the remove"
        assert not early[1], "removed key is in an index on disk"
    assert result == [True]
    assert store.get("k") is None and b"k" not in disk_objects(tmp_path / "store")
    store.close()
    with gdskv.open(tmp_path / "store", dram="4MiB", ssd="64MiB") as reopened:
        assert reopened.get("k") is None and len(reopened) == 0
