"""Keep `import torch` working where torch_npu is installed but CANN is not.

torch_npu registers itself in torch's `torch.backends` entry points, so a plain `import torch`
imports torch_npu too; without CANN's libraries that raises "RuntimeError: Failed to load the
backend extension: torch_npu. You can disable extension auto-loading with
TORCH_DEVICE_BACKEND_AUTOLOAD=0." and nothing, hwsync included, can even import.

`prepare_torch_import` is registered under the entry-point group `hwsync.pre_torch_import`
for the core to call before it imports torch. When torch_npu is installed, the user has not
set TORCH_DEVICE_BACKEND_AUTOLOAD, and CANN's HCCL library is nowhere the loader looks, it sets
the variable to 0 and says so; the npu probe then imports torch_npu itself and reports the real
error. On a machine with CANN it changes nothing. This module must never import torch.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Container, Mapping, MutableMapping

from hwsync_npu.api import AUTOLOAD_ENV, torch_npu_installed

#: set to the reason when this hook disabled autoloading, so the probe can repeat it
NOTE_ENV = "HWSYNC_NPU_AUTOLOAD_NOTE"

#: torch_npu's extension links these CANN libraries; libhccl.so is the one its import reports
#: missing first on a machine without CANN ("ImportError: libhccl.so: cannot open shared
#: object file"), so its absence is the signal.
CANN_PROBE_LIBRARY = "libhccl.so"


def _library_dirs(environ: Mapping[str, str]) -> list[str]:
    """Where the dynamic loader would look for CANN: LD_LIBRARY_PATH, then the toolkit's lib64."""
    dirs = [d for d in environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    for key in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        if environ.get(key):
            dirs.append(os.path.join(environ[key], "lib64"))
    return dirs


def cann_library_found(environ: Mapping[str, str] | None = None) -> bool:
    """Whether libhccl.so is in a directory the loader searches (or in the ld.so cache)."""
    env = os.environ if environ is None else environ
    if any(glob.glob(os.path.join(d, CANN_PROBE_LIBRARY + "*")) for d in _library_dirs(env)):
        return True
    try:
        with open("/etc/ld.so.cache", "rb") as cache:
            return CANN_PROBE_LIBRARY.encode() in cache.read()
    except OSError:
        return False


def prepare_torch_import(environ: MutableMapping[str, str] | None = None,
                         modules: Container[str] | None = None) -> str | None:
    """Disable torch's device-backend autoload when torch_npu cannot load; return why, or None."""
    env = os.environ if environ is None else environ
    if "torch" in (sys.modules if modules is None else modules) or AUTOLOAD_ENV in env or not torch_npu_installed():
        return None  # too late, the user decided, or nothing to protect against
    if cann_library_found(env):
        return None
    note = (
        f"torch_npu is installed but CANN's {CANN_PROBE_LIBRARY} is not on LD_LIBRARY_PATH, so hwsync set "
        f"{AUTOLOAD_ENV}=0 to keep `import torch` working; install CANN and "
        "`source /usr/local/Ascend/ascend-toolkit/set_env.sh` to use the NPUs"
    )
    env[AUTOLOAD_ENV] = "0"
    env[NOTE_ENV] = note
    return note
