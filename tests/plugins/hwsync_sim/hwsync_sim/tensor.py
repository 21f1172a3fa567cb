"""Tensors on the simulated device: torch sees device "sim", the bytes live in host memory.

Why it is built this way (the choice the sim rests on):
- the core must run its real accelerator code paths: allocate with torch.empty(device=...),
  copy with copy_ (its memmove fast path only when both sides are "cpu"), slice, .view(dtype),
  move parameters with `.data =`. So sim tensors must be genuine torch tensors whose device type
  is not "cpu", with every operation on them routed through the simulator;
- torch lets a Python package claim its spare device slot (PrivateUse1) without C++: it is
  renamed "sim", given a device guard, and given kernels through torch.library
  (torch.utils.backend_registration._setup_privateuseone_for_python_backend does the same, and
  torch's own test_privateuseone_python_backend.py is the worked example);
- the tensors themselves are a `__torch_dispatch__` wrapper subclass (SimTensor): a storage-less
  tensor whose metadata is the device tensor's, and which holds the Block (allocation) its bytes
  live in. Every aten operation on one arrives at `dispatch`, which runs it on host views of
  those bytes, in stream order, with the device checks a GPU would (or should) make;
- `param.data = sim_tensor` (how hwsync onloads, and what Module.to does) turns a plain tensor
  into a storage-less "sim" tensor that is no SimTensor: its storage is remembered when torch
  asks whether the move is allowed, and its operations reach `dispatch` through a PrivateUse1
  fallback kernel.

What an operation does (see hwsync_sim.runtime for the device model):
- views (slice, view, view(dtype), detach, ...): metadata only, allowed from any thread;
- copies (each counted as one launch, its bytes on the device that runs it: Runtime.count_copy): host to
  device reads the source at once (pageable memory is staged) and writes the
  device bytes later on the stream, except from host memory pinned with SimDevice.pin_host_memory,
  which (as cudaHostRegister'd memory on CUDA) is read only when the copy runs; device to device runs later on the stream; device to host
  waits for the stream, as a copy into pageable memory does, except a non_blocking copy into
  pinned memory, which (as on CUDA) is queued and returns at once. So a destination read early has
  the old bytes; torch._foreach_copy_ of tensors on one device is one launch (CUDA's multi-tensor
  kernel, issued from C++), queued like a copy; across devices, a copy per tensor (CUDA's slow path);
- any other kernel is queued on the stream too (its outputs' shapes come from meta tensors);
  one that returns a value to the host (item, equal) waits for the stream, as on a GPU;
- each of these needs the tensors' device to be the calling thread's current device.
"""

from __future__ import annotations

import threading
import types
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

from hwsync_sim.runtime import TYPE, Block, SimDeviceError, SimError, runtime

aten = torch.ops.aten


class SimTensor(torch.Tensor):
    """A tensor on a simulated device: torch holds its metadata, its Block holds the bytes."""

    _block: Block

    @staticmethod
    def __new__(cls, block: Block, shape: Any, stride: Any, offset: int, dtype: torch.dtype) -> "SimTensor":
        tensor = torch.Tensor._make_wrapper_subclass(cls, shape, strides=stride, storage_offset=offset, dtype=dtype,
                                                     device=torch.device(TYPE, block.mem.index))
        tensor._block = block
        return tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: D105 - torch's protocol
        return dispatch(func, args, kwargs or {})

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"SimTensor(shape={tuple(self.shape)}, dtype={self.dtype}, device='{self.device}')"

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        """Refused as for any device tensor."""
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the "
                        "tensor to host memory first.")

    def tolist(self) -> Any:
        """A device-to-host copy, then the values (what torch does for a CUDA tensor)."""
        return self.cpu().tolist()


def is_sim(tensor: Any) -> bool:
    """Whether `tensor` is a tensor on the simulated device (a SimTensor or a plain one)."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type == TYPE


# Plain "sim" tensors made by `.data = sim_tensor`: their storage -> the Block behind it.
_transplants: dict[int, tuple[StorageWeakRef, Block]] = {}
_transplants_lock = threading.Lock()


def forget_dead_transplants() -> None:
    """Let go of the Blocks of moved-into tensors whose storage is gone (`param.data = other` freed the old one):
    as torch frees a storage with its last tensor, the sim frees (or parks) its memory then, not at the next move."""
    with _transplants_lock:
        dead = [_transplants.pop(k) for k, (ref, _) in list(_transplants.items()) if ref.expired()]
    del dead  # outside the lock: freeing a Block runs the runtime's free, which may collect, which comes back here


def block_of(tensor: torch.Tensor) -> Block:
    """The Block holding a sim tensor's bytes."""
    if isinstance(tensor, SimTensor):
        return tensor._block
    entry = _transplants.get(tensor.untyped_storage()._cdata)
    if entry is None or entry[0].expired():
        raise SimError(f"sim: a {tensor.device} tensor that the simulator did not make (shape {tuple(tensor.shape)}); "
                       "only torch.empty/.to/copies onto the sim device and `.data =` are modelled")
    return entry[1]


def as_sim(tensor: torch.Tensor) -> SimTensor:
    """A sim tensor as a SimTensor (a plain one gets a SimTensor alias of the same bytes)."""
    if isinstance(tensor, SimTensor):
        return tensor
    return SimTensor(block_of(tensor), tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype)


def host_view(tensor: SimTensor) -> torch.Tensor:
    """A host tensor aliasing the device tensor's bytes as they are in memory right now."""
    storage = tensor._block.mem.data.untyped_storage()
    return torch.empty(0, dtype=tensor.dtype).set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())


def _extent_bytes(shape: Any, stride: Any, dtype: torch.dtype) -> int:
    if any(s == 0 for s in shape):
        return 0
    return (sum((s - 1) * st for s, st in zip(shape, stride)) + 1) * dtype.itemsize


def new_tensor(index: int, shape: Any, stride: Any, dtype: torch.dtype) -> SimTensor:
    """Allocate a device tensor on `index` (the calling thread's current device)."""
    rt = runtime()
    rt.require_current(index, f"allocating {tuple(shape)} {dtype}")
    return SimTensor(rt.allocate(index, _extent_bytes(shape, stride, dtype)), shape, stride, 0, dtype)


def _index_of(device: Any) -> int:
    device = torch.device(device) if device is not None else torch.device(TYPE)
    return runtime().current() if device.index is None else device.index


# -- the operations --------------------------------------------------------------------------------

def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run one aten operation that involves a sim tensor."""
    if func is aten._has_compatible_shallow_copy_type.default:
        return _allow_move(*args)
    if func is aten.lift_fresh.default:
        return args[0]
    if func.is_view:
        return _view(func, args, kwargs)
    if func is aten.copy_.default:
        return copy(args[0], args[1], bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False)))
    if func is aten._foreach_copy_.default:
        non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
        return foreach_copy(args[0], args[1], non_blocking)
    if func is aten._to_copy.default:
        return _to_copy(*args, **kwargs)
    if func is aten.record_stream.default:
        return None  # one stream per device: nothing to record
    return _kernel(func, args, kwargs)


def _allow_move(tensor: torch.Tensor, new: torch.Tensor) -> bool:
    """`tensor.data = new` (or Module.to): allowed into plain tensors, whose new storage is remembered."""
    if isinstance(tensor, SimTensor):
        return False  # a SimTensor's bytes are its Block's; it cannot take other memory
    if isinstance(new, SimTensor):
        storage = new.untyped_storage()
        forget_dead_transplants()
        with _transplants_lock:
            _transplants[storage._cdata] = (StorageWeakRef(storage), new._block)
    return True


def _view(func: Any, args: tuple, kwargs: dict) -> Any:
    base = as_sim(args[0])
    out = func(host_view(base), *args[1:], **kwargs)  # metadata only: no device work, no device check
    block = base._block
    return pytree.tree_map_only(torch.Tensor, lambda o: SimTensor(block, o.shape, o.stride(), o.storage_offset(),
                                                                  o.dtype), out)


def copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """dst.copy_(src) with a sim tensor on either side (see the module doc for the timing)."""
    rt = runtime()
    if src.shape != dst.shape and torch.broadcast_shapes(src.shape, dst.shape) != dst.shape:
        # checked before anything is queued, as torch checks before it launches a copy
        raise RuntimeError(f"The size of tensor a ({tuple(dst.shape)}) must match the size of tensor b "
                           f"({tuple(src.shape)}) for copy_")
    nbytes = dst.numel() * dst.element_size()
    if is_sim(dst) and is_sim(src):
        d, s = as_sim(dst), as_sim(src)
        if d.device != s.device:
            raise SimDeviceError(f"sim: copy from {s.device} to {d.device}: cross-device copies are not modelled "
                                 "(in hwsync one means a tensor landed on another device than intended)")
        rt.require_current(d.device.index, "a device-to-device copy")
        rt.count_copy(d.device.index, nbytes)
        rt.stream(d.device.index).enqueue(lambda: host_view(d).copy_(host_view(s)))
    elif is_sim(dst):
        d = as_sim(dst)
        rt.require_current(d.device.index, "a host-to-device copy")
        rt.count_copy(d.device.index, nbytes)
        if rt.is_pinned(src):  # pinned host memory: like CUDA, the source is read when the copy runs
            source = src.detach()
            rt.stream(d.device.index).enqueue(lambda: host_view(d).copy_(source))
        else:
            staged = src.detach().clone()  # pageable host memory: the source is read before copy_ returns
            rt.stream(d.device.index).enqueue(lambda: host_view(d).copy_(staged))
    else:
        s = as_sim(src)
        rt.require_current(s.device.index, "a device-to-host copy")
        rt.count_copy(s.device.index, nbytes)
        if non_blocking and rt.is_pinned(dst):  # into pinned memory, as on CUDA: queued, returns at once
            target = dst.detach()
            rt.stream(s.device.index).enqueue(lambda: target.copy_(host_view(s)))
        else:  # into pageable host memory the copy returns only once it (and all work before it) is done
            rt.stream(s.device.index).call(lambda: dst.copy_(host_view(s)))
    return dst


def foreach_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool = False) -> None:
    """torch._foreach_copy_(dsts, srcs): one launch queued when every tensor is on one sim device, else a copy each."""
    rt = runtime()
    if len(dsts) != len(srcs):
        raise RuntimeError(f"Tensor lists must have the same number of tensors, got {len(dsts)} and {len(srcs)}")
    places = {t.device for t in [*dsts, *srcs]}
    if len(places) != 1 or next(iter(places)).type != TYPE:
        for d, s in zip(dsts, srcs):  # CUDA's slow path: a copy_ per pair, each its own launch
            copy(d, s, non_blocking)
        return
    pairs = [(as_sim(d), as_sim(s)) for d, s in zip(dsts, srcs)]
    for d, s in pairs:
        if d.shape != s.shape:
            raise RuntimeError(f"_foreach_copy_: tensors of shapes {tuple(d.shape)} and {tuple(s.shape)} differ")
    index = pairs[0][0].device.index if pairs else rt.current()
    rt.require_current(index, "a foreach copy")
    rt.count_copy(index, sum(d.numel() * d.element_size() for d, _ in pairs))

    def run() -> None:
        for d, s in pairs:
            host_view(d).copy_(host_view(s))

    rt.stream(index).enqueue(run)


def _to_copy(x: torch.Tensor, dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
             pin_memory: Any = None, non_blocking: bool = False, memory_format: Any = None) -> torch.Tensor:
    s = as_sim(x)
    target = torch.device(device) if device is not None else s.device
    shaped = torch.empty_strided(s.shape, s.stride(), dtype=dtype or s.dtype, device="meta")
    shaped = torch.empty_like(shaped, memory_format=memory_format or torch.preserve_format)
    if target.type == "cpu":
        return copy(torch.empty_strided(shaped.shape, shaped.stride(), dtype=shaped.dtype), s)
    if target.type != TYPE:
        raise SimError(f"sim: copies between {TYPE} and {target.type} are not modelled")
    return copy(new_tensor(_index_of(target), shaped.shape, shaped.stride(), shaped.dtype), s)


def _kernel(func: Any, args: tuple, kwargs: dict) -> Any:
    """Any other operation: queued like a kernel, or run with the host waiting when it returns a value."""
    rt = runtime()
    flat, spec = pytree.tree_flatten((args, kwargs))
    original = list(flat)
    index = None
    for i, item in enumerate(flat):
        if is_sim(item):
            flat[i] = sim = as_sim(item)
            if index is not None and sim.device.index != index:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"{TYPE}:{index} and {sim.device}! ({func})")
            index = sim.device.index
        elif isinstance(item, torch.Tensor) and item.dim() > 0:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{TYPE} and {item.device}! ({func})")
        elif isinstance(item, torch.device) and item.type == TYPE:
            flat[i] = torch.device("cpu")  # e.g. empty_like(x, device=...): computed on the host views
    if index is None:
        raise SimError(f"sim: {func} has no sim tensor to run on")
    rt.require_current(index, str(func))
    sims = [(i, item) for i, item in enumerate(flat) if isinstance(item, SimTensor)]

    def on_host() -> Any:
        hosts = list(flat)
        for i, sim in sims:
            hosts[i] = host_view(sim)
        host_args, host_kwargs = pytree.tree_unflatten(hosts, spec)
        return func(*host_args, **host_kwargs), hosts

    shapes = _output_shapes(func, flat, spec, sims)
    if shapes is None:  # a value for the host (item, equal), or no meta kernel: the host waits
        out, hosts = rt.stream(index).call(on_host)
        return _wrap_computed(rt, index, out, hosts, sims, original)
    outputs = [original[o] if isinstance(o, int) else new_tensor(index, o.shape, o.stride(), o.dtype)
               for o in shapes[1]]

    def kernel() -> None:
        out, _ = on_host()
        for result, target in zip(pytree.tree_leaves(out), outputs):
            if isinstance(target, SimTensor) and result.untyped_storage().data_ptr() != \
                    target._block.mem.data.untyped_storage().data_ptr():
                host_view(target).copy_(result)  # a fresh result lands in the memory handed out already

    rt.stream(index).enqueue(kernel)
    return pytree.tree_unflatten(outputs, shapes[0])


def _output_shapes(func: Any, flat: list, spec: Any, sims: list) -> tuple[Any, list] | None:
    """What the kernel returns, worked out on meta tensors: (tree spec, [input position or meta tensor])."""
    if not func._schema.returns or any(str(r.type) != "Tensor" for r in func._schema.returns):
        return None
    metas = list(flat)
    position = {}
    for i, sim in sims:
        metas[i] = torch.empty_strided(sim.shape, sim.stride(), dtype=sim.dtype, device="meta")
        position[id(metas[i])] = i
    try:
        meta_args, meta_kwargs = pytree.tree_unflatten(metas, spec)
        out = func(*meta_args, **meta_kwargs)
    except Exception:  # noqa: BLE001 - no meta kernel, or a data-dependent shape: run it for real
        return None
    leaves, out_spec = pytree.tree_flatten(out)
    return out_spec, [position.get(id(o), o) for o in leaves]


def _wrap_computed(rt: Any, index: int, out: Any, hosts: list, sims: list, original: list) -> Any:
    by_id = {id(hosts[i]): original[i] for i, _ in sims}
    storages = {sim._block.mem.data.untyped_storage().data_ptr(): sim._block for _, sim in sims}

    def wrap(o: torch.Tensor) -> torch.Tensor:
        if id(o) in by_id:  # an in-place or out= operation returns the caller's own tensor
            return by_id[id(o)]
        block = storages.get(o.untyped_storage().data_ptr())
        if block is None:  # a new result: it becomes device memory
            block = rt.adopt(index, torch.empty(0, dtype=torch.uint8).set_(o.untyped_storage()))
        return SimTensor(block, o.shape, o.stride(), o.storage_offset(), o.dtype)

    return pytree.tree_map_only(torch.Tensor, wrap, out)


# -- teaching torch the device ---------------------------------------------------------------------

class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):  # noqa: D102 - torch's protocol
        return torch._C._autograd.DeviceType.PrivateUse1


def _torch_module() -> types.ModuleType:
    """torch.sim: what torch itself asks a device module (the current device, the count)."""
    module = types.ModuleType(f"torch.{TYPE}")
    module.is_available = lambda: True
    module.is_initialized = lambda: True
    module._is_in_bad_fork = lambda: False
    module.manual_seed_all = lambda seed: None
    module.current_device = lambda: runtime().current()
    module.device_count = lambda: runtime().count()
    module.set_device = lambda index: runtime().set_current(torch.device(TYPE, index).index
                                                             if isinstance(index, str) else int(index))
    module.synchronize = lambda device=None: runtime().synchronize(_index_of(device))
    return module


def _empty(size: Any, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None,
           memory_format: Any = None) -> SimTensor:
    dtype = dtype or torch.get_default_dtype()
    shaped = torch.empty(size, dtype=dtype, device="meta", memory_format=memory_format or torch.contiguous_format)
    return new_tensor(_index_of(device), shaped.shape, shaped.stride(), dtype)


def _empty_strided(size: Any, stride: Any, dtype: Any = None, layout: Any = None, device: Any = None,
                   pin_memory: Any = None) -> SimTensor:
    return new_tensor(_index_of(device), size, stride, dtype or torch.get_default_dtype())


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    return copy(dst, src, non_blocking)


_libraries: list = []


def install_torch_device() -> None:
    """Claim torch's PrivateUse1 slot as "sim" and route its operations here (once per process)."""
    if _libraries:
        return
    try:
        torch.utils.rename_privateuse1_backend(TYPE)
    except RuntimeError as exc:
        raise SimError(f"the sim needs torch's PrivateUse1 device slot, which is already taken ({exc}); "
                       "do not load torch_npu or another PrivateUse1 plugin in the same process") from exc
    torch._C._acc.register_python_privateuseone_device_guard(_Guard())
    torch._register_device_module(TYPE, _torch_module())
    torch.utils.generate_methods_for_privateuse1_backend()
    kernels = torch.library.Library("aten", "IMPL")
    kernels.impl("empty.memory_format", _empty, "PrivateUse1")
    kernels.impl("empty_strided", _empty_strided, "PrivateUse1")
    kernels.impl("_copy_from", _copy_from, "PrivateUse1")
    kernels.impl("_has_compatible_shallow_copy_type", lambda tensor, new: True, "PrivateUse1")
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(lambda op, *args, **kwargs: dispatch(op, args, kwargs), "PrivateUse1")
    _libraries.extend([kernels, fallback])
