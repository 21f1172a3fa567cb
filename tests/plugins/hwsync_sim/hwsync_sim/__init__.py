"""hwsync-sim: a strict SIMULATED accelerator, a test-only hwsync backend ("sim"). Not hardware.

It exists so that what only an accelerator shows can be tested on any machine: the bugs that the
CPU backend hides because every copy there is synchronous, there is one device, and shared
memory has no reference counting. It is a faithful model of those semantics, built on CPU
memory, and strict where a real device is merely unlucky:
- device copies finish later, on a per-device stream thread, unless someone waits for them
  (a device or event synchronize, or a device-to-host copy); reading early sees old bytes
  (hwsync_sim.streams, hwsync_sim.tensor);
- N devices (HWSYNC_SIM_DEVICES, default 2); the current device is per thread, and a new thread
  starts on 0; device work on device k from a thread whose current device is j is an error
  (hwsync_sim.runtime);
- fresh device memory holds 0xA5 bytes; freed memory, and buffers released to the other side
  once refilling starts, hold 0xDD, so a late reader sees garbage (hwsync_sim.runtime, .ipc);
- IPC exports are counted as torch counts CUDA IPC, and a buffer its owner freed but a consumer
  never mapped, or never closed, is reported as a leak when the owner collects
  (hwsync_sim.sharing; reports also go to the file named by HWSYNC_SIM_LEAK_LOG);
- simccl behaves as NCCL does: collectives run on a stream, wait() only orders streams, a dead
  peer makes a collective hang, and destroying the group then hangs unless it was aborted
  (hwsync_sim.simccl).
Where the model is strict rather than merely unlucky (device work from a thread on another
device, cross-device copies, reading during a refill), it raises or poisons at once, so a test
fails every time instead of once in a while. Tests drive other processes on the simulated node
with hwsync_sim.peers.

How the core sees sim tensors: they are real torch tensors of device type "sim" (torch's
PrivateUse1 slot, claimed from Python, no C++), so the core's own accelerator code paths run
unchanged; see hwsync_sim.tensor for why and how.

Only hwsync's backend door is used (`from hwsync.backend import ...`, as every backend does), and
nothing in hwsync knows about the sim. Importing this package imports neither torch nor the
runtime; the classes load on first use, and the runtime starts on the first device operation.
Settings: HWSYNC_SIM_DEVICES, HWSYNC_SIM_VISIBLE_DEVICES, HWSYNC_SIM_DEVICE (the main thread's
starting device, as a launcher's set_device(local_rank)), HWSYNC_SIM_MEMORY_GIB (per device,
default 16), HWSYNC_SIM_STREAM_DELAY_S (how long unwaited work takes, default 0.2),
HWSYNC_SIM_LEAK_LOG.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "SimBackend": "hwsync_sim.backend",
    "SimDevice": "hwsync_sim.device",
    "SimIpcTransport": "hwsync_sim.ipc",
    "SimShmTransport": "hwsync_sim.shm",
    "SimProcessGroup": "hwsync_sim.simccl",
    "SimTensor": "hwsync_sim.tensor",
    "runtime": "hwsync_sim.runtime",
    "read_leak_log": "hwsync_sim.runtime",
    "Peer": "hwsync_sim.peers",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    """Load the plugin's classes on first use (see module doc)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hwsync_sim' has no attribute {name!r}")
