#!/usr/bin/env bash
# Build .gpu-before/: hwsync as it was before the replay work (issue 50's "before"), for ci/gpu.sh's probe-before
# step, which runs ci/gpu_sync_probe_before.py against it. Run HERE (it needs .git); the GPU machine gets a copy of
# the working tree without .git, so name .gpu-before in the run's carry (it is git-ignored; ~2 MB).
#   bash ci/gpu-before.sh [REV]
# REV (default 1a78d18): the last commit of the old package layout (hwsync.bucket, hwsync.registry, hwsync.manifest,
# hwsync.cli.bench, which the old probe imports): main's tip when it was merged into the reorganized line (c6d71b7's
# second parent). Replay (d1617f7, the first plan/replay commit) came after that merge, on the new layout only.
# hwsync and its backends (cpu, cuda, npu, the simulated accelerator) are installed, not editable, into
# .gpu-before/site. With PYTHONPATH=.gpu-before/site first, `import hwsync` finds the old package before the
# editable installs' finders (appended to sys.meta_path), and importlib.metadata, which keeps the first distribution
# of each name on sys.path, reads the old dists' hwsync.backends entry points: the old backends are the ones loaded.
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:-1a78d18}
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
rev=$(git rev-parse --verify "$REV^{commit}")
for path in hwsync/bucket.py hwsync/registry.py hwsync/manifest.py hwsync/cli/bench/transfer_parts.py; do
  git cat-file -e "$rev:$path" || { echo "ci/gpu-before.sh: $REV has no $path: not the old layout" >&2; exit 1; }
done
rm -rf .gpu-before
mkdir -p .gpu-before/src
git archive "$rev" pyproject.toml README.md hwsync backends tests/plugins/hwsync_sim | tar -x -C .gpu-before/src
# pure Python, no compiled files: the same site serves the GPU machine's Python (3.12) as this one
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target .gpu-before/site \
  .gpu-before/src .gpu-before/src/backends/cpu .gpu-before/src/backends/cuda .gpu-before/src/backends/npu \
  .gpu-before/src/tests/plugins/hwsync_sim
rm -rf .gpu-before/src
echo "$rev" >.gpu-before/REV
echo "ci/gpu-before.sh: .gpu-before/site holds hwsync at $rev ($(du -sh .gpu-before | cut -f1))"
