"""A tensor's digest: computed where the tensor lives, the same on every device, updatable from a delta.

Why not a library or `torch.hash_tensor`: xxhash and blake3 hash host memory, so a GPU or NPU receiver
would copy every tensor to the host to check it; `torch.hash_tensor` (torch 2.13, mode 0) runs on the
device but is the XOR of the elements, blind to position and linear over bits: it misses two swapped
elements or rows, and any bit flipped in an even number of elements (two -0.0 turned +0.0). This is
Carter-Wegman multilinear hashing over the tensor's bytes as 64-bit words, from five torch ops: each word
is premixed (w ^ w >>> 32, a bijection that keeps a high-bit change from vanishing mod 2**64), times a
per-position odd 64-bit key, summed mod 2**64. Integer addition is associative, so the value does not
depend on the device, the thread count or the reduction order. A single changed word always changes the
sum (odd keys); two different tensors of one size collide with probability below 2**-33 over the keys.
The keys are fixed (error detection, not authentication). The sum is over words, so a sender can update
the digest of its baseline from the changed words alone (`word_delta`).
"""

from __future__ import annotations

import threading

import torch

_WORDS_PER_ROW = 1 << 16  # keys repeat per row of 65536 words; each row has its own odd multiplier
_KEY_SEED, _ROW_SEED = 0x243F6A8885A308D3, 0x13198A2E03707344
_LEN_KEY = 0x3C6EF372FE94F82B  # mixes the byte length in, so an empty and a zero tensor differ in length terms
_ROWS_PER_STEP = {"cpu": 8}  # rows per pass: on the host 4 MiB of words, in cache; elsewhere 64 (32 MiB)
_U64 = 1 << 64


def _signed(c: int) -> int:
    return c - _U64 if c >= 1 << 63 else c


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic): a fixed, well-spread odd key per input."""
    z = x + _signed(0x9E3779B97F4A7C15)
    z = (z ^ _srl(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _srl(z, 27)) * _signed(0x94D049BB133111EB)
    return (z ^ _srl(z, 31)) | 1


_keys: dict[torch.device, torch.Tensor] = {}
_keys_lock = threading.Lock()


def _column_keys(device: torch.device) -> torch.Tensor:
    with _keys_lock:
        if device not in _keys:
            host = _splitmix(torch.arange(_WORDS_PER_ROW, dtype=torch.int64) + _KEY_SEED)
            _keys[device] = host.to(device)
        return _keys[device]


def _row_keys(rows: torch.Tensor) -> torch.Tensor:
    return _splitmix(rows + _ROW_SEED)


def _mix_(w: torch.Tensor) -> torch.Tensor:
    """w ^ (w >>> 32), in place."""
    return w.bitwise_xor_(_srl(w, 32))


def byte_words(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the tensor's bytes as int64 words, the last one zero-padded; its byte length)."""
    raw = t.contiguous().view(-1).view(torch.uint8)
    nbytes = raw.numel()
    whole = nbytes // 8 * 8
    if whole == nbytes:
        return raw.view(torch.int64), nbytes
    tail = torch.zeros(8, dtype=torch.uint8, device=raw.device)
    tail[: nbytes - whole] = raw[whole:]
    return torch.cat([raw[:whole].view(torch.int64), tail.view(torch.int64)]), nbytes


def word_keys(index: torch.Tensor) -> torch.Tensor:
    """The odd 64-bit key of each word position in `index` (int64)."""
    cols = _column_keys(index.device).index_select(0, index & (_WORDS_PER_ROW - 1))
    return cols.mul_(_row_keys(index >> 16))


def word_delta(index: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> int:
    """What a digest gains when the int64 words at `index` change from `old` to `new` (mod 2**64)."""
    if index.numel() == 0:
        return 0
    diff = _mix_(new.clone()).sub_(_mix_(old.clone()))
    return int(diff.mul_(word_keys(index)).sum()) % _U64


def finish(total: int, nbytes: int) -> int:
    """Add the length term to a sum of word terms: the digest, an int in [0, 2**64)."""
    return (total + nbytes * _LEN_KEY) % _U64


def tensor_digest(t: torch.Tensor) -> int:
    """The digest of a tensor's bytes, computed on its device: an int in [0, 2**64)."""
    words, nbytes = byte_words(t)
    keys = _column_keys(words.device)
    n = words.numel()
    step = _ROWS_PER_STEP.get(words.device.type, 64) * _WORDS_PER_ROW
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    scratch = torch.empty(min(step, n), dtype=torch.int64, device=words.device)
    for start in range(0, n, step):
        chunk = words[start: start + step]
        m = scratch[: chunk.numel()]
        m.copy_(chunk)
        _mix_(m)
        rows = chunk.numel() // _WORDS_PER_ROW
        first_row = start // _WORDS_PER_ROW
        if rows:
            full = m[: rows * _WORDS_PER_ROW].view(rows, _WORDS_PER_ROW).mul_(keys).sum(1)
            row_ids = torch.arange(first_row, first_row + rows, dtype=torch.int64, device=words.device)
            total += full.mul_(_row_keys(row_ids)).sum()
        rest = m[rows * _WORDS_PER_ROW:]
        if rest.numel():
            last = torch.tensor([first_row + rows], dtype=torch.int64, device=words.device)
            total += rest.mul_(keys[: rest.numel()]).sum() * _row_keys(last)[0]
    return finish(int(total), nbytes)
