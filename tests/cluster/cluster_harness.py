"""Start and stop real ``gdskv-master`` / ``gdskv-node`` processes for the cluster tests.

Every process binds 127.0.0.1 with a free port (port 0) and says which on its first stdout
line; a reader thread collects the JSON lines so a test can wait for an event with a
deadline. ``Cluster.close()`` kills whatever is still running.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

LEASE_S = 1.0
HEARTBEAT_S = 0.1


class Proc:
    """One daemon; ``events`` are its JSON stdout lines."""

    def __init__(self, args: List[str]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.args = args
        self.popen = subprocess.Popen(
            [sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.events: "queue.Queue[dict]" = queue.Queue()
        self.stderr: List[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.popen.stdout:  # type: ignore[union-attr]
            try:
                self.events.put(json.loads(line))
            except ValueError:
                pass

    def _read_stderr(self) -> None:
        for line in self.popen.stderr:  # type: ignore[union-attr]
            self.stderr.append(line)

    def wait_event(self, name: str, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.popen.poll() is not None and self.events.empty():
                raise AssertionError(
                    f"{self.args[0]} never said {name!r} (rc={self.popen.poll()}): {''.join(self.stderr)[-2000:]}"
                )
            try:
                event = self.events.get(timeout=min(remaining, 0.2))
            except queue.Empty:
                continue
            if event.get("event") == name:
                return event

    def kill9(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(15)
        except subprocess.TimeoutExpired:
            self.kill9()
            return -9


class Cluster:
    """A master and named nodes, each a real process."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.master: Optional[Proc] = None
        self.master_address = ""
        self.nodes: Dict[str, Proc] = {}
        self.node_info: Dict[str, dict] = {}

    def start_master(self, address: str = "127.0.0.1:0") -> str:
        self.master = Proc(
            ["gdskv.master", "--listen", address, "--lease-s", str(LEASE_S), "--heartbeat-s", str(HEARTBEAT_S)]
        )
        self.master_address = self.master.wait_event("listening")["address"]
        return self.master_address

    def start_node(self, name: str, *, dram: str = "8MiB", ssd: str = "64MiB", wait: bool = True, sets: tuple = ()) -> dict:
        args = [
            "gdskv.node", "--master", self.master_address, "--dram", dram, "--ssd", f"{self.tmp / name}:{ssd}",
            "--set", "bucket_max_age_s=0.01", "--set", "bucket_bytes=1MiB", "--heartbeat-s", str(HEARTBEAT_S),
        ]
        for item in sets:
            args += ["--set", item]
        proc = Proc(args)
        info = proc.wait_event("listening")
        if wait:
            info.update(proc.wait_event("registered"))
        self.nodes[name] = proc
        self.node_info[name] = info
        return info

    def address(self, name: str) -> str:
        return self.node_info[name]["address"]

    def node_id(self, name: str) -> str:
        return self.node_info[name]["node_id"]

    def close(self) -> None:
        for proc in list(self.nodes.values()) + ([self.master] if self.master else []):
            if proc.popen.poll() is None:
                proc.kill9()


def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    """Poll a condition another process makes true: a sync point with a deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
