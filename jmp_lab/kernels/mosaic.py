"""The fused AdamW update as a Mosaic GPU kernel (``plgpu``), for Hopper.

jax 0.10 deprecates ``pl.pallas_call`` for Mosaic GPU in favour of
``plgpu.kernel`` + ``plgpu.emit_pipeline``, which is what this uses: a
persistent grid of one program per SM, each streaming its share of
``BLOCK_ROWS x LANES`` blocks through shared memory with TMA copies, several
blocks in flight (``max_concurrent_steps``) to hide memory latency.

``plgpu.kernel`` takes no ``input_output_aliases``, so unlike the Triton
kernel this one writes fresh output buffers. The kernel itself moves the same
bytes, but in a step that donates the state XLA copies each fresh output into
its donated buffer. On a non-finite step it copies the old values through, so
the outputs still equal the inputs.

8-bit moments (a block a row) are dequantized, updated and quantized again in
registers laid out by :func:`row_block_layout`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jmp_lab import _compat as compat
from jmp_lab.kernels import layout as flat_layout
from jmp_lab.kernels import quantized
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


def row_block_layout(block_rows: int, lanes: int, vector: int = 4):
  """Registers in which each row of a ``(block_rows, lanes)`` block lies in
  one warp: a warpgroup's four warps take ``block_rows / 4`` rows each, and
  a row's ``lanes`` elements spread over the warp's 32 threads in runs of
  ``vector`` (four: 16 bytes of fp32, the widest transfer that stays inside
  shared memory's 16-byte tiles; jax 0.12 refuses wider). A per-row maximum
  (an 8-bit moment's block scale: a row is a block in the flat layout) is
  then a reduction inside a thread and across one warp's lanes, with no
  shared memory. ``plgpu.Layout.WG_STRIDED`` reduces only over a whole
  array.
  """
  tiling = compat.mosaic_tiling(((block_rows, lanes),
                                 (block_rows // 4, lanes), (32 * vector,),
                                 (vector,)))
  return plgpu.Layout.TILED(tiling, warp_dims=(-6,), lane_dims=(-2,),
                            vector_dim=-1)


class _Moment(NamedTuple):
  """How one moment travels: ``kind`` None for an fp32 (or bf16) array, else
  its 8-bit kind. Its per-row scales stay in global memory, read and
  written as scalars (``_Registers``): a block's eight scales are 32 bytes,
  under the 128 a pipelined copy moves."""

  kind: str | None
  second: bool


@dataclasses.dataclass(frozen=True)
class _Registers:
  """How a block moves between memory and registers in ``layout``: the
  compiled kernel names the layout at every step; the interpreter knows no
  register layouts (and has no ``plgpu.load``), so there they are left out
  and a ref is read with ``ref[...]``."""

  layout: Any
  shape: tuple[int, int]
  interpret: bool

  def read(self, ref):
    return ref[...] if self.interpret else load(ref, self.layout)

  def scales_per_element(self, ref, row0):
    """The block's per-row scales (rows ``row0 ...`` of ``ref``, in global
    memory) broadcast along each row. Read as scalars: a warp's two scales
    are 8 bytes, and jax 0.12 refuses a vector transfer from global memory
    that covers less than a 32-byte sector."""
    rows = self.iota(0)
    wide = self.in_layout(jnp.zeros(self.shape, jnp.float32))
    for r in range(self.shape[0]):
      wide = jnp.where(rows == r, ref[row0 + r], wide)
    return wide

  def write_scales(self, ref, row0, per_row):
    """Writes a block's per-row scales (non-negative; one row a warp's) to
    rows ``row0 ...`` of ``ref`` as scalars (see ``scales_per_element``):
    each taken out of the per-row array by a masked maximum."""
    rows = (jax.lax.broadcasted_iota(jnp.int32, per_row.shape, 0)
            if self.interpret else plgpu.broadcasted_iota(
                jnp.int32, per_row.shape, 0, layout=self.layout.reduce(1)))
    for r in range(self.shape[0]):
      ref[row0 + r] = jnp.max(jnp.where(rows == r, per_row, 0.0), axis=0)

  def in_layout(self, x):
    return x if self.interpret else plgpu.layout_cast(x, self.layout)

  def moment_values(self, moment: "_Moment", stored, row0):
    """A moment's fp32 values from what is stored: the array itself, or an
    8-bit moment's codes dequantized with its scales."""
    main, scales = stored
    if moment.kind is None:
      return main
    return quantized.dequantize(
        main, self.scales_per_element(scales, row0), moment.kind,
        moment.second, broadcast=lambda per_element: per_element)

  def write_moment(self, moment: "_Moment", out_main, out_scales, value,
                   row0):
    """Stores a moment's new fp32 values: as they are, or quantized (codes
    in ``out_main``, the block's scales in ``out_scales``)."""
    if moment.kind is None:
      out_main[...] = value
      return
    codes, scales = quantized.quantize(value, moment.kind, moment.second,
                                       broadcast=self.per_element,
                                       sqrt=sqrt_via_rsqrt)
    out_main[...] = codes
    self.write_scales(out_scales, row0, scales)

  def copy_scales(self, ref, out_ref, row0):
    """A skipped step's scales, copied through unchanged."""
    for r in range(self.shape[0]):
      out_ref[row0 + r] = ref[row0 + r]

  def iota(self, axis: int):
    if self.interpret:
      return jax.lax.broadcasted_iota(jnp.int32, self.shape, axis)
    return plgpu.broadcasted_iota(jnp.int32, self.shape, axis,
                                  layout=self.layout)

  def per_element(self, per_row):
    """Per-row values broadcast along each row."""
    return self.in_layout(jax.lax.broadcast_in_dim(per_row, self.shape, (0,)))


def fused_update(config: AdamWConfig, g, p, mu, nu, hyper, flags, *,
                 max_concurrent_steps: int = 2,
                 interpret: bool = False) -> Outputs:
  """Runs the kernel over ``(rows, LANES)`` buffers; see ``reference``.

  An 8-bit moment (a :class:`~jmp_lab.kernels.quantized.QuantizedMoment` of
  the buffer, a scale a row) is read as codes and scales, dequantized in
  registers, updated and quantized again (``jmp_lab.kernels.quantized``'s
  maps), so no fp32 copy of it is ever in memory.

  ``interpret``: run under Pallas' Mosaic GPU interpreter (on the CPU, for
  tests). The interpreter has no ``plgpu.load``, layout casts or
  predicated copies out of ``emit_pipeline``, so there the registers are
  read with a plain ``ref[...]``, no layout is named, and the steps walk the
  blocks in global memory in a loop (no shared memory or steps in flight);
  the steps' arithmetic is the compiled kernel's.
  """
  rows, lanes = p.shape
  block_rows = flat_layout.BLOCK_ROWS
  programs = flat_layout.num_programs(rows * lanes)
  blocks = rows // block_rows
  if blocks % programs:
    raise ValueError(
        f"{blocks} blocks do not split evenly over {programs} programs; "
        f"build buffers with jmp_lab.kernels.layout")
  moments = tuple(_moment_of(config, m, second)
                  for m, second in ((mu, False), (nu, True)))
  if any(m.kind for m in moments):
    regs = row_block_layout(block_rows, lanes)
  else:
    # Every register array must share one layout, or Mosaic cannot combine
    # bf16 gradients with f32 moments. (This kernel ran on an H200 with it.)
    regs = plgpu.Layout.WG_STRIDED((block_rows, lanes), vec_size=2)
  access = _Registers(regs, (block_rows, lanes), interpret)
  read, iota = access.read, access.iota
  extra_dtype = jnp.float32 if config.half_dtype is None else config.half_dtype

  def body(hyper_ref, flags_ref, g_ref, p_ref, *refs):
    it = iter(refs)
    moment_in = [(next(it), next(it) if m.kind else None) for m in moments]
    p_out = next(it)
    moment_out = [(next(it), next(it) if m.kind else None) for m in moments]
    extra_out = next(it)
    program = jax.lax.axis_index("program")
    finite = flags_ref[FINITE] == 1
    boundary = flags_ref[DECAY_BOUNDARY]
    lr, inv_bias1, inv_bias2, scale, clip = (
        hyper_ref[i] for i in (LR, INV_BIAS1, INV_BIAS2, SCALE, CLIP))

    def step(indices, g_s, p_s, mu_s, nu_s, p_o, mu_o, nu_o, extra_o):
      (i,) = indices
      row0 = (i * programs + program) * block_rows
      p_val = read(p_s)
      # A moment as stored: its array (fp32 values or 8-bit codes), and an
      # 8-bit moment's scales (a ref in global memory; see _Registers).
      stored = [(read(main), scales)
                for main, (_, scales) in zip((mu_s, nu_s), moment_in)]

      @pl.when(finite)
      def _update():
        index = (iota(0) + row0) * lanes + iota(1)
        mu_val, nu_val = (access.moment_values(m, raw, row0)
                          for m, raw in zip(moments, stored))
        out = adamw_elementwise(config, read(g_s), p_val, mu_val, nu_val,
                                index < boundary, lr, inv_bias1, inv_bias2, scale,
                                clip,
                                sqrt=sqrt_via_rsqrt)
        p_o[...] = out.master
        for m, main, (_, out_scales), value in zip(
            moments, (mu_o, nu_o), moment_out, (out.mu, out.nu)):
          access.write_moment(m, main, out_scales, value, row0)
        extra_o[...] = out.extra

      @pl.when(jnp.logical_not(finite))
      def _skip():
        p_o[...] = p_val
        for main, (_, out_scales), (old, old_scales) in zip(
            (mu_o, nu_o), moment_out, stored):
          main[...] = old
          if out_scales is not None:
            access.copy_scales(old_scales, out_scales, row0)
        extra_o[...] = (jnp.zeros_like(p_val) if config.half_dtype is None
                        else p_val.astype(config.half_dtype))

    streamed = (g_ref, p_ref, *(main for main, _ in moment_in), p_out,
                *(main for main, _ in moment_out), extra_out)
    if interpret:
      # The interpreter cannot run emit_pipeline's predicated copies out:
      # the same steps on the blocks in global memory, one after another.
      def one_block(i, carry):
        block = pl.ds((i * programs + program) * block_rows, block_rows)
        step((i,), *(ref.at[block] for ref in streamed))
        return carry
      jax.lax.fori_loop(0, blocks // programs, one_block, 0)
      return
    spec = plgpu.BlockSpec((block_rows, lanes),
                           lambda i: (i * programs + program, 0))
    plgpu.emit_pipeline(
        step, grid=(blocks // programs,), in_specs=[spec] * 4,
        out_specs=[spec] * 4, max_concurrent_steps=max_concurrent_steps,
    )(*streamed)

  moment_operands = _moment_operands(moments, (mu, nu), rows)
  out_type = ((jax.ShapeDtypeStruct(p.shape, jnp.float32),)
              + tuple(jax.ShapeDtypeStruct(x.shape, x.dtype)
                      for x in moment_operands)
              + (jax.ShapeDtypeStruct(p.shape, extra_dtype),))
  new_p, *new_moments, extra = plgpu.kernel(
      body, out_type=out_type, grid=(programs,), grid_names=("program",),
      compiler_params=COMPILER_PARAMS,
      interpret=compat.mosaic_interpret_params() if interpret else None,
  )(hyper, flags, g, p, *moment_operands)
  new_mu, new_nu = _moments_from(moments, new_moments, (mu, nu))
  return Outputs(new_p, new_mu, new_nu, extra)


def _moment_of(config: AdamWConfig, moment, second: bool) -> _Moment:
  kind = config.quant_kind(second)
  if quantized.is_quantized(moment) != (kind is not None):
    name = "nu" if second else "mu"
    raise ValueError(
        f"{name} is {'an 8-bit' if kind is None else 'not an 8-bit'} moment "
        f"but config.{name}_quant is {kind!r}; build both from the same "
        f"fused_adamw settings")
  return _Moment(kind, second)


def _moment_operands(moments, arrays, rows: int) -> list:
  """The kernel's operands for the moments: an array, or an 8-bit moment's
  codes and its scales as one a row."""
  operands = []
  for moment, array in zip(moments, arrays):
    operands += ([array] if moment.kind is None
                 else [array.codes, array.scales.reshape(rows)])
  return operands


def _moments_from(moments, outputs, like) -> tuple:
  """The new moments from the kernel's outputs, shaped as ``like``."""
  it = iter(outputs)
  return tuple(next(it) if moment.kind is None else quantized.QuantizedMoment(
      next(it), next(it).reshape(old.scales.shape))
               for moment, old in zip(moments, like))


__all__ = [
    "COMPILER_PARAMS",
    "fused_update",
    "load",
    "row_block_layout",
    "sqrt_via_rsqrt",
]
