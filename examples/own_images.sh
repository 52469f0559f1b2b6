#!/usr/bin/env bash
# Train on a folder of your own images, from a fresh clone: makes the venv, writes a CSV
# index of PHOTOS (one sub-folder per class), then trains under torchrun.
#   examples/own_images.sh PHOTOS [--nodes 2] [--out DIR] [--val-every 10] [TRAIN OPTIONS...]
# TRAIN OPTIONS: --epochs 10 --batch-size 32 --lr 0.05 --size 64 --scale S --workers N --seed 0
# (python examples/own_images.py train --help). Output: DIR (examples/output/own_images)
# holds train.csv, val.csv and, after training, model.pt.
set -euo pipefail
usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[[ $# -ge 1 && "$1" != -* ]] || usage
photos="$1"
shift
repo="$(cd "$(dirname "$0")/.." && pwd)"
nodes=2 out="$repo/examples/output/own_images" val_every=10 train=()
while (( $# )); do
    case "$1" in
        --nodes) nodes="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --val-every) val_every="$2"; shift 2 ;;
        -h|--help) usage ;;
        *) train+=("$1"); shift ;;
    esac
done
# PHOTOS and DIR as given from here; the commands below run in the repository
photos="$(realpath -- "$photos")" out="$(realpath -m -- "$out")"
cd "$repo"
VENV="$(scripts/venv.sh)"
"$VENV/bin/python" examples/own_images.py index "$photos" --out "$out" --val-every "$val_every"
val=()
[[ -f "$out/val.csv" ]] && val=(--val "$out/val.csv")
exec "$VENV/bin/torchrun" --standalone --nproc-per-node="$nodes" \
    examples/own_images.py train "$out/train.csv" "${val[@]}" --out "$out" "${train[@]}"
