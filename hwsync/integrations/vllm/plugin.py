"""hwsync's vLLM plugin: the `hwsync` backend in vLLM's weight-transfer registries.

Installed as the `vllm.general_plugins` entry point `hwsync` (root pyproject.toml), which vLLM
runs in every process it starts (the one building LLM / AsyncLLM / the server, the engine
core, each worker). A trainer process that never starts an engine never runs vLLM's plugins,
so importing hwsync.integrations.vllm.native (where the trainer's init info lives) registers
too. Registration is lazy (a module path: nothing of hwsync's vLLM side is imported until vLLM
builds an engine) and idempotent: vLLM raises on a duplicate name and may load plugins more
than once per process.
"""

from __future__ import annotations

import sys

#: the name `WeightTransferConfig(backend=...)` and the trainer's init info select hwsync by
BACKEND = "hwsync"

_ENGINES = (
    ("WeightTransferEngineFactory", "hwsync.integrations.vllm.engine", "HwsyncWeightTransferEngine"),
    ("WeightTransferTrainerFactory", "hwsync.integrations.vllm.native", "HwsyncTrainerEngine"),
)


def register() -> bool:
    """Register `hwsync` in vLLM's worker and trainer registries; False where this vLLM has no such API."""
    _llvmlite_answers_vllms_scan()
    try:
        from vllm.distributed.weight_transfer import factory
    except ImportError:  # a vLLM before the weight-transfer API: the worker extension still works
        return False
    for factory_name, module, class_name in _ENGINES:
        registry = getattr(factory, factory_name)
        try:
            registry.register_engine(BACKEND, module, class_name)
        except ValueError:  # already registered in this process (plugins may run more than once)
            pass
    return True


def _llvmlite_answers_vllms_scan() -> None:
    """Let a vLLM worker start in a process that loaded numba (hwsync's delta and copy kernels do).

    At a worker's start, right after the plugins, vLLM 0.32's CPU platform rebinds its kernels by reading
    `vars(value).get("kernel")` for every attribute of every loaded module that has a `__dict__`. llvmlite's
    `ffi.lib` (loaded with numba) answers any attribute with a function wrapper, `__dict__` included, so the read
    fails and the engine does not start (AttributeError: '_lib_fn_wrapper' object has no attribute 'get'): an
    engine started, or forked, from a trainer after its first delta sync. `lib` looks an attribute up in its table
    of wrappers first; an empty dict there answers `__dict__` as a plain object would, and nothing calls it.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})
