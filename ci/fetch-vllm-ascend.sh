#!/usr/bin/env bash
# Download the real vllm-ascend wheel (no dependencies, never installed) into .cache/vllm-ascend/,
# where tests/test_vllm_ascend_wheel.py reads its worker and weight-transfer sources statically
# (docs/ascend.md, "hwsync as vllm-ascend's weight-transfer backend"). Idempotent; exits 0 without
# network so the test can skip instead. Usage: ci/fetch-vllm-ascend.sh [VERSION]
# (default: the release docs/ascend.md was checked against; 25 MB)
set -uo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:-${VLLM_ASCEND_VERSION:-0.26.0rc1}}"
DEST=".cache/vllm-ascend"
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && PY=".venv/bin/python"
mkdir -p "$DEST"
if ls "$DEST"/vllm_ascend-"$VERSION"-*.whl >/dev/null 2>&1; then
  echo "fetch-vllm-ascend: already have $(ls "$DEST"/vllm_ascend-"$VERSION"-*.whl)"
  exit 0
fi
# --only-binary: the wheel is what users install (its sdist builds against CANN); --pre: a release candidate
if "$PY" -m pip download --quiet --no-deps --pre --only-binary=:all: "vllm-ascend==$VERSION" -d "$DEST"; then
  echo "fetch-vllm-ascend: saved $(ls "$DEST"/vllm_ascend-"$VERSION"-*.whl)"
else
  echo "fetch-vllm-ascend: could not download vllm-ascend==$VERSION; the vllm-ascend wheel test will skip" >&2
fi
exit 0
