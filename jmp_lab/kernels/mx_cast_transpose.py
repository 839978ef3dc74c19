"""MXFP8 quantization along both axes in one pass: a Pallas Triton kernel.

A block-scaled Dense layer reads each activation and each output gradient
twice: blocked along its features (the forward, or the input-gradient GEMM)
and blocked along its tokens, transposed (the weight-gradient GEMM). XLA
quantizes each of the two layouts in two passes of its own (the block
maxima, then the values), so a 16-bit tensor is read four times to write two
8-bit copies. :func:`mx_cast_transpose` reads it once: each program loads
32 x 32 tiles, takes each tile's row maxima and column maxima, and writes
both E4M3 copies (the second transposed) with their E8M0 scales, as
Transformer Engine's MXFP8 ``quantize`` writes its row-wise and
column-wise data in one kernel. It is :mod:`jmp_lab.kernels.cast_transpose`
(Hopper's per-tensor fp8) made block-scaled, dispatched as that one is: the
kernel in a step compiled for CUDA, split by rows and columns across
devices (``custom_partitioning``), XLA's path elsewhere; under ``vmap``
the mapped inputs' rows joined, one call for all.

The numbers are those of
:func:`jmp_lab._src.numerics.block_quantize.quantize_mxfp8` bit for bit
(the OCP MX spec's scale, rounded up, from the maximum's exponent and
mantissa bits; values ``x / 2**e`` clipped to 448, rounded to nearest even
into E4M3), which ``tests/test_block_scaled.py`` checks in Pallas interpret
mode. The tile (32 x 128 a program, 4 warps) comes from compiling for the
B200 and H100 targets without register spills, not from GPU timings.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning

from jmp_lab.kernels import platform
from jmp_lab.kernels.mesh import axes_per_dim, explicitly_sharded, split_dims
from jmp_lab.kernels.platform import quiet_triton_deprecation

#: Values per E8M0 scale (the OCP MX block).
BLOCK = 32
# Column blocks a program walks (the widest that divides the columns).
_SUB_TILES = (4, 2, 1)
NUM_WARPS = 4
_E4M3_MAX = 448.0
_E8M0_BIAS = 127


def fits(shape: tuple[int, ...]) -> bool:
  """Whether :func:`mx_cast_transpose` takes a tensor of ``shape``: 2-D,
  both axes whole blocks of 32.

  >>> fits((8192, 2048)), fits((100, 2048)), fits((2, 64, 64))
  (True, False, False)
  """
  return len(shape) == 2 and all(d % BLOCK == 0 and d > 0 for d in shape)


def _scale_bits(amax: jax.Array, has_nan: jax.Array) -> jax.Array:
  """The E8M0 scale's bits (int32) for block maxima ``amax`` (fp32, >= 0):
  the smallest ``e`` with ``448 * 2**e >= amax``, read from the maximum's
  own bits as ``quantize_mxfp8`` reads them from ``frexp`` (no division,
  no rounding): with ``amax = (1 + M / 2**23) * 2**(E - 127)``, ``e`` is
  ``E - 135`` when ``1 + M / 2**23 <= 1.75`` and ``E - 134`` otherwise;
  clamped to [-126, 127], 0 for a zero block, NaN (255) for a block with a
  NaN or an infinity."""
  bits = jax.lax.bitcast_convert_type(amax, jnp.int32)
  exponent = jax.lax.shift_right_logical(bits, 23) & 0xFF
  mantissa = bits & 0x7FFFFF
  e = jnp.where(mantissa <= 0x600000, exponent - 135, exponent - 134)
  e = jnp.clip(jnp.where(amax > 0, e, 0), 1 - _E8M0_BIAS, _E8M0_BIAS)
  finite = (amax < jnp.inf) & jnp.logical_not(has_nan)
  return jnp.where(finite, e + _E8M0_BIAS, 255)


def _scale(bits: jax.Array) -> jax.Array:
  """E8M0 bits (int32, 1..255) as the fp32 power of two (255: NaN)."""
  power = jax.lax.bitcast_convert_type(
      jax.lax.shift_left(jnp.minimum(bits, 254), 23), jnp.float32)
  return jnp.where(bits == 255, jnp.float32(jnp.nan), power)


def _quantized(x: jax.Array, scale: jax.Array) -> jax.Array:
  return jnp.clip(x / scale, -_E4M3_MAX, _E4M3_MAX).astype(
      jnp.float8_e4m3fn)


def _kernel(x_ref, q_ref, s_ref, q_t_ref, s_t_ref, *, sub_tiles: int):
  row_block = pl.program_id(0)
  rows = pl.ds(pl.multiple_of(row_block * BLOCK, BLOCK), BLOCK)
  for t in range(sub_tiles):  # unrolled: the tiles are independent
    col_block = pl.program_id(1) * sub_tiles + t
    cols = pl.ds(pl.multiple_of(col_block * BLOCK, BLOCK), BLOCK)
    x = x_ref[rows, cols].astype(jnp.float32)
    magnitude = jnp.abs(x)
    # A NaN must make its block's scale NaN, as XLA's maximum does; the
    # GPU's max instruction would skip it.
    nan = jnp.where(jnp.isnan(x), 1.0, 0.0)
    # Blocks along the columns (each row's 32 values): the row-wise copy.
    bits = _scale_bits(jnp.max(magnitude, axis=1), jnp.max(nan, axis=1) > 0)
    q_ref[rows, cols] = _quantized(x, _scale(bits)[:, None])
    s_ref[rows, pl.ds(col_block, 1)] = bits.astype(jnp.uint8)[:, None]
    # Blocks along the rows (each column's 32 values): the transposed copy.
    bits_t = _scale_bits(jnp.max(magnitude, axis=0),
                         jnp.max(nan, axis=0) > 0)
    q_t_ref[cols, rows] = _quantized(x, _scale(bits_t)[None, :]).T
    s_t_ref[cols, pl.ds(row_block, 1)] = bits_t.astype(jnp.uint8)[:, None]


def mx_cast_transpose(x: jax.Array, *, interpret: bool = False
                      ) -> tuple[jax.Array, ...]:
  """``(q, s, q_t, s_t)``: ``x`` (2-D, 16-bit, both axes multiples of 32;
  see :func:`fits`) in MXFP8 blocked along its columns (``q`` E4M3 as
  ``x`` lies, ``s`` its E8M0 scales' bits, ``(rows, cols / 32)`` uint8) and
  blocked along its rows, written transposed (``q_t`` ``(cols, rows)``,
  ``s_t`` ``(cols, rows / 32)``), from one read of ``x``.

  >>> import jax.numpy as jnp
  >>> x = jnp.tile(jnp.arange(64, dtype=jnp.bfloat16), (32, 1))
  >>> q, s, q_t, s_t = mx_cast_transpose(x, interpret=True)
  >>> q.dtype, s.shape, q_t.shape, s_t.shape
  (dtype(float8_e4m3fn), (32, 2), (64, 32), (64, 1))
  >>> s[0].tolist()   # row maxima 31 and 63: 2**-3 and 2**-2 (448 / 8 >= 31)
  [124, 125]
  >>> float(q[0, 40]), float(q_t[40, 0]), int(s_t[40, 0])   # column 40: 40s
  (160.0, 320.0, 124)
  """
  rows, cols = x.shape
  sub_tiles = next(n for n in _SUB_TILES if (cols // BLOCK) % n == 0)
  grid = (rows // BLOCK, cols // (BLOCK * sub_tiles))

  def whole(shape):  # each program slices its own tiles
    return pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))

  shapes = [((rows, cols), jnp.float8_e4m3fn),
            ((rows, cols // BLOCK), jnp.uint8),
            ((cols, rows), jnp.float8_e4m3fn),
            ((cols, rows // BLOCK), jnp.uint8)]
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton  # GPU only
    quiet_triton_deprecation()
    compiler_params = pltriton.CompilerParams(num_warps=NUM_WARPS,
                                              num_stages=2)
  return tuple(pl.pallas_call(
      functools.partial(_kernel, sub_tiles=sub_tiles), grid=grid,
      in_specs=[whole(x.shape)],
      out_specs=tuple(whole(shape) for shape, _ in shapes),
      out_shape=tuple(jax.ShapeDtypeStruct(shape, dtype)
                      for shape, dtype in shapes),
      compiler_params=compiler_params, interpret=interpret,
      name="mxfp8_cast_transpose",
  )(x))


# ---------------------------------------------------------------------------
# The op: the kernel where it runs (CUDA, whole blocks on each device), XLA's
# path elsewhere; split by rows (and columns) across devices; a vmap rule.
# ---------------------------------------------------------------------------


def _local(x, xla: Callable):
  """One device's block: the kernel, or XLA's path where it is not whole
  blocks of 32."""
  return mx_cast_transpose(x) if fits(x.shape) else xla(x)


def _partition(xla, mesh, arg_shapes, result_shape):
  del result_shape
  rows, columns = axes_per_dim(arg_shapes[0].sharding, 2)
  return (mesh, functools.partial(_local, xla=xla),
          _infer(xla, mesh, arg_shapes, None),
          (split_dims(mesh, rows, columns),))


def _infer(xla, mesh, arg_shapes, result_shape):
  """Each copy and its scales split as ``x`` is, the transposed ones
  transposed."""
  del xla, result_shape
  rows, columns = axes_per_dim(arg_shapes[0].sharding, 2)
  straight = split_dims(mesh, rows, columns)
  transposed = split_dims(mesh, columns, rows)
  return (straight, straight, transposed, transposed)


_PARTITIONED = custom_partitioning(_local, static_argnums=(1,))
# Rows are (m i) and columns (c j), i and j the 32 values of a block, so a
# block never straddles devices and the scales split with their values.
_PARTITIONED.def_partition(
    partition=_partition, infer_sharding_from_operands=_infer,
    sharding_rule="(m i) (c j) -> (m i) (c j), (m i) c, (c j) (m i), (c j) m",
    i=BLOCK, j=BLOCK)


def quantize_both_ways(x: jax.Array, xla: Callable) -> tuple[jax.Array, ...]:
  """``(q, s, q_t, s_t)`` of a 2-D ``x`` as :func:`mx_cast_transpose`
  gives them: the kernel in a step compiled for CUDA where ``x`` is 16-bit
  and whole blocks; elsewhere (the CPU, explicitly sharded types, a jax
  without Pallas' Triton backend) ``xla(x)``, which must return the
  same four arrays (``tests/test_block_scaled.py`` checks they agree).
  Under ``vmap`` the mapped inputs' rows are joined into one call
  (:func:`_joined`), the kernel's where it runs.

  Across devices each device quantizes its own block of ``x``
  (``custom_partitioning``); blocks of 32 never straddle devices.
  """
  if (not fits(x.shape) or x.dtype not in (jnp.bfloat16, jnp.float16)
      or explicitly_sharded(x)  # a Pallas ref cannot be sliced so
      or not platform.importable("jax.experimental.pallas.triton")):
    return xla(x)

  def one(x):
    return platform.kernel_on_cuda(lambda x: _PARTITIONED(x, xla), xla, x,
                                   batched=functools.partial(_joined, one))
  return one(x)


def _joined(quantize: Callable, xs: jax.Array) -> tuple[jax.Array, ...]:
  """``quantize`` of each of ``xs`` (V, M, K) under ``vmap``, as one
  quantization of their rows joined, (V * M, K): the same numbers, since a
  block along the columns lies in one row and a block of 32 rows in one
  input (M is whole blocks), and one kernel for all V."""
  v, m, k = xs.shape
  q, s, q_t, s_t = quantize(xs.reshape(v * m, k))
  apart = lambda t: jnp.moveaxis(  # noqa: E731  (K, V * R) -> (V, K, R)
      t.reshape(t.shape[0], v, -1), 1, 0)
  return (q.reshape(v, m, k), s.reshape(v, m, -1), apart(q_t), apart(s_t))


__all__ = [
    "BLOCK",
    "fits",
    "mx_cast_transpose",
    "quantize_both_ways",
]
