"""HwsyncServerAdapter: verl's vLLM ServerAdapter whose weight update goes through hwsync's same-host path.

verl's colocated (hybrid) update runs on every trainer worker (`ActorRolloutRefWorker.
update_weights`): resume the engine's weights, the rollout's `update_weights` (this class),
offload the trainer's model, resume the KV cache. Only the middle step changes. The replica's
first rank (the one with verl's server handle) owns a `WeightSender`, kept across updates, and
drives vLLM's own weight-transfer lifecycle on every engine worker through the server's
`collective_rpc`: `init_weight_transfer_engine` (once per sender: its endpoint),
`start_weight_update`, `update_weights` (every worker's hwsync backend receives one whole sync
while this rank sends it), `finish_weight_update`; then verl's own `clear_kv_cache` and
`set_global_steps`. The replica's other ranks walk verl's generator alongside (FSDP's
`full_tensor()` is a collective) and send nothing: every engine worker receives the full tensors
from the first rank and loads its own shard. What is sent is colocated_parts.py's: full weights
against a manifest learned once, or a planned LoRA update whose base goes only when the engine
reports it lacks it.

Limits (each refused at construction with the reason): one node per replica (the same-host
path), vLLM data parallel size 1 and no prefill/decode disaggregation (verl's `collective_rpc`
reaches the workers of one engine), named-tensor updates only (verl's `delta_sharded` engine
keeps its own path).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable
from typing import Any

import torch
from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_INT_ID, VLLM_LORA_NAME
from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

from hwsync.colocated import WeightSender
from hwsync.errors import ClosedError
from hwsync.integrations.verl.colocated_parts import (
    ColocatedOptions,
    FullWeights,
    base_names,
    check_engine_config,
    lora_trainer_model,
)
from hwsync.integrations.verl.trainer import Walk
from hwsync.integrations.vllm.sources import SyncParts, sync_parts
from hwsync.integrations.vllm.trainer import settle
from hwsync.sync.options import SenderOptions
from hwsync.sync.stats import SyncStats
from hwsync.timing import RPC_GRACE_S

log = logging.getLogger("hwsync")


class HwsyncServerAdapter(ServerAdapter):
    """verl's vLLM ServerAdapter with hwsync's sender: same construction, same memory steps around the update."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh, replica_rank)
        check_engine_config(self.config)
        self.options = ColocatedOptions.of(self.config)
        cfg = self.config
        #: engine workers of this replica's server: each receives every tensor and keeps its shard
        self.num_workers = int(cfg.tensor_model_parallel_size) * int(cfg.pipeline_model_parallel_size)
        local = int(os.environ.get("RAY_LOCAL_WORLD_SIZE", self.num_workers))
        disaggregation = getattr(cfg, "disaggregation", None)
        if int(cfg.data_parallel_size) != 1 or getattr(disaggregation, "enabled", False) or self.num_workers > local:
            raise ValueError(
                f"hwsync's colocated adapter serves replicas of one vLLM engine on one node: this config has "
                f"data_parallel_size={cfg.data_parallel_size}, prefill/decode disaggregation "
                f"{getattr(disaggregation, 'enabled', False)}, {self.num_workers} workers per replica on nodes of "
                f"{local}; use data_parallel_size=1 and tensor x pipeline parallel size within a node, or verl's own "
                "sender (drop external_lib=hwsync.integrations.verl.colocated and its engine_kwargs)")
        self._sender: WeightSender | None = None
        self._full = FullWeights()
        #: the LoRA base verl handed over this step (its base_sync_done=False call), sent with the adapter
        self._lora_base: list[tuple[str, torch.Tensor]] | None = None
        self._updates = 0
        #: the sender's stats of the last update (on the replica's first rank; None elsewhere)
        self.last_stats: SyncStats | None = None

    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None,
                             wire_format: str = "named_tensors", **kwargs: Any) -> None:
        """One update from verl's trainer worker: full weights, or LoRA (base part held, adapter part sent)."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"hwsync's colocated adapter sends named tensors; wire_format={wire_format!r} "
                                      "belongs to verl's own delta engine: drop the hwsync external_lib to use it")
        if hasattr(weights, "__aiter__") and not hasattr(weights, "__iter__"):
            raise TypeError("hwsync's colocated adapter takes verl's trainer-side generator; an async iterable comes "
                            "from a disaggregated checkpoint engine: use checkpoint_engine.backend=hwsync there")
        peft_config = kwargs.get("peft_config")
        walk = Walk(weights)
        if not self._has_server:  # another rank of the replica: its gathers pair with the first rank's
            walk.drain()
            return
        if peft_config is not None and not kwargs.get("base_sync_done", True):
            self._lora_base = base_names(walk)  # the planner decides with the adapter part, which comes next
            return
        self._updates += 1
        version = int(global_steps) if global_steps is not None else self._updates
        manifest = None
        if peft_config is not None:
            base, self._lora_base = self._lora_base, None
            source: Any = lora_trainer_model(list(walk), peft_config, base, self.model_config.local_path,
                                             name=VLLM_LORA_NAME, lora_id=int(VLLM_LORA_INT_ID))
        else:
            source, manifest = self._full.source(walk)
        try:
            self.last_stats = await self._sync(sync_parts(source, manifest), version, global_steps)
        except BaseException:
            self._full.forget()
            walk.drain()  # the other ranks' gathers must complete
            raise
        if manifest is not None:
            self._full.learned(manifest)
        log.info("hwsync: update %s into the vLLM engine of replica %d: %s", version, self.replica_rank,
                 self.last_stats)
        # what verl's own adapter does after an update: cached blocks were computed with the old weights
        await self.server_handle.clear_kv_cache.remote()
        if global_steps is not None:
            await self.server_handle.set_global_steps.remote(global_steps)

    async def _rpc(self, method: str, **kwargs: Any) -> Any:
        """Call `method` on every engine worker through verl's server (vLLM's collective_rpc); wait for it."""
        return await self.server_handle.collective_rpc.remote(method, timeout=None, args=(), kwargs=kwargs)

    async def _session(self) -> WeightSender:
        """The sender kept across updates; a new one tells every engine worker its endpoint."""
        if self._sender is not None:
            return self._sender
        sender = WeightSender(
            num_receivers=self.num_workers,
            options=SenderOptions(bucket_bytes=self.options.bucket_bytes, num_buffers=self.options.num_buffers,
                                  timeout_s=self.options.timeout_s))
        try:
            await self._rpc("init_weight_transfer_engine", init_info={
                "endpoint": sender.endpoint, "timeout_s": self.options.timeout_s, "allow_partial": False})
        except BaseException:
            sender.close()
            raise
        self._sender = sender
        return sender

    async def _sync(self, parts: SyncParts, version: int, global_steps: int | None) -> SyncStats:
        """One whole hwsync sync inside one vLLM weight update; raises with the engine's message."""
        if not self._ensure_server_handle():
            raise RuntimeError("hwsync's adapter found no vLLM server for this replica's first rank")
        sender = await self._session()
        await self._rpc("start_weight_update")
        info = {"weight_version": None if global_steps is None else str(global_steps), "adapter": parts.adapter,
                "plans": parts.plans}
        update = self.server_handle.collective_rpc.remote("update_weights", timeout=None, args=(),
                                                          kwargs={"update_info": info})
        failed_early: list[BaseException] = []

        def on_done(future: Any) -> None:
            # an engine that failed before or while receiving must not leave the sender waiting out its timeout
            exc = future.exception()
            if exc is not None:
                failed_early.append(exc)
                sender.close()

        update.future().add_done_callback(on_done)
        stats = send_exc = rpc_exc = None
        try:
            # on the actor's event loop, as verl's generator expects (its gathers run on this thread's device)
            stats = sender.send(parts.source, version=version, manifest=parts.manifest)
        except Exception as exc:  # noqa: BLE001 - the engine's side is still awaited; settle() raises one of them
            send_exc = exc
        try:
            await asyncio.wait_for(update, self.options.timeout_s + RPC_GRACE_S)
        except Exception as exc:  # noqa: BLE001 - Ray's error carrying the engine's message; settle() raises it
            rpc_exc = exc
        await self._finish(failed=rpc_exc is not None)
        if failed_early or isinstance(send_exc, ClosedError):
            self._drop_session()  # closed under a running send: the next update opens a new one
            if rpc_exc is not None:
                send_exc = None  # the sender stopped because the engine failed: the engine's error is the one
        return settle(stats, send_exc, None, rpc_exc)

    async def _finish(self, *, failed: bool) -> None:
        """End the update on every worker, after a failed one too: vLLM's worker (and vllm-ascend's main) closed it
        itself and refuses a finish then, but vllm-ascend's NPUWorker up to 0.26.0rc1 did not, and only the finish
        puts back the tensors its reload moved to meta and lets the next update start (as the vLLM integration)."""
        try:
            await self._rpc("finish_weight_update")
        except Exception as exc:  # after a failed update the refusal is expected; else it is raised
            if not failed:
                raise
            expected = "start_weight_update" in str(exc)  # vLLM's words for "no update to finish"
            log.log(logging.DEBUG if expected else logging.WARNING, "hwsync: finish_weight_update after a failed "
                    "update: %s: %s", type(exc).__name__, exc)

    def _drop_session(self) -> None:
        if self._sender is not None:
            self._sender.close()
        self._sender = None

    def close(self) -> None:
        """Close the sender (buffers, socket); the next update opens a new one. Safe to call twice."""
        self._drop_session()
