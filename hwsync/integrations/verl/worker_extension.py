"""The vLLM worker extension of hwsync's colocated mode: verl's own, with its receiver guarded.

verl starts vLLM with its `vLLMColocateWorkerExtension` (verl's server calls its methods, e.g.
`monkey_patch_model`), so hwsync's colocated mode keeps it and adds one thing: an engine started
for hwsync (`weight_transfer_config: {backend: hwsync}`) that is reached by verl's own sender
(`update_weights_from_ipc`) means the trainer never got hwsync's adapter (its external_lib was
not imported before verl looked the rollout class up). That must not pass unnoticed: the update
is drained without loading anything (verl's sender waits without a timeout: it must not be left
hanging) and then the call raises, which verl's adapter awaits: the step fails with the fix.

    actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls:
        hwsync.integrations.verl.worker_extension.HwsyncColocateWorkerExtension
"""

from __future__ import annotations

from typing import Any

import torch
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from hwsync.errors import HwsyncError

#: the value for actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls
EXTENSION_CLS = "hwsync.integrations.verl.worker_extension.HwsyncColocateWorkerExtension"


class VerlSenderReachedEngineError(HwsyncError, RuntimeError):
    """verl's own colocated sender reached an engine configured for hwsync: the trainer lacks hwsync's adapter."""


class HwsyncColocateWorkerExtension(vLLMColocateWorkerExtension):
    """verl's colocated worker extension; its own receiver drains verl's update unloaded, then fails the step."""

    def update_weights_from_ipc(self, peft_config: Any = None, base_sync_done: bool = False,
                                use_shm: bool = False) -> None:
        """Take verl's buckets without loading them (its sender must not hang), then raise: hwsync was not used."""
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        device = self.device if self.device is not None else torch.device("cpu")  # nothing is loaded anywhere
        BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=device, use_shm=use_shm).receive_weights(
            on_bucket_received=lambda weights, is_last: None)
        raise VerlSenderReachedEngineError(
            "verl's own colocated sender (BucketedWeightSender) reached this vLLM engine, which was started for "
            "hwsync (weight_transfer_config.backend=hwsync), and was refused (no weight changed): the trainer "
            "worker runs verl's ServerAdapter, not hwsync's. Set actor_rollout_ref.model.external_lib="
            "hwsync.integrations.verl.colocated (verl imports it in the trainer workers before it looks up the "
            "rollout class), or drop the hwsync engine_kwargs to use verl's own sender on purpose")
