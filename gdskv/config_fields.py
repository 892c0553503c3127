"""The field checks every config class shares: sizes, choices, counts, flags and waits.

Each check raises a :class:`ConfigError` naming the field it was given. Sizes are bytes
inside the library; strings such as ``"8GiB"`` are parsed at the edge with
:func:`parse_size`.

It also holds the names a config and the component it configures both check (eviction
policies, file_per_key's sync modes), so that a component never imports a config module
that builds it. This module is a leaf below every config module: it imports nothing of
gdskv but :mod:`gdskv.errors`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping, Optional, Type, TypeVar, Union

from gdskv.errors import ConfigError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": KiB,
    "m": 1000**2, "mb": 1000**2, "mib": MiB,
    "g": 1000**3, "gb": 1000**3, "gib": GiB,
    "t": 1000**4, "tb": 1000**4, "tib": TiB,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")

Size = Union[int, str]

#: Object-level eviction policies (gdskv.tiers.policies registers them under these names).
EVICTION_POLICIES = ("lru", "fifo")
#: How the file_per_key backend makes its files durable (see backend_config.FilePerKeyConfig.sync).
FILE_PER_KEY_SYNC_MODES = ("filesystem", "file")

#: The longest wait a setting or a ``timeout`` may ask for: a year (Python's own limit on a
#: wait is about 292 years; past it a wait raises OverflowError).
MAX_WAIT_S = 365 * 24 * 3600.0


def parse_size(value: Size, *, field: str = "size") -> int:
    """Parse ``"2GiB"``, ``"512 MB"``, ``"4096"`` or an int into a byte count (>= 0).

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB)
    powers of 1000. Raises :class:`ConfigError` naming ``field`` for anything else.
    """
    if isinstance(value, bool):
        raise ConfigError("size must be an int or a string like '8GiB'", field=field, got=value)
    if isinstance(value, int):
        if value < 0:
            raise ConfigError("size must not be negative", field=field, got=value)
        return value
    if not isinstance(value, str):
        raise ConfigError("size must be an int or a string like '8GiB'", field=field, got=value)
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError("unparsable size; use e.g. '512MiB', '8GiB', '4096'", field=field, got=value)
    try:
        return int(float(match.group(1)) * _UNITS[unit])
    except OverflowError:
        raise ConfigError("size too large", field=field, got=value[:40]) from None


def format_size(n: float) -> str:
    """Render a byte count with a binary unit, e.g. ``2.0 GiB``."""
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def check_choice(name: str, value: str, choices: tuple[str, ...], *, field: Optional[str] = None) -> str:
    """Return ``value`` if it is one of ``choices``, else raise a ConfigError listing them
    (and naming ``field``, when given)."""
    if value not in choices:
        named = {} if field is None else {"field": field}
        raise ConfigError(f"unknown {name}", **named, got=value, valid=", ".join(choices))
    return value


def check_bytes(field: str, value: Any) -> int:
    """A byte count >= 0, from an int or a string like ``"8GiB"``."""
    if isinstance(value, str):
        return parse_size(value, field=field)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError("must be a non-negative byte count", field=field, got=value)
    return value


def check_positive(field: str, value: Any, *, maximum: Optional[int] = None, why: str = "") -> int:
    """An int > 0 (and <= ``maximum``, when given; ``why`` says where the limit comes from)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError("must be a positive integer", field=field, got=value)
    if maximum is not None and value > maximum:
        raise ConfigError(f"must be at most {maximum}{why}", field=field, got=value)
    return value


def check_count(field: str, value: Any) -> int:
    """An int >= 0."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError("must be an integer >= 0", field=field, got=value)
    return value


def check_flag(field: str, value: Any) -> bool:
    """True or False (not 1, 0 or a string)."""
    if not isinstance(value, bool):
        raise ConfigError("must be True or False", field=field, got=value)
    return value


def check_finite(field: str, value: Any) -> float:
    """A finite int or float (not a bool or a string)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError("must be a finite number", field=field, got=value)
    return value


def check_wait(field: str, value: Any, *, positive: bool = False) -> float:
    """A wait in seconds: finite, >= 0 (> 0 with ``positive``) and at most :data:`MAX_WAIT_S`."""
    check_finite(field, value)
    if value > MAX_WAIT_S:
        raise ConfigError(f"must be at most {MAX_WAIT_S:.0f} seconds (a year)", field=field, got=value)
    if positive and value <= 0:
        raise ConfigError("must be positive", field=field, got=value)
    if value < 0:
        raise ConfigError("must be >= 0", field=field, got=value)
    return value


C = TypeVar("C")


def registered(kind: str, name: str, registry: Mapping[str, C]) -> C:
    """``registry[name]``, or a ConfigError naming ``kind`` and listing the registered names."""
    check_choice(kind, name, tuple(sorted(registry)))
    return registry[name]


def construct(cls: Type[C], options: Mapping[str, Any], *, what: str) -> C:
    """``cls(**options)`` for a config dataclass, refusing an option it does not have with
    a ConfigError that lists the ones it has (``what`` names the component in the message)."""
    valid = sorted(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(f"unknown option of {what}", got=", ".join(unknown), valid=", ".join(valid))
    return cls(**options)
