"""Trace readers: Mooncake, Qwen-Bailian and the generic gdskv format, all JSON lines.

Formats (one JSON object per line; blank lines are ignored):

- ``mooncake``: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (one
  int per 512-token block, already prefix-chained). Block size 512 tokens.
- ``qwen`` (Qwen-Bailian): ``chat_id``, ``parent_chat_id``, ``timestamp`` (s),
  ``input_length``, ``output_length``, ``type``, ``turn``, ``hash_ids`` (one int per 16-token
  block, a hash of that block's tokens alone: NOT chained — the reader chains them, see
  :class:`gdskv.trace.model.BlockChainer`). Block size 16 tokens. ``chat_id``, ``timestamp``,
  ``input_length``, ``output_length`` and ``hash_ids`` are required; the others are checked
  when present.
- ``generic``: an optional header line
  ``{"format": "gdskv-trace", "version": 1, "block_tokens": 16, "chained": true, "time_unit": "s"}``
  then ``{"timestamp": 1.5, "blocks": [...]}`` lines, with optional ``input_length`` and
  ``output_length``. Block ids are ints or strings; ``chained: false`` asks the reader to
  chain them; ``time_unit`` is ``"s"`` (default) or ``"ms"``. Documented in docs/trace.md.

Contract of :func:`read_trace`: returns a :class:`Trace` whose requests are sorted by
timestamp (ties keep file order) and whose block ids are prefix-chained ints. A malformed
line raises :class:`TraceFormatError` with the path and the 1-based line number, or, with
``skip_bad=True``, is skipped and counted. A missing file raises :class:`gdskv.IoError`.
Files ending in ``.gz`` are read through gzip.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from typing import Any, Callable, Dict, IO, Iterator, List, Optional, Tuple

from gdskv.errors import ConfigError, IoError
from gdskv.trace.errors import TraceFormatError
from gdskv.trace.model import BlockChainer, BlockInterner, Request, Trace, sort_requests

#: Skipped lines remembered (line number and reason) for the report.
SKIPPED_KEPT = 10

GENERIC_FORMAT_NAME = "gdskv-trace"
GENERIC_VERSION = 1


_INT_ONLY = frozenset((int,))


class _BadLine(Exception):
    """Internal: one line is malformed (turned into TraceFormatError with its position)."""


def _field(obj: Dict[str, Any], name: str) -> Any:
    try:
        return obj[name]
    except KeyError:
        raise _BadLine(f"missing field {name!r}") from None


def _number(obj: Dict[str, Any], name: str) -> float:
    value = _field(obj, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _BadLine(f"{name!r} must be a finite number, got {value!r}")
    return float(value)


def _count(obj: Dict[str, Any], name: str, default: Optional[int] = None) -> int:
    if default is not None and name not in obj:
        return default
    value = _field(obj, name)
    if type(value) is not int or value < 0:
        raise _BadLine(f"{name!r} must be a non-negative integer, got {value!r}")
    return value


def _int_list(obj: Dict[str, Any], name: str) -> List[int]:
    value = _field(obj, name)
    if not isinstance(value, list):
        raise _BadLine(f"{name!r} must be a list of integers, got {type(value).__name__}")
    if not _INT_ONLY.issuperset(map(type, value)):  # the fast check; find the culprit only on failure
        for i, x in enumerate(value):
            if type(x) is not int:
                raise _BadLine(f"{name!r}[{i}] must be an integer, got {x!r}")
    return value


class _Reader:
    """Base: parse one decoded line into a Request (or None for a header)."""

    name = "base"
    block_tokens = 16

    def parse(self, obj: Dict[str, Any], lineno: int) -> Optional[Request]:  # pragma: no cover
        raise NotImplementedError


class MooncakeReader(_Reader):
    name = "mooncake"
    block_tokens = 512

    def parse(self, obj: Dict[str, Any], lineno: int) -> Optional[Request]:
        ts = _number(obj, "timestamp")
        if ts < 0:
            raise _BadLine(f"'timestamp' must not be negative, got {ts!r}")
        return Request(
            timestamp=ts / 1000.0,
            input_length=_count(obj, "input_length"),
            output_length=_count(obj, "output_length"),
            blocks=_int_list(obj, "hash_ids"),
        )


class QwenReader(_Reader):
    name = "qwen"
    block_tokens = 16

    def __init__(self) -> None:
        self._chainer = BlockChainer()

    def parse(self, obj: Dict[str, Any], lineno: int) -> Optional[Request]:
        _count_any_int(obj, "chat_id")
        if "parent_chat_id" in obj:
            _count_any_int(obj, "parent_chat_id")
        if "turn" in obj:
            _count(obj, "turn")
        if "type" in obj and not isinstance(obj["type"], str):
            raise _BadLine(f"'type' must be a string, got {obj['type']!r}")
        ts = _number(obj, "timestamp")
        if ts < 0:
            raise _BadLine(f"'timestamp' must not be negative, got {ts!r}")
        input_length = _count(obj, "input_length")
        output_length = _count(obj, "output_length")
        hashes = _int_list(obj, "hash_ids")
        return Request(
            timestamp=ts, input_length=input_length, output_length=output_length, blocks=self._chainer.chain(hashes)
        )


def _count_any_int(obj: Dict[str, Any], name: str) -> int:
    value = _field(obj, name)
    if type(value) is not int:
        raise _BadLine(f"{name!r} must be an integer, got {value!r}")
    return value


class GenericReader(_Reader):
    name = "generic"
    block_tokens = 16

    def __init__(self) -> None:
        self.chained = True
        self.scale = 1.0
        self._seen_request = False
        self._chainer = BlockChainer()
        self._interner = BlockInterner()

    def parse(self, obj: Dict[str, Any], lineno: int) -> Optional[Request]:
        if "format" in obj:
            if self._seen_request:
                raise _BadLine("the header must be the first line")
            self._header(obj)
            return None
        self._seen_request = True
        ts = _number(obj, "timestamp") * self.scale
        if ts < 0:
            raise _BadLine(f"'timestamp' must not be negative, got {ts!r}")
        raw = _field(obj, "blocks")
        if not isinstance(raw, list):
            raise _BadLine(f"'blocks' must be a list, got {type(raw).__name__}")
        for i, x in enumerate(raw):
            if not (type(x) is int or isinstance(x, str)):
                raise _BadLine(f"'blocks'[{i}] must be an integer or a string, got {x!r}")
        blocks = self._chainer.chain(raw) if not self.chained else self._interner.intern(raw)
        return Request(
            timestamp=ts,
            input_length=_count(obj, "input_length", default=len(blocks) * self.block_tokens),
            output_length=_count(obj, "output_length", default=0),
            blocks=blocks,
        )

    def _header(self, obj: Dict[str, Any]) -> None:
        if obj.get("format") != GENERIC_FORMAT_NAME:
            raise _BadLine(f"header 'format' must be {GENERIC_FORMAT_NAME!r}, got {obj.get('format')!r}")
        version = obj.get("version", GENERIC_VERSION)
        if version != GENERIC_VERSION:
            raise _BadLine(f"unsupported generic trace version {version!r} (this build reads {GENERIC_VERSION})")
        if "block_tokens" in obj:
            bt = obj["block_tokens"]
            if type(bt) is not int or bt <= 0:
                raise _BadLine(f"'block_tokens' must be a positive integer, got {bt!r}")
            self.block_tokens = bt
        chained = obj.get("chained", True)
        if not isinstance(chained, bool):
            raise _BadLine(f"'chained' must be true or false, got {chained!r}")
        self.chained = chained
        unit = obj.get("time_unit", "s")
        if unit not in ("s", "ms"):
            raise _BadLine(f"'time_unit' must be 's' or 'ms', got {unit!r}")
        self.scale = 1.0 if unit == "s" else 1e-3
        unknown = set(obj) - {"format", "version", "block_tokens", "chained", "time_unit"}
        if unknown:
            raise _BadLine(f"unknown header fields {sorted(unknown)}")


#: Readers by format name; "auto" picks one from the first line.
READERS: Dict[str, Callable[[], _Reader]] = {
    MooncakeReader.name: MooncakeReader,
    QwenReader.name: QwenReader,
    GenericReader.name: GenericReader,
}
FORMATS = ("auto",) + tuple(READERS)


def detect_format(obj: Any) -> Optional[str]:
    """The format a decoded first line belongs to, or None if it matches none."""
    if not isinstance(obj, dict):
        return None
    if "format" in obj or "blocks" in obj:
        return GenericReader.name
    if "chat_id" in obj or "parent_chat_id" in obj:
        return QwenReader.name
    if "hash_ids" in obj:
        return MooncakeReader.name
    return None


def _open(path: str) -> IO[str]:
    try:
        if path.endswith(".gz"):
            return gzip.open(path, "rt", encoding="utf-8")
        return open(path, "r", encoding="utf-8")
    except OSError as exc:
        raise IoError(f"cannot open trace: {exc.strerror}", path=path, errno=exc.errno) from exc


def _lines(f: IO[str], path: str) -> Iterator[Tuple[int, str]]:
    lineno = 0
    try:
        for lineno, line in enumerate(f, 1):
            yield lineno, line
    except UnicodeDecodeError as exc:
        raise TraceFormatError("trace is not UTF-8 text", path=path, line=lineno + 1, cause=str(exc)) from exc
    except (OSError, EOFError) as exc:  # e.g. a truncated .gz
        raise TraceFormatError("trace could not be read to the end", path=path, line=lineno + 1, cause=str(exc)) from exc


def read_trace(
    path: "str | os.PathLike[str]",
    *,
    format: str = "auto",  # noqa: A002 - the user-facing word
    skip_bad: bool = False,
    limit: Optional[int] = None,
) -> Trace:
    """Read a trace file. See the module docstring for formats and error handling.

    ``limit`` stops after that many requests (in file order), for quick looks at big traces.
    """
    path = os.fspath(path)
    if format not in FORMATS:
        raise ConfigError("unknown trace format", got=format, valid=", ".join(FORMATS))
    reader: Optional[_Reader] = None if format == "auto" else READERS[format]()
    requests: List[Request] = []
    skipped = 0
    kept: List[Tuple[int, str]] = []
    loads = json.loads
    with _open(path) as f:
        for lineno, line in _lines(f, path):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                try:
                    obj = loads(line)
                except ValueError as exc:
                    raise _BadLine(f"invalid JSON: {exc}") from None
                if not isinstance(obj, dict):
                    raise _BadLine(f"expected a JSON object, got {type(obj).__name__}")
                if reader is None:
                    name = detect_format(obj)
                    if name is None:
                        raise TraceFormatError(
                            "cannot tell the trace format from its first line; pass --format",
                            path=path,
                            line=lineno,
                            fields=sorted(obj)[:12],
                            valid=", ".join(READERS),
                        )
                    reader = READERS[name]()
                request = reader.parse(obj, lineno)
            except _BadLine as exc:
                if not skip_bad:
                    raise TraceFormatError(
                        f"malformed {reader.name if reader else 'trace'} line: {exc}", path=path, line=lineno
                    ) from None
                skipped += 1
                if len(kept) < SKIPPED_KEPT:
                    kept.append((lineno, str(exc)))
                continue
            if request is not None:
                requests.append(request)
    if reader is None or not requests:
        raise TraceFormatError(
            "trace holds no valid request", path=path, skipped=skipped, format=reader.name if reader else format
        )
    return Trace(
        requests=sort_requests(requests),
        format=reader.name,
        block_tokens=reader.block_tokens,
        path=path,
        skipped=skipped,
        skipped_lines=tuple(kept),
    )
