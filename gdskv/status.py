"""``gdskv status PATH`` and ``gdskv check PATH``: look inside a store directory.

Both open the store (taking its lock, so not while a daemon has it open), print what they
found and close it without writing DRAM contents anywhere (there are none: a freshly opened
store holds everything on NVMe).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import gdskv
from gdskv.config import format_size
from gdskv.storedir import stored_backend
from gdskv.tiers.backends import BACKENDS


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    for name, func, text in (
        ("status", run_status, "show what a store directory holds and what recovery found"),
        ("check", run_check, "verify every object's checksum; drop and list corrupt ones"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("path", help="store directory")
        p.add_argument("--ssd", default=None, help="NVMe byte cap to open with (default: the capacity an offset store was made with, "
                                                   "else the config default)")
        p.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH ('-' for stdout)")
        p.set_defaults(func=func)


def _open(args: argparse.Namespace) -> gdskv.Store:
    """The store at ``args.path``, opened with the backend it was created with (unless
    ``--backend`` says otherwise) and, without ``--ssd``, the capacity it was made with where
    its backend records one (``offset``): looking at a store never resizes its files."""
    backend = os.environ.get("GDSKV_BACKEND") or stored_backend(Path(args.path))
    ssd = args.ssd
    if ssd is None and backend in BACKENDS:
        ssd = BACKENDS[backend].stored_capacity(Path(args.path))
    return gdskv.open(args.path, dram="1MiB", ssd=ssd, **({"backend": backend} if backend else {}))


def _emit_json(args: argparse.Namespace, payload: dict) -> None:
    if not args.json:
        return
    text = json.dumps(payload, indent=2, default=str)
    if args.json == "-":
        print(text)
    else:
        with open(args.json, "w") as f:
            f.write(text + "\n")


def run_status(args: argparse.Namespace) -> int:
    with _open(args) as store:
        stats = store.stats()
    nvme = stats.get("nvme", {})
    rec = stats.get("recovery", {})
    print(f"store      {args.path}")
    print(f"objects    {nvme.get('objects', 0)} in {nvme.get('buckets', 0)} buckets ({nvme.get('backend', '-')})")
    print(f"nvme used  {format_size(nvme.get('used_bytes', 0))} of {format_size(nvme.get('capacity', 0))}")
    print(f"recovery   dropped {rec.get('dropped_torn', 0)} torn, {rec.get('dropped_corrupt', 0)} corrupt")
    _emit_json(args, stats)
    return 0


def run_check(args: argparse.Namespace) -> int:
    with _open(args) as store:
        report = store.check()
    print(f"checked {report.nvme_objects} objects on NVMe: {len(report.corrupt_keys)} corrupt (dropped)")
    for key in report.corrupt_keys:
        print(f"  corrupt: {key!r}")
    _emit_json(args, {"nvme_objects": report.nvme_objects, "corrupt_keys": [k.hex() for k in report.corrupt_keys]})
    return 0 if report.ok else 1
