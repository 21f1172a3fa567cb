"""hwsync in verl's colocated (hybrid) mode: the module a verl config names in `external_lib`.

    actor_rollout_ref:
      model:
        external_lib: hwsync.integrations.verl.colocated
      rollout:
        engine_kwargs:
          vllm:
            weight_transfer_config: {backend: hwsync}
            worker_extension_cls: hwsync.integrations.verl.worker_extension.HwsyncColocateWorkerExtension

verl imports `external_lib` in every worker when it builds the model config, before the trainer
worker looks its rollout class up. Importing this module checks that the installed verl has the
private names hwsync replaces (verl_names.py; a mismatch raises and nothing is replaced), then
points verl's rollout registry entry ("vllm", "async") at `HwsyncServerAdapter` (server_adapter.py).
The adapter checks the two engine keys itself; the worker extension fails a step loudly if verl's
own sender ever reaches an engine started for hwsync. See docs/verl.md.
"""

from __future__ import annotations

from hwsync.integrations.verl.verl_names import VerlMismatchError, check_verl

VERL_VERSION = check_verl()  # before anything of verl is touched: a mismatch leaves verl as it was

from verl.workers.rollout import base as _rollout_base  # noqa: E402 - after the check

from hwsync.integrations.verl.server_adapter import HwsyncServerAdapter  # noqa: E402
from hwsync.integrations.verl.worker_extension import EXTENSION_CLS, HwsyncColocateWorkerExtension  # noqa: E402

#: the registry key of verl's vLLM rollout and what verl 0.9 registers there
ROLLOUT_KEY = ("vllm", "async")
VERL_ADAPTER = "verl.workers.rollout.vllm_rollout.ServerAdapter"
#: what hwsync registers instead
HWSYNC_ADAPTER = f"{HwsyncServerAdapter.__module__}.{HwsyncServerAdapter.__qualname__}"


def install() -> None:
    """Point verl's ("vllm", "async") rollout at hwsync's adapter; refuse to replace another plugin's class."""
    registry = _rollout_base._ROLLOUT_REGISTRY
    current = registry.get(ROLLOUT_KEY)
    if current not in (VERL_ADAPTER, HWSYNC_ADAPTER):
        raise VerlMismatchError(f"verl's vLLM rollout class is {current!r}, not verl's own {VERL_ADAPTER!r}: another "
                                "plugin replaced it. hwsync's colocated adapter replaces verl's only; drop one of them")
    registry[ROLLOUT_KEY] = HWSYNC_ADAPTER


install()

__all__ = ["EXTENSION_CLS", "HWSYNC_ADAPTER", "HwsyncColocateWorkerExtension", "HwsyncServerAdapter", "VERL_VERSION",
           "install"]
