"""WeightReceiver.receive(into=...): copying straight into the caller's own tensors.

Real processes, real sockets, real shared memory. The receiving process preallocates one
destination per expected tensor, fills it with garbage before each sync, and reports the
digests of its destinations and of whatever reached `load` (see into_procs).
"""

from __future__ import annotations

import os
import platform
import re

import pytest
import torch

from hwsync import WeightReceiver, WeightSender
from hwsync.errors import RemoteError
from hwsync.backend.shm import leftover_segments
from hwsync.sync.options import SenderOptions

import transfer_procs as procs
from into_procs import into_set, start_receiver

BUCKET = 1 << 16
X86 = platform.machine().lower() in ("x86_64", "amd64")
needs_doorbell = pytest.mark.skipif(not X86, reason="the doorbell is used on x86-64 hosts only")


def assert_all_into(result: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor arrived bit-exact in its destination, asked for once, and load was never called."""
    assert "error" not in result, result
    assert result["into_digests"] == procs.digests(tensors)
    assert sorted(result["asked"]) == sorted(tensors), "into() is asked once per tensor, split ones included"
    assert result["load_calls"] == 0 and result["loaded"] == {}


@pytest.mark.parametrize("doorbell,layout", [
    pytest.param(True, "plain", id="doorbell", marks=needs_doorbell),
    pytest.param(False, "plain", id="frames"),
    pytest.param(X86, "arena", id="arena-of-parameters"),
])
def test_into_preallocated_tensors_is_bit_exact_and_never_loads(backend, monkeypatch, doorbell, layout):
    """One tensor per destination, or ("arena") destinations that are views into one buffer with guard
    bytes between them, the floating-point ones nn.Parameters that require grad."""
    if doorbell:
        monkeypatch.delenv("HWSYNC_DOORBELL", raising=False)
    else:
        monkeypatch.setenv("HWSYNC_DOORBELL", "0")
    first, second = into_set(BUCKET), into_set(BUCKET, seed=6)
    dtypes = {t.dtype for t in first.values()}
    assert {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.bool, torch.complex64} <= dtypes
    assert any(t.dim() == 0 for t in first.values()) and any(t.numel() == 0 for t in first.values())
    sizes = [t.numel() * t.element_size() for t in first.values()]
    split = [-(-n // BUCKET) for n in sizes if n > BUCKET]
    assert len(split) >= 3  # tensors larger than a bucket: at least this many buckets each
    specs = [{"set": "into", "bucket": BUCKET, "into": True, "layout": layout},
             {"set": "into2", "bucket": BUCKET, "into": True, "layout": layout}]
    with WeightSender(options=SenderOptions(bucket_bytes=BUCKET, timeout_s=30)) as sender:
        with start_receiver(sender.endpoint, specs) as q:
            for version, tensors in enumerate((first, second), 1):
                stats = sender.send(tensors.items(), version=version)
                result = q.get(timeout=60)
                assert_all_into(result, tensors)
                assert result["version"] == version and result["incomplete"] is False
                assert stats.tensors == result["stats"]["tensors"] == len(tensors)
                assert stats.bytes == result["stats"]["bytes"] == sum(t.numel() * t.element_size()
                                                                      for t in tensors.values())
                # into= everywhere: buckets are packed dense (tensors cut wherever a bucket ends)
                dense = -(-stats.bytes // BUCKET)
                assert stats.buckets == result["stats"]["buckets"]
                assert dense <= stats.buckets <= dense + 1 + (256 * len(tensors)) // BUCKET + 1
                assert set(result["doorbell_seen"]) == {doorbell}
                if layout == "arena":
                    assert result["guard_intact"], "a copy into a destination ran past its end"
                    assert "float32.matrix" in result["parameters"] and "split.bf16" in result["parameters"]
    assert not leftover_segments(os.getpid())


def test_declined_tensors_and_only_those_go_through_load(backend):
    tensors = into_set(BUCKET)
    # declined: a split tensor, a scalar, a zero-size one and some plain ones; the rest go into
    declined = ["split.f32", "bool.scalar", "int8.empty3d", "float16.matrix", "bfloat16.transposed", "tail.scalar"]
    assert set(declined) <= set(tensors)
    spec = {"set": "into", "bucket": BUCKET, "into": True, "decline": declined}
    with WeightSender(options=SenderOptions(bucket_bytes=BUCKET, timeout_s=30)) as sender:
        with start_receiver(sender.endpoint, [spec, spec]) as q:
            for version in (1, 2):
                stats = sender.send(tensors.items(), version=version)
                result = q.get(timeout=60)
                assert "error" not in result, result
                assert sorted(result["loaded"]) == sorted(declined)
                assert result["loaded"] == procs.digests({n: tensors[n] for n in declined})
                assert result["into_digests"] == procs.digests({n: t for n, t in tensors.items() if n not in declined})
                assert sorted(result["asked"]) == sorted(tensors)
                assert 1 <= result["load_calls"] <= stats.buckets
                assert stats.tensors == result["stats"]["tensors"] == len(tensors)


def test_wrong_destinations_are_refused_naming_the_tensor_and_the_next_sync_works(backend):
    tensors = into_set(BUCKET)
    good = {"set": "into", "bucket": BUCKET, "into": True}
    cases = [
        # (what goes wrong, spec, what the receiver's message must say)
        ("wrong dtype", {**good, "bad": ("dtype", "float32.matrix")},
         "into('float32.matrix') gave a torch.float64 tensor of shape (37, 29), but the sender sent torch.float32"),
        ("wrong shape of a split tensor", {**good, "bad": ("shape", "split.bf16")},
         "into('split.bf16') gave a torch.bfloat16 tensor of shape (98326,), but the sender sent torch.bfloat16 "
         "of shape (3, 32775)"),
        ("wrong shape of a scalar", {**good, "bad": ("shape", "tail.scalar")},
         "into('tail.scalar') gave a torch.float64 tensor of shape (2,)"),
        ("non-contiguous", {**good, "bad": ("noncontig", "int16.matrix")},
         "into('int16.matrix') gave a non-contiguous tensor"),
        ("declined without load", {**good, "load": False, "decline": ["bool.matrix"]},
         "into() returned None for 'bool.matrix' and no load was given"),
    ]
    specs = []
    for _, spec, _ in cases:
        specs += [spec, good]
    with WeightSender(options=SenderOptions(bucket_bytes=BUCKET, timeout_s=30)) as sender:
        with start_receiver(sender.endpoint, specs) as q:
            for i, (case, _, message) in enumerate(cases):
                # a destination that does not match is a DestinationError (a ValueError and a ManifestError)
                kind = "ValueError" if case == "declined without load" else "DestinationError"
                with pytest.raises(RemoteError, match=re.escape(f"{kind}: {message}")):
                    sender.send(tensors.items(), version=2 * i + 1)
                failed = q.get(timeout=60)
                assert failed["error"].startswith(f"{kind}: ") and message in failed["error"], (case, failed)
                assert not leftover_segments(os.getpid()), case
                sender.send(tensors.items(), version=2 * i + 2)  # the same receiver, a sound sync
                ok = q.get(timeout=60)
                assert_all_into(ok, tensors)
                assert ok["version"] == 2 * i + 2 and ok["incomplete"] is False, case


def test_receive_needs_load_or_into():
    with WeightSender(options=SenderOptions(timeout_s=5)) as sender:
        with WeightReceiver(sender.endpoint, timeout_s=5) as receiver:
            with pytest.raises(ValueError, match="receive\\(\\) needs load .* into .* or both"):
                receiver.receive()
            with pytest.raises(ValueError, match="needs load"):
                receiver.receive(None, into=None)


def test_default_geometry_follows_how_receivers_take_tensors(backend):
    """Neither size given: the transport's into_geometry when every receiver copies into its own tensors (the
    core shm's: 4 MiB x 16 buffers; a device backend's shm may have none), else its default bucket x 2."""
    tensors = procs.versioned(1)
    senders = {
        "default, into": WeightSender(transport="shm", options=SenderOptions(timeout_s=30)),
        "default, load": WeightSender(transport="shm", options=SenderOptions(timeout_s=30)),
        "bucket_bytes given, into": WeightSender(transport="shm", options=SenderOptions(bucket_bytes=BUCKET, timeout_s=30)),
        "num_buffers given, into": WeightSender(transport="shm", options=SenderOptions(num_buffers=4, timeout_s=30)),
    }
    shm = senders["default, into"].transport
    if backend.name == "cpu":
        assert shm.into_geometry == (4 << 20, 16)
    default = (shm.default_bucket_bytes, 2)
    expected = {"default, into": shm.into_geometry or default, "default, load": default,
                "bucket_bytes given, into": (BUCKET, 2), "num_buffers given, into": (default[0], 4)}
    specs = [{"endpoint": s.endpoint, "set": "v1", "into": "into" in case} for case, s in senders.items()]
    try:
        with start_receiver(specs[0]["endpoint"], specs) as q:
            for case, sender in senders.items():
                stats = sender.send(tensors.items(), version=1)
                result = q.get(timeout=60)
                if "into" in case:
                    assert_all_into(result, tensors)
                else:
                    assert result["loaded"] == procs.digests(tensors) and result["asked"] == []
                got = (stats.bucket_bytes, stats.num_buffers)
                assert got == expected[case], (case, got)
                assert (result["stats"]["bucket_bytes"], result["stats"]["num_buffers"]) == got, case
                assert (sender.bucket_bytes, sender.num_buffers) == got, case
                if got[1] > 2:  # more buffers than the hot pair: the pool chooses, and says so
                    assert stats.notes["pool"]["buffers"] == got[1], case
                else:
                    assert "pool" not in stats.notes, case
    finally:
        for sender in senders.values():
            sender.close()
    assert not leftover_segments(os.getpid())
