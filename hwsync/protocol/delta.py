"""The `delta` field of an Offer (same host) or a PlanFrame (across nodes): a sync of a sender in delta mode.

    {"base": ID | None, "next": ID, "headers": [[code, dtype, numel, count, digest], ...] | None}

(DeltaField, typed like every other field: decoded into it, its shape checked, then its headers checked
against the manifest by check_delta.)

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

from dataclasses import dataclass
from typing import Any

from hwsync.delta.header import DeltaHeader
from hwsync.protocol.fields import BadFrame, short
from hwsync.sync.spec import TensorSpec

#: the longest baseline id a sender makes or a receiver takes
MAX_ID = 64


@dataclass(frozen=True)
class DeltaField:
    """The `delta` field of an Offer or a PlanFrame, typed like every other field (checked on decode)."""

    #: the baseline id the sync applies on; None: a full sync (after which receivers hold `next`)
    base: str | None
    #: the id receivers hold once this sync completes
    next: str
    #: an Offer's delta sync: one header per announced tensor, in the manifest's order
    headers: list[DeltaHeader] | None = None
    #: a PlanFrame's delta sync: the manifest's tensors in runs of n, each streamed as one group
    groups: list[int] | None = None

    @property
    def is_delta(self) -> bool:
        """Whether the sync sends deltas (a base, and its headers or groups)."""
        return self.base is not None and (self.headers is not None or self.groups is not None)

    def to_wire(self) -> dict[str, Any]:
        """The field as msgpack values; a PlanFrame's has `groups` where an Offer's has `headers`."""
        out: dict[str, Any] = {"base": self.base, "next": self.next}
        if self.groups is not None:
            out["groups"] = self.groups
        else:
            out["headers"] = None if self.headers is None else [h.to_wire() for h in self.headers]
        return out

    @classmethod
    def from_wire(cls, raw: Any) -> DeltaField:
        """The field a peer sent, its shape checked (its fit to the manifest: check_delta, check_plan_delta)."""
        if not isinstance(raw, dict) or set(raw) not in ({"base", "next", "headers"}, {"base", "next", "groups"}):
            keys = sorted(map(str, raw)) if isinstance(raw, dict) else type(raw).__name__
            raise BadFrame(f"a delta field has keys base, next and headers or groups; got {short(keys)}")
        base, after = raw["base"], raw["next"]
        for value, what in ((base, "base"), (after, "next")):
            if not (value is None and what == "base") and (not isinstance(value, str) or not 0 < len(value) <= MAX_ID):
                raise BadFrame(f"a delta field's {what} must be an id of at most {MAX_ID} characters, got "
                               f"{short(value)}")
        groups = raw.get("groups")
        if groups is not None and (not isinstance(groups, list) or any(type(n) is not int or n < 1 for n in groups)):
            raise BadFrame(f"a plan's delta groups are positive counts, got {short(groups)}")
        raws = raw.get("headers")
        if raws is not None and not isinstance(raws, list):
            raise BadFrame(f"a delta field's headers are a list, got {type(raws).__name__}")
        headers = None
        if raws is not None:
            try:  # named by position here; check_delta holds each against its tensor's announcement
                headers = [DeltaHeader.from_wire(h, f"tensor #{i}") for i, h in enumerate(raws)]
            except ValueError as exc:
                raise BadFrame(str(exc)) from None
        return cls(base, after, headers, groups)


def check_delta(delta: DeltaField, manifest: list[TensorSpec] | None) -> None:
    """Raise BadFrame unless `delta` is a well-formed Offer delta field for `manifest`."""
    if delta.groups is not None:
        raise BadFrame("an offer's delta field announces headers, not groups")
    if delta.headers is None:
        return
    if delta.base is None or manifest is None or len(delta.headers) != len(manifest):
        raise BadFrame("a delta sync names its base and has one header per announced tensor")
    for spec, header in zip(manifest, delta.headers):
        if header.dtype != spec.dtype or header.numel != _numel(spec.shape):
            raise BadFrame(f"{short(spec.name)}: its delta header does not match its announcement")


def check_plan_delta(delta: DeltaField, manifest: list[TensorSpec], num_buckets: int) -> None:
    """Raise BadFrame unless `delta` is a well-formed PlanFrame delta field for a plan of `manifest`."""
    if delta.headers is not None:
        raise BadFrame("a plan's delta field streams groups, not headers")
    groups = delta.groups
    if groups is None:
        if delta.base is not None:
            raise BadFrame("a plan's delta from a base streams its tensors in groups")
        return
    if delta.base is None or num_buckets:
        raise BadFrame("a plan's delta groups go with a base and no buckets")
    if sum(groups) != len(manifest):
        raise BadFrame(f"a plan's delta groups are positive counts of the manifest's {len(manifest)} tensors, got "
                       f"{short(groups)}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n
