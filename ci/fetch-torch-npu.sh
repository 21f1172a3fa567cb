#!/usr/bin/env bash
# Download real torch-npu wheels (no dependencies, never installed into the venv) into
# .cache/torch-npu/, where tests/test_npu_*.py read them statically and install them into a
# separate --target directory. Idempotent; exits 0 without network so tests can skip instead.
# Usage: ci/fetch-torch-npu.sh                      every wheel the tests read (tests/npu_wheel.py):
#                                                   2.13.0 and 2.10.0.post4 (the torch-npu vllm-ascend
#                                                   0.26.0rc1 pins) for this machine, and 2.10.0.post4 for
#                                                   aarch64 (Atlas 800T A2 hosts are Kunpeng)
#        ci/fetch-torch-npu.sh VERSION [PLATFORM]   one wheel (PLATFORM: a pip platform tag such as
#                                                   manylinux_2_28_aarch64; default this machine's)
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=".cache/torch-npu"
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && PY=".venv/bin/python"
mkdir -p "$DEST"

fetch() {  # VERSION [PLATFORM]
  local version="$1" platform="${2:-}" arch pattern
  arch="${platform##*_}"
  [ -z "$platform" ] && arch="$(uname -m)"
  [ "$arch" = "64" ] && arch="x86_64"  # manylinux_2_28_x86_64 ends in _64
  pattern="$DEST/torch_npu-$version-*$arch.whl"
  # shellcheck disable=SC2086
  if ls $pattern >/dev/null 2>&1; then
    echo "fetch-torch-npu: already have $(ls $pattern)"
    return 0
  fi
  # --only-binary: the wheel is what users install; an sdist would need CANN to build.
  local args=(--quiet --no-deps --only-binary=:all: -d "$DEST")
  if [ -n "$platform" ]; then
    local py
    py="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    args+=(--platform "$platform" --python-version "$py")
  fi
  # shellcheck disable=SC2086
  if "$PY" -m pip download "${args[@]}" "torch-npu==$version" && ls $pattern >/dev/null 2>&1; then
    echo "fetch-torch-npu: saved $(ls $pattern)"
  else
    echo "fetch-torch-npu: could not download torch-npu==$version${platform:+ for $platform}; the NPU wheel" \
         "tests that read it will skip" >&2
  fi
}

if [ $# -ge 1 ]; then
  fetch "$1" "${2:-${TORCH_NPU_PLATFORM:-}}"
else
  # the three at once (separate files): mostly waiting on the network
  fetch "${TORCH_NPU_VERSION:-2.13.0}" &
  fetch 2.10.0.post4 &
  fetch 2.10.0.post4 manylinux_2_28_aarch64 &
  wait
fi
exit 0
