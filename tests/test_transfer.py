"""WeightSender -> WeightReceiver between real processes, real sockets, real shared memory."""

from __future__ import annotations

import gc
import functools
import json
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import hwsync.colocated.receiver
from hwsync.protocol import PROTOCOL_VERSION
from hwsync import ManifestError, SyncTimeoutError, WeightSender
from hwsync.errors import ProtocolError, RemoteError
from hwsync.sync.spec import manifest_from_tensors
from hwsync.backend.shm import leftover_segments
from hwsync.sync.options import SenderOptions

import transfer_procs as procs

HERE = Path(__file__).parent
CTX = mp.get_context("spawn")


#: a receiver process running transfer_procs.receive_n: (process, result queue)
start_receiver = functools.partial(procs.start_receiver, procs.receive_n)


SIM_COVERS = "the 4 KiB-bucket matrix (every dtype) and the big split tensor run there"


@pytest.mark.parametrize("set_name,bucket_bytes", [
    ("matrix", 4096),
    pytest.param("matrix", 1 << 20, marks=pytest.mark.cpu_is_enough(SIM_COVERS)),
    ("big", 1 << 16),
    pytest.param("many", 1 << 18, marks=pytest.mark.cpu_is_enough(SIM_COVERS)),
])
def test_round_trip_is_bit_exact(backend, set_name, bucket_bytes):
    tensors = procs.SETS[set_name](bucket_bytes)
    with WeightSender(options=SenderOptions(bucket_bytes=bucket_bytes, timeout_s=60)) as sender:
        p, q = start_receiver(sender.endpoint)
        stats = sender.send(iter(tensors.items()), version=1)
        result = q.get(timeout=120)
        p.join(30)
    assert "error" not in result, result
    assert result["digests"] == procs.digests(tensors)
    assert stats.tensors == len(tensors) and result["version"] == 1
    assert stats.bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    if set_name == "big":
        assert stats.buckets >= 6, "a tensor 5x the bucket must be split over at least 5 buckets"
    assert stats.buckets == result["buckets"] and result["loads"] <= stats.buckets


def test_several_syncs_on_one_session_carry_versions(backend):
    with WeightSender(options=SenderOptions(bucket_bytes=1 << 16, timeout_s=60)) as sender:
        p, q = start_receiver(sender.endpoint, syncs=3)
        segments = set(leftover_segments(os.getpid()))
        for v in (1, 2, 3):
            stats = sender.send(procs.versioned(v).items(), version=v)
            result = q.get(timeout=60)
            assert result["version"] == v and result["digests"] == procs.digests(procs.versioned(v))
            assert stats.version == v and stats.to_dict()["gbps"] > 0
            assert set(leftover_segments(os.getpid())) == segments or not segments  # set up once, reused
            segments = set(leftover_segments(os.getpid()))
        p.join(30)
    assert not leftover_segments(os.getpid())


def test_receiver_follows_the_senders_geometry(backend):
    """Nothing is configured on the receiver; two senders with different buckets both work."""
    for bucket_bytes, buffers in ((4096, 2), (1 << 20, 4)):
        with WeightSender(options=SenderOptions(bucket_bytes=bucket_bytes, num_buffers=buffers, timeout_s=60)) as sender:
            p, q = start_receiver(sender.endpoint)
            sender.send(procs.versioned(1).items(), version=1)
            assert q.get(timeout=60)["digests"] == procs.digests(procs.versioned(1))
            p.join(30)


@pytest.mark.cpu_is_enough("how the sender iterates its source is host logic")
def test_source_is_consumed_lazily(backend):
    alive: list[weakref.ref] = []

    def source():
        for i in range(6):
            t = torch.randn(1 << 18)
            alive.append(weakref.ref(t))
            gc.collect()
            live = sum(1 for r in alive if r() is not None)
            assert live <= 2, f"{live} generated tensors alive at once: the sender holds the source"
            yield f"t{i}", t
            del t

    with WeightSender(options=SenderOptions(bucket_bytes=1 << 20, timeout_s=60)) as sender:
        p, q = start_receiver(sender.endpoint)
        sender.send(source(), version=1)
        assert "error" not in q.get(timeout=60)
        p.join(30)


def test_exception_in_load_reaches_the_sender_and_next_sync_works(backend):
    with WeightSender(options=SenderOptions(bucket_bytes=1 << 16, timeout_s=30)) as sender:
        p, q = start_receiver(sender.endpoint, syncs=2, fail_in_load="w3")
        with pytest.raises(RemoteError, match="engine cannot load w3: out of memory"):
            sender.send(procs.versioned(1).items(), version=1)
        failed = q.get(timeout=60)
        assert "engine cannot load w3" in failed["error"]
        assert failed["incomplete"] is True and failed["version"] is None
        assert not leftover_segments(os.getpid()), "segments must be released after a failure"
        # same receiver, fresh sync: "w3" is absent now, so it succeeds
        stats = sender.send(((n, t) for n, t in procs.versioned(2).items() if n != "w3"), version=2)
        ok = q.get(timeout=60)
        assert ok["version"] == 2 and stats.tensors == 7
        p.join(30)


def test_one_receivers_late_failure_does_not_poison_the_others_next_sync(backend):
    """B completes sync 1, then A fails on the last bucket: the abort B gets is stale by then."""
    with WeightSender(num_receivers=2, options=SenderOptions(bucket_bytes=1 << 16, timeout_s=30)) as sender:
        a, qa = start_receiver(sender.endpoint, syncs=2, fail_in_load="w7", fail_delay_s=1.0)
        b, qb = start_receiver(sender.endpoint, syncs=2)
        with pytest.raises(RemoteError, match="engine cannot load w7"):
            sender.send(procs.versioned(1).items(), version=1)
        assert "error" in qa.get(timeout=60)
        qb.get(timeout=60)  # completed, or aborted if it had not finished: either is fine
        stats = sender.send(((n, t) for n, t in procs.versioned(2).items() if n != "w7"), version=2)
        assert qa.get(timeout=60)["version"] == qb.get(timeout=60)["version"] == 2
        assert stats.tensors == 7
        a.join(30)
        b.join(30)


def test_receiver_killed_mid_sync(backend):
    import threading

    with WeightSender(options=SenderOptions(bucket_bytes=1 << 16, timeout_s=20)) as sender:
        slow = subprocess.Popen([sys.executable, str(HERE / "transfer_procs.py"), "slow_receiver", sender.endpoint],
                                stdout=subprocess.PIPE, text=True)

        def kill_when_loading() -> None:
            if slow.stdout.readline().strip() == "loading":
                slow.send_signal(signal.SIGKILL)

        killer = threading.Thread(target=kill_when_loading)
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(SyncTimeoutError, match=r"peer process \d+ exited") as info:
            sender.send(procs.versioned(1).items(), version=1)
        assert time.monotonic() - t0 < 20, "a dead receiver on this host is noticed well within the timeout"
        assert "release buffer" in str(info.value) and sender.endpoint.split("#")[0] in str(info.value)
        killer.join()
        slow.wait()
        assert not leftover_segments(os.getpid())
        # a new receiver on the same session works
        p, q = start_receiver(sender.endpoint)
        sender.send(procs.versioned(2).items(), version=2)
        assert q.get(timeout=60)["version"] == 2
        p.join(30)


@pytest.mark.cpu_is_enough("a killed sender runs on the sim in test_doorbell")
def test_sender_killed_mid_sync(backend):
    sender = subprocess.Popen([sys.executable, str(HERE / "transfer_procs.py"), "sender", "v1", str(1 << 16), "5"],
                              stdout=subprocess.PIPE, text=True)
    info = json.loads(sender.stdout.readline())
    p, q = start_receiver(info["endpoint"], timeout_s=5)
    assert sender.stdout.readline().strip() == "stalling"
    sender.send_signal(signal.SIGKILL)
    sender.wait()
    t0 = time.monotonic()
    result = q.get(timeout=60)
    p.join(30)
    assert time.monotonic() - t0 < 15
    assert "SyncTimeoutError" in result["error"] and "waiting for bucket" in result["error"]
    assert result["incomplete"] is True and result["version"] is None
    assert not Path(info["endpoint"].split("#")[0].removeprefix("ipc://")).parent.exists(), \
        "the receiver removes a dead sender's private socket directory"
    deadline = time.monotonic() + 15
    while leftover_segments(info["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leftover_segments(info["pid"]), "a killed sender's segments must be removed"


@pytest.mark.cpu_is_enough("control-plane logic only: nothing an accelerator changes")
def test_silent_peer_times_out_naming_phase_and_endpoint(backend):
    with WeightSender(options=SenderOptions(timeout_s=1.0)) as sender:
        with pytest.raises(SyncTimeoutError, match=r"timed out after 1.0s waiting for receivers to call receive\(\)"):
            sender.send([("a", torch.ones(3))], version=1)
    from hwsync import WeightReceiver

    with WeightSender() as quiet:
        with WeightReceiver(quiet.endpoint, timeout_s=1.0) as receiver:
            with pytest.raises(SyncTimeoutError, match="waiting for the sender's offer") as info:
                receiver.receive(lambda pairs: None)
            assert quiet.endpoint.split("#")[0] in str(info.value)


def _mismatched_receiver(endpoint: str, q) -> None:
    hwsync.colocated.receiver.PROTOCOL_VERSION = 99  # this process runs a "newer" hwsync
    procs.receive_n(endpoint, 1, q)


def test_protocol_version_mismatch_is_refused(backend):
    with WeightSender(options=SenderOptions(timeout_s=30)) as sender:
        q = CTX.Queue()
        p = CTX.Process(target=_mismatched_receiver, args=(sender.endpoint, q))
        p.start()
        with pytest.raises(ProtocolError, match=f"speaks hwsync protocol 99 and this sender speaks {PROTOCOL_VERSION}"):
            sender.send(procs.versioned(1).items(), version=1)
        assert "install the same hwsync version on both sides" in q.get(timeout=60)["error"]
        p.join(30)


def test_manifest_is_enforced_on_the_sender(backend):
    tensors = procs.versioned(1)
    manifest = manifest_from_tensors(tensors.items())
    with WeightSender(options=SenderOptions(timeout_s=30)) as sender:
        p, q = start_receiver(sender.endpoint, syncs=2)
        strayed = dict(tensors, w2=torch.zeros(3))
        with pytest.raises(ManifestError, match="tensor #2 strays from the announced manifest"):
            sender.send(strayed.items(), version=1, manifest=manifest)
        assert "sender aborted the sync" in q.get(timeout=60)["error"]
        sender.send(tensors.items(), version=2, manifest=manifest)
        assert q.get(timeout=60)["version"] == 2
        p.join(30)


@pytest.mark.cpu_is_enough("control-plane logic only: nothing an accelerator changes")
def test_wrong_token_is_ignored(backend):
    with WeightSender(options=SenderOptions(timeout_s=1.5)) as sender:
        address = sender.endpoint.split("#")[0]
        from hwsync import WeightReceiver

        with WeightReceiver(f"{address}#not-the-token", timeout_s=1.0) as intruder:
            with pytest.raises(SyncTimeoutError):
                intruder.receive(lambda pairs: None)
        with pytest.raises(SyncTimeoutError):
            sender.send([("a", torch.ones(2))], version=1)


@pytest.mark.cpu_is_enough("control-plane logic only: nothing an accelerator changes")
def test_tcp_endpoint_with_token(backend, free_port):
    with WeightSender(f"tcp://127.0.0.1:{free_port}", options=SenderOptions(timeout_s=30)) as sender:
        assert sender.endpoint.startswith(f"tcp://127.0.0.1:{free_port}#")
        p, q = start_receiver(sender.endpoint)
        sender.send(procs.versioned(3).items(), version=3)
        assert q.get(timeout=60)["digests"] == procs.digests(procs.versioned(3))
        p.join(30)


def test_roundtrip_command_verifies_every_byte(backend):
    """`hwsync roundtrip` on each backend; the receiver's tensors live on its device (no numpy() there)."""
    done = subprocess.run([sys.executable, "-m", "hwsync.cli", "roundtrip", "--megabytes", "1", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["verified"] is True and report["backend"] == backend.name


def test_ipc_directory_is_private_and_removed():
    sender = WeightSender()
    path = Path(sender.endpoint.split("#")[0].removeprefix("ipc://")).parent
    assert path.stat().st_mode & 0o777 == 0o700
    sender.close()
    assert not path.exists()


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="at least 2"):
        WeightSender(options=SenderOptions(num_buffers=1))
    with pytest.raises(ValueError, match="has no transport 'nvlink'"):
        WeightSender(transport="nvlink")
    from hwsync import WeightReceiver

    with pytest.raises(ValueError, match="pass sender.endpoint as it is"):
        WeightReceiver("localhost:5555")
