"""The machinery of frame definitions: a frame is a frozen dataclass whose annotations are checked on decode.

`frame(tag)` turns a class into a frame: a frozen dataclass with wire tag `tag`, whose fields
get a compiled check each (int, Count, float, str, bool, bytes, Any, maps, lists, optional
values, and layout types with a `from_wire` such as Entry). A check either returns the value
(converted, for layout types) or raises BadFrame naming the field.

What a peer sends is never trusted before its check: no value is used as a key, compared, or
put in a message before its type is known, and messages about a peer's values go through
`short`, which never raises and never grows with what the peer sent.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from hwsync.errors import ProtocolError

#: a msgpack map with string keys whose values the protocol does not constrain (stats, state, handles)
Map = dict[str, Any]
#: a non-negative int below 2**63 (counts, sizes, indices, ids, pids): what C and torch take without overflow
Count = Annotated[int, "count"]
#: the range of a plain int field (msgpack carries -2**63 .. 2**64-1; the upper half fits no C int64)
INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1


class BadFrame(ProtocolError):
    """A frame that does not match its definition (or no definition at all).

    `sync` is the frame's sync id where it had a valid one, so a receiver can refuse a malformed
    offer with an error frame its sender matches to the sync (None otherwise).
    """

    sync: int | None = None


# -- field checks ----------------------------------------------------------------------------------


def value_to_wire(value: Any) -> Any:
    """A field's wire form: a layout object (one, or a list of them) becomes its wire value."""
    if isinstance(value, (list, tuple)) and value and hasattr(value[0], "to_wire"):
        return [v.to_wire() for v in value]
    if hasattr(value, "to_wire"):
        return value.to_wire()
    return value


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 60, 60
_SHORT.maxlist = _SHORT.maxdict = _SHORT.maxtuple = _SHORT.maxset = 4


def short(value: Any) -> str:
    """A repr of at most 80 characters, for messages about what a peer sent; never raises.

    reprlib stops at depth 3 and a few items, so a peer's deeply nested or huge value costs
    nothing to describe (a plain repr of 1000 nested lists raises RecursionError).
    """
    if type(value) is str and len(value) <= _SHORT.maxstring:  # a name, as most are: reprlib's text, 10x sooner
        text = repr(value)
        if len(text) <= _SHORT.maxstring:
            return text
    try:
        if isinstance(value, (str, bytes)) and len(value) > 80:
            value = value[:80]  # before repr: a 64 MiB string is not copied to say it is wrong
        text = _SHORT.repr(value)
    except Exception:  # noqa: BLE001 - a value that cannot be described is still described
        text = f"<a {type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def short_text(text: str, limit: int = 200) -> str:
    """`text` (a message built from a peer's values) cut to `limit` characters."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def wire_count(value: Any, what: str) -> int:
    """`value` if it is an int in 0 .. 2**63-1, else BadFrame naming `what`."""
    if type(value) is not int:  # bool is an int to Python, not to the protocol
        raise BadFrame(f"{what}: expected int, got {type(value).__name__}")
    if not 0 <= value <= INT_MAX:
        raise BadFrame(f"{what}: expected a non-negative int below 2**63, got {short(value)}")
    return value


def wire_shape(value: Any, what: str) -> tuple[int, ...]:
    """A shape from a list of non-negative ints (below 2**63), else BadFrame naming `what`."""
    if not isinstance(value, list) or any(type(d) is not int or not 0 <= d <= INT_MAX for d in value):
        raise BadFrame(f"{what}: a shape must be a list of non-negative ints, got {short(value)}")
    return tuple(value)


def _scalar(kind: type) -> Callable[[Any, str], Any]:
    def check(value: Any, what: str) -> Any:
        # bool is an int to Python but not to the protocol; an int is a fine float
        if type(value) is kind or (kind is float and type(value) is int):
            if kind is int and not INT_MIN <= value <= INT_MAX:  # type: ignore[operator]  # an int, checked above
                raise BadFrame(f"{what}: {short(value)} is outside the 64-bit signed range")
            if kind is float and not math.isfinite(value):  # type: ignore[arg-type]  # a number, checked above
                raise BadFrame(f"{what}: expected a finite number, got {short(value)}")
            return value
        raise BadFrame(f"{what}: expected {kind.__name__}, got {type(value).__name__}")

    return check


def checker(tp: Any) -> Callable[[Any, str], Any]:
    """A function that checks (and converts) one wire value against an annotation."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return lambda value, what: value
    if tp == Count:
        return wire_count
    if tp in (int, float, str, bool, bytes):
        return _scalar(tp)
    if origin in (types.UnionType, typing.Union) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        check = checker(inner)
        return lambda value, what: None if value is None else check(value, what)
    if origin is list:
        item = checker(args[0])

        def check_list(value: Any, what: str) -> list[Any]:
            if not isinstance(value, list):
                raise BadFrame(f"{what}: expected a list, got {type(value).__name__}")
            return [item(v, what) for v in value]

        return check_list
    if origin is dict:
        def check_map(value: Any, what: str) -> dict[str, Any]:
            if not isinstance(value, dict):
                raise BadFrame(f"{what}: expected a map, got {type(value).__name__}")
            bad = [k for k in value if type(k) is not str][:1]
            if bad:  # a key of another type would be compared with, or looked up by, str keys
                raise BadFrame(f"{what}: map keys must be str, got {short(bad[0])}")
            return value

        return check_map
    if hasattr(tp, "from_wire"):  # Entry, BucketSpec, TensorSpec
        def check_wire(value: Any, what: str) -> Any:
            try:
                return tp.from_wire(value)
            except BadFrame:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever a from_wire raised on a peer's value
                raise BadFrame(f"{what}: {short(value)} is not a {tp.__name__} ({short_text(str(exc))})") from None

        return check_wire
    raise TypeError(f"the protocol cannot check fields of type {tp!r}")



# -- frames ----------------------------------------------------------------------------------------


class Frame:
    """Base of every frame: `T` is its type tag on the wire; dataclass fields are its fields."""

    T: ClassVar[str]
    _checks: ClassVar[tuple[tuple[str, Callable[[Any, str], Any]], ...]]

    def validate(self) -> None:
        """Rules across fields (overridden where a frame has some)."""


_F = typing.TypeVar("_F", bound=type)


@typing.dataclass_transform(frozen_default=True)
def frame(tag: str) -> Callable[[_F], _F]:
    """Make a frozen dataclass frame with wire tag `tag` and compile its field checks."""

    def wrap(cls: _F) -> _F:
        made = typing.cast(_F, dataclass(frozen=True)(cls))
        made.T = tag  # type: ignore[attr-defined]
        hints = typing.get_type_hints(made, include_extras=True)  # keeps Count
        made._checks = tuple((f.name, checker(hints[f.name])) for f in dataclasses.fields(made))  # type: ignore[attr-defined]
        return made

    return wrap


# same host: receiver -> sender
