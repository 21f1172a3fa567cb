"""Host memmoves in batches (hwsync.sync.host_copy): the compiled loop and the ctypes calls copy the same bytes.

A replay's copies run as one of the two, whichever is loaded when it runs, so any batch of copies must leave the
same bytes either way: random batches of moves in and out of a buffer, overlapping ones too (memmove semantics),
compared with a reference that copies in Python. The compiled loop needs numba (vLLM's dependency); without it those
cases skip with the reason.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hwsync.sync import host_copy
from hwsync.sync.host_copy import Moves

SIZE = 4096
HAS_NUMBA = importlib.util.find_spec("numba") is not None


@pytest.fixture(scope="module")
def kernel():
    """The compiled loop, loaded (the test fails if it does not load where numba is installed)."""
    if not HAS_NUMBA:
        pytest.skip("numba is not installed here: copies run as ctypes calls only")
    assert host_copy.wait(120), "numba is installed, but the compiled copy loop did not load (see the log)"
    return host_copy._kernel


def _reference(buf: bytearray, rows: list[tuple[int, int, int]], base: int, into: bool) -> None:
    """What memmove does for each row, in order, on offsets into `buf` (rows hold offsets, not addresses)."""
    for address, offset, nbytes in rows:
        dst, src = (base + offset, address) if into else (address, base + offset)
        buf[dst:dst + nbytes] = bytes(buf[src:src + nbytes])


rows_strategy = st.lists(st.tuples(st.integers(0, SIZE // 2 - 1), st.integers(0, SIZE // 4 - 1),
                                   st.integers(0, SIZE // 4)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(rows=rows_strategy, base=st.integers(0, SIZE // 4), into=st.booleans(), compiled=st.booleans())
def test_a_batch_of_moves_copies_what_memmove_copies_row_by_row(kernel, rows, base, into, compiled):
    start = torch.randint(0, 256, (SIZE,), dtype=torch.uint8)
    buf = start.clone()
    at = buf.data_ptr()
    moves = Moves([(at + address, offset, nbytes) for address, offset, nbytes in rows])
    saved, host_copy._kernel = host_copy._kernel, (kernel if compiled else None)
    try:
        moves.move_in(at + base) if into else moves.move_out(at + base)
    finally:
        host_copy._kernel = saved
    expected = bytearray(start.numpy().tobytes())
    _reference(expected, rows, base, into)
    assert buf.numpy().tobytes() == bytes(expected)


def test_a_small_plan_never_loads_numba(monkeypatch):
    monkeypatch.setattr(host_copy, "_loader", None)
    host_copy.warm(host_copy.COMPILED_FROM - 1)
    assert host_copy._loader is None
    monkeypatch.setenv("HWSYNC_NUMBA_COPIES", "0")
    host_copy.warm(10 * host_copy.COMPILED_FROM)
    assert host_copy._loader is None
