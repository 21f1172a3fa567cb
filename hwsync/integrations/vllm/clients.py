"""vLLM weight-sync clients for the engines vLLM ships none for: offline `LLM` and in-process `AsyncLLM`.

A trainer-side weight-transfer engine drives the inference side through vLLM's
`VLLMWeightSyncClient` protocol (init / start / update / finish(weight_version), plain dicts).
vLLM provides it for HTTP (`HTTPVLLMWeightSyncClient`) and Ray actors; `vllm.LLM` has the same
four methods but takes request dicts (`{"init_info": ...}`), and `AsyncLLM`'s are coroutines.
These adapters add only that wrapping, plus `world_size()` (how many workers receive) and
`reset_prefix_cache()`, which the hwsync trainer engine uses when a client has them, and, for staged syncs
(`HwsyncTrainerInitInfo(stage=True)`), `pause_generation(mode)` and `resume_generation()` where the engine serves
while it syncs (AsyncLLM; vLLM's HTTP client reaches the server's /pause and /resume: `pause_generation` here).
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
import urllib.request
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("hwsync")

class LLMClient:
    """VLLMWeightSyncClient for an offline `vllm.LLM` (call from any thread: its RPCs block)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Hand the backend's init info to every worker."""
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        """Open a weight update on every worker."""
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Run one update on every worker (blocks until they are done)."""
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Close the update; vLLM stamps `weight_version` on the engine's outputs."""
        self.llm.finish_weight_update(weight_version)

    def world_size(self) -> int:
        """Workers that receive each update (tensor x pipeline parallel)."""
        return int(self.llm.llm_engine.vllm_config.parallel_config.world_size)

    def reset_prefix_cache(self) -> bool:
        """Drop cached KV blocks: they were computed with the old weights (False: vLLM refused, requests hold some)."""
        return bool(self.llm.reset_prefix_cache())


class AsyncLLMClient:
    """VLLMWeightSyncClient for an `AsyncLLM` running on event loop `loop`; call it from another thread.

    The trainer engine's blocking `send_weights` then runs off the loop, e.g.
    `await asyncio.to_thread(trainer.send_weights, "step-3")`, while the loop keeps serving.
    """

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.loop = loop

    def _run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coroutine.close()
            raise RuntimeError("AsyncLLMClient blocks until the engine answers: call the trainer engine from "
                               "another thread, e.g. await asyncio.to_thread(trainer.send_weights, version)")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Hand the backend's init info to every worker."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        """Open a weight update on every worker."""
        self._run(self.engine.start_weight_update())

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Run one update on every worker (blocks this thread, not the loop)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Close the update; vLLM stamps `weight_version` on the engine's outputs."""
        self._run(self.engine.finish_weight_update(weight_version))

    def world_size(self) -> int:
        """Workers that receive each update (tensor x pipeline parallel)."""
        return int(self.engine.vllm_config.parallel_config.world_size)

    def reset_prefix_cache(self) -> bool:
        """Drop cached KV blocks: they were computed with the old weights (False: vLLM refused, requests hold some)."""
        return bool(self._run(self.engine.reset_prefix_cache()))

    def pause_generation(self, mode: str) -> None:
        """vLLM's pause in `mode` ("keep", "wait" or "abort"); caches are cleared except in "keep"."""
        self._run(self.engine.pause_generation(mode=mode, clear_cache=mode != "keep"))

    def resume_generation(self) -> None:
        """Resume generation after pause_generation."""
        self._run(self.engine.resume_generation())


def engine_world_size(client: Any, timeout_s: float = 30.0) -> int | None:
    """How many workers receive each update, when the client can tell (ours, or an HTTP client's server)."""
    world_size = getattr(client, "world_size", None)
    if callable(world_size):
        return int(world_size())
    base_url = getattr(client, "base_url", None)
    if isinstance(base_url, str):  # vLLM's HTTPVLLMWeightSyncClient: the server's RL route says
        with urllib.request.urlopen(base_url.rstrip("/") + "/get_world_size", timeout=timeout_s) as response:
            return int(json.loads(response.read())["world_size"])
    return None


def prefix_cache_kept(reset: object) -> None:
    """Say so when vLLM refused to reset its prefix cache after a sync (its reset returns False while running
    requests hold KV blocks): new requests may then reuse prefixes computed with the previous weights."""
    if reset is False:
        log.warning("hwsync: vLLM kept its prefix cache after the sync (requests were running and hold KV blocks): "
                    "new requests may reuse prefixes computed with the previous weights. Where that matters, stage "
                    "the sync with pause_mode='wait' or 'abort' (they clear the caches)")


def reset_prefix_cache(client: Any, timeout_s: float = 30.0) -> bool:
    """Reset the engine's prefix cache through `client` where it can (ours; an HTTP client's server); False if not
    (a refusal by vLLM is logged: prefix_cache_kept)."""
    reset = getattr(client, "reset_prefix_cache", None)
    if callable(reset):
        done = reset()
        prefix_cache_kept(done)
        return done is not False
    base_url = getattr(client, "base_url", None)
    if isinstance(base_url, str):  # the server's dev-mode route, mounted with the RL routes
        _post(base_url, "/reset_prefix_cache", timeout_s)
        return True
    return False


def can_pause(client: Any) -> bool:
    """Whether `client` can pause and resume its engine's generation (ours for AsyncLLM; an HTTP client's server)."""
    return callable(getattr(client, "pause_generation", None)) or isinstance(getattr(client, "base_url", None), str)


def pause_generation(client: Any, mode: str, timeout_s: float = 300.0) -> None:
    """Pause the engine's generation through `client` (see can_pause): vLLM's pause in `mode`."""
    pause = getattr(client, "pause_generation", None)
    if callable(pause):
        pause(mode)
        return
    query = urllib.parse.urlencode({"mode": mode, "clear_cache": str(mode != "keep").lower()})
    _post(client.base_url, "/pause?" + query, timeout_s)


def resume_generation(client: Any, timeout_s: float = 300.0) -> None:
    """Resume the engine's generation through `client` (see can_pause)."""
    resume = getattr(client, "resume_generation", None)
    if callable(resume):
        resume()
        return
    _post(client.base_url, "/resume", timeout_s)


def _post(base_url: str, route: str, timeout_s: float) -> None:
    request = urllib.request.Request(base_url.rstrip("/") + route, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s):
        pass
