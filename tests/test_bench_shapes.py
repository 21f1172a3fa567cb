"""The state dicts `hwsync bench transfer` builds: the transformer, N equal tensors, and the mixture of experts."""

from __future__ import annotations

import math

import pytest

from hwsync_tools.bench.transfer import main, model_spec


def _bytes(spec) -> int:
    return sum(math.prod(shape) * 2 for _, shape, _ in spec)


@pytest.mark.parametrize("gb", [0.01, 0.5, 2.0])
def test_the_moe_keeps_every_layer_and_expert_and_comes_near_the_size_asked(gb):
    spec = model_spec(int(gb * 1e9), "bf16", moe=128)
    assert len(spec) == 48 * (9 + 3 * 128) + 3  # Qwen3-30B-A3B's count: thousands of tensors is the point
    assert len({name for name, _, _ in spec}) == len(spec)
    assert 0.75 * gb * 1e9 <= _bytes(spec) <= gb * 1e9


def test_the_moe_takes_its_expert_count():
    assert len(model_spec(int(0.05e9), "bf16", moe=8)) == 48 * (9 + 3 * 8) + 3


def test_moe_with_equal_tensors_is_refused_by_name():
    with pytest.raises(SystemExit, match="--moe"):
        main(["--moe", "--tensors", "10"])
