"""Errors of the trace tools.

A malformed trace line raises :class:`TraceFormatError` carrying the path, the 1-based line
number and what was wrong, unless the reader was asked to skip bad lines (then they are
counted in :attr:`gdskv.trace.Trace.skipped`).
"""

from __future__ import annotations

from gdskv.errors import GdskvError


class TraceFormatError(GdskvError):
    """A trace file (or one of its lines) does not follow its format."""
