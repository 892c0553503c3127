"""``gdskv demo``: the main job on the embedded store (placeholder wiring; see add_parser)."""

from __future__ import annotations

import argparse


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("demo", help="write and verify a few GB of KV blocks through the tiers")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("gdskv demo: not implemented yet")
