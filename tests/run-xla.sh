#!/usr/bin/env bash
# The XLA test tier (opt-in): distlearn.backends.XLA on a real torch_xla runtime.
# torch_xla 2.9.0 pins torch 2.9.0, so it gets its own environment (.venv-xla, about
# 7 GB: PyPI's Linux torch wheel pulls the CUDA libraries) and never touches .venv.
# Runs on the CPU (PJRT_DEVICE=CPU) unless PJRT_DEVICE is set (TPU, CUDA).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${XLA_VENV:-.venv-xla}"
PYTHON="${PYTHON:-python3}"
stamp="$VENV/.distlearn-xla-stamp"
want="torch==2.9.0 torch_xla==2.9.0 numpy pytest pytest-timeout"

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV" >&2
fi
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    echo "run-xla: installing $want into $VENV (one time; log in $VENV/install.log)" >&2
    # shellcheck disable=SC2086
    if ! "$VENV/bin/python" -m pip install --disable-pip-version-check $want >"$VENV/install.log" 2>&1; then
        tail -n 30 "$VENV/install.log" >&2
        exit 1
    fi
    echo "$want" >"$stamp"
fi
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
# The checkout is imported from the work tree (pyproject: pythonpath = ["."]); the
# project is not installed here, so its other dependencies never pull a second torch.
exec "$VENV/bin/python" -m pytest -m xla -p no:cacheprovider tests/test_distlearn_xla.py "$@"
