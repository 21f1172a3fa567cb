#!/usr/bin/env bash
# Lint (ruff) and type-check (mypy) hwsync/, backends/ and tools/, as configured in pyproject.toml.
# Both run even when the first fails, so one run shows every finding; the exit status is non-zero if
# either found anything. ci/test.sh runs this; the tools are the `lint` extra (ci/setup.sh installs it).
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
[ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ] && . .venv/bin/activate
status=0
printf '\n== ruff check hwsync backends tools\n' >&2
python -m ruff check hwsync backends tools || status=1
printf '\n== mypy (hwsync, the backends and the tools; files and options in pyproject.toml)\n' >&2
python -m mypy || status=1
[ "$status" = 0 ] && echo "ci/lint.sh: ruff and mypy clean" >&2
exit "$status"
