"""How the multi-tensor kernels' compile time grows with the leaves in one launch.

Issue 12 asks for at most 4 kernels in the optimizer update. The tree
layout's kernels (``jmp_lab.kernels.multi_tensor``) handle each leaf in a
conditional block of its own, because a Pallas kernel cannot pick a buffer
by a runtime index (apex's table of pointers has no Pallas equivalent). One
launch over all of GPT-2-small's 197 leaves would meet the goal, if it
compiled in reasonable time. This script compiles, for an H100 on a machine
without a GPU, both Triton kernels over ``N`` leaves in one launch, and a
Mosaic GPU version of the update over the same leaves, and prints the
seconds each compile takes.

The Mosaic GPU update here is a compile-time probe: the multi-tensor design
written with ``plgpu.kernel`` and one ``emit_pipeline`` per leaf (each of
the 132 programs streams every ``P``-th block of each leaf through shared
memory). It is compiled, never run, and nothing in the library calls it.

Usage (compile times are one run each; the machine's speed varies, so
compare the rows of one run)::

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/multi_tensor_compile.py \\
      --leaves 8,16,32 --mosaic-leaves 8,32
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jmp_lab.diagnostics import compile_for_gpu  # noqa: E402
from jmp_lab.kernels import multi_tensor  # noqa: E402
from jmp_lab.kernels.reference import (CLIP, FINITE, INV_BIAS1,  # noqa: E402
                                       INV_BIAS2, LR, SCALE, AdamWConfig,
                                       adamw_elementwise)

# GPT-2-small's leaf shapes, in the order one layer holds them.
GPT2_SHAPES = [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,),
               (768,), (768,), (768, 3072), (3072,), (3072, 768), (768,)]
LANES = 256
PROGRAMS = 132  # one per SM of an H100
CONFIG = AdamWConfig(0.9, 0.999, 1e-8, 1e-4, np.dtype(jnp.bfloat16))
SDS = jax.ShapeDtypeStruct


def leaf_shapes(n: int) -> list[tuple[int, ...]]:
  return [GPT2_SHAPES[i % len(GPT2_SHAPES)] for i in range(n)]


def decays(shapes) -> list[bool]:
  return [len(s) > 1 for s in shapes]


def triton_seconds(n: int) -> tuple[float, float]:
  """Seconds to compile the statistics and the update kernel over ``n``
  leaves in one launch each."""
  shapes = leaf_shapes(n)
  grads = [SDS(s, jnp.bfloat16) for s in shapes]
  state = [SDS(s, jnp.float32) for s in shapes]
  saved = multi_tensor.LEAVES_PER_LAUNCH
  multi_tensor.LEAVES_PER_LAUNCH = n
  try:
    start = time.perf_counter()
    compile_for_gpu(lambda g: multi_tensor.grad_stats(
        g, jnp.float32(1.0), interpret=False), grads)
    stats = time.perf_counter() - start
    start = time.perf_counter()
    compile_for_gpu(
        lambda g, p, mu, nu, hyper, flags: multi_tensor.update(
            CONFIG, decays(shapes), g, p, mu, nu, hyper, flags,
            write_extra=True, interpret=False),
        grads, state, state, state, SDS((5,), jnp.float32),
        SDS((2,), jnp.int32), donate_argnums=(1, 2, 3))
    return stats, time.perf_counter() - start
  finally:
    multi_tensor.LEAVES_PER_LAUNCH = saved


def _block_rows(rows: int) -> int:
  return next(b for b in (8, 4, 2, 1) if rows % b == 0)


def mosaic_probe_update(g, p, mu, nu, hyper, flags, leaf_decays):
  """The multi-tensor update as one Mosaic GPU kernel (compile probe only).

  Leaves are viewed as ``(rows, 256)``; program ``k`` of ``PROGRAMS``
  pipelines blocks ``k, k + PROGRAMS, ...`` of each leaf. Writes fresh
  outputs (``plgpu.kernel`` takes no aliases).
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jmp_lab.kernels.mosaic import COMPILER_PARAMS, load, sqrt_via_rsqrt
  n = len(g)
  rows = [x.size // LANES for x in p]

  def body(hyper_ref, flags_ref, *refs):
    groups = [refs[k * n:(k + 1) * n] for k in range(8)]
    program = jax.lax.axis_index("program")
    finite = flags_ref[FINITE] == 1
    scalars = [hyper_ref[i] for i in (LR, INV_BIAS1, INV_BIAS2, SCALE, CLIP)]
    for i in range(n):
      block = _block_rows(rows[i])
      blocks = rows[i] // block
      layout = plgpu.Layout.WG_STRIDED((block, LANES), vec_size=2)

      def step(_, g_s, p_s, mu_s, nu_s, p_o, mu_o, nu_o, half_o, i=i,
               layout=layout):
        old = tuple(load(ref, layout) for ref in (p_s, mu_s, nu_s))

        @pl.when(finite)
        def _update():
          out = adamw_elementwise(CONFIG, load(g_s, layout), *old,
                                  jnp.bool_(leaf_decays[i]), *scalars,
                                  sqrt=sqrt_via_rsqrt)
          for ref, value in zip((p_o, mu_o, nu_o, half_o), out):
            ref[...] = value

        @pl.when(jnp.logical_not(finite))
        def _keep():
          for ref, value in zip((p_o, mu_o, nu_o), old):
            ref[...] = value
          half_o[...] = old[0].astype(CONFIG.half_dtype)

      spec = plgpu.BlockSpec((block, LANES),
                             lambda j, k=program: (j * PROGRAMS + k, 0))

      @pl.when(program < blocks)
      def _leaf(i=i, step=step, spec=spec, blocks=blocks):
        plgpu.emit_pipeline(
            step, grid=((blocks - program + PROGRAMS - 1) // PROGRAMS,),
            in_specs=[spec] * 4, out_specs=[spec] * 4,
            max_concurrent_steps=2)(*(group[i] for group in groups))

  shapes = [(r, LANES) for r in rows]
  out_type = tuple(SDS(s, jnp.float32) for _ in range(3) for s in shapes) + \
      tuple(SDS(s, CONFIG.half_dtype) for s in shapes)
  return plgpu.kernel(body, out_type=out_type, grid=(PROGRAMS,),
                      grid_names=("program",),
                      compiler_params=COMPILER_PARAMS)(
      hyper, flags,
      *[x.reshape(-1, LANES) for group in (g, p, mu, nu) for x in group])


def mosaic_seconds(n: int) -> float:
  shapes = leaf_shapes(n)
  grads = [SDS(s, jnp.bfloat16) for s in shapes]
  state = [SDS(s, jnp.float32) for s in shapes]
  start = time.perf_counter()
  compile_for_gpu(
      lambda g, p, mu, nu, hyper, flags: mosaic_probe_update(
          g, p, mu, nu, hyper, flags, decays(shapes)),
      grads, state, state, state, SDS((5,), jnp.float32),
      SDS((2,), jnp.int32))
  return time.perf_counter() - start


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--leaves", default="8,16,32",
                      help="leaves per launch for the Triton kernels")
  parser.add_argument("--mosaic-leaves", default="8,32",
                      help="leaves for the Mosaic GPU probe ('' skips it)")
  args = parser.parse_args(argv)
  print(f"# compiled for an H100 without a GPU; jax {jax.__version__}; "
        "seconds of one compile each")
  print("| kernel | leaves in one launch | compile s | s per leaf |")
  print("|---|---|---|---|")
  for n in [int(x) for x in args.leaves.split(",") if x]:
    stats, update = triton_seconds(n)
    print(f"| Triton statistics | {n} | {stats:.1f} | {stats / n:.2f} |")
    print(f"| Triton update | {n} | {update:.1f} | {update / n:.2f} |")
  for n in [int(x) for x in args.mosaic_leaves.split(",") if x]:
    seconds = mosaic_seconds(n)
    print(f"| Mosaic GPU update (probe) | {n} | {seconds:.1f} | "
          f"{seconds / n:.2f} |")


if __name__ == "__main__":
  main()
