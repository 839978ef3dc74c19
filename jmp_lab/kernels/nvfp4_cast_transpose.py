"""NVFP4 quantization along both axes, the Hadamard transform inside: two
Pallas Triton kernels.

A block-scaled Dense layer under NVFP4's recipe reads each activation and
output gradient in two layouts: blocked along its features (the forward or
the input-gradient GEMM) and, after the 16-wide random Hadamard transform
along its tokens, blocked along its tokens and transposed (the
weight-gradient GEMM). Each layout has its own per-tensor global scale, so
its amax must be known before any value is quantized. XLA's path reads the
16-bit tensor for the amax, writes the transformed tensor, and reads each
layout for its block maxima and again for its values.

Here :func:`nvfp4_amaxes` reads ``x`` once for both amaxes (of ``x`` and of
its transform; per program, which XLA then reduces) and
:func:`nvfp4_cast_transpose` reads it once more to write both E2M1 copies
(packed two to a byte, the second transposed) with their E4M3 scales,
rounding to nearest or stochastically (jmp_lab's counter hash of each
element's index, as XLA's path draws it). Transformer Engine's NVFP4
``quantize`` is made the same way: an amax kernel, then one that writes
the row-wise and the transformed column-wise data.

The transform is a 16 x 16 matrix product per group of 16 tokens, done as a
broadcast product and a sum in fp32 (each product of a bf16 value and
+-1/4 is exact; the sum is exact while the group's magnitudes lie within
about 2**16 of each other), then rounded to bf16 as XLA's path rounds its
GEMM's output. The kernels take bf16 (whose bits unpack to fp32 by a shift): each
program reads 32 tokens x 16 features as 32-bit words, two features a word,
even and odd tokens apart, so that the two E2M1 codes of a byte (two
features, or two tokens) sit in one program's registers without a shuffle.

The numbers are those of :func:`jmp_lab._src.numerics.block_quantize.quantize_nvfp4`
(with :func:`~jmp_lab._src.numerics.block_quantize.hadamard_16` before the
column-wise copy): bit for bit in Pallas interpret mode
(``tests/test_block_scaled.py``), with two exceptions, both sums whose
order of additions differs. Where a group's transform sum is not exact in
fp32, this kernel's order (or a GEMM's) can round it differently, in a few
transposed bytes where magnitudes within a group lie far apart
(``benchmarks/RESULTS.md``). Under Four Over Six, a block whose two sums of
squared errors lie within their last bits of each other can take the other
scale, in either copy. Each division by a scale is a product with the
scale's reciprocal, as XLA's path writes it (XLA compiles a division by a
broadcast so); the reciprocals are IEEE's on the GPU too (``rcp.rn.f32``:
Triton's own fp32 division is approximate).
The tile comes from compiling for the B200 target without register spills,
not from GPU timings.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning

from jmp_lab.kernels import platform
from jmp_lab.kernels import rounding
from jmp_lab.kernels.mesh import axes_per_dim, explicitly_sharded, split_dims
from jmp_lab.kernels.platform import quiet_triton_deprecation

#: Values per E4M3 scale (NVFP4's block), and tokens per Hadamard group.
BLOCK = 16
#: Tokens a program reads (two Hadamard groups: even and odd tokens apart).
TOKENS = 2 * BLOCK
NUM_WARPS = 4
_E2M1_MAX = 6.0
_E4M3_MAX = 448.0
_HALF = BLOCK // 2   # 32-bit words (feature pairs) in a block of features


def fits(shape: tuple[int, ...]) -> bool:
  """Whether the kernels take a tensor of ``shape``: 2-D, tokens a
  multiple of 32 and features of 16.

  >>> fits((8192, 2048)), fits((8192, 24)), fits((2, 64, 64))
  (True, False, False)
  """
  return (len(shape) == 2 and shape[0] % TOKENS == 0 and shape[1] % BLOCK == 0
          and min(shape) > 0)


def hadamard_blocks(hadamard: np.ndarray) -> np.ndarray:
  """The 16 x 16 transform as four 16 x 16 matrices ``(even->even,
  odd->even, even->odd, odd->odd)`` over a program's 32 tokens held as 16
  even and 16 odd ones (rows 0-7 of each are the first group of 16 tokens,
  rows 8-15 the second): block diagonal, one group never mixing with the
  other."""
  out = np.zeros((4, BLOCK, BLOCK), np.float32)
  for k, (to, frm) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
    for group in range(2):
      rows = slice(group * _HALF, (group + 1) * _HALF)
      out[k, rows, rows] = hadamard[to::2, frm::2]
  return out


# ---- what a program computes --------------------------------------------------


def _unpacked(words: jax.Array) -> tuple[jax.Array, jax.Array]:
  """32-bit words of two bf16 values as fp32 (exact): (low, high), the
  even and the odd feature."""
  low = jax.lax.bitcast_convert_type(jax.lax.shift_left(words, jnp.uint32(16)),
                                     jnp.float32)
  high = jax.lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000),
                                      jnp.float32)
  return low, high


def _load(words_ref, half_words: int):
  """This program's 32 tokens x 16 features: ``(even tokens, odd tokens)``,
  each ``(even features, odd features)``, each (16 tokens, 8 features)."""
  rows = pl.ds(pl.multiple_of(pl.program_id(0) * BLOCK, BLOCK), BLOCK)
  start = pl.multiple_of(pl.program_id(1) * _HALF, _HALF)
  even = _unpacked(words_ref[rows, pl.ds(start, _HALF)])
  odd = _unpacked(words_ref[rows, pl.ds(start + half_words, _HALF)])
  return even, odd


def _transformed(h_ref, even, odd):
  """The Hadamard transform along the tokens, rounded to bf16 as XLA's
  GEMM writes it: ``(even tokens, odd tokens)``, each (even, odd
  features)."""
  def times(k, x):  # (16, 16) @ (16, 8) as a broadcast product and a sum
    h = h_ref[k][:, :, None]
    # The other group's zeros must not make an infinity a NaN (0 * inf).
    return jnp.sum(jnp.where(h != 0, h * x[None, :, :], 0.0), axis=1)

  def bf16(x):
    return x.astype(jnp.bfloat16).astype(jnp.float32)

  return tuple(
      tuple(bf16(times(to_even, e) + times(to_even + 1, o))
            for e, o in zip(even, odd))
      for to_even in (0, 2))


def _amax_kernel(words_ref, h_ref, rows_ref, cols_ref, *, half_words: int):
  even, odd = _load(words_ref, half_words)
  t_even, t_odd = _transformed(h_ref, even, odd)
  rows_ref[pl.program_id(0), pl.program_id(1)] = _max_abs(*even, *odd)
  cols_ref[pl.program_id(0), pl.program_id(1)] = _max_abs(*t_even, *t_odd)


def _max_abs(*tiles: jax.Array, axis=None, where=None) -> jax.Array:
  """The largest magnitude in ``tiles`` (over ``axis``, among ``where``);
  NaN if a NaN is among them, as XLA's maximum gives it (the GPU's max
  instruction would skip it, so the NaNs are counted apart)."""
  largest = nan = None
  for tile in tiles:
    magnitude = jnp.abs(tile) if where is None else jnp.where(
        where, jnp.abs(tile), 0.0)
    is_nan = jnp.isnan(magnitude)
    tile_max = jnp.max(jnp.where(is_nan, 0.0, magnitude), axis=axis)
    tile_nan = jnp.max(jnp.where(is_nan, 1.0, 0.0), axis=axis)
    largest = tile_max if largest is None else jnp.maximum(largest, tile_max)
    nan = tile_nan if nan is None else jnp.maximum(nan, tile_nan)
  return jnp.where(nan > 0, jnp.float32(jnp.nan), largest)


def _reciprocal_rn(y: jax.Array) -> jax.Array:
  """``1 / y`` rounded to nearest on the GPU, as XLA divides
  (``rcp.rn.f32``: Triton's own fp32 division is approximate, which would
  move a quotient near an E2M1 tie or an E4M3 rounding boundary)."""
  from jax.experimental.pallas import triton as pltriton  # GPU only
  shape = jnp.shape(y)
  if not shape:  # a scalar (the global scale) as a one-element tensor
    y = jnp.broadcast_to(y, (1,))
  out = pltriton.elementwise_inline_asm(
      "rcp.rn.f32 $0, $1;", args=[y], constraints="=f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(y.shape, jnp.float32)])[0]
  return out.reshape(shape)


def _reciprocal_exact(y: jax.Array) -> jax.Array:
  """``1 / y`` off the GPU (the Pallas interpreter)."""
  return jnp.float32(1.0) / y


def _scale(amax: jax.Array, global_scale: jax.Array, reciprocal: Callable,
           headroom: float = 1.0):
  """A block's E4M3 scale (its amax maps to 6, or with ``headroom`` 1.5 to
  4; NaN for a block with an infinity or a NaN, as XLA's path) and its
  decode scale."""
  # Divisions as XLA's path writes them: times the fp32 reciprocal.
  scale = amax * reciprocal(global_scale * _E2M1_MAX)
  if headroom != 1.0:  # as XLA's path: the scale to 6, then times 1.5
    scale = scale * jnp.float32(headroom)
  scale = jnp.clip(scale, 0.0, _E4M3_MAX)
  scale = jnp.where(amax < jnp.inf, scale, jnp.float32(jnp.nan)).astype(
      jnp.float8_e4m3fn)
  return scale, scale.astype(jnp.float32) * global_scale


def _uniform(key: jax.Array, token: jax.Array, feature: jax.Array,
             features: int) -> jax.Array:
  """XLA's path's noise for the element at (token, feature):
  ``counter_bits`` of its flat index under the stream's key."""
  index = token * jnp.uint32(features) + feature
  return rounding.uniform_from_bits(rounding.hash32(index ^ key))


def _e2m1_rounded(x, decode, uniform, reciprocal: Callable):
  """``x`` over its decode scale rounded into E2M1 (to nearest even, or
  up with the probability of its distance from the lower neighbour): the
  magnitude, and whether it is negative."""
  scaled = jnp.where(
      decode > 0, x * reciprocal(jnp.where(decode > 0, decode, 1.0)), 0.0)
  magnitude = jnp.minimum(jnp.abs(scaled), _E2M1_MAX)
  # Multiples of E2M1's step there (0.5 below 2, 1 below 4, 2 up to 6),
  # by multiplying with powers of two (exact; no division to approximate).
  step = jnp.where(magnitude < 2.0, 0.5, jnp.where(magnitude < 4.0, 1.0, 2.0))
  per_step = jnp.where(magnitude < 2.0, 2.0,
                       jnp.where(magnitude < 4.0, 1.0, 0.5))
  multiple = (_round_half_even(magnitude * per_step) if uniform is None
              else jnp.floor(magnitude * per_step + uniform))
  return jnp.minimum(multiple * step, _E2M1_MAX), scaled < 0


def _e2m1_codes(x, decode, uniform, reciprocal: Callable):
  """:func:`_e2m1_rounded` as the 4-bit codes (sign, then 0, 0.5, 1, 1.5,
  2, 3, 4, 6)."""
  rounded, negative = _e2m1_rounded(x, decode, uniform, reciprocal)
  code = jnp.where(rounded < 2.0, rounded * 2.0,
                   jnp.where(rounded < 4.0, rounded + 2.0, rounded * 0.5 + 4.0))
  return code.astype(jnp.uint32) | jnp.where(negative, jnp.uint32(8),
                                             jnp.uint32(0))


def _round_half_even(v):
  """``v`` (0 to 12) rounded to the nearest integer, a tie to the even one
  (Pallas' Triton backend has no ``round``); each step is exact in fp32."""
  whole = jnp.floor(v)
  fraction = v - whole
  odd = (whole - 2.0 * jnp.floor(whole * 0.5)) == 1.0
  up = (fraction > 0.5) | ((fraction == 0.5) & odd)
  return whole + jnp.where(up, 1.0, 0.0)


def _packed(low, high):
  return (low | (high << jnp.uint32(4))).astype(jnp.uint8)


def _squared_errors(tiles, scale, decode, global_scale, reciprocal: Callable):
  """The tiles' squared errors, element by element and summed over the
  tiles, rounded to nearest with ``scale`` (fp32; ``decode`` its decode
  scale; both broadcast against a tile), in units of the global scale:
  how XLA's path measures a Four Over Six candidate
  (:func:`~jmp_lab._src.numerics.block_quantize.quantize_nvfp4`)."""
  total = None
  for x in tiles:
    magnitude, negative = _e2m1_rounded(x, decode, None, reciprocal)
    value = jnp.where(negative, -magnitude, magnitude)
    error = jnp.square(value * scale - x * reciprocal(global_scale))
    total = error if total is None else total + error
  return total


def _fp32(scale):
  return scale.astype(jnp.float32)


def _chosen(take_four, four, six):
  """Four Over Six's choice between two ``(scale, decode)`` candidates
  (the scales selected in fp32, which holds every E4M3 value, NaN
  included, and stored as E4M3 again)."""
  scale = jnp.where(take_four, _fp32(four[0]), _fp32(six[0]))
  return (scale.astype(jnp.float8_e4m3fn),
          jnp.where(take_four, four[1], six[1]))


def _group_errors(a, b, groups, candidates, global_scale, reciprocal):
  """Each of the two token groups' sums of squared errors (per feature)
  with its own ``(scale, decode)`` candidate (tiles ``a`` and ``b``, rows
  in ``groups[0]`` the first group's)."""
  def tile(values):
    return jnp.where(groups[0], values[0][None, :], values[1][None, :])

  errors = _squared_errors(
      (a, b), tile([_fp32(c[0]) for c in candidates]),
      tile([c[1] for c in candidates]), global_scale, reciprocal)
  return [jnp.sum(jnp.where(group, errors, 0.0), axis=0) for group in groups]


class _Program(NamedTuple):
  """What both of a program's copies need: its element coordinates (each
  (16, 8): row ``pair`` of the even and odd tokens, word ``feature``), its
  noise (None when rounding to nearest) and its reciprocal."""

  pair: jax.Array
  feature: jax.Array
  noise: Callable
  reciprocal: Callable
  four_over_six: bool


def _write_along_features(program, even, odd, global_scale, key, q_ref,
                          s_ref, half_words: int):
  """Each token's 16 features are a block: ``q`` packs two features a byte."""
  i, j = pl.program_id(0), pl.program_id(1)
  rows = pl.ds(pl.multiple_of(i * BLOCK, BLOCK), BLOCK)
  for parity, (x_even, x_odd) in enumerate((even, odd)):  # even, odd tokens
    amax = _max_abs(x_even, x_odd, axis=1)
    six = _scale(amax, global_scale, program.reciprocal)
    if program.four_over_six:
      four = _scale(amax, global_scale, program.reciprocal, 1.5)
      error_6, error_4 = (jnp.sum(_squared_errors(
          (x_even, x_odd), _fp32(scale)[:, None], decode[:, None],
          global_scale, program.reciprocal), axis=1) for scale, decode in (six,
                                                                       four))
      six = _chosen(error_4 < error_6, four, six)
    scale, decode = six
    token = 2 * program.pair + parity
    codes = [_e2m1_codes(x, decode[:, None],
                         program.noise(key, token, 2 * program.feature + f),
                         program.reciprocal)
             for f, x in enumerate((x_even, x_odd))]
    q_ref[rows, pl.ds(pl.multiple_of(j * _HALF + parity * half_words, _HALF),
                      _HALF)] = _packed(*codes)
    s_ref[rows, pl.ds(j + parity * (s_ref.shape[1] // 2), 1)] = scale[:, None]


def _write_along_tokens(program, t_even, t_odd, global_scale, key, q_t_ref,
                        s_t_ref):
  """After the transform each group of 16 tokens (rows 0-7, or 8-15, of the
  even and the odd tokens) is a block: ``q_t`` packs two tokens a byte,
  transposed."""
  i, j = pl.program_id(0), pl.program_id(1)
  first_group = program.pair < _HALF
  columns = jax.lax.broadcasted_iota(jnp.int32, (_HALF, 2), 1)
  for parity in (0, 1):   # the even, then the odd features
    a, b = t_even[parity], t_odd[parity]
    groups = (first_group, ~first_group)
    amaxes = [_max_abs(a, b, axis=0, where=group) for group in groups]
    sixes = [_scale(amax, global_scale, program.reciprocal) for amax in amaxes]
    if program.four_over_six:
      fours = [_scale(amax, global_scale, program.reciprocal, 1.5)
               for amax in amaxes]
      sixes = [_chosen(e4 < e6, four, six) for e6, e4, four, six in zip(
          _group_errors(a, b, groups, sixes, global_scale, program.reciprocal),
          _group_errors(a, b, groups, fours, global_scale, program.reciprocal),
          fours, sixes)]
    (scale_0, decode_0), (scale_1, decode_1) = sixes
    decode = jnp.where(first_group, decode_0[None, :], decode_1[None, :])
    feature = 2 * program.feature + parity
    codes = [_e2m1_codes(x, decode, program.noise(
        key, 2 * program.pair + t, feature), program.reciprocal)
             for t, x in enumerate((a, b))]
    features = pl.ds(pl.multiple_of(j * _HALF, _HALF), _HALF)
    q_t_ref[features, pl.ds(pl.multiple_of(
        i * BLOCK + parity * (q_t_ref.shape[1] // 2), BLOCK), BLOCK)] = (
            _packed(*codes).T)
    # The two groups' scales side by side (selected in fp32, which holds
    # every E4M3 value, then stored as E4M3 again).
    both = jnp.where(columns == 0, _fp32(scale_0)[:, None],
                     _fp32(scale_1)[:, None])
    s_t_ref[features, pl.ds(2 * i + parity * (s_t_ref.shape[1] // 2), 2)] = (
        both.astype(jnp.float8_e4m3fn))


def _cast_kernel(words_ref, h_ref, scales_ref, keys_ref, tokens_ref,
                 features_ref, q_ref, s_ref, q_t_ref, s_t_ref, *,
                 half_words: int, features: int, stochastic: bool,
                 four_over_six: bool, reciprocal: Callable):
  even, odd = _load(words_ref, half_words)
  first_token = tokens_ref[pl.program_id(0)].astype(jnp.uint32)
  first_feature = features_ref[pl.program_id(1)].astype(jnp.uint32)

  def noise(key, token, feature):
    if not stochastic:
      return None
    return _uniform(key, first_token + token, first_feature + feature,
                    features)

  program = _Program(
      jax.lax.broadcasted_iota(jnp.uint32, (BLOCK, _HALF), 0),
      jax.lax.broadcasted_iota(jnp.uint32, (BLOCK, _HALF), 1), noise, reciprocal,
      four_over_six)
  _write_along_features(program, even, odd, scales_ref[0], keys_ref[0],
                        q_ref, s_ref, half_words)
  _write_along_tokens(program, *_transformed(h_ref, even, odd),
                      scales_ref[1], keys_ref[1], q_t_ref, s_t_ref)


# ---- the two calls ------------------------------------------------------------


def _check(x: jax.Array) -> None:
  if x.dtype != jnp.bfloat16 or not fits(x.shape):
    raise ValueError(
        f"x must be a 2-D bfloat16 array of whole 32 x 16 tiles (tokens a "
        f"multiple of 32, features of 16); got {x.dtype}{list(x.shape)}. "
        f"quantize_both_ways takes any tensor (XLA's path where these "
        f"kernels do not).")


def _words(x: jax.Array) -> jax.Array:
  """``x`` (tokens, features) bf16 as 32-bit words ``(tokens / 2,
  features)``: row ``r`` holds token ``2r``'s features, two to a word,
  then token ``2r + 1``'s (a free reshape and bitcast)."""
  tokens, features = x.shape
  pairs = x.reshape(tokens // 2, features, 2)
  return jax.lax.bitcast_convert_type(pairs, jnp.uint32)


def _call(kernel, x, operands, out_shapes, name, interpret):
  tokens, features = x.shape
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton  # GPU only
    quiet_triton_deprecation()
    compiler_params = pltriton.CompilerParams(num_warps=NUM_WARPS,
                                              num_stages=1)

  def whole(shape):  # each program slices its own tiles
    return pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))

  return pl.pallas_call(
      functools.partial(kernel, half_words=features // 2),
      grid=(tokens // TOKENS, features // BLOCK),
      in_specs=[whole(a.shape) for a in operands],
      out_specs=tuple(whole(s.shape) for s in out_shapes),
      out_shape=tuple(out_shapes), compiler_params=compiler_params,
      interpret=interpret, name=name)(*operands)


def nvfp4_amaxes(x: jax.Array, hadamard: np.ndarray, *,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """``(amax(x), amax(H x))`` in fp32 from one read of ``x`` (bf16, see
  :func:`fits`), ``H x`` the 16-wide transform ``hadamard`` along the
  tokens (the first axis), rounded to bf16.

  >>> import jax.numpy as jnp, numpy as np
  >>> x = jnp.ones((32, 16), jnp.bfloat16)
  >>> h = np.full((16, 16), 0.25, np.float32)   # each token: 16 ones / 4
  >>> [float(a) for a in nvfp4_amaxes(x, h, interpret=True)]
  [1.0, 4.0]
  """
  _check(x)
  rows, cols = _partial_amaxes(x, jnp.asarray(hadamard_blocks(hadamard)),
                               interpret)
  return jnp.max(rows), jnp.max(cols)


def nvfp4_cast_transpose(x: jax.Array, hadamard: np.ndarray,
                         global_scales: jax.Array, keys, *,
                         stochastic: bool, four_over_six: bool = False,
                         first_token=None, first_feature=None, features=None,
                         interpret: bool = False) -> tuple[jax.Array, ...]:
  """``(q, s, q_t, s_t)``: ``x`` (tokens, features; bf16, see :func:`fits`)
  in NVFP4 blocked along its features (``q`` E2M1 codes packed two
  features to a byte, ``(tokens, features / 2)`` uint8, ``s`` its E4M3
  scales ``(tokens, features / 16)``) and, after the transform
  ``hadamard`` along the tokens, blocked along the tokens and written
  transposed (``q_t`` ``(features, tokens / 2)`` packed two tokens to a
  byte, ``s_t`` ``(features, tokens / 16)``), from one read of ``x``.

  Args:
    x: the tensor.
    hadamard: the 16 x 16 transform (fp32), or its
      :func:`hadamard_blocks` as an array.
    global_scales: fp32 ``(2,)``: the two copies' per-tensor scales.
    keys: uint32 ``(2,)``: the two copies' noise streams' keys
      (``counter_bits``'s ``stream_key``); read only when ``stochastic``.
    stochastic: round stochastically (else to nearest even).
    four_over_six: each block scaled so that its amax maps to 6 or to 4,
      whichever dequantizes with the smaller sum of squared errors rounded
      to nearest (arXiv 2512.02010; XLA's path's rule, ``global_scales``
      then taken with its ``scale_max`` 256); the values are then rounded
      as ``stochastic`` says. Chosen in the program's registers: the
      kernel reads and writes the same bytes.
    first_token, first_feature: int32, the first token of each 32 and the
      first feature of each 16 in the whole tensor (a device's shard's
      noise is the whole tensor's); default ``x`` is whole.
    features: the whole tensor's features (the flat index's stride).
    interpret: run the Pallas interpreter (for tests off a GPU).
  """
  _check(x)
  tokens, width = x.shape
  if first_token is None:
    first_token = jnp.arange(0, tokens, TOKENS, dtype=jnp.int32)
  if first_feature is None:
    first_feature = jnp.arange(0, width, BLOCK, dtype=jnp.int32)
  out_shapes = (jax.ShapeDtypeStruct((tokens // 2, width), jnp.uint8),
                jax.ShapeDtypeStruct((tokens // 2, 2 * width // BLOCK),
                                     jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((width // 2, tokens), jnp.uint8),
                jax.ShapeDtypeStruct((width // 2, 2 * tokens // BLOCK),
                                     jnp.float8_e4m3fn))
  kernel = functools.partial(
      _cast_kernel, features=features or width, stochastic=stochastic,
      four_over_six=four_over_six,
      reciprocal=_reciprocal_exact if interpret else _reciprocal_rn)
  q, s, q_t, s_t = _call(
      kernel, x, (_words(x), jnp.asarray(hadamard_blocks(np.asarray(hadamard))
                              if np.ndim(hadamard) == 2 else hadamard),
                  global_scales.astype(jnp.float32),
                  jnp.asarray(keys, jnp.uint32), first_token, first_feature),
      out_shapes, "nvfp4_cast_transpose", interpret)
  return (q.reshape(tokens, width // 2), s.reshape(tokens, width // BLOCK),
          q_t.reshape(width, tokens // 2), s_t.reshape(width, tokens // BLOCK))


def as_e2m1(packed: jax.Array) -> jax.Array:
  """Codes packed two to a byte (the low nibble first) as E2M1 values, the
  last axis doubled (a bitcast).

  >>> import jax.numpy as jnp
  >>> as_e2m1(jnp.array([[0x21, 0xF7]], jnp.uint8)).astype(jnp.float32)
  Array([[ 0.5,  1. ,  6. , -6. ]], dtype=float32)
  """
  values = jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn)
  return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


# ---------------------------------------------------------------------------
# The op: the kernels where they run (CUDA, bf16, whole tiles on each device),
# XLA's path elsewhere; split by tokens and features across devices; a vmap
# rule.
# ---------------------------------------------------------------------------


def _whole_or_split(mesh, sharding, shape):
  """The mesh axes splitting (tokens, features), each kept where every
  device's part is whole tiles along it (32 tokens, 16 features), else
  dropped: the devices then gather that axis (bf16) and each quantizes
  all of it."""
  def kept(axes, size, tile):
    devices = int(np.prod([mesh.shape[a] for a in axes]))
    return axes if size % (tile * devices) == 0 else ()
  rows, columns = axes_per_dim(sharding, 2)
  return kept(rows, shape[0], TOKENS), kept(columns, shape[1], BLOCK)


def _amax_partition(mesh, arg_shapes, result_shape):
  del result_shape
  split = split_dims(mesh, *_whole_or_split(mesh, arg_shapes[0].sharding,
                                            arg_shapes[0].shape))
  return mesh, _amaxes_on_gpu, (split, split), (split, split_dims(mesh))


def _amax_infer(mesh, arg_shapes, result_shape):
  del result_shape
  split = split_dims(mesh, *_whole_or_split(mesh, arg_shapes[0].sharding,
                                            arg_shapes[0].shape))
  return (split, split)


def _partial_amaxes(x, blocks, interpret: bool = False):
  """Each program's two maxima (XLA reduces them, across devices too);
  ``blocks``: :func:`hadamard_blocks` as an array."""
  tokens, features = x.shape
  partial = jax.ShapeDtypeStruct((tokens // TOKENS, features // BLOCK),
                                 jnp.float32)
  return _call(_amax_kernel, x, (_words(x), blocks), (partial, partial),
               "nvfp4_amax", interpret)


def _cast_partition(stochastic, features, four_over_six, mesh, arg_shapes,
                    result_shape):
  del result_shape
  rows, columns = _whole_or_split(mesh, arg_shapes[0].sharding,
                                  arg_shapes[0].shape)
  whole = split_dims(mesh)
  args = (split_dims(mesh, rows, columns), whole, whole, whole,
          split_dims(mesh, rows), split_dims(mesh, columns))
  local = functools.partial(_cast, stochastic=stochastic, features=features,
                            four_over_six=four_over_six)
  return mesh, local, _cast_outputs(mesh, rows, columns), args


def _cast_outputs(mesh, rows, columns):
  straight = split_dims(mesh, rows, columns)
  transposed = split_dims(mesh, columns, rows)
  return (straight, straight, transposed, transposed)


def _cast_infer(stochastic, features, four_over_six, mesh, arg_shapes,
                result_shape):
  del stochastic, features, four_over_six, result_shape
  return _cast_outputs(mesh, *_whole_or_split(mesh, arg_shapes[0].sharding,
                                              arg_shapes[0].shape))


def _cast(x, blocks, global_scales, keys, first_token, first_feature,
          stochastic, features, four_over_six):
  return nvfp4_cast_transpose(
      x, blocks, global_scales, keys, stochastic=stochastic,
      four_over_six=four_over_six, first_token=first_token,
      first_feature=first_feature, features=features)


def _amaxes_on_gpu(x, blocks):
  return _partial_amaxes(x, blocks)


_PARTITIONED_AMAXES = custom_partitioning(_amaxes_on_gpu)
# Tokens are (m i) and features (c j), i 32 and j 16: a tile never
# straddles devices; each program's maxima split with its tile.
_PARTITIONED_AMAXES.def_partition(
    partition=_amax_partition, infer_sharding_from_operands=_amax_infer,
    sharding_rule="(m i) (c j), b r s -> m c, m c", i=TOKENS, j=BLOCK)

_PARTITIONED_CAST = custom_partitioning(_cast, static_argnums=(6, 7, 8))
_PARTITIONED_CAST.def_partition(
    partition=_cast_partition, infer_sharding_from_operands=_cast_infer,
    sharding_rule=("(m i) (c j), b r s, t, k, m, c -> (m i) (c h), (m i) c, "
                   "(c j) (m p), (c j) (m q)"),
    i=TOKENS, j=BLOCK, h=BLOCK // 2, p=BLOCK, q=2)


def quantize_both_ways(x: jax.Array, hadamard: np.ndarray, *,
                       stochastic: bool, scales_and_keys: Callable,
                       xla: Callable, four_over_six: bool = False
                       ) -> tuple[jax.Array, ...]:
  """``(q, s, g, q_t, s_t, g_t)``: ``x`` (tokens, features) in NVFP4
  blocked along its features (E2M1 ``q``, E4M3 ``s``, global scale ``g``)
  and, transformed by ``hadamard`` along its tokens, blocked along them and
  transposed (``q_t``, ``s_t``, ``g_t``).

  The kernels in a step compiled for CUDA where ``x`` is bf16 and whole
  tiles (:func:`fits`); elsewhere (the CPU, ``vmap``, fp16, explicitly
  sharded types, a jax without Pallas' Triton backend) ``xla(x)``, which
  must return the same six arrays (``tests/test_block_scaled.py`` checks
  they agree). ``scales_and_keys(amax, amax_t)`` gives the two copies'
  global scales and noise keys from their amaxes, as ``xla`` derives them
  (with ``four_over_six``, :func:`nvfp4_cast_transpose`'s, their
  ``scale_max`` 256).

  Across devices each device quantizes its own tiles (``custom_partitioning``;
  the amaxes are reduced over all of them, and each element draws the noise
  of its index in the whole tensor).
  """
  if (not fits(x.shape) or x.dtype != jnp.bfloat16
      or explicitly_sharded(x)  # a Pallas ref cannot be sliced so
      or not platform.importable("jax.experimental.pallas.triton")):
    return xla(x)
  blocks = jnp.asarray(hadamard_blocks(np.asarray(hadamard, np.float32)))
  tokens, features = x.shape

  def kernels(x):
    rows, cols = _PARTITIONED_AMAXES(x, blocks)
    global_scales, keys = scales_and_keys(jnp.max(rows), jnp.max(cols))
    q, s, q_t, s_t = _PARTITIONED_CAST(
        x, blocks, global_scales, keys,
        jnp.arange(0, tokens, TOKENS, dtype=jnp.int32),
        jnp.arange(0, features, BLOCK, dtype=jnp.int32),
        stochastic, features, four_over_six)
    return (as_e2m1(q), s, global_scales[0], as_e2m1(q_t), s_t,
            global_scales[1])

  return platform.kernel_on_cuda(kernels, xla, x)


__all__ = [
    "BLOCK",
    "TOKENS",
    "as_e2m1",
    "fits",
    "hadamard_blocks",
    "nvfp4_amaxes",
    "nvfp4_cast_transpose",
    "quantize_both_ways",
]
