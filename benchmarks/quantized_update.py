"""The fused AdamW update with fp32, bf16 and 8-bit moments, compiled for an
H100 on GPT-2-small-shaped params (124M), against its ideal bytes.

For each moment dtype (remainder master, bf16 params and gradients, the
donated ``update.new_params`` step that ``jmp_lab.TrainState`` runs), prints
the bytes the compiled update moves (XLA's cost model plus every custom
call's operands and results, ``jmp_lab.diagnostics.compiled_report``), the
ideal (each parameter's gradient, param, remainder and two moments read,
four written, plus the statistics pass's read of the gradient), their ratio,
and how many ``copy`` instructions of a moment leaf the compiled module holds
(the kernel updates the moments in place; a copy is a failed alias).

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/quantized_update.py

``--flat-kernels`` instead compiles the flat layout's update kernel alone
(``jmp_lab.kernels.fused_update`` on ``(rows, 256)`` buffers, fp32 master,
bf16 gradients and params; a row a block for 8-bit moments) for each GPU
backend, and prints its registers, spills and bytes per element against the
ideal: g, master and both moments read; master, both moments and the bf16
params written.
"""

from __future__ import annotations

import argparse
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jmp_lab  # noqa: E402
from jmp_lab.diagnostics import compiled_report  # noqa: E402

LAYER = [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,),
         (768,), (768,), (768, 3072), (3072,), (3072, 768), (768,)]
# B/param of each moment kind: stored bytes (8-bit: codes + scales/256).
MOMENT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1 + 4 / 256,
                "float8_e4m3fn": 1 + 4 / 256}


def gpt2_params(layers: int):
  shapes = {"wte": (50304, 768), "wpe": (1024, 768), "ln_f": (768,)}
  for i in range(layers):
    shapes.update({f"h{i}_{k}": s for k, s in enumerate(LAYER)})
  return {k: jax.ShapeDtypeStruct(s, jnp.bfloat16) for k, s in shapes.items()}


def ideal_bytes(params, moment: str, with_stats: bool = True) -> float:
  """Per param: read g, p, remainder, mu, nu; write p, remainder, mu, nu
  (issue 46's ideal: 14 B/param with 8-bit moments, 18 with bf16); and,
  ``with_stats``, the statistics pass's read of g (2 B). Small leaves keep
  fp32 moments."""
  total = 0.0
  for p in jax.tree_util.tree_leaves(params):
    m = MOMENT_BYTES[moment]
    if moment in ("int8", "float8_e4m3fn") and (
        p.size < 4096 or p.shape[-1] % 32):
      m = 4
    total += p.size * (2 + 2 + 2 + 2 * m + 2 + 2 + 2 * m
                       + (2 if with_stats else 0))
  return total


def report(params, moment: str):
  tx = jmp_lab.fused_adamw(3e-4, policy="p=bf16,c=bf16,o=f32",
                           master="remainder", backend="triton",
                           mu_dtype=moment, nu_dtype=moment)
  state = jax.eval_shape(tx.init, params)
  # Donated in the order the step returns them (params, state), as a
  # TrainState step does: jax pairs donated buffers with outputs of the same
  # shape and dtype in order, so (state, params) in and (params, state) out
  # would hand the new params the old bf16 moments' buffers, and XLA would
  # copy every moment around the kernel that updates them in place.
  step = lambda g, p, s: tx.update.new_params(g, s, p)  # noqa: E731
  rep = compiled_report(step, params, params, state, donate_argnums=(1, 2))
  copies = len(re.findall(r"= \S+ copy\(\S*(mu|nu)", rep.hlo_text))
  return rep, copies


def flat_kernel(backend: str, moment: str, rows: int):
  """The flat update kernel compiled for the H100: (registers, spill bytes,
  custom-call bytes per element, ideal bytes per element)."""
  from jmp_lab.kernels import quantized  # pylint: disable=import-outside-toplevel
  from jmp_lab.kernels.reference import AdamWConfig  # pylint: disable=import-outside-toplevel
  kind = quantized.kind_of(moment)
  config = AdamWConfig(0.9, 0.999, 1e-8, 1e-4, np.dtype(jnp.bfloat16),
                       mu_quant=kind, nu_quant=kind)
  sds = jax.ShapeDtypeStruct

  def moment_arg(second):
    if kind is None:
      return sds((rows, 256), jnp.float32)
    codes = quantized.zeros((1, 256), kind, second).codes.dtype
    return quantized.QuantizedMoment(sds((rows, 256), codes),
                                     sds((rows, 1), jnp.float32))

  args = (sds((rows, 256), jnp.bfloat16), sds((rows, 256), jnp.float32),
          moment_arg(False), moment_arg(True), sds((5,), jnp.float32),
          sds((2,), jnp.int32))
  rep = compiled_report(
      lambda *a: jmp_lab.kernels.fused_update(backend, config, *a), *args,
      donate_argnums=(1, 2, 3))
  (kernel,) = rep.pallas_kernels
  m = MOMENT_BYTES[moment]
  ideal = 2 + 4 + 2 * m + 4 + 2 * m + 2
  return kernel.registers, kernel.spill_bytes, rep.custom_call_bytes / (
      rows * 256), ideal


def main_flat_kernels(moments, rows: int = 132 * 8 * 4):
  print(f"jax {jax.__version__}, the flat update kernel on ({rows}, 256) "
        "buffers, compiled for h100")
  print("| backend | moments | registers | spill bytes | B/element | ideal "
        "B/element | ratio |")
  print("|---|---|---|---|---|---|---|")
  for backend in ("triton", "mosaic"):
    for moment in moments:
      registers, spills, moved, ideal = flat_kernel(backend, moment, rows)
      print(f"| {backend} | {moment} | {registers} | {spills} | {moved:.2f} "
            f"| {ideal:.2f} | {moved / ideal:.3f} |", flush=True)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--moments", default="float32,bfloat16,int8")
  parser.add_argument("--flat-kernels", action="store_true",
                      help="the flat layout's kernel alone, per backend")
  args = parser.parse_args(argv)
  if args.flat_kernels:
    main_flat_kernels([m for m in args.moments.split(",") if m != "bfloat16"])
    return
  params = gpt2_params(args.layers)
  n = sum(p.size for p in jax.tree_util.tree_leaves(params))
  print(f"jax {jax.__version__}, {n / 1e6:.1f}M params, compiled for h100")
  print("| moments | update GB | ideal GB (with stats) | ratio | ratio to the "
        "update-only ideal | B/param | moment copies | kernels |")
  print("|---|---|---|---|---|---|---|---|")
  for moment in args.moments.split(","):
    rep, copies = report(params, moment)
    moved, ideal = rep.bytes_accessed, ideal_bytes(params, moment)
    update_only = ideal_bytes(params, moment, with_stats=False)
    print(f"| {moment} | {moved / 1e9:.2f} | {ideal / 1e9:.2f} | "
          f"{moved / ideal:.2f} | {moved / update_only:.2f} | "
          f"{moved / n:.1f} | {copies} | {rep.kernels} |", flush=True)


if __name__ == "__main__":
  main()
