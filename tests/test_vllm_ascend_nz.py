"""The worker extension's FRACTAL_NZ guard on vllm-ascend (hwsync.integrations.vllm.ascend), without an NPU.

vllm-ascend refuses weight updates while its NZ weight layout may be in use; its own door checks that,
`worker_extension_cls` bypasses the door, so hwsync's extension checks it: it defaults
VLLM_ASCEND_ENABLE_NZ to 0 before the worker reads its config, and refuses a sync, through the protocol
(the sender hears the reason at once), when weight_nz_mode is on. What vllm-ascend itself is, is a
stand-in here: its platform (`on_ascend`) and its config module (`get_ascend_config`, `is_310p`); the
names are checked against the real wheel by tests/test_vllm_ascend_wheel.py. The sender is hwsync's
real WeightSender on a thread of this process.
"""

from __future__ import annotations

import os
import sys
import threading
import types
from typing import Any

import pytest
import torch

from hwsync.colocated import WeightSender
from hwsync.errors import HwsyncError
from hwsync.integrations.vllm import ascend
from hwsync.integrations.vllm.worker import HwsyncWorkerExtension
from hwsync.sync.spec import manifest_from_tensors
from hwsync.sync.options import SenderOptions


@pytest.fixture
def npu_platform(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """vLLM's platform is vllm-ascend's NPU one, whose config says what `config` holds."""
    config: dict[str, Any] = {"weight_nz_mode": 0, "is_310p": False}
    monkeypatch.setattr(ascend, "on_ascend", lambda: True)
    package = types.ModuleType("vllm_ascend")
    settings = types.ModuleType("vllm_ascend.ascend_config")
    settings.get_ascend_config = lambda: types.SimpleNamespace(weight_nz_mode=config["weight_nz_mode"])  # type: ignore[attr-defined]
    utils = types.ModuleType("vllm_ascend.utils")
    utils.is_310p = lambda: config["is_310p"]  # type: ignore[attr-defined]
    for name, module in (("vllm_ascend", package), ("vllm_ascend.ascend_config", settings),
                         ("vllm_ascend.utils", utils)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv(ascend.NZ_ENV, raising=False)
    return config


def test_off_ascend_nothing_is_set_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ascend, "on_ascend", lambda: False)
    env: dict[str, str] = {}
    assert ascend.default_nz_off(env) is None and env == {}
    assert ascend.nz_refusal() is None


def test_on_ascend_nz_defaults_to_off_and_a_users_value_stays(npu_platform: dict[str, Any]) -> None:
    env: dict[str, str] = {}
    assert "VLLM_ASCEND_ENABLE_NZ=0" in (ascend.default_nz_off(env) or "") and env == {ascend.NZ_ENV: "0"}
    env = {ascend.NZ_ENV: "1"}
    assert ascend.default_nz_off(env) is None and env == {ascend.NZ_ENV: "1"}


@pytest.mark.parametrize("mode", [1, 2])
def test_a_mode_that_may_change_layouts_is_refused_with_vllm_ascends_reason(npu_platform: dict[str, Any],
                                                                            mode: int) -> None:
    assert ascend.nz_refusal() is None
    npu_platform["weight_nz_mode"] = mode
    reason = ascend.nz_refusal()
    assert reason is not None and ascend.NZ_REASON in reason and f"weight_nz_mode={mode}" in reason
    assert f"{ascend.NZ_ENV}=0" in reason


def test_the_310p_always_converts_and_is_refused(npu_platform: dict[str, Any]) -> None:
    npu_platform["is_310p"] = True
    assert "310P" in (ascend.nz_refusal() or "")


class _WorkerBase:
    """Stands in for a vLLM worker class: records the NZ variable its __init__ sees (NPUWorker reads config there)."""

    def __init__(self, **kwargs: Any) -> None:
        self.nz_at_init = os.environ.get(ascend.NZ_ENV)


def test_the_extension_turns_nz_off_before_the_workers_init(npu_platform: dict[str, Any]) -> None:
    # what vLLM's WorkerWrapperBase.init_worker does with worker_extension_cls: the extension joins the worker's bases
    worker_class = type("NPUWorkerStandIn", (_WorkerBase,), {})
    worker_class.__bases__ = worker_class.__bases__ + (HwsyncWorkerExtension,)
    worker = worker_class(vllm_config=None, local_rank=0)
    assert worker.nz_at_init == "0" and os.environ[ascend.NZ_ENV] == "0"
    assert isinstance(worker, HwsyncWorkerExtension)


def test_a_refused_sync_tells_the_sender_at_once_and_touches_nothing(npu_platform: dict[str, Any]) -> None:
    npu_platform["weight_nz_mode"] = 2
    worker = HwsyncWorkerExtension()  # no model runner at all: a refusal must not reach the model
    tensors = [("w", torch.arange(8, dtype=torch.float32))]
    outcome: dict[str, BaseException] = {}

    def rpc(endpoint: str) -> None:
        try:
            worker.hwsync_receive(endpoint, 10.0)
        except BaseException as exc:  # noqa: BLE001 - kept for the assertion
            outcome["rpc"] = exc

    with WeightSender(options=SenderOptions(timeout_s=10.0)) as sender:
        thread = threading.Thread(target=rpc, args=(sender.endpoint,))
        thread.start()
        with pytest.raises(Exception, match="FRACTAL_NZ") as sent:
            sender.send(tensors, version=1, manifest=manifest_from_tensors(tensors))
        thread.join(10)
    assert "timed out" not in str(sent.value)
    assert isinstance(outcome.get("rpc"), HwsyncError) and ascend.NZ_REASON in str(outcome["rpc"])
    worker.hwsync_close()
