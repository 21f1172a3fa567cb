"""Page-locking shared host memory for NPU copies (torch_npu's npurt), without an NPU.

No CANN exists here, so torch_npu's runtime module is a recording fake of the two calls
torch_npu 2.13.0 binds (`npurt().npuHostRegister(ptr, size, flags)` and
`npuHostUnregister(ptr)`, returning an ACL error code; the names are checked against the
real wheel by test_npu_api_conformance): these tests check hwsync's side (which memory is
registered, with which flag, unregistered before it is unmapped, what a refusal or an older
torch_npu leads to), not the driver's. The shm transport runs with "cpu" standing in for the
NPU, over real POSIX shared memory.
"""

from __future__ import annotations

import mmap
import os
from types import SimpleNamespace

import pytest
import torch

from hwsync.shm import SHM_DIR
from hwsync_npu.device import NpuDevice
from hwsync_npu.host_register import ACL_HOST_REG_MAPPED, open_host_register
from hwsync_npu.shm import DeviceCopyShmTransport


class FakeNpuRuntime:
    """npuHostRegister / npuHostUnregister that record their arguments; `refuse` makes register fail."""

    def __init__(self, refuse: bool = False) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[tuple] = []
        self.refuse = refuse

    def npuHostRegister(self, address: int, nbytes: int, flags: int) -> int:  # noqa: N802 - torch_npu's name
        self.calls.append(("register", address, nbytes, flags))
        if self.refuse:
            return 107000  # an ACL error code: the runtime refused
        self.registered[address] = nbytes
        return 0

    def npuHostUnregister(self, address: int) -> int:  # noqa: N802
        self.calls.append(("unregister", address))
        return 0 if self.registered.pop(address, None) is not None else 107000


def _device_with(runtime: object) -> NpuDevice:
    """An NpuDevice whose torch_npu.npu is a stand-in offering npurt() -> runtime."""
    device = NpuDevice()
    device._torch_npu = SimpleNamespace(npu=SimpleNamespace(npurt=lambda: runtime))  # type: ignore[assignment]
    return device


def _page_aligned(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    buffer = mmap.mmap(-1, nbytes)  # anonymous mappings start on a page
    return buffer, torch.frombuffer(buffer, dtype=torch.uint8)


def test_pin_registers_the_whole_tensor_mapped_and_unpin_undoes_it() -> None:
    acl = FakeNpuRuntime()
    device = _device_with(acl)
    buffer, tensor = _page_aligned(3 * mmap.PAGESIZE)
    assert device.pin_host_memory(tensor)
    assert acl.calls == [("register", tensor.data_ptr(), 3 * mmap.PAGESIZE, ACL_HOST_REG_MAPPED)]
    device.unpin_host_memory(tensor)
    assert acl.calls[-1] == ("unregister", tensor.data_ptr()) and not acl.registered
    del tensor
    buffer.close()


def test_pin_refuses_what_aclrthostregister_cannot_take_without_calling_it() -> None:
    acl = FakeNpuRuntime()
    device = _device_with(acl)
    buffer, tensor = _page_aligned(2 * mmap.PAGESIZE)
    assert not device.pin_host_memory(tensor[1:])  # AscendCL requires a page-aligned start
    assert not device.pin_host_memory(tensor[:0])  # nothing to register
    assert not device.pin_host_memory(torch.empty(0, device="meta"))  # not host memory
    assert acl.calls == []
    del tensor
    buffer.close()


def test_a_refusal_an_older_torch_npu_or_no_torch_npu_keeps_copies_pageable() -> None:
    buffer, tensor = _page_aligned(mmap.PAGESIZE)
    assert not _device_with(FakeNpuRuntime(refuse=True)).pin_host_memory(tensor)

    older = NpuDevice()  # a torch_npu without npurt
    older._torch_npu = SimpleNamespace(npu=SimpleNamespace())  # type: ignore[assignment]
    assert not older.pin_host_memory(tensor)

    def no_runtime() -> object:
        raise RuntimeError("torch_npu._C._npurt is unavailable in this build.")  # torch_npu's own words

    assert open_host_register(SimpleNamespace(npurt=no_runtime)) is None  # type: ignore[arg-type]
    assert open_host_register(SimpleNamespace(npurt=lambda: object())) is None  # type: ignore[arg-type]
    if NpuDevice().probe().usable:
        pytest.skip("an NPU is usable here: the no-torch_npu case cannot be shown")
    assert not NpuDevice().pin_host_memory(tensor)  # torch_npu does not import on this machine
    del tensor
    buffer.close()


def test_device_copy_shm_pins_every_segment_on_both_sides_and_unpins_before_unmapping() -> None:
    acl = FakeNpuRuntime()
    npu = _device_with(acl)
    still_there: list[bool] = []
    unpin = npu.unpin_host_memory

    def checked_unpin(tensor: torch.Tensor) -> None:
        # the sender's segment files still exist when their pages are unregistered
        still_there.append(all(os.path.exists(os.path.join(SHM_DIR, n)) for n in names))
        unpin(tensor)

    npu.unpin_host_memory = checked_unpin  # type: ignore[method-assign]
    transport = DeviceCopyShmTransport(lambda: torch.device("cpu"), host=npu)
    sender = transport.open_sender(64 * 1024, 2)
    receiver = None
    try:
        names = sender.handles()["names"]
        receiver = transport.open_receiver(sender.handles())
        assert len(acl.registered) == 4  # two segments, each mapped by both processes' sides
        payload = torch.arange(200, dtype=torch.uint8)
        sender.buffer(0)[:200].copy_(payload)
        sender.publish(0, 200)
        assert torch.equal(receiver.view(0, 200), payload)
        receiver.close()
        assert len(acl.registered) == 2  # the receiver's registrations are gone, the sender's remain
        sender.close()
        assert not acl.registered and still_there == [True] * 4
        assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
        sender.close()  # twice is safe: nothing is unregistered again
        assert sum(1 for c in acl.calls if c[0] == "unregister") == 4
    finally:
        if receiver is not None:
            receiver.close()
        sender.close()
