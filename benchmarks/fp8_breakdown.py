"""Where an fp8 step's extra kernels and bytes come from, compiled for an H100.

The GPT of ``benchmarks/train_step.py`` is compiled (no GPU needed) under a
bf16 configuration and its fp8 counterpart, and every kernel of the two
steps is put in one of these classes, read from the optimized HLO:

  GEMM              cuBLAS(Lt) custom calls (fp8 or 16-bit)
  quantize          kernels that write an fp8 tensor (the casts to E4M3/E5M2,
                    with whatever XLA fused into them: an amax, a transpose)
  amax              reductions of |x| to one number for a scale, alone
  scaling state     the delayed-scaling bookkeeping (history, next scale,
                    the skip select) and the copies into the state's buffers
  other             everything else (norms, softmax, the optimizer, ...)

For each class the table gives kernels and bytes (kernel-boundary bytes
counted as ``jmp_lab.diagnostics.compiled_report`` does) for both steps, and
the fp8 step's ratios. Also printed: the roofline model of both steps and the
share of the fp8 step's bytes that quantization adds (quantize and amax
kernels, less what the bf16 step's same-class kernels move), and the net
figure: the bytes the fp8 step moves outside its GEMMs beyond the bf16
step's (the quantize class also holds the producers XLA fused into the
casts). All figures are models of the compiled module, not measurements.

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/fp8_breakdown.py            # GPT-2 small
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/fp8_breakdown.py --size 1.3b --lean
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re

import jax

from benchmarks import train_step as ts

SIZES = {
    "gpt2-small": ts.ModelSize(),
    # The GEMM-bound configuration of issue 27: a 1.3B-class GPT.
    "1.3b": ts.ModelSize(layers=24, width=2048, heads=16, seq_len=2048,
                         vocab=50304, batch=4),
    "tiny": ts.SMALL,
}
CLASSES = ("GEMM", "quantize", "amax", "scaling state", "other")
_DEFINITION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) (?:fusion|copy|"
                         r"custom-call)\(", re.M)


_CUBLAS_CALL = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*? custom-call\(.*"
                          r"custom_call_target=\"__cublas", re.M)


def output_types(hlo_text: str) -> dict[str, str]:
  """``{instruction: its result type text}`` for the kernels of a module."""
  return {name: shape for name, shape in _DEFINITION.findall(hlo_text)}


def cublas_calls(hlo_text: str) -> set[str]:
  """The names of a module's cuBLAS(Lt) GEMM calls, by their target: an fp8
  weight-gradient GEMM's scope can end in ``transpose`` rather than
  ``dot_general``, which the scope alone would count as "other"."""
  return set(_CUBLAS_CALL.findall(hlo_text))


def kernel_class(record, result_type: str, gemms: frozenset = frozenset()
                 ) -> str:
  """The class of one kernel (see the module docstring); ``gemms``: the
  names of the module's cuBLAS calls (:func:`cublas_calls`)."""
  op = record.op_name
  if record.opcode == "custom-call" and (record.name in gemms
                                         or "dot_general" in op):
    return "GEMM"
  if "f8e4m3" in result_type or "f8e5m2" in result_type:
    return "quantize"
  fp8_scope = "Fp8" in op or "fp8" in op
  if fp8_scope and op.endswith(("reduce_max", "/abs")):
    return "amax"
  # The state update runs at the step's top level (jmp_lab.fp8.next_meta and
  # the skip select), outside any module's scope and outside the gradient
  # (the loss's own reductions are under jvp()).
  top_level = (op.startswith("jit(train_step)/") and "jmp_lab" not in op
               and "jvp(" not in op)
  state_shaped = re.fullmatch(r"f32\[\d*\]\{0\}|\(.*f32\[1\].*\)",
                              result_type or "") is not None
  if top_level and op.endswith(("concatenate", "reduce_max", "select_n")):
    return "scaling state"
  if record.opcode == "copy" and state_shaped and not op:
    return "scaling state"
  return "other"


def breakdown(report) -> dict[str, list[float]]:
  """``{class: [kernels, bytes]}`` for one compiled step."""
  types = output_types(report.hlo_text)
  gemms = frozenset(cublas_calls(report.hlo_text))
  totals = collections.defaultdict(lambda: [0, 0.0])
  for record in report.kernel_records:
    cls = kernel_class(record, types.get(record.name, ""), gemms)
    totals[cls][0] += record.times
    totals[cls][1] += record.io_bytes * record.times
  return totals


def compare(size: ts.ModelSize, lean: bool, target: str = "h100") -> str:
  base_name, fp8_name = ("bf16-lean", "bf16-fp8-lean") if lean else (
      "bf16", "bf16-fp8")
  configs = {c.name: c for c in ts.ALL_CONFIGS}
  reports = {name: ts.compiled_step_report(configs[name], size, target)
             for name in (base_name, fp8_name)}
  rows = {name: breakdown(r) for name, r in reports.items()}
  lines = [f"| class | {base_name} kernels | {fp8_name} kernels | "
           f"{base_name} GB | {fp8_name} GB |", "|---|---|---|---|---|"]
  for cls in CLASSES:
    (k0, b0), (k1, b1) = rows[base_name][cls], rows[fp8_name][cls]
    lines.append(f"| {cls} | {k0} | {k1} | {b0 / 1e9:.2f} | {b1 / 1e9:.2f} |")
  base, fp8 = reports[base_name], reports[fp8_name]
  t0, t1 = base.roofline_seconds(), fp8.roofline_seconds()
  quant = sum(rows[fp8_name][c][1] - rows[base_name][c][1]
              for c in ("quantize", "amax"))
  # The quantize class also holds the producers XLA fused into the casts
  # (a LayerNorm, a GELU) that the bf16 step runs as "other": the net cost
  # is what the fp8 step moves outside its GEMMs beyond the bf16 step.
  beyond = ((fp8.bytes_accessed - rows[fp8_name]["GEMM"][1])
            - (base.bytes_accessed - rows[base_name]["GEMM"][1]))
  lines += [
      "",
      f"| | {base_name} | {fp8_name} | ratio |", "|---|---|---|---|",
      f"| kernels | {base.kernels} | {fp8.kernels} | "
      f"{fp8.kernels / base.kernels:.2f} |",
      f"| bytes (GB) | {base.bytes_accessed / 1e9:.1f} | "
      f"{fp8.bytes_accessed / 1e9:.1f} | "
      f"{fp8.bytes_accessed / base.bytes_accessed:.3f} |",
      *(f"| roofline {k} (ms, model) | {t0[k] * 1e3:.2f} | {t1[k] * 1e3:.2f} "
        f"| {t1[k] / t0[k]:.2f} |" for k in t0),
      "",
      f"quantization's extra bytes: {quant / 1e9:.2f} GB, "
      f"{quant / fp8.bytes_accessed:.1%} of the fp8 step's",
      f"bytes outside the GEMMs beyond the bf16 step's: {beyond / 1e9:.2f} "
      f"GB, {beyond / fp8.bytes_accessed:.1%} of the fp8 step's",
  ]
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(SIZES), default="gpt2-small")
  parser.add_argument("--lean", action="store_true",
                      help="the lean step (fused attention, blocked loss)")
  parser.add_argument("--batch", type=int, help="override the size's batch")
  parser.add_argument("--target", choices=["h100", "h200"], default="h100")
  args = parser.parse_args(argv)
  size = SIZES[args.size]
  if args.batch:
    size = dataclasses.replace(size, batch=args.batch)
  print(f"# compiled for one {args.target} without a GPU; jax "
        f"{jax.__version__}; model {size}; lean={args.lean}")
  print(compare(size, args.lean, args.target))


if __name__ == "__main__":
  main()
