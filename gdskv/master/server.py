"""Run the master: :class:`MasterServer` (embeddable) and the ``gdskv-master`` command.

``gdskv-master --listen 127.0.0.1:50051 [--lease-s 10]`` serves until SIGINT/SIGTERM. Once
listening it prints one JSON line to stdout, ``{"event": "listening", "address": ...}``, so
a supervisor (or a test) started with ``--listen 127.0.0.1:0`` learns the port.

The master keeps its state in memory only: after a restart, nodes find that it does not know
them (heartbeat answered "unknown node"), register again and re-register every replica.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import sys
import threading
import time
from concurrent import futures
from typing import List, Optional

import grpc

from gdskv.errors import ConfigError, GdskvError
from gdskv.master._proto import master_pb2_grpc as pb_grpc
from gdskv.master.config import MasterConfig
from gdskv.master.registry import Registry
from gdskv.master.service import MasterService

log = logging.getLogger(__name__)

#: gRPC message size limit (both ways): batches of thousands of 4 KiB keys fit.
MAX_MESSAGE_BYTES = 256 << 20

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


class MasterServer:
    """A gRPC master on ``listen`` ("host:port"; port 0 picks a free one).

    ``start()`` binds and returns the address actually bound; ``stop()`` is idempotent.
    A background thread expires dead nodes and stale WRITING reservations.
    """

    def __init__(self, listen: str, config: Optional[MasterConfig] = None, *, workers: int = 8) -> None:
        self.config = config or MasterConfig()
        self.registry = Registry(self.config)
        self.service = MasterService(self.registry)
        self._listen = listen
        # SO_REUSEPORT off: a second master on the same port must fail, not share it.
        options = GRPC_OPTIONS + [("grpc.so_reuseport", 0)]
        pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gdskv-master")
        self._server = grpc.server(pool, options=options)
        pb_grpc.add_MasterServicer_to_server(self.service, self._server)
        self._stop = threading.Event()
        self._reaper: Optional[threading.Thread] = None
        self.address: Optional[str] = None

    def start(self) -> str:
        host, _, port = self._listen.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError("listen address must be host:port", got=self._listen)
        try:
            bound = self._server.add_insecure_port(self._listen)
        except RuntimeError as exc:
            raise ConfigError("cannot listen", address=self._listen, cause=str(exc)) from exc
        if bound == 0:
            raise ConfigError("cannot listen (address in use?)", address=self._listen)
        self._server.start()
        self.address = f"{host}:{bound}"
        self._reaper = threading.Thread(target=self._reap, name="gdskv-master-reaper", daemon=True)
        self._reaper.start()
        return self.address

    def _reap(self) -> None:
        period = min(self.config.lease_s / 4, 1.0)
        while not self._stop.wait(period):
            try:
                dropped = self.registry.expire(time.monotonic())
                if dropped:
                    log.info("gdskv-master: dropped %d node(s) past their lease", dropped)
            except Exception:  # never let the reaper die
                log.exception("gdskv-master: expiry failed")

    def wait(self) -> None:
        self._server.wait_for_termination()

    def stop(self, grace: float = 0.5) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._server.stop(grace).wait()
        if self._reaper is not None:
            self._reaper.join()

    def __enter__(self) -> "MasterServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gdskv-master", description="The gdskv master: where every replica is.")
    p.add_argument("--listen", default="127.0.0.1:50051", help="host:port to serve gRPC on (port 0: any free port)")
    p.add_argument("--lease-s", type=float, default=MasterConfig.lease_s, help="node lease (seconds)")
    p.add_argument("--grace-s", type=float, default=None, help="forget a dead node this long after its lease")
    p.add_argument("--heartbeat-s", type=float, default=None, help="heartbeat period asked of nodes")
    p.add_argument("--writing-timeout-s", type=float, default=MasterConfig.writing_timeout_s)
    p.add_argument("--promote-threshold", type=float, default=MasterConfig.promote_threshold)
    p.add_argument("--offload-threshold", type=float, default=MasterConfig.offload_threshold)
    p.add_argument("--workers", type=int, default=8, help="gRPC worker threads")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return p


#: Cyclic-GC thresholds of the gdskv-master process. The registry allocates a few objects per
#: replica and holds millions of them; with the default thresholds the collector rescans them
#: so often that registrations run at about half speed. Its records form no cycles.
GC_THRESHOLDS = (100_000, 50, 100)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    gc.set_threshold(*GC_THRESHOLDS)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        config = MasterConfig(
            lease_s=args.lease_s,
            grace_s=args.grace_s,
            heartbeat_s=args.heartbeat_s,
            writing_timeout_s=args.writing_timeout_s,
            promote_threshold=args.promote_threshold,
            offload_threshold=args.offload_threshold,
        )
        server = MasterServer(args.listen, config, workers=args.workers)
        address = server.start()
    except GdskvError as exc:
        print(f"gdskv-master: error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(json.dumps({"event": "listening", "address": address, "lease_s": config.lease_s}), flush=True)
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
