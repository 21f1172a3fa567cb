"""The bucket plan of a disaggregated sync: which bytes go in which bucket, and which sender sends it.

The plan is computed once, by sender rank 0, from the manifest alone (names, dtypes, shapes),
and announced to every other rank in a protocol.PlanFrame. No rank recomputes it: two ranks
that computed it independently could disagree (a different bucket size, a different hwsync)
and then post mismatched collectives, which hangs instead of failing. Buckets are packed by
the same rule as the same-host sender's (bucket.BucketPacker), so BucketReader reassembles them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hwsync.errors import ManifestError
from hwsync.protocol import BucketSpec, Entry, PlanFrame
from hwsync.protocol.delta import DeltaField
from hwsync.sync.bucket import BucketPacker, Closed
from hwsync.sync.report import ReceiverReport
from hwsync.sync.spec import TensorSpec


@dataclass
class CollectivePlan:
    """Every bucket of one sync, in broadcast order, with its owning sender."""

    bucket_bytes: int
    num_senders: int
    manifest: list[TensorSpec]
    buckets: list[BucketSpec]

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data the sync carries."""
        return sum(spec.nbytes for spec in self.manifest)

    def owned_by(self, sender: int) -> list[int]:
        """Indices of the buckets `sender` broadcasts, in order."""
        return [k for k, b in enumerate(self.buckets) if b.owner == sender]

    def pieces(self) -> list[list[tuple[int, Entry]]]:
        """For each manifest position, the (bucket index, entry) pieces that carry that tensor."""
        position = {spec.name: i for i, spec in enumerate(self.manifest)}
        out: list[list[tuple[int, Entry]]] = [[] for _ in self.manifest]
        for k, bucket in enumerate(self.buckets):
            for entry in bucket.entries:
                if entry.name not in position:
                    raise ManifestError(f"planned bucket {k} carries {entry.name!r}, which the plan's manifest lacks")
                out[position[entry.name]].append((k, entry))
        return out

    def frame(self, *, pid: int, host: str, epoch: int, version: int, receivers: list[ReceiverReport],
              delta: DeltaField | None = None) -> PlanFrame:
        """The PlanFrame that announces this plan."""
        return PlanFrame(pid=pid, host=host, epoch=epoch, version=version, bucket_bytes=self.bucket_bytes,
                         num_senders=self.num_senders, manifest=self.manifest, buckets=self.buckets,
                         receivers=receivers,
                         delta=delta)

    @classmethod
    def from_frame(cls, frame: PlanFrame) -> CollectivePlan:
        """The plan a PlanFrame announced."""
        return cls(frame.bucket_bytes, frame.num_senders, list(frame.manifest), list(frame.buckets))


def pack_layout(manifest: list[TensorSpec], bucket_bytes: int) -> list[Closed]:
    """Each bucket's used bytes and entries, packed as the same-host sender packs real tensors."""
    packer = BucketPacker(bucket_bytes)
    buckets: list[Closed] = []
    seen: set[str] = set()
    for spec in manifest:
        if spec.name in seen:
            raise ManifestError(f"tensor {spec.name!r} appears twice in the manifest; names must be unique")
        seen.add(spec.name)
        buckets += [step for step in packer.place(spec.name, spec.dtype, spec.shape, spec.nbytes)
                    if isinstance(step, Closed)]
    last = packer.close()
    return buckets + ([last] if last is not None else [])


def assign_owners(sizes: list[int], num_senders: int) -> list[int]:
    """Owner of each bucket: the sender with the fewest bytes so far, so shares stay even and interleaved."""
    if num_senders < 1:
        raise ValueError(f"num_senders={num_senders} must be at least 1")
    load = [0] * num_senders
    owners = []
    for size in sizes:
        owner = min(range(num_senders), key=lambda s: (load[s], s))
        owners.append(owner)
        load[owner] += max(size, 1)
    return owners


def make_plan(manifest: list[TensorSpec], bucket_bytes: int, num_senders: int) -> CollectivePlan:
    """The whole plan of one sync (called on sender rank 0 only, then announced)."""
    layout = pack_layout(manifest, bucket_bytes)
    sizes = [bucket.nbytes for bucket in layout]
    owners = assign_owners(sizes, num_senders)
    buckets = [BucketSpec(owner, bucket.nbytes, tuple(bucket.entries)) for owner, bucket in zip(owners, layout)]
    return CollectivePlan(bucket_bytes, num_senders, list(manifest), buckets)


#: buckets of targets per group of a streamed delta. A group costs both hosts about a millisecond of CPU (its two
#: broadcasts, its descriptor, the hand-offs between threads). At 10 Gbit/s on the bed (368M elements, 2 cores,
#: LR 1e-6), in groups of two buckets, step 1 took 1.34-1.60x its floor (median 1.47x, fourteen runs) and steps
#: 2-4 a median 1.21x; in groups of one 1.43-1.78x (1.50x, ten runs) and 1.35x; in groups of a quarter, 2.06-2.61x.
#: A larger group delays the first broadcast and lengthens the last apply: over 1 Gbit/s, where the wire is the
#: floor, the steps took alike (1.12-1.45x against 1.08-1.48x).
DELTA_GROUP_BUCKETS = 2


def delta_groups(targets: list[TensorSpec], bucket_bytes: int) -> list[int]:
    """A streamed delta's groups: runs of consecutive tensors of about DELTA_GROUP_BUCKETS buckets of targets each,
    so a group's encode overlaps the previous group's broadcast and apply (payloads are a share of their targets:
    one larger than a bucket gets a buffer of its own)."""
    groups: list[int] = []
    count = held = 0
    for spec in targets:
        count, held = count + 1, held + spec.nbytes
        if held >= DELTA_GROUP_BUCKETS * bucket_bytes:
            groups.append(count)
            count = held = 0
    return groups + ([count] if count else [])
