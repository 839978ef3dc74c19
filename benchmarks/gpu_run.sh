#!/usr/bin/env bash
# The one command for a machine with an NVIDIA GPU (about 20 minutes; each
# part has its own time limit so the whole stays under 25):
#
#   bash benchmarks/gpu_run.sh [OUTPUT_DIR]      # default: $OUT, else gpu_results/
#
# 1. the kernel correctness tests on the real backends: the Triton and Mosaic
#    GPU kernels against the jnp reference (tests/test_kernels.py, which skips
#    them on a CPU);
# 2. benchmarks/fused_update.py at 10M, 100M and 1B params (with torch's
#    AdamW(fused=True) + GradScaler when torch has CUDA);
# 3. benchmarks/train_step.py on GPT-2-small, with the torch AMP peer (eager
#    and torch.compile) and a plot.
#
# Every log and table goes to OUTPUT_DIR; the tables are appended to
# benchmarks/RESULTS.md under a dated heading (and a copy of RESULTS.md is
# written to OUTPUT_DIR, for machines whose working tree is thrown away).
# Run from source: nothing is installed. Never changes the GPU's settings.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_results}}"
mkdir -p "$out"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1
  python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.is_available())' 2>&1
} | tee "$out/environment.txt"

status=0
run() {  # run NAME SECONDS COMMAND...: log to $out/NAME.log, keep going on failure
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee "$out/$name.log"
  timeout "$limit" "$@" 2>&1 | tee -a "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc" | tee -a "$out/$name.log"
  [ "$rc" -eq 0 ] || status=1
}

run kernels 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -rs
run fused_update 480 python3 benchmarks/fused_update.py
run train_step 660 python3 benchmarks/train_step.py --plot "$out/train_step.png"

{
  echo
  echo "## GPU run of $(date -u +%Y-%m-%d) (\`bash benchmarks/gpu_run.sh\`)"
  echo
  echo '```'
  cat "$out/environment.txt"
  echo '```'
  for name in kernels fused_update train_step; do
    echo
    echo "### $name"
    echo
    # Tables and the lines that describe them; logs stay in the output folder.
    grep -E '^(\||# |largest batch|[0-9]+ (passed|failed)|FAILED|SKIPPED|== )' "$out/$name.log" || true
  done
} >> benchmarks/RESULTS.md
cp benchmarks/RESULTS.md "$out/RESULTS.md"
echo "wrote $out (status $status)"
exit "$status"
