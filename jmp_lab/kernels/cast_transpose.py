"""Cast to fp8 and transpose in one pass: a Pallas Triton kernel.

An fp8 weight-gradient GEMM on Hopper reads both operands with the
contracted (token) axis innermost, so it needs the transposed fp8 copy of
each output gradient, while the input-gradient GEMM reads the untransposed
one. XLA writes the first copy in the kernel that quantizes the gradient
(with its amax) and the second by reading it back and transposing it: 2 + 1
bytes, then 1 + 1, per element. Transformer Engine's ``cast_transpose``
writes both copies from one read of the 16-bit tensor (2 + 1 + 1 bytes),
and so does :func:`cast_transpose` here, which also computes the maxima
of ``|x|`` that delayed scaling records (see :func:`jmp_lab.fp8.write_amaxes`)
and, asked to, the column sums of ``x`` that are a Dense layer's bias
gradient (Transformer Engine's ``cast_transpose_dbias``).

Each program owns a fixed set of ``(rows, cols)`` tiles and writes their
largest ``|x|`` into its own slot of ``maxima``: no atomics, and the slots'
maximum is ``x``'s amax. The tile sizes are chosen so that the programs
number exactly ``len(maxima)`` (the fp8 history's length), each walking
``tiles_per_program`` tiles, so the maxima need no second reduction. Shapes
that do not split so, or whose rows or columns are not multiples of 32,
stay on XLA's path (:func:`tiling` returns None).

The quantization is the one XLA compiles for the GPU from Flax's
``fp8_ops.quantize``: ``x / scale`` in fp32, clipped to the format's
largest finite value, rounded to the nearest even fp8 value. The same body
runs in Pallas interpret mode (``interpret=True``) on any device, which is
how the CPU tests check it. The tile sizes come from compiling for an H100
without register spills, not from timings on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning

from jmp_lab.kernels.mesh import (axes_per_dim, explicitly_sharded,
                                  split_dims, split_over)
from jmp_lab.kernels.stats import part_maxima
from jmp_lab.kernels import platform
from jmp_lab.kernels.platform import quiet_triton_deprecation

# Tile edges tried, largest first; each tile is read once and written twice
# (no spills, at most 128 registers a thread, compiled for the H100:
# tests/test_kernels.py).
_ROW_TILES = (64, 32)
_COL_TILES = (128, 64, 32)
NUM_WARPS = 4
# Tiles larger than 64 x 64 (64 x 128, without column sums) run 8 warps, on
# every jax: at 4 warps (64 values a thread) jax 0.10's Triton gave them 80
# registers, jax 0.12's 168, half the resident warps.
LARGE_TILE_WARPS = 8
# With column sums, tiles of at most 64 x 64: a 64 x 128 tile and its sums
# take 168 registers a thread (no spills, but half the resident warps), a
# 64 x 64 one 92 with 2,048 columns and 96 with 3,072 (compiled for the
# H100; tests/test_kernels.py bounds them at 128).
_MAX_TILE_WITH_SUMS = 64 * 64


@dataclasses.dataclass(frozen=True)
class Tiling:
  """How :func:`cast_transpose` splits an ``(rows, cols)`` tensor.

  With ``column_sums`` the kernel also writes partial sums of the columns.
  Where each program's tiles lie in one column strip (``strips``), it walks
  them down the strip, sums its columns in registers and writes one row of
  partial sums; otherwise it walks its tiles along a row of tiles and
  writes one row of sums a tile.
  """

  tile_rows: int
  tile_cols: int
  tiles_per_program: int
  programs: int
  column_sums: bool = False
  strips: bool = False

  def sum_rows(self, rows: int) -> int:
    """How many rows of partial column sums the kernel writes."""
    row_tiles = rows // self.tile_rows
    return row_tiles // self.tiles_per_program if self.strips else row_tiles


def tiling(shape: tuple[int, ...], programs: int, column_sums: bool = False
           ) -> Optional[Tiling]:
  """The tiling of a 2-D ``shape`` over exactly ``programs`` programs, or
  None when there is none (XLA's path then quantizes). With
  ``column_sums``, a tiling whose programs each own one column strip is
  preferred (fewer partial sums to write).

  >>> tiling((8192, 768), 1024)
  Tiling(tile_rows=64, tile_cols=32, tiles_per_program=3, programs=1024, column_sums=False, strips=False)
  >>> tiling((8192, 2048), 1024, column_sums=True).strips   # 2 tiles a strip
  True
  >>> tiling((100, 768), 1024) is None   # rows not a multiple of 32
  True
  """
  if len(shape) != 2 or programs < 1:
    return None
  rows, cols = shape
  tilings = []
  for tile_rows in _ROW_TILES:
    for tile_cols in _COL_TILES:
      if rows % tile_rows or cols % tile_cols or (
          column_sums and tile_rows * tile_cols > _MAX_TILE_WITH_SUMS):
        continue
      tiles = (rows // tile_rows) * (cols // tile_cols)
      if tiles < programs or tiles % programs:
        continue
      per_program = tiles // programs
      strips = column_sums and (rows // tile_rows) % per_program == 0
      tilings.append(Tiling(tile_rows, tile_cols, per_program, programs,
                            column_sums, strips))
  # The largest tiles, preferring strips where there are column sums.
  return max(tilings, key=lambda t: t.strips, default=None)


def _kernel(scale_ref, x_ref, q_ref, q_t_ref, maxima_ref, *sums_ref,
            tiling: Tiling, row_tiles: int, col_tiles: int, fp8_max: float):
  program = pl.program_id(0)
  scale = scale_ref[0]
  rows, cols = tiling.tile_rows, tiling.tile_cols

  def where(index):  # the (row tile, column tile) of a tile index
    if tiling.strips:  # down a column strip
      return index % row_tiles, index // row_tiles
    return index // col_tiles, index % col_tiles

  def tile(k, carry):
    # (The column sums are carried only down a strip: a carry the loop
    # does not use still costs registers.)
    running_max, *column_sums = carry
    row_tile, col_tile = where(program * tiling.tiles_per_program + k)
    row = pl.ds(pl.multiple_of(row_tile * rows, rows), rows)
    col = pl.ds(pl.multiple_of(col_tile * cols, cols), cols)
    x = x_ref[row, col].astype(jnp.float32)
    q = jnp.clip(x / scale, -fp8_max, fp8_max)
    q_ref[row, col] = q.astype(q_ref.dtype)
    q_t_ref[col, row] = q.T.astype(q_t_ref.dtype)
    if tiling.strips:
      column_sums = [column_sums[0] + jnp.sum(x, axis=0)]
    elif tiling.column_sums:  # a row of sums for each tile
      sums_ref[0][pl.ds(row_tile, 1), col] = jnp.sum(x, axis=0)[None, :]
    return (jnp.maximum(running_max, jnp.max(jnp.abs(x))), *column_sums)

  carry = (jnp.float32(0),)
  if tiling.strips:
    carry += (jnp.zeros((cols,), jnp.float32),)
  largest, *column_sums = jax.lax.fori_loop(0, tiling.tiles_per_program,
                                            tile, carry)
  maxima_ref[...] = jnp.full((1,), largest, jnp.float32)
  if tiling.strips:
    _, col_tile = where(program * tiling.tiles_per_program)
    strip_row = program % (row_tiles // tiling.tiles_per_program)
    col = pl.ds(pl.multiple_of(col_tile * cols, cols), cols)
    sums_ref[0][pl.ds(strip_row, 1), col] = column_sums[0][None, :]


def cast_transpose(x: jax.Array, scale: jax.Array, dtype, tiling: Tiling, *,
                   interpret: bool = False) -> tuple[jax.Array, ...]:
  """``(q, q.T, maxima)``: ``x`` (2-D, 16-bit) quantized to the fp8
  ``dtype`` with ``scale`` (``q = x / scale``, clipped), its transpose, and
  ``tiling.programs`` partial maxima of ``|x|`` (fp32). With
  ``tiling.column_sums``, a fourth result: partial sums of ``x``'s columns
  in fp32, ``tiling.sum_rows(rows)`` rows of them (their sum over rows is
  the column sum: a Dense layer's bias gradient, which Transformer Engine's
  ``cast_transpose_dbias`` computes in the same pass).

  >>> import jax.numpy as jnp
  >>> x = jnp.tile(jnp.arange(128, dtype=jnp.bfloat16) / 8, (64, 1))
  >>> x_tiling = tiling(x.shape, 2)   # two programs: 64 columns each
  >>> q, q_t, maxima = cast_transpose(x, jnp.float32(0.5), jnp.float8_e5m2,
  ...                                 x_tiling, interpret=True)
  >>> q.dtype, q_t.shape, maxima.tolist()
  (dtype(float8_e5m2), (128, 64), [7.875, 15.875])
  >>> bool((q_t.T == q).all()), float(q[0, 2])   # (2 / 8) / 0.5
  (True, 0.5)
  >>> *_, sums = cast_transpose(x, jnp.float32(0.5), jnp.float8_e5m2,
  ...     tiling(x.shape, 2, column_sums=True), interpret=True)
  >>> sums.shape, float(sums.sum(axis=0)[2])   # 64 rows of 2 / 8
  ((1, 128), 16.0)
  """
  rows, cols = x.shape
  fp8_max = float(jnp.finfo(dtype).max)
  kernel = functools.partial(
      _kernel, tiling=tiling, row_tiles=rows // tiling.tile_rows,
      col_tiles=cols // tiling.tile_cols, fp8_max=fp8_max)

  def whole(shape):  # each program slices its own tiles
    return pl.BlockSpec(shape, lambda p: (0,) * len(shape))

  out_specs = [whole(x.shape), whole((cols, rows)),
               pl.BlockSpec((1,), lambda p: (p,))]
  out_shape = [jax.ShapeDtypeStruct(x.shape, dtype),
               jax.ShapeDtypeStruct((cols, rows), dtype),
               jax.ShapeDtypeStruct((tiling.programs,), jnp.float32)]
  if tiling.column_sums:
    sums_shape = (tiling.sum_rows(rows), cols)
    out_specs.append(whole(sums_shape))
    out_shape.append(jax.ShapeDtypeStruct(sums_shape, jnp.float32))
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton  # GPU only
    quiet_triton_deprecation()
    warps = (LARGE_TILE_WARPS
             if tiling.tile_rows * tiling.tile_cols > _MAX_TILE_WITH_SUMS
             else NUM_WARPS)
    compiler_params = pltriton.CompilerParams(num_warps=warps,
                                              num_stages=2)
  return tuple(pl.pallas_call(
      kernel, grid=(tiling.programs,),
      in_specs=[whole((1,)), whole(x.shape)],
      out_specs=tuple(out_specs), out_shape=tuple(out_shape),
      compiler_params=compiler_params, interpret=interpret,
      name="fp8_cast_transpose",
  )(jnp.reshape(scale.astype(jnp.float32), (1,)), x))


# ---------------------------------------------------------------------------
# The op: the kernel where it runs (CUDA, a tiling), XLA's quantization
# elsewhere; split by rows across devices; a vmap rule.
# ---------------------------------------------------------------------------


def _xla_path(x, scale, quantize: Callable, programs: int,
              column_sums: bool = False):
  q = quantize(x, scale)
  maxima = part_maxima(x, programs)
  if maxima is None:  # every slot the amax: their maximum is still x's amax
    maxima = jnp.full((programs,), jnp.max(jnp.abs(x).astype(jnp.float32),
                                           initial=0.0))
  if column_sums:
    return q, q.T, maxima, jnp.sum(x.astype(jnp.float32), axis=0)
  return q, q.T, maxima


def _local(x, scale, dtype_name: str, programs: int, quantize: Callable,
           column_sums: bool):
  """One device's rows: the kernel, or XLA's path where its rows do not
  tile (``quantize`` is XLA's formula)."""
  local_tiling = tiling(x.shape, programs, column_sums)
  if local_tiling is None:
    return _xla_path(x, scale, quantize, programs, column_sums)
  out = cast_transpose(x, scale, jnp.dtype(dtype_name), local_tiling)
  if column_sums:  # the strips' partial sums, summed
    return out[:3] + (jnp.sum(out[3], axis=0),)
  return out


def _block_axes(sharding) -> tuple[tuple, tuple]:
  """The mesh axes that split ``x``'s rows and its columns (``()`` where
  whole): each device quantizes and transposes its own block."""
  rows, columns = axes_per_dim(sharding, 2)
  return rows, columns


def _partition(dtype_name, programs, quantize, column_sums, mesh, arg_shapes,
               result_shape):
  rows, columns = _block_axes(arg_shapes[0].sharding)

  def lower(x, scale):
    out = _local(x, scale, dtype_name, programs, quantize, column_sums)
    if not rows and not columns:
      return out
    # Each device holds a block: the maxima's maximum over all of them, the
    # column sums' sum over the devices that split the rows.
    q, q_t, maxima = out[:3]
    combined = (q, q_t, jax.lax.pmax(maxima, rows + columns))
    if not column_sums:
      return combined
    return combined + ((jax.lax.psum(out[3], rows) if rows else out[3]),)

  return (mesh, lower, _infer(dtype_name, programs, quantize, column_sums,
                              mesh, arg_shapes, result_shape),
          (split_dims(mesh, rows, columns), split_over(mesh, (), 1)))


def _infer(dtype_name, programs, quantize, column_sums, mesh, arg_shapes,
           result_shape):
  """``q`` split as ``x`` is (rows and columns), ``q.T`` transposed, the
  maxima whole, the column sums split as the columns."""
  del dtype_name, programs, quantize, result_shape
  rows, columns = _block_axes(arg_shapes[0].sharding)
  sums = (split_over(mesh, columns, 1),) if column_sums else ()
  return ((split_dims(mesh, rows, columns), split_dims(mesh, columns, rows),
           split_over(mesh, (), 1)) + sums)


def _partitioned(column_sums: bool):
  op = custom_partitioning(_local, static_argnums=(2, 3, 4, 5))
  op.def_partition(
      partition=_partition, infer_sharding_from_operands=_infer,
      sharding_rule="m n, s -> m n, n m, p" + (", n" if column_sums else ""))
  return op


_PARTITIONED = {column_sums: _partitioned(column_sums)
                for column_sums in (False, True)}


def quantize_transpose(x: jax.Array, scale: jax.Array, dtype,
                       programs: int, quantize: Callable, *,
                       column_sums: bool = False) -> tuple[jax.Array, ...]:
  """``(q, q.T, maxima)`` of a 2-D ``x``: :func:`cast_transpose` in a step
  compiled for CUDA where ``x`` is 16-bit and :func:`tiling` tiles it over
  ``programs``; elsewhere XLA's path: ``quantize(x, scale)`` (the fp8
  tensor), its transpose, and ``x``'s maxima over ``programs`` equal parts.
  With ``column_sums``, a fourth result: ``x``'s column sums in fp32 (the
  bias gradient of a Dense layer whose output gradient ``x`` is), from the
  same read of ``x``.

  Used by :func:`jmp_lab.fp8.dot_general` for output gradients, which XLA
  would otherwise quantize and then transpose in a second pass (and read
  a third time for the bias gradient). Across devices it runs on each
  device's rows (``custom_partitioning``; the maxima combined with a
  ``pmax``, the column sums with a ``psum``); under ``vmap``, or where ``x``
  is sharded in its type (explicit mesh axes), or where jax has no Pallas
  Triton backend, it takes XLA's path.
  """
  if (x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float16)
      or tiling(x.shape, programs, column_sums) is None
      or explicitly_sharded(x)  # a Pallas ref cannot be sliced so
      # A jax without Pallas' Triton backend (deprecated in 0.11).
      or not platform.importable("jax.experimental.pallas.triton")):
    return _xla_path(x, scale, quantize, programs, column_sums)
  dtype_name = jnp.dtype(dtype).name
  scale = jnp.reshape(scale.astype(jnp.float32), (1,))

  def xla(x, scale):
    return _xla_path(x, scale[0], quantize, programs, column_sums)

  def kernel(x, scale):
    return _PARTITIONED[column_sums](x, scale, dtype_name, programs, quantize,
                                     column_sums)

  return platform.kernel_on_cuda(kernel, xla, x, scale)


__all__ = [
    "cast_transpose",
    "quantize_transpose",
    "Tiling",
    "tiling",
]
