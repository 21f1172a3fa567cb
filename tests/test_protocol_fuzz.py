"""Fuzzing the protocol: whatever a peer sends, decode raises BadFrame and nothing else, and the gate drops it.

Deterministic (no seed to chase): every field of every frame type of every frame set (TO_SENDER,
TO_RECEIVER, TO_HUB, TO_RANK) is replaced by each of a list of hostile values (wrong types, the
largest ints msgpack carries, negative counts, nested containers, deep nesting, unhashable keys,
NaN and infinities, bytes for str, ext types), removed, or joined by an unknown field; the items
of list fields (bucket entries, references, segments, manifest items, planned buckets) are fuzzed
the same way one position at a time; then a seeded generator of random nested values goes over
every field again. msgpack carries no int above 2**64 - 1, so the "huge ints" are 2**63 .. 2**64 - 1.

Each message must decode to a frame whose every field has its declared type, or raise BadFrame;
through a Gate (the sender's and the hub's bound socket) it must be admitted or dropped, never
raise; through the receiver's and a rank's decode (a Refused is read raw, in any version) it
may only raise ProtocolError. A failure names the frame, the field and the value.
"""

from __future__ import annotations

import logging
import math
import random
import types
import typing
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest

from hwsync.errors import ProtocolError
from hwsync.control.sockets import Gate
from hwsync.protocol import TO_HUB, TO_RANK, TO_RECEIVER, TO_SENDER, Accept, BadFrame, Count, Frame, Ready, RankReady, \
    decode, encode, peek, refused_reason
from hwsync.protocol.fields import INT_MAX, INT_MIN

from test_protocol import _example

SETS = {"to_sender": TO_SENDER, "to_receiver": TO_RECEIVER, "to_hub": TO_HUB, "to_rank": TO_RANK}
TOKEN = "0123456789abcdef0123456789abcdef"


@dataclass(frozen=True)
class Raw:
    """A value given as msgpack bytes: what msgpack's packer refuses to make (nesting deeper than 511)."""

    data: bytes


def _deep(depth: int, leaf: bytes = b"\xc0") -> Raw:
    return Raw(b"\x91" * depth + leaf)  # [[[...[leaf]...]]]


#: values no field of any frame takes (or takes only where it is Any / a map's value)
HOSTILE: list[Any] = [
    None, True, False, 0, 1, -1, INT_MIN, INT_MAX, INT_MAX + 1, (1 << 64) - 1,
    0.5, -0.0, math.nan, math.inf, -math.inf, 1e308,
    "", "x", "x" * 70_000, "../../etc/passwd", "/etc/passwd", "\x00", "é\u202e",
    b"", b"bytes", b"\xff" * 70_000,
    [], [1], [None], ["x", 1], [[[]]], [math.nan], list(range(5000)),
    {}, {"a": 1}, {"t": {"t": {}}}, {1: 2}, {b"k": 1}, {None: 1}, {1.5: 2}, {math.nan: 1},
    _deep(1000), _deep(600, msgpack.packb({"a": 1})), _deep(2000),
    msgpack.ExtType(5, b"payload"), Raw(b"\xd6\xff" + b"\x00" * 4),  # an ext type; a timestamp (ext -1)
]

#: raw msgpack bytes decode must refuse: maps whose keys are unhashable once unpacked (arrays, maps)
RAW_UNHASHABLE_KEYS = [
    b"\x81\x91\x01\x02",  # {[1]: 2}
    b"\x82\xa1t\xa5ready\x81\x80\x01",  # {"t": "ready", {}: 1}
    b"\x81\xa1t\x81\x91\x01\x01",  # {"t": {[1]: 1}}
]


def _packed(value: Any) -> bytes | None:
    """`value` as msgpack (a map's Raw values spliced in), or None where msgpack cannot carry it."""
    try:
        if isinstance(value, Raw):
            return value.data
        if isinstance(value, dict) and any(isinstance(v, Raw) for v in value.values()):
            header = bytes([0x80 | len(value)]) if len(value) < 16 else b"\xde" + len(value).to_bytes(2, "big")
            return header + b"".join(_packed(k) + _packed(v) for k, v in value.items())
        return msgpack.packb(value, use_bin_type=True)
    except (ValueError, OverflowError, TypeError):
        return None  # msgpack itself cannot carry it (an int above 2**64 - 1): no peer can send it


def _wire(frame: Frame) -> dict[str, Any]:
    return msgpack.unpackb(encode(frame), raw=False)


@dataclass
class Case:
    """One fuzzed message: what was changed, and its bytes."""

    what: str
    data: bytes


def _cases(frames: dict[str, type[Frame]]) -> list[Case]:
    """Every hostile change of every field (and of every list item) of every frame in `frames`."""
    out: list[Case] = []
    for tag, cls in frames.items():
        base = _wire(_example(cls))
        for name in [*base, "t"]:
            for value in HOSTILE:
                data = _packed({**base, name: value})
                if data is not None:
                    out.append(Case(f"{tag}.{name} = {_describe(value)}", data))
            if isinstance(base.get(name), list) and base[name]:
                out += _item_cases(tag, base, name)
        for name in base:
            if name != "t":
                out.append(Case(f"{tag} without {name}", _packed({k: v for k, v in base.items() if k != name})))
        out.append(Case(f"{tag} with an unknown field", _packed({**base, "extra": {"x": [1]}})))
        out.append(Case(f"{tag} with a non-str key", _packed({**base, 7: 1})))
    out += [Case(f"raw {data!r}", data) for data in RAW_UNHASHABLE_KEYS]
    return out


def _item_cases(tag: str, base: dict[str, Any], name: str) -> list[Case]:
    """Fuzz the first item of list field `name`, and each position inside it when it is a list itself."""
    out = []
    item = base[name][0]
    for value in HOSTILE[::3]:
        data = _packed({**base, name: [value, *base[name][1:]]})
        if data is not None:
            out.append(Case(f"{tag}.{name}[0] = {_describe(value)}", data))
        if isinstance(item, list):
            for i in range(len(item)):
                changed = list(item)
                changed[i] = value
                data = _packed({**base, name: [changed]})
                if data is not None:
                    out.append(Case(f"{tag}.{name}[0][{i}] = {_describe(value)}", data))
    return out


def _describe(value: Any) -> str:
    text = repr(value) if not isinstance(value, list) or len(repr(value)) < 60 else f"<list of {len(value)}>"
    return text[:60]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([rng.randrange(-(1 << 63), 1 << 64), rng.randrange(-3, 3), INT_MAX + rng.randrange(3)])
    if kind == 2:
        return rng.choice([rng.uniform(-1e9, 1e9), math.nan, math.inf])
    if kind == 3:
        return "".join(rng.choice("ab/.-\x00é") for _ in range(rng.randrange(12)))
    if kind == 4:
        return rng.randbytes(rng.randrange(12))
    if kind == 5:
        return msgpack.ExtType(rng.randrange(8), rng.randbytes(rng.randrange(12)))
    if kind in (6, 7):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["t", "name", "k", 1, b"b", None]
    return {rng.choice(keys): _random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _random_cases(frames: dict[str, type[Frame]], rounds: int = 40) -> list[Case]:
    rng = random.Random(32)
    out = []
    for tag, cls in frames.items():
        base = _wire(_example(cls))
        for name in base:
            for _ in range(rounds):
                value = _random_value(rng)
                data = _packed({**base, name: value})
                if data is not None:
                    out.append(Case(f"{tag}.{name} = random {_describe(value)}", data))
    return out


# -- what a decoded frame must be ------------------------------------------------------------------


def _conforms(value: Any, tp: Any) -> bool:
    """Whether a decoded value has the declared type (the oracle, written apart from the checks it tests)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if tp == Count:
        return type(value) is int and 0 <= value <= INT_MAX
    if tp is int:
        return type(value) is int and INT_MIN <= value <= INT_MAX
    if tp is float:
        return type(value) in (int, float) and math.isfinite(value)
    if tp in (str, bool, bytes):
        return type(value) is tp
    if origin in (types.UnionType, typing.Union):
        return any(_conforms(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(type(k) is str for k in value)
    return isinstance(value, tp)


def _check(cls_set: dict[str, type[Frame]], case: Case) -> None:
    try:
        frame = decode(case.data, cls_set)
    except BadFrame:
        return
    except Exception as exc:  # the bug this file is for
        pytest.fail(f"decode raised {type(exc).__name__} ({exc}) instead of BadFrame for {case.what}")
    hints = typing.get_type_hints(type(frame), include_extras=True)
    for name, _ in frame._checks:
        assert _conforms(getattr(frame, name), hints[name]), \
            f"{case.what}: decoded {frame.T}.{name} = {getattr(frame, name)!r:.80} is not a {hints[name]}"


@pytest.mark.parametrize("name", SETS)
def test_decode_raises_bad_frame_and_nothing_else(name):
    frames = SETS[name]
    cases = _cases(frames) + _random_cases(frames)
    assert len(cases) > 500
    for case in cases:
        _check(frames, case)


@pytest.mark.parametrize("name", SETS)
def test_hostile_values_are_refused_where_a_field_has_a_type(name):
    """The oracle above accepts nothing the definitions refuse: every wrong type is a BadFrame."""
    frames = SETS[name]
    for tag, cls in frames.items():
        base = _wire(_example(cls))
        hints = typing.get_type_hints(cls, include_extras=True)
        for field, _ in cls._checks:
            for value in HOSTILE:
                data = _packed({**base, field: value})
                if data is None or (not isinstance(value, Raw) and _conforms(value, hints[field])):
                    continue
                with pytest.raises(BadFrame):
                    decode(data, frames)


class _Part:
    """What the gate reads of a zmq.Frame: its bytes (no connection metadata)."""

    def __init__(self, data: bytes) -> None:
        self.bytes = data
        self.buffer = memoryview(data)


@pytest.mark.parametrize("ready", [Ready, RankReady], ids=["sender", "hub"])
def test_the_gate_drops_every_fuzzed_message_without_raising(ready, caplog):
    """A stranger (never bound) and a bound peer send the corpus; a Ready with the token is fuzzed too."""
    caplog.set_level(logging.WARNING, logger="hwsync")
    frames = TO_SENDER if ready is Ready else TO_HUB
    replies: list[Frame] = []
    gate = Gate(TOKEN, ready, frames, lambda identity, frame: replies.append(frame))
    gate.drops._clock = iter(range(0, 1 << 40, 100)).__next__  # every drop logged: each line is checked
    with_token = dict(_wire(_example(ready)), token=TOKEN)
    cases = _cases(frames) + _cases({"ready": ready})
    cases += [Case(f"ready with the token, {name} = {_describe(v)}", d) for name in with_token if name != "token"
              for v in HOSTILE if (d := _packed({**with_token, name: v})) is not None]
    gate.bound.add(b"bound")
    for case in cases:
        for identity in (b"stranger", b"bound"):
            try:
                gate.admit([_Part(identity), _Part(case.data)])
            except Exception as exc:  # noqa: BLE001 - the bug this test is for
                pytest.fail(f"the gate raised {type(exc).__name__} ({exc}) for {case.what} from {identity!r}")
    assert gate.drops.total > len(cases)
    assert max(len(r.getMessage()) for r in caplog.records) < 1200, "a drop's log line grows with what was sent"


def _receiver_decode():
    """The receiver's decode of its sender's frames (where it lives changes: the first one found)."""
    import importlib

    for module, owner, method in [("hwsync.colocated.receiver_control", "ReceiverControl", "decode"),
                                  ("hwsync.colocated.receiver", "WeightReceiver", "_decode")]:
        try:
            function = getattr(getattr(importlib.import_module(module), owner), method)
        except (ImportError, AttributeError):
            continue
        control = types.SimpleNamespace(refused=False, sender=(None, None), _refused=False, _sender=(None, None))
        return lambda data: function(control, [data])
    pytest.skip("no receiver decode found (hwsync.colocated.receiver_control / receiver moved)")


def _rank_decode():
    from hwsync.disaggregated.link import Link

    link = types.SimpleNamespace(refused=False)
    return lambda data: Link._decode(link, data)


@pytest.mark.parametrize("side", ["receiver", "rank"])
def test_a_peers_refused_or_malformed_frame_is_a_protocol_error(side):
    """A receiver and a rank read a Refused raw (any version can say why): the raw path must not raise anything else."""
    frames = TO_RECEIVER if side == "receiver" else TO_RANK
    decode_one = _receiver_decode() if side == "receiver" else _rank_decode()
    refused = {"t": "refused", "reason": "why"}
    cases = _cases(frames) + [Case(f"refused.{k} = {_describe(v)}", d) for k in ("t", "reason") for v in HOSTILE
                              if (d := _packed({**refused, k: v})) is not None]
    for case in cases:
        try:
            decode_one(case.data)
        except ProtocolError:
            pass
        except Exception as exc:  # noqa: BLE001 - the bug this test is for
            pytest.fail(f"the {side}'s decode raised {type(exc).__name__} ({exc}) for {case.what}")


def test_peek_keeps_only_scalars():
    raw = peek(msgpack.packb({"t": {"a": 1}, "token": [1], "proto": 5, 3: "x", "reason": "r"}))
    assert raw == {"proto": 5, "reason": "r"}
    assert peek(msgpack.packb([1])) is None and peek(b"\xc1") is None


def test_refused_reason_reads_any_version_and_nothing_else():
    assert refused_reason(msgpack.packb({"t": "refused", "reason": "why", "new_field": [1]})) == "why"
    for value in HOSTILE:
        tag, reason = _packed({"t": value, "reason": "why"}), _packed({"t": "refused", "reason": value})
        if tag is not None:
            assert refused_reason(tag) is None
        if reason is not None:
            assert refused_reason(reason) == (value if type(value) is str else None)


def test_a_late_frame_from_a_peer_let_go_is_dropped_quietly_and_a_strangers_loudly(caplog):
    """After an aborted sync the sender lets its receivers go; their frames still in flight are dropped (nothing they
    say changes state) but are no stranger's: no warning about a peer that never presented the token."""
    caplog.set_level(logging.DEBUG, logger="hwsync")
    gate = Gate(TOKEN, Ready, TO_SENDER, lambda identity, frame: None)
    late = encode(Accept(sync=3))
    gate.bind(b"receiver")
    gate.unbind(b"receiver")  # the sync was aborted
    assert gate.admit([_Part(b"receiver"), _Part(late)]) is None
    assert gate.admit([_Part(b"stranger"), _Part(late)]) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "never presented the token" in warnings[0], warnings  # the stranger's alone
    assert gate.drops.total == 1
