"""Exception types a user of hwsync catches; every message names the fix."""

from __future__ import annotations


class HwsyncError(Exception):
    """Base class of every error hwsync raises on purpose."""


class BackendError(HwsyncError):
    """No usable backend could be selected; the message lists what is installed and why."""


class SyncError(HwsyncError):
    """A sync failed; both sides have released their buffers and a new sync may be tried."""


class SyncTimeoutError(SyncError):
    """A peer stayed silent past the timeout (dead, stalled, or never started)."""


class ProtocolError(SyncError):
    """The two sides disagree on the protocol or the handshake was refused."""


class RemoteError(SyncError):
    """The peer raised; the message carries the peer's own exception text."""


class ManifestError(SyncError):
    """The announced tensors do not match the receiving model, or iteration strayed from them."""


class DestinationError(ManifestError, ValueError):
    """A receiver's into() gave a destination that does not match the tensor sent (dtype, shape, layout); nothing
    was written into it."""


class DeltaCheckError(SyncError):
    """A tensor did not have the sender's digest after a delta was applied; the receiver holds no known version,
    and the next sync is full."""


class StagingMemoryError(SyncError):
    """A receiver that stages lacks the memory for the version offered; refused before a byte moved, and no
    receiver of the sync applies it."""


class NotAppliedError(SyncError):
    """A staged sync failed before its commit: no receiver that stages applied the version, each keeps the
    previous one; the message names the receiver that failed and why."""


class PartlyAppliedError(SyncError):
    """A staged sync was committed (every receiver had staged it and the Apply went out), but a receiver failed or
    exited before it said applied: the others apply the version; the one named holds no known version, and its
    next sync is full."""


class SupersededError(SyncError):
    """A staged version was never committed: a newer stage or send replaced it, and no receiver applied it."""


class SourceError(HwsyncError, ValueError):
    """What the caller passed as a sync's source is unusable; the message names the item and the fix."""


class PlanError(HwsyncError, ValueError):
    """The plan of a sync cannot be made or followed (TrainerModel, EngineState); the message names the fix."""


class DuplicateTensorError(PlanError):
    """A tensor name was yielded twice in one sync."""


class MemoryImbalanceError(HwsyncError):
    """Ranks' device memory differs by more than the tolerance (check_balance mode="raise")."""


class ClosedError(HwsyncError):
    """The sender or receiver was closed: a sync it was running ended, and it serves no more; make a new one."""
