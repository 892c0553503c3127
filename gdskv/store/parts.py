"""The parts of an open store, as :attr:`gdskv.Store.parts` hands them out."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from gdskv.store.activity import Activity
from gdskv.store.dram_room import DramRoom
from gdskv.store.promoter import Promoter
from gdskv.tiers.dram import DramTier


@dataclasses.dataclass(frozen=True)
class StoreParts:
    """The parts of an open store (:attr:`Store.parts`), for tests and tools that look
    inside or inject faults. They are the store's own: call their methods only under
    ``lock`` where their docs say so, and never move data around the store through them."""

    lock: "threading.RLock"
    dram: DramTier
    nvme: Any  #: the NVMe backend (a :class:`~gdskv.tiers.backends.null.NullBackend` without an SSD tier)
    hbm: Any  #: the :class:`gdskv.tiers.hbm.HbmTier`, or None without an HBM tier
    offloader: Any
    promoter: Promoter
    room: DramRoom
    activity: Activity
