"""The backend's contract: the one hwsync module a backend imports, and the list of names it may use.

A backend is a distribution with an entry point in the `hwsync.backends` group naming a Backend
subclass (docs/backends.md): its Device, Communicators over its collective library
(ProcessGroupCommunicator does the work for any torch.distributed backend), and its Transports
(ShmTransport for the host, DeviceShmTransport for shared memory with device copies around it; a
device IPC transport of its own builds on ReceiverExports, release_if_held and AllocatorSegments).

A backend imports `from hwsync.backend import <name>` for the names in `__all__` and nothing else
of hwsync (tests/test_layering.py enforces it), so the core may move its modules without breaking
one. Everything here is import-safe: no vendor runtime, no device touched.
"""

from hwsync.backend.communicator import GroupFactory, ProcessGroupCommunicator, claim_interface_env
from hwsync.backend.device_shm import DeviceShmSendBuffers, DeviceShmTransport
from hwsync.backend.exports import ReceiverExports
from hwsync.backend.interfaces import (
    Backend,
    Communicator,
    Device,
    DeviceSegments,
    Handles,
    ProbeResult,
    ReceiveBuffers,
    Record,
    SegmentPlace,
    SendBuffers,
    Transport,
)
from hwsync.backend.ipc_counters import release_if_held
from hwsync.backend.registry import get_backend, load_backend, select_backend
from hwsync.backend.segments import AllocatorSegments
from hwsync.backend.shm import SharedSegment, ShmTransport
from hwsync.control.nic import Nic
from hwsync.errors import HwsyncError
from hwsync.timing import GROUP_TIMEOUT_S

__all__ = [
    # what a backend implements (hwsync.backend.interfaces)
    "Backend",
    "Communicator",
    "Device",
    "DeviceSegments",
    "ProbeResult",
    "ReceiveBuffers",
    "SendBuffers",
    "Transport",
    # the values those interfaces pass: msgpack maps on the wire, a segment's place in memory
    "Handles",
    "Record",
    "SegmentPlace",
    # communicators: the core's over any torch.distributed backend, and the interface a group binds to
    "GroupFactory",
    "Nic",
    "ProcessGroupCommunicator",
    "claim_interface_env",
    # shared memory: the host's transport and segments, and the one with device copies around them
    "DeviceShmSendBuffers",
    "DeviceShmTransport",
    "SharedSegment",
    "ShmTransport",
    # device IPC: exports counted per receiver, torch's IPC counters, the caching allocator's segments
    "AllocatorSegments",
    "ReceiverExports",
    "release_if_held",
    # the registry: backends by name (a test plugin's peers load another process's backend)
    "get_backend",
    "load_backend",
    "select_backend",
    # errors and timeouts
    "GROUP_TIMEOUT_S",
    "HwsyncError",
]
