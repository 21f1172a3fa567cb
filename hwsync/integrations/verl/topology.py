"""Who does what in one verl weight update: metadata from `prepare()`, and `build_topology` on the driver.

verl's CheckpointEngineManager calls `prepare()` on every trainer rank and rollout worker,
collects the dicts in that order (trainer ranks 0..n-1, then rollout workers replica by
replica), calls `build_topology(n, m, metadata)` on the driver and hands element i of each
returned list to worker i's `init_process_group`. Everything here is plain data: it crosses
Ray's control plane, never hwsync's wire, and the driver touches no device.

Roles: trainer ranks on rank 0's host (up to `max_senders`) are hwsync's striped senders
0..S-1; other trainer ranks get rank -1 (they walk verl's generator, whose FSDP gather is
collective, and send nothing); rollout worker j is receiver j.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hwsync.control.endpoints import new_token
from hwsync.control.sockets import curve_key_pair
from hwsync.disaggregated.sender import default_host, pick_port

#: a metadata dict made by this engine carries this key; its value is the metadata layout's version
MARK = "hwsync"
LAYOUT = 1


def node_ip(override: str | None = None) -> str:
    """The address peers reach this process at: the override, Ray's node IP, or the resolver's."""
    if override:
        return override
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except Exception:  # noqa: BLE001 - outside Ray (or an old Ray) the resolver's answer is the fallback
        pass
    return default_host()


def fresh_endpoint(host: str) -> tuple[str, str]:
    """A new control endpoint for sender 0 to bind, and its CURVE secret key (which stays in sender 0's process).

    The endpoint is announced to every worker before sender 0 binds it, so it carries a port free now on
    `host`, a new token and the public half of a new CURVE key pair.
    """
    public, secret = curve_key_pair()
    return f"tcp://{host}:{pick_port(host)}#{new_token()}#{public}", secret


@dataclass(frozen=True)
class TrainerPlace:
    """What one trainer rank learns from build_topology."""

    endpoint: str
    rank: int  # its sender rank, or -1: walk the weights, send nothing
    num_senders: int
    num_receivers: int


@dataclass(frozen=True)
class RolloutPlace:
    """What one rollout worker learns from build_topology."""

    endpoint: str
    rank: int


def trainer_metadata(host: str, max_senders: int, master: dict[str, Any] | None) -> dict[str, Any]:
    """A trainer rank's prepare() result; rank 0 adds its current endpoint and a fresh one (master)."""
    return {MARK: LAYOUT, "role": "trainer", "host": host,
            "max_senders": max_senders, "master": master}


def rollout_metadata(host: str) -> dict[str, Any]:
    """A rollout worker's prepare() result."""
    return {MARK: LAYOUT, "role": "rollout", "host": host}


def _check(metadata: list[Any], n: int, m: int) -> None:
    if len(metadata) != n + m:
        raise ValueError(f"build_topology got {len(metadata)} metadata dicts for {n} trainer ranks and {m} rollout "
                         "workers; verl's manager passes one per worker")
    for i, item in enumerate(metadata):
        role = "trainer" if i < n else "rollout"
        if not isinstance(item, dict) or item.get(MARK) != LAYOUT or item.get("role") != role:
            who = f"trainer rank {i}" if i < n else f"rollout worker {i - n}"
            raise ValueError(f"the metadata of {who} was not made by hwsync's engine (layout {LAYOUT}, role {role}): "
                             f"{item!r:.200}; set checkpoint_engine.backend='hwsync' for the actor and the rollout "
                             "alike, with the same hwsync version on both")
    if not metadata[0].get("master"):
        raise ValueError("trainer rank 0 did not build its engine as master (is_master=True); verl's trainer worker "
                         "passes is_master=(torch.distributed.get_rank() == 0): build it that way")


def build_topology(n: int, m: int, metadata: list[Any]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """Per-worker init_process_group kwargs: (trainer lists of length n, rollout lists of length m)."""
    if n < 1 or m < 1:
        raise ValueError(f"hwsync needs at least one trainer rank and one rollout worker, got {n} and {m}")
    _check(metadata, n, m)
    master = metadata[0]
    senders = [i for i in range(n) if metadata[i]["host"] == master["host"]][: max(1, int(master["max_senders"]))]
    count, receivers = len(senders), m
    current = master["master"]
    # keep rank 0's hub (and with it every group) when the shape is unchanged; else all start afresh
    if current.get("endpoint") and current.get("counts") == [count, receivers]:
        endpoint = current["endpoint"]
    else:
        endpoint = current["fresh"]
    ranks = [senders.index(i) if i in senders else -1 for i in range(n)]
    trainer = {"endpoint": [endpoint] * n, "rank": ranks, "num_senders": [count] * n,
               "num_receivers": [receivers] * n}
    rollout = {"endpoint": [endpoint] * m, "rank": list(range(m))}
    return trainer, rollout
