"""hwsync as a verl checkpoint engine, registered as "hwsync" with verl's CheckpointEngineRegistry.

    actor_rollout_ref.rollout.checkpoint_engine:
      backend: hwsync
      custom_backend_module: hwsync.integrations.verl
      engine_kwargs: {hwsync: {timeout_s: 120}}

verl imports this package on its driver and on every worker (custom_backend_module), which
registers HwsyncCheckpointEngine. Files: engine.py (the CheckpointEngine), topology.py
(prepare metadata and build_topology), trainer.py (walking verl's generator, sending, the
metrics), rollout.py (receiving on a thread for verl's async generator), cpu_platform.py
(verl's platform registry on a CPU-only host). See docs/verl.md. Importing hwsync never
imports this package.
"""

from __future__ import annotations

try:
    import verl.checkpoint_engine.base  # noqa: F401 - verl's engine interface and registry
except ImportError as exc:  # verl itself, or one of the modules verl imports without declaring them
    raise ImportError(
        f"hwsync.integrations.verl needs the verl package, which failed to import ({exc}). Install it with "
        "pip install 'hwsync[verl]' (verl 0.9.x with the fastapi and uvicorn its checkpoint engines import), or "
        "drop checkpoint_engine.custom_backend_module=hwsync.integrations.verl from the verl config"
    ) from exc

from hwsync.integrations.verl.engine import BACKEND, HwsyncCheckpointEngine

__all__ = ["BACKEND", "HwsyncCheckpointEngine"]
