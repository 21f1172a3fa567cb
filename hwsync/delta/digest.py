"""A tensor's digest: computed where the tensor lives, the same on every device, updatable from a delta.

Why not a library or `torch.hash_tensor`: xxhash and blake3 hash host memory, so a GPU or NPU receiver
would copy every tensor to the host to check it; `torch.hash_tensor` (torch 2.13, mode 0) runs on the
device but is the XOR of the elements, blind to position and linear over bits: it misses two swapped
elements or rows, and a bit flipped in an even number of elements (two -0.0 turned +0.0).

This is Carter-Wegman multilinear hashing: the tensor's bytes as signed 32-bit lanes (the tail padded
with zeros), each widened to 64 bits, times a fixed odd 64-bit key of its position, summed mod 2**64,
plus a term for the byte length. Three torch ops per lane (widen, multiply, sum), on any device; integer
addition is associative, so the value does not depend on the device, the thread count or the reduction
order. A single changed lane always changes the sum (odd keys, |difference| < 2**32); two different
tensors of one size collide with probability at most 2**-32 over the keys. The keys are fixed (error
detection, not authentication). The sum is linear in each element, so a sender updates its baseline's
digest from the changed elements alone (`element_delta`).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from hwsync.delta import native

_LANES_PER_ROW = 1 << 16  # keys repeat per row of 65536 lanes; each row has its own odd multiplier
_KEY_SEED, _ROW_SEED = 0x243F6A8885A308D3, 0x13198A2E03707344
_LEN_KEY = 0x3C6EF372FE94F82B
_ROWS_PER_STEP = {"cpu": 16}  # rows per pass: on the host 4 MiB of lanes, in cache; elsewhere 64 (16 MiB)
_U64 = 1 << 64


def _signed(c: int) -> int:
    return c - _U64 if c >= 1 << 63 else c


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic), made odd: a fixed, well-spread key per input."""
    z = x + _signed(0x9E3779B97F4A7C15)
    z = (z ^ _srl(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _srl(z, 27)) * _signed(0x94D049BB133111EB)
    return (z ^ _srl(z, 31)) | 1


_tables: dict[tuple[str, torch.device], torch.Tensor] = {}
_lock = threading.Lock()


def key_table(kind: str, device: torch.device, size: int) -> torch.Tensor:
    """Column keys (65536) or row keys (at least `size`, grown by doubling), cached per device."""
    with _lock:
        have = _tables.get((kind, device))
        if have is None or have.numel() < size:
            n = _LANES_PER_ROW if kind == "col" else max(1024, 1 << max(0, size - 1).bit_length())
            seed = _KEY_SEED if kind == "col" else _ROW_SEED
            have = _tables[(kind, device)] = _splitmix(torch.arange(n, dtype=torch.int64) + seed).to(device)
        return have


_host: tuple[np.ndarray, np.ndarray] | None = None  # host_keys' last pair


def host_keys(nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The column keys and enough row keys for a host tensor of `nbytes`, as numpy arrays (the compiled kernels'):
    the last pair handed out while it has enough rows (taken per tensor, they cost more than a small tensor's scan)."""
    global _host
    rows = ((nbytes + 3) // 4 >> 16) + 1
    have = _host
    if have is None or have[1].size < rows:
        cpu = torch.device("cpu")
        have = _host = key_table("col", cpu, _LANES_PER_ROW).numpy(), key_table("row", cpu, rows).numpy()
    return have  # a thread reads the old pair or the new one whole: both are right


def lane_keys(lane: torch.Tensor) -> torch.Tensor:
    """The odd 64-bit key of each 32-bit lane position in `lane` (int64)."""
    rows = lane >> 16
    row_keys = key_table("row", lane.device, int(rows.max()) + 1 if rows.numel() else 1)
    cols = key_table("col", lane.device, _LANES_PER_ROW).index_select(0, lane & (_LANES_PER_ROW - 1))
    return cols.mul_(row_keys.index_select(0, rows))


def element_delta(pos: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> int:
    """What a digest gains when the elements at flat `pos` change from `old` to `new` (integer views)."""
    if pos.numel() == 0:
        return 0
    size = old.element_size()
    if size == 8:  # two lanes per element: the low half first
        pos = torch.stack([pos * 2, pos * 2 + 1], 1).view(-1)
        old, new, size = old.view(torch.int32), new.view(torch.int32), 4
    per = 4 // size
    if size == 1:  # sign-extend bytes (a uint8 view would zero-extend)
        old, new = old.view(torch.int8), new.view(torch.int8)
    diff = new.to(torch.int64) - old.to(torch.int64)
    if per > 1:  # a lane is its low elements zero-extended plus its top element sign-extended, shifted
        sub = pos & (per - 1)
        low = sub != per - 1
        diff = torch.where(low, (new.to(torch.int64) & ((1 << 8 * size) - 1)) -
                           (old.to(torch.int64) & ((1 << 8 * size) - 1)), diff)
        diff = diff << (sub * 8 * size)
    return int(diff.mul_(lane_keys(pos // per)).sum()) % _U64


def _lanes(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the tensor's bytes as int32 lanes, the last zero-padded; its byte length)."""
    raw = t.contiguous().view(-1).view(torch.uint8)
    nbytes = raw.numel()
    whole = nbytes // 4 * 4
    if whole == nbytes:
        return raw.view(torch.int32), nbytes
    tail = torch.zeros(4, dtype=torch.uint8, device=raw.device)
    tail[: nbytes - whole] = raw[whole:]
    return torch.cat([raw[:whole].view(torch.int32), tail.view(torch.int32)]), nbytes


def finish(total: int, nbytes: int) -> int:
    """Add the length term to a sum of lane terms: the digest, an int in [0, 2**64)."""
    return (total + nbytes * _LEN_KEY) % _U64


def tensor_digest(t: torch.Tensor, *, compiled: bool = True) -> int:
    """The digest of a tensor's bytes, computed on its device: an int in [0, 2**64) (`compiled=False`: torch ops
    even on the host, for comparison)."""
    lanes, nbytes = _lanes(t)
    device, n = lanes.device, lanes.numel()
    cols = key_table("col", device, _LANES_PER_ROW)
    rows_total = (n + _LANES_PER_ROW - 1) // _LANES_PER_ROW
    row_keys = key_table("row", device, rows_total)
    kernel = native.digest_lanes() if device.type == "cpu" and compiled and native.ready() else None
    if kernel is not None:  # on the host, one compiled pass at memory speed (torch ops: three passes)
        return finish(int(kernel(lanes.numpy(), cols.numpy(), row_keys.numpy())), nbytes)
    step = _ROWS_PER_STEP.get(device.type, 64) * _LANES_PER_ROW
    total = torch.zeros((), dtype=torch.int64, device=device)
    wide = torch.empty(min(step, n), dtype=torch.int64, device=device)
    for start in range(0, n, step):
        chunk = lanes[start: start + step]
        m = wide[: chunk.numel()]
        m.copy_(chunk)  # sign-extends
        rows, row0 = chunk.numel() // _LANES_PER_ROW, start // _LANES_PER_ROW
        if rows:
            sums = m[: rows * _LANES_PER_ROW].view(rows, _LANES_PER_ROW).mul_(cols).sum(1)
            total += sums.mul_(row_keys[row0: row0 + rows]).sum()
        rest = m[rows * _LANES_PER_ROW:]
        if rest.numel():
            total += rest.mul_(cols[: rest.numel()]).sum() * row_keys[row0 + rows]
    return finish(int(total), nbytes)
