"""The fused AdamW update as a Mosaic GPU kernel (``plgpu``), for Hopper.

jax 0.10 deprecates ``pl.pallas_call`` for Mosaic GPU in favour of
``plgpu.kernel`` + ``plgpu.emit_pipeline``, which is what this uses: a
persistent grid of one program per SM, each streaming its share of
``BLOCK_ROWS x LANES`` blocks through shared memory with TMA copies, several
blocks in flight (``max_concurrent_steps``) to hide memory latency.

``plgpu.kernel`` takes no ``input_output_aliases``, so unlike the Triton
kernel this one writes fresh output buffers (the bytes moved are the same; with
a donated state XLA frees the old ones right after). On a non-finite step it
copies the old values through, so the outputs still equal the inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jmp_lab import _compat as compat
from jmp_lab.kernels import layout as flat_layout
from jmp_lab.kernels.reference import (CLIP, INV_BIAS1, INV_BIAS2, DECAY_BOUNDARY, FINITE,
                                       LR, SCALE, AdamWConfig, Outputs,
                                       adamw_elementwise)


# The lowering the kernel was written and tested for. jax 0.11 changed
# plgpu.kernel's default to the Warpgroup semantics; "Lane" exists in both.
COMPILER_PARAMS = plgpu.CompilerParams(
    lowering_semantics=plgpu.LoweringSemantics.Lane)

def load(ref, layout):
  """A whole ref into registers in ``layout`` (the call differs between jax
  versions: :func:`jmp_lab._compat.mosaic_load`)."""
  return compat.mosaic_load(plgpu, ref, layout)


def sqrt_via_rsqrt(x):
  """sqrt for Mosaic GPU, which lowers rsqrt but not sqrt (0 stays 0).

  x * rsqrt(x) can differ from a correctly rounded sqrt in the last bit, so
  this backend matches the reference to a few ulps rather than one.
  """
  positive = x > 0
  return jnp.where(positive, x * jax.lax.rsqrt(jnp.where(positive, x, 1.0)),
                   0.0)


def fused_update(config: AdamWConfig, g, p, mu, nu, hyper, flags, *,
                 max_concurrent_steps: int = 2) -> Outputs:
  """Runs the kernel over ``(rows, LANES)`` buffers; see ``reference``."""
  rows, lanes = p.shape
  block_rows = flat_layout.BLOCK_ROWS
  programs = flat_layout.num_programs(rows * lanes)
  blocks = rows // block_rows
  if blocks % programs:
    raise ValueError(
        f"{blocks} blocks do not split evenly over {programs} programs; "
        f"build buffers with jmp_lab.kernels.layout")
  # Every register array must share one layout, or Mosaic cannot combine
  # bf16 gradients with f32 moments.
  regs = plgpu.Layout.WG_STRIDED((block_rows, lanes), vec_size=2)
  extra_dtype = jnp.float32 if config.half_dtype is None else config.half_dtype

  def body(hyper_ref, flags_ref, g_ref, p_ref, mu_ref, nu_ref,
           p_out, mu_out, nu_out, extra_out):
    program = jax.lax.axis_index("program")
    finite = flags_ref[FINITE] == 1
    boundary = flags_ref[DECAY_BOUNDARY]
    lr, inv_bias1, inv_bias2, scale, clip = (
        hyper_ref[i] for i in (LR, INV_BIAS1, INV_BIAS2, SCALE, CLIP))

    def step(indices, g_s, p_s, mu_s, nu_s, p_o, mu_o, nu_o, extra_o):
      (i,) = indices
      p_val, mu_val, nu_val = (load(ref, regs) for ref in (p_s, mu_s, nu_s))

      @pl.when(finite)
      def _update():
        row0 = (i * programs + program) * block_rows
        index = (plgpu.broadcasted_iota(jnp.int32, (block_rows, lanes), 0,
                                        layout=regs) + row0) * lanes + \
            plgpu.broadcasted_iota(jnp.int32, (block_rows, lanes), 1,
                                   layout=regs)
        out = adamw_elementwise(config, load(g_s, regs), p_val, mu_val, nu_val,
                                index < boundary, lr, inv_bias1, inv_bias2, scale,
                                clip,
                                sqrt=sqrt_via_rsqrt)
        p_o[...] = out.master
        mu_o[...] = out.mu
        nu_o[...] = out.nu
        extra_o[...] = out.extra

      @pl.when(jnp.logical_not(finite))
      def _skip():
        p_o[...] = p_val
        mu_o[...] = mu_val
        nu_o[...] = nu_val
        extra_o[...] = (jnp.zeros_like(p_val) if config.half_dtype is None
                        else p_val.astype(config.half_dtype))

    spec = plgpu.BlockSpec((block_rows, lanes),
                           lambda i: (i * programs + program, 0))
    plgpu.emit_pipeline(
        step, grid=(blocks // programs,), in_specs=[spec] * 4,
        out_specs=[spec] * 4, max_concurrent_steps=max_concurrent_steps,
    )(g_ref, p_ref, mu_ref, nu_ref, p_out, mu_out, nu_out, extra_out)

  out_type = (jax.ShapeDtypeStruct(p.shape, jnp.float32),) * 3 + (
      jax.ShapeDtypeStruct(p.shape, extra_dtype),)
  outs = plgpu.kernel(body, out_type=out_type, grid=(programs,),
                      grid_names=("program",),
                      compiler_params=COMPILER_PARAMS)(hyper, flags, g, p,
                                                       mu, nu)
  return Outputs(*outs)


__all__ = [
    "COMPILER_PARAMS",
    "fused_update",
    "load",
    "sqrt_via_rsqrt",
]
