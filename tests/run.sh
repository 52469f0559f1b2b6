#!/usr/bin/env bash
# The test command: installs what it needs, lints, then runs the suite.
# Extra arguments go to pytest, e.g. `tests/run.sh -m slow` for the slow tier.
# `tests/run.sh --fast [ARGS]`: the fast tier for the edit-test loop (no lint or docs
# build; the tests tests/heavy.txt lists left out; under 3 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages some tests use: nginx (the examples' and bench's server),
# thrift-compiler (code generated from an IDL), iproute2 (network namespaces).
# Installed once when missing and we may (root, apt-get); otherwise the tests
# that need them skip, saying why.
need=()
command -v nginx >/dev/null || [[ -x /usr/sbin/nginx ]] || need+=(nginx)
command -v thrift >/dev/null || need+=(thrift-compiler)
command -v ip >/dev/null || need+=(iproute2)
if (( ${#need[@]} )) && [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    echo "run.sh: apt-get install ${need[*]} (once)" >&2
    if ! { export DEBIAN_FRONTEND=noninteractive; apt-get update -qq \
        && apt-get install -y -qq --no-install-recommends "${need[@]}"; } >/dev/null 2>&1; then
        echo "run.sh: apt-get failed; the tests that need ${need[*]} will skip" >&2
    fi
fi

fast=()
if [[ "${1:-}" == --fast ]]; then
    shift
    fast=(-m "not slow and not xla and not heavy")
fi

VENV="$(scripts/venv.sh)"
if (( ! ${#fast[@]} )); then
    "$VENV/bin/ruff" check .
    "$VENV/bin/ruff" format --check .
    # The docs site (mkdocs.yml): a broken link or anchor, a missing API reference or an
    # option table out of step with the code fails here, in a few seconds.
    site="$(mktemp -d)"
    NO_MKDOCS_2_WARNING=1 "$VENV/bin/mkdocs" build --strict --quiet --site-dir "$site"
    rm -rf "$site"
fi
# Tests run side by side in worker processes (pytest-xdist). In the full tier most of a
# test's time is waiting on a child process or a peer, not CPU (the cores were 55% idle
# with one worker a core), so two workers a core, at most 8: on 2 cores the ipc files
# took 94 s with 4 workers against 142 s with 2. The fast tier's short tests are CPU:
# one worker a core, at most 4 (86 s with 2 workers, 152 s with 4). TEST_WORKERS=0 runs
# them in this process (as does a later -n in the arguments). worksteal: the long tests
# at the end do not wait behind one worker's queue.
cores="$(nproc)"
if (( ${#fast[@]} )); then
    workers="${TEST_WORKERS:-$((cores < 4 ? cores : 4))}"
else
    workers="${TEST_WORKERS:-$((2 * cores < 8 ? 2 * cores : 8))}"
fi
exec "$VENV/bin/python" -m pytest -n "$workers" --dist worksteal ${fast[@]+"${fast[@]}"} "$@"
