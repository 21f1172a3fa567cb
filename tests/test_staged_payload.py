"""A staged delta payload written into the engine's own tensor at the commit (hwsync.delta.staged): the new version
exactly where the tensor is still the base the stage checked, and DeltaCheckError, never a silent wrong weight, where
it changed at a position the delta writes (or anywhere, when the commit digests the tensor whole)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hwsync.delta.diff import encode
from hwsync.delta.digest import tensor_digest
from hwsync.delta.header import BITMAP, BLOCKS, STEPS
from hwsync.delta.staged import StagedPayload
from hwsync.errors import DeltaCheckError
from hwsync.sync.staging import payload_kept

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _versions(n: int, changed: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A base, the new version with `changed` elements moved a little, and the changed positions."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g).to(dtype)
    where = torch.randperm(n, generator=g)[:changed]
    new = base.clone()
    new[where] = (new[where].float() * 1.5 + 0.25).to(dtype)
    moved = where[new[where].view(torch.int16 if dtype.itemsize == 2 else torch.int32)
                  != base[where].view(torch.int16 if dtype.itemsize == 2 else torch.int32)]
    return base, new, moved


def _staged(base: torch.Tensor, new: torch.Tensor, by_changes: bool, engine: torch.Tensor) -> StagedPayload | None:
    """`new` staged as a delta on `base`, checked at the stage against the engine's tensor `engine` (equal to it)."""
    delta = encode(new, base, base_digest=tensor_digest(base))
    if delta.header.code not in (BLOCKS, BITMAP, STEPS):
        return None  # a dense or unchanged tensor is staged whole or not at all: no payload to write
    return StagedPayload("w", base.dtype, tuple(base.shape), delta.header, delta.payload.clone(),
                         tensor_digest(base), by_changes, engine)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(64, 70_000), share=st.floats(0.0005, 0.2), dtype=st.sampled_from(sorted(DTYPES)),
       seed=st.integers(0, 1 << 16), by_changes=st.booleans(),
       tamper=st.sampled_from(["none", "changed", "other", "made anew"]))
def test_a_staged_payload_writes_the_new_version_or_refuses(n, share, dtype, seed, by_changes, tamper):
    base, new, moved = _versions(n, max(1, int(n * share)), DTYPES[dtype], seed)
    dest = base.clone()  # the engine's tensor, as the stage saw it
    staged = _staged(base, new, by_changes, dest)
    if staged is None or not moved.numel():
        return
    if tamper == "made anew":  # the engine gives, at the commit, another tensor than the stage's (changed elsewhere)
        dest = dest.clone()
    ints = dest.view(torch.int16 if dest.element_size() == 2 else torch.int32)
    if tamper == "changed":  # the engine's tensor changed, between stage and commit, where the delta writes
        ints[int(moved[0])] ^= 0x10
    elif tamper in ("other", "made anew"):  # ... or where it does not
        unchanged = torch.ones(n, dtype=torch.bool)
        unchanged[moved] = False
        if not unchanged.any():
            return
        ints[int(unchanged.nonzero()[0])] ^= 0x10
    exact = lambda: torch.equal(dest.view(torch.uint8), new.view(torch.uint8))  # noqa: E731
    if tamper == "none":
        staged.write(dest)
        assert exact()
    elif tamper == "changed":  # refused, or overwritten with the new value (a code that carries values): exact
        try:
            staged.write(dest)
        except DeltaCheckError as exc:
            assert "between the stage" in str(exc)
        else:
            assert exact(), f"a {staged.header.code} payload wrote a wrong weight and said nothing"
    elif not by_changes or tamper == "made anew":  # the whole digest finds a byte changed anywhere (and a tensor
        # in other memory than the stage's is digested whole: the digest of the stage's speaks for its memory only)
        with pytest.raises(DeltaCheckError, match="between the stage"):
            staged.write(dest)
    else:  # checked from the changes only: a byte changed elsewhere is left to the periodic whole digest
        staged.write(dest)
        assert tensor_digest(dest) != staged.header.digest


def test_payloads_are_kept_when_sparse_and_never_for_a_dense_delta():
    base, new, _ = _versions(100_000, 1_000, torch.bfloat16, 0)
    sparse = encode(new, base, base_digest=tensor_digest(base)).header
    assert payload_kept(sparse, base.numel() * base.element_size())
    everything = encode(base + 1, base, base_digest=tensor_digest(base)).header
    assert not payload_kept(everything, base.numel() * base.element_size())
