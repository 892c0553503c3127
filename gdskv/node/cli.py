"""``gdskv-node``: run a node daemon.

    gdskv-node --master 127.0.0.1:50051 --dram 8GiB --ssd /var/tmp/kv:100GiB --listen 127.0.0.1:0
    gdskv-node --socket --dram 8GiB --ssd /var/tmp/kv:100GiB          # one host, no cluster
    gdskv-node --master 127.0.0.1:50051 --socket --dram 8GiB --ssd /var/tmp/kv:100GiB

The store lives in the ``--ssd`` directory (``DIR:0`` for a DRAM-only node); reopening it
recovers every intact object on NVMe, and the node registers all of them with the master.
Other :class:`StoreConfig` fields are set with ``--set field=value`` (repeatable).

``--master`` joins a cluster (the data server serves peers); ``--socket [PATH]`` serves the
processes of this host that attach with :func:`gdskv.attach` (:mod:`gdskv.local`; default
path: ``node.sock`` in the store directory, mode ``--socket-mode``, default 600). A node
takes either or both.

Prints JSON lines to stdout: ``{"event": "attachable", "socket"}`` once the socket serves,
``{"event": "listening", "node_id", "address"}`` once the data server is up,
``{"event": "registered", "objects"}`` once the master knows every replica (the master may
come later: the node keeps trying). SIGTERM/SIGINT (or, with ``--exit-when-idle S``, no
attached process for S seconds: ``{"event": "idle"}``): end the attached sessions,
deregister, close the store (DRAM-only objects are written to SSD first), exit 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

import gdskv
from gdskv.config import parse_size
from gdskv.errors import ConfigError, GdskvError
from gdskv.local.reach import ClusterReach
from gdskv.local.server import LocalServer
from gdskv.node.config import ClusterConfig
from gdskv.node.node import Node


def parse_ssd(spec: str) -> Tuple[str, int]:
    """``DIR:SIZE`` -> (directory, bytes). The size part is required."""
    path, sep, size = spec.rpartition(":")
    if not sep or not path:
        raise ConfigError("--ssd must be DIR:SIZE (e.g. /var/tmp/kv:100GiB, or DIR:0 for no SSD tier)", got=spec)
    return path, parse_size(size, field="ssd")


def parse_sets(pairs: List[str]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep:
            raise ConfigError("--set needs field=value", got=pair)
        out[name.strip()] = _coerce(raw.strip())
    return out


def _coerce(raw: str) -> Any:
    """``--set`` values: integers, numbers, booleans (true/false, yes/no, on/off), else text."""
    flag = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}.get(raw.lower())
    if flag is not None:
        return flag
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gdskv-node", description="A gdskv node: a tiered store serving its peers.")
    p.add_argument("--master", default=None, help="host:port of gdskv-master (join a cluster)")
    p.add_argument(
        "--socket", nargs="?", const="", default=None, metavar="PATH",
        help="serve processes of this host on a Unix socket (default PATH: node.sock in the store directory)",
    )
    p.add_argument("--socket-mode", default="600", help="permissions of the socket file, octal (default 600)")
    p.add_argument("--staging", default="256MiB", help="shared room for reads from NVMe by attached processes")
    p.add_argument(
        "--exit-when-idle", type=float, default=None, metavar="SECONDS",
        help="with --socket: exit (as on SIGTERM) once no process has been attached for this long",
    )
    p.add_argument("--dram", required=True, help="DRAM tier capacity, e.g. 8GiB")
    p.add_argument("--ssd", required=True, help="DIR:SIZE of the NVMe tier, e.g. /var/tmp/kv:100GiB")
    p.add_argument("--listen", default="127.0.0.1:0", help="host:port of the data server (port 0: any)")
    p.add_argument("--advertise", default=None, help="address peers should use, if not the bound one")
    p.add_argument("--node-id", default=None, help="id on the master (default: random)")
    p.add_argument("--connections", type=int, default=ClusterConfig.connections, help="connections per peer")
    p.add_argument(
        "--heartbeat-s", type=float, default=ClusterConfig.heartbeat_s, help="heartbeat period until the master sets it"
    )
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="FIELD=VALUE", help="a StoreConfig field")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if args.master is None and args.socket is None:
            raise ConfigError("a node needs --master (join a cluster), --socket (serve this host), or both")
        if args.exit_when_idle is not None and (args.socket is None or not args.exit_when_idle > 0):
            raise ConfigError("--exit-when-idle needs --socket and a positive number of seconds", got=args.exit_when_idle)
        path, ssd = parse_ssd(args.ssd)
        config = ClusterConfig(
            listen=args.listen,
            advertise=args.advertise,
            node_id=args.node_id,
            connections=args.connections,
            heartbeat_s=args.heartbeat_s,
        )
        socket_mode = _parse_mode(args.socket_mode)
        staging = parse_size(args.staging, field="staging")
        sets = parse_sets(args.sets)
        if args.socket is not None:
            sets["dram_shared"] = True
        store = gdskv.open(path, dram=args.dram, ssd=ssd, **sets)
    except GdskvError as exc:
        print(f"gdskv-node: error: {exc}", file=sys.stderr)
        return 2
    node = Node(store, args.master, config) if args.master is not None else None
    local: Optional[LocalServer] = None
    status = 0
    try:
        if node is not None:
            address = node.start()
            _emit(event="listening", node_id=node.node_id, address=address, master=args.master)
            announcer = threading.Thread(target=_announce, args=(node, stop), daemon=True)
            announcer.start()
        if args.socket is not None:
            describe = {"node_id": node.node_id, "master": args.master} if node is not None else {}
            reach = ClusterReach(node) if node is not None else None
            local = LocalServer(
                store, args.socket or None, mode=socket_mode, staging_bytes=staging, describe=describe, reach=reach
            )
            _emit(event="attachable", socket=str(local.start()))
        while not stop.wait(0.5):
            if local is not None and args.exit_when_idle is not None and local.idle_s() >= args.exit_when_idle:
                _emit(event="idle", seconds=args.exit_when_idle)
                break
    except GdskvError as exc:
        print(f"gdskv-node: error: {exc}", file=sys.stderr)
        status = 2
    finally:
        if local is not None:
            local.close()
        if node is not None:
            node.close()
        try:
            store.close()
        except GdskvError as exc:  # e.g. the disk was full: objects that were only in DRAM are lost
            print(f"gdskv-node: error while closing the store: {exc}", file=sys.stderr)
            status = status or 1
    return status


def _parse_mode(raw: str) -> int:
    try:
        mode = int(raw, 8)
    except ValueError:
        raise ConfigError("--socket-mode must be octal permission bits such as 600 or 660", got=raw) from None
    if not 0 <= mode <= 0o777:
        raise ConfigError("--socket-mode must be octal permission bits such as 600 or 660", got=raw)
    return mode


def _announce(node: Node, stop: threading.Event) -> None:
    while not stop.is_set():
        if node.wait_registered(timeout=0.5):
            _emit(event="registered", node_id=node.node_id, objects=int(node.registrar.counters["resync_objects"]))
            return


def _emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
