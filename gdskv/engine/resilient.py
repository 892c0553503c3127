"""A store reached through a node, that keeps the engine serving while the node is gone.

:class:`ResilientStore` speaks :class:`gdskv.KVStore` over whatever ``connect()`` returns
(an :class:`~gdskv.local.client.AttachedStore`; :class:`~gdskv.engine.hostnode.NodeLink`
starts the node first where the mode says so). Contract:

- While attached, every call goes to the node's store as it is.
- A call that finds the node gone (:class:`NodeUnavailableError`) ends the attachment:
  it returns a miss (``get``/``get_into`` None, ``exists`` False, ``remove`` False, the
  batch forms one per key), and so does every call until the store is attached again;
  a put is dropped and counted (``dropped_puts``). Other errors (a value of the wrong
  size, a key stored with other bytes) are raised as the node's store raises them.
- One warning per outage, naming this process (its pid and roles) and the socket; one
  more line when attached again. A store that could not be reached at :meth:`start` is
  an outage from the start.
- During an outage a background thread tries ``connect()`` again, at most once a second
  (:data:`RETRY_S`); no call of the engine waits for it.
- :meth:`stats` is the node's store's figures plus ``resilient``: the socket, whether
  attached, and the counters; while the node is gone, ``resilient`` alone.
- :meth:`close` is idempotent; calls after it raise :class:`StoreClosedError`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from gdskv.errors import GdskvError, NodeUnavailableError, StoreClosedError
from gdskv.types import Key

log = logging.getLogger(__name__)

#: Least time between two tries to attach again.
RETRY_S = 1.0


class ResilientStore:
    """See the module docstring."""

    def __init__(
        self, connect: Callable[[], Any], *, socket: str, mode: str = "node", role: Optional[str] = None, retry_s: float = RETRY_S
    ) -> None:
        self._connect = connect
        self.socket = socket
        self.mode = mode
        self.retry_s = retry_s
        self.roles: List[str] = [role] if role else []
        self._lock = threading.Lock()
        self._store: Optional[Any] = None
        self._closed = False
        self._stop = threading.Event()
        self._retrier: Optional[threading.Thread] = None
        self._pid = os.getpid()
        self.counters: Dict[str, int] = dict.fromkeys(("outages", "reattached", "dropped_puts", "missed_reads"), 0)

    # ------------------------------------------------------------------ attachment

    def start(self) -> "ResilientStore":
        """Attach now; when that fails, warn and go on trying in the background."""
        try:
            store = self._connect()
        except (GdskvError, OSError) as exc:
            with self._lock:
                self.counters["outages"] += 1
                self._retry_in_background()
            log.warning(
                "gdskv: %s cannot reach the gdskv node at %s (mode %s): store unavailable, serving without gdskv "
                "(misses) and trying again every %.0f s: %s", self._who(), self.socket, self.mode, self.retry_s, exc,
            )
            return self
        with self._lock:
            self._store = store
        return self

    @property
    def available(self) -> bool:
        """Whether a node's store is attached now."""
        return self._store is not None

    def add_role(self, role: str) -> None:
        """One more user of this store in this process, named in warnings."""
        with self._lock:
            if role not in self.roles:
                self.roles.append(role)

    def _who(self) -> str:
        roles = f" ({', '.join(self.roles)})" if self.roles else ""
        return f"process {os.getpid()}{roles}"

    def _lost(self, store: Any, exc: BaseException) -> None:
        with self._lock:
            if self._store is not store or self._closed:
                return  # another call saw it first: one warning per outage
            self._store = None
            self.counters["outages"] += 1
            self._retry_in_background()
        log.warning(
            "gdskv: %s lost the gdskv node at %s: serving without gdskv (misses, saves dropped) until it is back, "
            "trying every %.0f s: %s", self._who(), self.socket, self.retry_s, exc,
        )
        # Not closed: calls of other threads may still be copying out of its mapping; its
        # connections are closed already, and the mapping goes with the last reference.

    def _retry_in_background(self) -> None:
        """Start the retrying thread unless one runs (the lock is held)."""
        if self._pid != os.getpid():  # a forked child: its parent's thread is not here
            self._pid, self._retrier = os.getpid(), None
        if self._retrier is not None and self._retrier.is_alive():
            return
        self._retrier = threading.Thread(target=self._retry, name="gdskv-reattach", daemon=True)
        self._retrier.start()

    def _retry(self) -> None:
        while not self._stop.wait(self.retry_s):
            try:
                store = self._connect()
            except (GdskvError, OSError) as exc:
                log.debug("gdskv: %s: the node at %s is still unavailable: %s", self._who(), self.socket, exc)
                continue
            with self._lock:
                if self._closed:
                    store.close()
                    return
                self._store = store
                self.counters["reattached"] += 1
            log.warning("gdskv: %s attached to the gdskv node at %s again", self._who(), self.socket)
            return

    # ------------------------------------------------------------------ calls

    def _call(self, op: str, miss: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        store = self._store
        if store is None:
            if self._closed:
                raise StoreClosedError("the store is closed", socket=self.socket)
            return miss()
        try:
            return getattr(store, op)(*args, **kwargs)
        except NodeUnavailableError as exc:
            self._lost(store, exc)
            return miss()
        except StoreClosedError:
            if self._closed or store is self._store:
                raise
            return miss()  # replaced while this call ran

    def _read_miss(self, n: int, many: bool) -> Callable[[], Any]:
        def miss() -> Any:
            self.counters["missed_reads"] += n
            return [None] * n if many else None

        return miss

    def _put_miss(self, n: int) -> Callable[[], None]:
        def miss() -> None:
            self.counters["dropped_puts"] += n

        return miss

    def put(self, key: Key, value: Any, *, overwrite: bool = False) -> None:
        self._call("put", self._put_miss(1), key, value, overwrite=overwrite)

    def batch_put(self, keys: Sequence[Key], values: Sequence[Any], *, overwrite: bool = False) -> None:
        self._call("batch_put", self._put_miss(len(keys)), keys, values, overwrite=overwrite)

    def get(self, key: Key) -> Optional[bytearray]:
        return self._call("get", self._read_miss(1, False), key)

    def batch_get(self, keys: Sequence[Key]) -> List[Optional[bytearray]]:
        return self._call("batch_get", self._read_miss(len(keys), True), keys)

    def get_into(self, key: Key, out: Any) -> Optional[int]:
        return self._call("get_into", self._read_miss(1, False), key, out)

    def batch_get_into(self, keys: Sequence[Key], outs: Sequence[Any]) -> List[Optional[int]]:
        return self._call("batch_get_into", self._read_miss(len(keys), True), keys, outs)

    def exists(self, key: Key) -> bool:
        return self._call("exists", lambda: False, key)

    def batch_exists(self, keys: Sequence[Key]) -> List[bool]:
        return self._call("batch_exists", lambda: [False] * len(keys), keys)

    def remove(self, key: Key) -> bool:
        return self._call("remove", lambda: False, key)

    def batch_remove(self, keys: Sequence[Key]) -> List[bool]:
        return self._call("batch_remove", lambda: [False] * len(keys), keys)

    def stats(self) -> Dict[str, Any]:
        doc = self._call("stats", dict)
        return {**doc, "resilient": {"socket": self.socket, "mode": self.mode, "attached": self._store is not None, **self.counters}}

    def node_info(self) -> Dict[str, Any]:
        """What the node said of itself at the handshake (empty while it is gone)."""
        store = self._store
        return dict(getattr(store, "info", {}) or {}) if store is not None else {}

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Let go of the node (what this process held there is given back). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            store, self._store = self._store, None
            self._stop.set()
        if store is not None:
            store.close()

    def __enter__(self) -> "ResilientStore":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "attached" if self._store is not None else ("closed" if self._closed else "unavailable")
        return f"ResilientStore({self.socket!r}, {state})"


def wait_attached(store: ResilientStore, timeout: float) -> bool:
    """Wait until ``store`` is attached (tests, tools); False if ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while not store.available:
        if store._closed or time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
