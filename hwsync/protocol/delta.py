"""The `delta` field of an Offer (same host) or a PlanFrame (across nodes): a sync of a sender in delta mode.

    {"base": ID | None, "next": ID, "headers": [[code, dtype, numel, count, digest], ...] | None}

`base` is the baseline the sync applies on (None: a full sync, after which receivers hold `next`);
`headers`, one per announced tensor in the manifest's order, describe a delta sync's payloads
(hwsync.delta.header). Checked whole before a receiver acts on any of it.

A PlanFrame's field streams a delta instead of announcing it:

    {"base": ID | None, "next": ID, "groups": [n, ...] | None}

its manifest names the tensors as the receivers hold them, and a delta sync (`base` set) has no
buckets but `groups`: the manifest's tensors in runs of n, each run broadcast by sender 0 as one
descriptor (per tensor: code, count, digest; hwsync.delta.header.headers_to_words) and then its
payloads, so a group's encode overlaps the previous group's broadcast and apply.
"""

from __future__ import annotations

from typing import Any

from hwsync.delta.header import DeltaHeader
from hwsync.protocol.fields import BadFrame, short
from hwsync.sync.spec import TensorSpec

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


def check_plan_delta(delta: dict[str, Any], manifest: list[TensorSpec], num_buckets: int) -> None:
    """Raise BadFrame unless `delta` is a well-formed PlanFrame delta field for a plan of `manifest`."""
    if set(delta) != {"base", "next", "groups"}:
        raise BadFrame(f"a plan's delta field has keys base, next, groups; got {short(sorted(map(str, delta)))}")
    check_delta({"base": delta["base"], "next": delta["next"], "headers": None}, manifest)
    groups = delta["groups"]
    if groups is None:
        if delta["base"] is not None:
            raise BadFrame("a plan's delta from a base streams its tensors in groups")
        return
    if delta["base"] is None or num_buckets:
        raise BadFrame("a plan's delta groups go with a base and no buckets")
    if not isinstance(groups, list) or any(type(n) is not int or n < 1 for n in groups) or \
            sum(groups) != len(manifest):
        raise BadFrame(f"a plan's delta groups are positive counts of the manifest's {len(manifest)} tensors, got "
                       f"{short(groups)}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n
