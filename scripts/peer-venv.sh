#!/usr/bin/env bash
# Make or refresh the virtual environment of one bench peer (.venv-PEER) and print its path.
#
#   scripts/peer-venv.sh mosaic|litdata|torchdata
#
# Peers live apart from the project's .venv because their pins clash with it
# (mosaicml-streaming 0.13.0 pins numpy<2.2 and pulls about 75 packages) and so
# that no peer's install can change what the project's own tests run against.
# torch is always pinned to the project's torch==2.13.0 (a CPU wheel): an
# unpinned resolve would fetch the newest CUDA build, gigabytes of it.
# Idempotent: reinstalls only when this script changed. The bench imports
# nothing but numpy, Pillow, torch and the peer itself in these venvs.
set -euo pipefail
cd "$(dirname "$0")/.."
peer="${1:?usage: scripts/peer-venv.sh mosaic|litdata|torchdata}"
PYTHON="${PYTHON:-python3}"
TORCH="torch==2.13.0"
case "$peer" in
    mosaic) pkgs=("mosaicml-streaming==0.13.0") ;;
    # litdata reads S3 through boto3 (its default) or obstore; both are pulled here
    litdata) pkgs=("litdata==0.2.76" "boto3") ;;
    torchdata) pkgs=("torchdata==0.11.0" "requests") ;;
    *)
        echo "peer-venv: unknown peer '$peer' (mosaic, litdata, torchdata)" >&2
        exit 2
        ;;
esac
VENV=".venv-$peer"
stamp="$VENV/.peer-stamp"
want="$( (cat scripts/peer-venv.sh; echo "$peer") | sha256sum | cut -c1-16)"
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV" >&2
fi
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    echo "peer-venv: installing ${pkgs[*]} into $VENV (one time; log in $VENV/install.log)" >&2
    pip=("$VENV/bin/python" -m pip install --disable-pip-version-check)
    # torch first and pinned again with the peer, so the resolver may not move it
    if ! { "${pip[@]}" --upgrade "pip>=24" && "${pip[@]}" "$TORCH" \
        && "${pip[@]}" "$TORCH" pillow numpy requests "${pkgs[@]}"; } >"$VENV/install.log" 2>&1; then
        tail -n 30 "$VENV/install.log" >&2
        echo "peer-venv: install failed; see $VENV/install.log" >&2
        exit 1
    fi
    echo "$want" >"$stamp"
fi
echo "$VENV"
