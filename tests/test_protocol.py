"""The protocol module: every frame round-trips, and decode refuses whatever breaks a definition."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hwsync.sync.spec import TensorSpec
from hwsync.backend.memory import RankMemory
from hwsync.sync.planner import EngineState
from hwsync.sync.report import DtypeReport, ReceiverReport
from hwsync.protocol.delta import DeltaField
from hwsync.protocol import (
    TO_HUB,
    TO_RANK,
    TO_RECEIVER,
    TO_SENDER,
    BadFrame,
    Bucket,
    BucketSpec,
    Entry,
    Error,
    Offer,
    PlanFrame,
    Ready,
    Ref,
    Refs,
    Release,
    SegmentSpec,
    decode,
    encode,
)
from hwsync.protocol.layout import DeviceRef, DeviceSegment, Ref
from hwsync.protocol.fields import INT_MAX
from hwsync.sync.spec import WIRE_DTYPES, dtype_from_name

ENTRY = Entry("w", "float32", (2, 3), 0, 0, 24, 24)
#: segment names as hwsync makes them: hwsync-<pid>-<start>-<pidns>-[params-]<16 hex> (pid 1 here, as in _example)
OWNER = "hwsync-1-7788-4026531836-"
BUFFERS = [f"{OWNER}{i:016x}" for i in range(2)]
PARAMS = f"{OWNER}params-00000000000000ab"
OFFER = Offer(sync=1, proto=3, backend="cpu", transport="shm", handles={"kind": "shm", "names": BUFFERS, "bytes": 4096},
              bucket_bytes=4096, num_buffers=2, version=7, pid=1, host="h",
              manifest=[TensorSpec("w", "float32", (2, 3))], tensors=1, total_bytes=24, first=0, doorbell=None,
              rank=0, segments=[], delta=None)
SEGMENT = SegmentSpec(PARAMS, 4096)
REF = Ref("w", "float32", (2, 3), 0, 256, 24)
DEVICE_SEGMENT = DeviceSegment(7, 1 << 20, {"kind": "cuda_ipc", "handle": b"\x01" * 64, "slot": 3})
DEVICE_REF = DeviceRef("w", "bfloat16", (2, 3), 7, 512)
DOORBELL = {"name": f"{OWNER}{'f' * 16}", "bytes": 4096 + 2 * 65536, "receivers": 2, "slots": 2}


def _example(cls):
    """One valid instance of any frame class, built from its field types."""
    values = {"int": 1, "Count": 1, "str": "x", "bool": True, "float": 1.0}
    kwargs = {}
    for f in dataclasses.fields(cls):
        kind = str(f.type)
        if "ReceiverReport" in kind:
            report = ReceiverReport(EngineState(sleep_level=1, weights_freed=False, has_base=True), DtypeReport("bfloat16"),
                                    "s:1", RankMemory(0, 1, 2, 0, 0), {"k": [1, "v"]})
            kwargs[f.name] = [report] if kind.startswith("list") else report
        elif "DeviceSegment" in kind:
            kwargs[f.name] = [DEVICE_SEGMENT]
        elif "DeviceRef" in kind:
            kwargs[f.name] = [DEVICE_REF]
        elif kind == "list[Count]":
            kwargs[f.name] = [7]
        elif "SegmentSpec" in kind:
            kwargs[f.name] = [SEGMENT]
        elif "Ref" in kind:
            kwargs[f.name] = [REF]
        elif "Entry" in kind:
            kwargs[f.name] = [ENTRY]
        elif "BucketSpec" in kind:
            kwargs[f.name] = [BucketSpec(0, 24, (ENTRY,))]
        elif "TensorSpec" in kind:
            kwargs[f.name] = [TensorSpec("w", "float32", (2, 3))]
        elif f.name in ("nbytes", "bucket_bytes"):
            kwargs[f.name] = 4096
        elif kind == "list[str]":
            kwargs[f.name] = ["tcp://h:1"]
        elif f.name == "doorbell" and "Map" in kind:
            kwargs[f.name] = DOORBELL
        elif f.name == "delta" and "DeltaField" in kind:
            kwargs[f.name] = DeltaField.from_wire({"base": "s:1", "next": "s:2",
                                                   "headers": [["same", "float32", 6, 0, 7]]})
            if cls.T == "plan":  # a plan with buckets: a full sync of a sender in delta mode
                kwargs[f.name] = DeltaField(None, "s:2")
        elif kind.startswith(("Map", "dict")):
            kwargs[f.name] = {"k": [1, "v"]}
        else:
            kwargs[f.name] = values[kind.split(" ")[0]]
    return cls(**kwargs)


@pytest.mark.parametrize("frames", [TO_SENDER, TO_RECEIVER, TO_HUB, TO_RANK], ids=["sender", "receiver", "hub", "rank"])
def test_every_frame_round_trips(frames):
    for cls in frames.values():
        frame = _example(cls)
        assert decode(encode(frame), frames) == frame


def _raw(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


@pytest.mark.parametrize("data,match", [
    (b"\xc1garbage", "not a msgpack frame"),
    (b"", "not a msgpack frame"),
    (encode(OFFER)[:-3], "not a msgpack frame"),
    (msgpack.packb([1, 2]), "must be a msgpack map"),
    (_raw(sync=1), "not one this socket accepts"),
    (_raw(t="offer", sync=1), "not one this socket accepts"),
    (_raw(t="release", sync=1, buf=0), "lacks field 'seq'"),
    (_raw(t="release", sync=1, buf=0, seq=1, extra=2), "unknown fields"),
    (_raw(t="release", sync="1", buf=0, seq=1), "release.sync: expected int"),
    (_raw(t="release", sync=True, buf=0, seq=1), "release.sync: expected int, got bool"),
    (_raw(t="error", sync=None, kind="load", message=b"bytes"), "error.message: expected str"),
    (_raw(t="complete", sync=1, stats=[1]), "complete.stats: expected a map"),
])
def test_decode_refuses_what_breaks_a_definition(data, match):
    with pytest.raises(BadFrame, match=match):
        decode(data, TO_SENDER)


def test_the_receiver_side_refuses_a_sender_frame_and_vice_versa():
    with pytest.raises(BadFrame, match="not one this socket accepts"):
        decode(encode(Release(sync=1, buf=0, seq=0)), TO_RECEIVER)
    with pytest.raises(BadFrame, match="not one this socket accepts"):
        decode(encode(OFFER), TO_SENDER)


@pytest.mark.parametrize("entry,match", [
    (["w", "float32", [2, 3], 0, 0, 24], "list of 7 fields"),
    (["w", "float99", [2, 3], 0, 0, 24, 24], "bad name or dtype"),
    ([5, "float32", [2, 3], 0, 0, 24, 24], "bad name or dtype"),
    (["w", "float32", [2, -3], 0, 0, 24, 24], "non-negative ints"),
    (["w", "float32", [2, 3], -1, 0, 24, 24], "non-negative int"),
    (["w", "float32", [2, 3], 0, 0, 24, 20], "do not fit"),
    (["w", "float32", [2, 3], 0, 16, 24, 24], "do not fit"),
    (["w", "float32", [2, 3], 4090, 0, 24, 24], "past the bucket"),
])
def test_bucket_entries_are_checked(entry, match):
    data = _raw(t="bucket", sync=1, index=0, seq=0, buf=0, nbytes=4096, entries=[entry])
    with pytest.raises(BadFrame, match=match):
        decode(data, TO_RECEIVER)


def test_a_plan_cannot_name_a_sender_beyond_its_senders():
    frame = _example(PlanFrame)
    bad = dataclasses.replace(frame, buckets=[BucketSpec(3, 24, (ENTRY,))], num_senders=2)
    with pytest.raises(BadFrame, match="does not fit 2 senders"):
        decode(encode(bad), TO_RANK)


def test_entries_come_back_as_entries_and_manifests_as_specs():
    bucket = decode(encode(Bucket(sync=1, index=0, seq=0, buf=1, nbytes=24, entries=[ENTRY])), TO_RECEIVER)
    assert bucket.entries == [ENTRY] and bucket.entries[0].is_whole
    offer = decode(encode(OFFER), TO_RECEIVER)
    assert offer.manifest == [TensorSpec("w", "float32", (2, 3))]


def test_ready_and_error_keep_their_fields():
    ready = Ready(token="t", proto=4, pid=1, host="h", doorbell=True, into=False,
                  report=ReceiverReport(EngineState(sleep_level=0, weights_freed=False, has_base=True), DtypeReport("bfloat16"),
                                        "s:1", RankMemory(0, 1, 2, 0, 0), {"k": [1]}),
                  backend="cpu", transports=["shm"], instance="r1")
    assert decode(encode(ready), TO_SENDER) == ready
    error = Error(sync=None, kind="load", message="boom")
    assert decode(encode(error), TO_HUB) == error


@pytest.mark.parametrize("segments,refs,match", [
    ([[PARAMS, 4096]], [["w", "float32", [2, 3], 0, 4096 - 16, 24]], "multiples of 256"),
    ([[PARAMS, 4096]], [["w", "float32", [2, 3], 0, 4096, 24]], "past the 4096 bytes"),
    ([[PARAMS, 4096]], [["w", "float32", [2, 3], 1, 0, 24]], "segment #1 of 1"),
    ([[PARAMS, 4096]], [["w", "float32", [2, 3], 0, 0, 25]], "do not fit float32"),
    ([[PARAMS, 4096]], [["w", "float32", [2, 3], 0, -256, 24]], "non-negative int"),
    ([["../etc/passwd", 4096]], [], "not the name of an hwsync shared segment"),
    ([["hwsync-12-params-ab", 4096]], [], "not the name of an hwsync shared segment"),  # an older hwsync's form
    ([[f"{OWNER}00000000000000ab", 4096]], [], "not the name of an hwsync shared segment"),  # a buffer's, not params
    ([[PARAMS + "/x", 4096]], [], "not the name of an hwsync shared segment"),
    ([[PARAMS, -1]], [], "non-negative int"),
    ([[PARAMS, 4096], [PARAMS.replace("hwsync-1-", "hwsync-13-"), 4096]], [], "several processes"),
])
def test_shared_tensor_references_are_checked(segments, refs, match):
    with pytest.raises(BadFrame, match=match):
        decode(_raw(t="refs", sync=1, segments=segments, refs=refs, device_segments=[], device_refs=[]), TO_RECEIVER)


def test_refs_come_back_as_refs():
    frame = Refs(sync=3, segments=[SEGMENT], refs=[REF])
    back = decode(encode(frame), TO_RECEIVER)
    assert back == frame and back.segments[0].pid == 1 and back.refs[0].shape == (2, 3)


def test_device_references_and_exports_round_trip():
    frame = Refs(sync=3, segments=[], refs=[], device_segments=[DEVICE_SEGMENT], device_refs=[DEVICE_REF])
    back = decode(encode(frame), TO_RECEIVER)
    assert back == frame and back.device_refs[0].nbytes == 12 and back.device_segments[0].export["slot"] == 3
    offer = decode(encode(dataclasses.replace(OFFER, device_segments=[1, 5])), TO_RECEIVER)
    assert offer.device_segments == [1, 5]


@pytest.mark.parametrize("segments,refs,match", [
    ([], [["w", "bfloat16", [2, 3], 7, 513]], "not aligned for bfloat16"),
    ([], [["w", "bfloat16", [2, 3], 7]], "list of 5 fields"),
    ([], [["w", "bfloat99", [2, 3], 7, 0]], "bad name or dtype"),
    ([], [["w", "float32", [2, -3], 7, 0]], "non-negative ints"),
    ([], [["w", "float32", [2, 3], -7, 0]], "non-negative int"),
    ([], [["w", "float32", [1 << 40, 1 << 40], 7, 0]], "larger than any segment"),
    ([[7, 1024, {}]], [["w", "float32", [2, 3], 7, 1024 - 16]], "past the 1024 bytes of device segment 7"),
    ([[7, 1024, {}], [7, 2048, {}]], [], "exported twice"),
    ([[7, 0, {}]], [], "has no bytes"),
    ([[7, 1024, []]], [], "export must be a map"),
    ([[7, 1024, {1: 2}]], [], "export must be a map"),
    ([[7, 1024]], [], r"\[id, size, export\]"),
])
def test_device_references_are_checked(segments, refs, match):
    with pytest.raises(BadFrame, match=match):
        decode(_raw(t="refs", sync=1, segments=[], refs=[], device_segments=segments, device_refs=refs), TO_RECEIVER)


def test_a_reference_to_a_segment_exported_earlier_is_left_to_the_receiver():
    """Decode checks what the frame itself says; an id exported in an earlier frame is checked against the mapping."""
    frame = decode(_raw(t="refs", sync=1, segments=[], refs=[], device_segments=[],
                        device_refs=[["w", "float32", [4], 9, 1 << 30]]), TO_RECEIVER)
    assert frame.device_refs[0].segment == 9



_ODD = st.sampled_from([None, True, False, -1, 0, 1, 255, 256, 2**62, INT_MAX, INT_MAX + 1, 0.0, 256.0, "", "bfloat16",
                        "float32", "bool", "nope", b"bf16", [], [0], [True], [2, -1], [2.0], [INT_MAX, 2], "x" * 90])
_DIM = st.one_of(st.integers(0, 9), st.sampled_from([True, False, -1, 2.0, INT_MAX + 1, None]))


@settings(max_examples=1500, deadline=None)
@given(name=st.one_of(st.just("w"), _ODD), dtype=st.one_of(st.sampled_from(sorted(WIRE_DTYPES)), _ODD),
       shape=st.one_of(st.lists(_DIM, max_size=3), _ODD), segment=st.one_of(st.integers(0, 3), _ODD),
       offset=st.one_of(st.integers(0, 3).map(lambda blocks: 256 * blocks), st.integers(0, 600), _ODD),
       nbytes_off=st.one_of(st.sampled_from([0, 0, 1, -1]), st.tuples(_ODD)), extra=st.booleans())
def test_a_references_quick_check_takes_exactly_what_the_field_by_field_one_takes(name, dtype, shape, segment, offset,
                                                                                  nbytes_off, extra):
    # Ref.from_wire checks every field inline and hands what fails to Ref._checked, which names the wrong field:
    # whatever a peer sends, both must agree (the same Ref, or BadFrame)
    try:  # the size the other fields make, so that the odd one is what is tested
        numel = 1
        for dim in shape:
            numel *= int(dim)
        nbytes = numel * dtype_from_name(dtype).itemsize
    except (TypeError, ValueError):
        nbytes = 0
    nbytes = nbytes_off[0] if isinstance(nbytes_off, tuple) else nbytes + nbytes_off
    item = [name, dtype, shape, segment, offset, nbytes] + (["more"] if extra else [])
    outcomes = []
    for parse in (Ref.from_wire, Ref._checked):
        try:
            outcomes.append(parse(list(item)))
        except BadFrame:
            outcomes.append(BadFrame)
    assert outcomes[0] == outcomes[1], item
