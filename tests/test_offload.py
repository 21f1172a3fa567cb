"""onload/offload: nothing moves (and nothing is timed) when nothing is offloaded; real moves restore."""

from __future__ import annotations

import types

import pytest
import torch

import hwsync.sync.offload as offload_mod
from hwsync.errors import HwsyncError
from hwsync.backend.interfaces import Device, ProbeResult
from hwsync.sync.offload import onload
from hwsync.backend.registry import backend_statuses, load_backend, reset_backend_cache


class StubDevice(Device):
    """A Device over torch's "meta" type: tensors really change device, no hardware needed.

    Only the mechanics are exercised with it (which tensors move, bytes, restore, timings,
    synchronisation calls); the test on a real accelerator below checks values.
    """

    name = "meta-stub"
    torch_type = "meta"

    def __init__(self, fail_sync_at: int | None = None) -> None:
        self.syncs = 0
        self.fail_sync_at = fail_sync_at

    def probe(self) -> ProbeResult:
        return ProbeResult(True, "stub")

    def count(self) -> int:
        return 1

    def current_index(self) -> int:
        return 0

    def set_index(self, index: int) -> None:
        pass

    def synchronize(self) -> None:
        self.syncs += 1
        if self.syncs == self.fail_sync_at:
            raise RuntimeError("device fault during synchronize")

    def mem_get_info(self, index=None):
        return 0, 0

    def memory_allocated(self, index=None) -> int:
        return 0

    def memory_reserved(self, index=None) -> int:
        return 0

    def empty_cache(self) -> None:
        pass

    def physical_id(self, index=None) -> str:
        return "meta:0"

    def torch_device(self, index=None) -> torch.device:
        return torch.device("meta")


@pytest.fixture
def meta_like_npu():
    """Let cpu tensors point at meta memory, the way torch_npu registers npu as cpu-compatible.

    torch core answers `_has_compatible_shallow_copy_type` with True for cpu/cuda pairs only;
    torch_npu overrides it for PrivateUse1. Doing the same for meta (for this test only) makes
    `param.data = meta_tensor` behave as it does on an accelerator.
    """
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_has_compatible_shallow_copy_type", lambda a, b: True, "AutogradMeta")
    yield
    lib._destroy()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def _ptrs(module: torch.nn.Module) -> list[int]:
    return [p.data_ptr() for p in module.parameters()]


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.fixture
def cpu_device(monkeypatch) -> Device:
    monkeypatch.setenv("HWSYNC_BACKEND", "cpu")
    reset_backend_cache()
    yield load_backend("cpu").device()
    reset_backend_cache()


def test_nothing_offloaded_moves_nothing_and_times_nothing(cpu_device, monkeypatch):
    model = _model()
    before = _ptrs(model)
    values = [p.detach().clone() for p in model.parameters()]

    def no_timer():
        raise AssertionError("a timer was started although nothing had to move")

    # Replace the module's view of `time` only: pytest's own timers stay untouched.
    monkeypatch.setattr(offload_mod, "time", types.SimpleNamespace(perf_counter=no_timer))
    with onload(model, "cpu") as stats:
        assert _ptrs(model) == before
    assert stats.onload_s == 0.0 and stats.offload_s == 0.0
    assert stats.tensors_moved == 0 and stats.bytes_onloaded == 0 and stats.bytes_offloaded == 0
    assert _ptrs(model) == before
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), values))


def test_default_device_comes_from_the_selected_backend(cpu_device):
    model = _model()
    before = _ptrs(model)
    with onload(model) as stats:  # no device, no Device: the cpu backend's host
        pass
    assert stats.device == "cpu" and stats.onload_s == 0.0 and stats.offload_s == 0.0
    assert _ptrs(model) == before


def test_offloaded_parameters_move_and_come_back_to_the_same_storage(meta_like_npu):
    model, api = _model(), StubDevice()
    before = _ptrs(model)
    with onload(model, "meta", backend_device=api) as stats:
        assert all(p.device.type == "meta" for p in model.parameters())
        assert api.syncs == 1, "onload must synchronise through the backend's Device"
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert _ptrs(model) == before
    assert api.syncs == 2
    assert stats.tensors_moved == len(before)
    assert stats.bytes_onloaded == _param_bytes(model)
    assert stats.bytes_offloaded == 0  # no writeback: the host copy was never stale
    assert stats.onload_s > 0.0 and stats.offload_s > 0.0


def test_parameters_already_on_the_device_are_left_alone(meta_like_npu):
    on_host = torch.nn.Parameter(torch.ones(4))
    on_device = torch.nn.Parameter(torch.ones(4, device="meta"))
    device_data = on_device.data
    with onload([on_host, on_device], "meta", backend_device=StubDevice()) as stats:
        assert on_host.device.type == "meta"
    assert stats.tensors_moved == 1 and stats.bytes_onloaded == 16
    assert on_device.data.device.type == "meta" and on_device.data.shape == device_data.shape


def test_aliased_tensors_are_copied_once(meta_like_npu):
    weight = torch.randn(32)
    tied = weight.view(32)  # another tensor object over the same memory (tied embeddings)
    with onload([weight, tied], "meta", backend_device=StubDevice()) as stats:
        assert weight.device.type == tied.device.type == "meta"
    assert stats.tensors_moved == 2 and stats.bytes_onloaded == 32 * 4
    assert weight.data_ptr() == tied.data_ptr()


def test_restored_when_the_block_raises(meta_like_npu):
    model = _model()
    before = _ptrs(model)
    with pytest.raises(ValueError, match="sync failed"):
        with onload(model, "meta", backend_device=StubDevice()):
            raise ValueError("sync failed")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert _ptrs(model) == before


def test_restored_when_onloading_itself_fails(meta_like_npu):
    model = _model()
    before = _ptrs(model)
    with pytest.raises(RuntimeError, match="device fault"):
        with onload(model, "meta", backend_device=StubDevice(fail_sync_at=1)):
            pytest.fail("the block must not run when onloading failed")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert _ptrs(model) == before


def test_a_device_the_backend_cannot_synchronise_is_refused(cpu_device):
    with pytest.raises(HwsyncError, match="HWSYNC_BACKEND"):
        with onload(_model(), "meta", backend_device=cpu_device):
            pass


def test_a_device_torch_cannot_repoint_to_is_a_clear_error():
    model = _model()
    before = _ptrs(model)
    with pytest.raises(HwsyncError, match="module.to"):
        with onload(model, "meta", backend_device=StubDevice()):
            pytest.fail("the block must not run when onloading failed")
    assert _ptrs(model) == before and all(p.device.type == "cpu" for p in model.parameters())


def _accelerator():
    """A usable non-cpu backend, or the registry's reasons why there is none."""
    statuses = [s for s in backend_statuses() if s.name != "cpu"]
    usable = [s for s in statuses if s.usable]
    if usable:
        return load_backend(usable[0].name), ""
    if not statuses:
        return None, "no accelerator backend is installed (only cpu); install hwsync-cuda or hwsync-npu"
    return None, "no accelerator backend is usable: " + "; ".join(f"{s.name}: {s.reason}" for s in statuses)


def test_real_offloaded_case_on_an_accelerator():
    backend, why = _accelerator()
    if backend is None:
        pytest.skip(why)
    api = backend.device()
    target = api.torch_device()
    model = _model()
    before = _ptrs(model)
    values = [p.detach().clone() for p in model.parameters()]
    with onload(model, target, backend_device=api) as stats:
        assert all(p.device == target for p in model.parameters())
        assert all(torch.equal(p.cpu(), v) for p, v in zip(model.parameters(), values))
    assert stats.onload_s > 0.0 and stats.offload_s > 0.0
    assert stats.bytes_onloaded == _param_bytes(model)
    assert _ptrs(model) == before and all(p.device.type == "cpu" for p in model.parameters())

    # Writeback: changes made on the device reach the original host storage.
    with onload(model, target, backend_device=api, writeback=True) as stats:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    assert stats.bytes_offloaded == _param_bytes(model)
    assert _ptrs(model) == before
    assert all(torch.equal(p, v + 1.0) for p, v in zip(model.parameters(), values))
