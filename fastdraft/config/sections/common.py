"""Shared by the sections: the dtypes a recipe may name, the check that raises a user error, and
the declared range of every numeric key (`Range`, checked by `check_ranges` in each section's
__post_init__, so a value out of range is named by its dotted key when the config is built)."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from fastdraft.errors import FastdraftError

DTYPES = ("float32", "bfloat16", "float16")

#: The largest int a value reaching torch or numpy may be (a signed 64-bit one).
INT64_MAX = 2**63 - 1


def require(ok: bool, message: str) -> None:
    if not ok:
        raise FastdraftError(message)


class OutOfRange(FastdraftError):
    """A value outside its key's Range: `key` (dotted) `requirement` (e.g. 'must be > 0, got
    -1'); `field` is the key within its section, for callers that name the place themselves."""

    def __init__(self, key: str, field: str, requirement: str) -> None:
        super().__init__(f"{key} {requirement}")
        self.key, self.field, self.requirement = key, field, requirement


@dataclass(frozen=True, slots=True)
class Range:
    """The values a numeric key takes, declared on its field as `Annotated[int, Range(ge=1)]`:
    bounds ge / gt (lower, closed / open) and le / lt (upper), each optional; `allow`: special
    values outside them that mean something (-1: top_k off); `finite`: a float must be finite
    (nan and inf refused; False only where a field documents inf); `note`: what null means on
    an Optional field ('no clipping'), else what the special values mean ('-1: off'), said in
    the message. On a tuple field the range holds for each element."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    allow: Collection[float] = frozenset()   # kept as a frozenset
    finite: bool = True
    note: str = ""

    def __post_init__(self) -> None:
        if (self.ge is not None and self.gt is not None) or (self.le is not None
                                                            and self.lt is not None):
            raise TypeError("Range: give at most one lower (ge / gt) and one upper (le / lt) bound")
        object.__setattr__(self, "allow", frozenset(self.allow))

    @property
    def lower(self) -> tuple[float, bool] | None:
        """(bound, open) of the lower end, None: unbounded."""
        if self.gt is not None:
            return self.gt, True
        return None if self.ge is None else (self.ge, False)

    @property
    def upper(self) -> tuple[float, bool] | None:
        """(bound, open) of the upper end, None: unbounded."""
        if self.lt is not None:
            return self.lt, True
        return None if self.le is None else (self.le, False)

    def admits(self, value: float) -> bool:
        if value in self.allow:
            return True
        if isinstance(value, float) and self.finite and not math.isfinite(value):
            return False
        lower, upper = self.lower, self.upper
        above = lower is None or (value > lower[0] if lower[1] else value >= lower[0])
        below = upper is None or (value < upper[0] if upper[1] else value <= upper[0])
        return above and below

    def bounds(self) -> str:
        """'> 0', 'in [0, 1)', '>= 1' (no bounds: 'any number')."""
        lower, upper = self.lower, self.upper
        if lower is not None and upper is not None:
            return (f"in {'(' if lower[1] else '['}{_num(lower[0])}, {_num(upper[0])}"
                    f"{')' if upper[1] else ']'}")
        if lower is not None:
            return f"{'>' if lower[1] else '>='} {_num(lower[0])}"
        if upper is not None:
            return f"{'<' if upper[1] else '<='} {_num(upper[0])}"
        return "any number"

    def describe(self, optional: bool, value: Any = None) -> str:
        """What `must be` is followed by: '> 0 (or null: no clipping)', '-1 or >= 1 (-1: off)';
        'finite and > 0' for a non-finite `value`."""
        text = self.bounds()
        if isinstance(value, float) and not math.isfinite(value) and (self.lower is None
                                                                       or self.upper is None):
            text = f"finite and {text}"
        if self.allow:
            text = " or ".join([*map(_num, sorted(self.allow)), text])
        if optional:
            return f"{text} (or null: {self.note})" if self.note else f"{text} (or null)"
        return f"{text} ({self.note})" if self.note else text


#: A seed: numpy's and torch's generators take [0, 2**32).
SEED_RANGE = Range(ge=0, lt=2**32)


def _num(value: float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        value = int(value)
    if isinstance(value, int) and value >= 2**16 and (value & (value - 1)) == 0:
        return f"2**{value.bit_length() - 1}"
    return str(value)


def _show(value: Any) -> str:
    """A value as the recipe would spell it (true, null, 1.5)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value)


@dataclass(frozen=True, slots=True)
class _Ranged:
    name: str
    range: Range
    optional: bool


_RANGED: dict[type, tuple[_Ranged, ...]] = {}


def ranged_fields(cls: type) -> tuple[_Ranged, ...]:
    """The fields of config class `cls` that declare a Range (hints read once per class)."""
    found = _RANGED.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        found = tuple(r for f in dataclasses.fields(cls)
                      if (r := _ranged(f.name, hints[f.name])) is not None)
        _RANGED[cls] = found
    return found


def _ranged(name: str, hint: Any) -> _Ranged | None:
    """`Annotated[T, Range]`, `Annotated[T | None, Range]` or `Annotated[T, Range] | None`."""
    hint, optional = _strip_none(hint)
    if typing.get_origin(hint) is not typing.Annotated:
        return None
    base, *extras = typing.get_args(hint)
    ranges = [e for e in extras if isinstance(e, Range)]
    if not ranges:
        return None
    return _Ranged(name, ranges[0], optional or _strip_none(base)[1])


def _strip_none(hint: Any) -> tuple[Any, bool]:
    """(T, True) for `T | None`, else (hint, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(rest) < len(args):
            return rest[0], True
    return hint, False


def check_ranges(config: Any) -> None:
    """Every Range-annotated field of `config` within its range, else an OutOfRange naming
    the dotted key (the class's SECTION, e.g. 'rollout.spec', and the field)."""
    cls = type(config)
    where = getattr(cls, "SECTION", "")
    for spec in ranged_fields(cls):
        value = getattr(config, spec.name)
        if value is None and spec.optional:
            continue
        values = value if isinstance(value, tuple) else (value,)
        bad = next((v for v in values if not _admitted(spec.range, v)), _OK)
        if bad is _OK:
            continue
        if _is_number(bad) and spec.range.admits(bad):   # within the range, beyond int64
            need = f"must be at most {INT64_MAX} (a 64-bit integer)"
        else:
            each = " each" if len(values) > 1 else ""
            need = f"must{each} be {spec.range.describe(spec.optional, bad)}"
        key = f"{where}.{spec.name}" if where else spec.name
        raise OutOfRange(key, spec.name, f"{need}, got {_show(value)}")


_OK = object()


def _admitted(rng: Range, value: Any) -> bool:
    return _is_number(value) and rng.admits(value) and (
        not isinstance(value, int) or -INT64_MAX - 1 <= value <= INT64_MAX)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
