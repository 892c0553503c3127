"""What a node serves on the data plane: its store (:class:`StoreProvider`).

- READ: DRAM values go out first, straight from the arena (pinned with
  :meth:`Store.borrow` while they are sent); the rest is read from NVMe into the
  connection's staging buffer (verified by the store) and streamed, in rounds of at most
  ``staging_round_bytes``. A key that is in neither tier is a clean miss; the master is
  told to forget that replica (it was stale).
- WRITE: each value is checked against the CRC32C the writer sent, then put into the store;
  the reply goes out once the master has recorded the new replicas.
- REMOVE: unregister first, then delete from every tier.
- PULL: fetch keys from the cluster (best replica first) into the store.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional

from gdskv.errors import CorruptionError, GdskvError, InvalidValueError, KeyExistsError, NoSpaceError
from gdskv.master.model import DRAM, NVME
from gdskv.store import Store
from gdskv.transport.base import Provider, ServedItem, Staging
from gdskv.transport.frames import ItemStatus, value_crc

if TYPE_CHECKING:
    from gdskv.node.registrar import Registrar

log = logging.getLogger(__name__)


class StoreProvider(Provider):
    def __init__(
        self,
        store: Store,
        registrar: "Registrar",
        *,
        flush_timeout_s: float = 10.0,
        staging_round_bytes: int = 64 << 20,
        pull: Optional[Callable[[List[bytes]], List[ItemStatus]]] = None,
    ) -> None:
        self.store = store
        self.registrar = registrar
        self.flush_timeout_s = flush_timeout_s
        self.staging_round_bytes = staging_round_bytes
        self._pull = pull

    # ------------------------------------------------------------------ READ

    def read(self, keys: List[bytes], rooms: List[int], staging: Staging) -> Iterator[List[ServedItem]]:
        started = time.monotonic()
        rest: List[int] = []
        with self.store.borrow(keys) as borrowed:
            items: List[ServedItem] = []
            for i, found in enumerate(borrowed):
                if found is None:
                    rest.append(i)
                    continue
                view, crc = found
                if view.nbytes > rooms[i]:
                    items.append(ServedItem(i, ItemStatus.TOO_SMALL, size=view.nbytes))
                else:
                    items.append(ServedItem(i, ItemStatus.OK, view, crc, tier=DRAM))
            yield items  # sent while the entries are pinned
        missing: List[bytes] = []
        for group in self._rounds(rest, rooms):
            yield self._read_nvme(keys, rooms, group, staging, missing)
        if missing:
            self.registrar.stale(missing, since=started)

    def _slot(self, room: int) -> int:
        return min(room, self.staging_round_bytes)

    def _rounds(self, idx: List[int], rooms: List[int]) -> Iterator[List[int]]:
        group: List[int] = []
        total = 0
        for i in idx:
            slot = self._slot(rooms[i])
            if group and total + slot > self.staging_round_bytes:
                yield group
                group, total = [], 0
            group.append(i)
            total += slot
        if group:
            yield group

    def _read_nvme(
        self, keys: List[bytes], rooms: List[int], group: List[int], staging: Staging, missing: List[bytes]
    ) -> List[ServedItem]:
        """Read a group into staging slots (at most ``staging_round_bytes`` each, whatever room
        the reader claims); a value larger than its slot gets a buffer of its own size."""
        slots = [self._slot(rooms[i]) for i in group]
        buf = staging.get(sum(slots))
        outs: List[memoryview] = []
        pos = 0
        for slot in slots:
            outs.append(buf[pos : pos + slot])
            pos += slot
        ks = [keys[i] for i in group]
        try:
            sizes: List[Optional[int]] = self.store.batch_get_into(ks, outs)
        except InvalidValueError:  # a value is larger than its slot: go key by key
            sizes = [self._read_one(k, outs, j, rooms[group[j]]) for j, k in enumerate(ks)]
        items: List[ServedItem] = []
        for j, i in enumerate(group):
            n = sizes[j]
            if isinstance(n, ServedItem):
                n.index = i
                items.append(n)
            elif n is None:
                items.append(ServedItem(i, ItemStatus.MISS))
                missing.append(keys[i])
            else:
                view = outs[j][:n]
                items.append(ServedItem(i, ItemStatus.OK, view, value_crc(keys[i], view), tier=NVME))
        return items

    def _read_one(self, key: bytes, outs: List[memoryview], j: int, room: int) -> "Optional[int] | ServedItem":
        try:
            return self.store.get_into(key, outs[j])
        except InvalidValueError as exc:
            size = int(exc.context.get("size", 0))
        if size > room:
            return ServedItem(0, ItemStatus.TOO_SMALL, size=size)
        outs[j] = memoryview(bytearray(size))
        try:
            return self.store.get_into(key, outs[j])
        except InvalidValueError:  # replaced by a larger value meanwhile
            return None

    # ------------------------------------------------------------------ WRITE / REMOVE / PULL

    def write(self, keys: List[bytes], values: List[memoryview], crcs: List[int]) -> List[ItemStatus]:
        statuses: List[ItemStatus] = []
        for key, value, crc in zip(keys, values, crcs):
            if value_crc(key, value) != crc:
                statuses.append(ItemStatus.CORRUPT)
                continue
            try:
                self.registrar.note_put([key])
                self.store.put(key, value)
                statuses.append(ItemStatus.OK)
            except KeyExistsError:
                statuses.append(ItemStatus.EXISTS)
            except NoSpaceError:
                statuses.append(ItemStatus.NO_SPACE)
            except (InvalidValueError, CorruptionError):
                statuses.append(ItemStatus.INVALID)
            except GdskvError as exc:
                log.warning("gdskv-node: put of %r failed: %s", key[:64], exc)
                statuses.append(ItemStatus.ERROR)
        if ItemStatus.OK in statuses:
            self.registrar.flush(self.flush_timeout_s)
        return statuses

    def remove(self, keys: List[bytes]) -> List[ItemStatus]:
        self.registrar.removing(keys)
        statuses = [ItemStatus.OK if self.store.remove(k) else ItemStatus.MISS for k in keys]
        # A bucket that reached SSD meanwhile (a remove waits for one that holds its key)
        # registered its other keys again: unregister once more, now that they are gone.
        self.registrar.removing(keys)
        return statuses

    def pull(self, keys: List[bytes]) -> List[ItemStatus]:
        if self._pull is None:
            return [ItemStatus.ERROR] * len(keys)
        return self._pull(keys)
