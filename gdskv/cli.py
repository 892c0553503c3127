"""The ``gdskv`` command. Each subcommand lives in the module that owns its concept and
registers itself through an ``add_parser(subparsers)`` function; this file only wires them.

Nothing imports this module.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional

from gdskv.errors import GdskvError


def build_parser() -> argparse.ArgumentParser:
    from gdskv import demo, status
    from gdskv.engine import ttft
    from gdskv.trace import command as trace_command

    parser = argparse.ArgumentParser(prog="gdskv", description="Tiered KV-cache store for LLM serving.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(sub)
    status.add_parser(sub)
    trace_command.add_parser(sub)
    ttft.add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except GdskvError as exc:
        print(f"gdskv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
