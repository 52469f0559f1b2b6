#!/usr/bin/env bash
# MNIST over HTTP with 4 processes, one SIGKILLed mid-epoch: the other 3 re-form the
# tree, take over its examples and finish, with no restart. Prints, at the end, whether
# every training example was used exactly once in each epoch, and the test accuracy.
# With --come-back the killed process is started again and rejoins the running job.
#   examples/elastic.sh [--quick] [--kill-at STEP] [--kill-rank R] [--come-back] [--epochs E] ...
# Options: examples/elastic.sh --help.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(scripts/venv.sh)"
exec "$VENV/bin/python" examples/launch.py --script examples/elastic.py --survive --prog "$0" "$@"
