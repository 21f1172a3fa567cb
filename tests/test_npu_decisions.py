"""Unit tests of the NPU backend's own decisions, fed with what real Ascend machines produce.

Sources of the quoted strings:
[drv-a] /usr/local/Ascend/driver/version.info from a CANN troubleshooting note (PyPTO docs):
        "Version=25.3.rc1 ... package_version=25.3.rc1"
[drv-b] a MindIE 2.0 image's version notes: "Version=24.1.rc2.2 ... package_version=24.1.rc2.2"
[drv-c] a user report on openEuler 22.03: "Version=25.0.rc1.1"
[cann]  torch_npu/csrc/core/npu/GetCANNInfo.h (Ascend/pytorch): "support version format: a.b.c,
        a.b.RCd, a.b.Tg, a.b.RCd.alphaf"; torch_npu docs for get_cann_version return '8.3.RC1';
        an A3 machine's notes: "ascend_toolkit_install.info: version=9.0.0"
[ipc]   torch_npu IPC guide (内存共享(IPC)): "仅支持在Ascend HDK 25.3.RC1及以上且CANN 8.3.RC1及以上版本使用"
[soc]   vllm-ascend / HCCL sources: "Ascend910B1".."Ascend910B4-1", "Ascend910_9391".., "Ascend310P3"
[vis]   torch_npu/npu/__init__.py `_parse_visible_devices` and vllm-ascend examples
        "ASCEND_RT_VISIBLE_DEVICES=0,1,2,3", "ASCEND_RT_VISIBLE_DEVICES=2,3"
"""

from __future__ import annotations

import logging
import os

import msgpack
import pytest
import torch

from hwsync_npu import preimport
from hwsync_npu.device import logical_index, parse_visible_devices, physical_index
from hwsync_npu.hccl import (HCCL_REDUCE_DTYPES_310P, HCCL_REDUCE_DTYPES_A2_A3, HCCL_REDUCE_DTYPES_ANY,
                             HCCL_REDUCE_DTYPES_TRAINING, hccl_reduce_dtypes)
from hwsync_npu.ipc import NpuIpcTransport, ensure_msgpack_safe, share_record
from hwsync_npu.versions import (cann_install_info_paths, cann_version_from_install_info, decide_ipc,
                                 driver_version_from_info, parse_version)

DRIVER_INFO_25_3 = """Version=25.3.rc1
ascendhal_version=7.35.23
aicpu_version=1.0
tdt_version=1.0
log_version=1.0
prof_version=2.0
dvppkernels_version=1.1
tsfw_version=1.0
Innerversion=V100R001C23SPC002B212
compatible_version=[V100R001C19],[V100R001C20],[V100R001C21],[V100R001C22],[V100R001C23]
compatible_version_fw=[7.0.0,8.9.9]
package_version=25.3.rc1
"""  # [drv-a]
DRIVER_INFO_24_1 = "Version=24.1.rc2.2\nascendhal_version=7.35.23\npackage_version=24.1.rc2.2\n"  # [drv-b]
DRIVER_INFO_OLD = "Version=24.1.rc1\nascendhal_version=7.35.19\naicpu_version=1.0\n"  # no package_version line


# --- versions ---------------------------------------------------------------------------------

@pytest.mark.parametrize("older,newer", [
    ("8.3.RC1", "8.3.RC2"), ("8.3.RC2", "8.5.0"), ("8.3.RC1.alpha003", "8.3.RC1"), ("8.0.T63", "8.0.RC1"),
    ("8.5.0", "9.0.0"), ("25.0.rc1", "25.0.rc1.1"), ("24.1.rc2.2", "25.3.rc1"), ("25.3.rc1", "25.3.RC1.2"),
    ("25.3.RC1", "25.5.0"), ("25.5.0", "26.0.rc1"), ("8.3.RC1.beta1", "8.3.RC1"),
    ("25.5.t3.b001", "25.5.t3.b002"), ("25.3.RC1", "25.5.t3.b001"), ("25.5.t3.b001", "25.5.rc1"),
])
def test_versions_order_like_ascend_releases(older: str, newer: str) -> None:
    assert parse_version(older) < parse_version(newer)


def test_rc_case_does_not_matter() -> None:
    # the driver writes "25.3.rc1" [drv-a]; docs and the IPC guide write "25.3.RC1" [ipc]
    assert parse_version("25.3.rc1") == parse_version("25.3.RC1")


def test_driver_build_tags_parse() -> None:
    # bug 9: internal driver builds carry a build tag ("25.5.t3.b001"), which used to parse to None
    version = parse_version("25.5.t3.b001")
    assert version is not None and (version.major, version.minor, version.number, version.build) == (25, 5, 3, 1)
    assert parse_version("25.5.T3.B001") == version


@pytest.mark.parametrize("text", ["", "8", "8.3", "CANN-8.3", "8.x.RC1", "8.3.RCx", "8.3.RC1.gamma1", "7.6.T13.0.B094:8.0.T63"])
def test_unknown_formats_are_not_guessed(text: str) -> None:
    assert parse_version(text) is None


def test_driver_version_from_real_version_info() -> None:
    assert driver_version_from_info(DRIVER_INFO_25_3) == "25.3.rc1"
    assert driver_version_from_info(DRIVER_INFO_24_1) == "24.1.rc2.2"
    assert driver_version_from_info(DRIVER_INFO_OLD) == "24.1.rc1"  # falls back to Version=
    assert driver_version_from_info("ascendhal_version=7.35.23\n") is None


def test_cann_version_from_install_info() -> None:
    assert cann_version_from_install_info("package_name=Ascend-cann-toolkit\nversion=9.0.0\n") == "9.0.0"  # [cann]
    assert cann_version_from_install_info("version=8.3.RC1\ninnerversion=V100R001C23\n") == "8.3.RC1"


def test_install_info_paths_prefer_the_sourced_toolkit() -> None:
    paths = cann_install_info_paths({"ASCEND_TOOLKIT_HOME": "/opt/cann/8.3.RC1"}, machine="aarch64")
    assert paths[0] == "/opt/cann/8.3.RC1/aarch64-linux/ascend_toolkit_install.info"
    assert "/usr/local/Ascend/ascend-toolkit/latest/aarch64-linux/ascend_toolkit_install.info" in paths


# --- IPC or shm -------------------------------------------------------------------------------

@pytest.mark.parametrize("cann,driver,use", [
    ("8.3.RC1", "25.3.rc1", True),      # the documented minimums [ipc]
    ("8.5.0", "25.5.0", True),
    ("9.0.0", "26.0.rc1", True),
    ("8.3.RC1", "25.3.RC1.2", True),
    ("8.2.RC1", "25.3.rc1", False),     # CANN too old
    ("8.3.RC1", "25.0.rc1.1", False),   # driver too old [drv-c]
    ("8.3.RC1.alpha003", "25.3.rc1", False),  # a pre-release of the minimum is below it
    ("8.5.0", "24.1.rc2.2", False),     # [drv-b]
    (None, "25.3.rc1", False),          # get_cann_version returns "" below CANN 8.1.RC1
    ("8.5.0", None, False),             # driver version.info not mounted into the container
    ("8.0.T63", "25.3.rc1", False),
    ("8.5.0", "25.5.t3.b001", True),    # bug 9: a build-tagged driver
    ("8.5.0", "26.1.custom-7", True),   # not a known format, but 26.1 alone is above 25.3
    ("9.0.custom", "25.5.0", True),
    ("8.5.0", "24.9.custom", False),    # ... or alone below it
])
def test_ipc_decision(cann: str | None, driver: str | None, use: bool) -> None:
    decision = decide_ipc(cann, driver)
    assert decision.use_ipc is use
    if not use:
        assert "25.3.RC1" in decision.reason and "8.3.RC1" in decision.reason and "shared memory" in decision.reason


def test_an_unknown_format_that_major_minor_cannot_decide_is_refused_with_the_reason() -> None:
    decision = decide_ipc("8.5.0", "25.3.custom")
    assert not decision.use_ipc
    assert "'25.3.custom' is not in a format hwsync knows" in decision.reason and "cannot tell" in decision.reason
    allowed = decide_ipc("8.5.0", "26.1.custom")
    assert allowed.use_ipc and "'26.1.custom' is not in a format hwsync knows" in allowed.reason


def test_ipc_fallback_is_logged_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import hwsync_npu.ipc as ipc

    monkeypatch.setattr(ipc, "torch_npu_installed", lambda: True)
    monkeypatch.setattr(ipc, "current_versions", lambda: ("8.2.RC1", "25.3.rc1"))
    transport = NpuIpcTransport(lambda: torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="hwsync"):
        for _ in range(3):
            assert transport.available().usable is False
    assert len([r for r in caplog.records if "npu_ipc unavailable" in r.getMessage()]) == 1
    with pytest.raises(RuntimeError, match="CANN is 8.2.RC1"):
        transport.open_sender(1024, 2)


def test_share_record_is_msgpack_safe() -> None:
    # shape of storage._share_npu_()'s tuple (torch_npu/multiprocessing/reductions.py)
    shared = (2, b"\x01ipc-handle", 1 << 20, 0, b"/torch_1234_ref", 7, None, True)
    record = share_record(shared)
    assert msgpack.unpackb(msgpack.packb(record, use_bin_type=True), raw=False) == record
    assert record["physical_device"] == (2 if os.environ.get("ASCEND_RT_VISIBLE_DEVICES") is None else record["physical_device"])
    with pytest.raises(TypeError, match="cannot travel without pickle"):
        ensure_msgpack_safe({"x": object()})


# --- visible devices --------------------------------------------------------------------------

@pytest.mark.parametrize("value,ids", [
    (None, None), ("0,1,2,3", [0, 1, 2, 3]), ("2,3", [2, 3]), ("4", [4]), ("", []),
    ("0,1,x", [0, 1]), ("0,1x", [0, 1]), ("0,,2", [0]), ("3,1", []),  # rts needs ascending ids [vis]
])
def test_parse_visible_devices(value: str | None, ids: list[int] | None) -> None:
    assert parse_visible_devices(value) == ids


def test_logical_physical_mapping_across_processes() -> None:
    # trainer sees chips 2,3 (vllm-ascend example [vis]); the engine sees all of 0..7
    trainer, engine = "2,3", "0,1,2,3,4,5,6,7"
    physical = physical_index(1, trainer)
    assert physical == 3 and logical_index(physical, engine) == 3
    assert logical_index(physical, None) == 3 and physical_index(0, None) == 0
    with pytest.raises(ValueError, match="add 3 to ASCEND_RT_VISIBLE_DEVICES"):
        logical_index(3, "0,1")
    with pytest.raises(ValueError, match="is not visible"):
        physical_index(2, trainer)


# --- HCCL reduce dtypes -----------------------------------------------------------------------

@pytest.mark.parametrize("soc,dtypes", [
    ("Ascend910B1", HCCL_REDUCE_DTYPES_A2_A3), ("Ascend910B4-1", HCCL_REDUCE_DTYPES_A2_A3),
    ("Ascend910_9391", HCCL_REDUCE_DTYPES_A2_A3), ("Ascend910_9362", HCCL_REDUCE_DTYPES_A2_A3),
    ("Ascend910A", HCCL_REDUCE_DTYPES_TRAINING), ("Ascend910ProB", HCCL_REDUCE_DTYPES_TRAINING),
    ("Ascend310P3", HCCL_REDUCE_DTYPES_310P), (None, HCCL_REDUCE_DTYPES_ANY), ("Ascend950PR_9599", HCCL_REDUCE_DTYPES_ANY),
])
def test_hccl_reduce_dtypes_by_chip(soc: str | None, dtypes: frozenset) -> None:
    assert hccl_reduce_dtypes(soc) == dtypes


def test_hccl_dtype_rules() -> None:
    assert torch.bfloat16 in HCCL_REDUCE_DTYPES_A2_A3 and torch.bfloat16 not in HCCL_REDUCE_DTYPES_TRAINING
    assert torch.float64 not in HCCL_REDUCE_DTYPES_A2_A3 and torch.uint8 not in HCCL_REDUCE_DTYPES_A2_A3
    assert torch.int32 in HCCL_REDUCE_DTYPES_ANY  # the core's barrier reduces an int32 everywhere
    assert HCCL_REDUCE_DTYPES_ANY == {torch.int8, torch.int32, torch.float16, torch.float32}


# --- pre-import hook --------------------------------------------------------------------------

def test_pre_import_hook_leaves_a_cann_machine_alone(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "libhccl.so").write_bytes(b"")
    monkeypatch.setattr(preimport, "torch_npu_installed", lambda: True)
    fresh: set[str] = set()  # as if torch were not imported yet
    assert preimport.prepare_torch_import({"LD_LIBRARY_PATH": str(tmp_path)}, fresh) is None
    assert preimport.prepare_torch_import({"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"}, fresh) is None  # the user decided
    assert preimport.prepare_torch_import({}, {"torch"}) is None  # too late to matter
    env: dict[str, str] = {"LD_LIBRARY_PATH": str(tmp_path / "nothing-here")}
    monkeypatch.setattr(preimport, "cann_library_found", lambda e: False)
    assert "libhccl.so" in (preimport.prepare_torch_import(env, fresh) or "")
    assert env["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0" and preimport.NOTE_ENV in env


# The shm transport (the core's hwsync.backend.device_shm over NpuDevice) is tested in test_npu_host_register.py.
