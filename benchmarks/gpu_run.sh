#!/usr/bin/env bash
# The one script for a machine with an NVIDIA GPU. Each part has a time limit
# under 10 minutes (not yet run on a GPU), so a lease with a per-command limit
# runs them one call at a time:
#
#   bash benchmarks/gpu_run.sh OUTPUT_DIR [PART ...]   # default: every part
#
#   timings       first in any lease: the five timings (P1-P5) in one call of
#                 at most 9 minutes, then one table (benchmarks/timings.py):
#                 the fused update against a device copy, the unfused update
#                 and torch's AdamW(fused=True) + GradScaler (100M params);
#                 GPT-2-small's step in bf16 against fp32-highest and TF32;
#                 the lean bf16 step against torch AMP with SDPA, and its
#                 MFU; then, if time is left, fp8 against bf16 on the
#                 1.3B-class GPT. It installs nothing: the lent machines
#                 have jax, flax, optax, chex and torch (it checks them
#                 first, in seconds);
#   compiled      the compiled-for-H100 checks (tests/test_compiled.py) on
#                 this machine's jax and CUDA plugin (0.11.2 and CUDA 13 on
#                 the lent machines; CI runs them on 0.10.2 and the newest);
#   kernels       the kernel correctness tests on the real backends: the
#                 Triton and Mosaic GPU kernels against the jnp reference
#                 (tests/test_kernels.py, which skips them on a CPU), and
#                 linear_cross_entropy's Triton kernels against fp32
#                 (tests/test_losses.py -k triton);
#   fused_update  benchmarks/fused_update.py at 10M, 100M and 1B params (with
#                 torch's AdamW(fused=True) + GradScaler when torch has CUDA):
#                 issue 12's GPU targets;
#   train_step    benchmarks/train_step.py on GPT-2-small, with the torch AMP
#                 peer (eager and torch.compile) and a plot: issue 7's targets;
#   fp8           GPT-2-small's step with fp8 matmuls (delayed and current
#                 scaling) against bf16, and the 1.3B-class GPT's lean step
#                 with fp8 against bf16: issue 16's item 5 and issue 27;
#   lean          GPT-2-small's lean step (cuDNN's fused attention and the
#                 loss's Pallas kernels) against bf16, and the largest batch of each:
#                 issue 25's step time.
#
# e.g. three calls: `... "$OUT" kernels fused_update`, `... "$OUT" train_step`,
# `... "$OUT" fp8`. OUTPUT_DIR defaults to $OUT, else gpu_results/.
#
# Every log and table goes to OUTPUT_DIR; the tables are appended to
# benchmarks/RESULTS.md under a dated heading (and a copy of RESULTS.md is
# written to OUTPUT_DIR, for machines whose working tree is thrown away).
# Run from source: nothing is installed. Never changes the GPU's settings.
#
# jax and torch do not share a process: jax's allocator keeps what it once
# held, so torch would get what is left. Each benchmark runs twice, jax
# (--no-torch) then torch (--torch-only), in processes of their own. jax
# allocates on demand (XLA_PYTHON_CLIENT_PREALLOCATE=false) and may grow to
# 95% of the card (XLA_PYTHON_CLIENT_MEM_FRACTION): its largest batch is the
# model's, not a preallocation's. Each reports its peak from its own
# allocator. GPU_RUN_DRY=1 prints the commands and their environment instead
# of running them (tests/test_benchmarks.py checks them on a CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_results}}"
shift || true
all_parts=(timings kernels compiled fused_update train_step fp8 lean)
parts=("$@")
[ "${#parts[@]}" -gt 0 ] || parts=("${all_parts[@]}")
for part in "${parts[@]}"; do
  case " ${all_parts[*]} " in
    *" $part "*) ;;
    *) echo "gpu_run.sh: unknown part '$part'; the parts are: ${all_parts[*]}" >&2
       exit 2 ;;
  esac
done
mkdir -p "$out"
# CUDA first (the default backend), and the CPU too: compiled_report's byte
# model runs XLA's cost analysis through the CPU client (the CUDA client's
# PJRT C API has none).
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda,cpu
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
dry="${GPU_RUN_DRY:-}"

[ -n "$dry" ] || {
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1
  python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.is_available())' 2>&1
} | tee "$out/environment.txt"

status=0
run() {  # run NAME SECONDS COMMAND...: log to $out/NAME.log, keep going on failure
  local name=$1 limit=$2
  shift 2
  if [ -n "$dry" ]; then
    echo "$name (limit $limit s): XLA_PYTHON_CLIENT_PREALLOCATE=$XLA_PYTHON_CLIENT_PREALLOCATE" \
         "XLA_PYTHON_CLIENT_MEM_FRACTION=$XLA_PYTHON_CLIENT_MEM_FRACTION $*"
    return
  fi
  echo "== $name: $*" | tee "$out/$name.log"
  timeout "$limit" "$@" 2>&1 | tee -a "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc" | tee -a "$out/$name.log"
  [ "$rc" -eq 0 ] || status=1
}

[ -z "$dry" ] || echo "dry run: the commands, not run"
# The timings' budget: 9 minutes in all, the checks and the table included.
timings_budget=540
timings() {
  local start=$SECONDS left
  run timings_fused 100 python3 benchmarks/fused_update.py --sizes 100M --repeats 20 \
    --no-torch --json "$out/timings_fused.json"
  run timings_fused_torch 60 python3 benchmarks/fused_update.py --sizes 100M --repeats 20 \
    --torch-only --json "$out/timings_fused_torch.json"
  run timings_step 230 python3 benchmarks/train_step.py --configs \
    fp32-highest,fp32-tf32,bf16,bf16-lean --warmup 3 --steps 10 --no-torch \
    --no-batch-search --json "$out/timings_step.json"
  run timings_step_torch 80 python3 benchmarks/train_step.py --torch-only \
    --torch-peers bf16-sdpa --warmup 3 --steps 10 --no-batch-search \
    --json "$out/timings_step_torch.json"
  # fp8 on the 1.3B-class GPT only with two minutes to spare.
  left=$(( timings_budget - 20 - (SECONDS - start) ))
  [ -n "$dry" ] && left=$(( timings_budget - 20 - 470 ))
  if [ -n "$dry" ] || [ "$left" -ge 120 ]; then
    run timings_fp8 "$left" python3 benchmarks/train_step.py --configs \
      bf16-lean,bf16-fp8-lean --layers 24 --width 2048 --heads 16 --seq-len 2048 \
      --batch 4 --warmup 2 --steps 5 --no-torch --no-batch-search \
      --json "$out/timings_fp8.json"
  fi
  run timings 20 python3 benchmarks/timings.py "$out"
}

for part in "${parts[@]}"; do
  case "$part" in
    timings) timings ;;
    compiled) JAX_PLATFORMS=cpu run compiled 240 python3 -m pytest -q -p no:cacheprovider \
                tests/test_compiled.py -rs ;;
    kernels) run kernels 270 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -rs
             run loss_kernels 200 python3 -m pytest -q -p no:cacheprovider tests/test_losses.py \
               -k "triton" -rs ;;
    fused_update) run fused_update 250 python3 benchmarks/fused_update.py --no-torch
                  run fused_update_torch 100 python3 benchmarks/fused_update.py --torch-only ;;
    train_step) run train_step 420 python3 benchmarks/train_step.py --no-torch --plot "$out/train_step.png"
                run train_step_torch 150 python3 benchmarks/train_step.py --torch-only ;;
    fp8) run fp8 570 python3 benchmarks/train_step.py --configs bf16,bf16-fp8,bf16-fp8-current \
           --no-torch --no-batch-search
         run fp8_1.3b 570 python3 benchmarks/train_step.py --configs bf16-lean,bf16-fp8-lean \
           --layers 24 --width 2048 --heads 16 --seq-len 2048 --batch 4 --steps 10 \
           --no-torch --no-batch-search ;;
    lean) run lean 570 python3 benchmarks/train_step.py --configs bf16,bf16-lean \
           --no-torch --batch-search-configs bf16,bf16-lean ;;
  esac
done

[ -z "$dry" ] || exit 0
{
  echo
  echo "## GPU run of $(date -u +%Y-%m-%d) (\`bash benchmarks/gpu_run.sh OUTPUT_DIR ${parts[*]}\`)"
  echo
  echo '```'
  cat "$out/environment.txt"
  echo '```'
  for name in "${parts[@]}"; do
    echo
    echo "### $name"
    echo
    # Tables and the lines that describe them; logs stay in the output folder.
    for log in "$out/$name.log" "$out/${name}_torch.log"; do
      [ -f "$log" ] || continue
      grep -E '^(\||# |largest batch|[0-9]+ (passed|failed)|FAILED|SKIPPED|== )' "$log" || true
    done
  done
} >> benchmarks/RESULTS.md
cp benchmarks/RESULTS.md "$out/RESULTS.md"
echo "wrote $out (status $status)"
exit "$status"
