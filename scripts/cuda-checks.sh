#!/usr/bin/env bash
# The checks that need a CUDA GPU (CI has none): the `cuda` tests, then the step
# time of the README's loop on CUDA tensors beside DDP. Run where torch sees a GPU
# and distlearn is importable; figures and logs go to OUT (default cuda-out/).
#   scripts/cuda-checks.sh [OUT]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-cuda-out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS CMD...: run one check, bounded, its log in OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | tail -n 40
    echo "== $name: exit ${PIPESTATUS[0]}"
}
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
      "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))'
step tests 120 "$py" -m pytest -p no:cacheprovider -q -rs -m cuda tests/test_distlearn.py
# Ranks share the GPUs when there are fewer than ranks: gloo and the tree stage
# CUDA tensors through host memory; NCCL, which refuses two ranks of one host on one
# GPU, gets a host id a rank from bench.step_time and talks over loopback sockets.
step steps-gloo 240 "$py" -m bench.step_time --device cuda --models convnet mnist \
    --nodes 2 4 --rows none ddp gloo ipc ipc-sync --reps 2 --timeout 90 \
    --out "$out/RESULTS-step-time-cuda.md"
step steps-nccl 330 "$py" -m bench.step_time --device cuda --backend nccl \
    --models convnet mnist --nodes 2 4 --rows none ddp ddp-join gloo ipc --reps 2 --timeout 90 \
    --out "$out/RESULTS-step-time-nccl.md"
# Where the NCCL rows' steps go (issue 16: AllReduceSGD over NCCL trails DDP): one
# profiled block of each row, an op table and a Chrome trace a row in OUT/profile-nccl.
step profile-nccl 120 "$py" -m bench.step_time --device cuda --backend nccl \
    --models mnist convnet --nodes 2 --rows ddp gloo --reps 1 --timeout 90 \
    --profile "$out/profile-nccl"
