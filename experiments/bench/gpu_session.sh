#!/usr/bin/env bash
# A GPU session's checks in one prepared command (experiments/bench/README.md, "GPU"), for a machine lent
# for minutes that cannot fetch packages:
#
#   bash experiments/bench/gpu_session.sh OUT           # about 6 minutes on one H200
#
#   1. jzero imports beside the machine's own JAX, flax, optax and orbax (nothing installed: jzero runs
#      from this checkout on PYTHONPATH), and sees the GPU;
#   2. `jzero train` on its embedded default (a mesh of the one GPU): its closing lines;
#   3. `experiments/bench/run.py --backend gpu` for gpt2, then llama1b: jzero's spec and flat steps against
#      plain optax written by hand, bf16, ms/step, tokens/s per GPU and MFU.
#
# Writes OUT/session.log (versions, the GPU, each stage's output and exit status), OUT/train-summary.json,
# and OUT/gpt2/, OUT/llama1b/ (result.json, table.md, bench.png): eight files at most. Each stage has its
# own timeout, so a stuck one leaves the others their time (together 590 s, inside one device call's 600);
# the script's status is the first stage's that failed. PYTHON names the interpreter (default python3);
# GPU_SESSION_DRY_RUN=1 goes on without a GPU (to try the script on a CPU machine: the benches then fail).
set -uo pipefail
out=${1:?usage: bash experiments/bench/gpu_session.sh OUT}
cd "$(dirname "$0")/../.."
mkdir -p "$out"
log="$out/session.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0

stage() {  # stage NAME SECONDS COMMAND...: runs COMMAND under a timeout, its output into the log
    local name=$1 seconds=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), timeout ${seconds} s): $*" >>"$log"
    timeout "$seconds" "$@" >>"$log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc" >>"$log"
    [ "$status" -ne 0 ] || status=$rc
    return "$rc"
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
    git rev-parse HEAD 2>/dev/null || echo "(no git here)"
} >"$log"
stage env 60 "$py" -c 'import os, sys, jax, jaxlib, flax, optax, orbax.checkpoint, jzero
print("python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__, "flax", flax.__version__,
      "optax", optax.__version__, "orbax", orbax.checkpoint.__version__)
print("devices", jax.devices())
if jax.default_backend() != "gpu" and not os.environ.get("GPU_SESSION_DRY_RUN"):
    sys.exit("no GPU: JAX runs on " + jax.default_backend())' || exit "$status"
runs=$(mktemp -d)
if stage train 120 "$py" -m jzero.cli train --out "$runs/train" --quiet; then
    cp "$runs/train/summary.json" "$out/train-summary.json"
fi
for model in "gpt2 150" "llama1b 260"; do  # 2026-11-27 on an H200: 108 and 200 s
    set -- $model
    stage "bench $1" "$2" "$py" experiments/bench/run.py --backend gpu --models "$1" --steps 10 --out "$out/$1"
done
rm -rf "$runs"
exit "$status"
