"""The `delta` field of an Offer (same host) or a PlanFrame (across nodes): a sync of a sender in delta mode.

    {"base": ID | None, "next": ID, "headers": [[code, dtype, numel, count, digest], ...] | None}

`base` is the baseline the sync applies on (None: a full sync, after which receivers hold `next`);
`headers`, one per announced tensor in the manifest's order, describe a delta sync's payloads
(hwsync.delta.header). A PlanFrame's field also has `targets` ([name, dtype, shape] each): its
manifest lists what its buckets carry, so the tensors the receivers end up holding are named here.
Checked whole before a receiver acts on any of it.
"""

from __future__ import annotations

from typing import Any

from hwsync.delta.header import DeltaHeader
from hwsync.manifest import TensorSpec
from hwsync.protocol.fields import BadFrame, short

#: the longest baseline id a sender makes or a receiver takes
MAX_ID = 64


def check_delta(delta: dict[str, Any], manifest: list[TensorSpec] | None) -> None:
    """Raise BadFrame unless `delta` is a well-formed delta field for `manifest`."""
    if set(delta) != {"base", "next", "headers"}:
        raise BadFrame(f"a delta field has keys base, next, headers; got {short(sorted(map(str, delta)))}")
    base, after, headers = delta["base"], delta["next"], delta["headers"]
    for value, what in ((base, "base"), (after, "next")):
        if not (value is None and what == "base") and (not isinstance(value, str) or not 0 < len(value) <= MAX_ID):
            raise BadFrame(f"a delta field's {what} must be an id of at most {MAX_ID} characters, got {short(value)}")
    if headers is None:
        return
    if base is None or manifest is None or not isinstance(headers, list) or len(headers) != len(manifest):
        raise BadFrame("a delta sync names its base and has one header per announced tensor")
    for spec, raw in zip(manifest, headers):
        try:
            header = DeltaHeader.from_wire(raw, spec.name)
        except ValueError as exc:
            raise BadFrame(str(exc)) from None
        if header.dtype != spec.dtype or header.numel != _numel(spec.shape):
            raise BadFrame(f"{short(spec.name)}: its delta header does not match its announcement")


def plan_targets(delta: dict[str, Any]) -> list[TensorSpec]:
    """The tensors a cross-node delta sync's receivers end up holding (its `targets`), checked; BadFrame otherwise."""
    targets = delta.get("targets")
    if not isinstance(targets, list):
        raise BadFrame("a plan's delta field names its targets: the tensors as the receivers hold them")
    try:
        return [TensorSpec.from_wire(item) for item in targets]
    except ValueError as exc:
        raise BadFrame(f"a plan's delta targets: {exc}") from None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n
