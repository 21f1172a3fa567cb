"""hwsync's HCCL groups join exactly hwsync's peers, whatever RANK_TABLE_FILE and ROOTINFO_SUBCOMM_ENABLE say.

HCCL cannot run here. Two stand-ins (tests/npu_hccl_standin.py): libhccl.so's C functions as ctypes
callbacks with hccl.h's prototypes, forming communicators by root info; and torch_npu 2.10.0.post4's
ProcessGroupHCCL reduced to its choice of peers, ported from its createHCCLCommEx / createHCCLCommOrigin /
createHCCLCommSub. The process already has a default HCCL world (a trainer's or vLLM's, made as
init_process_group makes it: no global ranks listed), as every hwsync process on Ascend does. A group of
two ranks (threads here) is built through the core's ProcessGroupCommunicator with the NPU backend's
factory, over a real TCPStore, and broadcasts from rank 0. Before hwsync made its communicators itself
(hccl.py), its ProcessGroupHCCL listed global ranks [0, 1] and, with either variable set, was derived
from the process's own world: the stand-in names those wrong peers.
"""

from __future__ import annotations

import ctypes
import socket
import threading
import types
from typing import Any

import npu_hccl_standin
import pytest
import torch
import torch.distributed as dist

from hwsync.backend.communicator import ProcessGroupCommunicator
from hwsync_npu import hccl


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Stream:
    npu_stream = 0x5EED


@pytest.fixture
def fabric(monkeypatch: pytest.MonkeyPatch) -> npu_hccl_standin.StandInHccl:
    """The stand-in libhccl.so and torch_npu binding, and a default HCCL world already in the process."""
    library = npu_hccl_standin.StandInHccl()
    if hasattr(hccl, "HcclLibrary"):  # (hwsync before it made its communicators itself had no HCCL library)
        monkeypatch.setattr(hccl.HcclLibrary, "load", classmethod(lambda cls: cls(library)))
    npu = types.SimpleNamespace(current_stream=lambda device=None: _Stream(),
                                Event=lambda: types.SimpleNamespace(record=lambda stream=None: None,
                                                                    query=lambda: True))
    binding = types.SimpleNamespace(ProcessGroupHCCL=npu_hccl_standin.StandInProcessGroupHCCL)
    monkeypatch.setattr(hccl, "import_torch_npu", lambda: types.SimpleNamespace(npu=npu), raising=False)
    # the binding torch_npu's own groups come from, for any code that still builds them
    real_import = __import__("importlib").import_module
    monkeypatch.setattr("importlib.import_module",
                        lambda name, *a: binding if name == "torch_npu._C._distributed_c10d" else real_import(name, *a))
    npu_hccl_standin.StandInProcessGroupHCCL.built = []
    npu_hccl_standin.StandInProcessGroupHCCL(dist.HashStore(), 3, 8, npu_hccl_standin.Options(), world="trainer")
    monkeypatch.delenv("RANK_TABLE_FILE", raising=False)
    monkeypatch.delenv("ROOTINFO_SUBCOMM_ENABLE", raising=False)
    monkeypatch.delenv("HWSYNC_HCCL_BUFFSIZE_MB", raising=False)
    yield library
    npu_hccl_standin.StandInProcessGroupHCCL.global_ = None


def _broadcast_group(payload: torch.Tensor) -> list[Any]:
    """Two ranks build one group through ProcessGroupCommunicator and broadcast `payload` from rank 0; each rank's
    received bytes (or its error)."""
    init = f"tcp://127.0.0.1:{_free_port()}"
    out: list[Any] = [None, None]

    def rank_main(rank: int) -> None:
        try:
            comm = ProcessGroupCommunicator("hccl", hccl.hccl_group, init, rank, 2, torch.device("cpu"),
                                            hccl.HCCL_REDUCE_DTYPES_A2_A3, 30.0)
            try:
                tensor = payload.clone() if rank == 0 else torch.zeros_like(payload)
                comm.broadcast(tensor, src=0)
                gathered = comm.all_gather(torch.tensor([rank * 10 + 1], dtype=torch.int32))
                total = torch.tensor([rank + 1.5], dtype=torch.float32)
                comm.all_reduce(total, "sum")
                out[rank] = (tensor, [int(g) for g in gathered], float(total))
            finally:
                comm.destroy()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("env", ["neither", "RANK_TABLE_FILE", "ROOTINFO_SUBCOMM_ENABLE"])
def test_the_group_joins_its_own_peers_in_every_environment(fabric, monkeypatch, tmp_path, env):
    if env == "RANK_TABLE_FILE":
        ranktable = tmp_path / "ranktable.json"
        ranktable.write_text('{"status": "completed", "server_list": []}')
        monkeypatch.setenv("RANK_TABLE_FILE", str(ranktable))
    elif env == "ROOTINFO_SUBCOMM_ENABLE":
        monkeypatch.setenv("ROOTINFO_SUBCOMM_ENABLE", "1")
    payload = torch.arange(1000, dtype=torch.float32)
    results = _broadcast_group(payload)
    for rank, result in enumerate(results):
        assert not isinstance(result, Exception), f"rank {rank}: {result}"
        tensor, gathered, total = result
        assert torch.equal(tensor, payload) and gathered == [1, 11] and total == 4.0
    (comm,) = fabric.comms()
    assert comm.size == 2 and sorted(comm.ranks.values()) == [0, 1], "one communicator of exactly the group's ranks"
    assert [c for c in npu_hccl_standin.StandInProcessGroupHCCL.built if c.world != "trainer"] == [], \
        "a torch_npu ProcessGroupHCCL, whose peers RANK_TABLE_FILE / ROOTINFO_SUBCOMM_ENABLE decide"


def test_the_communicator_carries_its_hccl_buffer_size(fabric, monkeypatch):
    monkeypatch.setenv(hccl.BUFFSIZE_ENV, "32")
    results = _broadcast_group(torch.ones(10))
    assert not any(isinstance(r, Exception) for r in results), results
    (comm,) = fabric.comms()
    assert comm.buffer_mb == 32
    assert ("HcclCommInitRootInfoConfig", 0) in fabric.calls and ("HcclCommInitRootInfo", 0) not in fabric.calls


def test_the_default_buffer_is_hwsyncs_and_an_hccl_without_configs_gets_hccls(fabric, monkeypatch):
    results = _broadcast_group(torch.ones(10))
    assert not any(isinstance(r, Exception) for r in results), results
    assert fabric.comms()[0].buffer_mb == hccl.DEFAULT_BUFFSIZE_MB
    fabric.capability = 0  # a CANN whose communicators take no buffer size
    results = _broadcast_group(torch.ones(10))
    assert not any(isinstance(r, Exception) for r in results), results
    assert fabric.comms()[1].buffer_mb is None and ("HcclCommInitRootInfo", 1) in fabric.calls
    assert "MB per hwsync HCCL communicator" in hccl.buffer_note()


def test_a_bad_buffer_setting_names_the_variable():
    with pytest.raises(ValueError, match=hccl.BUFFSIZE_ENV):
        hccl.hccl_buffer_mb({hccl.BUFFSIZE_ENV: "lots"})
    assert hccl.hccl_buffer_mb({}) == hccl.DEFAULT_BUFFSIZE_MB


def test_the_config_is_laid_out_as_hccl_reads_it():
    # HcclCommConfig's header (size_t size, uint32 magic word, uint32 version, uint64 reserved: 24 bytes), then the
    # buffer size and determinism: CANN's hccl_types.h, version 1
    assert ctypes.sizeof(hccl.CommConfig) == 32 and hccl.CommConfig.buffer_size_mb.offset == 24
    config = hccl.CommConfig.with_buffer(64)
    assert (config.size, config.magic_word, config.version, config.buffer_size_mb) == (32, 0xF0F0F0F0, 1, 64)
    assert ctypes.sizeof(hccl.RootInfo) == 4108


def test_the_stand_in_binding_derives_from_the_processs_world_as_torch_npu_does(fabric, monkeypatch, tmp_path):
    # the ported branch logic itself: a group listing global ranks [0, 1], as hwsync's did
    options = npu_hccl_standin.Options()
    options.global_ranks_in_group, options.group_id = [0, 1], "hwsync-x"
    group = npu_hccl_standin.StandInProcessGroupHCCL(dist.HashStore(), 0, 2, options)
    assert group.peers().startswith("its own group")
    monkeypatch.setenv("ROOTINFO_SUBCOMM_ENABLE", "1")
    assert group.peers() == "ranks [0, 1] of the process's own world 'trainer'"
    monkeypatch.delenv("ROOTINFO_SUBCOMM_ENABLE")
    ranktable = tmp_path / "ranktable.json"
    ranktable.write_text("{}")
    monkeypatch.setenv("RANK_TABLE_FILE", str(ranktable))
    assert group.peers() == "ranks [0, 1] of the process's own world 'trainer'"
    empty = npu_hccl_standin.Options()  # an empty list instead: the group becomes the ranktable's world
    assert npu_hccl_standin.StandInProcessGroupHCCL(dist.HashStore(), 0, 2, empty).peers().startswith(
        "the ranktable's world")
