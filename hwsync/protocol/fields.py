"""The machinery of frame definitions: a frame is a frozen dataclass whose annotations are checked on decode.

`frame(tag)` turns a class into a frame: a frozen dataclass with wire tag `tag`, whose fields
get a compiled check each (int, float, str, bool, bytes, Any, maps, lists, optional values, and
layout types with a `from_wire` such as Entry). A check either returns the value (converted,
for layout types) or raises BadFrame naming the field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from hwsync.errors import ProtocolError

#: a msgpack map with string keys whose values the protocol does not constrain (stats, state, handles)
Map = dict[str, Any]


class BadFrame(ProtocolError):
    """A frame that does not match its definition (or no definition at all)."""


# -- field checks ----------------------------------------------------------------------------------


def value_to_wire(value: Any) -> Any:
    """A field's wire form: lists of layout objects become lists of their wire lists."""
    if isinstance(value, (list, tuple)) and value and hasattr(value[0], "to_wire"):
        return [v.to_wire() for v in value]
    return value


def short(value: Any) -> str:
    """A repr cut to 80 characters, for messages about what a peer sent."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def wire_count(value: Any, what: str) -> int:
    """`value` if it is a non-negative int, else BadFrame naming `what`."""
    if type(value) is not int or value < 0:
        raise BadFrame(f"{what}: expected a non-negative int, got {short(value)}")
    return value


def wire_shape(value: Any, what: str) -> tuple[int, ...]:
    """A shape from a list of non-negative ints, else BadFrame naming `what`."""
    if not isinstance(value, list) or any(type(d) is not int or d < 0 for d in value):
        raise BadFrame(f"{what}: a shape must be a list of non-negative ints, got {short(value)}")
    return tuple(value)


def _scalar(kind: type) -> Callable[[Any, str], Any]:
    def check(value: Any, what: str) -> Any:
        # bool is an int to Python but not to the protocol; an int is a fine float
        if type(value) is kind or (kind is float and type(value) is int):
            return value
        raise BadFrame(f"{what}: expected {kind.__name__}, got {type(value).__name__}")

    return check


def checker(tp: Any) -> Callable[[Any, str], Any]:
    """A function that checks (and converts) one wire value against an annotation."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return lambda value, what: value
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
            return value

        return check_map
    if hasattr(tp, "from_wire"):  # Entry, BucketSpec, TensorSpec
        def check_wire(value: Any, what: str) -> Any:
            try:
                return tp.from_wire(value)
            except BadFrame:
                raise
            except Exception as exc:
                raise BadFrame(f"{what}: {short(value)} is not a {tp.__name__} ({exc})") from None

        return check_wire
    raise TypeError(f"the protocol cannot check fields of type {tp!r}")



# -- frames ----------------------------------------------------------------------------------------


class Frame:
    """Base of every frame: `T` is its type tag on the wire; dataclass fields are its fields."""

    T: ClassVar[str]
    _checks: ClassVar[tuple[tuple[str, Callable[[Any, str], Any]], ...]]

    def validate(self) -> None:
        """Rules across fields (overridden where a frame has some)."""


def frame(tag: str) -> Callable[[type], type]:
    """Make a frozen dataclass frame with wire tag `tag` and compile its field checks."""

    def wrap(cls: type) -> type:
        cls = dataclass(frozen=True)(cls)
        cls.T = tag
        hints = typing.get_type_hints(cls)
        cls._checks = tuple((f.name, checker(hints[f.name])) for f in dataclasses.fields(cls))
        return cls

    return wrap


# same host: receiver -> sender
