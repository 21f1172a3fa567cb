"""The trainer side for `vllm serve`: syncs over the server's routes, staged where the caller asks.

Start the server with VLLM_SERVER_DEV_MODE=1 (its /collective_rpc route, and the RL routes /pause, /resume and
/update_weight_version) and `--worker-extension-cls hwsync.integrations.vllm.HwsyncWorkerExtension`:

    sync = HttpVllmWeightSync("http://127.0.0.1:8000", stage=True)
    stats = sync.sync(model, version=step)

Streamed (the default), each worker's `hwsync_receive` holds the engine for the whole transfer. Staged
(`stage=True`), the workers stage while the server keeps generating, and the server pauses (`/pause` with
`pause_mode`) only to apply: the same steps as an AsyncLLM's staged sync (staged_trainer.py), each an HTTP call.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
import urllib.request
from typing import Any

from hwsync.colocated import WeightSender
from hwsync.integrations.vllm import staged_trainer as staged
from hwsync.integrations.vllm.sources import Weights, sync_parts
from hwsync.integrations.vllm.staged_trainer import PAUSE_MODES, PauseMode
from hwsync.integrations.vllm.trainer import _BlockingEngineSync, _missing_extension, settle
from hwsync.sync.planner import TrainerModel
from hwsync.sync.spec import TensorSpec
from hwsync.sync.stats import SyncStats
from hwsync.timing import DEFAULT_TIMEOUT_S, RPC_GRACE_S


class _Routes:
    """The server's routes as blocking calls."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    def post(self, path: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
        """POST `body` as JSON to `path`; the JSON answer, or None."""
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            text = response.read()
        return json.loads(text) if text else None

    def rpc(self, method: str, args: tuple[Any, ...], timeout_s: float) -> list[Any]:
        """Every worker's `method(*args)` through /collective_rpc (the route passes strings: the worker's hwsync
        methods convert them back, a dict from JSON); one result per worker."""
        strings = [json.dumps(a) if isinstance(a, dict) else str(a) for a in args]
        return self.post("/collective_rpc", {"method": method, "args": strings}, timeout_s)["results"]


class _ServerEngine:
    """The AsyncLLM calls a staged sync makes (staged_trainer.py), as the server's routes, off the event loop."""

    def __init__(self, routes: _Routes, timeout_s: float) -> None:
        self._routes, self._timeout_s = routes, timeout_s

    async def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return await asyncio.to_thread(self._routes.post, path, body, self._timeout_s + RPC_GRACE_S)

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Every worker's `method(*args)`."""
        return await asyncio.to_thread(self._routes.rpc, method, args, self._timeout_s + RPC_GRACE_S)

    async def pause_generation(self, mode: PauseMode, clear_cache: bool) -> None:
        """/pause in vLLM's `mode`."""
        await self._post("/pause?" + urllib.parse.urlencode({"mode": mode, "clear_cache": str(clear_cache).lower()}))

    async def resume_generation(self) -> None:
        """/resume."""
        await self._post("/resume")

    async def update_weight_version(self, version: str) -> None:
        """/update_weight_version: the version the server says it serves (/weight_info)."""
        await self._post("/update_weight_version", {"new_version": version})


class HttpVllmWeightSync(_BlockingEngineSync):
    """Trainer side for `vllm serve` started with VLLM_SERVER_DEV_MODE=1 and hwsync's worker extension."""

    def __init__(self, base_url: str, *, sender: WeightSender | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 bucket_bytes: int | None = None, allow_partial: bool = False, delta: bool = False,
                 stage: bool = False, pause_mode: PauseMode = "keep") -> None:
        """`stage=True`: each sync stages while the server generates, and the server pauses (/pause in
        `pause_mode`: "keep", "wait" or "abort") only to apply it."""
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode={pause_mode!r}: one of {PAUSE_MODES} (vLLM's /pause modes)")
        self.base_url = base_url.rstrip("/")
        self._routes = _Routes(self.base_url)
        try:
            workers = self._routes.rpc("hwsync_status", (), timeout_s)
        except Exception as exc:
            raise _missing_extension(exc) from exc
        super().__init__(len(workers), sender, timeout_s, bucket_bytes, allow_partial, delta)
        #: stage each sync while the server generates (True) or stream it, the server held throughout (False)
        self.staging = stage
        #: vLLM's pause mode around a staged sync's apply
        self.pause_mode: PauseMode = pause_mode

    def sync(self, weights: Weights | TrainerModel, *, version: int,
             manifest: list[TensorSpec] | None = None) -> SyncStats:
        """Push `weights` (or a TrainerModel to plan) as `version`; staged, generation pauses only to apply it
        (stats.stage.pause_s), and a failure before the commit applies nothing and never pauses."""
        parts = sync_parts(weights, manifest)
        if not self.staging:
            return self._drive(parts, version)
        return asyncio.run(self._staged(parts.source, parts.manifest, self._session(parts.specs), version,
                                        self._receive_args(parts)))

    async def _staged(self, source: Any, manifest: list[TensorSpec] | None, sender: WeightSender, version: int,
                      args: tuple[Any, ...]) -> SyncStats:
        engine = _ServerEngine(self._routes, self.timeout_s)
        outcome = await staged.stage(engine, sender, source, manifest, version, args)
        await staged.commit(engine, sender, outcome, self.pause_mode, self.timeout_s)
        self.engine_stats = outcome.results or []
        return settle(outcome.stats, outcome.send_exc, outcome.results, outcome.rpc_exc)

    def _receive_rpc(self, args: tuple[Any, ...]) -> Any:
        return self._routes.rpc("hwsync_receive", args, self.timeout_s + RPC_GRACE_S)

    def _reset_prefix_cache(self) -> None:
        self._routes.post("/reset_prefix_cache", None, self.timeout_s)
