"""Whether a compiled fp32-to-bfloat16 cast gives torch's bits on this machine (checked once, before it is used).

torch's cast is the loader's own op, so the delta encode may replace it only where the two agree: on
fp32 values of every exponent, ties to even, subnormals, -0.0, infinities and overflow. NaNs are not
probed: the kernel reports them and torch casts those chunks (its NaN bits differ between builds).
"""

from __future__ import annotations

from typing import Callable


def matches_torch(cast: Callable[..., bool]) -> bool:
    """Whether `cast` gives torch's bits for fp32 values of every exponent, ties, subnormals, -0.0, inf, overflow."""
    import numpy as np
    import torch

    gen = torch.Generator().manual_seed(1)
    probe = torch.randint(-(1 << 31), 1 << 31, (1 << 16,), dtype=torch.int64, generator=gen).to(torch.int32)
    special = [0, 1 << 31, 1, 0x8000, 0x18000, 0x7FFF, 0x17FFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F800000,
               0xFF800000, 0x007FFFFF, 0x3F808000, 0x3F818000, 0xBF808000]
    probe[: len(special)] = torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in special], dtype=torch.int32)
    bits = probe.numpy().view(np.uint32)
    bits[(bits & 0x7FFFFFFF) > 0x7F800000] &= 0xFF800000  # NaNs become infinities: the kernel hands NaNs to torch
    out = np.empty(bits.size, np.uint16)
    if cast(bits, out):
        return False
    expected = torch.from_numpy(bits.view(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return bool((out == expected).all())
