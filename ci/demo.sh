#!/usr/bin/env bash
# The main job, on a fresh machine: set up, show the backend report, move a tensor between two
# processes and verify it, then run the RL demo (a real vLLM engine fed by a trainer through hwsync),
# with the whole model, with a LoRA (base once, then the adapter alone), and staged (an AsyncLLM serving
# throughout, paused only to apply each version). The set-up leaves out
# .venv-verl, which only the verl integration's tests use (ci/test.sh builds it).
set -euo pipefail
cd "$(dirname "$0")/.."
HWSYNC_SKIP_VERL=1 bash ci/setup.sh
. .venv/bin/activate
hwsync info
hwsync roundtrip
hwsync demo "$@"
hwsync demo --lora "$@"
hwsync demo --staged "$@"
