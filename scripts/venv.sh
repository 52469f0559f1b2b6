#!/usr/bin/env bash
# Make or refresh the project's virtual environment (.venv) and print its path.
# Idempotent: reinstalls only when setup.py, this script or the C source changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
stamp="$VENV/.distlearn-stamp"
# (dataset/index/csv/_lines.c, dataset/formats/thrift/_fast.c: the C the install compiles)
want="$(cat setup.py scripts/venv.sh scripts/constraints.txt dataset/index/csv/_lines.c \
    dataset/formats/thrift/_fast.c | sha256sum | cut -c1-16)"

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV" >&2
fi
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    echo "venv: installing into $VENV (one time; log in $VENV/install.log)" >&2
    pip=("$VENV/bin/python" -m pip install --disable-pip-version-check)
    # A current pip first (a new venv ships 23.x), then torch, pinned: setup.py
    # accepts any torch>=2.1, and an unpinned resolve would fetch the newest
    # CUDA build (gigabytes). constraints.txt keeps pip from backtracking
    # through boto3 releases (a 48 s resolve without it, 24 s with it).
    if ! { "${pip[@]}" --upgrade "pip>=24" && "${pip[@]}" "torch==2.13.0" \
        && "${pip[@]}" -c scripts/constraints.txt -e ".[all]"; } >"$VENV/install.log" 2>&1; then
        tail -n 30 "$VENV/install.log" >&2
        echo "venv: install failed; see $VENV/install.log" >&2
        exit 1
    fi
    echo "$want" >"$stamp"
fi
# The package's bytecode, as a pip install writes it: with PYTHONDONTWRITEBYTECODE set
# (as on CI machines) every process would compile ~100 modules from source at start.
# Quick when nothing changed (compileall compares times).
"$VENV/bin/python" -m compileall -q -j 0 distlearn dataset ipc >/dev/null 2>&1 || true
echo "$VENV"
