"""The real torch-npu wheels the NPU tests read: cached under .cache/torch-npu, fetched once (ci/fetch-torch-npu.sh).

Which wheels: the versions of hwsync_npu.api.CHECKED_TORCH_NPU_VERSIONS. The static checks read 2.10.0.post4 in
its aarch64 build (what Atlas 800T A2 hosts install; vllm-ascend 0.26.0rc1 pins it) and 2.13.0 in this machine's;
the tests that install a wheel (`pip install --target`) take this machine's build of each.
"""

from __future__ import annotations

import glob
import os
import platform
import subprocess

from hwsync_npu import api

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".cache", "torch-npu")
VERSION = api.CHECKED_TORCH_NPU_VERSION
VERSIONS = api.CHECKED_TORCH_NPU_VERSIONS
#: the build the static checks read of each version: the pip platform tag, or None for this machine's
STATIC_PLATFORM = {"2.10.0.post4": "manylinux_2_28_aarch64"}


def _arch(platform_tag: str | None) -> str:
    if platform_tag is None:
        return platform.machine()
    return "x86_64" if platform_tag.endswith("x86_64") else platform_tag.rsplit("_", 1)[-1]


def wheel_path(version: str = VERSION, platform_tag: str | None = None) -> str | None:
    """The cached torch-npu wheel of `version` for `platform_tag` (this machine's when None), fetched once."""
    pattern = os.path.join(CACHE, f"torch_npu-{version}-*{_arch(platform_tag)}.whl")
    if not glob.glob(pattern):
        command = ["bash", os.path.join(ROOT, "ci", "fetch-torch-npu.sh"), version]
        if platform_tag is not None:
            command.append(platform_tag)
        subprocess.run(command, capture_output=True, timeout=600, check=False)
    found = sorted(glob.glob(pattern))
    return found[0] if found else None


def static_wheel_path(version: str) -> str | None:
    """The wheel of `version` the static checks read (see STATIC_PLATFORM)."""
    return wheel_path(version, STATIC_PLATFORM.get(version))


def missing(version: str, platform_tag: str | None = None) -> str:
    """The skip reason for a wheel that is not there."""
    where = f" for {platform_tag}" if platform_tag else ""
    return (f"torch-npu {version}{where} wheel not in {CACHE} and could not be fetched "
            f"(run ci/fetch-torch-npu.sh {version}{' ' + platform_tag if platform_tag else ''})")
