"""The gdskv HiCache storage backend against SGLang's real ``HiCacheStorage`` base class and
its real storage factory (``dynamic`` backend loading).

No SGLang engine runs without a GPU, so the host pool is a small stand-in with the
methods and attributes HiCache's controller and the backend use (``page_size``,
``layer_num``, ``head_num``, ``head_dim``, ``dtype``, ``layout``, ``get_data_page``,
``get_dummy_flat_data_page``, ``set_from_flat_data_page``), laid out as SGLang's MHA host
pool is in its default ``layer_first`` layout: ``[2, layers, tokens, heads, head_dim]``.
"""

from __future__ import annotations

import logging

import pytest

from real_engines import SGLANG_VERSION, import_or_skip

pytestmark = pytest.mark.sglang

import_or_skip("sglang.srt.mem_cache.hicache_storage", f"sglang=={SGLANG_VERSION}")
torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from gdskv.connectors.sglang import GdskvHiCacheStorage  # noqa: E402
from gdskv.errors import ConfigError  # noqa: E402

PAGE, LAYERS, HEADS, DIM, TOKENS = 16, 2, 2, 32, 16 * 8
DYNAMIC = {"backend_name": "gdskv", "module_path": "gdskv.connectors.sglang", "class_name": "GdskvHiCacheStorage"}


class HostPool:
    """SGLang's MHA host pool, layer_first, in miniature (see the module docstring)."""

    def __init__(self, seed: int, *, head_dim: int = DIM) -> None:
        self.page_size, self.layer_num, self.head_num, self.head_dim = PAGE, LAYERS, HEADS, head_dim
        self.dtype = torch.bfloat16
        self.layout = "layer_first"
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn(2, LAYERS, TOKENS, HEADS, head_dim, generator=g).to(self.dtype)

    def get_data_page(self, index, flat=True):
        return self.kv_buffer[:, :, index : index + PAGE].flatten()

    def get_dummy_flat_data_page(self):
        return torch.zeros(2 * LAYERS * PAGE * HEADS * self.head_dim, dtype=self.dtype)

    def set_from_flat_data_page(self, index, data_page):
        self.kv_buffer[:, :, index : index + PAGE] = data_page.reshape(2, LAYERS, PAGE, HEADS, self.head_dim)


def storage_config(path, model="tiny-llama", **extra):
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=model,
        extra_config={**DYNAMIC, "path": str(path), "dram": "16MiB", "ssd": "64MiB", **extra},
    )


def make_backend(path, pool, **kw):
    """What HiCache's controller does: create through the factory, then register the pool."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(path, **kw), pool)
    backend.register_mem_pool_host(pool)
    return backend


HASHES = [f"{i:064x}" for i in range(1, 5)]  # stand-ins for SGLang's chained page hashes


def test_the_factory_loads_the_backend_dynamically(tmp_path):
    backend = make_backend(tmp_path / "kv", HostPool(0))
    try:
        assert isinstance(backend, GdskvHiCacheStorage)
        assert isinstance(backend, HiCacheStorage)
        assert not GdskvHiCacheStorage.__abstractmethods__
    finally:
        backend.close()


def test_the_old_module_path_gives_the_same_objects(tmp_path):
    """Configs written before the move name ``gdskv.engine.sglang``; it re-exports the backend."""
    import gdskv.connectors.sglang as new
    import gdskv.engine.sglang as old

    assert old.__all__ == new.__all__
    for name in new.__all__:
        assert getattr(old, name) is getattr(new, name), name
    cfg = storage_config(tmp_path / "kv", module_path="gdskv.engine.sglang")
    backend = StorageBackendFactory.create_backend("dynamic", cfg, HostPool(0))
    try:
        assert type(backend) is GdskvHiCacheStorage
    finally:
        backend.close()


def test_pages_written_by_one_engine_are_read_by_another(tmp_path):
    a_pool = HostPool(1)
    a = make_backend(tmp_path / "kv", a_pool)
    pages = [a_pool.get_data_page(i * PAGE) for i in range(4)]
    assert a.batch_exists(HASHES) == 0
    assert a.batch_set(HASHES[:3], pages[:3])
    assert a.batch_exists(HASHES) == 3  # visible while still queued
    assert a.exists(HASHES[0]) and not a.exists(HASHES[3])
    a.close()  # drains the queue; the store keeps the pages

    b = make_backend(tmp_path / "kv", HostPool(2))
    try:
        assert b.batch_exists(HASHES) == 3
        outs = [b.mem_pool_host.get_dummy_flat_data_page() for _ in range(4)]
        got = b.batch_get(HASHES, outs)
        assert [g is not None for g in got] == [True, True, True, False]
        for want, out in zip(pages[:3], outs):
            assert torch.equal(want, out)
        one = b.get(HASHES[1], b.mem_pool_host.get_dummy_flat_data_page())
        assert torch.equal(one, pages[1])
    finally:
        b.close()


def test_the_zero_copy_interface_moves_pages_between_host_pools(tmp_path):
    a_pool, b_pool = HostPool(3), HostPool(4)
    a = make_backend(tmp_path / "kv", a_pool, interface_v1=1)
    indices = torch.arange(2 * PAGE, 4 * PAGE)  # host pages 2 and 3
    assert a.batch_set_v1(HASHES[:2], indices) == [True, True]
    assert a.flush(10)
    a.close()
    b = make_backend(tmp_path / "kv", b_pool, interface_v1=1)
    try:
        assert b.batch_get_v1(HASHES[:3], torch.arange(0, 3 * PAGE)) == [True, True, False]
        assert torch.equal(b_pool.kv_buffer[:, :, : 2 * PAGE], a_pool.kv_buffer[:, :, 2 * PAGE : 4 * PAGE])
    finally:
        b.close()


def test_another_model_or_geometry_gets_misses_never_foreign_kv(tmp_path):
    pool = HostPool(5)
    a = make_backend(tmp_path / "kv", pool)
    assert a.batch_set(HASHES[:2], [pool.get_data_page(0), pool.get_data_page(PAGE)])
    a.close()
    other = make_backend(tmp_path / "kv", HostPool(6), model="another-model")
    wider = make_backend(tmp_path / "kv", HostPool(7, head_dim=2 * DIM))
    try:
        for backend in (other, wider):
            assert backend.batch_exists(HASHES) == 0
            out = backend.mem_pool_host.get_dummy_flat_data_page()
            assert backend.batch_get(HASHES[:1], [out]) == [None]
            assert not out.any()
    finally:
        other.close()
        wider.close()


def test_a_store_that_cannot_open_gives_misses_and_a_warning(tmp_path, caplog):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    caplog.set_level(logging.WARNING)
    pool = HostPool(8)
    backend = make_backend(not_a_dir / "kv", pool)
    try:
        assert backend.batch_exists(HASHES) == 0
        assert backend.batch_set(HASHES[:1], [pool.get_data_page(0)]) is False
        assert backend.batch_get(HASHES[:1], [pool.get_dummy_flat_data_page()]) == [None]
    finally:
        backend.close()
    assert "unavailable" in caplog.text


def test_bad_configuration(tmp_path):
    with pytest.raises(ConfigError, match="unknown gdskv connector option"):
        make_backend(tmp_path / "kv", HostPool(0), colour="red")
    cfg = storage_config(tmp_path / "kv")
    del cfg.extra_config["class_name"]
    with pytest.raises(ValueError, match="class_name"):
        StorageBackendFactory.create_backend("dynamic", cfg, HostPool(0))
    cfg = storage_config(tmp_path / "kv")
    cfg.is_mla_model = True
    with pytest.raises(ConfigError, match="MHA"):
        StorageBackendFactory.create_backend("dynamic", cfg, HostPool(0))


def test_pages_of_the_wrong_size_are_refused(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    backend = make_backend(tmp_path / "kv", HostPool(9))
    try:
        assert backend.batch_set(HASHES[:1], [torch.zeros(8, dtype=torch.bfloat16)]) is False
        assert backend.batch_exists(HASHES) == 0
        assert backend.batch_get(HASHES[:1], [torch.zeros(8, dtype=torch.bfloat16)]) == [None]
    finally:
        backend.close()
    assert "wrong size" in caplog.text
