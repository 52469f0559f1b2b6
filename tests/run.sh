#!/usr/bin/env bash
# The test command: installs what it needs, lints, then runs the suite.
# Extra arguments go to pytest, e.g. `tests/run.sh -m slow` for the slow tier.
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

VENV="$(scripts/venv.sh)"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
exec "$VENV/bin/python" -m pytest "$@"
