#!/usr/bin/env bash
# The test command: installs what it needs, lints, then runs the suite.
# Extra arguments go to pytest, e.g. `tests/run.sh -m slow` for the slow tier.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(scripts/venv.sh)"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
exec "$VENV/bin/python" -m pytest "$@"
