"""The delta codec (hwsync.delta), unit by unit: exact on bit patterns, the smallest code, checked results.

Every round trip runs twice: with the compiled host kernel (numba, where installed) and with torch ops
only (what a GPU or NPU baseline uses); both must give the same bytes.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hwsync.delta import (
    BITMAP,
    BLOCK,
    BLOCKS,
    DENSE,
    SAME,
    STEPS,
    DeltaEncoder,
    DeltaHeader,
    advance,
    apply_into,
    apply_to_copy,
    encode,
    native,
    payload_bytes,
    smallest_code,
    tensor_digest,
    to_engine_dtype,
    verify,
)
from hwsync.delta.patch import BaseMismatch

INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.bool]
SMALL = {"chunk_elems": 1 << 16, "span_elems": 1 << 17}  # several chunks and spans on small tensors


@pytest.fixture(params=["numba", "torch"])
def engine(request, monkeypatch):
    """The host engine under test: the compiled kernel, or torch ops alone (native switched off)."""
    if request.param == "numba":
        if native.kernel() is None:
            pytest.skip("numba is not installed here (pip install numba): only the torch path runs")
        # the codec uses the kernels as if loaded (a sync's codec waits for warm.start's thread to load them)
        monkeypatch.setattr(native, "ready", lambda: True)
    else:
        monkeypatch.setattr(native, "_get", lambda name: None)
    return request.param


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(INTS[t.element_size()])


def _random(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(n, generator=gen) < 0.5
    if not dtype.is_floating_point:
        return torch.randint(-100 if dtype == torch.int8 else 0, 100, (n,), generator=gen).to(dtype)
    return (torch.randn(n, generator=gen) * 10).to(dtype)


def _changed(base: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    """`base` with about `density` of its elements' bit patterns changed (a low bit flipped)."""
    new = base.clone()
    mask = torch.rand(base.shape, generator=gen) < density
    flat = _bits(new)
    flat[mask.view(-1)] ^= 1
    return new


def _far(base: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    """`base` with about `density` of its elements' bit patterns replaced by random ones (far from the old)."""
    new = base.clone()
    mask = (torch.rand(base.shape, generator=gen) < density).view(-1)
    flat = _bits(new)
    flat[mask] = torch.randint(-(1 << 15), 1 << 15, (int(mask.sum()),), generator=gen).to(flat.dtype) ^ 0x5A5A
    return new


def _step_units(new: torch.Tensor, base: torch.Tensor) -> int | None:
    """The step code's count for 2-byte elements, computed the plain way: a unit per change, a filler per 255
    elements of a longer step, a raw value per difference outside -127..127."""
    if base.element_size() != 2:
        return None
    a, b = _bits(to_engine_dtype(new, base.dtype)).to(torch.int32), _bits(base).to(torch.int32)
    pos = torch.nonzero(a != b).view(-1)
    distance = torch.diff(pos, prepend=torch.tensor([-1]))
    diff = a[pos] - b[pos]
    return int(pos.numel() + ((distance - 1) // 255).sum() + ((diff < -127) | (diff > 127)).sum())


def _round_trip(new: torch.Tensor, base: torch.Tensor, **encoder) -> DeltaHeader:
    """Encode with and without the baseline's digest, apply three ways, check everything; the header."""
    enc = DeltaEncoder(**encoder)
    first = None
    for base_digest in (tensor_digest(base), None):
        delta = enc.encode(new, base, base_digest=base_digest)
        header = DeltaHeader.from_wire(delta.header.to_wire())
        assert header == delta.header and delta.payload.numel() == header.nbytes
        assert header.digest == tensor_digest(to_engine_dtype(new, base.dtype))
        out = apply_to_copy(base, header, delta.payload)
        assert torch.equal(_bits(out), _bits(to_engine_dtype(new, base.dtype))) and verify(out, header)
        dest = base.clone()
        apply_into(dest, header, delta.payload)
        assert torch.equal(_bits(dest), _bits(out))
        if first is None:
            first = delta
        else:  # the digest path does not change the bytes
            assert torch.equal(first.payload, delta.payload) and first.header == delta.header
    assert first is not None
    return first.header


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("density", [0.0, 1e-4, 0.01, 0.1, 0.5, 1.0])
def test_round_trip_is_exact_and_picks_the_smallest_code(engine, dtype, density):
    gen = torch.Generator().manual_seed(hash((str(dtype), density)) % 2**31)
    base = _random(300_001, dtype, gen)
    new = _changed(base, density, gen)
    header = _round_trip(new, base, **SMALL)
    changed = int((_bits(new) != _bits(base)).sum())
    size = dtype.itemsize
    units = _step_units(new, base)
    assert header.code == smallest_code(base.numel(), changed, size, units)
    assert header.count == {DENSE: base.numel(), STEPS: units}.get(header.code, changed)
    chosen = payload_bytes(header.code, base.numel(), header.count, size)
    assert all(chosen <= payload_bytes(c, base.numel(), changed, size) for c in (DENSE, BLOCKS, BITMAP) if changed)
    assert size != 2 or not changed or chosen <= payload_bytes(STEPS, base.numel(), units, size)


def _steps_canonical(new: torch.Tensor, base: torch.Tensor, engine: str) -> None:
    """`new` against `base`: exact, the step code with the reference count of units, and (where compiled) the same
    bytes from both engines."""
    header = _round_trip(new, base, **SMALL)
    assert header.code == STEPS and header.count == _step_units(new, base)
    if engine == "numba":
        plain = DeltaEncoder(engine="torch", **SMALL).encode(new, base)
        compiled = DeltaEncoder(engine="numba", **SMALL).encode(new, base)
        assert compiled.header == plain.header and torch.equal(compiled.payload, plain.payload)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_step_code_at_its_edges(engine, dtype):
    """Steps of exactly 255, 256, 510 and 511 (fillers), a change at the first and the last element, across chunk
    ends (a long unchanged stretch over several), sign flips, NaN and -0.0 (escapes): exact, and the same bytes
    from both engines."""
    gen = torch.Generator().manual_seed(11)
    n = 5 * (1 << 16) + 77
    base = _random(n, dtype, gen)
    new = _changed(base, 0.03, gen)
    flat = _bits(new)
    flat[(1 << 16) - 300: 3 * (1 << 16) + 5] = _bits(base)[(1 << 16) - 300: 3 * (1 << 16) + 5]  # 2 chunks unchanged
    at = 4 * (1 << 16)
    flat[at: at + 2000] = _bits(base)[at: at + 2000]
    for p in (at, at + 255, at + 511, at + 1021, at + 1532):  # steps of 255, 256, 510, 511
        flat[p] ^= 1
    flat[0] ^= 1
    flat[n - 1] ^= 1
    new.view(-1)[[10, 20, 30, 40]] = torch.tensor([float("nan"), -0.0, 1e30, -1e30]).to(dtype)
    _steps_canonical(new, base, engine)


def test_the_step_code_ends_at_the_last_change(engine):
    """Changes in the first chunk only: the chunks after it (unchanged) add no fillers, so the code is as small as
    the changes make it, and both engines give the same bytes."""
    gen = torch.Generator().manual_seed(14)
    n = 5 * (1 << 16)
    base = _random(n, torch.bfloat16, gen)
    new = base.clone()
    _bits(new)[: 1 << 15: 30] += 1  # 3% of the first half chunk
    _steps_canonical(new, base, engine)


@pytest.mark.parametrize("piece", [3, 1], ids=["pieces of 3 chunks", "pieces of a chunk"])
@pytest.mark.parametrize("pattern", ["steps across the halves", "second half unchanged", "first half unchanged",
                                     "unchanged between changes", "escapes at the boundary", "dense"])
def test_a_tensor_scanned_in_pieces_on_two_threads_gives_the_bytes_of_one_scan(pattern, piece):
    """A large tensor's compiled scan runs in pieces on two threads (hwsync.delta.scan.join): the same header and
    payload as one scan and as the torch ops, whatever lies on either side of a boundary."""
    if native.kernel() is None:
        pytest.skip("the pieces are the compiled kernel's: numba is not installed")
    gen = torch.Generator().manual_seed(15)
    n = 6 * (1 << 16) + 123
    half = 3 * (1 << 16)  # where the halves meet (chunks of 65536)
    base = _random(n, torch.bfloat16, gen)
    new = _changed(base, 1.0 if pattern == "dense" else 0.02, gen)
    flat, old = _bits(new), _bits(base)
    if pattern == "steps across the halves":  # the last change 300 before the boundary, the next 10 after it
        flat[half - 300: half + 10] = old[half - 300: half + 10]
        flat[half - 301] ^= 1
        flat[half + 10] ^= 1
    elif pattern == "second half unchanged":
        flat[half - 1000:] = old[half - 1000:]
    elif pattern == "first half unchanged":
        flat[: half + 700] = old[: half + 700]
    elif pattern == "unchanged between changes":  # whole pieces without a change, then changes again
        flat[(1 << 16) - 5: half + (1 << 16) + 9] = old[(1 << 16) - 5: half + (1 << 16) + 9]
    elif pattern == "escapes at the boundary":
        new.view(-1)[half - 2: half + 2] = torch.tensor([float("nan"), -1e30, 1e30, -0.0]).to(torch.bfloat16)
    with ThreadPoolExecutor(1) as helper:
        split = DeltaEncoder(engine="numba", split_elems=2 * (1 << 16), piece_elems=piece * (1 << 16), **SMALL).encode(
            new, base, base_digest=tensor_digest(base), helper=helper)
    whole = DeltaEncoder(engine="numba", **SMALL).encode(new, base, base_digest=tensor_digest(base))  # one thread
    plain = DeltaEncoder(engine="torch", **SMALL).encode(new, base, base_digest=tensor_digest(base))
    assert split.header == whole.header == plain.header
    assert torch.equal(split.payload, whole.payload) and torch.equal(split.payload, plain.payload)
    assert split.header.code == ("dense" if pattern == "dense" else STEPS)
    assert torch.equal(_bits(apply_to_copy(base, split.header, split.payload)), flat)


def test_a_failed_piece_fails_the_encode_and_drops_the_helpers_queued_pieces(monkeypatch):
    """A scan in pieces that fails on the encode thread raises there, and the pieces queued for the helper are
    cancelled, not left to run after the encode has gone."""
    if native.kernel() is None:
        pytest.skip("the pieces are the compiled kernel's: numba is not installed")
    from hwsync.delta import diff

    gen = torch.Generator().manual_seed(16)
    base = _random(6 * (1 << 16), torch.bfloat16, gen)
    new = _changed(base, 0.02, gen)
    scan_range, helper_runs = DeltaEncoder._scan_range, []

    def failing(self, *args):
        if threading.current_thread() is threading.main_thread() and args[-2] == 1 << 16:
            raise RuntimeError("the second piece failed")
        return scan_range(self, *args)

    monkeypatch.setattr(DeltaEncoder, "_scan_range", failing)
    monkeypatch.setattr(diff, "_scan_piece", lambda *args: helper_runs.append(args[-2]))
    gate = threading.Event()
    with ThreadPoolExecutor(1) as helper:
        helper.submit(gate.wait, 10)  # the helper is busy: every piece waits in its queue
        with pytest.raises(RuntimeError, match="second piece failed"):
            DeltaEncoder(engine="numba", split_elems=2 * (1 << 16), piece_elems=1 << 16, **SMALL).encode(
                new, base, base_digest=tensor_digest(base), helper=helper)
        gate.set()
    assert helper_runs == []


@pytest.mark.parametrize("corrupt, message", [
    (lambda p, u: p[16:18].view(torch.int16).fill_(0x0300), "filler"),  # a filler with a difference
    (lambda p, u: p[:8].view(torch.int64).add_(1), "escape"),  # one escape more than raw values
    (lambda p, u: p[:8].view(torch.int64).fill_(u + 1), "escape"),  # more escapes than units
    (lambda p, u: p[16 + 2 * u - 2: 16 + 2 * u].view(torch.int16).fill_(0x00FF), "past"),  # the last 255 on
    (lambda p, u: p[8:16].view(torch.int64).add_(1), "not the delta's base"),  # the old values' terms
])
def test_a_corrupt_step_code_is_refused_before_any_write(engine, corrupt, message):
    gen = torch.Generator().manual_seed(12)
    base = _random(600, torch.bfloat16, gen)
    new = base.clone()
    _bits(new)[::20] += 1
    delta = encode(new, base)
    assert delta.header.code == STEPS
    payload = delta.payload.clone()
    corrupt(payload, delta.header.count)
    dest = base.clone()
    with pytest.raises(ValueError, match=message):
        apply_into(dest, delta.header, payload)
    assert torch.equal(dest, base)


def test_both_engines_give_the_same_bytes(monkeypatch):
    if native.kernel() is None:
        pytest.skip("numba is not installed here: there is one engine only")
    gen = torch.Generator().manual_seed(1)
    codes = set()
    for density, change in ((0.001, _changed), (0.02, _changed), (0.3, _changed), (0.3, _far)):
        base = _random(200_003, torch.bfloat16, gen)
        new = change(base, density, gen)
        master = new.float() + torch.randn(new.shape, generator=gen) * 1e-3
        for trainer in (new, master):
            compiled = DeltaEncoder(engine="numba").encode(trainer, base, base_digest=tensor_digest(base))
            plain = DeltaEncoder(engine="torch").encode(trainer, base, base_digest=tensor_digest(base))
            assert compiled.header == plain.header and torch.equal(compiled.payload, plain.payload)
            codes.add(compiled.header.code)
    # the compiled scan of 2-byte elements makes the step code; the block and bitmap codes are rebuilt from it
    assert {BLOCKS, BITMAP, STEPS} <= codes


def test_a_step_code_that_breaks_midway_puts_back_what_it_wrote(engine):
    """The compiled scatter checks a step code as it writes: a malformed unit after the first changes (a filler
    with a difference, a step past the end) fails the apply, and every value written before it, a difference's or
    an escape's raw value, is put back."""
    gen = torch.Generator().manual_seed(15)
    base = _random(4000, torch.bfloat16, gen)
    new = base.clone()
    _bits(new)[::10] += 1
    _bits(new)[5::40] ^= 0x4000  # far from the old value: escapes
    delta = encode(new, base)
    escapes = int(delta.payload[:8].view(torch.int64))
    assert delta.header.code == STEPS and escapes > 10
    units = delta.header.count - escapes
    for at, unit, message in ((units // 2, 0x0300, "filler"), (units - 1, 0x00FF, "past")):
        payload = delta.payload.clone()
        payload[16 + 2 * at: 18 + 2 * at].view(torch.int16).fill_(unit)
        dest = base.clone()
        with pytest.raises(ValueError, match=message):
            apply_into(dest, delta.header, payload, gain=True)
        assert torch.equal(_bits(dest), _bits(base))


@pytest.mark.parametrize("target", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_masters_cast_exactly_as_the_loaders_copy(engine, target):
    """vLLM's default loader stores `param.data.copy_(loaded_weight)`: the delta must hold the same bits."""
    gen = torch.Generator().manual_seed(2)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-45, 3.4e38, 65504.0,
                            65520.0, 1e-7, 2.0 ** -24, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8])
    nan_payloads = torch.tensor([0x7FC00001, 0x7F800001, 0xFFFFFFFF, 0x7FBFFFFF], dtype=torch.int64) \
        .to(torch.int32).view(torch.float32)
    master = torch.cat([torch.randn(200_000, generator=gen) * 3, special, nan_payloads])
    loaded = torch.empty(master.shape, dtype=target)
    loaded.copy_(master)  # what the engine's loader stores
    assert torch.equal(_bits(to_engine_dtype(master, target)), _bits(loaded))
    base = torch.empty(master.shape, dtype=target)
    base.copy_(master * 0.999)
    delta = DeltaEncoder(**SMALL).encode(master, base, base_digest=tensor_digest(base))
    assert torch.equal(_bits(apply_to_copy(base, delta.header, delta.payload)), _bits(loaded))
    assert delta.header.digest == tensor_digest(loaded)


def test_the_compiled_cast_gives_torchs_bits_and_hands_nans_to_torch():
    """The encode threads cast fp32 to bfloat16 in the compiled kernel: every non-NaN bit pattern as torch rounds it
    (ties to even, subnormals, overflow to inf, -0.0), and a chunk with a NaN is reported so torch casts it."""
    if native.cast_bf16() is None:
        pytest.skip("numba is not installed here, or its cast differs from this torch's: torch casts")
    cast = native.cast_bf16()
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(-(1 << 31), 1 << 31, (1 << 20,), dtype=torch.int64, generator=gen).to(torch.int32)
    ties = torch.arange(1 << 16, dtype=torch.int32) << 16 | 0x8000  # every upper half, exactly half-way
    for t in (bits, ties):
        t[(t & 0x7FFFFFFF) > 0x7F800000] &= -0x800000  # no NaN: each becomes an infinity of its sign
    for src in (bits, ties, bits[:7]):
        out = torch.empty(src.numel(), dtype=torch.bfloat16)
        assert not cast(src.numpy().view("uint32"), out.view(torch.int16).numpy().view("uint16"))
        assert torch.equal(out.view(torch.int16), src.view(torch.float32).to(torch.bfloat16).view(torch.int16))
    with_nan = bits.clone()
    with_nan[12345] = 0x7FC00001
    assert cast(with_nan.numpy().view("uint32"), torch.empty(with_nan.numel(), dtype=torch.int16).numpy())
    master = with_nan.view(torch.float32)  # through the encoder: the chunk with the NaN is cast by torch
    base = torch.zeros(master.numel(), dtype=torch.bfloat16)
    delta = DeltaEncoder(**SMALL).encode(master, base)
    assert torch.equal(_bits(apply_to_copy(base, delta.header, delta.payload)), _bits(to_engine_dtype(master,
                                                                                                     torch.bfloat16)))


def test_a_chunk_with_a_nan_goes_to_torchs_cast_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused scan reports a chunk with a NaN in it; that chunk is cast by torch straight away, not first by the
    compiled cast, which would read it again only to report the NaN once more."""
    kernel = native.cast_bf16()
    if kernel is None or native.scan16_cast() is None:
        pytest.skip("numba is not installed here, or its cast differs from this torch's: torch casts every chunk")
    calls: list[int] = []

    def counted(src: object, out: object) -> bool:
        calls.append(1)
        return bool(kernel(src, out))

    monkeypatch.setattr(native, "cast_bf16", lambda: counted)
    gen = torch.Generator().manual_seed(5)
    master = torch.randn(1 << 18, generator=gen)
    base = master.to(torch.bfloat16)
    master[::7] += 0.01
    master[70000] = float("nan")  # in the second chunk of four
    delta = DeltaEncoder(**SMALL).encode(master, base, base_digest=tensor_digest(base))
    assert calls == []
    assert torch.equal(_bits(apply_to_copy(base, delta.header, delta.payload)),
                       _bits(to_engine_dtype(master, torch.bfloat16)))


def test_an_encoder_makes_only_the_chunk_buffers_its_path_uses() -> None:
    """The torch path (a device's baseline, or no numba) and the compiled scan use different chunk buffers; each is
    made at its first use, so a device holds none that its path never touches."""
    base = torch.zeros(1 << 17, dtype=torch.bfloat16)
    new = base.float()
    new[::5] = 1.0
    paths = {"torch": ({"cast", "xor", "mask", "words"}, {"units", "raws", "offsets", "dirty"})}
    if native.scan16_cast() is not None:
        paths["numba"] = ({"units"}, {"xor", "mask", "words", "offsets", "dirty"})
    for engine, (made, not_made) in paths.items():
        encoder = DeltaEncoder(**SMALL, engine=engine)
        encoder.encode(new, base)
        held = set(vars(encoder._buffers(torch.bfloat16, torch.device("cpu"))))
        assert made <= held and not not_made & held, (engine, held)


# (exponent bits, mantissa width) of each float format: a NaN has every exponent bit and a non-zero mantissa
_NAN = {torch.bfloat16: (0x7F80, 7), torch.float16: (0x7C00, 10), torch.float32: (0x7F800000, 23),
        torch.float64: (0x7FF0000000000000, 52)}


@pytest.mark.parametrize("dtype", list(_NAN), ids=str)
def test_nan_payloads_signed_zeros_infinities_and_subnormals_come_through(engine, dtype):
    """Bit patterns that compare equal as floats (-0.0 == 0.0) or never (NaN) are still diffed exactly."""
    ints, (exponent, mantissa) = INTS[dtype.itemsize], _NAN[dtype]
    tiny = torch.finfo(dtype).tiny
    base = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), tiny / 4, -tiny / 2] * 2000, dtype=dtype)
    new = base.clone()
    sign = -(1 << (8 * dtype.itemsize - 1))  # the sign bit, as the signed integer of that width
    new.view(ints)[::3] ^= sign  # 0.0 <-> -0.0, inf <-> -inf, subnormals change sign
    payloads = torch.arange(1, 4001, dtype=torch.int64) % ((1 << mantissa) - 1) + 1
    new.view(ints)[1::3] = (payloads[: new[1::3].numel()] | exponent).to(ints)  # NaNs with distinct payloads
    new.view(ints)[2::6] = (payloads[: new[2::6].numel()] | exponent | sign).to(ints)  # negative NaNs
    assert _round_trip(new, base, **SMALL).count == int((_bits(new) != _bits(base)).sum())
    back = _round_trip(base, new, **SMALL)  # and from NaNs back to numbers
    assert back.count == int((_bits(new) != _bits(base)).sum())


def test_an_unchanged_tensor_costs_no_payload(engine):
    base = _random(100_000, torch.bfloat16, torch.Generator().manual_seed(3))
    delta = encode(base.clone(), base, base_digest=tensor_digest(base))
    assert delta.header.code == SAME and delta.payload.numel() == 0 and delta.header.nbytes == 0
    assert delta.header.digest == tensor_digest(base)
    dest = base.clone()
    apply_into(dest, delta.header, delta.payload)
    assert torch.equal(dest, base) and verify(dest, delta.header)


@pytest.mark.parametrize("n", [0, 1, 7, 65535, 65536, 65537, 2 * 65536 + 1])
def test_block_boundaries_empty_and_scalar_tensors(engine, n):
    gen = torch.Generator().manual_seed(n)
    base = _random(n, torch.bfloat16, gen)
    for where in ([0], [n - 1], [0, 65535 % max(n, 1), 65536 % max(n, 1), n - 1], list(range(0, n, 4096))):
        new = base.clone()
        for i in (w for w in where if 0 <= w < n):
            _bits(new)[i] ^= 0x10
        _round_trip(new, base, **SMALL)
    scalar = torch.tensor(1.5, dtype=torch.bfloat16)
    header = _round_trip(torch.tensor(2.5, dtype=torch.bfloat16), scalar)
    assert header.code == DENSE and header.numel == 1
    assert _round_trip(scalar.clone(), scalar).code == SAME


def test_block_code_at_a_block_with_every_element_changed(engine):
    """A block whose 65536 elements all changed (its count no longer fits a uint16) in a sparse tensor."""
    base = _random(40 * BLOCK, torch.float32, torch.Generator().manual_seed(4))  # 4-byte: no step code
    new = base.clone()
    _bits(new)[BLOCK: 2 * BLOCK] ^= 1
    assert _round_trip(new, base, **SMALL).code == BLOCKS


def test_a_wrong_base_is_caught_by_the_digest(engine):
    gen = torch.Generator().manual_seed(5)
    older = _random(100_000, torch.bfloat16, gen)
    base = _changed(older, 0.01, gen)
    new = _changed(base, 0.01, gen)
    delta = encode(new, base, base_digest=tensor_digest(base))
    try:
        wrong = apply_to_copy(older, delta.header, delta.payload)  # the receiver held the version before
    except BaseMismatch:  # the step code checks the values at its changes before it writes
        assert delta.header.code == STEPS
    else:
        assert not verify(wrong, delta.header)
    one_off = base.clone()
    untouched = int(torch.nonzero(_bits(new) == _bits(base))[0])
    _bits(one_off)[untouched] ^= 1  # a single element the delta does not touch
    assert not verify(apply_to_copy(one_off, delta.header, delta.payload), delta.header)
    assert verify(apply_to_copy(base, delta.header, delta.payload), delta.header)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8], ids=str)
def test_a_flipped_byte_in_the_destination_is_caught(engine, dtype):
    gen = torch.Generator().manual_seed(6)
    base = _random(70_001, dtype, gen)
    new = _changed(base, 0.01, gen)
    delta = encode(new, base, base_digest=tensor_digest(base))
    dest = base.clone()
    apply_into(dest, delta.header, delta.payload)
    raw = dest.view(-1).view(torch.uint8)
    for at in torch.randint(0, raw.numel(), (50,), generator=gen).tolist() + [0, raw.numel() - 1]:
        for bit in (0, 7):
            raw[at] ^= 1 << bit
            assert not verify(dest, delta.header), (at, bit)
            raw[at] ^= 1 << bit
    assert verify(dest, delta.header)


def test_the_compiled_digest_equals_the_torch_ops_digest(monkeypatch):
    if native.kernel() is None:
        pytest.skip("numba is not installed here: there is one digest path only")
    gen = torch.Generator().manual_seed(12)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in (0, 1, 3, 5, 8, 65536 * 4,
                                                                                       65536 * 4 + 3, 300_001)]
    tensors += [torch.randn(1000, 333, generator=gen).bfloat16(), torch.tensor(2.5), torch.randn(77).double()]
    compiled = [tensor_digest(t) for t in tensors]
    monkeypatch.setattr(native, "_get", lambda name: None)
    assert compiled == [tensor_digest(t) for t in tensors]


def test_the_digest_sees_what_an_xor_hash_misses():
    """Why not torch.hash_tensor: it XORs the elements, so a swap or two equal flips leave it unchanged."""
    t = torch.randn(4096).bfloat16()
    swapped = t.clone()
    swapped[[10, 20]] = t[[20, 10]]
    signs = t.clone()
    signs.view(torch.int16)[[3, 7]] ^= -0x8000  # two sign flips
    for other in (swapped, signs):
        assert torch.equal(torch.hash_tensor(other.view(torch.int16)), torch.hash_tensor(t.view(torch.int16)))
        assert tensor_digest(other) != tensor_digest(t)
    rows = t.view(64, 64).flip(0).contiguous()
    assert tensor_digest(rows) != tensor_digest(t)


def test_advance_writes_only_the_changes(engine):
    """The sender's baseline moves by scattering the changes: an element the delta does not name is not
    rewritten (a full copy would have restored it)."""
    gen = torch.Generator().manual_seed(7)
    base = _random(100_000, torch.bfloat16, gen)
    new = _changed(base, 0.001, gen)
    delta = encode(new, base, base_digest=tensor_digest(base))
    assert delta.header.code == BLOCKS
    marker = int(torch.nonzero(_bits(new) == _bits(base))[0])
    baseline = base.clone()
    _bits(baseline)[marker] ^= 0x7
    advance(baseline, delta.header, delta.payload)
    expected = new.clone()
    _bits(expected)[marker] ^= 0x7
    assert torch.equal(_bits(baseline), _bits(expected))


def test_dense_wins_early_and_carries_the_engine_dtype(engine):
    gen = torch.Generator().manual_seed(8)
    base = _random(300_000, torch.bfloat16, gen)
    master = base.float() * 1.01
    delta = DeltaEncoder(**SMALL).encode(master, base)
    assert delta.header.code == DENSE and delta.changed is None  # the scan stopped once dense had won
    assert delta.payload.numel() == base.numel() * 2
    assert torch.equal(delta.payload.view(torch.int16), _bits(to_engine_dtype(master, torch.bfloat16)))
    same = base.clone()
    _bits(same)[:] ^= 1
    delta = encode(same, base)
    assert delta.header.code == DENSE and delta.payload.data_ptr() == same.data_ptr()  # no copy


def test_destinations_that_are_views_or_unaligned_payloads(engine):
    gen = torch.Generator().manual_seed(9)
    base = _random(300 * 200, torch.float32, gen).view(300, 200)
    new = _changed(base, 0.05, gen)
    delta = encode(new, base)
    dest = base.t().contiguous().t()  # same values, column-major: not contiguous
    assert not dest.is_contiguous()
    apply_into(dest, delta.header, delta.payload)
    assert torch.equal(dest, new)
    carrier = torch.zeros(delta.payload.numel() + 3, dtype=torch.uint8)
    carrier[3:] = delta.payload  # as if it sat at an odd offset of a bucket
    assert torch.equal(apply_to_copy(base, delta.header, carrier[3:]), new)
    # a step code's sections (the host's compiled scatter reads them as numpy views) at an odd offset, one with
    # escapes (whole new values) among its units
    base16 = _random(70_000, torch.bfloat16, gen)
    new16 = _changed(base16, 0.02, gen)
    new16[::1000] = -new16[::1000]
    delta = encode(new16, base16)
    assert delta.header.code == STEPS and int(delta.payload[:8].view(torch.int64)) > 0  # escapes
    carrier = torch.zeros(delta.payload.numel() + 3, dtype=torch.uint8)
    carrier[3:] = delta.payload
    assert torch.equal(_bits(apply_to_copy(base16, delta.header, carrier[3:])), _bits(new16))


def test_malformed_headers_and_mismatched_payloads_are_refused():
    good = DeltaHeader(BLOCKS, "bfloat16", 100, 3, 5)
    assert DeltaHeader.from_wire(good.to_wire()) == good
    for wire in ([], ["zip", "bfloat16", 100, 3, 5], [BLOCKS, "complex128", 100, 3, 5], [BLOCKS, "bfloat16", -1, 0, 5],
                 [BLOCKS, "bfloat16", 100, 101, 5], [SAME, "bfloat16", 100, 1, 5], [DENSE, "bfloat16", 100, 3, 5],
                 [BLOCKS, "bfloat16", 100, 3, 1 << 64], [BLOCKS, "bfloat16", 100.0, 3, 5]):
        with pytest.raises(ValueError):
            DeltaHeader.from_wire(wire, name="w")
    base = torch.zeros(100, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="layer.0: the delta is for 100 elements of float16"):
        apply_into(base, DeltaHeader(DENSE, "float16", 100, 100, 0), torch.zeros(200, dtype=torch.uint8),
                   name="layer.0")
    with pytest.raises(ValueError, match="needs a flat uint8 payload of 200 bytes"):
        apply_into(base, DeltaHeader(DENSE, "bfloat16", 100, 100, 0), torch.zeros(199, dtype=torch.uint8))
    with pytest.raises(ValueError, match="a changed shape needs a full sync"):
        encode(torch.zeros(10), torch.zeros(11))


def test_corrupt_payloads_are_refused_before_a_wrong_write(engine):
    gen = torch.Generator().manual_seed(10)
    base = _random(70_000, torch.bfloat16, gen)
    delta = encode(_changed(base, 0.001, gen), base)
    counts = delta.payload.clone()
    counts[:4].view(torch.int32)[0] += 1
    with pytest.raises(ValueError, match="add up to"):
        apply_into(base.clone(), delta.header, counts)
    bitmap = encode(_far(base, 0.3, gen), base)
    assert bitmap.header.code == BITMAP
    tail = bitmap.payload.clone()
    tail[(70_000 // 8)] |= 0x80  # a bit past the last element
    with pytest.raises(ValueError, match="past the tensor"):
        apply_into(base.clone(), bitmap.header, tail)


def test_the_simulated_accelerator_runs_the_device_paths():
    """Apply, digest and encode on a non-host device (the sim): torch ops only, the same bytes."""
    if importlib.util.find_spec("hwsync_sim") is None:
        pytest.skip("the sim backend is not installed: pip install -e tests/plugins/hwsync_sim")
    from hwsync.backend.registry import load_backend

    device = load_backend("sim").device().torch_device()
    gen = torch.Generator().manual_seed(11)
    base = _random(150_001, torch.bfloat16, gen)
    for density in (0.001, 0.3, 1.0):
        new = _changed(base, density, gen)
        delta = encode(new, base, base_digest=tensor_digest(base))
        dest = base.to(device)
        apply_into(dest, delta.header, delta.payload)
        assert torch.equal(_bits(dest.cpu()), _bits(new)) and verify(dest, delta.header)
        on_device = DeltaEncoder(**SMALL).encode(new.to(device), base.to(device), base_digest=tensor_digest(base))
        assert on_device.header == delta.header and torch.equal(on_device.payload.cpu(), delta.payload)


def test_a_device_trainers_fp32_masters_against_a_host_baseline(engine):
    """A trainer tensor on a device (the sim), fp32 masters for a bfloat16 engine, a baseline in host memory: what a
    GPU trainer with delta_on_device=False sends. The compiled scan of 2-byte elements read the trainer's tensor as
    numpy (a TypeError on any device); it is cast onto the host chunk by chunk instead: the same bytes as from the
    host."""
    if importlib.util.find_spec("hwsync_sim") is None:
        pytest.skip("the sim backend is not installed: pip install -e tests/plugins/hwsync_sim")
    from hwsync.backend.registry import load_backend

    device = load_backend("sim").device().torch_device()
    gen = torch.Generator().manual_seed(12)
    base = _random(150_001, torch.bfloat16, gen)
    for density in (0.02, 1.0):
        master = _changed(base, density, gen).float() + torch.rand(base.shape, generator=gen) * 1e-3
        on_host = encode(master, base, base_digest=tensor_digest(base))
        from_device = encode(master.to(device), base, base_digest=tensor_digest(base))
        assert from_device.header == on_host.header and torch.equal(from_device.payload.cpu(), on_host.payload)


def _available_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


@pytest.mark.slow
def test_positions_past_two_to_the_31():
    """A tensor of more than 2**31 elements: positions are int64, the block code covers it."""
    n = (1 << 31) + BLOCK + 5
    if _available_bytes() < 3 * n:
        pytest.skip(f"needs {3 * n / 1e9:.1f} GB of free memory for two {n / 1e9:.1f} GB tensors")
    base = torch.zeros(n, dtype=torch.uint8)
    new = base.clone()
    where = torch.tensor([0, (1 << 31) - 1, 1 << 31, (1 << 31) + 1, n - 1])
    new[where] = 7
    delta = encode(new, base, base_digest=tensor_digest(base))
    assert delta.header.code == BLOCKS and delta.header.count == 5
    del new
    advance(base, delta.header, delta.payload)
    assert torch.equal(torch.nonzero(base).view(-1), where) and verify(base, delta.header)


def test_a_step_code_writes_nothing_on_a_copy_that_is_not_its_base(engine):
    """A difference is right only on the value it was taken from: a copy changed at a changed element (behind
    hwsync's back, or a delta applied twice) is refused before a write, where a block code's whole values would
    land and only the digest would tell."""
    gen = torch.Generator().manual_seed(13)
    base = _random(200_000, torch.bfloat16, gen)
    new = _changed(base, 0.02, gen)
    delta = DeltaEncoder(**SMALL).encode(new, base, base_digest=tensor_digest(base))
    assert delta.header.code == STEPS
    at = int(torch.nonzero(_bits(new) != _bits(base))[5])
    for wrong in (base.clone(), None):
        if wrong is None:  # the same delta again on its own result
            wrong = apply_to_copy(base, delta.header, delta.payload)
        else:
            _bits(wrong)[at] ^= 0x10
        before = wrong.clone()
        with pytest.raises(BaseMismatch, match="not the delta's base"):
            apply_into(wrong, delta.header, delta.payload, gain=True)
        assert torch.equal(_bits(wrong), _bits(before))


def test_warm_up_runs_the_kernels_of_every_dtype_once():
    """Senders and receivers load the kernels after a full sync in delta mode (hwsync.delta.warm): every width,
    floating or not, goes through encode and apply without error, and a second call does nothing."""
    from hwsync.delta import warm

    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.bool]
    warm.warm_up(dtypes)
    if native.kernel() is not None:
        assert set(dtypes) <= warm._warm
    warm.warm_up(dtypes)  # loaded: returns at once


def test_the_host_key_tables_are_kept_and_grow_for_a_larger_tensor(monkeypatch):
    from hwsync.delta import digest

    monkeypatch.setattr(digest, "_tables", {})  # the tables as a fresh process has them (other tests grow them)
    monkeypatch.setattr(digest, "_host", None)
    small = digest.host_keys(1 << 20)
    assert digest.host_keys(1 << 10) is small  # kept: not fetched again per tensor
    huge = 1 << 40  # bytes of a tensor past the row table's first size (1024 rows of 65536 lanes)
    cols, rows = digest.host_keys(huge)
    assert rows.size >= ((huge + 3) // 4 >> 16) + 1 > small[1].size
    cpu = torch.device("cpu")
    assert (cols == digest.key_table("col", cpu, 1 << 16).numpy()).all()
    assert (rows[: small[1].size] == small[1]).all()  # the same keys, more of them
    assert digest.host_keys(1 << 20)[1] is rows  # the larger pair serves the small tensors after it
