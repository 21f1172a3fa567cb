"""What a backend author needs, in one module: the interfaces to implement and the core's reusable parts.

A backend is a distribution with an entry point in the `hwsync.backends` group naming a Backend
subclass (docs/backends.md): its Device, Communicators over its collective library
(ProcessGroupCommunicator does the work for any torch.distributed backend), and its Transports
(ShmTransport for the host, DeviceShmTransport for shared memory with device copies around it).
"""

from hwsync.backend.communicator import ProcessGroupCommunicator
from hwsync.backend.device_shm import DeviceShmTransport
from hwsync.backend.interfaces import (
    Backend,
    Communicator,
    Device,
    Handles,
    ProbeResult,
    ReceiveBuffers,
    SendBuffers,
    Transport,
)
from hwsync.backend.registry import get_backend, select_backend
from hwsync.backend.shm import ShmTransport

__all__ = ["Backend", "Communicator", "Device", "DeviceShmTransport", "Handles", "ProbeResult",
           "ProcessGroupCommunicator", "ReceiveBuffers", "SendBuffers", "ShmTransport", "Transport", "get_backend",
           "select_backend"]
