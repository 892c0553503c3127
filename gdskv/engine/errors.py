"""Errors of the engine integration. Every one is a :class:`gdskv.GdskvError`.

Misses stay return values (a lookup returns fewer cached tokens, a load loads fewer pages);
these errors mark misuse that would otherwise copy KV of the wrong shape into an engine.
"""

from __future__ import annotations

from gdskv.errors import GdskvError, NoSpaceError


class LayoutMismatchError(GdskvError):
    """Two parties disagree on the page geometry: page size, layout, dtype or namespace
    (for example an allocator built for one layout wrapping an engine with another)."""


class PoolExhaustedError(NoSpaceError):
    """The engine's page pool cannot supply the pages asked for: every page is in use by a
    running request (idle cached pages are evicted first)."""
