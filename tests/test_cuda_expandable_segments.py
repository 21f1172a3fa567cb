"""Bug 7: a trainer with expandable_segments:True is detected, and CUDA IPC steps aside with the reason.

With expandable segments torch shares GPU memory as file descriptors that receivers fetch with
pidfd_getfd, which unprivileged containers refuse. These checks need no GPU: the decision reads
the allocator settings torch holds (from PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF or set at
run time), and the transport is given a Device whose probe says usable.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from hwsync.errors import HwsyncError
from hwsync.backend.interfaces import ProbeResult
from hwsync_cuda import device as cuda_device
from hwsync_cuda import ipc as cuda_ipc
from hwsync_cuda.device import expandable_segments, expandable_segments_reason


@pytest.mark.parametrize("settings, enabled", [
    ("", False),
    ("expandable_segments:True", True),
    ("max_split_size_mb:128,expandable_segments:True", True),
    ("expandable_segments:False", False),
    (" expandable_segments : True ", True),
    ("expandable_segments:True,expandable_segments:False", False),  # the last one wins
    ("garbage_collection_threshold:0.6", False),
])
def test_allocator_settings_are_read_as_torch_reads_them(settings, enabled):
    assert expandable_segments(settings) is enabled
    assert (expandable_segments_reason(settings) is not None) is enabled


@pytest.mark.parametrize("variable", cuda_device.ALLOC_CONF_ENVS)
def test_the_trainers_environment_reaches_the_decision_through_torch(variable):
    code = "from hwsync_cuda.device import expandable_segments_reason as r; print(r() is not None)"
    for value, expected in (("expandable_segments:True", "True"), ("max_split_size_mb:64", "False")):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**_clean_env(), variable: value})
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == expected, (variable, value, done.stdout)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in cuda_device.ALLOC_CONF_ENVS}


class _UsableGpu:
    """A Device stand-in whose probe says usable: the transport's own decision is what is tested."""

    def probe(self) -> ProbeResult:
        return ProbeResult(True, "stand-in")


def test_cuda_ipc_steps_aside_with_the_reason_and_refuses_when_asked_by_name(monkeypatch, caplog):
    monkeypatch.setattr(cuda_device, "allocator_settings", lambda: "expandable_segments:True")
    transport = cuda_ipc.CudaIpcTransport(_UsableGpu())  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="hwsync"):
        first, second = transport.available(), transport.available()
    assert not first.usable and "expandable_segments:True" in first.reason and "pidfd_getfd" in first.reason
    assert "'shm' transport" in first.reason and second == first
    assert sum("falling back to shm" in r.getMessage() for r in caplog.records) == 1, "logged once"
    with pytest.raises(HwsyncError, match="cuda_ipc cannot be used: .*expandable_segments"):
        transport.open_sender(1 << 20, 2)
    monkeypatch.setattr(cuda_device, "allocator_settings", lambda: "expandable_segments:False")
    assert cuda_ipc.CudaIpcTransport(_UsableGpu()).available().usable  # type: ignore[arg-type]
