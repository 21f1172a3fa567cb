"""What the worker extension does around loading.py's reload on an NPU worker, checked without one.

- the fingerprint a worker takes of its weights never casts on the device (float64 on Ascend's AI Core is
  not to be relied on): a CPU tensor subclass stands for an NPU tensor that refuses float64;
- the reload runs under the model's device, as vllm-ascend's NPUWorker runs its own (`with torch.device`);
- the device is synchronized once after the reload is finalized, on success and failure, through the
  backend's Device (here a recording one; the order with the receive is what is checked).
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from hwsync.integrations.vllm.worker import DeviceTarget, HwsyncWorkerExtension, model_device


class NpuLike(torch.Tensor):
    """A CPU tensor standing for an NPU one: casting it to float64 raises; `.cpu()` gives a plain host tensor."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cpu:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).as_subclass(torch.Tensor)
        if func in (torch.Tensor.to, torch.Tensor.double, torch.Tensor.type) and torch.float64 in (
                *args[1:], *kwargs.values()):
            raise RuntimeError("float64 computed on the NPU stand-in")
        return super().__torch_function__(func, types, args, kwargs)


def _npu_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4, bias=False))
    for module in model:
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(param.detach().to(torch.bfloat16).as_subclass(NpuLike)))
    return model


def test_the_fingerprint_reads_device_weights_as_bytes_without_casting_them_there():
    pytest.importorskip("vllm", reason="the fingerprint probes vLLM's linear layers")
    from hwsync.integrations.vllm.fingerprint import Fingerprint

    model = _npu_model(0)
    before = Fingerprint.take(model)  # raised "float64 computed on the NPU stand-in" when samples were cast there
    assert set(before.entries) == {"0.weight", "0.bias", "1.weight"}
    assert before.changed(Fingerprint.take(_npu_model(0))) == []
    with torch.no_grad():
        model[1].weight.view(-1)[0] += 1  # the first sampled element of one tensor
    assert before.changed(Fingerprint.take(model)) == ["1.weight"]


def test_the_reload_runs_under_the_models_device():
    model = torch.nn.Linear(2, 2)
    assert model_device(model) == torch.device("cpu")
    assert model_device(torch.nn.Linear(2, 2, device="meta")) is None
    target = DeviceTarget(model, types.SimpleNamespace(model="m"), None, torch.device("meta"))
    with target.context():  # loaders and the reload allocate with plain torch.empty: they must land on the device
        assert torch.empty(3).is_meta
    assert not torch.empty(3).is_meta


class _RecordingWorkerSync:
    """Stands in for loading.py's WorkerSync: its receive (which finalizes the reload) and its backend's Device."""

    def __init__(self, events: list[str], fail: bool) -> None:
        self.events, self.fail = events, fail
        device = types.SimpleNamespace(synchronize=lambda: events.append("synchronize"))
        self.receiver = types.SimpleNamespace(backend=types.SimpleNamespace(device=lambda: device))

    def receive(self, endpoint: str, target: Any, **kwargs: Any) -> dict[str, Any]:
        assert isinstance(target, DeviceTarget) and target.device == torch.device("cpu")
        self.events.append("receive+finalize")
        if self.fail:
            raise RuntimeError("the sender died")
        return {"version": 1}


@pytest.mark.parametrize("fail", [False, True])
def test_the_device_is_synchronized_once_after_the_finalize(fail: bool, monkeypatch: pytest.MonkeyPatch):
    from hwsync.integrations.vllm import ascend

    monkeypatch.setattr(ascend, "on_ascend", lambda: False)  # not vllm-ascend's platform (and vLLM not imported)
    events: list[str] = []
    worker = HwsyncWorkerExtension()
    worker._hwsync = _RecordingWorkerSync(events, fail)  # type: ignore[assignment]
    worker.model_runner = types.SimpleNamespace(model=torch.nn.Linear(2, 2),  # type: ignore[attr-defined]
                                                model_config=types.SimpleNamespace(model="m"))
    if fail:
        with pytest.raises(RuntimeError, match="the sender died"):
            worker.hwsync_receive("ipc:///nowhere")
    else:
        assert worker.hwsync_receive("ipc:///nowhere") == {"version": 1}
    assert events == ["receive+finalize", "synchronize"]
