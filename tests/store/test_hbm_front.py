"""The store with an HBM tier (gdskv/store/hbm_front.py), on a host stand-in for device memory:
device puts land in HBM, reads look there first, evictions reach DRAM and NVMe, close
drains HBM, the existing-key rules hold across tiers. The same paths on a real GPU are the
``gpu`` tests at the end."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import gdskv
from gdskv.errors import ConfigError, InvalidValueError, KeyExistsError
from gates import After
from gdskv.tiers.devpool import HostStandInPool, StandInArray, standin_array
from tests.conftest import block

KiB = 1024


@pytest.fixture
def hbm_store(make_store):
    """A store whose HBM tier is a host stand-in pool of ``hbm`` bytes (default 64 KiB)."""

    def _make(sub: str = "store", hbm: int = 64 * KiB, **options):
        return make_store(sub, hbm_pool=HostStandInPool(hbm), **options)

    return _make


def dev(seed: int, size: int) -> StandInArray:
    return standin_array(block(seed, size))


def read_dev(store, key, size) -> bytes | None:
    out = standin_array(size)
    n = store.get_into(key, out)
    return None if n is None else out[:n].tobytes()


def test_device_put_lands_in_hbm_and_reads_back_into_device_and_host(hbm_store):
    store = hbm_store()
    store.put("a", dev(1, 8 * KiB))
    stats = store.stats()
    assert stats["hbm"]["objects"] == 1 and stats["dram"]["objects"] == 0
    assert stats["hbm"]["pool"] == "host-standin" and stats["hbm"]["hit_copy"] == "copy"
    assert read_dev(store, "a", 8 * KiB) == block(1, 8 * KiB)
    host = bytearray(8 * KiB)
    assert store.get_into("a", host) == 8 * KiB and bytes(host) == block(1, 8 * KiB)
    assert store.get("a") == block(1, 8 * KiB)
    assert store.exists("a") and len(store) == 1
    assert store.stats()["hbm"]["hits"] == 3


def test_evicted_objects_reach_dram_then_nvme_and_survive_reopen(hbm_store, tmp_path):
    store = hbm_store(hbm=64 * KiB)
    for i in range(12):  # 12 x 16 KiB through a 64 KiB pool
        store.put(f"k{i}", dev(i, 16 * KiB))
    store.parts.hbm.drain()
    stats = store.stats()
    assert stats["hbm"]["objects"] <= 4
    assert stats["hbm"]["evicted_to_dram"] >= 8
    for i in range(12):
        assert read_dev(store, f"k{i}", 16 * KiB) == block(i, 16 * KiB), i
    assert store.check().ok
    store.flush()
    store.close()
    with gdskv.open(tmp_path / "store", dram="4MiB", ssd="64MiB") as again:
        for i in range(12):
            assert again.get(f"k{i}") == block(i, 16 * KiB), i


def test_close_drains_hbm_so_nothing_acknowledged_is_lost(hbm_store, tmp_path):
    store = hbm_store(hbm=64 * KiB)
    for i in range(3):
        store.put(f"k{i}", dev(i, 16 * KiB))
    assert store.stats()["dram"]["objects"] == 0
    store.close()
    with gdskv.open(tmp_path / "store", dram="4MiB", ssd="64MiB") as again:
        assert [again.get(f"k{i}") for i in range(3)] == [block(i, 16 * KiB) for i in range(3)]


def test_close_without_drain_drops_hbm_objects(hbm_store, tmp_path):
    store = hbm_store()
    store.put("volatile", dev(1, 4 * KiB))
    store.close(drain=False)
    with gdskv.open(tmp_path / "store", dram="4MiB", ssd="64MiB") as again:
        assert again.get("volatile") is None


def test_device_read_from_dram_is_promoted_into_hbm_when_it_has_room(hbm_store):
    store = hbm_store()
    store.put("h", block(5, 8 * KiB))  # a host value: DRAM
    assert store.stats()["hbm"]["objects"] == 0
    assert read_dev(store, "h", 8 * KiB) == block(5, 8 * KiB)
    stats = store.stats()
    assert stats["hbm"]["promoted"] == 1 and stats["hbm"]["objects"] == 1
    assert (stats["hbm"]["hits"], stats["hbm"]["misses"]) == (0, 1)  # HBM was asked once
    hits = stats["hbm"]["hits"]
    assert read_dev(store, "h", 8 * KiB) == block(5, 8 * KiB)
    assert store.stats()["hbm"]["hits"] == hits + 1


def test_promotion_never_evicts_and_can_be_switched_off(hbm_store):
    store = hbm_store(hbm=16 * KiB)
    store.put("resident", dev(1, 16 * KiB))  # fills HBM
    store.put("host", block(2, 8 * KiB))
    assert read_dev(store, "host", 8 * KiB) == block(2, 8 * KiB)
    stats = store.stats()
    assert stats["hbm"]["promoted"] == 0 and stats["hbm"]["evictions"] == 0
    off = hbm_store("off", hbm_promote=False)
    off.put("host", block(2, 8 * KiB))
    assert read_dev(off, "host", 8 * KiB) == block(2, 8 * KiB)
    assert off.stats()["hbm"]["objects"] == 0


def test_device_read_from_nvme_is_verified_then_copied_and_promoted(hbm_store, tmp_path):
    with gdskv.open(tmp_path / "store", dram="4MiB", ssd="64MiB") as first:
        for i in range(4):
            first.put(f"n{i}", block(i, 12 * KiB))
    store = hbm_store()  # reopens the same directory: the values are on NVMe only
    assert store.stats()["dram"]["objects"] == 0
    for i in range(4):
        assert read_dev(store, f"n{i}", 12 * KiB) == block(i, 12 * KiB)
    stats = store.stats()
    assert stats["nvme"]["hits"] == 4 and stats["hbm"]["promoted"] == 4
    assert read_dev(store, "n0", 12 * KiB) == block(0, 12 * KiB)
    assert store.stats()["nvme"]["hits"] == 4  # served from HBM now


def test_device_reads_from_nvme_stage_in_dram_slots_and_give_them_back(hbm_store, tmp_path):
    with gdskv.open(tmp_path / "store", dram="4MiB", ssd="64MiB") as first:
        for i in range(6):
            first.put(f"n{i}", block(i, 200 * KiB))
    store = hbm_store(hbm=64 * KiB, hbm_promote=False, promote_after_reads=0)
    assert store.stats()["dram"]["used_bytes"] == 0
    slots = []
    reserve = store.parts.dram.reserve_unlisted
    store.parts.dram.reserve_unlisted = lambda key, size: slots.append(key) or reserve(key, size)
    outs = [standin_array(200 * KiB) for _ in range(6)]
    assert store.batch_get_into([f"n{i}" for i in range(6)], outs) == [200 * KiB] * 6
    assert len(slots) == 6  # every value was staged in a DRAM slot
    assert [o.tobytes() for o in outs] == [block(i, 200 * KiB) for i in range(6)]
    stats = store.stats()
    assert stats["dram"]["used_bytes"] == 0 and stats["dram"]["objects"] == 0  # slots freed, none listed
    assert stats["dram"]["free_extents"] == 1


def test_device_reads_from_nvme_fall_back_to_own_memory_when_dram_is_full(hbm_store, tmp_path):
    with gdskv.open(tmp_path / "store", dram="4MiB", ssd="64MiB") as first:
        first.put("n", block(7, 300 * KiB))
    store = hbm_store(hbm=64 * KiB, dram="256KiB", hbm_promote=False, promote_after_reads=0)
    out = standin_array(300 * KiB)  # larger than the whole DRAM tier: no slot can hold it
    assert store.get_into("n", out) == 300 * KiB and out.tobytes() == block(7, 300 * KiB)
    assert store.stats()["dram"]["used_bytes"] == 0


def test_batch_get_into_mixes_tiers_and_buffer_kinds(hbm_store):
    store = hbm_store(hbm=32 * KiB)
    store.put("hbm", dev(1, 8 * KiB))
    store.put("dram", block(2, 8 * KiB))
    outs = [standin_array(8 * KiB), bytearray(8 * KiB), standin_array(8 * KiB), bytearray(8 * KiB)]
    sizes = store.batch_get_into(["hbm", "hbm", "dram", "missing"], outs)
    assert sizes == [8 * KiB, 8 * KiB, 8 * KiB, None]
    assert outs[0].tobytes() == block(1, 8 * KiB) and bytes(outs[1]) == block(1, 8 * KiB)
    assert outs[2].tobytes() == block(2, 8 * KiB)
    assert bytes(outs[3]) == bytes(8 * KiB)


def test_too_small_device_out_is_refused_before_anything_is_written(hbm_store):
    store = hbm_store()
    store.put("a", dev(1, 8 * KiB))
    store.put("b", block(2, 8 * KiB))
    small = standin_array(4 * KiB)
    small[:] = 7
    ok = standin_array(8 * KiB)
    ok[:] = 7
    with pytest.raises(InvalidValueError):
        store.batch_get_into(["a", "b"], [ok, small])
    assert (ok == 7).all() and (small == 7).all()
    with pytest.raises(InvalidValueError):
        store.get_into("b", small)


def test_existing_key_rules_hold_across_hbm_and_dram(hbm_store):
    store = hbm_store()
    store.put("host", block(1, 4 * KiB))
    store.put("host", dev(1, 4 * KiB))  # same bytes from the device: a no-op
    assert store.stats()["hbm"]["objects"] == 0
    with pytest.raises(KeyExistsError):
        store.put("host", dev(2, 4 * KiB))
    store.put("host", dev(2, 4 * KiB), overwrite=True)
    assert store.get("host") == block(2, 4 * KiB)
    assert store.stats()["dram"]["objects"] == 0  # the old DRAM copy is gone

    store.put("dev", dev(3, 4 * KiB))
    store.put("dev", block(3, 4 * KiB))  # same bytes from the host: a no-op
    with pytest.raises(KeyExistsError):
        store.put("dev", block(4, 4 * KiB))
    assert read_dev(store, "dev", 4 * KiB) == block(3, 4 * KiB)
    store.put("dev", block(4, 4 * KiB), overwrite=True)
    assert store.get("dev") == block(4, 4 * KiB)


def test_remove_forgets_hbm_objects(hbm_store):
    store = hbm_store()
    store.put("a", dev(1, 4 * KiB))
    assert store.remove("a") is True
    assert not store.exists("a") and store.get("a") is None and len(store) == 0
    assert store.remove("a") is False


def test_bad_device_values_are_refused_with_context(hbm_store):
    store = hbm_store(hbm=16 * KiB)
    with pytest.raises(gdskv.ValueTooLargeError, match="HBM tier"):
        store.put("big", dev(1, 32 * KiB))
    with pytest.raises(InvalidValueError):
        store.put("empty", standin_array(0))
    assert len(store) == 0


def test_dram_only_store_takes_hbm_evictions_as_a_cache(hbm_store):
    store = hbm_store(hbm=32 * KiB, dram="64KiB", ssd=0)
    for i in range(20):
        store.put(f"k{i}", dev(i, 16 * KiB))
    store.parts.hbm.drain()
    stats = store.stats()
    assert stats["dram"]["dropped"] > 0  # DRAM made room by dropping its coldest objects
    assert read_dev(store, "k19", 16 * KiB) == block(19, 16 * KiB)
    for i in range(20):
        got = read_dev(store, f"k{i}", 16 * KiB)
        assert got is None or got == block(i, 16 * KiB)


def test_concurrent_device_puts_and_reads_stay_consistent(hbm_store):
    store = hbm_store(hbm=64 * KiB, dram="256KiB")
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(40):
                key = f"t{t}-{i}"
                store.put(key, dev(t * 1000 + i, 8 * KiB))
                for j in range(max(0, i - 3), i + 1):
                    got = read_dev(store, f"t{t}-{j}", 8 * KiB)
                    assert got == block(t * 1000 + j, 8 * KiB), (t, j)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors[0]
    assert store.check().ok
    store.flush()
    for t in range(4):
        for i in range(40):
            assert store.get(f"t{t}-{i}") == block(t * 1000 + i, 8 * KiB)


def test_copy_written_while_the_key_cycles_through_hbm_is_kept(hbm_store, tmp_path):
    """A DRAM object being offloaded is read into a device buffer (promoted into HBM) and
    evicted from HBM again before its offload finishes: the DRAM copy published from HBM
    counts on the SSD copy just written, which must therefore stay on SSD."""
    store = hbm_store()
    write = store.parts.nvme.write = After(store.parts.nvme.write)
    store.put("k", block(1, 8 * KiB))  # eager: queued for SSD at once
    write.wait_reached()  # written to SSD; the offloader has not finished the batch yet
    assert read_dev(store, "k", 8 * KiB) == block(1, 8 * KiB)  # promoted into HBM
    store.parts.hbm.evict(store.parts.hbm.capacity)
    store.parts.hbm.drain()  # published into DRAM again: the first DRAM copy is detached
    write.open()
    store.flush()
    assert store.parts.nvme.lookup(b"k") is not None
    store.close()
    with gdskv.open(tmp_path / "store", dram="4MiB", ssd="64MiB") as again:
        assert again.get("k") == block(1, 8 * KiB)


def test_hbm_option_without_a_device_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("GDSKV_DEVICE", "cpu")
    with pytest.raises(ConfigError, match="HBM"):
        gdskv.open(tmp_path / "s", dram="4MiB", ssd="16MiB", hbm="1MiB")
    with pytest.raises(ConfigError):
        gdskv.open(tmp_path / "s", dram="4MiB", ssd="16MiB", hbm_eviction="random")
    # The failed open released the directory: a store without HBM opens there.
    gdskv.open(tmp_path / "s", dram="4MiB", ssd="16MiB").close()


def test_host_arrays_still_go_to_dram_with_an_hbm_tier(hbm_store):
    store = hbm_store()
    store.put("np", np.frombuffer(block(9, 4 * KiB), dtype=np.uint8))
    stats = store.stats()
    assert stats["dram"]["objects"] == 1 and stats["hbm"]["objects"] == 0


# --------------------------------------------------------------------------- real GPU


@pytest.mark.gpu
def test_cuda_store_put_get_evict_and_reopen(tmp_path):
    torch = pytest.importorskip("torch")
    MiB = 1 << 20
    values = [torch.randint(0, 255, (2 * MiB,), dtype=torch.uint8, device="cuda") for _ in range(6)]
    with gdskv.open(tmp_path / "s", dram="16MiB", ssd="64MiB", hbm="4MiB") as store:
        for i, v in enumerate(values):
            store.put(f"k{i}", v)
        outs = [torch.empty(2 * MiB, dtype=torch.uint8, device="cuda") for _ in range(6)]
        assert store.batch_get_into([f"k{i}" for i in range(6)], outs) == [2 * MiB] * 6
        torch.cuda.synchronize()
        assert all(torch.equal(o, v) for o, v in zip(outs, values))
        stats = store.stats()
        assert stats["hbm"]["pool"] == "cuda" and stats["hbm"]["evicted_to_dram"] >= 4
        assert stats["hbm"]["hit_copy"] in ("cudaMemcpyAsync", "Tensor.copy_")
        host = bytearray(2 * MiB)
        assert store.get_into("k0", host) == 2 * MiB and bytes(host) == bytes(values[0].cpu().numpy())
        one = torch.full((2 * MiB + 512,), 7, dtype=torch.uint8, device="cuda")
        assert store.get_into("k5", one) == 2 * MiB  # an HBM hit into a larger device buffer
        torch.cuda.synchronize()
        assert torch.equal(one[: 2 * MiB], values[5]) and bool((one[2 * MiB :] == 7).all())
    with gdskv.open(tmp_path / "s", dram="16MiB", ssd="64MiB", hbm="8MiB") as again:
        out = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
        for i, v in enumerate(values):  # NVMe -> host (verified) -> device
            assert again.get_into(f"k{i}", out) == 2 * MiB
            torch.cuda.synchronize()
            assert torch.equal(out, v), i


@pytest.mark.gpu
def test_cuda_device_overwrites_in_a_full_pool(tmp_path):
    """On the CUDA pool: a same-size overwrite in a full HBM takes the old value's room
    (nothing is evicted), and one that cannot get room leaves the old value."""
    torch = pytest.importorskip("torch")
    from gdskv.errors import NoSpaceError

    MiB = 1 << 20
    first, second, new = (torch.randint(0, 255, (2 * MiB,), dtype=torch.uint8, device="cuda") for _ in range(3))
    with gdskv.open(tmp_path / "s", dram="16MiB", ssd="64MiB", hbm="4MiB", put_timeout_s=0.2) as store:
        store.put("a", first)
        store.put("b", second)  # HBM full
        store.put("a", new, overwrite=True)
        out = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
        assert store.get_into("a", out) == 2 * MiB
        torch.cuda.synchronize()
        assert torch.equal(out, new) and store.stats()["hbm"]["evictions"] == 0
        sink = store.parts.hbm.sink  # noqa: SLF001
        real = sink.reserve
        sink.reserve = lambda key, size: None  # nothing can leave HBM now
        try:
            with pytest.raises(NoSpaceError):
                store.put("b", torch.zeros(3 * MiB, dtype=torch.uint8, device="cuda"), overwrite=True)
        finally:
            sink.reserve = real
        assert store.get_into("b", out) == 2 * MiB
        torch.cuda.synchronize()
        assert torch.equal(out, second)


@pytest.mark.parametrize("overwrite", [False, True], ids=["no overwrite", "overwrite"])
def test_a_host_put_of_a_key_waits_for_its_device_put_in_flight(hbm_store, overwrite):
    """A host put of a key whose device put is copying into HBM (outside the store's lock)
    waits for it, then finds the device value: without ``overwrite`` it is refused (a
    different value is stored), with it it replaces it. Never do the two tiers each keep
    a value of the key."""
    store = hbm_store()
    hbm = store.parts.hbm
    real_put = hbm.put
    outcome = []

    def host_put():
        try:
            store.put("k", block(2, 16 * KiB), overwrite=overwrite)
            outcome.append("stored")
        except KeyExistsError:
            outcome.append("refused")

    other = threading.Thread(target=host_put)

    def put_with_a_host_put_in_its_window(k, value, **options):
        hbm.put = real_put
        other.start()
        other.join(0.3)  # (on code that does not wait, the host put is done by now)
        return real_put(k, value, **options)

    hbm.put = put_with_a_host_put_in_its_window
    store.put("k", dev(3, 20 * KiB))
    other.join(10)
    assert outcome == ["stored" if overwrite else "refused"]
    in_hbm = hbm.size_of_key(b"k") is not None
    in_dram = store.parts.dram.lookup(b"k") is not None
    assert in_hbm != in_dram, (in_hbm, in_dram)  # one tier holds the key
    assert store.get("k") == (block(2, 16 * KiB) if overwrite else block(3, 20 * KiB))
    assert read_dev(store, "k", 20 * KiB) == (block(2, 16 * KiB) if overwrite else block(3, 20 * KiB))


def test_a_remove_of_a_key_waits_for_its_device_put_in_flight(hbm_store):
    """A remove while the key's device put copies into HBM waits for it and removes what it
    stored: the key is gone afterwards, not brought back by the put landing later."""
    store = hbm_store()
    hbm = store.parts.hbm
    real_put = hbm.put
    removed = []
    other = threading.Thread(target=lambda: removed.append(store.remove("k")))

    def put_with_a_remove_in_its_window(k, value, **options):
        hbm.put = real_put
        other.start()
        other.join(0.3)
        return real_put(k, value, **options)

    hbm.put = put_with_a_remove_in_its_window
    store.put("k", dev(4, 8 * KiB))
    other.join(10)
    assert removed == [True]
    assert not store.exists("k") and store.get("k") is None and hbm.size_of_key(b"k") is None


def test_a_listener_calling_the_store_on_the_key_being_put_fails_instead_of_hanging(hbm_store):
    """Listeners must not call the store. One that does, on the key whose device put runs
    it (an eviction the put made published a victim into DRAM: ``on_stored``), gets an
    error (logged and ignored like any listener's) instead of waiting for itself."""
    from gdskv.store import StoreListener

    store = hbm_store(hbm=64 * KiB)
    for i in range(4):
        store.put(f"d{i}", dev(i, 16 * KiB))  # full: the next put evicts
    errors = []

    class RemovesTheKey(StoreListener):
        def on_stored(self, tier, items):
            if threading.current_thread().name == "device-put":
                try:
                    store.remove("k")
                except gdskv.GdskvError as exc:
                    errors.append(exc)

    store.add_listener(RemovesTheKey())
    putter = threading.Thread(target=lambda: store.put("k", dev(9, 16 * KiB)), name="device-put", daemon=True)
    putter.start()
    putter.join(10)
    assert not putter.is_alive() and len(errors) == 1 and "listener must not call the store" in str(errors[0])
    assert read_dev(store, "k", 16 * KiB) == block(9, 16 * KiB)


@pytest.mark.parametrize("meanwhile", ["remove then device put", "host overwrite, same size", "device overwrite"])
def test_a_promotion_never_replaces_or_outlives_a_newer_value(hbm_store, meanwhile):
    """A device read of a DRAM value promotes a copy into HBM. When the key is written
    while that promotion is on its way, the newer value is what the store serves (the
    promotion neither replaces it nor, being dropped, takes it with it)."""
    store = hbm_store()
    store.put("k", block(1, 16 * KiB))  # a host value: in DRAM
    hbm = store.parts.hbm
    real_put = hbm.put
    at, go = threading.Event(), threading.Event()

    def held_promotion(k, value, **options):
        if options.get("evict", True) is False:  # the promotion of the read
            at.set()
            go.wait(10)
        return real_put(k, value, **options)

    hbm.put = held_promotion
    out = standin_array(16 * KiB)
    reader = threading.Thread(target=lambda: store.get_into("k", out))
    reader.start()
    assert at.wait(10)
    newer = block(2, 16 * KiB)
    if meanwhile == "remove then device put":
        store.remove("k")
        store.put("k", dev(2, 16 * KiB))
    elif meanwhile == "host overwrite, same size":
        store.put("k", newer, overwrite=True)
    else:
        store.put("k", dev(2, 16 * KiB), overwrite=True)
    go.set()
    reader.join(10)
    assert out.tobytes() == block(1, 16 * KiB)  # the read got the value it started with
    hbm.put = real_put
    assert store.get("k") == newer and read_dev(store, "k", 16 * KiB) == newer


@pytest.mark.parametrize("meanwhile", ["remove then device put", "device overwrite"])
def test_a_promotion_registered_before_a_newer_value_never_takes_it_away(hbm_store, meanwhile):
    """A promotion registered in HBM, then the key removed and device-put again (or device
    overwritten) before the promotion's caller goes on: the new value stays."""
    store = hbm_store()
    store.put("k", block(1, 16 * KiB))  # host value: DRAM
    hbm = store.parts.hbm
    real_put = hbm.put
    at, go = threading.Event(), threading.Event()

    def promotion_registered_then_slow(k, value, **options):
        stored = real_put(k, value, **options)
        if options.get("evict", True) is False:  # the promotion: registered, check not yet run
            at.set()
            go.wait(10)
        return stored

    hbm.put = promotion_registered_then_slow
    out = standin_array(16 * KiB)
    reader = threading.Thread(target=lambda: store.get_into("k", out))
    reader.start()
    assert at.wait(10)
    if meanwhile == "remove then device put":
        assert store.remove("k")
        store.put("k", dev(2, 16 * KiB))
    else:
        store.put("k", dev(2, 16 * KiB), overwrite=True)
    assert read_dev(store, "k", 16 * KiB) == block(2, 16 * KiB)  # acknowledged, readable
    go.set()
    reader.join(10)
    hbm.put = real_put
    assert store.get("k") == block(2, 16 * KiB)  # the acknowledged device put survives


def test_a_promotion_is_not_registered_after_an_overwrite_returned(hbm_store):
    """The promotion's copy is reserved, the key is overwritten (a host put, which returns),
    then the promotion would register: it is dropped then, and reads get the new value."""
    store = hbm_store()
    store.put("k", block(1, 16 * KiB))
    hbm = store.parts.hbm
    real_put, real_write = hbm.put, hbm.pool.write
    in_write, go_write, registered, go_check = (threading.Event() for _ in range(4))

    def slow_write(offset, value):
        if threading.current_thread().name == "reader":
            in_write.set()
            go_write.wait(10)
        return real_write(offset, value)

    def put(k, value, **options):
        stored = real_put(k, value, **options)
        if options.get("evict", True) is False and threading.current_thread().name == "reader":
            registered.set()
            go_check.wait(10)
        return stored

    hbm.pool.write, hbm.put = slow_write, put
    out = standin_array(16 * KiB)
    reader = threading.Thread(target=lambda: store.get_into("k", out), name="reader")
    reader.start()
    assert in_write.wait(10)
    store.put("k", block(2, 16 * KiB), overwrite=True)  # acknowledged
    go_write.set()
    assert registered.wait(10)
    seen = read_dev(store, "k", 16 * KiB)
    go_check.set()
    reader.join(10)
    hbm.pool.write, hbm.put = real_write, real_put
    assert seen == block(2, 16 * KiB)


def test_a_put_waiting_for_the_same_bytes_then_finds_a_device_put_in_flight(hbm_store):
    """Put H1 copies V into DRAM; put H2 of the same V waits for it; meanwhile a device put
    D overwrites the key (H1's copy is dropped) and copies into HBM. H2 must wait for D and
    then find D's value (a different one: KeyExistsError), not store V beside it."""
    store = hbm_store()
    V, W = block(1, 16 * KiB), block(2, 16 * KiB)
    real_write = store.parts.dram.write
    h1_in_write, release_h1 = threading.Event(), threading.Event()

    def held_first_write(entry, view):
        if not h1_in_write.is_set():
            h1_in_write.set()
            release_h1.wait(10)
        return real_write(entry, view)

    store.parts.dram.write = held_first_write
    hbm = store.parts.hbm
    real_put = hbm.put
    d_in_put, release_d = threading.Event(), threading.Event()

    def held_device_put(k, value, **options):
        if options.get("evict", True):
            d_in_put.set()
            release_d.wait(10)
        return real_put(k, value, **options)

    hbm.put = held_device_put
    outcomes = {}

    def put(name, value, **options):
        try:
            store.put("k", value, **options)
            outcomes[name] = "stored"
        except KeyExistsError:
            outcomes[name] = "refused"

    h1 = threading.Thread(target=put, args=("h1", V))
    h1.start()
    assert h1_in_write.wait(10)
    h2 = threading.Thread(target=put, args=("h2", V))
    h2.start()
    deadline = time.monotonic() + 10
    while store.parts.activity.copy_waiters == 0 and time.monotonic() < deadline:  # H2 waits for H1's bytes
        time.sleep(0.001)
    d = threading.Thread(target=put, args=("d", dev(2, 16 * KiB)), kwargs={"overwrite": True})
    d.start()
    assert d_in_put.wait(10)
    h2.join(0.5)  # (on code that does not wait for D, H2 has stored V by now)
    release_d.set()
    d.join(10)
    release_h1.set()
    h1.join(10)
    h2.join(10)
    assert outcomes["d"] == "stored" and outcomes["h2"] == "refused", outcomes
    in_hbm, in_dram = hbm.size_of_key(b"k") is not None, store.parts.dram.readable(b"k") is not None
    assert in_hbm and not in_dram
    assert store.get("k") == W


def test_comparing_a_put_with_an_hbm_value_is_not_a_read_of_it(hbm_store):
    """An idempotent put of an HBM object's bytes copies the object out to compare CRCs: that
    copy counts no hit and leaves the object's place in the LRU order, so the next eviction
    still takes it first (before the fix it counted a hit and made it the newest)."""
    store = hbm_store(hbm=32 * KiB)
    store.put("old", dev(1, 16 * KiB))
    store.put("new", dev(2, 16 * KiB))
    store.put("old", block(1, 16 * KiB))  # the same bytes: a no-op, after a CRC of the HBM copy
    hbm = store.stats()["hbm"]
    assert (hbm["hits"], hbm["misses"]) == (0, 0)
    store.put("third", dev(3, 16 * KiB))  # evicts the least recently used object
    evicted = {key for key, tier, _, _ in store.inventory() if tier is gdskv.Tier.DRAM}
    assert evicted == {b"old"}
    assert store.get("old") == block(1, 16 * KiB)


@pytest.mark.parametrize("old_in", ["hbm", "dram"])
def test_a_device_overwrite_that_finds_no_room_leaves_the_old_value(hbm_store, old_in, monkeypatch):
    """A device put with overwrite=True that cannot get room in HBM (nothing can be evicted:
    the DRAM sink refuses) raises NoSpaceError and leaves the key's old value where it was,
    as a host put does. Before, the old copies went first and the key was lost."""
    from gdskv.errors import NoSpaceError

    store = hbm_store(hbm=16 * KiB, put_timeout_s=0.1)
    old = dev(1, 8 * KiB) if old_in == "hbm" else block(1, 8 * KiB)
    store.put("k", old)
    store.put("other", dev(2, 8 * KiB))
    if old_in == "dram":
        store.put("third", dev(3, 8 * KiB))  # HBM full: "other" and "third"
    sink = store.parts.hbm.sink  # noqa: SLF001
    monkeypatch.setattr(sink, "reserve", lambda key, size: None)  # the sink refuses: nothing can leave HBM
    with pytest.raises(NoSpaceError):
        store.put("k", dev(9, 12 * KiB), overwrite=True)
    assert store.get("k") == block(1, 8 * KiB)
    if old_in == "hbm":
        assert read_dev(store, "k", 8 * KiB) == block(1, 8 * KiB)
    monkeypatch.undo()  # (close drains HBM into DRAM)
    store.put("k", dev(9, 12 * KiB), overwrite=True)
    assert store.get("k") == block(9, 12 * KiB)


def test_a_device_overwrite_evicts_neither_its_old_value_nor_another_object(hbm_store):
    """HBM is full; a same-size overwrite of "k" takes the old value's room: nothing is
    copied down to DRAM (no listener hears of the old value being stored), "other" stays,
    and the replaced value counts as a remove, as with a host overwrite."""
    from gdskv.store import StoreListener

    store = hbm_store(hbm=16 * KiB)
    store.put("other", dev(2, 8 * KiB))
    store.put("k", dev(1, 8 * KiB))
    heard = []

    class Heard(StoreListener):
        def on_stored(self, tier, items):
            heard.extend((tier, key) for key, _, _ in items)

    store.add_listener(Heard())
    store.put("k", dev(9, 8 * KiB), overwrite=True)
    assert read_dev(store, "k", 8 * KiB) == block(9, 8 * KiB)
    assert read_dev(store, "other", 8 * KiB) == block(2, 8 * KiB)
    assert heard == [] and store.stats()["hbm"]["evictions"] == 0
    assert store.stats()["removes"] == 1
