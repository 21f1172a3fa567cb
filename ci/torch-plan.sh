#!/usr/bin/env bash
# Which torch ci/setup.sh installs here, printed as one line:
#   cpu                 no NVIDIA GPU: the pinned CPU build (ci/constraints.txt)
#   cuda-keep VERSION   a GPU, and $PYTHON already has a CUDA torch: keep the machine's (the venv sees it)
#   cuda-install        a GPU, and no CUDA torch yet: install the registry's CUDA build of the pinned version
# It reads the machine only (nvidia-smi, $PYTHON's torch); it installs nothing.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  echo cpu
  exit 0
fi
version=$("$PYTHON" -c 'import torch; print(torch.__version__ if torch.version.cuda else "")' 2>/dev/null || true)
if [ -n "$version" ]; then
  echo "cuda-keep $version"
else
  echo cuda-install
fi
