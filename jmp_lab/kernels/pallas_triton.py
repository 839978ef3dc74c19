"""The fused AdamW update as a ``pl.pallas_call`` kernel: Triton and interpret.

One kernel body serves two backends:

* ``"triton"`` -- lowered through Pallas' Triton backend, for NVIDIA GPUs
  before Hopper (deprecated upstream in jax 0.11, still present);
* ``"interpret"`` -- Pallas interpret mode, which runs the same body on any
  device; the CPU tests use it.

The master, m and v are updated in place (``input_output_aliases``; donate the
optimizer state to make it real). On a non-finite step the kernel writes none
of them: only the extra output (the half copy, or a zero update) is written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jmp_lab.kernels import layout as flat_layout
from jmp_lab.kernels.reference import (CLIP, INV_BIAS1, INV_BIAS2, DECAY_BOUNDARY, FINITE,
                                       LR, NUM_HYPER, SCALE, AdamWConfig, Outputs,
                                       adamw_elementwise, element_indices)


def _kernel(config: AdamWConfig, hyper_ref, flags_ref, g_ref, p_ref, mu_ref,
            nu_ref, p_out, mu_out, nu_out, extra_out):
  finite = flags_ref[FINITE] == 1
  # Read outside pl.when: interpret mode only substitutes the program id at
  # the kernel's top level.
  row0 = pl.program_id(0) * g_ref.shape[0]

  @pl.when(finite)
  def _update():
    decays = element_indices(g_ref.shape, row0) < flags_ref[DECAY_BOUNDARY]
    out = adamw_elementwise(config, g_ref[...], p_ref[...], mu_ref[...],
                            nu_ref[...], decays, hyper_ref[LR],
                            hyper_ref[INV_BIAS1], hyper_ref[INV_BIAS2],
                            hyper_ref[SCALE], hyper_ref[CLIP])
    p_out[...] = out.master
    mu_out[...] = out.mu
    nu_out[...] = out.nu
    extra_out[...] = out.extra

  @pl.when(jnp.logical_not(finite))
  def _skip():
    # Master, m and v are aliased to their inputs: not writing them keeps
    # them. The extra output is a fresh buffer and must hold the old values.
    if config.half_dtype is None:
      extra_out[...] = jnp.zeros(extra_out.shape, extra_out.dtype)
    else:
      extra_out[...] = p_ref[...].astype(config.half_dtype)


def fused_update(config: AdamWConfig, g, p, mu, nu, hyper, flags, *,
                 interpret: bool, block_rows: int = flat_layout.BLOCK_ROWS,
                 num_warps: int = 4) -> Outputs:
  """Runs the kernel over ``(rows, LANES)`` buffers; see ``reference``."""
  rows, lanes = p.shape
  if rows % block_rows:
    raise ValueError(f"rows {rows} is not a multiple of block_rows {block_rows}")
  block = pl.BlockSpec((block_rows, lanes), lambda i: (i, 0))
  scalars = lambda n: pl.BlockSpec((n,), lambda i: (0,))  # noqa: E731
  extra_dtype = jnp.float32 if config.half_dtype is None else config.half_dtype
  # Triton blocks must be powers of two: pad the scalars to eight.
  hyper = jnp.pad(hyper, (0, 8 - NUM_HYPER))
  out_shape = (jax.ShapeDtypeStruct(p.shape, jnp.float32),) * 3 + (
      jax.ShapeDtypeStruct(p.shape, extra_dtype),)
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton  # GPU only
    compiler_params = pltriton.CompilerParams(num_warps=num_warps,
                                              num_stages=1)
  outs = pl.pallas_call(
      functools.partial(_kernel, config),
      out_shape=out_shape,
      grid=(rows // block_rows,),
      in_specs=[scalars(8), scalars(2), block, block, block, block],
      out_specs=[block] * 4,
      # Operands: hyper, flags, g, p, mu, nu -> outputs p, mu, nu, extra.
      input_output_aliases={3: 0, 4: 1, 5: 2},
      interpret=interpret,
      compiler_params=compiler_params,
      name="jmp_lab_fused_adamw",
  )(hyper, flags, g, p, mu, nu)
  return Outputs(*outs)


def flat_update(interpret: bool):
  """This module's flat-layout update, for the backend registry."""
  return functools.partial(fused_update, interpret=interpret)


__all__ = [
    "flat_update",
    "fused_update",
]
