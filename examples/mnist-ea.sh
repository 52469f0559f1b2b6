#!/usr/bin/env bash
# MNIST over HTTP with 4 processes and elastic averaging (AllReduceEA, tau 10,
# alpha 0.2), from a fresh clone: makes the venv, prepares the data if missing,
# serves it on 127.0.0.1, runs 4 processes of examples/mnist-ea.py, stops
# everything, exits non-zero if any process failed. The last line is the final
# test accuracy.
#   examples/mnist-ea.sh [--quick] [--nodes N] [--epochs E] [--batch-size B] [--lr LR] [--tau T] [--alpha A] [--backend gloo] ...
# Options: examples/mnist-ea.sh --help.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(scripts/venv.sh)"
exec "$VENV/bin/python" examples/launch.py --script examples/mnist-ea.py --prog "$0" "$@"
