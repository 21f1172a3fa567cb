"""Memory report over real ranks (spawned processes, gloo), balance checks and bucket sizing."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from hwsync.errors import HwsyncError
from hwsync.backend.memory import (
    GiB,
    MiB,
    MemoryImbalanceError,
    MemoryReport,
    RankMemory,
    check_balance,
    choose_bucket_bytes,
    memory_report,
)

WORLD = 4
HEAVY_RANK = 2
HEAVY_BYTES = 2 * GiB


def _rank_main(rank: int, port: int, out: str) -> None:
    """One rank: report, let HEAVY_RANK allocate and touch 2 GiB, report again, check balance."""
    import torch

    from hwsync.backend.registry import load_backend

    backend = load_backend("cpu")
    device = backend.device()
    comm = backend.communicator(f"tcp://127.0.0.1:{port}", rank, WORLD, timeout_s=120)
    try:
        before = memory_report(comm, device)
        heavy = torch.ones(HEAVY_BYTES // 4) if rank == HEAVY_RANK else None  # ones() touches every page
        comm.barrier()  # every rank reads its figures after the allocation exists
        after = memory_report(comm, device)
        own_rss = device.memory_allocated()
        result = check_balance(after, 0.5, "warn", field="allocated")
        try:
            check_balance(after, 0.5, "raise", field="allocated")
            raised = None
        except MemoryImbalanceError as exc:
            raised = str(exc)
        record = {"before": before.to_dict(), "after": after.to_dict(), "own_rss": own_rss,
                  "result": result.to_dict(), "raised": raised, "table": after.table()}
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
        comm.barrier()  # keep the allocation alive until every rank has reported
        del heavy
    finally:
        comm.destroy()


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path_factory.mktemp("memory")
    mp.spawn(_rank_main, args=(port, str(out)), nprocs=WORLD, join=True)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_report_over_four_ranks_is_the_same_everywhere(four_ranks):
    reports = [MemoryReport.from_dict(r["after"]) for r in four_ranks]
    assert all(rep == reports[0] for rep in reports), "all_gather must give every rank the same report"
    report = reports[0]
    assert report.device_type == "cpu"
    assert [r.rank for r in report.ranks] == list(range(WORLD))
    for rank, record in zip(report.ranks, four_ranks):
        # Each row is that rank's own reading, gathered, not a copy of someone else's.
        assert abs(rank.allocated - record["own_rss"]) < 64 * MiB
        assert 0 < rank.free <= rank.total
        assert rank.reserved >= rank.allocated
    # On the cpu backend free is the host's MemAvailable: one figure for the whole host.
    assert len({r.total for r in report.ranks}) == 1
    assert max(report.values("free")) - min(report.values("free")) < 512 * MiB
    assert "allocated" in report.table() and len(report.table().splitlines()) == WORLD + 1


def test_heavy_rank_is_named_with_its_numbers(four_ranks):
    before = MemoryReport.from_dict(four_ranks[0]["before"])
    after = MemoryReport.from_dict(four_ranks[0]["after"])
    grew = [a.allocated - b.allocated for a, b in zip(after.ranks, before.ranks)]
    assert grew[HEAVY_RANK] >= HEAVY_BYTES - 64 * MiB
    assert all(g < 256 * MiB for r, g in enumerate(grew) if r != HEAVY_RANK)

    result = four_ranks[0]["result"]
    assert not result["balanced"]
    assert [o["rank"] for o in result["outliers"]] == [HEAVY_RANK]
    outlier = result["outliers"][0]
    assert outlier["value"] == after.ranks[HEAVY_RANK].allocated
    assert outlier["deviation"] >= HEAVY_BYTES - 256 * MiB
    heavy_gib = f"{after.ranks[HEAVY_RANK].allocated / GiB:.2f} GiB"
    for record in four_ranks:
        assert f"rank {HEAVY_RANK} has {heavy_gib} allocated" in record["raised"]
        assert "offloaded" in record["raised"] and "mode='warn'" in record["raised"]
        assert "rank 0 " not in record["raised"] and "rank 1 " not in record["raised"]


def test_real_report_sizes_buckets(four_ranks):
    report = MemoryReport.from_dict(four_ranks[0]["after"])
    choice = choose_bucket_bytes(report, num_buffers=2)
    assert choice.bucket_bytes % MiB == 0 and 16 * MiB <= choice.bucket_bytes <= GiB
    assert choice.min_free == min(report.values("free"))


SIM_HEAVY_BYTES = 512 * MiB


def _sim_rank_main(rank: int, port: int, out: str) -> None:
    """One rank on its own simulated device: HEAVY_RANK allocates device memory, every rank reports."""
    import os

    import torch

    os.environ["HWSYNC_SIM_DEVICE"] = str(rank)  # before the sim starts here: the launcher's set_device(rank)
    from hwsync.backend.registry import load_backend

    backend = load_backend("sim")
    device = backend.device()
    comm = backend.communicator(f"tcp://127.0.0.1:{port}", rank, WORLD, timeout_s=120)
    try:
        before = memory_report(comm, device)
        heavy = torch.empty(SIM_HEAVY_BYTES, dtype=torch.uint8, device=device.torch_device()) \
            if rank == HEAVY_RANK else None
        comm.barrier()  # every rank reads its figures after the allocation exists
        after = memory_report(comm, device)
        result = check_balance(after, 0.01, "warn", field="free")
        Path(out, f"rank{rank}.json").write_text(json.dumps({"before": before.to_dict(), "after": after.to_dict(),
                                                              "result": result.to_dict()}))
        comm.barrier()
        del heavy
    finally:
        comm.destroy()


def test_report_over_four_ranks_on_their_own_simulated_devices(tmp_path):
    """Each rank reads its own device's figures (the sim counts every process on a device), gathered over
    simccl; the rank that holds device memory is the one named."""
    pytest.importorskip("hwsync_sim", reason="the sim backend is not installed: pip install -e tests/plugins/hwsync_sim")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_sim_rank_main, args=(port, str(tmp_path)), nprocs=WORLD, join=True)
    records = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(WORLD)]
    after = MemoryReport.from_dict(records[0]["after"])
    before = MemoryReport.from_dict(records[0]["before"])
    assert all(MemoryReport.from_dict(r["after"]) == after for r in records)
    assert after.device_type == "sim" and [r.rank for r in after.ranks] == list(range(WORLD))
    grew = [a.allocated - b.allocated for a, b in zip(after.ranks, before.ranks)]
    assert grew[HEAVY_RANK] >= SIM_HEAVY_BYTES and all(g < MiB for r, g in enumerate(grew) if r != HEAVY_RANK)
    dropped = [b.free - a.free for a, b in zip(after.ranks, before.ranks)]
    assert dropped[HEAVY_RANK] >= SIM_HEAVY_BYTES, "free memory is the device's, as the driver reports it"
    assert [o["rank"] for o in records[0]["result"]["outliers"]] == [HEAVY_RANK]


def test_single_process_report_without_a_communicator(monkeypatch):
    monkeypatch.setenv("HWSYNC_BACKEND", "cpu")
    from hwsync.backend.registry import reset_backend_cache

    reset_backend_cache()
    report = memory_report(None)
    reset_backend_cache()
    assert len(report.ranks) == 1 and report.ranks[0].rank == 0 and report.ranks[0].free > 0


def _report(free_gib: list[float], allocated_gib: list[float] | None = None, total_gib: float = 80) -> MemoryReport:
    allocated_gib = allocated_gib or [0.0] * len(free_gib)
    return MemoryReport("cuda", tuple(
        RankMemory(r, int(f * GiB), int(total_gib * GiB), int(a * GiB), int(a * GiB))
        for r, (f, a) in enumerate(zip(free_gib, allocated_gib))
    ))


def test_balanced_report_passes_silently(caplog):
    with caplog.at_level(logging.WARNING, "hwsync"):
        result = check_balance(_report([40, 40.5, 39.8, 40.2]), 0.05, "raise")
    assert result.balanced and result.outliers == () and not caplog.records


def test_low_rank_is_named_and_warned(caplog):
    with caplog.at_level(logging.WARNING, "hwsync"):
        result = check_balance(_report([40, 40, 22, 40]), 0.10)
    assert not result.balanced
    assert [(o.rank, o.value, o.deviation) for o in result.outliers] == [(2, 22 * GiB, -18 * GiB)]
    assert result.median == 40 * GiB
    assert "rank 2 has 22.00 GiB free (-18.00 GiB vs the median)" in result.message
    assert "loaded the model at different times" in result.message
    assert caplog.records and "rank 2" in caplog.records[0].getMessage()


def test_median_names_the_odd_rank_in_either_direction():
    result = check_balance(_report([20, 20, 20, 35]), 0.10)
    assert [o.rank for o in result.outliers] == [3] and result.outliers[0].deviation == 15 * GiB


def test_raise_mode_raises_a_hwsync_error():
    with pytest.raises(MemoryImbalanceError, match=r"rank 1 has 10.00 GiB free") as info:
        check_balance(_report([40, 10, 40]), 0.10, "raise")
    assert isinstance(info.value, HwsyncError)


def test_min_gap_ignores_noise_on_small_figures():
    report = _report([40, 40, 40], allocated_gib=[0.01, 0.05, 0.02])
    assert check_balance(report, 0.10, field="allocated").balanced
    assert not check_balance(report, 0.10, field="allocated", min_gap_bytes=0).balanced


def test_check_balance_rejects_bad_arguments():
    with pytest.raises(ValueError, match="'warn' or 'raise'"):
        check_balance(_report([1, 1]), 0.1, "abort")
    with pytest.raises(ValueError, match="not one of"):
        check_balance(_report([1, 1]), 0.1, field="used")


def test_bucket_from_the_least_free_rank():
    choice = choose_bucket_bytes(_report([40, 3, 40]), num_buffers=2, fraction=0.2)
    # 20% of 3 GiB over two buffers is 307.2 MiB, aligned down to 307 MiB.
    assert choice.bucket_bytes == 307 * MiB and choice.limiting_rank == 1 and choice.min_free == 3 * GiB
    assert "rank 1 has the least free memory (3.00 GiB)" in choice.reason


def test_bucket_is_capped_and_floored():
    assert choose_bucket_bytes(_report([80, 80]), 2, cap=512 * MiB).bucket_bytes == 512 * MiB
    tight = choose_bucket_bytes(_report([0.1, 40]), 2, floor=32 * MiB)
    assert tight.bucket_bytes == 32 * MiB and "floor" in tight.reason


def test_bucket_refused_when_even_the_floor_does_not_fit():
    with pytest.raises(HwsyncError, match="rank 0 has only 0.03 GiB free"):
        choose_bucket_bytes(_report([0.03, 40]), 2, floor=32 * MiB)


def test_bucket_alignment_and_arguments():
    choice = choose_bucket_bytes(_report([10.001]), 3, fraction=0.5, align=4 * MiB)
    assert choice.bucket_bytes % (4 * MiB) == 0
    for kwargs in (dict(num_buffers=0), dict(fraction=0), dict(fraction=1.5), dict(align=3),
                   dict(floor=2 * GiB, cap=GiB)):
        with pytest.raises(ValueError):
            choose_bucket_bytes(_report([10]), **kwargs)


def test_report_round_trips_through_a_dict():
    report = _report([1, 2], [0.5, 0.25])
    assert MemoryReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    assert report.min_free.rank == 0



def test_rows_from_elsewhere_are_joined_and_renumbered():
    from dataclasses import asdict

    local = RankMemory(0, 5 * GiB, 80 * GiB, 1, 1)
    peer = {**asdict(RankMemory(0, 2 * GiB, 80 * GiB, 3, 3)), "extra": "ignored"}
    report = MemoryReport.from_rows("cuda", [local, peer])
    assert [r.rank for r in report.ranks] == [0, 1] and report.min_free.rank == 1
    assert choose_bucket_bytes(report).limiting_rank == 1
