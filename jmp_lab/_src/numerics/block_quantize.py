"""Blackwell's block-scaled formats: MXFP8 and NVFP4 quantization.

The face with the docs is :mod:`jmp_lab.block_scaled`. Each rule here is
written from its source, so that an independent implementation of the same
source agrees bit for bit (``tests/test_block_scaled.py`` has one):

* **MXFP8** (OCP Microscaling Formats spec v1.0, section 6.3; the scale
  rounded *up*, as cuBLAS, jax's ``quantize`` and torchao's ``RCEIL`` do,
  arXiv 2506.08027): blocks of 32 values along the contraction axis; the
  scale is the power of two ``2**e`` with the smallest ``e`` for which
  ``448 * 2**e >= amax`` (so no value saturates; ``e`` within [-126, 127],
  0 for an all-zero block), stored as E8M0; values are ``x / 2**e``
  rounded to nearest even into E4M3.
* **NVFP4** (NVIDIA's NVFP4 pretraining paper, arXiv 2509.25149, section 2
  and appendix B; Transformer Engine's ``NVFP4BlockScaling``): a per-tensor
  fp32 scale ``g = amax(tensor) / (448 * 6)`` (current scaling: no state);
  blocks of 16 values (or 16x16 tiles for weights), each with the E4M3 scale
  ``s = e4m3(amax(block) / (6 * g))``; values ``x / (s * g)`` rounded into
  E2M1, to nearest even or stochastically (gradients). Each division is a
  product with the divisor's fp32 reciprocal, as XLA compiles a division by
  a broadcast scale (``_times_reciprocal``).
* **Four Over Six** (Cook et al., arXiv 2512.02010, and the rule of its
  reference code, ``fouroversix/quantize/reference.py``; optional): the global scale is
  ``amax(tensor) / (256 * 6)``, and each block (a weight's 16x16 tile)
  takes the E4M3 scale that maps its amax to 6 or the one 1.5 times as
  large, which maps it to 4, whichever gives the smaller sum of squared
  errors once dequantized. E2M1 has no value between 4 and 6, so a
  block's near-maximal values round less coarsely scaled to 4.
* The **random Hadamard transform** (the paper's section 4.2): a 16x16
  Hadamard matrix, normalized, after a fixed random sign flip, applied to
  the two operands of the weight-gradient GEMM along their shared
  contraction axis. It is orthogonal, so the product is unchanged; it
  spreads outliers over each block before 4-bit quantization.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lab.kernels import rounding


@dataclasses.dataclass(frozen=True)
class BlockFormat:
  """A block-scaled number format.

  Attributes:
    name: ``"mxfp8"`` or ``"nvfp4"``.
    block: values per scale along the contraction axis.
    value_dtype: the element type (E4M3 or E2M1).
    scale_dtype: the block scale's type (E8M0 or E4M3).
    value_max: the largest finite element value.
    global_scale: whether a per-tensor fp32 scale sits above the blocks.
  """

  name: str
  block: int
  value_dtype: np.dtype
  scale_dtype: np.dtype
  value_max: float
  global_scale: bool


MXFP8 = BlockFormat("mxfp8", 32, np.dtype(jnp.float8_e4m3fn),
                    np.dtype(jnp.float8_e8m0fnu), 448.0, False)
NVFP4 = BlockFormat("nvfp4", 16, np.dtype(jnp.float4_e2m1fn),
                    np.dtype(jnp.float8_e4m3fn), 6.0, True)
FORMATS = {f.name: f for f in (MXFP8, NVFP4)}

_E4M3_MAX = 448.0
# E8M0 encodes 2**(bits - 127), bits 0..254; 255 is NaN.
_E8M0_BIAS = 127


class Quantized(NamedTuple):
  """A tensor in a block-scaled format, blocks along its last axis.

  Attributes:
    values: the elements, in the format's value dtype, shape ``(..., K)``.
    scales: one per block, in the format's scale dtype, ``(..., K/block)``.
    global_scale: an fp32 scalar (1 for MXFP8).
  """

  values: jax.Array
  scales: jax.Array
  global_scale: jax.Array


def padded_to_block(x: jax.Array, block: int, axis: int = -1) -> jax.Array:
  """``x`` with zeros appended along ``axis`` up to a multiple of ``block``
  (zeros change neither a block's amax nor a product over the axis)."""
  axis = axis % x.ndim
  extra = -x.shape[axis] % block
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def _block_axis(x: jax.Array, axis: int, block: int, *,
                tiles: bool = False) -> int:
  """``axis`` of ``x`` made non-negative, checked: within ``x``'s axes and
  a whole number of blocks long (with ``tiles``, the last axis, and the
  second last a whole number of blocks too)."""
  shape = jnp.shape(x)
  if not isinstance(axis, (int, np.integer)) or not -len(shape) <= axis < len(
      shape):
    raise ValueError(f"axis must be an axis of x (shape {shape}), got "
                     f"{axis!r}")
  axis = int(axis) % len(shape)
  if tiles and axis != len(shape) - 1:
    raise ValueError(f"{block}x{block} tiles block the last two axes, got "
                     f"axis={axis}")
  for checked in ((len(shape) - 2, axis) if tiles else (axis,)):
    if checked < 0 or shape[checked] % block:
      raise ValueError(
          f"x's axis {checked} (shape {shape}) must be a multiple of "
          f"{block} long{' (tiles block the last two axes)' if tiles else ''};"
          f" pad it, or let jmp_lab.block_scaled.dot_general pad the "
          f"contraction")
  return axis


def _blocked(x: jax.Array, block: int, axis: int = -1) -> jax.Array:
  """``x`` with ``axis`` split into (blocks, ``block``): the block's own
  values on the axis right after it."""
  axis = axis % x.ndim
  return x.reshape(*x.shape[:axis], x.shape[axis] // block, block,
                   *x.shape[axis + 1:])


def _block_amax(blocks: jax.Array, axis: int) -> jax.Array:
  # In the input's dtype (exact), so that XLA reads it as it lies.
  return jnp.max(jnp.abs(blocks), axis=axis % (blocks.ndim - 1) + 1)


def _e8m0_exponent(amax: jax.Array) -> jax.Array:
  """The smallest ``e`` with ``448 * 2**e >= amax``, exactly: with
  ``amax = m * 2**p`` (``0.5 <= m < 1``), ``448 = 0.875 * 2**9``, so ``e`` is
  ``p - 9`` when ``m <= 0.875`` and ``p - 8`` otherwise. No division, so no
  rounding can land a block one power of two low. Clamped to [-126, 127]:
  E8M0's 2**-127 is an fp32 subnormal, which GPUs and XLA:CPU flush to
  zero (a block that small has nothing E4M3 can hold anyway); an all-zero
  block gets the scale 1."""
  mantissa, exponent = jnp.frexp(amax)
  e = jnp.where(mantissa <= 0.875, exponent - 9, exponent - 8)
  e = jnp.where(amax > 0, e, 0)
  return jnp.clip(e, 1 - _E8M0_BIAS, _E8M0_BIAS)


def _e8m0(e: jax.Array, finite: jax.Array) -> jax.Array:
  bits = jnp.where(finite, e + _E8M0_BIAS, 255).astype(jnp.uint8)
  return jax.lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu)


def e8m0_to_float32(scales: jax.Array) -> jax.Array:
  """E8M0 scales as fp32 powers of two, built from their bits (exact; 2**-127
  is an fp32 subnormal, built as such; 255 is NaN)."""
  bits = jax.lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.uint32)
  normal = jax.lax.bitcast_convert_type(bits << 23, jnp.float32)
  smallest = jnp.float32(2.0**-127)
  nan = jnp.float32(jnp.nan)
  return jnp.where(bits == 255, nan, jnp.where(bits == 0, smallest, normal))


def _over_tiles(per_block: jax.Array, block: int, reduce) -> jax.Array:
  """Per-block figures (blocks along the last axis) reduced over each
  ``block`` x ``block`` tile's ``block`` rows, repeated down them."""
  rows = per_block.reshape(*per_block.shape[:-2],
                           per_block.shape[-2] // block, block,
                           per_block.shape[-1])
  return jnp.broadcast_to(reduce(rows, axis=-2, keepdims=True),
                          rows.shape).reshape(per_block.shape)


def _tile_amax(amax: jax.Array, block: int) -> jax.Array:
  """Block maxima made the maxima of ``block`` x ``block`` tiles."""
  return _over_tiles(amax, block, jnp.max)


def quantize_mxfp8(x: jax.Array, axis: int = -1, *,
                   tiles: bool = False) -> Quantized:
  """``x`` (``axis`` a multiple of 32) in MXFP8: E4M3 values, one E8M0
  scale per 32 along ``axis``, rounded up (module doc). The values keep
  ``x``'s layout; the scales are ``x``'s shape with ``axis`` divided by 32.
  Blocking along the axis where it lies (rather than transposing first)
  lets XLA read ``x`` as it is and write the quantized copy transposed.

  With ``tiles`` (a weight's; ``axis`` the last), each 32 x 32 tile of the
  last two axes shares one scale (still an MX encoding along either axis:
  every 32 values have one E8M0 scale, the tile's), so that the
  transposed weight is the same quantization."""
  axis = _block_axis(x, axis, MXFP8.block, tiles=tiles)
  blocks = _blocked(x, MXFP8.block, axis)
  amax = _block_amax(blocks, axis).astype(jnp.float32)
  if tiles:
    amax = _tile_amax(amax, MXFP8.block)
  finite = jnp.isfinite(amax)
  e = _e8m0_exponent(jnp.where(finite, amax, 0.0))
  scales = _e8m0(e, finite)
  scaled = blocks.astype(jnp.float32) / jnp.expand_dims(
      e8m0_to_float32(scales), axis + 1)
  values = jnp.clip(scaled, -_E4M3_MAX, _E4M3_MAX).astype(MXFP8.value_dtype)
  return Quantized(values.reshape(x.shape), scales, jnp.float32(1.0))


# Four Over Six's largest block scale for a block scaled to 6: scaled to 4
# instead, the block's scale is 1.5 times that, 384, still an E4M3 value.
FOUR_OVER_SIX_SCALE_MAX = 256.0


def nvfp4_global_scale(x: jax.Array, *, amax: Optional[jax.Array] = None,
                       scale_max: float = _E4M3_MAX) -> jax.Array:
  """The per-tensor fp32 decode scale ``amax / (scale_max * 6)`` (times
  its fp32 reciprocal: :func:`~jmp_lab.kernels.rounding.over_constant`), with
  ``scale_max`` 448 (E4M3's largest, the paper's) or 256 (Four Over Six).
  It is 1 for a tensor of zeros or a non-finite amax, whose non-finite
  blocks then carry a NaN scale (:func:`quantize_nvfp4`). ``amax`` if given: the max of the block maxima, the same
  value from a tensor a block's size smaller than ``x``."""
  if amax is None:
    amax = jnp.max(jnp.abs(x))
  amax = amax.astype(jnp.float32)
  usable = (amax > 0) & jnp.isfinite(amax)
  # As a product with the reciprocal: the same bits eagerly and jitted.
  return jnp.where(usable, rounding.over_constant(
      amax, scale_max * NVFP4.value_max), jnp.float32(1.0))


def _times_reciprocal(x: jax.Array, divisor: jax.Array) -> jax.Array:
  """``x / divisor`` for a ``divisor`` that broadcasts against ``x`` (a
  block's scale, the tensor's), written as XLA compiles it: ``x`` times
  the fp32 reciprocal. XLA's algebraic simplifier rewrites a division by a
  broadcast so, on every backend; written out, the numbers no longer
  depend on how a program's division reaches XLA, and NVFP4's kernels
  (:mod:`jmp_lab.kernels.nvfp4_cast_transpose`) compute the same."""
  return x * (jnp.float32(1.0) / divisor)


def _e4m3_decode(amax: jax.Array, global_scale: jax.Array) -> jax.Array:
  """Each block's scale before rounding: its amax maps to 6."""
  return _times_reciprocal(amax, global_scale * jnp.float32(NVFP4.value_max))


def _e4m3(decode: jax.Array) -> jax.Array:
  return jnp.clip(decode, 0.0, _E4M3_MAX).astype(NVFP4.scale_dtype)


def _e2m1_values(blocks: jax.Array, scales: jax.Array,
                 global_scale: jax.Array, axis: int,
                 uniform: Optional[jax.Array]) -> jax.Array:
  """``blocks`` over their scales times the global scale, rounded into E2M1
  (stochastically with ``uniform``, blocked as ``blocks``)."""
  decode = jnp.expand_dims(scales.astype(jnp.float32), axis + 1) * global_scale
  scaled = jnp.where(decode > 0, _times_reciprocal(
      blocks.astype(jnp.float32), jnp.where(decode > 0, decode, 1.0)), 0.0)
  scaled = jnp.clip(scaled, -NVFP4.value_max, NVFP4.value_max)
  if uniform is None:
    scaled = _round_e2m1_nearest(scaled)
  else:
    scaled = _round_e2m1_stochastic(scaled, uniform)
  return scaled.astype(NVFP4.value_dtype)


def _e2m1_step(magnitude: jax.Array) -> jax.Array:
  """The gap between E2M1's neighbours around ``magnitude``: 0.5 below 2,
  1 below 4, 2 up to 6."""
  return jnp.where(magnitude < 2.0, 0.5, jnp.where(magnitude < 4.0, 1.0, 2.0))


def _round_e2m1_nearest(scaled: jax.Array) -> jax.Array:
  """``scaled`` (within +-6) as its cast to E2M1 rounds it, to the nearest
  value, a tie to the even code: XLA's own convert on CUDA, and in fp32
  before the cast elsewhere, so that the cast after it is exact.

  XLA:CPU's default emitters, the MLIR ones, round fp32 to E2M1 once, as
  jmp_lab does (``test_xlas_e2m1_convert_rounds_as_jmp_lab_does``); XLA's
  GPU fusions are MLIR-emitted too and are taken to round the same (not
  checked on a GPU: none was available). XLA:CPU's older emitters (jax 0.10,
  ``--xla_cpu_use_fusion_emitters=false``) convert through bf16 and round
  twice (0.7499 became 1, 5.0001 became 4), so off CUDA the rounding is
  jmp_lab's; on CUDA XLA's, whose fused quantize kernels then move 4% fewer
  bytes than with this rounding in them (``benchmarks/RESULTS.md``)."""
  return jax.lax.platform_dependent(scaled, cuda=lambda s: s,
                                    default=_e2m1_grid_nearest)


def _e2m1_grid_nearest(scaled: jax.Array) -> jax.Array:
  """``scaled`` (within +-6) rounded to the nearest E2M1 value in fp32, a
  tie to the even code. Within each step the grid is the step's multiples,
  and an even multiple is an even code, so half-to-even on ``m / step`` is
  E2M1's rounding."""
  magnitude = jnp.abs(scaled)
  step = _e2m1_step(magnitude)
  rounded = jnp.minimum(jnp.round(magnitude / step) * step, NVFP4.value_max)
  return jnp.where(scaled < 0, -rounded, rounded)


def _block_squared_error(values: jax.Array, scales: jax.Array,
                         target: jax.Array, axis: int) -> jax.Array:
  """Each block's sum of squared errors, in units of the global scale
  (``target`` is the blocks over it; the same for both candidates)."""
  dequantized = values.astype(jnp.float32) * jnp.expand_dims(
      scales.astype(jnp.float32), axis + 1)
  return jnp.sum(jnp.square(dequantized - target), axis=axis + 1)


def _round_e2m1_stochastic(scaled: jax.Array, uniform: jax.Array
                           ) -> jax.Array:
  """``scaled`` (within +-6) rounded to one of its two E2M1 neighbours, up
  with probability its distance from the lower one over their gap: E2M1's
  grid steps by 0.5 below 2, by 1 below 4 and by 2 up to 6."""
  magnitude = jnp.abs(scaled)
  step = _e2m1_step(magnitude)
  # floor(m / step + u) is m / step's floor plus one with probability its
  # fraction (the divisions by powers of two are exact).
  rounded = jnp.minimum(jnp.floor(magnitude / step + uniform) * step,
                        NVFP4.value_max)
  return jnp.where(scaled < 0, -rounded, rounded)


def quantize_nvfp4(x: jax.Array, *, tiles: bool = False,
                   uniform: Optional[jax.Array] = None,
                   axis: int = -1,
                   stochastic_salt: Optional[int] = None,
                   four_over_six: bool = False) -> Quantized:
  """``x`` in NVFP4 (module doc): E2M1 values, one E4M3 scale per 16 along
  the last axis and an fp32 global scale from the tensor's amax.

  Args:
    x: last axis a multiple of 16 (and, with ``tiles``, the second last).
    tiles: one scale per 16x16 tile of the last two axes (a weight's, so
      that its transpose is the same quantization: the paper's 2D scaling);
      the scales are repeated down each tile's 16 rows.
    uniform: uniform [0, 1) noise of ``x``'s shape for stochastic rounding;
      None rounds to nearest even.
    axis: the axis the blocks run along (not with ``tiles``); the values
      keep ``x``'s layout, the scales are its shape with ``axis`` divided.
    stochastic_salt: round stochastically with noise drawn inside
      (:func:`counter_uniform` under :func:`content_seed` of ``x``'s amax
      and this salt) instead of ``uniform``.
    four_over_six: Four Over Six (module doc): each block (tile) scaled so
      that its amax maps to 6 or to 4, whichever dequantizes with the
      smaller sum of squared errors rounded to nearest (then rounded as
      asked); the global scale leaves room for the larger scale
      (``scale_max`` 256).
  """
  axis = _block_axis(x, axis, NVFP4.block, tiles=tiles)
  blocks = _blocked(x, NVFP4.block, axis)
  amax = _block_amax(blocks, axis).astype(jnp.float32)
  # From the block maxima: one pass over x fewer (and XLA fused the
  # tensor-wide reduction into its producer's kernel, which spilled on
  # sm_100a).
  tensor_amax = jnp.max(amax)
  global_scale = nvfp4_global_scale(
      x, amax=tensor_amax,
      scale_max=FOUR_OVER_SIX_SCALE_MAX if four_over_six else _E4M3_MAX)
  if stochastic_salt is not None:
    uniform = counter_uniform(content_seed(tensor_amax), stochastic_salt,
                              x.shape)
  if uniform is not None:
    uniform = _blocked(uniform, NVFP4.block, axis)
  if tiles:
    amax = _tile_amax(amax, NVFP4.block)
  decode = _e4m3_decode(amax, global_scale)
  scales = _e4m3(decode)
  if four_over_six:
    scales = _four_over_six_scales(blocks, decode, global_scale, axis,
                                   tiles)
  # A block (tile) with an infinity or a NaN gets a NaN scale, as MXFP8's
  # E8M0 NaN: clipped to 448 instead, an overflowed gradient would be
  # quantized to finite values and the loss scale would not see it.
  scales = jnp.where(jnp.isfinite(amax), scales,
                     jnp.asarray(jnp.nan, NVFP4.scale_dtype))
  values = _e2m1_values(blocks, scales, global_scale, axis, uniform)
  return Quantized(values.reshape(x.shape), scales, global_scale)


def _four_over_six_scales(blocks: jax.Array, decode: jax.Array,
                          global_scale: jax.Array, axis: int,
                          tiles: bool) -> jax.Array:
  """Each block's (tile's) scale that maps its amax to 6 or the one 1.5
  times as large (to 4), whichever dequantizes with the smaller sum of
  squared errors (arXiv 2512.02010's MSE rule; a tie keeps 6).

  The candidates are compared rounded to nearest, even where the values are
  then rounded stochastically: a choice made on noisy candidates would
  depend on the noise, and the rounding would no longer be unbiased (the
  paper's reference compares the stochastically rounded ones). Only the
  choice is taken here, in a reduction per block; the values are then
  quantized once, with the chosen scale, so that XLA reads the input once
  more rather than writing both candidates out."""
  scales_6 = _e4m3(decode)
  scales_4 = _e4m3(decode * jnp.float32(1.5))
  target = _times_reciprocal(blocks.astype(jnp.float32), global_scale)

  def squared_error(scales):
    values = _e2m1_values(blocks, scales, global_scale, axis, None)
    per_block = _block_squared_error(values, scales, target, axis)
    return (_over_tiles(per_block, NVFP4.block, jnp.sum) if tiles
            else per_block)

  return jnp.where(squared_error(scales_4) < squared_error(scales_6),
                   scales_4, scales_6)


def quantize(x: jax.Array, fmt: BlockFormat, *, tiles: bool = False,
             axis: int = -1, stochastic_salt: Optional[int] = None,
             four_over_six: bool = False) -> Quantized:
  """``x`` in ``fmt``, blocks along ``axis`` (see the two above; Four Over
  Six is NVFP4's)."""
  if fmt is MXFP8:
    return quantize_mxfp8(x, axis, tiles=tiles)
  return quantize_nvfp4(x, tiles=tiles, axis=axis,
                        stochastic_salt=stochastic_salt,
                        four_over_six=four_over_six)


def dequantize(q: Quantized, dtype=jnp.float32) -> jax.Array:
  """The values times their scales, in ``dtype`` (exact in fp32 before the
  global scale: an E2M1 or E4M3 value times an E4M3 or power-of-two scale
  fits fp32's significand)."""
  if q.scales.dtype == np.dtype(jnp.float8_e8m0fnu):
    scales = e8m0_to_float32(q.scales)
  else:
    scales = q.scales.astype(jnp.float32)
  block = q.values.shape[-1] // q.scales.shape[-1]
  values = _blocked(q.values.astype(jnp.float32), block) * scales[..., None]
  return (values.reshape(q.values.shape) * q.global_scale).astype(dtype)


# ---- the random Hadamard transform -----------------------------------------

HADAMARD_SIZE = 16
# Fixed random signs (the paper draws one sign vector and keeps it): a
# constant, so the transform needs no random key and a model's apply call no
# new RNG stream.
HADAMARD_SIGNS = np.where(
    np.random.default_rng(2509_25149).random(HADAMARD_SIZE) < 0.5, -1.0, 1.0
).astype(np.float32)


def _hadamard_matrix() -> np.ndarray:
  """The 16x16 orthonormal Hadamard matrix (Sylvester's) times the fixed
  sign flip: ``H @ diag(signs) / 4``."""
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < HADAMARD_SIZE:
    h = np.block([[h, h], [h, -h]])
  return (h * HADAMARD_SIGNS[None, :] / 4.0).astype(np.float32)


HADAMARD = _hadamard_matrix()


def hadamard_16(x: jax.Array, axis: int = -1) -> jax.Array:
  """The 16-wide random Hadamard transform of each 16 along ``axis`` (a
  multiple of 16): signs flipped, then the orthonormal Walsh-Hadamard
  transform; in ``x``'s dtype (the GEMM accumulates in fp32 and writes
  ``x``'s dtype).

  Written as a batched GEMM of the 16x16 matrix by each group of 16 (one
  read of ``x`` and one write, in its layout, with no transposed copy),
  not as four butterfly stages or a 16-term sum, which XLA compiled to
  several passes over the tensor or to kernels that spill registers."""
  axis = _block_axis(x, axis, HADAMARD_SIZE)
  lead = int(np.prod(x.shape[:axis]))
  trail = int(np.prod(x.shape[axis + 1:]))
  groups = x.reshape(lead * (x.shape[axis] // HADAMARD_SIZE), HADAMARD_SIZE,
                     trail)
  matrix = jnp.broadcast_to(jnp.asarray(HADAMARD, x.dtype),
                            (groups.shape[0], HADAMARD_SIZE, HADAMARD_SIZE))
  out = jax.lax.dot_general(matrix, groups, (((2,), (1,)), ((0,), (0,))),
                            precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=x.dtype)
  return out.reshape(x.shape)


def counter_uniform(seed: jax.Array, salt: int, shape) -> jax.Array:
  """Uniform [0, 1) noise of ``shape`` for stochastic rounding: jmp_lab's
  counter-based hash of each element's index
  (:func:`jmp_lab.rounding.counter_bits`, as the stochastic bf16 update
  uses) under ``seed`` and ``salt``. Integer arithmetic that XLA fuses into
  the quantizing kernel, where a threefry generator (``jax.random``) was a
  kernel of its own whose output the quantization then read back."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape,
                                             axis) * jnp.uint32(stride)
    stride *= shape[axis]
  return rounding.uniform_from_bits(rounding.counter_bits(seed, salt, index))


def content_seed(amax: jax.Array) -> jax.Array:
  """A seed made of a tensor's own contents: the bits of its fp32 amax,
  hashed. No key to pass; the same tensor rounds the same way (a rerun is
  bit for bit); a step's new gradients, whose amax differs, draw new noise.
  (The amax is at hand: the quantization computes it anyway. A sum over
  the tensor was one more pass, which XLA fused into kernels that spilled
  registers on sm_100a.)"""
  amax = amax.astype(jnp.float32)
  # One NaN for every NaN: their bits differ from kernel to kernel (a
  # propagated NaN keeps its payload, a computed one is the GPU's own).
  amax = jnp.where(jnp.isnan(amax), jnp.float32(jnp.nan), amax)
  bits = jax.lax.bitcast_convert_type(amax, jnp.uint32)
  return rounding.hash32(bits ^ jnp.uint32(0x5EED5EED))
