"""NVIDIA GPUs as a hwsync Device, over torch.cuda.

Rules:
- `probe()` never creates a CUDA context and never calls `torch.cuda.init()`: it reads how torch
  was built, then counts GPUs through `torch.cuda.device_count()`, which asks NVML first (no
  context, fork stays safe) and only falls back to `cudaGetDeviceCount` (driver init, still no
  context) when NVML is unusable;
- every other method is runtime use and may initialise CUDA;
- a GPU's identity across processes is its uuid, written NVML-style (`GPU-xxxxxxxx-...`), the
  form `nvidia-smi -L` prints and CUDA_VISIBLE_DEVICES accepts; local indices differ between
  processes with different CUDA_VISIBLE_DEVICES, uuids do not.
"""

from __future__ import annotations

import ctypes
import os

import torch

from hwsync.backend import Device, ProbeResult

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
UUID_PREFIX = "GPU-"


def normalize_uuid(uuid: str) -> str:
    """A uuid in NVML form, `GPU-` plus lowercase hex, whichever form it arrived in."""
    text = str(uuid).strip().lower()
    if text.startswith(UUID_PREFIX.lower()):
        text = text[len(UUID_PREFIX):]
    return UUID_PREFIX + text


def device_uuid(index: int) -> str:
    """The NVML-style uuid of local CUDA device `index` (initialises CUDA)."""
    uuid = torch.cuda.get_device_properties(index).uuid
    raw = getattr(uuid, "bytes", None)
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 16:
        h = bytes(raw).hex()
        return f"{UUID_PREFIX}{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
    # Older torch exposes only str(uuid), the dashed hex without the GPU- prefix.
    return normalize_uuid(str(uuid))


def local_index_of_uuid(uuid: str) -> int | None:
    """The local index of the GPU with `uuid` in this process, or None if it is not visible."""
    wanted = normalize_uuid(uuid)
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == wanted:
            return index
    return None


def visible_devices_text() -> str:
    """CUDA_VISIBLE_DEVICES as it is set here, for messages (`unset` when absent)."""
    value = os.environ.get(VISIBLE_DEVICES_ENV)
    return "unset" if value is None else repr(value)


#: where torch reads its caching allocator's settings (the first is the older, CUDA-only name)
ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def allocator_settings() -> str:
    """This process's caching-allocator settings as torch holds them (env or set at run time)."""
    try:
        return str(torch._C._accelerator_getAllocatorSettings())
    except Exception:  # noqa: BLE001 - an older torch: what the environment says
        return ",".join(os.environ.get(name, "") for name in ALLOC_CONF_ENVS)


def expandable_segments(settings: str) -> bool:
    """Whether allocator settings ("key:value,key:value", the last of a key wins) enable expandable segments."""
    enabled = False
    for option in settings.split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments":
            enabled = value.strip() == "True"
    return enabled


def expandable_segments_reason(settings: str | None = None) -> str | None:
    """Why CUDA IPC cannot be relied on with these allocator settings (this process's when None), or None."""
    if not expandable_segments(allocator_settings() if settings is None else settings):
        return None
    return ("the trainer's CUDA caching allocator has expandable_segments:True (PYTORCH_CUDA_ALLOC_CONF or "
            "PYTORCH_ALLOC_CONF): torch then shares GPU memory as file descriptors that each receiver fetches with "
            "pidfd_getfd, which unprivileged containers refuse. hwsync uses the 'shm' transport instead; to share "
            "GPU memory directly, drop expandable_segments:True for the trainer (or set expandable_segments:False)")


def _nvidia_driver_loadable() -> bool:
    # libnvidia-ml ships with the driver: if it cannot be loaded, no driver is installed here.
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def probe_cuda() -> ProbeResult:
    """Whether torch can drive an NVIDIA GPU here, and exactly why not; creates no CUDA context."""
    details: dict[str, object] = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        VISIBLE_DEVICES_ENV: os.environ.get(VISIBLE_DEVICES_ENV),
    }
    if getattr(torch.version, "hip", None):
        return ProbeResult(
            False,
            f"torch {torch.__version__} is a ROCm (HIP {torch.version.hip}) build; hwsync-cuda drives "
            "NVIDIA GPUs with a CUDA build of torch",
            details,
        )
    if torch.version.cuda is None or not torch.backends.cuda.is_built():
        return ProbeResult(
            False,
            f"torch {torch.__version__} was built without CUDA; install a CUDA build of torch "
            "(e.g. pip install torch --index-url https://download.pytorch.org/whl/cu128)",
            details,
        )
    count = torch.cuda.device_count()
    details["count"] = count
    details["nccl"] = _nccl_available()
    if count > 0:
        return ProbeResult(
            True, f"{count} NVIDIA GPU(s) visible; torch {torch.__version__} with CUDA {torch.version.cuda}", details
        )
    visible = os.environ.get(VISIBLE_DEVICES_ENV)
    if visible is not None:
        return ProbeResult(
            False,
            f"no NVIDIA GPU visible ({VISIBLE_DEVICES_ENV}={visible!r}); set it to GPUs this machine has "
            "(see nvidia-smi -L) or unset it",
            details,
        )
    if not _nvidia_driver_loadable():
        return ProbeResult(
            False, "no NVIDIA driver here (libnvidia-ml.so.1 cannot be loaded); run on a GPU machine", details
        )
    return ProbeResult(
        False, "the NVIDIA driver is installed but reports no GPU; check nvidia-smi and the container's GPU access",
        details,
    )


def _nccl_available() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_nccl_available())


#: cudaHostRegisterReadOnly (cuda_runtime_api.h): register pages the process may only read
CUDA_HOST_REGISTER_READ_ONLY = 8


class CudaDevice(Device):
    """NVIDIA GPUs seen by this process through torch.cuda."""

    name = "cuda"
    torch_type = "cuda"
    visible_devices_env = VISIBLE_DEVICES_ENV

    def probe(self) -> ProbeResult:
        """Whether a GPU is usable, without creating a CUDA context; never raises."""
        try:
            return probe_cuda()
        except Exception as exc:  # noqa: BLE001 - a probe reports, it does not fail the caller
            return ProbeResult(False, f"probing CUDA raised {type(exc).__name__}: {exc}")

    def count(self) -> int:
        """Visible GPUs (NVML-based where possible, so no context is created)."""
        return torch.cuda.device_count()

    def current_index(self) -> int:
        """The current CUDA device of this process."""
        return torch.cuda.current_device()

    def set_index(self, index: int) -> None:
        """Make `index` the current CUDA device."""
        count = self.count()
        if not 0 <= index < count:
            raise ValueError(
                f"CUDA device {index} does not exist: {count} visible ({VISIBLE_DEVICES_ENV}={visible_devices_text()})"
            )
        torch.cuda.set_device(index)

    def synchronize(self) -> None:
        """Wait for every stream of the current device."""
        torch.cuda.synchronize()

    def _index(self, index: int | None) -> int:
        return self.current_index() if index is None else index

    def pin_host_memory(self, tensor: torch.Tensor, *, read_only: bool = False) -> bool:
        """cudaHostRegister the tensor's pages (shared memory included), so host-to-device copies run at full
        speed and asynchronously; False (and pageable copies) when the driver refuses."""
        nbytes = tensor.numel() * tensor.element_size()
        if not nbytes or tensor.device.type != "cpu":
            return False
        # cudaHostRegisterDefault (0), or cudaHostRegisterReadOnly: pages mapped read-only (a receiver's view of a
        # sender's segment) can be registered only with it, and the device then only reads them
        flags = CUDA_HOST_REGISTER_READ_ONLY if read_only else 0
        return int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, flags)) == 0

    def unpin_host_memory(self, tensor: torch.Tensor) -> None:
        """cudaHostUnregister what pin_host_memory registered."""
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())

    def record_event(self, index: int | None = None) -> torch.cuda.Event:
        """A torch.cuda.Event recorded now on the current stream of GPU `index` (the current GPU when None)."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._index(index)))
        return event

    def runtime_in_use(self) -> bool:
        """Whether this process has initialised CUDA (only then can GPU work be in flight); never initialises it."""
        return torch.cuda.is_initialized()

    def staging_device(self) -> torch.device | None:
        """The current GPU where torch sees one (asking creates no context), else None: the host view."""
        if not torch.cuda.is_available():
            return None
        return torch.device("cuda", torch.cuda.current_device())

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        """(free, total) from cudaMemGetInfo, which counts other processes' use too."""
        free, total = torch.cuda.mem_get_info(self._index(index))
        return int(free), int(total)

    def memory_allocated(self, index: int | None = None) -> int:
        """Bytes held by live tensors in this process's caching allocator."""
        return int(torch.cuda.memory_allocated(self._index(index)))

    def memory_reserved(self, index: int | None = None) -> int:
        """Bytes the caching allocator holds from the driver."""
        return int(torch.cuda.memory_reserved(self._index(index)))

    def empty_cache(self) -> None:
        """Return unused cached blocks to the driver."""
        torch.cuda.empty_cache()

    def physical_id(self, index: int | None = None) -> str:
        """The GPU's uuid (`GPU-...`), the same in every process whatever CUDA_VISIBLE_DEVICES says."""
        return device_uuid(self._index(index))

    def local_index(self, physical_id: str) -> int:
        """The local index of the GPU with this uuid; the error says how to make it visible."""
        index = local_index_of_uuid(physical_id)
        if index is None:
            raise LookupError(
                f"GPU {normalize_uuid(physical_id)} is not visible to this process "
                f"({VISIBLE_DEVICES_ENV}={visible_devices_text()}, {self.count()} GPU(s) visible); "
                f"add it to {VISIBLE_DEVICES_ENV} (by index or uuid, see nvidia-smi -L)"
            )
        return index
