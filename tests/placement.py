"""Where each rank of a multi-process test runs: the backend under test, each rank on a device of its own.

Collective libraries on accelerators take one device per rank (NCCL refuses two ranks on one GPU,
and so does the simulated accelerator), so a test gives rank i its own device index. On the
simulated accelerator that is HWSYNC_SIM_DEVICE, read when the child first uses the sim (the
launcher's set_device(local_rank)); on a real one, set_index.
"""

from __future__ import annotations

import os

import pytest

from hwsync.backend.interfaces import Backend


def need_devices(backend: Backend, ranks: int) -> None:
    """Skip unless `backend` has a device for each of `ranks` ranks (the CPU has as many as it needs)."""
    if backend.name == "cpu":
        return
    count = backend.device().count()
    if count < ranks:
        pytest.skip(f"needs {ranks} {backend.name} devices, one per rank; {count} visible")


def place(name: str, index: int) -> None:
    """In a rank's process (or the test's, for rank 0), before it touches a device: backend `name`, device `index`."""
    os.environ["HWSYNC_BACKEND"] = name
    if name == "sim":
        os.environ["HWSYNC_SIM_DEVICE"] = str(index)
        from hwsync_sim.runtime import initialized

        if not initialized():
            return  # the main thread starts on HWSYNC_SIM_DEVICE when the sim starts
    if name != "cpu":
        from hwsync.backend.registry import load_backend

        load_backend(name).device().set_index(index)
