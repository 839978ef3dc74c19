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
from jmp_lab.kernels import quantized
from jmp_lab.kernels.reference import (CLIP, INV_BIAS1, INV_BIAS2, DECAY_BOUNDARY, FINITE,
                                       LR, NUM_HYPER, SCALE, AdamWConfig, Outputs,
                                       adamw_elementwise, element_indices)


def _kernel(config: AdamWConfig, moments: tuple, hyper_ref, flags_ref, *refs):
  # In: g, p, mu (codes, scales if 8-bit), nu (likewise). Out (aliased): p,
  # mu, nu (likewise); then the extra output.
  it = iter(refs)
  g_ref, p_ref = next(it), next(it)
  mu_in, nu_in = (tuple(next(it) for _ in range(n)) for n in moments)
  p_out = next(it)
  mu_out, nu_out = (tuple(next(it) for _ in range(n)) for n in moments)
  extra_out = next(it)
  finite = flags_ref[FINITE] == 1
  # Read outside pl.when: interpret mode only substitutes the program id at
  # the kernel's top level.
  row0 = pl.program_id(0) * g_ref.shape[0]

  @pl.when(finite)
  def _update():
    decays = element_indices(g_ref.shape, row0) < flags_ref[DECAY_BOUNDARY]
    mu, nu = (_load_moment(config, refs_, second)
              for refs_, second in ((mu_in, False), (nu_in, True)))
    out = adamw_elementwise(config, g_ref[...], p_ref[...], mu, nu, decays,
                            hyper_ref[LR], hyper_ref[INV_BIAS1],
                            hyper_ref[INV_BIAS2], hyper_ref[SCALE],
                            hyper_ref[CLIP])
    p_out[...] = out.master
    _store_moment(config, mu_out, out.mu, False)
    _store_moment(config, nu_out, out.nu, True)
    extra_out[...] = out.extra

  @pl.when(jnp.logical_not(finite))
  def _skip():
    # Master, m and v are aliased to their inputs: not writing them keeps
    # them. The extra output is a fresh buffer and must hold the old values.
    if config.half_dtype is None:
      extra_out[...] = jnp.zeros(extra_out.shape, extra_out.dtype)
    else:
      extra_out[...] = p_ref[...].astype(config.half_dtype)


def _load_moment(config, refs, second):
  """A moment block in fp32; an 8-bit one (a row is a quantization block)
  dequantized in registers."""
  if len(refs) == 1:
    return refs[0][...]
  kind = config.quant_kind(second)
  return quantized.dequantize(refs[0][...], refs[1][...], kind, second)


def _store_moment(config, refs, value, second):
  if len(refs) == 1:
    refs[0][...] = value
    return
  kind = config.quant_kind(second)
  codes, scales = quantized.quantize(value, kind, second)
  refs[0][...] = codes
  refs[1][...] = scales


def fused_update(config: AdamWConfig, g, p, mu, nu, hyper, flags, *,
                 interpret: bool, block_rows: int = flat_layout.BLOCK_ROWS,
                 num_warps: int = 4) -> Outputs:
  """Runs the kernel over ``(rows, LANES)`` buffers; see ``reference``.

  An 8-bit moment (a :class:`~jmp_lab.kernels.quantized.QuantizedMoment`
  of the buffer: a scale a row) is read and written as its codes and
  scales."""
  rows, lanes = p.shape
  if rows % block_rows:
    raise ValueError(f"rows {rows} is not a multiple of block_rows {block_rows}")
  block = pl.BlockSpec((block_rows, lanes), lambda i: (i, 0))
  per_row = pl.BlockSpec((block_rows,), lambda i: (i,))
  scalars = lambda n: pl.BlockSpec((n,), lambda i: (0,))  # noqa: E731
  extra_dtype = jnp.float32 if config.half_dtype is None else config.half_dtype
  # Triton blocks must be powers of two: pad the scalars to eight.
  hyper = jnp.pad(hyper, (0, 8 - NUM_HYPER))
  # A moment's arrays, specs and shapes: (codes, scales a row) when 8-bit.
  parts = [((m.codes, m.scales.reshape(rows)), (block, per_row))
           if quantized.is_quantized(m) else ((m,), (block,))
           for m in (mu, nu)]
  moment_arrays = [x for arrays, _ in parts for x in arrays]
  moment_specs = [s for _, specs in parts for s in specs]
  out_shape = [jax.ShapeDtypeStruct(p.shape, jnp.float32)] + [
      jax.ShapeDtypeStruct(x.shape, x.dtype) for x in moment_arrays] + [
          jax.ShapeDtypeStruct(p.shape, extra_dtype)]
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton  # GPU only
    compiler_params = pltriton.CompilerParams(num_warps=num_warps,
                                              num_stages=1)
  n_moment = len(moment_arrays)
  outs = pl.pallas_call(
      functools.partial(_kernel, config, tuple(len(a) for a, _ in parts)),
      out_shape=out_shape,
      grid=(rows // block_rows,),
      in_specs=[scalars(8), scalars(2), block, block] + moment_specs,
      out_specs=[block] + moment_specs + [block],
      # Operands: hyper, flags, g, p, moments -> outputs p, moments, extra.
      input_output_aliases={3 + k: k for k in range(1 + n_moment)},
      interpret=interpret,
      compiler_params=compiler_params,
      name="jmp_lab_fused_adamw",
  )(hyper, flags, g, p, *moment_arrays)
  new_p, *new_moments, extra = outs
  it = iter(new_moments)
  new_mu, new_nu = (quantized.QuantizedMoment(next(it), next(it).reshape(
      m.scales.shape)) if quantized.is_quantized(m) else next(it)
                    for m in (mu, nu))
  return Outputs(new_p, new_mu, new_nu, extra)


def flat_update(interpret: bool):
  """This module's flat-layout update, for the backend registry."""
  return functools.partial(fused_update, interpret=interpret)


__all__ = [
    "flat_update",
    "fused_update",
]
