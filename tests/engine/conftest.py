"""Fixtures of the engine tests: an in-memory engine wrapped by an allocator over a store."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gdskv.engine import OffloadConfig, OffloadingAllocator, PageLayout
from gdskv.engine.memory import MemoryEngine

PAGE = 16


def layout(kind: str = "per_layer", **changes) -> PageLayout:
    fields = dict(page_size=PAGE, num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", kind=kind)
    fields.update(changes)
    return PageLayout(**fields)


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32_000, n)


@pytest.fixture
def make_allocator():
    """Build ``(engine, allocator)`` pairs; close every allocator at teardown."""
    made = []

    def _make(store=None, *, kind="per_layer", pages=32, model_id="model-a", layout_changes=None, **config):
        engine = MemoryEngine(layout(kind, **(layout_changes or {})), pages)
        alloc = OffloadingAllocator(engine, store, config=OffloadConfig(model_id=model_id, **config))
        made.append(alloc)
        return engine, alloc

    yield _make
    for alloc in made:
        alloc.close(drain=False)


class GatedStore:
    """A store whose puts wait for ``gate`` (a sync point), to observe saves in flight."""

    def __init__(self, store) -> None:
        self.store = store
        self.gate = threading.Event()
        self.put_started = threading.Event()

    def put(self, key, value, **kw):
        self.put_started.set()
        self.gate.wait(30)
        return self.store.put(key, value, **kw)

    def __getattr__(self, name):
        return getattr(self.store, name)
