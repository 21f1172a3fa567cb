"""A rogue sender cannot make a receiver map what is not its own segment, nor map anything writable it only reads.

Issue 32, item 2: an offer naming a shared segment by a path (`../../tmp/file`, `/tmp/file`) was
accepted, and the receiver opened the file O_RDWR and mapped it MAP_SHARED, then handed its bytes
to `load`. A real receiver process (every mmap it makes recorded: the file and whether it may
write) meets a rogue sender process (tests/rogue_procs.py) that names, in its offer's shm handles,
its doorbell, its shared segments and its Refs frames: a path up and out of /dev/shm, an absolute
path, another live process's segment, and a symlink in /dev/shm to a file elsewhere. Each is
refused with the reason and nothing but the rogue's own segments is ever mapped; the valid offer
maps the buffers and the parameter segment read-only and only the doorbell writable (the receiver
writes its own released counter there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

import rogue_procs
from hwsync.sync.shared_params import SharedTensors
from hwsync.backend.shm import SHM_DIR, SharedSegment

HERE = Path(__file__).parent
CTX = mp.get_context("spawn")

#: what the receiver's error must say, by case
REASONS = {
    "buffer-dotdot": "not the name of an hwsync shared segment",
    "buffer-absolute": "not the name of an hwsync shared segment",
    "buffer-other-pid": "not the sender's",
    "buffer-symlink": "is a symbolic link",
    "doorbell-dotdot": "not the name of an hwsync shared segment",
    "doorbell-absolute": "not the name of an hwsync shared segment",
    "doorbell-symlink": "is a symbolic link",
    "doorbell-other-pid": "not the sender's",
    "offer-segment-other-pid": "a sender only ever names segments it created",
    "refs-dotdot": "not the name of an hwsync shared segment",
    "refs-other-pid": "a sender sends references into its own segments only",
    "refs-symlink": "is a symbolic link",
}


@pytest.fixture(scope="module")
def others():
    """Real segments of another live process (this one): a buffer and a parameter segment."""
    buffer = SharedSegment.create(1 << 20)
    params = SharedTensors([("x", __import__("torch").zeros(16))])
    yield buffer.name, params.segment_names[0]
    buffer.close()
    params.close()


def _run(case: str, tmp_path: Path, others: tuple[str, str]) -> tuple[dict, dict, bytes]:
    """(the receiver's report, the rogue's, the victim file's bytes after)."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"VICTIM--" * (1 << 17))  # 1 MiB: larger than any size the rogue announces
    directory = tmp_path / "ipc"
    directory.mkdir(mode=0o700)
    rogue = subprocess.Popen([sys.executable, str(HERE / "rogue_procs.py"), str(directory), case, str(victim),
                              *others], stdout=subprocess.PIPE, text=True)
    try:
        line = rogue.stdout.readline().split()
        assert line and line[0] == "endpoint", line
        q = CTX.Queue()
        receiver = CTX.Process(target=rogue_procs.receive_recording, args=(line[1], q))
        receiver.start()
        report = q.get(timeout=60)
        receiver.join(30)
        out, _ = rogue.communicate(timeout=60)
    finally:
        rogue.kill()
    result = next(json.loads(x[len("result "):]) for x in out.splitlines() if x.startswith("result "))
    return report, result, victim.read_bytes()


def _rogue_pid_segments(report: dict) -> list[tuple[str, bool]]:
    return [(path, writable) for path, writable in report["mapped"] if path.startswith(SHM_DIR + "/hwsync-")]


@pytest.mark.parametrize("case", list(REASONS))
def test_a_rogue_senders_names_are_refused_with_the_reason(case, tmp_path, others):
    report, rogue, victim = _run(case, tmp_path, others)
    assert REASONS[case] in report.get("error", ""), report
    mapped = [path for path, _ in report["mapped"]]
    assert not any(str(tmp_path) in p for p in mapped), f"the receiver mapped the victim file: {mapped}"
    assert not any(others[0] in p or others[1] in p for p in mapped), f"it mapped another process's segment: {mapped}"
    assert "w" not in report["loaded"] and victim == b"VICTIM--" * (1 << 17)
    assert all(r.get("t") != "complete" for r in rogue["replies"])


@pytest.mark.parametrize("case", ["valid", "valid-doorbell"])
def test_what_a_receiver_only_reads_is_mapped_read_only(case, tmp_path, others):
    report, rogue, _ = _run(case, tmp_path, others)
    assert "error" not in report, report
    assert report["loaded"]["w"] == [float(i) for i in range(16)]
    assert [r["t"] for r in rogue["replies"]] == ["accept", "complete"]
    mapped = _rogue_pid_segments(report)
    writable = [path for path, w in mapped if w]
    assert len(mapped) == 3 + (case == "valid-doorbell"), mapped  # two buffers, the parameter segment, the doorbell
    if case == "valid":
        assert not writable, f"mapped writable: {writable}"
    else:  # the doorbell: the receiver writes its own released counter there, and nothing else
        assert len(writable) == 1 and "params" not in writable[0], writable
