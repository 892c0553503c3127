"""GPU measurements for benchmarks/gpu_check.sh, one stage per call.

Each stage prints ``ROW|name|measured|baseline|ratio|note`` lines (GB/s; the baseline is
what the same machine does in the same run) that gpu_check.sh gathers into its table:

- ``copy``: HBM tier host<->device copies against a plain torch copy of the same bytes
  between the same pinned host buffer and device memory; HBM hits of 2 MiB blocks, through
  the tier and through the Store API (one by one and batched), against device-to-device
  copies (target >= 0.8x).
- ``nvme``: NVMe -> GPU through the kvikio engine and through the staging path (uring or
  psync, O_DIRECT), each against fio reading the same file (O_DIRECT, 4 MiB blocks), or a
  plain O_DIRECT read where fio is missing (target >= 0.9x); cold 2 MiB reads through the
  Store into device buffers; and GDS vs compat mode.

Usage: python benchmarks/bench_gpu.py copy|nvme [--dir DIR] [--gib N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GB = 1e9
MiB = 1 << 20


def row(name, measured, baseline, note=""):
    ratio = f"{measured / baseline:.2f}x" if measured and baseline else "-"
    m = f"{measured:.2f}" if measured else "-"
    b = f"{baseline:.2f}" if baseline else "-"
    print(f"ROW|{name}|{m}|{b}|{ratio}|{note}", flush=True)


def best_of(fn, repeat=5):
    """Best wall time of ``fn()`` (which synchronises before returning)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# --------------------------------------------------------------------------- copy


def stage_copy(args):
    import torch

    from gdskv.tiers.devpool import TorchCudaPool
    from gdskv.tiers.hbm import HbmTier, HostSink

    size = 1 << 30
    host = torch.empty(size, dtype=torch.uint8).pin_memory()
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    sync = torch.cuda.synchronize

    def plain_h2d():
        dev.copy_(host, non_blocking=True); sync()

    def plain_d2h():
        host.copy_(dev, non_blocking=True); sync()

    pool = TorchCudaPool(size)
    host_view = memoryview(host.numpy())

    def pool_h2d():
        pool.write(0, host); sync()

    def pool_d2h():
        pool.to_host_async(0, size, host_view).wait()

    for name, ours, plain in (("H2D pinned (HBM pool write)", pool_h2d, plain_h2d),
                              ("D2H pinned (HBM eviction copy)", pool_d2h, plain_d2h)):
        ours(); plain()
        row(name, size / best_of(ours) / GB, size / best_of(plain) / GB, "vs plain torch copy_")
    pool.close()
    dev = None  # free the 1 GiB before the next part

    class Sink(HostSink):
        def reserve(self, key, n):
            return None

        def complete(self, key, buf, ok):
            pass

    block = 2 * MiB
    tier = HbmTier(TorchCudaPool(256 * MiB), Sink())
    values = [torch.randint(0, 255, (block,), dtype=torch.uint8, device="cuda") for _ in range(64)]
    for i, v in enumerate(values):
        tier.put(b"k%d" % i, v)
    out = torch.empty(block, dtype=torch.uint8, device="cuda")

    def hits():
        for i in range(64):
            tier.get_into(b"k%d" % i, out)
        sync()

    def d2d():
        for i in range(64):
            out.copy_(values[i])
        sync()

    hits(); d2d()
    row("HBM hit 2 MiB (tier get_into)", 64 * block / best_of(hits) / GB, 64 * block / best_of(d2d) / GB,
        "vs device-to-device copy_ per block; target >= 0.8x")
    tier.close()
    store_hits(values, block)


def store_hits(values, block):
    """HBM hits through the public Store API, 64 blocks of 2 MiB into 64 device buffers:
    one get_into per block, and one batch_get_into (one batched device copy), against the
    same 64 copies done with plain ``copy_`` calls and against one copy of all their bytes."""
    import tempfile

    import torch

    import gdskv

    sync = torch.cuda.synchronize
    n = len(values)
    keys = [f"k{i}" for i in range(n)]
    outs = [torch.empty(block, dtype=torch.uint8, device="cuda") for _ in range(n)]
    big_src = torch.cat(values)
    big_dst = torch.empty_like(big_src)
    with tempfile.TemporaryDirectory() as tmp, gdskv.open(tmp, dram="256MiB", ssd=0, hbm="256MiB") as store:
        for k, v in zip(keys, values):
            store.put(k, v)

        def one_by_one():
            for k, o in zip(keys, outs):
                store.get_into(k, o)
            sync()

        def batch():
            store.batch_get_into(keys, outs)
            sync()

        def plain_each():
            for v, o in zip(values, outs):
                o.copy_(v)
            sync()

        def plain_one():
            big_dst.copy_(big_src)
            sync()

        for fn in (one_by_one, batch, plain_each, plain_one):
            fn()
        ok = True
        for fn in (one_by_one, batch):  # both paths deliver the right bytes
            for o in outs:
                o.fill_(0x5A)
            fn()
            ok = ok and all(torch.equal(o, v) for o, v in zip(outs, values))
        print("single hits copy with:", store.stats()["hbm"]["hit_copy"], flush=True)
        total = n * block
        each = total / best_of(plain_each, 20) / GB
        one = total / best_of(plain_one, 20) / GB
        get = total / best_of(one_by_one, 20) / GB
        got = total / best_of(batch, 20) / GB
        check = "bytes equal" if ok else "BYTES DIFFER"
        row("HBM hit 2 MiB (Store.get_into)", get, each, f"vs copy_ per block; {check}; target >= 0.8x")
        row("HBM hit 2 MiB x64 (Store.batch_get_into)", got, each, f"vs copy_ per block; {check}; target >= 0.8x")
        row("HBM hit 2 MiB x64 (Store.batch_get_into)", got, one, "vs one 128 MiB copy_ (the device's bandwidth)")
        print("store hbm stats:", json.dumps(store.stats()["hbm"]), flush=True)


# --------------------------------------------------------------------------- nvme


def make_file(path, nbytes):
    import numpy as np

    if os.path.exists(path) and os.path.getsize(path) == nbytes:
        return
    chunk = np.random.default_rng(1).integers(0, 256, 64 * MiB, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fio_read(path, nbytes, repeat=3):
    """fio's sequential O_DIRECT read of the file (4 MiB blocks, queue depth 16): the best of
    ``repeat`` runs, as for the gdskv paths. io_uring first, libaio where fio lacks it."""
    if shutil.which("fio") is None:
        return None, "fio missing"
    errors = []
    for engine in ("io_uring", "libaio"):
        cmd = ["fio", "--name=r", f"--filename={path}", "--rw=read", "--bs=4M", "--direct=1", f"--ioengine={engine}",
               "--iodepth=16", "--numjobs=1", f"--size={nbytes}", "--output-format=json"]
        best = 0.0
        for _ in range(repeat):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                errors.append(f"{engine}: {done.stderr.strip()[:60]}")
                break
            best = max(best, json.loads(done.stdout)["jobs"][0]["read"]["bw_bytes"] / GB)
        if best:
            return best, f"fio O_DIRECT 4M qd16 {engine}"
    return None, "fio failed: " + "; ".join(errors)


def odirect_read(path, nbytes):
    """Plain O_DIRECT read of the file through the psync engine into aligned host memory."""
    from gdskv.gds.aligned import alloc_aligned
    from gdskv.gds.engine import IoRequest
    from gdskv.gds.psync import PsyncEngine

    chunk = 4 * MiB
    with PsyncEngine(threads=16, direct=True) as engine:
        fd = engine.open_file(path, os.O_RDONLY)
        bufs = [alloc_aligned(chunk) for _ in range(16)]
        drop_cache(path)
        t0 = time.perf_counter()
        pos = 0
        while pos < nbytes:
            reqs = []
            for b in bufs:
                if pos >= nbytes:
                    break
                reqs.append(IoRequest.read(fd, pos, b.view[: min(chunk, nbytes - pos)], path=path))
                pos += chunk
            engine.run(reqs)
        elapsed = time.perf_counter() - t0
        os.close(fd)
        for b in bufs:
            b.close()
    return nbytes / elapsed / GB


def kvikio_read(path, nbytes):
    import torch

    from gdskv.gds.engine import IoRequest
    from gdskv.gds.kvikio_engine import KvikioEngine

    chunk = 64 * MiB
    # 16 threads running 4 MiB tasks: as many reads in flight as fio's queue depth 16 x 4 MiB.
    engine = KvikioEngine(threads=16, task_size=4 * MiB)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")  # the whole file: one batch
    try:
        engine.register(dst)
    except Exception as exc:  # noqa: BLE001 - unregistered buffers still work, more slowly
        print(f"cuFile buffer registration failed: {exc}", flush=True)
    fd = engine.open_file(path, os.O_RDONLY)
    reqs = [IoRequest.read(fd, pos, dst[pos : pos + min(chunk, nbytes - pos)], path=path)
            for pos in range(0, nbytes, chunk)]

    def once():
        drop_cache(path)
        t0 = time.perf_counter()
        engine.run(reqs)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    once()
    best = min(once() for _ in range(3))
    mode, why = engine.mode, engine.mode_reason
    os.close(fd)
    engine.close()
    return nbytes / best / GB, mode, why


def staging_read(path, nbytes):
    import torch

    from gdskv.gds.staging import StagedRead, StagingReader, TorchCopier
    from gdskv.io_config import AutoConfig

    engine = AutoConfig(direct=True, depth=64, threads=8).build(os.path.dirname(path))
    # 16 slots of 4 MiB: as many bytes in flight as the plain O_DIRECT read (16 x 4 MiB).
    reader = StagingReader(engine, TorchCopier(), slot_bytes=4 * MiB, slots=16)
    span = 256 * MiB
    dst = torch.empty(span, dtype=torch.uint8, device="cuda")
    fd = engine.open_file(path, os.O_RDONLY)

    # The whole file in one call, so the pipeline stays full from the first block to the
    # last; each 256 MiB span lands in the same device buffer.
    items = [StagedRead(fd, pos, min(span, nbytes - pos), dst, path=path) for pos in range(0, nbytes, span)]

    def once():
        drop_cache(path)
        t0 = time.perf_counter()
        reader.read_into(items)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    once()
    best = min(once() for _ in range(3))
    name = engine.describe()["name"]
    os.close(fd)
    reader.close()
    engine.close()
    return nbytes / best / GB, name


def store_nvme_read(directory, nbytes):
    """Cold reads of 2 MiB blocks through the Store into device buffers: NVMe -> host (read
    and CRC-verified) -> device. The store is written, closed and reopened first, so every
    block comes from NVMe (O_DIRECT)."""
    import torch

    import gdskv

    block, batch = 2 * MiB, 32
    count = max(batch, min(nbytes, 1 << 30) // block // batch * batch)
    path = os.path.join(directory, "store")
    shutil.rmtree(path, ignore_errors=True)
    data = torch.randint(0, 255, (batch * block,), dtype=torch.uint8).numpy()
    with gdskv.open(path, dram="256MiB", ssd=count * block * 2) as store:
        for i in range(count):
            j = i % batch
            store.put(f"b{i}", data[j * block : (j + 1) * block])
        store.flush()
    outs = [torch.empty(block, dtype=torch.uint8, device="cuda") for _ in range(batch)]
    with gdskv.open(path, dram="256MiB", ssd=count * block * 2, hbm="64MiB", hbm_promote=False) as store:
        t0 = time.perf_counter()
        for start in range(0, count, batch):
            sizes = store.batch_get_into([f"b{i}" for i in range(start, start + batch)], outs)
            assert all(n == block for n in sizes), sizes
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        engine = store.stats()["io_engine"]["name"]
    ok = all(torch.equal(out.cpu(), torch.from_numpy(data[j * block : (j + 1) * block])) for j, out in enumerate(outs))
    shutil.rmtree(path, ignore_errors=True)
    return count * block / elapsed / GB, f"{count} x 2 MiB cold, engine={engine}, the last batch's bytes {'equal' if ok else 'DIFFER'} on host"


def stage_nvme(args):
    from gdskv.gds.probe import fs_type

    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "gpu_check.data")
    nbytes = int(args.gib * (1 << 30))
    make_file(path, nbytes)
    print(f"file {path} ({args.gib} GiB) on {fs_type(args.dir)}", flush=True)
    base, base_note = fio_read(path, nbytes)
    plain = odirect_read(path, nbytes)
    row("NVMe->host plain O_DIRECT read", plain, base, f"psync 16 x 4 MiB; vs {base_note}")
    if base is None:
        base, base_note = plain, f"{base_note}; plain O_DIRECT read"
    else:
        print(f"ROW|NVMe->host fio read (baseline)|{base:.2f}|-|-|{base_note}, {args.gib} GiB on {fs_type(args.dir)}", flush=True)
    print(f"baseline: {base:.2f} GB/s ({base_note})", flush=True)
    try:
        gbs, mode, why = kvikio_read(path, nbytes)
        row("NVMe->GPU kvikio", gbs, base, f"mode={mode}; vs {base_note}; target >= 0.9x")
        print(f"kvikio mode: {mode} ({why})", flush=True)
        print(f"ROW|GDS or compat|{mode}|-|-|{why}", flush=True)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        print(f"ROW|NVMe->GPU kvikio|FAILED|-|-|{type(exc).__name__}: {str(exc)[:100]}", flush=True)
    try:
        gbs, note = store_nvme_read(args.dir, nbytes)
        row("NVMe->GPU Store.batch_get_into", gbs, base, f"{note}; vs {base_note}")
    except Exception as exc:  # noqa: BLE001 - reported in the table
        print(f"ROW|NVMe->GPU Store.batch_get_into|FAILED|-|-|{type(exc).__name__}: {str(exc)[:100]}", flush=True)
    try:
        gbs, name = staging_read(path, nbytes)
        row("NVMe->GPU staging", gbs, base, f"engine={name}, O_DIRECT; vs {base_note}; target >= 0.9x")
    except Exception as exc:  # noqa: BLE001 - reported in the table
        print(f"ROW|NVMe->GPU staging|FAILED|-|-|{type(exc).__name__}: {str(exc)[:100]}", flush=True)
    if not args.keep:
        os.unlink(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("copy", "nvme"))
    parser.add_argument("--dir", default=os.environ.get("GDSKV_GPU_DIR", "bench-out/gpu"))
    parser.add_argument("--gib", type=float, default=float(os.environ.get("GDSKV_GPU_GIB", "4")))
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    {"copy": stage_copy, "nvme": stage_nvme}[args.stage](args)


if __name__ == "__main__":
    main()
