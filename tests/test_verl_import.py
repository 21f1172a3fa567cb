"""hwsync and verl keep apart: importing hwsync never imports verl, and the verl integration says how to get verl.

Runs in both environments: .venv (no verl: the integration's import must fail clearly) and
.venv-verl (verl installed: the integration registers its engine).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

HAS_VERL = importlib.util.find_spec("verl") is not None


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_hwsync_never_imports_verl():
    done = _python("import sys, hwsync, hwsync.integrations, hwsync.cli, hwsync_tools.bench.transfer\n"
                   "loaded = sorted(m for m in sys.modules if m == 'verl' or m.startswith('verl.'))\n"
                   "assert not loaded, loaded")
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.skipif(HAS_VERL, reason="verl is installed here; this checks the message where it is not")
def test_without_verl_the_integration_says_how_to_install_it():
    done = _python("import hwsync.integrations.verl")
    assert done.returncode != 0
    assert "ImportError: hwsync.integrations.verl needs the verl package" in done.stderr
    assert "pip install 'hwsync[verl]'" in done.stderr


@pytest.mark.skipif(not HAS_VERL, reason="needs verl: ci/test.sh runs this in .venv-verl (ci/setup-verl.sh)")
def test_with_verl_importing_the_integration_registers_the_engine():
    done = _python("import hwsync.integrations.verl\n"
                   "from verl.checkpoint_engine.base import CheckpointEngineRegistry\n"
                   "print(CheckpointEngineRegistry.get('hwsync').__name__)")
    assert done.returncode == 0 and done.stdout.strip() == "HwsyncCheckpointEngine", done.stderr[-2000:]
