"""The ``gdskv`` command. Each subcommand lives in the module that owns its concept and
registers itself through an ``add_parser(subparsers)`` function; this file only wires them.

Nothing imports this module.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional

from gdskv.config import BACKENDS, IO_ENGINES, check_choice
from gdskv.errors import GdskvError

#: Options every subcommand's store honours, and the environment variable each one sets
#: (read by gdskv.config.env_overrides when the store is opened).
STORE_OPTIONS = {"backend": "GDSKV_BACKEND", "io_engine": "GDSKV_IO_ENGINE"}


def build_parser() -> argparse.ArgumentParser:
    from gdskv import demo, status
    from gdskv.trace import command as trace_command
    from gdskv.ttft import command as ttft_command

    parser = argparse.ArgumentParser(prog="gdskv", description="Tiered KV-cache store for LLM serving.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--backend", help=f"NVMe layout: {', '.join(BACKENDS)} (env GDSKV_BACKEND)")
    parser.add_argument("--io-engine", dest="io_engine", help=f"I/O engine: {', '.join(IO_ENGINES)} (env GDSKV_IO_ENGINE)")
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(sub)
    status.add_parser(sub)
    trace_command.add_parser(sub)
    ttft_command.add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        apply_store_options(args)
        return int(args.func(args) or 0)
    except GdskvError as exc:
        print(f"gdskv: error: {exc}", file=sys.stderr)
        return 2


def apply_store_options(args: argparse.Namespace) -> None:
    """Validate ``--backend``/``--io-engine`` and pass them to every store the command opens."""
    choices = {"backend": ("backend", BACKENDS), "io_engine": ("io engine", IO_ENGINES)}
    for field, var in STORE_OPTIONS.items():
        value = getattr(args, field, None)
        if value is not None:
            check_choice(choices[field][0], value, choices[field][1])
            os.environ[var] = value


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
