"""One sync as the pipeline hands it to a carrier: what streams, what receivers are told, what they end up holding."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hwsync.sync.spec import NamedTensors, TensorSpec

if TYPE_CHECKING:  # a full sync never imports the delta code
    from hwsync.delta.diff import Delta
    from hwsync.protocol.delta import DeltaField
    from hwsync.sync.encode_ahead import EncodeAhead


@dataclass
class Prepared:
    """One sync, prepared: cast for the engines; for a delta, encoded (up front) or encoding (streamed)."""

    #: the (name, tensor) pairs to stream: cast tensors (full), or each tensor's payload bytes (delta); None when
    #: the delta is streamed
    source: NamedTensors | None
    #: the manifest the stream is checked against (payloads as uint8 for a delta), or None
    stream_manifest: list[TensorSpec] | None
    #: the tensors the receivers end up holding (names, the engine's dtypes, shapes), or None
    targets: list[TensorSpec] | None
    #: the Offer's delta field (a PlanFrame's is made from it); None outside delta mode
    wire: DeltaField | None
    deltas: dict[str, Delta] = field(default_factory=dict)
    #: a streamed delta: each target's (spec, delta) in order, encoded as it is asked for
    encoded: EncodeAhead | None = None
    #: the source's pairs before the cast (a sender rank that only walks the source, as sender 0 sends a delta)
    uncast: NamedTensors | None = None

    @property
    def is_delta(self) -> bool:
        """Whether this sync sends deltas (the receivers apply them on the baseline they hold)."""
        return self.wire is not None and self.wire.base is not None \
            and (self.wire.headers is not None or self.encoded is not None)
