"""A delta payload held between its stage and its commit, for a tensor the engine gives as the delta's base.

A receiver that stages a delta into an engine that names its own tensors (`into`) does not keep a copy of the
model: the engine's tensor is the base. During the stage the payload is applied on a scratch copy of that tensor
and checked there (the engine reads nothing new); a sparse payload is then kept, and the scratch dropped. At the
commit the payload is written into the engine's tensor in place, and checked again: from the changed elements
when the digest the tensor had is known on the host (cheap: it catches the engine's tensor changed at a changed
position between stage and commit), else by digesting the tensor whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hwsync.delta.header import DeltaHeader
from hwsync.delta.patch import BaseMismatch, apply_into, verify
from hwsync.errors import DeltaCheckError


@dataclass(frozen=True)
class StagedPayload:
    """One tensor's checked delta payload, written into the engine's tensor at the commit."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    header: DeltaHeader
    #: the payload's bytes, in the staging area's memory (a copy: the wire's buffer is reused)
    payload: torch.Tensor
    #: the digest of the base the stage checked the payload on, when known (the commit's cheap check)
    base_digest: int | None
    #: whether the commit checks from the changed elements (else it digests the tensor whole)
    by_changes: bool
    #: the engine's tensor the stage checked it against: `base_digest` is that memory's, and the commit checks from
    #: the changes only when it writes into that memory
    base: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes the staging area holds for it."""
        return self.payload.numel()

    def write(self, dest: torch.Tensor) -> None:
        """Write the changes into the engine's tensor and check its digest is the sender's (DeltaCheckError if not:
        the engine's tensor was not the base the stage checked, so the receiver then holds no known version)."""
        payload = self.payload.to(dest.device, non_blocking=dest.device.type != "cpu")
        try:
            if self.by_changes and self.base_digest is not None and _same_memory(dest, self.base):
                gain = apply_into(dest, self.header, payload, name=self.name, gain=True)
                ok = gain is not None and (self.base_digest + gain) % (1 << 64) == self.header.digest
            else:
                apply_into(dest, self.header, payload, name=self.name)
                ok = verify(dest, self.header)
        except BaseMismatch:  # a step code found other values at its changes, and wrote nothing
            ok = False
        if not ok:
            raise DeltaCheckError(f"{self.name}: after its staged {self.header.code} delta was written at the commit, "
                                  "the engine's tensor does not have the sender's digest: it changed between the stage "
                                  "(where the delta checked out on a copy of it) and the commit; the next sync is full")


def _same_memory(tensor: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether `tensor` is `base`'s memory (`base` is held, so its storage cannot have been freed and reused)."""
    if tensor is base:
        return True
    try:
        return tensor.data_ptr() == base.data_ptr() and tensor.untyped_storage() is base.untyped_storage()
    except (RuntimeError, TypeError):  # no torch storage (a wrapper subclass): only the very tensor counts
        return False
