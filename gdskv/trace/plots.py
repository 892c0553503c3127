"""PNG plots of a sweep and of a reuse analysis. matplotlib is imported here, lazily (it
is in the ``bench`` extra); a missing matplotlib is a :class:`ConfigError` naming the extra.
"""

from __future__ import annotations

import os
from typing import Any

from gdskv.config import format_size
from gdskv.errors import ConfigError, IoError
from gdskv.trace.reuse import FAR_S, NEAR_S, ReuseReport
from gdskv.trace.sweep import SweepReport


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'gdskv[bench]'") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str) -> None:
    try:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    except OSError as exc:
        raise IoError(f"cannot write plot: {exc.strerror}", path=path, errno=exc.errno) from exc


def plot_sweep(report: SweepReport, path: "str | os.PathLike[str]", *, title: str = "") -> None:
    """Hit rate against DRAM size (log scale), one line per SSD size, and the ideal."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for ssd in report.ssd_sizes:
            pts = sorted((p for p in report.points if p.ssd_bytes == ssd), key=lambda p: p.dram_bytes)
            label = "DRAM only" if ssd == 0 else f"+ {format_size(ssd)} SSD"
            ax.plot([p.dram_bytes for p in pts], [p.hit_rate for p in pts], marker="o", label=label)
        ax.axhline(report.ideal_hit_rate, color="grey", linestyle="--", label=f"ideal {report.ideal_hit_rate:.3f}")
        ax.set_xscale("log", base=2)
        ticks = report.dram_sizes
        ax.set_xticks(ticks)
        ax.set_xticklabels([format_size(t).replace(".0 ", " ") for t in ticks], rotation=30)
        ax.set_xlabel("DRAM capacity")
        ax.set_ylabel("hit rate (block accesses)")
        ax.set_ylim(0, max(0.05, min(1.0, report.ideal_hit_rate * 1.1)))
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
        ax.set_title(title or f"{report.requests:,} requests, {format_size(report.block_bytes)} blocks")
        _save(fig, os.fspath(path))
    finally:
        plt.close(fig)


def plot_reuse(report: ReuseReport, path: "str | os.PathLike[str]", *, title: str = "") -> None:
    """Histogram of reuse gaps on log-spaced bins, with the 10- and 30-minute marks."""
    plt = _pyplot()
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        gaps = np.asarray(report.gaps, dtype=float)
        floor = 0.1  # gaps below 0.1 s (same arrival step) land in the first bin
        top = max(float(gaps.max()) if gaps.size else 1.0, FAR_S * 1.5)
        bins = np.logspace(np.log10(floor), np.log10(top), 50)
        ax.hist(np.clip(gaps, floor, None), bins=bins, color="tab:blue")
        ax.set_xscale("log")
        for mark, text in ((NEAR_S, "10 min"), (FAR_S, "30 min")):
            ax.axvline(mark, color="tab:red", linestyle="--")
            ax.text(mark, ax.get_ylim()[1] * 0.97, f"{text} ", color="tab:red", va="top", ha="right", rotation=90)
        ax.set_xlabel("reuse gap (s, log scale; < 0.1 s drawn at 0.1 s)")
        ax.set_ylabel("reuses")
        ax.set_title(
            title
            or (
                f"{report.reuses:,} reuses: {report.within_10min:.1%} <= 10 min, "
                f"{report.from_10_to_30min:.1%} 10-30 min, {report.beyond_30min:.1%} > 30 min"
            )
        )
        ax.grid(True, alpha=0.3)
        _save(fig, os.fspath(path))
    finally:
        plt.close(fig)
