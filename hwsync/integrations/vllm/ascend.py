"""vllm-ascend's FRACTAL_NZ weight layout, as hwsync's worker extension must see it.

vllm-ascend may convert weights to FRACTAL_NZ, a device layout unlike the checkpoint's, when it
loads them (`vllm_ascend.utils.maybe_trans_nz`): under `weight_nz_mode` 2 every bf16/fp16 weight, under
1 (its default, from VLLM_ASCEND_ENABLE_NZ=1) quantized ones, and always on Atlas 300I (310P).
vllm-ascend itself refuses weight updates and wake-up while a mode is on (NPUWorker's
`_check_nz_disabled`, `wake_up`), for the reason quoted in `NZ_REASON`; its own weight-update door
checks that, but `worker_extension_cls` bypasses the door, so hwsync's extension checks it too:
- before the model loads (the extension's `__new__`, which runs before NPUWorker.__init__ reads its
  config), VLLM_ASCEND_ENABLE_NZ defaults to 0 in the worker's environment, as verl's extension
  sets it; a value the user set is left alone;
- before each sync, a worker whose weights may be in NZ refuses it with vllm-ascend's reason.
vllm_ascend is imported lazily, and only where vLLM's platform is the NPU: elsewhere nothing here runs.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

log = logging.getLogger("hwsync")

NZ_ENV = "VLLM_ASCEND_ENABLE_NZ"
#: vllm-ascend's own words when it refuses an update (0.26.0rc1 worker.py, `_check_nz_disabled` and `wake_up`)
NZ_REASON = "FRACTAL_NZ mode is enabled. This may cause model parameter precision issues in the RL scenarios."


def on_ascend() -> bool:
    """Whether this vLLM process runs on vllm-ascend's NPU platform."""
    try:
        from vllm.platforms import current_platform
    except Exception:  # noqa: BLE001 - no (working) vLLM here: not an NPU worker
        return False
    return getattr(current_platform, "device_type", None) == "npu"


def default_nz_off(environ: dict[str, str] | Any = None) -> str | None:
    """On Ascend, make VLLM_ASCEND_ENABLE_NZ default to 0 before the model loads; what was done, or None."""
    env = os.environ if environ is None else environ
    if not on_ascend():
        return None
    value = env.get(NZ_ENV)
    if value is None:
        env[NZ_ENV] = "0"
        note = (f"hwsync set {NZ_ENV}=0 for this worker: weights hwsync loads must keep the checkpoint's layout "
                "(vllm-ascend refuses weight updates while FRACTAL_NZ is on)")
        log.info("%s", note)
        return note
    if value.strip() not in ("", "0"):
        log.warning("hwsync: %s=%s: vllm-ascend may keep weights in FRACTAL_NZ, and hwsync will refuse every sync "
                    "into this engine; set %s=0", NZ_ENV, value, NZ_ENV)
    return None


def nz_mode() -> int:
    """vllm-ascend's weight_nz_mode for this worker: its config's (additional_config or the variable), else the
    variable as vllm-ascend reads it (default 1)."""
    try:
        config = importlib.import_module("vllm_ascend.ascend_config").get_ascend_config()
        return int(config.weight_nz_mode or 0)
    except Exception:  # noqa: BLE001 - a vllm-ascend without the config (or not set up): read the variable
        raw = os.environ.get(NZ_ENV, "1").strip() or "1"
        return int(raw) if raw.lstrip("-").isdigit() else 1


def always_nz_chip() -> bool:
    """Whether the chip is one vllm-ascend always converts weights to FRACTAL_NZ on (Atlas 300I, 310P)."""
    try:
        return bool(importlib.import_module("vllm_ascend.utils").is_310p())
    except Exception:  # noqa: BLE001 - no vllm-ascend utils: the chip cannot be named, as elsewhere
        return False


def nz_refusal() -> str | None:
    """Why this worker must refuse a sync because its weights may be in FRACTAL_NZ, or None (always None off Ascend)."""
    if not on_ascend():
        return None
    if always_nz_chip():
        return (f"vllm-ascend converts weights to FRACTAL_NZ on this chip (310P) whatever its settings: {NZ_REASON} "
                "hwsync cannot sync into this engine")
    mode = nz_mode()
    if mode:
        return (f"vllm-ascend refuses weight updates here (weight_nz_mode={mode}): {NZ_REASON} Start the engine with "
                f"{NZ_ENV}=0 (or --additional-config '{{\"weight_nz_mode\": 0}}'); hwsync's worker extension sets "
                f"{NZ_ENV}=0 itself unless it was set")
    return None
