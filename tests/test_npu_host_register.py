"""Page-locking shared host memory for NPU copies, and the shm transport over it, without an NPU.

No CANN exists here, so both routes of registration are recording stand-ins: torch_npu 2.13.0's
runtime module (`npurt().npuHostRegister(ptr, size, flags)`, `npuHostUnregister(ptr)`), and for
2.10.0.post4, which has no npurt, AscendCL's own `aclrtHostRegisterV2(ptr, size, flags)` /
`aclrtHostUnregister(ptr)` as C function pointers reached through the prototypes hwsync declares (the
names are checked against the real wheels by test_npu_api_conformance): these tests check hwsync's side
(which route, which memory, which flag, unregistered before it is unmapped and only after the device was
synchronized, a kernel on which CANN forbids it, what a refusal or a missing route leads to, what
`hwsync info` says), not the driver's. The shm transport
(the core's hwsync.backend.device_shm over NpuDevice) runs with "cpu" standing in for the NPU's memory,
over real POSIX shared memory. Why one design fits the NPU as it fits CUDA is read from the real
wheel below (test_torch_npu_copies_asynchronously_only_into_registered_host_memory).
"""

from __future__ import annotations

import mmap
import os
import zipfile
from types import SimpleNamespace

import msgpack
import pytest
import torch
from npu_wheel import CACHE, VERSION, wheel_path

from hwsync.backend.device_shm import DeviceShmTransport
from hwsync.backend.shm import SHM_DIR
from hwsync_npu import host_register
from hwsync_npu.backend import NpuBackend, NpuShmTransport
from hwsync_npu.device import NpuDevice
from hwsync_npu.host_register import ACL_HOST_REG_MAPPED, npurt_route, open_host_pinning

#: a kernel on which CANN allows registering /dev/shm pages (the machine's own may not be one)
NEW_KERNEL = "6.6.0-72.0.0.76.oe2403sp1.aarch64"


class FakeNpuRuntime:
    """npuHostRegister / npuHostUnregister that record their arguments; `refuse` makes register fail."""

    def __init__(self, refuse: bool = False) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[tuple] = []
        self.refuse = refuse

    def npuHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", address, nbytes, flags))
        if self.refuse:
            return 107000  # an ACL error code: the runtime refused
        self.registered[address] = nbytes
        return 0

    def npuHostUnregister(self, address: int) -> int:
        self.calls.append(("unregister", address))
        return 0 if self.registered.pop(address, None) is not None else 107000


class FakeAcl:
    """libascendcl.so's aclrtHostRegisterV2 / aclrtHostUnregister as C function pointers that record their calls."""

    def __init__(self, refuse: bool = False) -> None:
        import ctypes

        self.calls: list[tuple] = []
        self.refuse = refuse
        self._keep = []
        for name, (result, args) in host_register.ACL_PROTOTYPES.items():
            callback = ctypes.CFUNCTYPE(result, *args)(getattr(self, "_" + name))
            self._keep.append(callback)
            setattr(self, name, callback)

    def _aclrtHostRegisterV2(self, address: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", address, nbytes, flags))
        return 107000 if self.refuse else 0

    def _aclrtHostUnregister(self, address: int) -> int:
        self.calls.append(("unregister", address))
        return 0


def _device_with(runtime: object) -> NpuDevice:
    """An NpuDevice whose torch_npu.npu is a stand-in offering npurt() -> runtime, on a kernel CANN allows."""
    device = NpuDevice()
    device._torch_npu = SimpleNamespace(npu=SimpleNamespace(npurt=lambda: runtime))  # type: ignore[assignment]
    device._pinning = open_host_pinning(device._torch_npu.npu, release=NEW_KERNEL)
    return device


class CpuStandInNpu(NpuDevice):
    """An NpuDevice over a recording torch_npu stand-in, the CPU standing in for the NPU's memory.

    `initialized`: whether this process has started torch_npu's NPU state (torch_npu.npu.is_initialized);
    synchronize() is recorded in the runtime's calls, so the order of waits and unregistrations shows."""

    def __init__(self, acl: FakeNpuRuntime, initialized: bool = True) -> None:
        super().__init__()
        self._torch_npu = SimpleNamespace(npu=SimpleNamespace(  # type: ignore[assignment]
            npurt=lambda: acl, is_initialized=lambda: initialized,
            synchronize=lambda: acl.calls.append(("synchronize",))))
        self._pinning = open_host_pinning(self._torch_npu.npu, release=NEW_KERNEL)

    def staging_device(self) -> torch.device:
        """The CPU, standing in for the current NPU."""
        return torch.device("cpu")


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


def test_a_refusal_or_no_route_at_all_keeps_copies_pageable() -> None:
    buffer, tensor = _page_aligned(mmap.PAGESIZE)
    assert not _device_with(FakeNpuRuntime(refuse=True)).pin_host_memory(tensor)

    def no_acl() -> object:
        raise OSError("libascendcl.so: cannot open shared object file: No such file or directory")

    older = open_host_pinning(SimpleNamespace(), release=NEW_KERNEL, acl=no_acl)  # no npurt, and no CANN
    assert older.registrar is None and "no npu.npurt" in older.note and "libascendcl.so" in older.note
    assert "pageable" in older.note

    def no_runtime() -> object:
        raise RuntimeError("torch_npu._C._npurt is unavailable in this build.")  # torch_npu's own words

    assert npurt_route(SimpleNamespace(npurt=no_runtime))[0] is None
    assert npurt_route(SimpleNamespace(npurt=lambda: object()))[0] is None
    if NpuDevice().probe().usable:
        pytest.skip("an NPU is usable here: the no-torch_npu case cannot be shown")
    assert not NpuDevice().pin_host_memory(tensor)  # torch_npu does not import on this machine
    del tensor
    buffer.close()


def test_a_torch_npu_without_npurt_registers_through_ascendcl() -> None:
    # torch-npu 2.10.0.post4, the one vllm-ascend 0.26.0rc1 pins, has no npurt: AscendCL's own call, through ctypes
    acl = FakeAcl()
    pinning = open_host_pinning(SimpleNamespace(), release=NEW_KERNEL, acl=lambda: acl)
    assert pinning.registrar is not None and "aclrtHostRegisterV2" in pinning.note and "pinned" in pinning.note
    buffer, tensor = _page_aligned(2 * mmap.PAGESIZE)
    device = NpuDevice()
    device._torch_npu, device._pinning = SimpleNamespace(npu=SimpleNamespace()), pinning  # type: ignore[assignment]
    assert device.pin_host_memory(tensor)
    device.unpin_host_memory(tensor)
    assert acl.calls == [("register", tensor.data_ptr(), 2 * mmap.PAGESIZE, ACL_HOST_REG_MAPPED),
                         ("unregister", tensor.data_ptr())]
    assert not NpuDevice.pin_host_memory(  # a refusal of AscendCL's is a pageable copy, not an error
        _with_pinning(open_host_pinning(SimpleNamespace(), release=NEW_KERNEL, acl=lambda: FakeAcl(refuse=True))),
        tensor)
    del tensor
    buffer.close()


def _with_pinning(pinning: host_register.HostPinning) -> NpuDevice:
    device = NpuDevice()
    device._torch_npu, device._pinning = SimpleNamespace(npu=SimpleNamespace()), pinning  # type: ignore[assignment]
    return device


@pytest.mark.parametrize("release", ["5.10.0-60.18.0.50.oe2203.aarch64", "4.19.90-52.22.v2207.ky10.aarch64"])
def test_no_registration_on_kernels_where_cann_forbids_it(release: str) -> None:
    # openEuler 22.03 (5.10) and Kylin V10 (4.19), the usual Atlas 800T A2 host OSes: CANN's aclrtHostRegisterV2
    # reference forbids registering memory aclrtMallocHost did not allocate there, whichever route
    runtime, acl = FakeNpuRuntime(), FakeAcl()
    pinning = open_host_pinning(SimpleNamespace(npurt=lambda: runtime), release=release, acl=lambda: acl)
    assert pinning.registrar is None and release in pinning.note and "5.10" in pinning.note
    buffer, tensor = _page_aligned(mmap.PAGESIZE)
    assert not _with_pinning(pinning).pin_host_memory(tensor)
    assert runtime.calls == [] and acl.calls == []
    del tensor
    buffer.close()
    assert host_register.kernel_forbids("5.11.0") is None and host_register.kernel_forbids("6.6.0") is None


def test_the_npu_backend_offers_the_cores_device_shm_over_its_device() -> None:
    backend = NpuBackend()
    transport = backend.transports()["shm"]
    assert isinstance(transport, DeviceShmTransport) and transport.device is backend.device()


def test_hwsync_info_says_whether_shared_memory_copies_are_pinned() -> None:
    # `hwsync info` prints each transport's available() reason
    pinned = NpuShmTransport(_device_with(FakeNpuRuntime())).available()
    assert pinned.usable and "pinned" in pinned.reason and "npurt" in pinned.reason
    forbidden = _with_pinning(open_host_pinning(SimpleNamespace(), release="5.10.0", acl=lambda: FakeAcl()))
    pageable = NpuShmTransport(forbidden).available()
    assert pageable.usable and "pageable" in pageable.reason and "5.10" in pageable.reason


def test_shm_round_trip_stages_a_copy() -> None:
    transport = DeviceShmTransport(CpuStandInNpu(FakeNpuRuntime()))
    sender = transport.open_sender(4096, 2)
    try:
        handles = sender.handles()
        assert handles["kind"] == "shm"
        msgpack.packb(handles, use_bin_type=True)
        receiver = transport.open_receiver(handles)
        try:
            payload = torch.arange(100, dtype=torch.uint8)
            sender.buffer(1)[:100].copy_(payload)
            sender.publish(1, 100)
            view = receiver.view(1, 100)
            assert torch.equal(view, payload)
            assert view.data_ptr() != sender.buffer(1).data_ptr()  # a copy, not the sender's memory
        finally:
            receiver.close()
    finally:
        sender.close()


def test_shm_pins_every_segment_on_both_sides_and_unpins_after_a_wait_before_unmapping() -> None:
    acl = FakeNpuRuntime()
    npu = CpuStandInNpu(acl)
    still_there: list[bool] = []
    unpin = npu.unpin_host_memory

    def checked_unpin(tensor: torch.Tensor) -> None:
        # the sender's segment files still exist when their pages are unregistered
        still_there.append(all(os.path.exists(os.path.join(SHM_DIR, n)) for n in names))
        unpin(tensor)

    npu.unpin_host_memory = checked_unpin  # type: ignore[method-assign]
    transport = DeviceShmTransport(npu)
    sender = transport.open_sender(64 * 1024, 2)
    receiver = None
    try:
        names = sender.handles()["names"]
        receiver = transport.open_receiver(sender.handles())
        assert len(acl.registered) == 4  # two segments, each mapped by both processes' sides
        payload = torch.arange(200, dtype=torch.uint8)
        sender.buffer(0)[:200].copy_(payload)
        sender.publish(0, 200)
        assert acl.calls[-1] == ("synchronize",)  # packed copies may still be queued: publish waits for them
        assert torch.equal(receiver.view(0, 200), payload)
        receiver.release(0)
        assert acl.calls[-1] == ("synchronize",)  # the staging copy may still read the segment
        receiver.close()
        assert len(acl.registered) == 2  # the receiver's registrations are gone, the sender's remain
        sender.close()
        assert not acl.registered and still_there == [True] * 4
        assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
        sender.close()  # twice is safe: nothing is unregistered again
        assert sum(1 for c in acl.calls if c[0] == "unregister") == 4
        # each side waits for the device right before it unregisters (an async copy may still touch the pages)
        firsts = [i for i, c in enumerate(acl.calls) if c[0] == "unregister" and acl.calls[i - 1][0] != "unregister"]
        assert len(firsts) == 2 and all(acl.calls[i - 1] == ("synchronize",) for i in firsts)
    finally:
        if receiver is not None:
            receiver.close()
        sender.close()


def test_a_sender_that_never_started_the_npu_pins_nothing_and_never_waits() -> None:
    acl = FakeNpuRuntime()
    sender = DeviceShmTransport(CpuStandInNpu(acl, initialized=False)).open_sender(4096, 2)
    try:
        sender.buffer(0)[:10].fill_(1)
        sender.publish(0, 10)
    finally:
        sender.close()
    assert acl.calls == []  # no npuHostRegister, no synchronize: host tensors only need neither


def test_torch_npu_copies_asynchronously_only_into_registered_host_memory() -> None:
    """The one shm design (pack with non_blocking device-to-host copies, wait at publish) holds on the NPU
    because torch_npu treats registered host memory as CUDA treats cudaHostRegister'd memory.

    torch_npu/csrc/core/npu/CachingHostAllocator.cpp (Ascend/pytorch), process_non_blocking_copy: after
    a non_blocking copy is queued, aclrtPointerGetAttributes of the host pointer decides; memory the
    runtime knows as host memory ("allocated by aclrtMallocHost or malloc and register") only has the
    stream recorded, so the copy stays asynchronous; any other memory makes it synchronous. Checked
    here in the 2.13.0 wheel: the declaration in its headers and both branches' log lines in its library."""
    path = wheel_path()
    if path is None:
        pytest.skip(f"torch-npu {VERSION} wheel not in {CACHE} and could not be fetched (run ci/fetch-torch-npu.sh)")
    with zipfile.ZipFile(path) as wheel:
        header = wheel.read("torch_npu/include/torch_npu/csrc/core/npu/CachingHostAllocator.h").decode()
        library = wheel.read("torch_npu/lib/libtorch_npu.so")
    assert "void process_non_blocking_copy(" in header
    assert "the host memory is allocated by aclrtMallocHost or malloc and register" in header
    assert b"non_blocking copy without StreamSynchronize." in library  # the copy is queued, not waited for
    assert b"The memory is registered." in library  # registered host pages: stays asynchronous
    assert b"The copy of the kind needs to be converted to synchronous" in library  # pageable: made synchronous
    assert b"aclrtPointerGetAttributes" in library
