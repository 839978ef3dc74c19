"""GPT train steps compiled for a B200 without one: bf16 against MXFP8 and
NVFP4 (``jmp_lab.block_scaled``), from the compiled modules.

For each model size and config: the GEMMs the module runs, how many are
cuDNN's block-scaled GEMM (``__cudnn$blockScaledDot``), their share of the
GEMM FLOPs, the per-device memory, and the roofline step time
(``CompiledReport.roofline_seconds``: bytes over the B200's bandwidth plus
each GEMM's FLOPs over its math's data-sheet peak) as a ratio to bf16's.
Every figure is a model of a compiled program, not a measurement::

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/block_scaled_compile.py \\
      --size gpt2-small
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/block_scaled_compile.py \\
      --size 1.3b --lean
"""

from __future__ import annotations

import argparse
import json

from benchmarks import train_step as ts
from benchmarks.fp8_breakdown import SIZES

CONFIGS = [ts.Config("bf16", "mixed_bfloat16", "none"),
           *ts.BLOCK_SCALED_CONFIGS]
# The lean step (fused attention, the loss over vocabulary blocks, whose
# head GEMMs stay bf16 inside the loss kernel): the 1.3B-class comparison.
LEAN_CONFIGS = [ts.Config("bf16-lean", "mixed_bfloat16", "none", lean=True),
                *ts.BLOCK_SCALED_LEAN_CONFIGS]


def row(config: ts.Config, size: ts.ModelSize) -> dict:
  report = ts.compiled_step_report(config, size, "b200")
  roof = report.roofline_seconds()
  return {
      "config": config.name,
      "gemms": sum(g.times for g in report.gemms),
      "block_scaled_gemms": sum(g.times for g in report.block_scaled_gemms),
      "other_gemms": sorted({f"{g.kind} {g.operands}" for g in report.gemms
                             if g.block_scaled is None}),
      "block_scaled_flop_share": report.block_scaled_flop_share(),
      "argument_gib": report.memory.get("argument", 0) / 2**30,
      "temp_gib": report.memory.get("temp", 0) / 2**30,
      "roofline_ms": roof["total"] * 1e3,
      "gemm_ms": roof["gemm"] * 1e3,
      "memory_ms": roof["memory"] * 1e3,
  }


def table(rows: list[dict]) -> str:
  base = rows[0]["roofline_ms"]
  lines = [f"{'config':<12} {'GEMMs':>6} {'block-scaled':>13} {'FLOP %':>7} "
           f"{'args GiB':>9} {'temp GiB':>9} {'roofline ms':>12} "
           f"{'GEMM ms':>8} {'memory ms':>10} {'vs bf16':>8}"]
  for r in rows:
    lines.append(
        f"{r['config']:<12} {r['gemms']:>6} {r['block_scaled_gemms']:>13} "
        f"{100 * r['block_scaled_flop_share']:>6.1f}% "
        f"{r['argument_gib']:>9.2f} {r['temp_gib']:>9.2f} "
        f"{r['roofline_ms']:>12.2f} {r['gemm_ms']:>8.2f} "
        f"{r['memory_ms']:>10.2f} {r['roofline_ms'] / base:>7.3f}x")
  return "\n".join(lines)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--size", action="append", choices=sorted(SIZES))
  parser.add_argument("--lean", action="store_true",
                      help="the lean step's configs (bf16-lean first)")
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  configs = LEAN_CONFIGS if args.lean else CONFIGS
  results = {}
  for name in args.size or ["gpt2-small"]:
    rows = [row(config, SIZES[name]) for config in configs]
    results[name] = rows
    print(f"{name}, compiled for 1 x B200 (models, not measurements)")
    print(table(rows), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return results


if __name__ == "__main__":
  main()
