"""sim_ipc: the sender's device buffers mapped straight into receivers, as CUDA IPC does it.

Built like hwsync_cuda's CudaIpcTransport, so the same kinds of bugs show here:
- the sender allocates N device buffers once and exports them for each receiver process when it
  is first offered them (hwsync.backend.exports; hwsync_sim.sharing counts exports as torch counts CUDA
  IPC: one expected consumer per export), and releases the exports of receivers that refused
  them or died;
- the receiver maps the buffers on its own current device (peer access when that is not the
  sender's device, as torch_npu, vllm-ascend, verl and vLLM rebuild handles), so the sender's
  device need not be visible to it; a receiver in the sender's own process uses the sender's
  tensors (CUDA cannot open its own handles);
- publish() waits for an event on the buffers' device stream, where the packing copies ran (not a
  device-wide synchronize); close() drops the buffers and collects, and the sim reports every buffer
  still parked in IPC limbo then (torch would keep it silently);
- the sender's own device memory is shared the same way for mapped sources (device_segments():
  hwsync_sim.segments);
- release() only says the receiver is done, as NPU IPC's did (CUDA's synchronizes the device
  first): the receiver's copies out of a buffer may still be queued when it is released, unless
  the caller (hwsync's receiver) waited for them;
- when the sender starts refilling a buffer the receivers released, the sim poisons it first:
  a receiver's copy that runs after its release reads garbage, as it would read the next
  bucket's bytes on a device.
"""

from __future__ import annotations

import os
import secrets
import weakref

import torch

from hwsync.backend import (
    DeviceSegments,
    Handles,
    HwsyncError,
    ProbeResult,
    ReceiveBuffers,
    ReceiverExports,
    SendBuffers,
    Transport,
)
from hwsync_sim import sharing
from hwsync_sim.device import SimDevice
from hwsync_sim.runtime import POISON, TYPE, runtime
from hwsync_sim.segments import SimDeviceSegments
from hwsync_sim.tensor import host_view

HANDLE_KIND = "sim_ipc"

# Senders alive in this process, by token (a receiver here uses their tensors directly).
_LOCAL_SENDERS: "weakref.WeakValueDictionary[str, SimIpcSendBuffers]" = weakref.WeakValueDictionary()


class SimIpcSendBuffers(SendBuffers):
    """N device buffers on the current sim device, exported once for the whole session."""

    def __init__(self, device: SimDevice, bucket_bytes: int, num_buffers: int) -> None:
        if bucket_bytes <= 0 or num_buffers <= 0:
            raise ValueError(f"sim_ipc needs bucket_bytes > 0 and num_buffers > 0, got {bucket_bytes}, {num_buffers}")
        self.bucket_bytes = bucket_bytes
        self.num_buffers = num_buffers
        self.device = device
        self.device_index = device.current_index()
        self.physical_id = device.physical_id(self.device_index)
        self.token = secrets.token_hex(16)
        where = torch.device(TYPE, self.device_index)
        sharing.collect(runtime(), report=False)  # as torch.cuda.ipc_collect() before allocating
        self.buffers = [torch.empty(bucket_bytes, dtype=torch.uint8, device=where) for _ in range(num_buffers)]
        self._exports = ReceiverExports(lambda: [sharing.share(b) for b in self.buffers], sharing.release_if_held)
        self._published: set[int] = set()
        _LOCAL_SENDERS[self.token] = self

    def handles(self) -> Handles:
        """Handles for one receiver process that is not told apart from others (see handles_for)."""
        return self.handles_for("", None, None)

    def handles_for(self, receiver: str, pid: int | None, host: str | None) -> Handles:
        """The sender's device id and this receiver's own export of each buffer (none in this process)."""
        if not self.buffers:
            raise HwsyncError("sim_ipc send buffers are closed; open the transport again")
        records = self._exports.records_for(receiver, pid, host)
        return {"kind": HANDLE_KIND, "physical_id": self.physical_id, "bytes": self.bucket_bytes,
                "pid": os.getpid(), "token": self.token, "buffers": [dict(e) for e in records]}

    def release_for(self, receiver: str) -> None:
        """The receiver never maps its exports (refused, or died): release them for it."""
        self._exports.release(receiver)

    def buffer(self, index: int) -> torch.Tensor:
        """Device buffer `index` to pack into; a released buffer is poisoned as refilling starts."""
        if not self.buffers:
            raise HwsyncError("sim_ipc send buffers are closed; open the transport again")
        if index in self._published:
            self._published.discard(index)
            host_view(self.buffers[index]).fill_(POISON)  # the worst moment for a late reader
        return self.buffers[index]

    def publish(self, index: int, nbytes: int) -> None:
        """Wait until the packing copies queued on the buffers' device stream have written the buffer."""
        if not 0 <= nbytes <= self.bucket_bytes:
            raise ValueError(f"cannot publish {nbytes} bytes from a buffer of {self.bucket_bytes}")
        self.device.record_event(self.device_index).synchronize()
        self._published.add(index)

    def close(self) -> None:
        """Drop the buffers, collect, and report what stays in IPC limbo."""
        if not self.buffers:
            return
        _LOCAL_SENDERS.pop(self.token, None)
        self._exports.forget()
        self.buffers = []
        sharing.collect(runtime(), report=True)


class SimIpcReceiveBuffers(ReceiveBuffers):
    """The sender's buffers mapped into this process on its own current device."""

    def __init__(self, device: SimDevice, handles: Handles) -> None:
        if handles.get("kind") != HANDLE_KIND:
            raise ValueError(f"sim_ipc receiver got handles of kind {handles.get('kind')!r}")
        self.bucket_bytes = int(handles["bytes"])
        local = _LOCAL_SENDERS.get(str(handles.get("token")))
        if local is not None and int(handles.get("pid", -1)) == os.getpid():
            self.device_index = local.device_index
            self.tensors = list(local.buffers)
            return
        self.device_index = device.current_index()  # the receiver's own device: peer access if not the sender's
        self.tensors = [sharing.open_shared(record, self.device_index) for record in handles["buffers"]]

    def view(self, index: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the sender's buffer `index`, in place on the device."""
        if not self.tensors:
            raise HwsyncError("sim_ipc receive buffers are closed; open the transport again")
        if not 0 <= nbytes <= self.bucket_bytes:
            raise ValueError(f"cannot view {nbytes} bytes of a buffer of {self.bucket_bytes}")
        return self.tensors[index][:nbytes]

    def release(self, index: int) -> None:
        """Done with buffer `index`: nothing waits here (see the module doc)."""

    def close(self) -> None:
        """Unmap the sender's buffers (their memory stays the sender's)."""
        self.tensors = []


class SimIpcTransport(Transport):
    """Same-node transfer through shared (simulated) device memory; the sim's default."""

    name = HANDLE_KIND
    # CUDA IPC uses 512 MiB; the sim's buffers are real host memory, shared by every test worker.
    default_bucket_bytes = 32 << 20

    def __init__(self, device: SimDevice) -> None:
        self._device = device
        self._segments = SimDeviceSegments()

    def available(self) -> ProbeResult:
        """Usable wherever the simulated device is."""
        probe = self._device.probe()
        if not probe.usable:
            return probe
        return ProbeResult(True, "simulated device memory shared between processes on this node, counted as torch "
                                 "counts CUDA IPC")

    def open_sender(self, bucket_bytes: int, num_buffers: int) -> SendBuffers:
        """Allocate and export `num_buffers` device buffers on the current sim device."""
        return SimIpcSendBuffers(self._device, bucket_bytes, num_buffers)

    def open_receiver(self, handles: Handles, owner_pid: int | None = None) -> ReceiveBuffers:
        """Map the sender's buffers on this thread's current sim device."""
        return SimIpcReceiveBuffers(self._device, handles)

    def device_segments(self) -> DeviceSegments:
        """The sender's own allocations, read in place by receivers (mapped sources)."""
        return self._segments
