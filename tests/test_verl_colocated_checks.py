"""hwsync's colocated verl adapter refuses loudly, without an engine: verl's private names, a partial config.

The end-to-end run is test_verl_colocated.py; these check the refusals it cannot reach (a verl
whose names moved, a config missing a key, settings) in a second. They need verl: ci/test.sh runs
them in .venv-verl.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="verl is not installed in this environment: ci/test.sh runs these tests in "
                                   ".venv-verl, which ci/setup-verl.sh makes")

from hwsync.integrations.verl import verl_names
from hwsync.integrations.verl.colocated_parts import (
    ColocatedOptions,
    FullWeights,
    base_names,
    check_engine_config,
)
from hwsync.integrations.verl.verl_names import NEEDS, VerlMismatchError, check_verl, problem
from hwsync.integrations.verl.worker_extension import EXTENSION_CLS


def test_the_installed_verl_has_every_name_the_adapter_replaces():
    assert check_verl() == "0.9.1"


@pytest.mark.parametrize("need, change, expected", [
    ("ServerAdapter._ensure_server_handle", dict(what="ServerAdapter._ensure_server_handle_v2"),
     "ServerAdapter._ensure_server_handle_v2 is missing"),
    ("ActorRolloutRefWorker.update_weights", dict(params=("peft_config", "adapter_config")),
     "calls self.rollout.update_weights without ['adapter_config']"),
    ("ServerAdapter._ensure_server_handle", dict(module="verl.workers.rollout.vllm_rollout.gone"),
     "module verl.workers.rollout.vllm_rollout.gone is missing"),
])
def test_a_moved_name_is_named_with_what_moved(need, change, expected):
    original = next(n for n in NEEDS if n.what == need)
    assert expected in problem(dataclasses.replace(original, **change), {})


def test_a_mismatch_refuses_before_verls_registry_is_touched(monkeypatch):
    moved = dataclasses.replace(NEEDS[0], what="_ROLLOUT_REGISTRY_V2")
    monkeypatch.setattr(verl_names, "NEEDS", (moved, *NEEDS[1:]))
    with pytest.raises(VerlMismatchError, match=r"verl 0\.9\.1 does not have .*_ROLLOUT_REGISTRY_V2 is missing.*"
                                                r"Nothing was replaced"):
        check_verl()


def test_an_untested_verl_refuses_unless_told(monkeypatch):
    monkeypatch.setattr(verl_names, "verl_version", lambda: "0.11.0")
    monkeypatch.delenv(verl_names.UNTESTED_ENV, raising=False)
    with pytest.raises(VerlMismatchError, match=r"verl 0\.11\.0 is outside the range .* HWSYNC_VERL_UNTESTED=1"):
        check_verl()
    monkeypatch.setenv(verl_names.UNTESTED_ENV, "1")
    assert check_verl() == "0.11.0"


def test_importing_the_external_lib_replaces_verls_vllm_rollout_class():
    code = ("import hwsync.integrations.verl.colocated\n"
            "from verl.workers.rollout.base import get_rollout_class\n"
            "print(get_rollout_class('vllm', 'async').__qualname__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("HwsyncServerAdapter"), done.stderr[-2000:]


def _rollout(vllm: dict, backend: str = "naive", hwsync: dict | None = None, bucket_mb: int = 2048) -> SimpleNamespace:
    engine = {"hwsync": hwsync} if hwsync is not None else {}
    return SimpleNamespace(engine_kwargs={"vllm": vllm}, checkpoint_engine=SimpleNamespace(
        backend=backend, engine_kwargs=engine, update_weights_bucket_megabytes=bucket_mb))


def test_a_partial_config_names_every_missing_key():
    with pytest.raises(ValueError) as info:
        check_engine_config(_rollout({}, backend="nccl"))
    for key in ("weight_transfer_config.backend=hwsync", f"worker_extension_cls={EXTENSION_CLS}",
                "checkpoint_engine.backend=naive"):
        assert key in str(info.value)
    # vLLM's CLI form of the transfer config (JSON) counts too
    check_engine_config(_rollout({"weight_transfer_config": '{"backend": "hwsync"}',
                                  "worker_extension_cls": EXTENSION_CLS}))


def test_options_keep_hwsyncs_buffers_within_verls_bucket_setting():
    assert ColocatedOptions.of(_rollout({})).bucket_bytes == 64 << 20  # verl's default 2048 MB: capped
    assert ColocatedOptions.of(_rollout({}, bucket_mb=1)).bucket_bytes == 512 << 10  # 2 buffers within 1 MB
    assert ColocatedOptions.of(_rollout({}, hwsync={"bucket_megabytes": 8, "num_buffers": 3})).bucket_bytes == 8 << 20
    with pytest.raises(ValueError, match=r"unknown keys \['max_senders'\]"):
        ColocatedOptions.of(_rollout({}, hwsync={"max_senders": 2}))


def test_the_first_update_learns_the_manifest_later_ones_stream():
    import torch

    full = FullWeights()
    weights = [("a", torch.ones(3)), ("b", torch.zeros(2, 2))]
    source, manifest = full.source(iter(weights))
    assert [n for n, _ in source] == ["a", "b"] and [s.shape for s in manifest] == [(3,), (2, 2)]
    assert full.manifest is None  # only a complete update teaches it
    full.learned(manifest)
    generator = iter(weights)
    assert full.source(generator) == (generator, manifest)
    full.forget()
    assert full.manifest is None


def test_verls_lora_base_goes_under_the_checkpoints_names():
    assert [n for n, _ in base_names([("model.layers.0.self_attn.q_proj.base_layer.weight", None),
                                      ("model.norm.weight", None)])] == [
        "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
