"""Reporting of the TTFT benchmark: the report, progress, the acceptance check, the table,
JSON, plots. Both runners (:mod:`gdskv.ttft.run_reference`, :mod:`gdskv.ttft.run_vllm`)
return a :class:`TtftReport`.

Acceptance (issue 4): once memory (pool + DRAM) has run out — the first round in which the
DRAM-only store drops objects — the ``dram+ssd`` configuration's hit rate in every later
round stays within 5 points of its mean over the rounds before (round 1, which has no
history, excluded), and its last-round mean TTFT is below the ``dram`` configuration's;
the margin is reported as a ratio and in seconds.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from gdskv.errors import ConfigError

#: Largest drop of the SSD configuration's hit rate after memory ran out, in points.
HIT_RATE_TOLERANCE = 0.05

JSON_NAME = "ttft.json"
PLOT_TTFT = "ttft_per_round.png"
PLOT_HIT = "hit_rate_per_round.png"
#: Marker and line style per configuration, so overlapping lines stay visible.
STYLES = [("o", "-"), ("s", "-"), ("^", "-"), ("v", "--"), ("D", ":"), ("x", "-.")]


@dataclasses.dataclass
class TtftReport:
    """Every figure of a run (``as_dict`` is the JSON), and where the outputs went."""

    banner: Dict[str, Any]
    results: Dict[str, List[Dict[str, Any]]]  # config -> per-round figures
    acceptance: Dict[str, Any]
    json_path: Optional[Path] = None
    plot_paths: List[Path] = dataclasses.field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        return {"banner": self.banner, "results": self.results, "acceptance": self.acceptance}


def require_extras(*, plots: bool) -> None:
    """Fail early, naming the extra to install, when a needed package is missing."""
    missing = []
    for module, extra in (("torch", "engine"), ("transformers", "engine")) + ((("matplotlib", "bench"),) if plots else ()):
        try:
            __import__(module)
        except ImportError:
            missing.append(f"{module} (extra '{extra}')")
    if missing:
        raise ConfigError("the TTFT benchmark needs more packages", missing=", ".join(missing))


class Progress:
    """A rich progress bar on stderr, or nothing when rich is missing or it is disabled."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self._bar = None
        self._task = None
        if enabled:
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
                from rich.progress import Progress as RichProgress
            except ImportError:
                return
            self._bar = RichProgress(
                TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=Console(stderr=True), transient=False,
            )
            self._task = self._bar.add_task("starting", total=total)

    def __enter__(self) -> "Progress":
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)


def acceptance(results: Dict[str, List[Dict[str, Any]]], target_round: int) -> Dict[str, Any]:
    """Evaluate the acceptance criterion of the module docstring on per-round figures."""
    out: Dict[str, Any] = {"target_round": target_round, "tolerance_points": HIT_RATE_TOLERANCE * 100}
    dram, ssd = results.get("dram"), results.get("dram+ssd")
    if not dram or not ssd:
        return {**out, "evaluated": False, "reason": "needs the dram and dram+ssd configurations"}
    exhausted = next((r["round"] for r in dram if r["store"].get("dram_dropped", 0) > 0), None)
    out["exhausted_round"] = exhausted
    if exhausted is None:
        return {**out, "evaluated": False, "reason": "memory never ran out: the DRAM-only store dropped nothing"}
    before = [r["hit_rate"] for r in ssd if 2 <= r["round"] < exhausted]
    after = [r["hit_rate"] for r in ssd if r["round"] >= exhausted]
    if not before:
        return {**out, "evaluated": False, "reason": f"memory ran out in round {exhausted}: no earlier round with history"}
    before_mean = sum(before) / len(before)
    last_ssd, last_dram = ssd[-1]["ttft_mean_s"], dram[-1]["ttft_mean_s"]
    out.update(
        evaluated=True,
        ssd_hit_before=before_mean,
        ssd_hit_after_min=min(after),
        dram_hit_before=_mean([r["hit_rate"] for r in dram if 2 <= r["round"] < exhausted]),
        dram_hit_after_min=min(r["hit_rate"] for r in dram if r["round"] >= exhausted),
        hit_rate_ok=min(after) >= before_mean - HIT_RATE_TOLERANCE,
        last_round_ttft_ssd_s=last_ssd,
        last_round_ttft_dram_s=last_dram,
        ttft_ratio_dram_over_ssd=last_dram / last_ssd if last_ssd > 0 else None,
        ttft_saved_s=last_dram - last_ssd,
        ttft_ok=last_ssd < last_dram,
    )
    out["passed"] = out["hit_rate_ok"] and out["ttft_ok"]
    return out


judge = acceptance


def _mean(values: List[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def table(results: Dict[str, List[Dict[str, Any]]]) -> str:
    """The per-round, per-configuration table as fixed-width text."""
    head = (
        f"{'round':>5}  {'config':<17} {'hit %':>6} {'ideal %':>7}  {'pool/dram/ssd/queued %':<22} "
        f"{'TTFT mean':>9} {'p50':>7} {'p90':>7} {'service':>8} {'computed':>8}"
    )
    peer = any("peer_dram_tokens" in r for v in results.values() for r in v)
    if peer:
        head += f" {'inst':>4} {'peer dram/ssd %':>15}"
    lines = [head, "-" * len(head)]
    rounds = max(len(v) for v in results.values())
    for i in range(rounds):
        for name, per_round in results.items():
            if i >= len(per_round):
                continue
            r = per_round[i]
            n = r["prompt_tokens"]
            split = "/".join(f"{100 * r[k] / n:.0f}" for k in ("device_tokens", "dram_tokens", "ssd_tokens", "queued_tokens"))
            lines.append(
                f"{r['round']:>5}  {name:<17} {100 * r['hit_rate']:>6.1f} {100 * r['ideal_hit_rate']:>7.1f}  {split:<22} "
                f"{_s(r['ttft_mean_s']):>9} {_s(r['ttft_p50_s']):>7} {_s(r['ttft_p90_s']):>7} {_s(r['service_mean_s']):>8} "
                f"{r['computed_tokens']:>8}"
                + (f" {r.get('instance', ''):>4} {'/'.join(f'{100 * r.get(k, 0) / n:.0f}' for k in ('peer_dram_tokens', 'peer_ssd_tokens')):>15}" if peer else "")
            )
        if i + 1 < rounds:
            lines.append("")
    return "\n".join(lines)


def _s(seconds: float) -> str:
    return f"{seconds:.3f}s" if seconds < 10 else f"{seconds:.1f}s"


def render_acceptance(acc: Dict[str, Any]) -> str:
    if not acc.get("evaluated"):
        return f"acceptance: not evaluated ({acc.get('reason')})"
    if acc.get("kind") == "instances":
        return _render_instances(acc)
    ex = acc["exhausted_round"]
    return "\n".join(
        [
            f"memory ran out in round {ex} (first round in which the DRAM-only store dropped KV; planned near round {acc['target_round']})",
            f"hit rate, rounds 2..{ex - 1} -> rounds {ex}..end: dram+ssd {100 * acc['ssd_hit_before']:.1f}% -> min "
            f"{100 * acc['ssd_hit_after_min']:.1f}%; dram {100 * acc['dram_hit_before']:.1f}% -> min {100 * acc['dram_hit_after_min']:.1f}%"
            f"  [{'ok' if acc['hit_rate_ok'] else 'FAIL'}: within {acc['tolerance_points']:.0f} points]",
            f"last-round TTFT mean: dram+ssd {_s(acc['last_round_ttft_ssd_s'])} vs dram {_s(acc['last_round_ttft_dram_s'])} = "
            f"{acc['ttft_ratio_dram_over_ssd']:.2f}x lower, {_s(acc['ttft_saved_s'])} saved  [{'ok' if acc['ttft_ok'] else 'FAIL'}]",
        ]
    )


def _render_instances(acc: Dict[str, Any]) -> str:
    """The acceptance of ``--instances`` (:func:`gdskv.ttft.run_instances.acceptance`)."""
    lines = [
        f"hit rate, rounds 2..end (mean): ideal {100 * acc['ideal_hit_mean']:.1f}%, shared {100 * acc['shared_hit_mean']:.1f}%"
        + (f", separate {100 * acc['separate_hit_mean']:.1f}%" if "separate_hit_mean" in acc else "")
        + f"; shared at most {100 * acc['shared_gap_max']:.1f} points below the ideal"
        f"  [{'ok' if acc['hit_rate_ok'] else 'FAIL'}: within {acc['tolerance_points']:.0f} points]"
    ]
    if acc.get("separate_loss") is not None:
        lines.append(f"separate stores lose {100 * acc['separate_loss']:.0f}% of the ideal hit rate")
    if acc.get("tokens_equal") is not None:
        lines.append(f"first tokens, shared vs device (no gdskv): {'equal' if acc['tokens_equal'] else 'DIFFERENT'}  [{'ok' if acc['tokens_equal'] else 'FAIL'}]")
    return "\n".join(lines)


def render(report: TtftReport) -> str:
    """Banner, table, acceptance and output paths: what ``gdskv bench-ttft`` prints."""
    engine = "vLLM" if str(report.banner.get("engine", "")).startswith("vLLM") else "reference engine"
    lines = [f"gdskv TTFT per round ({engine}, output length 1)"]
    lines += [f"  {k}: {v}" for k, v in report.banner.items()]
    lines += ["", table(report.results), "", render_acceptance(report.acceptance)]
    if report.json_path is not None:
        lines += ["", f"figures: {report.json_path}"]
    lines += [f"plot: {p}" for p in report.plot_paths]
    return "\n".join(lines)


def finish(
    banner: Any,
    results: Dict[str, List[Dict[str, Any]]],
    target_round: int,
    out_dir: Optional[Path],
    *,
    acceptance: Optional[Dict[str, Any]] = None,
) -> TtftReport:
    """The report of a finished run (every runner ends here): its acceptance judged (or
    ``acceptance``, a runner's own), and its outputs written to ``out_dir`` unless that is None."""
    if acceptance is None:
        acceptance = judge(results, target_round)
    report = TtftReport(banner=banner, results=results, acceptance=acceptance)
    if out_dir is not None:
        write_outputs(report, out_dir)
    return report


def write_outputs(report: TtftReport, out_dir: Path) -> None:
    """Write the JSON of every figure and the two plots under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report.json_path = out_dir / JSON_NAME
    report.json_path.write_text(json.dumps(report.as_dict(), indent=1))
    report.plot_paths = plot(report, out_dir)


def plot(report: TtftReport, out_dir: Path) -> List[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exhausted = report.acceptance.get("exhausted_round")
    paths = []
    for fname, title, ylabel in (
        (PLOT_TTFT, "TTFT per round (mean; band: p50..p90)", "TTFT (s)"),
        (PLOT_HIT, "KV hit rate per round", "hit rate (% of prompt tokens)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        for (name, rounds), (marker, style) in zip(report.results.items(), STYLES):
            x = [r["round"] for r in rounds]
            if fname == PLOT_TTFT:
                ax.plot(x, [r["ttft_mean_s"] for r in rounds], marker=marker, ls=style, label=name)
                ax.fill_between(x, [r["ttft_p50_s"] for r in rounds], [r["ttft_p90_s"] for r in rounds], alpha=0.12)
            else:
                ax.plot(x, [100 * r["hit_rate"] for r in rounds], marker=marker, ls=style, label=name)
        if fname == PLOT_HIT and report.results:
            first = next(iter(report.results.values()))
            ax.plot([r["round"] for r in first], [100 * r["ideal_hit_rate"] for r in first], "k--", lw=1, label="ideal (whole history)")
            ax.set_ylim(0, 100)
        if exhausted:
            ax.axvline(exhausted - 0.5, color="grey", ls=":", lw=1)
            ax.text(exhausted - 0.45, ax.get_ylim()[1] * 0.97, "memory full", va="top", fontsize=8, color="grey")
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
