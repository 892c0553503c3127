"""``gdskv trace replay|sweep|reuse``: the command-line face of the trace tools.

:func:`add_parser` registers the ``trace`` command (called by :mod:`gdskv.cli`). Every
subcommand prints a table, takes ``--json PATH`` (``-`` for stdout instead of the table),
and reports malformed lines it skipped (``--skip-bad``) on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gdskv.config import StoreConfig, format_size, parse_size
from gdskv.errors import ConfigError, IoError
from gdskv.trace.model import Trace
from gdskv.trace.readers import FORMATS, read_trace

#: KV bytes per token of a Llama-3-8B-class model (32 layers x 8 KV heads x 128 x 2 x fp16).
DEFAULT_KV_BYTES_PER_TOKEN = 131072


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    trace = sub.add_parser(
        "trace", help="replay a KV-cache block trace: hit rates, capacity sweeps, reuse gaps"
    )
    tsub = trace.add_subparsers(dest="trace_command", required=True)

    p = tsub.add_parser("replay", help="hit rate per tier for one DRAM/SSD configuration")
    _trace_args(p)
    _tier_args(p)
    p.add_argument("--dram", default="64GiB", help="DRAM capacity (default 64GiB)")
    p.add_argument("--ssd", default="2TiB", help="SSD capacity, 0 for none (default 2TiB)")
    p.set_defaults(func=run_replay)

    p = tsub.add_parser("sweep", help="hit rate against DRAM size, with and without SSD; table, JSON, PNG")
    _trace_args(p)
    _tier_args(p)
    p.add_argument("--dram", default="8GiB..512GiB", help="DRAM sizes: list and/or doubling range (default 8GiB..512GiB)")
    p.add_argument("--ssd", default="0,1TiB,4TiB", help="SSD sizes, 0 for none (default 0,1TiB,4TiB)")
    p.add_argument("--plot", metavar="PNG", help="write the hit-rate curves to this PNG (needs matplotlib)")
    p.add_argument("--target", type=float, help="also report the smallest DRAM reaching this hit rate")
    p.add_argument("--jobs", type=int, default=1, help="replay points in this many processes (default 1)")
    p.set_defaults(func=run_sweep)

    p = tsub.add_parser("reuse", help="distribution of reuse gaps (time since a block's last use)")
    _trace_args(p)
    p.add_argument("--plot", metavar="PNG", help="write a histogram of the gaps to this PNG (needs matplotlib)")
    p.set_defaults(func=run_reuse)


def _trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE", help="trace file (JSON lines, optionally .gz)")
    p.add_argument("--format", default="auto", choices=FORMATS, help="trace format (default: detect)")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed lines (counted) instead of failing")
    p.add_argument("--limit", type=int, help="read only the first N requests")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-': stdout, no table)")


def _tier_args(p: argparse.ArgumentParser) -> None:
    d = StoreConfig()
    p.add_argument("--kv-bytes-per-token", default=str(DEFAULT_KV_BYTES_PER_TOKEN),
                   help=f"KV bytes per token, e.g. 131072 or 128KiB (default {DEFAULT_KV_BYTES_PER_TOKEN})")
    p.add_argument("--block-tokens", type=int, help="tokens per block (default: the trace format's)")
    p.add_argument("--policy", default=d.eviction, help=f"DRAM eviction policy (default {d.eviction})")
    p.add_argument("--ssd-policy", default=d.ssd_eviction, help=f"SSD bucket eviction policy (default {d.ssd_eviction})")
    p.add_argument("--offload", default=d.offload, help=f"offload policy: eager or watermark (default {d.offload})")
    p.add_argument("--promotion", default=str(d.promote_after_reads),
                   help=f"promote an SSD block to DRAM after N reads; 0 or off: never (default {d.promote_after_reads})")
    p.add_argument("--high-watermark", type=float, default=d.high_watermark, help=f"default {d.high_watermark}")
    p.add_argument("--low-watermark", type=float, default=d.low_watermark, help=f"default {d.low_watermark}")
    p.add_argument("--bucket-bytes", default=str(d.bucket_bytes), help=f"bucket size (default {format_size(d.bucket_bytes)})")
    p.add_argument("--bucket-max-keys", type=int, default=d.bucket_max_keys, help=f"default {d.bucket_max_keys}")


# ---------------------------------------------------------------------- helpers


def _load(args: argparse.Namespace) -> Trace:
    if args.limit is not None and args.limit <= 0:
        raise ConfigError("--limit must be positive", got=args.limit)
    trace = read_trace(args.trace, format=args.format, skip_bad=args.skip_bad, limit=args.limit)
    if trace.skipped:
        first = "; ".join(f"line {n}: {why}" for n, why in trace.skipped_lines[:3])
        print(f"gdskv trace: skipped {trace.skipped} malformed lines ({first})", file=sys.stderr)
    return trace


def _store_config(args: argparse.Namespace, dram: int, ssd: int) -> StoreConfig:
    promotion = args.promotion.strip().lower()
    if promotion in ("off", "never", "none"):
        promote = 0
    else:
        try:
            promote = int(promotion)
        except ValueError:
            raise ConfigError("--promotion takes a read count or 'off'", got=args.promotion) from None
    return StoreConfig(
        dram_bytes=dram,
        ssd_bytes=ssd,
        eviction=args.policy,
        ssd_eviction=args.ssd_policy,
        offload=args.offload,
        promote_after_reads=promote,
        high_watermark=args.high_watermark,
        low_watermark=args.low_watermark,
        bucket_bytes=parse_size(args.bucket_bytes, field="bucket_bytes"),
        bucket_max_keys=args.bucket_max_keys,
    )


def _block_bytes(args: argparse.Namespace, trace: Trace) -> Tuple[int, int]:
    tokens = args.block_tokens if args.block_tokens is not None else trace.block_tokens
    if tokens <= 0:
        raise ConfigError("--block-tokens must be positive", got=tokens)
    per_token = parse_size(args.kv_bytes_per_token, field="kv_bytes_per_token")
    if per_token <= 0:
        raise ConfigError("--kv-bytes-per-token must be positive", got=args.kv_bytes_per_token)
    return tokens, tokens * per_token


def _emit_json(path: Optional[str], payload: Dict[str, Any]) -> None:
    if not path:
        return
    text = json.dumps(payload, indent=2, sort_keys=False) + "\n"
    if path == "-":
        sys.stdout.write(text)
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise IoError(f"cannot write JSON: {exc.strerror}", path=path, errno=exc.errno) from exc


def _table(rows: Sequence[Sequence[str]], header: Optional[Sequence[str]] = None) -> str:
    """Left-aligned first column, right-aligned others."""
    all_rows: List[Sequence[str]] = ([header] if header else []) + list(rows)
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(all_rows[0]))]
    lines = []
    for k, r in enumerate(all_rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if header and k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def _speedup(x: Optional[float]) -> str:
    return "inf" if x is None else f"{x:.2f}x"


def _trace_line(trace: Trace, tokens: int, block_bytes: int) -> str:
    return (
        f"{trace.path} ({trace.format}): {len(trace.requests):,} requests over {trace.duration_s / 60:.1f} min, "
        f"{tokens} tokens/block = {format_size(block_bytes)}"
    )


# ---------------------------------------------------------------------- replay


def run_replay(args: argparse.Namespace) -> int:
    from gdskv.trace.replay import replay
    from gdskv.trace.simulator import SimConfig

    trace = _load(args)
    tokens, block_bytes = _block_bytes(args, trace)
    dram = parse_size(args.dram, field="dram")
    ssd = parse_size(args.ssd, field="ssd")
    config = SimConfig(store=_store_config(args, dram, ssd), block_bytes=block_bytes)
    report = replay(trace, config)
    payload = report.as_dict()
    payload["trace"]["block_tokens"] = tokens
    if args.json != "-":
        print(format_replay(report, _trace_line(trace, tokens, block_bytes)))
    _emit_json(args.json, payload)
    return 0


def format_replay(report: Any, heading: str) -> str:
    cfg = report.config
    tiers = f"DRAM {format_size(cfg['dram_bytes'])} = {cfg['dram_blocks']:,} blocks ({cfg['eviction']})"
    if cfg["ssd_bytes"]:
        promote = cfg["promote_after_reads"]
        tiers += (
            f", SSD {format_size(cfg['ssd_bytes'])} = {cfg['ssd_blocks']:,} blocks "
            f"({cfg['ssd_eviction']} buckets of {cfg['bucket_blocks']}, offload {cfg['offload']}, "
            f"promotion {'after ' + str(promote) + ' reads' if promote else 'off'})"
        )
    else:
        tiers += ", no SSD"
    rows = [
        ("DRAM", _pct(report.dram_hit_rate), format_size(report.dram_read_bytes)),
        ("SSD", _pct(report.nvme_hit_rate), format_size(report.nvme_read_bytes)),
        ("overall", _pct(report.hit_rate), format_size(report.dram_read_bytes + report.nvme_read_bytes)),
        ("ideal (infinite cache)", _pct(report.ideal_hit_rate), ""),
    ]
    c = report.counters
    lines = [
        heading,
        f"{report.accesses:,} block accesses, {report.unique_blocks:,} unique blocks",
        tiers,
        "",
        _table(rows, ("tier", "hit rate", "bytes read")),
        "",
        f"prefill speedup 1/(1-r): {_speedup(report.prefill_speedup)} (ideal {_speedup(report.ideal_prefill_speedup)})",
        f"moves: {c['offloaded']:,} blocks offloaded, {c['promoted']:,} promoted, "
        f"{c['dram_evicted']:,} evicted from DRAM, {c['nvme_evicted']:,} from SSD, {c['dropped']:,} dropped",
        f"replay: {report.seconds:.2f} s, {report.accesses_per_s / 1e6:.2f}M block accesses/s",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------- sweep


def run_sweep(args: argparse.Namespace) -> int:
    from gdskv.trace.sweep import parse_size_list, sweep

    trace = _load(args)
    tokens, block_bytes = _block_bytes(args, trace)
    dram_sizes = parse_size_list(args.dram, field="dram")
    ssd_sizes = parse_size_list(args.ssd, field="ssd")
    if args.target is not None and not 0 < args.target <= 1:
        raise ConfigError("--target is a hit rate in (0, 1]", got=args.target)
    base = _store_config(args, dram_sizes[0], ssd_sizes[0])
    report = sweep(trace, dram_sizes=dram_sizes, ssd_sizes=ssd_sizes, base=base, block_bytes=block_bytes, jobs=args.jobs)
    payload = report.as_dict()
    payload["trace"] = {"path": trace.path, "format": trace.format, "block_tokens": tokens}
    payload["config"] = {k: v for k, v in dataclasses.asdict(base).items() if k not in ("dram_bytes", "ssd_bytes")}
    if args.target is not None:
        smallest = report.smallest_dram_for(args.target)
        payload["target"] = {"hit_rate": args.target, "smallest_dram": {str(k): v for k, v in smallest.items()}}
    if args.plot:
        from gdskv.trace.plots import plot_sweep

        plot_sweep(report, args.plot)
    if args.json != "-":
        print(format_sweep(report, _trace_line(trace, tokens, block_bytes), target=args.target))
        if args.plot:
            print(f"plot: {args.plot}")
    _emit_json(args.json, payload)
    return 0


def format_sweep(report: Any, heading: str, *, target: Optional[float] = None) -> str:
    header = ["DRAM"] + ["no SSD" if s == 0 else f"+{format_size(s)} SSD" for s in report.ssd_sizes]
    rows = []
    for dram in report.dram_sizes:
        row = [f"{format_size(dram)} ({report.point(dram, report.ssd_sizes[0]).dram_blocks:,} blocks)"]
        for ssd in report.ssd_sizes:
            p = report.point(dram, ssd)
            row.append(f"{_pct(p.hit_rate)} {_speedup(p.prefill_speedup)}")
        rows.append(row)
    lines = [
        heading,
        f"hit rate and prefill speedup; ideal (infinite cache) {_pct(report.ideal_hit_rate)}",
        "",
        _table(rows, header),
        "",
        f"{len(report.points)} replays of {report.accesses:,} block accesses in {report.seconds:.1f} s "
        f"({report.jobs} process{'es' if report.jobs > 1 else ''})",
    ]
    if target is not None:
        for ssd, dram in report.smallest_dram_for(target).items():
            where = "no SSD" if ssd == 0 else f"{format_size(ssd)} SSD"
            lines.append(
                f"hit rate >= {_pct(target)} with {where}: "
                + (f"DRAM {format_size(dram)}" if dram is not None else "not reached in this sweep")
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------- reuse


def run_reuse(args: argparse.Namespace) -> int:
    from gdskv.trace.reuse import analyze_reuse

    trace = _load(args)
    report = analyze_reuse(trace)
    payload = report.as_dict()
    payload["trace"] = {"path": trace.path, "format": trace.format, "block_tokens": trace.block_tokens}
    if args.plot:
        from gdskv.trace.plots import plot_reuse

        plot_reuse(report, args.plot)
    if args.json != "-":
        heading = f"{trace.path} ({trace.format}): {len(trace.requests):,} requests over {trace.duration_s / 60:.1f} min"
        print(format_reuse(report, heading))
        if args.plot:
            print(f"plot: {args.plot}")
    _emit_json(args.json, payload)
    return 0


def format_reuse(report: Any, heading: str) -> str:
    rows = [(b["label"], f"{b['count']:,}", _pct(b["share"])) for b in report.bins]
    return "\n".join(
        [
            heading,
            f"{report.accesses:,} block accesses, {report.unique_blocks:,} unique blocks, "
            f"{report.reused_share:.1%} of them reused ({report.reuses:,} reuses)",
            f"reuse gap: median {report.median_gap_s:.0f} s, p90 {report.p90_gap_s:.0f} s, p99 {report.p99_gap_s:.0f} s",
            f"within 10 min {_pct(report.within_10min)}, 10-30 min {_pct(report.from_10_to_30min)}, "
            f"beyond 30 min {_pct(report.beyond_30min)}",
            "",
            _table(rows, ("gap", "reuses", "share")),
        ]
    )
