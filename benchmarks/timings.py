"""The five GPU timings in one table, from the JSON files the timing runs wrote.

``bash benchmarks/gpu_run.sh OUT timings`` runs the timings, each framework
in a process of its own, then this script:

    python benchmarks/timings.py OUT

It reads ``OUT/timings_*.json`` (written by ``fused_update.py --json`` and
``train_step.py --json``) and prints, for each figure, the measured ratio,
its goal and whether it is met:

* P1: the fused update's bandwidth (bytes it must move / median time) over a
  measured device copy's (``x + 1`` over fp32), goal >= 0.85;
* P2: the unfused ``mixed_precision(adamw)`` update's time over the fused
  one's, goal >= 1.5;
* P3: torch's ``AdamW(fused=True)`` with ``GradScaler`` over the fused
  update's time, goal > 1 (faster);
* P4: GPT-2-small's step, fp32 at "highest" precision over bf16 (goal >= 3)
  and TF32 over bf16 (goal >= 1.3);
* P5: the lean bf16 step's tokens/s over torch AMP with SDPA's (goal >= 1),
  and its MFU at the data sheet's bf16 peak (goal >= 45%);
* and, where it ran, the 1.3B-class GPT's fp8 lean step over its bf16 lean
  step.

A figure whose runs are missing reads "not run". Every time is a median of
device-synchronised steps after warm-up (the writers' docstrings).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Optional

#: The data sheet's dense bf16 tensor-core peak of an H100/H200 SXM (FLOP/s).
DATASHEET_BF16_PEAK = 989.4e12

FUSED_PATH = "fused tree (new params)"    # the default layout's step
UNFUSED_PATH = "unfused mixed_precision(adamw)"
COPY_PATH = "copy (x + 1, fp32)"
TORCH_PATH = "torch AdamW(fused) + GradScaler"

#: Which file each run writes, under OUT.
FILES = {"fused": "timings_fused.json", "fused_torch": "timings_fused_torch.json",
         "step": "timings_step.json", "step_torch": "timings_step_torch.json",
         "fp8": "timings_fp8.json"}


def _load(out: str, key: str) -> Optional[dict]:
  path = os.path.join(out, FILES[key])
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _update_seconds(found: Optional[dict], path: str) -> Optional[float]:
  """The median seconds of update ``path`` at the largest size timed."""
  rows = [r for r in (found or {}).get("rows", []) if r["path"] == path]
  return max(rows, key=lambda r: r["params"])["seconds"] if rows else None


def _update_row(found: Optional[dict], path: str) -> Optional[dict]:
  rows = [r for r in (found or {}).get("rows", []) if r["path"] == path]
  return max(rows, key=lambda r: r["params"]) if rows else None


def _step_seconds(found: Optional[dict], name: str) -> Optional[float]:
  return next((r["seconds"] for r in (found or {}).get("rows", [])
               if r["name"] == name), None)


def _ratio(numerator: Optional[float], denominator: Optional[float]
           ) -> Optional[float]:
  if numerator is None or denominator is None or denominator <= 0:
    return None
  return numerator / denominator


def figures(out: str) -> list[dict[str, Any]]:
  """Each figure: its id, what it compares, the value, the goal and whether
  it is met (None: not run)."""
  fused, fused_torch = _load(out, "fused"), _load(out, "fused_torch")
  step, step_torch = _load(out, "step"), _load(out, "step_torch")
  fp8 = _load(out, "fp8")
  rows = []

  def add(figure, what, value, goal, met_if):
    rows.append({"figure": figure, "what": what, "value": value,
                 "goal": goal,
                 "met": None if value is None else bool(met_if(value))})

  fused_row, copy_row = _update_row(fused, FUSED_PATH), _update_row(
      fused, COPY_PATH)
  bandwidth = None
  if fused_row and copy_row:
    bandwidth = ((fused_row["bytes_per_param"] / fused_row["seconds"])
                 / (copy_row["bytes_per_param"] / copy_row["seconds"]))
  add("P1", "fused update bandwidth / device copy bandwidth", bandwidth,
      ">= 0.85", lambda v: v >= 0.85)
  fused_s = _update_seconds(fused, FUSED_PATH)
  add("P2", "unfused / fused update time",
      _ratio(_update_seconds(fused, UNFUSED_PATH), fused_s), ">= 1.5x",
      lambda v: v >= 1.5)
  add("P3", "torch AdamW(fused)+GradScaler / fused update time",
      _ratio(_update_seconds(fused_torch, TORCH_PATH), fused_s), "> 1x",
      lambda v: v > 1.0)
  bf16_s = _step_seconds(step, "bf16")
  add("P4", "GPT-2 small step: fp32-highest / bf16 time",
      _ratio(_step_seconds(step, "fp32-highest"), bf16_s), ">= 3x",
      lambda v: v >= 3.0)
  add("P4", "GPT-2 small step: TF32 / bf16 time",
      _ratio(_step_seconds(step, "fp32-tf32"), bf16_s), ">= 1.3x",
      lambda v: v >= 1.3)
  lean_s = _step_seconds(step, "bf16-lean")
  torch_sdpa = [r["seconds"] for r in (step_torch or {}).get("rows", [])
                if r["name"].startswith("torch bf16 sdpa")]
  add("P5", "lean bf16 step / torch AMP+SDPA, tokens/s",
      _ratio(min(torch_sdpa) if torch_sdpa else None, lean_s), ">= 1.0x",
      lambda v: v >= 1.0)
  mfu = None
  if step and lean_s:
    mfu = step["model_flops"] / lean_s / DATASHEET_BF16_PEAK
  add("P5", "lean bf16 step MFU (data-sheet bf16 peak)", mfu, ">= 45%",
      lambda v: v >= 0.45)
  add("fp8", "1.3B-class GPT: bf16 lean / fp8 lean step time",
      _ratio(_step_seconds(fp8, "bf16-lean"), _step_seconds(fp8,
                                                           "bf16-fp8-lean")),
      "> 1x", lambda v: v > 1.0)
  return rows


def table(rows: list[dict[str, Any]]) -> str:
  lines = ["| figure | what | measured | goal | met |", "|---|---|---|---|---|"]
  for r in rows:
    value = r["value"]
    shown = ("not run" if value is None else
             f"{value:.1%}" if "MFU" in r["what"] else f"{value:.2f}")
    met = "n/a" if r["met"] is None else ("yes" if r["met"] else "**no**")
    lines.append(f"| {r['figure']} | {r['what']} | {shown} | {r['goal']} "
                 f"| {met} |")
  return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 1 or not os.path.isdir(argv[0]):
    raise SystemExit("usage: python benchmarks/timings.py OUT (the folder "
                     "the timing runs wrote their JSON files to)")
  rows = figures(argv[0])
  device = next((found["device"] for key in FILES
                 if (found := _load(argv[0], key))), "no device")
  print(f"# the five timings; device: {device}")
  print(table(rows))
  return rows


if __name__ == "__main__":
  main()
