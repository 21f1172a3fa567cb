"""What every path of the core does with a backend's Device around threads and shared buffers.

Two rules that only an accelerator shows (the CPU backend hides both):
- the current device is per thread, and a new thread starts on device 0 (cudaSetDevice and the
  NPU runtime's set_device are per host thread). Every thread hwsync starts therefore begins on
  the device of the thread that made it (`start_on_this_device`, `DeviceOwner`), so its
  allocations, communicators and synchronizations land where the owner's do;
- device copies run asynchronously. A buffer another process will refill may be handed back
  only once this process's queued reads of it have finished (`synchronize_for`: the whole device;
  `wait_for_queued`: the current stream, by an event where the backend records them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from hwsync.backend.interfaces import Device


def synchronize_for(device: Device, where: torch.device) -> None:
    """Wait until this process's queued work on device `where` has finished; nothing for host memory."""
    if where.type == "cpu" or where.type != device.torch_type:
        return
    current = device.current_index()
    index = current if where.index is None else where.index
    if index == current:
        device.synchronize()
        return
    device.set_index(index)  # Device.synchronize waits for the current device only
    try:
        device.synchronize()
    finally:
        device.set_index(current)


def wait_for_queued(device: Device, where: torch.device) -> None:
    """Wait until the work this process queued on the current stream of device `where` has run: an event where
    the backend records them (the trainer's other streams are not waited for), else the whole device."""
    if where.type == "cpu" or where.type != device.torch_type:
        return
    event = device.record_event(where.index)
    if event is None:
        synchronize_for(device, where)
    else:
        event.synchronize()


class DeviceOwner:
    """The current device of the thread that made this, to be made current in threads it hands work to."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.index = device.current_index() if device.torch_type != "cpu" else None

    def enter(self) -> None:
        """Make the owner's device this thread's current device (call first thing in a new thread)."""
        if self.index is not None and self.device.current_index() != self.index:
            self.device.set_index(self.index)


def start_on_this_device(target: Callable[[], Any], name: str, device: Device | None = None) -> threading.Thread:
    """Start a daemon thread running `target` on the calling thread's current device (of `device`,
    the selected backend's when None)."""
    if device is None:
        from hwsync.backend.registry import get_backend

        device = get_backend().device()
    owner = DeviceOwner(device)

    def run() -> None:
        owner.enter()
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


#: tensor types that always hold a storage of their own and read their bytes there (a wrapper, a DTensor, any
#: type that reads or gathers its memory otherwise is a subclass)
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def identified(ptr: int, tensor: torch.Tensor, data_ptr: Callable[[torch.Tensor], int]) -> bool:
    """Whether `ptr`, the tensor's address as `data_ptr` (a backend's Device.data_ptr) read it, tells its memory
    apart from any other's: only then can a plan hold it.

    torch's data_ptr of a tensor that holds no storage of its own (a wrapper subclass) is 0 plus its offset, the
    same for every such tensor: a plan checked by it would replay copies from, or into, memory the tensor no longer
    uses. Such a tensor has no plan unless its backend gives its own addresses. A tensor without bytes needs none."""
    if tensor.numel() == 0:
        return True
    if ptr == 0:
        return False
    if data_ptr is not torch.Tensor.data_ptr:  # the backend's own addresses: they are its memory's
        return True
    if type(tensor) in PLAIN_TENSOR_TYPES:  # no wrapper: its storage is its own (no storage object made)
        return True
    try:
        return tensor.untyped_storage().data_ptr() != 0
    except RuntimeError:  # "invalid python storage": a wrapper subclass's
        return False
