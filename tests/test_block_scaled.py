"""Tests for jmp_lab.block_scaled: MXFP8 and NVFP4 quantization against an
independent reference, the block-scaled products and their gradients, the
policy keys on every route, and the B200 compile."""

import collections
import fractions
import functools
import pathlib
import re
import sys
import warnings
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import jmp_lab
from jmp_lab import block_scaled as bs
from jmp_lab._src.numerics import block_matmul
from jmp_lab.diagnostics import audit_step

from conftest import EMITTER_FLAGS, run_under_xla_cpu_defaults
from cuda_compile import require_cuda_plugin  # noqa: E402

DIMS = (((1,), (0,)), ((), ()))
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.real_models import HFConv1D  # noqa: E402


# --- an independent reference, from the OCP MX spec and the NVFP4 paper -------


def _grid(dtype, codes):
  """Every finite non-negative value of a small float type, ascending, and
  its code."""
  values = np.arange(codes, dtype=np.uint8).view(dtype).astype(np.float64)
  keep = np.isfinite(values) & (values >= 0) & ~np.signbit(values)
  order = np.argsort(values[keep], kind="stable")
  return values[keep][order], np.arange(codes)[keep][order]


E4M3 = _grid(ml_dtypes.float8_e4m3fn, 256)
E2M1 = _grid(ml_dtypes.float4_e2m1fn, 16)


def _round_nearest_even(value, grid):
  """The grid values nearest ``value`` (an array; its sign kept), a tie to
  the one with an even code (an even last mantissa bit). In float64 the
  distances are exact: the values and the grid have few significant bits."""
  values, codes = grid
  value = np.asarray(value, np.float64)
  magnitude = np.abs(value)
  hi = np.clip(np.searchsorted(values, magnitude), 1, len(values) - 1)
  lo = hi - 1
  below, above = magnitude - values[lo], values[hi] - magnitude
  take_hi = (above < below) | ((above == below) & (codes[hi] % 2 == 0))
  take_hi |= magnitude > values[-1]
  rounded = np.where(take_hi, values[hi], values[lo])
  return np.where(value < 0, -rounded, rounded) + 0.0


def _mx_exponent(amax: float) -> int:
  """OCP MX v1.0 6.3's shared exponent, rounded up: the smallest e with
  448 * 2**e >= amax, within [-126, 127]; an all-zero block: 0."""
  if amax == 0:
    return 0
  e = 0
  while 448 * fractions.Fraction(2) ** e < amax:
    e += 1
  while 448 * fractions.Fraction(2) ** (e - 1) >= amax:
    e -= 1
  return int(np.clip(e, -126, 127))


def reference_mxfp8(x: np.ndarray):
  x = x.astype(np.float64).reshape(-1, 32)
  exponents = np.array([_mx_exponent(float(np.max(np.abs(b)))) for b in x])
  return _round_nearest_even(x / 2.0 ** exponents[:, None], E4M3), exponents


def reference_nvfp4(x: np.ndarray):
  """NVFP4 (arXiv 2509.25149 section 2): global decode scale amax/(448*6)
  and each block's E4M3 scale amax_b/(6 g), in fp32 arithmetic; values
  rounded to nearest even into E2M1 after dividing by scale * g. Each
  division by a scale (a constant, a block's) is a product with the fp32
  reciprocal, as XLA compiles a division by a constant or a broadcast
  (jmp_lab writes it so on every path, its kernels too)."""
  f32 = np.float32
  x = x.astype(f32)
  amax = f32(np.max(np.abs(x)))
  g = f32(amax * (f32(1) / f32(2688.0))) if amax > 0 else f32(1.0)
  blocks = x.reshape(-1, 16)
  decode = np.max(np.abs(blocks), axis=1) * (f32(1) / f32(g * f32(6.0)))
  scales = _round_nearest_even(np.minimum(decode, f32(448.0)), E4M3)
  d = (scales.astype(f32) * g).astype(f32)[:, None]
  with np.errstate(invalid="ignore", divide="ignore"):
    scaled = np.clip((blocks * (f32(1) / d)).astype(f32), -6, 6)
  values = np.where(d == 0, 0.0, _round_nearest_even(
      np.nan_to_num(scaled), E2M1))
  return values, scales, float(g)


def reference_nvfp4_four_over_six(x: np.ndarray, tiles: bool = False):
  """Four Over Six's rule (arXiv 2512.02010, section 3; the MSE rule of
  mit-han-lab/fouroversix ``quantize/reference.py``), in the arithmetic of
  ``reference_nvfp4`` above (that code computes the same scales as
  ``amax_b * 256 / amax``, which can differ in the last bit): global scale
  amax/(256*6); each block (16x16 tile) quantized twice, its amax mapped
  to 6 (scale amax_b/(6 g)) and to 4 (that scale times 1.5), and the
  candidate with the smaller sum of squared errors of the dequantized
  values (float64, in x's units) kept, 6 on a tie."""
  f32 = np.float32
  x = x.astype(f32)
  amax = f32(np.max(np.abs(x)))
  g = f32(amax * (f32(1) / f32(1536.0)))   # as reference_nvfp4's
  rows, columns = x.shape
  if tiles:
    blocks = x.reshape(rows // 16, 16, columns // 16, 16).transpose(
        0, 2, 1, 3).reshape(-1, 256)
  else:
    blocks = x.reshape(-1, 16)
  decode = np.max(np.abs(blocks), axis=1) * (f32(1) / f32(g * f32(6.0)))
  candidates = []
  for factor in (f32(1.0), f32(1.5)):
    scales = _round_nearest_even(np.minimum(f32(decode * factor), f32(448.0)),
                                 E4M3)
    d = (scales.astype(f32) * g).astype(f32)[:, None]
    with np.errstate(invalid="ignore", divide="ignore"):
      scaled = np.clip((blocks * (f32(1) / d)).astype(f32), -6, 6)
    values = np.where(d == 0, 0.0, _round_nearest_even(
        np.nan_to_num(scaled), E2M1))
    error = np.sum((values * d.astype(np.float64) - blocks) ** 2, axis=1)
    candidates.append((values, scales, error))
  (v6, s6, e6), (v4, s4, e4) = candidates
  take_4 = e4 < e6
  values = np.where(take_4[:, None], v4, v6)
  scales = np.where(take_4, s4, s6)
  if tiles:   # back to rows of 16, one scale per row of a tile
    values = values.reshape(rows // 16, columns // 16, 16, 16).transpose(
        0, 2, 1, 3).reshape(-1, 16)
    scales = np.repeat(scales.reshape(rows // 16, 1, columns // 16), 16,
                       axis=1).reshape(-1)
  return values, scales, float(g), take_4


def _awkward(shape, seed):
  """Normal values over a wide range of magnitudes, with exact powers of two,
  448 * 2**k and just above it, and an all-zero block."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * 2.0 ** rng.integers(-20, 20, shape[:-1] + (1,))
  flat = x.reshape(-1)
  flat[:32] = 2.0 ** np.arange(-15, 17)          # block 0: amax 2**16
  flat[32:64] = 0.0                              # block 1: zeros
  flat[64:96] = 1.0                              # block 2: amax just
  flat[64] = np.nextafter(np.float32(448.0), np.float32(1e9))  # above 448
  return x.astype(np.float32)


def test_mxfp8_matches_the_ocp_mx_reference_bit_for_bit():
  x = _awkward((6, 128), 0)
  q = bs.quantize_mxfp8(jnp.asarray(x))
  values, exponents = reference_mxfp8(x)
  np.testing.assert_array_equal(np.asarray(q.values, np.float64).reshape(-1, 32),
                                values)
  np.testing.assert_array_equal(
      np.asarray(jax.lax.bitcast_convert_type(q.scales, jnp.uint8)).reshape(-1),
      exponents + 127)
  # 448 * 2**e >= amax: no value saturates; the exponent is the smallest.
  assert list(exponents[:3]) == [8, 0, 1]


def test_nvfp4_matches_the_paper_reference_bit_for_bit():
  x = _awkward((4, 64), 1) * 1e-3
  q = bs.quantize_nvfp4(jnp.asarray(x))
  values, scales, g = reference_nvfp4(x)
  assert float(q.global_scale) == g
  np.testing.assert_array_equal(np.asarray(q.scales, np.float64).reshape(-1),
                                scales)
  np.testing.assert_array_equal(
      np.asarray(q.values, np.float64).reshape(-1, 16), values)


def test_nvfp4_rounds_just_off_a_tie_to_the_nearer_value_when_jitted():
  """jmp_lab rounds into E2M1 itself: XLA's fp32-to-E2M1 convert in jax
  0.10's older CPU emitters (the floor lane's) rounds through bf16 first,
  so 0.7499 became 1 and 5.0001 became 4."""
  block = np.array([6.0, 0.7499, 5.0001, 0.2501, 2.4999, 1.2501, 3.5001,
                    4.9999, 0.75, 5.0, 2.5, -0.7499, 0, 1, 2, 3], np.float32)
  nearest = [6.0, 0.5, 6.0, 0.5, 2.0, 1.5, 4.0, 4.0, 1.0, 4.0, 2.0, -0.5,
             0, 1, 2, 3]   # 0.75, 5 and 2.5 tie: to the even code
  q = jax.jit(bs.quantize_nvfp4)(jnp.asarray(block[None]))
  assert float(q.scales[0, 0]) * float(q.global_scale) == pytest.approx(1.0)
  np.testing.assert_array_equal(np.asarray(q.values, np.float32)[0], nearest)


def test_xlas_e2m1_convert_rounds_as_jmp_lab_does(request):
  """On CUDA the quantization leaves the rounding into E2M1 to XLA's
  convert; elsewhere it rounds itself. XLA's MLIR emitters, the GPU's and
  XLA:CPU's default, round the two ways alike: ties, just off them, and
  between (on the floor lane in a process with XLA:CPU's defaults)."""
  if EMITTER_FLAGS:
    run_under_xla_cpu_defaults(request.node.nodeid)
    return
  ties = np.arange(0, 6.25, 0.25)
  near = np.concatenate([ties + d for d in (0, 1e-4, -1e-4, 1e-6, -1e-6)])
  rng = np.random.default_rng(0)
  values = np.concatenate([near, -near, rng.uniform(-6, 6, 4096)])
  values = np.clip(values, -6, 6).astype(np.float32)
  values = np.resize(values, (values.size // 15 + 1) * 15).reshape(-1, 15)
  blocks = np.concatenate([np.full((len(values), 1), 6, np.float32), values],
                          axis=1)   # amax 6 in every block: scale x g = 1
  q = jax.jit(bs.quantize_nvfp4)(jnp.asarray(blocks.reshape(1, -1)))
  assert np.float32(q.scales[0, 0]) * np.float32(q.global_scale) == 1.0
  convert = jax.jit(lambda v: v.astype(jnp.float4_e2m1fn).astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(q.values, np.float32).reshape(-1),
                                np.asarray(convert(jnp.asarray(blocks))
                                           ).reshape(-1))


@pytest.mark.parametrize("tiles", [False, True], ids=["blocks", "tiles"])
def test_four_over_six_matches_its_reference_bit_for_bit(tiles):
  rng = np.random.default_rng(7)
  x = (rng.standard_t(3, (64, 64)) * 2.0 ** rng.integers(-6, 6, (64, 1))
       ).astype(np.float32)
  # A tile of near-maximal values (scaled to 6 they fall between 4 and 6,
  # where E2M1 has no value): scaled to 4 it is nearer, as a tile too.
  x[:16, :16] = rng.uniform(0.7, 1.0, (16, 16)) * rng.choice([-1, 1], (16, 16))
  q = jax.jit(functools.partial(bs.quantize_nvfp4, tiles=tiles,
                                four_over_six=True))(jnp.asarray(x))
  values, scales, g, take_4 = reference_nvfp4_four_over_six(x, tiles)
  assert float(q.global_scale) == g
  np.testing.assert_array_equal(np.asarray(q.scales, np.float64).reshape(-1),
                                scales)
  np.testing.assert_array_equal(
      np.asarray(q.values, np.float64).reshape(-1, 16), values)
  assert take_4.any() and not take_4.all()    # both candidates are taken
  if not tiles:   # blocks along another axis: the same quantization
    along_rows = bs.quantize_nvfp4(jnp.asarray(x.T), axis=0,
                                   four_over_six=True)
    chex.assert_trees_all_equal(
        (along_rows.values.T, along_rows.scales.T), (q.values, q.scales))
  # Nearer than the paper's quantization (every block scaled to 6).
  error = lambda q: float(jnp.sum(jnp.square(  # noqa: E731
      bs.dequantize(q) - x)))
  assert error(q) < error(bs.quantize_nvfp4(jnp.asarray(x), tiles=tiles))


def test_four_over_six_keeps_stochastic_rounding_unbiased():
  """The choice of 4 or 6 is made on the block, not on the noise: over many
  draws each value's mean is the value."""
  blocks = np.random.default_rng(0).uniform(-6, 6, (3, 16)).astype(np.float32)
  blocks[:, 0] = 6.0
  draws = jax.random.uniform(jax.random.key(0), (20000, *blocks.shape))
  quantize = jax.jit(jax.vmap(lambda u: bs.dequantize(bs.quantize_nvfp4(
      jnp.asarray(blocks), uniform=u, four_over_six=True))))
  mean = np.asarray(quantize(draws)).mean(axis=0)
  # One draw's error is at most a step (2 above 4); 20,000 of them average
  # to within about 0.01 of the value. Choosing on the noisy candidates
  # was up to 0.11 off on these blocks.
  np.testing.assert_allclose(mean, blocks, atol=0.03)


def test_nvfp4_weight_tiles_share_one_scale_per_16x16_tile():
  x = _awkward((32, 32), 2)
  q = bs.quantize_nvfp4(jnp.asarray(x), tiles=True)
  scales = np.asarray(q.scales, np.float64)            # (32, 2)
  for r in range(0, 32, 16):
    for c in range(2):
      tile = scales[r:r + 16, c]
      assert np.all(tile == tile[0])
      amax = np.max(np.abs(x[r:r + 16, 16 * c:16 * c + 16]))
      expected = _round_nearest_even(min(
          np.float32(amax) / np.float32(float(q.global_scale) * 6), 448),
          E4M3)
      assert tile[0] == expected


def test_mxfp8_weight_tiles_share_one_scale_per_32x32_tile():
  x = _awkward((64, 64), 3)
  q = bs.quantize_mxfp8(jnp.asarray(x), tiles=True)
  bits = np.asarray(jax.lax.bitcast_convert_type(q.scales, jnp.uint8))
  for r in range(0, 64, 32):
    for c in range(2):
      tile = x[r:r + 32, 32 * c:32 * c + 32]
      assert np.all(bits[r:r + 32, c] == _mx_exponent(
          float(np.max(np.abs(tile)))) + 127)
  with bs.mxfp8_recipe():   # the default: 32x32 weight tiles
    w = jax.random.normal(jax.random.key(1), (64, 32), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(2), (32, 64), jnp.bfloat16)
    dx = jax.jit(jax.grad(lambda x, w: bs.dot_general(
        x, w, DIMS, fmt="mxfp8").astype(jnp.float32).sum()))(x, w)
  # The input gradient read the forward's tiled weight, transposed.
  qw = bs.dequantize(bs.quantize_mxfp8(w.T, tiles=True))      # (N, K)
  expected = jnp.ones((32, 32)) @ qw
  chex.assert_trees_all_close(dx.astype(jnp.float32),
                              expected.astype(jnp.bfloat16).astype(jnp.float32))


def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased():
  # Each block: 6 (its amax, so its scale maps 6 to 6) and fifteen 1.25s,
  # which lie halfway between E2M1's 1 and 1.5.
  x = jnp.tile(jnp.array([6.0] + [1.25] * 15, jnp.float32), (1, 256))
  inside = np.arange(x.shape[1]) % 16 != 0
  draws = []
  for salt in range(32):
    uniform = jax.random.uniform(jax.random.key(salt), x.shape)
    q = bs.quantize_nvfp4(x, uniform=uniform)
    draws.append(np.asarray(q.values, np.float32)[0, inside])
  draws = np.stack(draws)
  nearest = np.asarray(bs.quantize_nvfp4(x).values, np.float32)[0, inside]
  assert set(np.unique(draws)) == {1.0, 1.5}     # the two grid neighbours
  assert abs(draws.mean() - 1.25) < 0.01         # unbiased
  assert np.all(nearest == 1.0)                  # the tie, to even


def test_the_hadamard_transform_is_orthonormal_and_keeps_a_product():
  eye = jnp.eye(16)
  h = bs.hadamard_16(eye, axis=0)
  chex.assert_trees_all_close(h.T @ h, eye, atol=1e-6)
  a = jax.random.normal(jax.random.key(0), (64, 8))
  b = jax.random.normal(jax.random.key(1), (64, 5))
  chex.assert_trees_all_close(bs.hadamard_16(a, 0).T @ bs.hadamard_16(b, 0),
                              a.T @ b, atol=1e-4)


# --- the one-pass MXFP8 kernel (Pallas interpret mode here) ----------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_the_one_pass_mxfp8_kernel_writes_xlas_two_quantizations(dtype):
  """mx_cast_transpose (run by the Pallas interpreter) writes both layouts
  bit for bit as XLA's path and the OCP MX reference do: wide magnitudes,
  exact powers of two, a block just above 448, zeros, and blocks with a NaN
  and an infinity (their scales NaN, as XLA's)."""
  from jmp_lab.kernels import mx_cast_transpose as mx
  x = _awkward((96, 256), 3) * (1e-3 if dtype == jnp.float16 else 1.0)
  x[40, 70] = np.nan
  x[75, 200] = np.inf
  x = jnp.asarray(x, dtype)
  kernel = mx.mx_cast_transpose(x, interpret=True)
  xla = block_matmul._mxfp8_both_ways(x)
  for got, want in zip(kernel, xla):
    chex.assert_type(got, want.dtype)
    chex.assert_shape(got, want.shape)
    np.testing.assert_array_equal(
        np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint8)),
        np.asarray(jax.lax.bitcast_convert_type(want, jnp.uint8)))
  q, s, q_t, s_t = kernel
  finite = np.isfinite(np.asarray(x, np.float32)).all(axis=1)
  values, exponents = reference_mxfp8(np.asarray(x, np.float32)[finite])
  np.testing.assert_array_equal(
      np.asarray(q, np.float64)[finite].reshape(-1, 32), values)
  np.testing.assert_array_equal(np.asarray(s)[finite].reshape(-1),
                                exponents + 127)
  assert int(s[40, 2]) == 255 and int(s_t[70, 1]) == 255   # the NaN's blocks
  assert int(s[75, 6]) == 255 and int(s_t[200, 2]) == 255  # the infinity's


def _e2m1_codes(values):
  """E2M1 values as their 4-bit codes, two to a byte (exact, signs of zeros
  too)."""
  pairs = values.reshape(*values.shape[:-1], values.shape[-1] // 2, 2)
  return np.asarray(jax.lax.bitcast_convert_type(pairs, jnp.uint8))


def _nvfp4_by_kernels(x, salt, four_over_six=False, **shard):
  """NVFP4's two quantizations of ``x`` by the kernels (the Pallas
  interpreter), with the global scales and noise keys XLA's path uses."""
  from jmp_lab.kernels import nvfp4_cast_transpose as nv
  from jmp_lab._src.numerics import block_quantize as bq
  amax, amax_t = nv.nvfp4_amaxes(x, bq.HADAMARD, interpret=True)
  scales, keys = block_matmul.nvfp4_scales_and_keys(amax, amax_t, salt,
                                                    four_over_six)
  return nv.nvfp4_cast_transpose(
      shard.pop("part", x), bq.HADAMARD, scales, keys,
      stochastic=salt is not None, four_over_six=four_over_six,
      interpret=True, **shard), scales


def _nvfp4_input(seed, non_finite=False):
  """bf16 rows over a wide range of magnitudes, blocks of zeros, and a
  block of E2M1's ties: the tensor's amax 168 makes the global scale
  2**-4, so that block (amax 6) has the scale 16 and decodes by 1."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((96, 64)) * 2.0 ** rng.integers(-6, 4, (96, 1))
  x[0, 0] = 168.0
  x[5, 16:32] = 0.0
  x[7, :16] = [6.0, 2.5, -5.0, 0.25, 0.75, -1.25, 1.75, 3.5] * 2
  x[8:40, 48] = 0.0
  if non_finite:
    x[40, 3], x[70, 50] = np.inf, np.nan
  return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.parametrize("salt, non_finite, four_over_six", [
    (None, False, False), (1, False, False), (1, True, False),
    (None, False, True), (1, True, True)],
    ids=["nearest", "stochastic", "an-infinity-and-a-nan",
         "four-over-six", "four-over-six-stochastic-non-finite"])
def test_the_nvfp4_kernels_write_xlas_two_quantizations(salt, non_finite,
                                                        four_over_six):
  """nvfp4_amaxes and nvfp4_cast_transpose (run by the Pallas interpreter)
  write both layouts bit for bit as XLA's path does: blocked along the
  features, and after the Hadamard transform along the tokens, transposed;
  rounded to nearest (ties to even) or stochastically with XLA's path's
  noise; an infinity's and a NaN's blocks with NaN scales; with Four Over
  Six, each block's choice of 4 or 6 as XLA's path makes it."""
  from jmp_lab.kernels import nvfp4_cast_transpose as nv
  x = _nvfp4_input(0, non_finite)
  (q, s, q_t, s_t), scales = _nvfp4_by_kernels(x, salt, four_over_six)
  with block_matmul.nvfp4_recipe(four_over_six=four_over_six) as recipe:
    along_features, along_tokens = block_matmul._xla_both_ways(
        x[None], recipe, salt)
  np.testing.assert_array_equal(q, _e2m1_codes(along_features.values[0]))
  np.testing.assert_array_equal(q_t, _e2m1_codes(along_tokens.values[0]))
  for got, want in ((s, along_features.scales[0]),
                    (s_t, along_tokens.scales[0])):
    chex.assert_type(got, jnp.float8_e4m3fn)
    np.testing.assert_array_equal(
        np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint8)),
        np.asarray(jax.lax.bitcast_convert_type(want, jnp.uint8)))
  chex.assert_trees_all_equal(
      scales, jnp.stack([along_features.global_scale,
                         along_tokens.global_scale]))
  values = nv.as_e2m1(q)
  chex.assert_type(values, jnp.float4_e2m1fn)
  assert values.shape == x.shape and not np.all(np.asarray(q) == 0)
  if four_over_six and salt is None:  # each copy takes both candidates
    for codes in (q, q_t):            # (a block's largest value: 4 or 6)
      decoded = np.abs(np.asarray(nv.as_e2m1(codes), np.float32))
      largest = decoded.reshape(codes.shape[0], -1, 16).max(axis=-1)
      assert (largest == 4).any() and (largest == 6).any()
  if non_finite:  # the infinity's and the NaN's blocks, in both copies
    nan = np.isnan(np.asarray(s, np.float32))
    assert nan[40, 0] and nan[70, 3] and nan.sum() == 2
    nan_t = np.isnan(np.asarray(s_t, np.float32))
    assert nan_t[3, 2] and nan_t[50, 4] and nan_t.sum() == 2


@pytest.mark.parametrize("shape, dtype", [
    ((48, 64), jnp.bfloat16), ((64, 24), jnp.bfloat16),
    ((64, 64), jnp.float16), ((2, 32, 16), jnp.bfloat16)])
def test_the_nvfp4_kernels_name_a_tensor_they_do_not_take(shape, dtype):
  from jmp_lab.kernels import nvfp4_cast_transpose as nv
  from jmp_lab._src.numerics import block_quantize as bq
  x = jnp.zeros(shape, dtype)
  with pytest.raises(ValueError, match=r"x must be a 2-D bfloat16 array.*got"):
    nv.nvfp4_amaxes(x, bq.HADAMARD, interpret=True)
  with pytest.raises(ValueError, match=r"whole 32 x 16 tiles"):
    nv.nvfp4_cast_transpose(x, bq.HADAMARD, jnp.ones(2), jnp.zeros(2),
                            stochastic=False, interpret=True)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_a_tensors_scale_has_the_same_bits_eagerly_and_jitted(fmt):
  """The per-tensor scale (NVFP4's global scale, fp8's current scale) is
  its amax over a constant, which XLA compiles as a product with the
  reciprocal under ``jit`` but divided eagerly: one bit apart for this
  tensor, which rounded four of its values on E2M1's 3.5 tie to 4 eagerly
  and to 3 jitted. The model's numbers then depended on ``jax.jit``."""
  x = jax.random.normal(jax.random.key(1), (3, 32, 48))[1].astype(
      jnp.bfloat16)
  if fmt == "fp8":
    from jmp_lab._src.numerics import fp8_quantize
    scale = functools.partial(fp8_quantize.current_scale,
                              fp8_dtype=jnp.float8_e4m3fn)
    chex.assert_trees_all_equal(scale(x), jax.jit(scale)(x))
    return
  eager, jitted = bs.quantize_nvfp4(x), jax.jit(bs.quantize_nvfp4)(x)
  chex.assert_trees_all_equal(eager.global_scale, jitted.global_scale)
  np.testing.assert_array_equal(np.asarray(eager.values, np.float32),
                                np.asarray(jitted.values, np.float32))


def test_nvfp4_gives_an_overflowed_block_a_nan_scale():
  """A block (or a weight's 16x16 tile) holding an infinity or a NaN
  dequantizes to NaN, as MXFP8's do: clipped to E4M3's 448 instead, an
  overflowed gradient would come out finite and the loss scale would not
  skip its step. The other blocks stay finite."""
  x = np.ones((16, 32), np.float32)
  x[0, 3], x[1, 20] = np.inf, np.nan
  finite = lambda q: np.isfinite(np.asarray(  # noqa: E731
      bs.dequantize(q))).reshape(16, 2, 16).all(axis=-1)
  np.testing.assert_array_equal(
      finite(bs.quantize_nvfp4(jnp.asarray(x, jnp.bfloat16))),
      [[False, True], [True, False]] + [[True, True]] * 14)
  tiles = finite(bs.quantize_nvfp4(jnp.asarray(x), tiles=True))
  np.testing.assert_array_equal(tiles, [[False, False]] * 16)
  x[1, 20] = 1.0
  tiles = finite(bs.quantize_nvfp4(jnp.asarray(x), tiles=True))
  np.testing.assert_array_equal(tiles, [[False, True]] * 16)
  g = jax.grad(lambda w: bs.dot_general(
      jnp.ones((32, 32), jnp.bfloat16), w, DIMS, fmt="nvfp4").astype(
          jnp.float32).sum() * jnp.float32(np.inf))(jnp.ones((32, 16),
                                                             jnp.bfloat16))
  assert not np.isfinite(np.asarray(g, np.float32)).any()


def test_a_shard_of_the_nvfp4_kernels_draws_the_whole_tensors_noise():
  """A device's tokens (a shard of rows, given the whole tensor's scales
  and its first token) quantize as those rows of the whole tensor do,
  stochastic noise included (each element's noise is its index's in the
  whole tensor)."""
  x = _nvfp4_input(1)
  (q, s, q_t, s_t), _ = _nvfp4_by_kernels(x, 1)
  rows = slice(32, 96)
  (q_1, s_1, q_t1, s_t1), _ = _nvfp4_by_kernels(
      x, 1, part=x[rows], first_token=jnp.array([32, 64], jnp.int32))
  np.testing.assert_array_equal(q_1, q[rows])
  np.testing.assert_array_equal(q_t1, q_t[:, 16:48])
  for got, want in ((s_1, s[rows]), (s_t1, s_t[:, 2:6])):
    np.testing.assert_array_equal(
        np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint8)),
        np.asarray(jax.lax.bitcast_convert_type(want, jnp.uint8)))
  # A device's features (tensor parallel): its first feature, and the whole
  # tensor's width as the index's stride.
  columns = slice(16, 64)
  (q_2, s_2, q_t2, s_t2), _ = _nvfp4_by_kernels(
      x, 1, part=x[:, columns], features=64,
      first_feature=jnp.array([16, 32, 48], jnp.int32))
  np.testing.assert_array_equal(q_2, q[:, 8:32])
  np.testing.assert_array_equal(q_t2, q_t[columns])


# --- the products ---------------------------------------------------------------


class ProductTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_forward_is_the_exact_product_of_the_quantized_operands(self):
    x = jax.random.normal(jax.random.key(0), (16, 64), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (64, 24), jnp.bfloat16)
    with bs.mxfp8_recipe(weight_tiles=False):   # 1x32 blocks, as x's
      y = self.variant(lambda x, w: bs.dot_general(x, w, DIMS, fmt="mxfp8"))(
          x, w)
    xv, xe = reference_mxfp8(np.asarray(x, np.float32))
    wv, we = reference_mxfp8(np.asarray(w, np.float32).T)
    xd = (xv * 2.0 ** xe[:, None]).reshape(16, 64)
    wd = (wv * 2.0 ** we[:, None]).reshape(24, 64)
    chex.assert_type(y, jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(y, np.float32),
        np.asarray(jnp.asarray((xd @ wd.T).astype(np.float32)).astype(
            jnp.bfloat16), np.float32))

  @chex.variants(with_jit=True, without_jit=True)
  def test_a_product_without_a_gradient_is_the_forward_of_one_with_it(self):
    """Called without a gradient, a product quantizes its input one way
    only (and on a GPU by XLA): the same numbers as the forward that saves
    the backward's copies."""
    x = jax.random.normal(jax.random.key(0), (96, 64), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (64, 48), jnp.bfloat16)
    for fmt in ("mxfp8", "nvfp4"):
      product = functools.partial(bs.dot_general, dimension_numbers=DIMS,
                                  fmt=fmt)
      y = self.variant(product)(x, w)
      with_gradient, _ = jax.vjp(product, x, w)
      chex.assert_type(y, jnp.bfloat16)
      chex.assert_trees_all_equal(y, with_gradient)

  @chex.variants(with_jit=True, without_jit=True)
  def test_gradients_are_block_scaled_along_their_own_contractions(self):
    x = jax.random.normal(jax.random.key(0), (32, 64), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (64, 32), jnp.bfloat16)
    g = jax.random.normal(jax.random.key(2), (32, 32), jnp.bfloat16)
    with bs.mxfp8_recipe(weight_tiles=False):   # w quantized again along N
      _, vjp = jax.vjp(lambda x, w: bs.dot_general(x, w, DIMS, fmt="mxfp8"),
                       x, w)
      dx, dw = self.variant(vjp)(g)

    def deq(a):   # a (R, C) quantized along C, by the reference
      v, e = reference_mxfp8(np.asarray(a, np.float32))
      return (v * 2.0 ** e[:, None]).reshape(a.shape)

    def bf16(a):
      return np.asarray(jnp.asarray(a.astype(np.float32)).astype(jnp.bfloat16),
                        np.float32)
    # dx = g w^T: g along N, w along N; dw = x^T g: both along the tokens.
    np.testing.assert_array_equal(np.asarray(dx, np.float32),
                                  bf16(deq(g) @ deq(np.asarray(w)).T))
    np.testing.assert_array_equal(np.asarray(dw, np.float32),
                                  bf16(deq(np.asarray(x).T) @ deq(
                                      np.asarray(g).T).T))

  @chex.variants(with_jit=True)
  def test_shapes_that_are_not_whole_blocks_are_padded(self):
    # K = 70, 5 tokens, 3 features: every GEMM padded, nothing raises.
    x = jax.random.normal(jax.random.key(0), (5, 70), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (70, 3), jnp.bfloat16)
    for fmt in ("mxfp8", "nvfp4"):
      f = self.variant(jax.value_and_grad(
          lambda x, w: bs.dot_general(x, w, DIMS, fmt=fmt).astype(
              jnp.float32).sum(), argnums=(0, 1)))
      value, (dx, dw) = f(x, w)
      x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
      exact = float((x32 @ w32).sum())
      assert abs(float(value) - exact) < 0.2 * float((abs(x32) @ abs(w32)).sum())
      chex.assert_shape((dx, dw), [(5, 70), (70, 3)])
      assert np.all(np.isfinite(np.asarray(dx, np.float32)))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("experts", [None, 2], ids=["dense", "experts"])
def test_a_weights_layout_does_not_change_its_numbers(fmt, experts):
  """A weight stored (out, in) gives the product and both gradients of the
  same weight stored (in, out), bit for bit: only the second has its
  weight-gradient GEMM's operands swapped (to write ``dw`` in its layout),
  and the GEMM's products and their order are the same."""
  lead = (experts,) if experts else ()
  batch = ((0,), (0,)) if experts else ((), ())
  x = jax.random.normal(jax.random.key(0), (*lead, 64, 96), jnp.bfloat16)
  w_in_out = jax.random.normal(jax.random.key(1), (*lead, 96, 48),
                               jnp.bfloat16)
  w_out_in = jnp.swapaxes(w_in_out, -1, -2)
  contract = len(lead) + 1

  def loss(x, w, rhs_contract):
    y = bs.dot_general(x, w, (((contract,), (rhs_contract,)), batch),
                       fmt=fmt)
    return y.astype(jnp.float32).sum(), y

  grads = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True),
                  static_argnums=2)
  (dx, dw), y = grads(x, w_in_out, len(lead))
  (dx_t, dw_t), y_t = grads(x, w_out_in, len(lead) + 1)
  chex.assert_trees_all_equal((y_t, dx_t, jnp.swapaxes(dw_t, -1, -2)),
                              (y, dx, dw))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("w_shape, x_shape, dims", [
    ((64, 96), (8, 96), (((1,), (1,)), ((), ()))),        # Equinox: w @ x
    ((48, 3, 64), (5, 3, 64, 7), (((2,), (2,)), ((1,), (1,)))),
    ((2, 32, 3, 16), (3, 16, 2, 32, 5), (((1,), (3,)), ((0, 2), (2, 0)))),
    ((4, 16, 6, 32), (32, 5, 16, 7), (((1, 3), (2, 0)), ((), ()))),
    ((2, 64), (2, 64, 9), (((1,), (1,)), ((0,), (0,)))),  # w: no free dim
])
def test_a_weight_on_the_left_is_the_swapped_product_in_lax_order(
    fmt, w_shape, x_shape, dims):
  """``weight="lhs"``: ``lax.dot_general(w, x, dims)``'s shape, and the
  numbers (forward and both gradients) of the product with the operands
  swapped, ``w`` as the right-hand weight, its free dims moved back."""
  w = jax.random.normal(jax.random.key(0), w_shape)
  x = jax.random.normal(jax.random.key(1), x_shape)
  (wc, xc), (wb, xb) = dims
  batch, x_free = len(wb), len(x_shape) - len(xc) - len(xb)
  w_free = len(w_shape) - len(wc) - len(wb)
  cotangent = jax.random.normal(
      jax.random.key(2), jax.eval_shape(
          lambda: jax.lax.dot_general(w, x, dims)).shape)

  def on_the_left(w, x):
    return bs.dot_general(w, x, dims, fmt=fmt, weight="lhs")

  def swapped(w, x):
    y = bs.dot_general(x, w, ((xc, wc), (xb, wb)), fmt=fmt)
    return jnp.moveaxis(y, list(range(batch + x_free, batch + x_free + w_free)),
                        list(range(batch, batch + w_free)))

  def loss(product):
    return lambda w, x: (product(w, x).astype(jnp.float32) * cotangent).sum()

  chex.assert_trees_all_close(on_the_left(w, x), swapped(w, x), atol=0, rtol=0)
  chex.assert_trees_all_close(
      jax.grad(loss(on_the_left), (0, 1))(w, x),
      jax.grad(loss(swapped), (0, 1))(w, x), atol=0, rtol=0)
  exact = jax.lax.dot_general(w, x, dims)
  assert float(jnp.linalg.norm(on_the_left(w, x).astype(jnp.float32) - exact)
               ) < 0.25 * float(jnp.linalg.norm(exact))


def test_einsum_is_block_scaled_like_its_dot_general():
  x = jax.random.normal(jax.random.key(0), (2, 8, 64), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (64, 4, 16), jnp.bfloat16)
  y = bs.einsum("btd,dhk->bthk", x, w, fmt="mxfp8")
  z = bs.dot_general(x, w, (((2,), (0,)), ((), ())), fmt="mxfp8")
  chex.assert_trees_all_equal(y, z)


@pytest.mark.parametrize("bad, pattern", [
    (dict(fmt="fp4"), "block-scaled format 'fp4' is not supported; accepted: "
                      "mxfp8, nvfp4"),
    (dict(fmt="mxfp8", out_sharding="x"), "does not take out_sharding"),
    (dict(fmt="nvfp4", weight="both"),
     "weight must be 'rhs' or 'lhs', got 'both'"),
])
def test_bad_arguments_are_named(bad, pattern):
  with pytest.raises(ValueError, match=re.escape(pattern)):
    bs.dot_general(jnp.ones((4, 32)), jnp.ones((32, 4)), DIMS, **bad)


@pytest.mark.parametrize("call, error, pattern", [
    (lambda: bs.dot_general(jnp.ones((4, 32), jnp.int32),
                            jnp.ones((32, 4), jnp.int32), DIMS, fmt="nvfp4"),
     TypeError, "takes floating-point operands; lhs is int32"),
    (lambda: bs.quantize_mxfp8(jnp.ones((64, 40))),
     ValueError, "x's axis 1 (shape (64, 40)) must be a multiple of 32"),
    (lambda: bs.quantize_nvfp4(jnp.ones((40, 64)), tiles=True),
     ValueError, "x's axis 0 (shape (40, 64)) must be a multiple of 16"),
    (lambda: bs.hadamard_16(jnp.ones((64, 40))),
     ValueError, "must be a multiple of 16"),
    (lambda: bs.quantize_mxfp8(jnp.ones((64, 64)), axis=5),
     ValueError, "axis must be an axis of x (shape (64, 64)), got 5"),
    (lambda: bs.quantize_nvfp4(jnp.ones((64, 64)), axis=-3),
     ValueError, "axis must be an axis of x (shape (64, 64)), got -3"),
    (lambda: bs.checkpoint_policy("dots_saveable"),
     TypeError, "policy must be a remat policy (a callable"),
], ids=["integer-operands", "mxfp8-axis-not-blocks", "nvfp4-tile-rows",
        "hadamard-axis", "axis-out-of-range", "negative-axis-out-of-range",
        "policy-a-string"])
def test_bad_operands_and_axes_are_named(call, error, pattern):
  """Each was accepted silently (integers quantized, an axis out of range
  wrapped around, a string policy failing only when differentiated) or
  failed inside a reshape that named neither argument."""
  with pytest.raises(error, match=re.escape(pattern)):
    call()


class ScaledByAParam(nn.Module):
  """A per-channel scale written as an einsum (``"btd,d->btd"``): a
  product over no contraction."""

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.normal(1.0), (64,))
    return jnp.einsum("btd,d->btd", x, scale)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_a_product_over_no_contraction_is_no_gemm(fmt):
  """A product that contracts nothing was block-scaled, its contraction
  padded to a block: both operands rounded to E4M3 (E2M1), 17 times
  bf16's error. It is now the compute dtype's product, on every route: a
  layer's einsum, and autocast's one-hot dispatch of an input."""
  x = jax.random.normal(jax.random.key(0), (2, 32, 64))
  model = jmp_lab.linen.with_policy(ScaledByAParam(), f"mixed_{fmt}")
  params = model.init(jax.random.key(1), x)
  report = audit_step(jax.grad(
      lambda p: model.apply(p, x).astype(jnp.float32).sum()), params)
  assert _kinds(report) == ["dot_general"] * len(report.matmuls)
  scale = params["params"]["scale"]
  chex.assert_trees_all_equal(
      model.apply(params, x),
      x.astype(jnp.bfloat16) * scale.astype(jnp.bfloat16))

  def dispatch(x, one_hot):
    return jnp.einsum("btd,te->ebtd", x, one_hot)

  one_hot = jax.nn.one_hot(jnp.arange(32) % 4, 4)
  chex.assert_trees_all_close(
      jmp_lab.autocast(dispatch, f"mixed_{fmt}")(x, one_hot),
      dispatch(x, one_hot), atol=2e-2, rtol=0)


def test_a_gpu_without_block_scaled_cores_warns_once(monkeypatch):
  class Hopper:
    platform, compute_capability, device_kind = "gpu", "9.0", "NVIDIA H100"
  monkeypatch.setattr(jax, "local_devices", lambda: [Hopper()])
  monkeypatch.setattr(block_matmul, "_WARNED", set())
  with pytest.warns(UserWarning, match="dequantize plus 16-bit GEMMs"):
    jax.make_jaxpr(lambda x, w: bs.dot_general(x, w, DIMS, fmt="nvfp4"))(
        jnp.ones((4, 32)), jnp.ones((32, 4)))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.make_jaxpr(lambda x, w: bs.dot_general(x, w, DIMS, fmt="mxfp8"))(
        jnp.ones((4, 32)), jnp.ones((32, 4)))


def test_the_nvfp4_recipe_can_be_ablated_and_restored():
  assert block_matmul.recipe_for("mxfp8").weight_tiles
  with bs.mxfp8_recipe(weight_tiles=False):
    assert not block_matmul.recipe_for("mxfp8").weight_tiles
  assert block_matmul.recipe_for("mxfp8") == block_matmul.RECIPES["mxfp8"]
  assert block_matmul.recipe_for("nvfp4").hadamard
  with bs.nvfp4_recipe(hadamard=False, stochastic_rounding=False):
    recipe = block_matmul.recipe_for("nvfp4")
    assert not recipe.hadamard and not recipe.stochastic_gradients
  assert block_matmul.recipe_for("nvfp4") == block_matmul.RECIPES["nvfp4"]
  with pytest.raises(TypeError, match="hadamard must be a bool"):
    with bs.nvfp4_recipe(hadamard="no"):
      pass


def test_a_jitted_step_follows_the_recipe_it_is_called_under():
  """The recipe is part of what ``jax.jit`` keys its caches on: a jitted
  function called under ``nvfp4_recipe(...)`` is traced again with it, and
  outside again without it. (Before, a function traced once kept that
  recipe whatever context it was called in, with no warning.)"""
  x = jax.random.normal(jax.random.key(0), (32, 64))
  w = jax.random.normal(jax.random.key(1), (64, 32))
  grad = jax.grad(lambda w: jnp.square(
      bs.dot_general(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), DIMS,
                     fmt="nvfp4").astype(jnp.float32)).sum())
  step = jax.jit(grad)
  default = step(w)
  with bs.nvfp4_recipe(hadamard=False, stochastic_rounding=False):
    ablated = step(w)
    chex.assert_trees_all_equal(ablated, jax.jit(grad)(w))
  assert not bool((ablated == default).all())
  chex.assert_trees_all_equal(step(w), default)


# --- the policy keys, on every route ---------------------------------------------


def test_policy_keys_and_presets():
  assert jmp_lab.get_policy("mixed_mxfp8") == jmp_lab.get_policy(
      "mixed_bfloat16,matmul=mxfp8")
  assert jmp_lab.get_policy("mixed_nvfp4").matmul == "nvfp4"
  with pytest.raises(ValueError, match="accepted: fp8, fp8_current, mxfp8, "
                                       "nvfp4"):
    jmp_lab.get_policy("mixed_bfloat16,matmul=mxfp4")


class Layers(nn.Module):
  """Every matmul layer fp8 reaches, one pinning float32, and a head."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(64)(x)
    x = nn.DenseGeneral((2, 32), dtype=jnp.float32)(x)
    x = nn.Einsum((2, 32, 64), "bhd,hdk->bk")(x)
    return nn.Dense(16, name="head")(x)


class NnxLayers(nnx.Module):

  def __init__(self, rngs):
    self.dense = nnx.Linear(48, 64, rngs=rngs)
    self.general = nnx.LinearGeneral(64, (2, 32), dtype=jnp.float32,
                                      rngs=rngs)
    self.einsum = nnx.Einsum("bhd,hdk->bk", (2, 32, 64), rngs=rngs)
    self.head = nnx.Linear(64, 16, rngs=rngs)

  def __call__(self, x):
    return self.head(self.einsum(self.general(self.dense(x))))


def _kinds(report):
  """The audit's kinds, without NVFP4's Hadamard GEMMs (two per layer)."""
  return sorted(r.kind for r in report.matmuls if r.kind != "hadamard")


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_every_matmul_layer_is_block_scaled_on_linen_and_nnx(fmt):
  x = jnp.ones((32, 48))
  policy = f"mixed_{fmt}"
  linen = jmp_lab.linen.with_policy(Layers(), policy,
                                    path_overrides={"head": "mixed_bfloat16"})
  params = jax.jit(linen.init)(jax.random.key(0), x)   # no new RNG stream
  report = audit_step(jax.grad(lambda p: linen.apply(p, x).sum()), params)
  # three layers x three GEMMs block-scaled; the head kept in bf16 (3 GEMMs
  # in jax's transpose: forward, input and weight gradients).
  assert _kinds(report) == ["dot_general"] * 3 + [fmt] * 9
  hadamards = [r for r in report.matmuls if r.kind == "hadamard"]
  assert len(hadamards) == (6 if fmt == "nvfp4" else 0)
  assert all(r.lhs_shape[1:] == (16, 16) for r in hadamards)

  model = jmp_lab.nnx.with_policy(NnxLayers(nnx.Rngs(0)), policy,
                                  path_overrides={"head": "mixed_bfloat16"})
  graph, state = nnx.split(model)
  report = audit_step(jax.grad(
      lambda s: nnx.merge(graph, s)(x).sum()), state)
  assert _kinds(report) == ["dot_general"] * 3 + [fmt] * 9


def test_the_audit_finds_each_block_scaled_gemm_where_its_layer_is_called():
  """A block-scaled or fp8 GEMM's ``where`` is the layer's call, as the
  bf16 GEMM's is, or the user's line under autocast; the Hadamard GEMMs
  (traced without a call site) name their layer. (Before, every row read
  ``block_matmul.py``, ``fp8_matmul.py`` or ``_compat.py``: jmp_lab's own
  lines.)"""
  x = jnp.ones((32, 48))
  locations = {}
  for policy in ("mixed_bfloat16", "mixed_fp8", "mixed_mxfp8", "mixed_nvfp4"):
    model = jmp_lab.linen.with_policy(Layers(), policy)
    params = model.init(jax.random.key(0), x)
    report = audit_step(jax.grad(lambda p: model.apply(p, x).sum()), params)
    locations[policy] = {(r.kind, r.location) for r in report.matmuls}
  assert not [where for rows in locations.values() for _, where in rows
              if re.match(r"(block_matmul|fp8_matmul|_compat)\.py", where)]
  # Flax's lines, or the model's own where jmp_lab runs the layer's call
  # (an Einsum's).
  bf16 = {where for _, where in locations["mixed_bfloat16"]}
  for policy in ("mixed_fp8", "mixed_mxfp8", "mixed_nvfp4"):
    assert {where for kind, where in locations[policy] if kind != "hadamard"
            if not where.startswith("test_block_scaled.py:")} <= bf16, (
                locations)
  hadamard = {where.split("/")[1] for kind, where in locations["mixed_nvfp4"]
              if kind == "hadamard"}
  assert hadamard == {"Dense_0", "DenseGeneral_0", "Einsum_0", "head"}, (
      hadamard)

  def loss(w, x):
    return jnp.tanh(x @ w).sum()
  report = audit_step(jax.grad(jmp_lab.autocast(loss, "mixed_mxfp8")),
                      jnp.ones((48, 64)), x)
  line = loss.__code__.co_firstlineno + 1
  assert {r.location for r in report.matmuls} == {
      f"test_block_scaled.py:{line}"}


def test_the_audit_names_an_nnx_layers_hadamard_gemms_by_its_gemms():
  """NNX modules open no name scopes, so NVFP4's Hadamard GEMMs (traced
  without a call site) had no layer to name: the audit showed ``?`` or an
  einsum's equation. They are where the GEMM they feed is."""
  x = jnp.ones((32, 48))
  model = jmp_lab.nnx.with_policy(NnxLayers(nnx.Rngs(0)), "mixed_nvfp4")
  graph, state = nnx.split(model)
  report = audit_step(jax.grad(lambda s: nnx.merge(graph, s)(x).sum()), state)
  where = collections.defaultdict(set)
  for r in report.matmuls:
    where[r.kind].add(r.location)
  # (Which line an einsum's GEMMs show can be another test's: jax reuses
  # the trace of jnp.einsum's jitted helper, with its source lines.)
  assert where["hadamard"] == where["nvfp4"], where
  assert not [w for w in where["hadamard"] if w == "?" or "->" in w]
  # The 48-wide input's transform is at the first Linear's forward GEMM.
  first = {r.location for r in report.matmuls
           if r.kind == "nvfp4" and r.lhs_shape == (1, 32, 48)}
  assert {r.location for r in report.matmuls if r.kind == "hadamard"
          and r.rhs_shape[-1] == 48} == first


def test_autocast_block_scales_weight_matmuls_not_attention():
  def loss(p, x):
    h = jnp.tanh(x @ p["w1"])
    q, k = h @ p["wq"], h @ p["wk"]
    return ((jax.nn.softmax(q @ k.T) @ h) @ p["w2"]).sum()
  p = {name: jax.random.normal(jax.random.key(i), shape) * 0.1
       for i, (name, shape) in enumerate([("w1", (64, 64)), ("wq", (64, 32)),
                                          ("wk", (64, 32)), ("w2", (64, 16))])}
  x = jax.random.normal(jax.random.key(9), (32, 64))
  grad = jax.jit(jax.grad(jmp_lab.autocast(loss, "mixed_mxfp8")))
  kinds = _kinds(audit_step(grad, p, x))
  assert kinds.count("mxfp8") == 12 and kinds.count("dot_general") == 6
  exact = jax.jit(jax.grad(loss))(p, x)
  for name, g in grad(p, x).items():
    assert float(jnp.linalg.norm(g - exact[name])) < 0.2 * float(
        jnp.linalg.norm(exact[name]))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_autocast_block_scales_a_weight_on_the_left_as_equinox_writes_it(fmt):
  """Equinox's ``Linear`` computes ``weight @ x`` (its weight is ``(out,
  in)``, on the left) and is applied under ``jax.vmap``. Its GEMMs are
  block-scaled as linen's Dense with the same weight transposed, to the
  bit, forward and both gradients. (Before, autocast only took a weight on
  the right, and an Equinox model ran every GEMM in bf16.)"""
  import equinox as eqx  # pylint: disable=import-outside-toplevel
  layer = eqx.nn.Linear(64, 32, key=jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (4, 32, 64))
  # A cotangent that is the same bf16 values on both routes.
  weights = jax.random.normal(jax.random.key(2), (4, 32, 32)).astype(
      jnp.bfloat16).astype(jnp.float32)

  # The layer's input is computed (normalized, in fp32 under both), as a
  # hidden layer's is: of two stored operands (a layer applied to an
  # argument) autocast takes the right one as the weight.
  def eqx_loss(layer, x):
    h = jax.nn.standardize(x, axis=-1)
    y = jax.vmap(jax.vmap(layer))(h)
    return (y.astype(jnp.float32) * weights).sum()

  dense = jmp_lab.linen.with_policy(nn.Dense(32), f"mixed_{fmt}")
  variables = {"params": {"kernel": layer.weight.T, "bias": layer.bias}}

  def linen_loss(variables, x):
    h = jax.nn.standardize(x, axis=-1)
    y = dense.apply(variables, h)
    return (y.astype(jnp.float32) * weights).sum()

  eqx_grad = jax.jit(jax.grad(jmp_lab.autocast(eqx_loss, f"mixed_{fmt}"),
                              argnums=(0, 1)))
  linen_grad = jax.jit(jax.grad(linen_loss, argnums=(0, 1)))
  assert _kinds(audit_step(eqx_grad, layer, x)).count(fmt) == 3
  (eqx_layer, eqx_x), (linen_variables, linen_x) = (
      eqx_grad(layer, x), linen_grad(variables, x))
  chex.assert_trees_all_close(eqx_x, linen_x, atol=0, rtol=0)
  chex.assert_trees_all_close(eqx_layer.weight.T,
                              linen_variables["params"]["kernel"],
                              atol=0, rtol=0)
  # (The bias gradients differ in rounding: flax sums a bf16 bias's
  # gradient in bf16, autocast sums in fp32.)


def test_autocast_takes_no_matrix_the_code_built_for_a_weight_on_the_left():
  """A causal mask and a one-hot segment matrix, built inside the
  function, multiply from the left: they are no weights and stay in bf16
  (a weight on the left is one handed in, as Equinox's ``Linear`` has)."""
  ids = jnp.arange(64) % 8

  def loss(w, h):
    h = jnp.tanh(h @ w)
    causal = jnp.tril(jnp.ones((64, 64))) @ h
    segments = jax.nn.one_hot(ids, 8).T @ h
    return causal.sum() + segments.sum()

  grad = jax.grad(jmp_lab.autocast(loss, "mixed_mxfp8"))
  kinds = _kinds(audit_step(grad, jnp.ones((64, 64)),
                            jax.random.normal(jax.random.key(0), (64, 64))))
  assert kinds == ["dot_general"] * 4 + ["mxfp8"] * 3


def test_nvfp4_under_float16_gives_finite_products_and_trains():
  """NVFP4's GEMM multiplies values each up to 2688 times its tensor's
  amax (the global scales come after it): under float16 its result
  overflowed 65504 and every product was non-finite, every step skipped.
  Now it is written in fp32 and scaled first, as bf16's would be."""
  import optax
  keys = jax.random.split(jax.random.key(5), 2)
  x, w = (jax.random.normal(k, shape) for k, shape in zip(keys, [(32, 64),
                                                                 (64, 32)]))
  y16 = bs.dot_general(x.astype(jnp.float16), w.astype(jnp.float16), DIMS,
                       fmt="nvfp4")
  y_bf16 = bs.dot_general(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                          DIMS, fmt="nvfp4")
  chex.assert_type(y16, jnp.float16)
  assert bool(jnp.isfinite(y16).all())
  exact = x @ w
  error = lambda y: float(  # noqa: E731
      jnp.linalg.norm(y.astype(jnp.float32) - exact) / jnp.linalg.norm(exact))
  # 4-bit operands: about 10% off the exact product, as in bf16.
  assert error(y16) < 0.2 and abs(error(y16) - error(y_bf16)) < 0.02, (
      error(y16), error(y_bf16))

  policy = "mixed_float16,matmul=nvfp4"
  model = jmp_lab.linen.with_policy(Layers(), policy)
  x = jax.random.normal(jax.random.key(6), (32, 128))
  target = jax.random.normal(jax.random.key(7), (32, 16))
  state = jmp_lab.TrainState.create(
      apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"],
      tx=jmp_lab.mixed_precision(optax.adam(1e-3), policy=policy))

  def loss_fn(params, state, batch):
    out = state.apply_fn({"params": params}, batch[0])
    return jnp.square(out.astype(jnp.float32) - batch[1]).mean()

  step = jmp_lab.make_train_step(loss_fn)
  losses = []
  for _ in range(8):
    state, metrics = step(state, (x, target))
    losses.append(float(metrics["loss"]))
  assert all(np.isfinite(losses)), losses
  assert int(state.skipped_steps) < 8 and losses[-1] < losses[0], losses


# --- under vmap: a model mapped over its inputs shares its weights ------------


def _per_example_and_mapped(fn, params, xs):
  """``fn(params, x)`` for each ``x`` of ``xs`` stacked, and ``fn`` under
  ``jax.vmap`` with ``params`` shared (not batched)."""
  each = jax.tree.map(lambda *v: jnp.stack(v),
                      *[jax.jit(fn)(params, x) for x in xs])
  mapped = jax.jit(jax.vmap(fn, in_axes=(None, 0)))(params, xs)
  return each, mapped


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_a_model_under_vmap_shares_its_block_scaled_weights(fmt):
  """``jax.vmap`` over the inputs of a model whose weights it does not
  batch, on every route: the numbers of the model run on each input.
  (Before, jax's batching rule of ``scaled_matmul``, traced for the CUDA
  branch even on a CPU, raised a bare ``AssertionError``: it requires all
  four operands batched along one axis.)"""
  xs = jax.random.normal(jax.random.key(1), (3, 32, 48))
  model = jmp_lab.linen.with_policy(Layers(), f"mixed_{fmt}")
  params = model.init(jax.random.key(0), xs[0])
  each, mapped = _per_example_and_mapped(model.apply, params, xs)
  chex.assert_trees_all_close(mapped, each, rtol=1e-2, atol=1e-2)
  grad = lambda p, x: jax.grad(  # noqa: E731
      lambda p: jnp.square(model.apply(p, x)).sum())(p)
  each, mapped = _per_example_and_mapped(grad, params, xs)
  chex.assert_trees_all_close(mapped, each, rtol=2e-2, atol=2e-2)

  nnx_model = jmp_lab.nnx.with_policy(NnxLayers(nnx.Rngs(0)), f"mixed_{fmt}")
  mapped = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(nnx_model, xs)
  each = jnp.stack([nnx_model(x) for x in xs])
  chex.assert_trees_all_close(mapped, each, rtol=1e-2, atol=1e-2)

  def plain(p, x):
    return jnp.tanh(x @ p["w1"]) @ p["w2"]
  p = {"w1": jax.random.normal(jax.random.key(2), (48, 64)) * 0.1,
       "w2": jax.random.normal(jax.random.key(3), (64, 32)) * 0.1}
  each, mapped = _per_example_and_mapped(
      jmp_lab.autocast(plain, f"mixed_{fmt}"), p, xs)
  chex.assert_trees_all_close(mapped, each, rtol=1e-2, atol=1e-2)
  assert _kinds(audit_step(jax.vmap(jmp_lab.autocast(plain, f"mixed_{fmt}"),
                                    in_axes=(None, 0)), p, xs)) == [fmt] * 2


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_a_vmapped_model_compiles_to_block_scaled_gemms_for_a_b200(fmt):
  """The CUDA branch's batching rule lowers: a model mapped over its inputs
  runs cuDNN's block-scaled GEMM, one per layer and pass, the mapped axis
  joined to the rows (no weight broadcast to the mapped axis)."""
  require_cuda_plugin()
  model = jmp_lab.linen.with_policy(Layers(), f"mixed_{fmt}")
  xs = jax.ShapeDtypeStruct((4, 64, 48), jnp.float32)
  params = jax.eval_shape(model.init, jax.random.key(0),
                          jax.ShapeDtypeStruct(xs.shape[1:], xs.dtype))
  step = jax.grad(lambda p, xs: jnp.square(jax.vmap(
      model.apply, in_axes=(None, 0))(p, xs)).sum())
  report = jmp_lab.diagnostics.compiled_report(step, params, xs,
                                               target="b200")
  # 4 layers x 3 GEMMs, less the first layer's unused input gradient.
  assert len(report.block_scaled_gemms) == 11
  assert {g.block_scaled for g in report.block_scaled_gemms} == {fmt}
  # Else only NVFP4's Hadamard transform, as XLA's GEMMs of width 16: under
  # vmap NVFP4 quantizes in XLA's passes (each input has its own global
  # scale). MXFP8's one-pass kernel quantizes all the mapped inputs' rows
  # at once: the activations and output gradients of whole blocks (all but
  # the 48-wide input and the 16-wide head's gradient), as without vmap.
  assert all(g.lhs.dims == (16, 16) for g in report.gemms
             if g.block_scaled is None)
  names = [k.name for k in report.pallas_kernels]
  assert names == (["mxfp8_cast_transpose"] * 6 if fmt == "mxfp8" else []), (
      names)
  # A forward or input-gradient GEMM multiplies the 4 x 64 rows as one
  # matrix against the one weight; a weight gradient, one per input.
  shapes = [g.lhs.dims[:2] for g in report.block_scaled_gemms]
  assert shapes.count((1, 256)) == 7 and shapes.count((4, 128)) == 4, shapes


def test_mxfp8_quantizes_mapped_inputs_as_each_alone():
  """Under ``vmap`` MXFP8's quantize joins the mapped inputs' rows into one
  call (one kernel on a GPU): each input's copies, both layouts, are the
  ones it gets alone, to the bit."""
  from jmp_lab.kernels import mx_cast_transpose as mx, platform
  if not platform.importable("jax.experimental.pallas.triton"):
    pytest.skip("without Pallas' Triton backend MXFP8 quantizes by XLA only")
  xs = jax.random.normal(jax.random.key(0), (3, 64, 96)).astype(jnp.bfloat16)
  quantize = lambda x: mx.quantize_both_ways(  # noqa: E731
      x, block_matmul._mxfp8_both_ways)
  mapped = jax.jit(jax.vmap(quantize))(xs)
  each = [quantize(x) for x in xs]
  for i, got in enumerate(mapped):
    chex.assert_trees_all_equal(
        got.view(jnp.uint8), jnp.stack([e[i] for e in each]).view(jnp.uint8))


def _scaled_matmul_runs_here() -> bool:
  """Whether ``jax.nn.scaled_matmul`` runs on this backend (jax 0.11 added
  a CPU path; 0.10.2 has none)."""
  q = jnp.ones((1, 32, 32), jnp.float8_e4m3fn)
  s = jnp.ones((1, 32, 1), jnp.float8_e8m0fnu)
  try:
    jax.nn.scaled_matmul(q, q, s, s, preferred_element_type=jnp.bfloat16)
  except Exception:  # pylint: disable=broad-except
    return False
  return True


@pytest.mark.parametrize("batched", [(True, False), (False, True),
                                     (True, True)])
def test_the_native_products_batching_rule_joins_the_mapped_axis(batched):
  """The CUDA branch's product under ``vmap``, run where jax can run it
  (the newest-jax lane's CPU): each mapped case against the product of
  each slice, to the bit (the same GEMMs, rows or columns joined)."""
  if not _scaled_matmul_runs_here():
    pytest.skip("jax.nn.scaled_matmul does not run on this backend")
  keys = jax.random.split(jax.random.key(4), 2)
  a, b = (bs.quantize_mxfp8(jax.random.normal(k, (3, 2, 32, 64))
                            .astype(jnp.bfloat16)) for k in keys)
  product = block_matmul._native_product(np.dtype(jnp.bfloat16))
  a_axis, b_axis = (0 if flag else None for flag in batched)
  a_in = jax.tree.map(lambda v: v if batched[0] else v[0], (a.values,
                                                            a.scales))
  b_in = jax.tree.map(lambda v: v if batched[1] else v[0], (b.values,
                                                            b.scales))
  mapped = jax.vmap(product, in_axes=(a_axis, b_axis, a_axis, b_axis))(
      a_in[0], b_in[0], a_in[1], b_in[1])
  each = jnp.stack([product(a.values[i if batched[0] else 0],
                            b.values[i if batched[1] else 0],
                            a.scales[i if batched[0] else 0],
                            b.scales[i if batched[1] else 0])
                    for i in range(3)])
  chex.assert_trees_all_equal(mapped, each)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_a_block_scaled_product_runs_inside_shard_map(fmt):
  """Inside ``shard_map`` the emulated GEMM varies over the manual axes and
  ``scaled_matmul``'s did not, so ``lax.platform_dependent`` refused the
  two branches (a TypeError, on any mesh). Each device's rows are its own
  product's, bit for bit."""
  mesh = jax.make_mesh((2,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  x = jax.random.normal(jax.random.key(0), (128, 64))
  w = jax.random.normal(jax.random.key(1), (64, 96))

  def product(x, w):
    return bs.dot_general(x, w, DIMS, fmt=fmt).astype(jnp.float32)

  def input_gradient(x, w):
    return jax.grad(lambda x: jnp.square(product(x, w)).sum())(x)

  with jax.set_mesh(mesh):
    for fn in (product, input_gradient):
      split = jax.jit(jax.shard_map(fn, in_specs=(P("data"), P()),
                                    out_specs=P("data")))(x, w)
      halves = [jax.jit(fn)(x[:64], w), jax.jit(fn)(x[64:], w)]
      chex.assert_trees_all_equal(split, jnp.concatenate(halves))
    # The replicated weight's gradient is summed over the devices, as jax's
    # own transpose sums it (a custom_vjp must return it replicated).
    weight_gradient = jax.grad(lambda x, w: jnp.square(product(x, w)).sum(),
                               argnums=1)
    split = jax.jit(jax.shard_map(weight_gradient, in_specs=(P("data"), P()),
                                  out_specs=P()))(x, w)
    chex.assert_trees_all_close(
        split, weight_gradient(x[:64], w) + weight_gradient(x[64:], w),
        rtol=1e-6, atol=1e-6)


def test_autocast_still_refuses_per_tensor_fp8():
  with pytest.raises(ValueError, match="autocast has no fp8 matmuls: .*"
                                       "does run the block-scaled"):
    jmp_lab.autocast(lambda x: x, "mixed_fp8")


class Scanned(nn.Module):

  @nn.compact
  def __call__(self, x, _):
    return nn.Dense(64)(jnp.tanh(x)), None


def test_scanned_and_rematerialized_layers_are_block_scaled():
  stack = nn.scan(nn.remat(Scanned), variable_axes={"params": 0},
                  split_rngs={"params": True}, length=3)
  model = jmp_lab.linen.with_policy(stack(), "mixed_nvfp4")
  x = jnp.ones((16, 64))
  params = jax.jit(model.init)(jax.random.key(0), x, None)
  report = audit_step(jax.grad(
      lambda p: model.apply(p, x, None)[0].sum()), params)
  assert {r.kind for r in report.matmuls} == {"nvfp4", "hadamard"}
  assert sum(r.times for r in report.matmuls if r.kind == "nvfp4") == 9


# --- compiled for a B200, without one -------------------------------------------


def _mlp_step_for_b200(fmt: str, front_end: str):
  from jmp_lab.diagnostics import compiled_report
  x = jax.ShapeDtypeStruct((256, 128), jnp.float32)
  if front_end == "linen":
    model = jmp_lab.linen.with_policy(Layers(), f"mixed_{fmt}")
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    step = jax.grad(lambda p, x: jnp.square(model.apply(p, x)).sum(),
                    argnums=(0, 1))
    return compiled_report(step, params, x, target="b200")
  model = jmp_lab.nnx.with_policy(NnxLayers(nnx.Rngs(0)), f"mixed_{fmt}")
  graph, state = nnx.split(model)
  x = jax.ShapeDtypeStruct((256, 48), jnp.float32)
  step = jax.grad(lambda s, x: jnp.square(nnx.merge(graph, s)(x)).sum(),
                  argnums=(0, 1))
  return compiled_report(step, state, x, target="b200")


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("front_end", ["linen", "nnx"])
def test_every_gemm_compiles_to_cudnns_block_scaled_dot_for_a_b200(
    fmt, front_end):
  require_cuda_plugin()
  report = _mlp_step_for_b200(fmt, front_end)
  assert report.hlo_text.count('custom_call_target="__cudnn$blockScaledDot"') == 12
  assert len(report.block_scaled_gemms) == 12
  assert {g.block_scaled for g in report.block_scaled_gemms} == {fmt}
  # Nothing else: NVFP4's Hadamard transform runs inside its quantize kernel.
  assert not [g for g in report.gemms if g.block_scaled is None]
  assert report.block_scaled_flop_share() > 0.9
  assert report.target.peak_flops["fp4" if fmt == "nvfp4" else "fp8"] in (
      9e15, 4.5e15)
  assert "sm_100a" in report.table() and "block-scaled GEMMs: 12" in (
      report.table())
  # Each activation and output gradient of whole tiles is quantized into
  # both layouts by Pallas kernels (x: 256 tokens): MXFP8's one kernel for
  # blocks of 32 (the 4 layers' inputs but the 48-wide NNX one, and the
  # output gradients but the 16-wide head's); NVFP4's amax kernel and its
  # cast kernel for all 8 (blocks of 16).
  names = [k.name for k in report.pallas_kernels]
  if fmt == "mxfp8":
    assert names == ["mxfp8_cast_transpose"] * (7 if front_end == "linen"
                                                else 6), names
  else:
    assert sorted(names) == (["nvfp4_amax"] * 8
                             + ["nvfp4_cast_transpose"] * 8), names
  assert all(k.spill_bytes in (0, None) for k in report.pallas_kernels)


def test_a_weights_tile_maxima_are_found_under_the_quantize_scope():
  """XLA splits MXFP8's weight quantization and names the tile-maxima
  reduction it makes itself (``reduce_max``, no name stack). The report
  names such a fusion by its fused ops, so that ``scope`` counts it: before,
  a 68 MB read of the (8192, 2048) fp32 kernel was in no scope."""
  require_cuda_plugin()
  model = jmp_lab.linen.with_policy(nn.Dense(2048), "mixed_mxfp8")
  x = jax.ShapeDtypeStruct((1024, 8192), jnp.float32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  report = jmp_lab.diagnostics.compiled_report(
      jax.grad(lambda p, x: jnp.square(model.apply(p, x)).sum()), params, x,
      target="b200")
  assert not [k.name for k in report.kernel_records
              if k.opcode == "fusion" and not k.op_name]
  kernel_bytes = 8192 * 2048 * 4
  tile_maxima = [k for k in report.kernel_records
                 if "jmp_lab_block_quantize" in k.op_name.split("/")
                 and k.opcode == "fusion"
                 and kernel_bytes <= k.io_bytes < 1.1 * kernel_bytes]
  assert len(tile_maxima) == 1, report.scope("jmp_lab_block_quantize")


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_the_optimizer_updates_block_scaled_weights_in_place_on_a_b200(fmt):
  """The weight-gradient GEMM writes each gradient in its weight's own
  layout (a Dense kernel's (in, out), a DenseGeneral's (in, heads, dim)),
  so the donated train step updates params and moments in place. Written
  transposed, the gradient reached the update through a transposing read,
  from which XLA will not write in place: every updated param and moment
  was written elsewhere and copied back."""
  require_cuda_plugin()
  import optax
  model = jmp_lab.linen.with_policy(Layers(), f"mixed_{fmt}")
  x = jnp.zeros((256, 128), jnp.float32)

  def make_state():
    params = model.init(jax.random.key(0), x)["params"]
    return jmp_lab.TrainState.create(
        apply_fn=model.apply, params=params,
        tx=jmp_lab.mixed_precision(optax.adam(1e-3), policy=f"mixed_{fmt}"))

  def loss_fn(params, state, batch):
    return jnp.square(state.apply_fn({"params": params}, batch)).mean()

  state = jax.eval_shape(make_state)
  report = jmp_lab.diagnostics.compiled_report(
      jmp_lab.make_train_step(loss_fn), state,
      jax.ShapeDtypeStruct(x.shape, x.dtype), target="b200")
  # 12 but the input's gradient, which nothing asks for.
  assert len(report.block_scaled_gemms) == 11
  smallest_kernel = min(
      p.size for p in jax.tree_util.tree_leaves(state.params) if p.ndim > 1)
  copies = [k for k in report.kernel_records if k.opcode == "copy"
            and k.io_bytes >= 2 * 4 * smallest_kernel]
  assert not copies, copies


def test_four_over_six_chooses_inside_nvfp4s_kernels_on_a_b200():
  """Under ``nvfp4_recipe(four_over_six=True)`` every activation and output
  gradient is still quantized by NVFP4's two kernels (the choice of 4 or 6
  made in the cast kernel's registers, without spilling on sm_100a), not
  by XLA's passes (+0.56 ms of memory a layer of the 1.3B-class step)."""
  require_cuda_plugin()
  with bs.nvfp4_recipe(four_over_six=True):
    report = _mlp_step_for_b200("nvfp4", "linen")
  assert sorted(k.name for k in report.pallas_kernels) == (
      ["nvfp4_amax"] * 8 + ["nvfp4_cast_transpose"] * 8)
  assert all(k.spill_bytes == 0 for k in report.pallas_kernels)
  assert len(report.block_scaled_gemms) == 12


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_a_forward_without_a_gradient_quantizes_one_way_by_xla_on_a_b200(
    fmt):
  """Evaluation (``apply``, no gradient) compiled for a B200: no kernel
  writes the weight gradient's copies; each input is quantized along its
  contraction by XLA, which fuses it into its producer (GPT-2 small's
  forward: 0.90x the modelled time under NVFP4, 0.98x under MXFP8)."""
  require_cuda_plugin()
  from jmp_lab.diagnostics import compiled_report
  x = jax.ShapeDtypeStruct((256, 128), jnp.float32)
  model = jmp_lab.linen.with_policy(Layers(), f"mixed_{fmt}")
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  report = compiled_report(model.apply, params, x, target="b200")
  assert not report.pallas_kernels, [k.name for k in report.pallas_kernels]
  assert len(report.block_scaled_gemms) == 4


class SelfAttention(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    return nn.MultiHeadDotProductAttention(num_heads=4)(h, h)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_self_attention_quantizes_its_one_input_once_on_a_b200(fmt):
  """Flax's attention projects one input for the query, the key and the
  value: compiled for a B200, that input is quantized once, not three
  times. The four projections' inputs are two tensors and their output
  gradients four, so six tensors are quantized (NVFP4: an amax kernel and a
  cast kernel each)."""
  require_cuda_plugin()
  model = jmp_lab.linen.with_policy(SelfAttention(), f"mixed_{fmt}")
  x = jax.ShapeDtypeStruct((2, 128, 128), jnp.float32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  report = jmp_lab.diagnostics.compiled_report(
      jax.grad(lambda p, x: jnp.square(
          model.apply(p, x).astype(jnp.float32)).sum()),
      params, x, target="b200")
  names = sorted(k.name for k in report.pallas_kernels)
  assert names == (["mxfp8_cast_transpose"] * 6 if fmt == "mxfp8" else
                   ["nvfp4_amax"] * 6 + ["nvfp4_cast_transpose"] * 6), names
  assert len(report.block_scaled_gemms) == 12   # 4 projections x 3 GEMMs


def test_on_8_b200s_self_attention_quantizes_its_one_input_once():
  """Data parallel over 8 B200s, MXFP8: each device quantizes its share of
  attention's one input once for the query, the key and the value (the
  partitioner's kernels merge as one device's do). NVFP4's amax kernels
  merge there too, but not its cast kernels: each reads the global scale of
  its own all-reduce, which XLA does not merge."""
  require_cuda_plugin()
  from jax.sharding import PartitionSpec as P
  counts = {}
  for fmt in ("mxfp8", "nvfp4"):
    model = jmp_lab.linen.with_policy(SelfAttention(), f"mixed_{fmt}")
    x = jax.ShapeDtypeStruct((16, 128, 128), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    report = jmp_lab.diagnostics.compiled_report(
        jax.grad(lambda p, x, model=model: jnp.square(
            model.apply(p, x).astype(jnp.float32)).sum()),
        params, x, target="b200", devices=8, axes={"data": 8},
        in_specs=(P(), P("data")))
    counts[fmt] = collections.Counter(k.name for k in report.pallas_kernels)
    assert len(report.block_scaled_gemms) == 12
  assert counts["mxfp8"] == {"mxfp8_cast_transpose": 6}
  assert counts["nvfp4"]["nvfp4_amax"] == 6
  assert 6 <= counts["nvfp4"]["nvfp4_cast_transpose"] <= 8


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("axes, x_spec, w_spec", [
    ({"data": 8}, ("data",), ()),
    ({"data": 4, "tensor": 2}, ("data",), (None, "tensor")),
], ids=["data", "data-tensor"])
def test_on_8_b200s_each_device_quantizes_its_own_tokens_both_ways(
    axes, x_spec, w_spec, fmt):
  """Data (and tensor) parallel over 8 B200s: the one-pass quantize kernels
  run on each device's own tokens for the input and for the output
  gradient (their partitioning rules: tiles never straddle devices; NVFP4's
  amaxes reduced across devices), no device gathers the batch or any
  16-bit tensor, and every GEMM is block-scaled."""
  require_cuda_plugin()
  from jax.sharding import PartitionSpec as P
  tokens, width, features = 4096, 1024, 2048

  def step(x, w):
    return jax.value_and_grad(lambda x, w: bs.dot_general(
        x, w, DIMS, fmt=fmt).astype(jnp.float32).sum(),
        argnums=(0, 1))(x, w)

  report = jmp_lab.diagnostics.compiled_report(
      step, jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16),
      jax.ShapeDtypeStruct((width, features), jnp.bfloat16),
      target="b200", devices=8, axes=axes,
      in_specs=(P(*x_spec), P(*w_spec)))
  names = sorted(k.name for k in report.pallas_kernels)
  assert names == (["mxfp8_cast_transpose"] * 2 if fmt == "mxfp8" else
                   ["nvfp4_amax", "nvfp4_amax", "nvfp4_cast_transpose",
                    "nvfp4_cast_transpose"]), names
  # No 16-bit tensor is gathered (under tensor parallel, jax's scaled_matmul
  # gathers the quantized weight's halves with their scales).
  gathers = [c for c in report.collectives if c.kind == "all-gather"]
  narrow = {"f8e4m3fn", "u8", "f4e2m1fn", "s8", "f32"}
  assert all(set(c.dtypes) <= narrow for c in gathers), gathers
  assert all(c.bytes < tokens * width for c in gathers), gathers
  assert not gathers or "tensor" in axes
  rows = tokens // axes["data"]
  # Each device's input, blocked along the tokens and written transposed.
  value_type = "f8e4m3fn" if fmt == "mxfp8" else "f4e2m1fn"
  assert re.search(rf"{value_type}\[(1,)?{width},{rows}\]", report.hlo_text)
  assert len(report.block_scaled_gemms) == 3 and len(report.gemms) == 3


def _fsdp_weight_step(fmt: str):
  """The gradients of a block-scaled product ``x @ w``."""
  def step(x, w):
    return jax.grad(lambda x, w: jnp.square(bs.dot_general(
        x, w, DIMS, fmt=fmt).astype(jnp.float32)).sum(), argnums=(0, 1))(x, w)
  return step


@pytest.mark.parametrize("fmt, width", [("mxfp8", 128), ("nvfp4", 64)])
def test_on_8_b200s_a_weight_split_finer_than_its_blocks_compiles(fmt, width):
  """FSDP over more devices than a weight has blocks along its split axis:
  a weight split in 8 along a contraction of 128 (MXFP8: 16 of a 32-block
  on each device) or 64 (NVFP4: 8 of 16). XLA splits the block count by a
  factor no mesh axis names, and jax's decoding of that layout raised an
  IndivisibleError inside the compile; now the quantized weight is
  gathered whole there, and the step compiles, every GEMM block-scaled,
  no 16-bit weight gathered. (On 8 CPU devices: ``tests/test_fsdp.py``.)"""
  require_cuda_plugin()
  from jax.sharding import PartitionSpec as P
  report = jmp_lab.diagnostics.compiled_report(
      _fsdp_weight_step(fmt),
      jax.ShapeDtypeStruct((4096, width), jnp.bfloat16),
      jax.ShapeDtypeStruct((width, 64), jnp.bfloat16),
      target="b200", devices=8, axes={"fsdp": 8},
      in_specs=(P("fsdp"), P("fsdp", None)))
  assert len(report.block_scaled_gemms) == 3 and len(report.gemms) == 3
  gathers = [c for c in report.collectives if c.kind == "all-gather"]
  assert not [c for c in gathers if "bf16" in c.dtypes], gathers


def test_without_pallas_triton_mxfp8_quantizes_by_xlas_passes(monkeypatch):
  """Once jax removes Pallas' Triton backend (deprecated in 0.11), MXFP8's
  activations and output gradients are quantized by XLA: the step still
  compiles for a B200, every GEMM block-scaled."""
  require_cuda_plugin()
  from jmp_lab.kernels import platform
  real = platform.importable
  monkeypatch.setattr(platform, "importable", lambda module: False
                      if "triton" in module else real(module))

  def step(x, w):
    return jax.value_and_grad(lambda x, w: bs.dot_general(
        x, w, DIMS, fmt="mxfp8").astype(jnp.float32).sum(),
        argnums=(0, 1))(x, w)
  report = jmp_lab.diagnostics.compiled_report(
      step, jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
      jax.ShapeDtypeStruct((128, 64), jnp.bfloat16), target="b200")
  assert not report.pallas_kernels
  assert len(report.block_scaled_gemms) == 3


@pytest.mark.model_compile
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("front_end", ["linen", "nnx"])
def test_gpt2_small_layers_run_every_dense_gemm_block_scaled_on_a_b200(
    fmt, front_end):
  """One of GPT-2 small's layers at its widths (768, 12 heads, T 1024,
  vocabulary 50,304; every layer is alike): every Dense/Linear GEMM (q, k, v, out, fc, proj per
  layer, and the head; forward, input and weight gradients) is cuDNN's
  block-scaled GEMM; the rest is attention's two matmuls per layer (and
  NVFP4's Hadamard GEMMs)."""
  require_cuda_plugin()
  sys.path.insert(0, str(ROOT))
  from benchmarks import block_scaled_compile as bsc
  from benchmarks import train_step as ts
  size = ts.ModelSize(layers=1)
  report = bsc.gradient_step_report(front_end, f"mixed_{fmt}", size)
  dense_layers = 6 * size.layers + 1
  assert len(report.block_scaled_gemms) == 3 * dense_layers
  assert {g.block_scaled for g in report.block_scaled_gemms} == {fmt}
  others = [g for g in report.gemms if g.block_scaled is None]
  attention = [g for g in others if 16 not in g.lhs.dims[-1:]]
  assert all(g.operands.startswith("bf16") for g in attention)
  assert report.block_scaled_flop_share() >= 0.85


class PlainMLP(nn.Module):
  """An MLP as users write it: a layer pinned to float32, one with bf16
  params."""

  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(64, dtype=jnp.float32)(x))
    x = nn.Dense(64, param_dtype=jnp.bfloat16)(x)
    return nn.Dense(32)(x)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_with_policy_and_autocast_block_scale_the_same_gemms(fmt):
  """One semantics on both routes: the same model's gradient runs the same
  block-scaled GEMMs (shapes and formats) through linen's with_policy and
  through autocast of its plain apply."""
  x = jax.random.normal(jax.random.key(0), (32, 48))
  params = PlainMLP().init(jax.random.key(1), x)
  policed = jmp_lab.linen.with_policy(PlainMLP(), f"mixed_{fmt}")
  routes = {
      "with_policy": jax.grad(lambda p: policed.apply(p, x).sum()),
      "autocast": jax.grad(jmp_lab.autocast(
          lambda p: PlainMLP().apply(p, x).sum(), f"mixed_{fmt}")),
  }
  gemms = {name: sorted((r.kind, r.lhs_shape, r.rhs_shape)
                        for r in audit_step(step, params).matmuls
                        if r.kind != "hadamard")
           for name, step in routes.items()}
  assert gemms["with_policy"] == gemms["autocast"]
  assert {kind for kind, _, _ in gemms["autocast"]} == {fmt}
  assert len(gemms["autocast"]) == 9   # 3 layers x 3 GEMMs


# --- weight matmuls a module writes itself -------------------------------------


class GPT2MLP(nn.Module):
  """``FlaxGPT2MLP``, with Hugging Face's ``FlaxConv1D`` (which multiplies
  by its own transposed kernel) or with ``nn.Dense`` layers."""
  layer: type = HFConv1D

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(self.layer(128, name="c_fc")(x), approximate=True)
    return self.layer(64, name="c_proj")(h)


def _as_dense(params):
  """Conv1D's params as ``nn.Dense``'s: each kernel transposed."""
  return jax.tree_util.tree_map_with_path(
      lambda path, p: p.T if path[-1].key == "kernel" else p, params)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_a_modules_own_weight_matmul_is_block_scaled_as_a_dense_is(fmt):
  """Hugging Face's GPT-2 multiplies by its params itself. Under the
  block-scaled keys those GEMMs ran in bf16, silently: only Dense,
  DenseGeneral and Einsum layers were block-scaled."""
  x = jax.random.normal(jax.random.key(0), (64, 64))
  own = jmp_lab.linen.with_policy(GPT2MLP(), f"mixed_{fmt}")
  dense = jmp_lab.linen.with_policy(GPT2MLP(nn.Dense), f"mixed_{fmt}")
  params = own.init(jax.random.key(1), x)

  def loss(model, params):
    return jnp.square(model.apply(params, x).astype(jnp.float32)).sum()

  report = audit_step(functools.partial(jax.grad(loss, argnums=1), own),
                      params)
  assert _kinds(report) == [fmt] * 6   # 2 layers x 3 GEMMs
  own_loss, own_grads = jax.jit(jax.value_and_grad(
      functools.partial(loss, own)))(params)
  dense_loss, dense_grads = jax.jit(jax.value_and_grad(
      functools.partial(loss, dense)))(_as_dense(params))
  # The same quantized products as Dense's, bit for bit.
  chex.assert_trees_all_equal(own_loss, dense_loss)
  chex.assert_trees_all_equal(_as_dense(own_grads), dense_grads)

  # A path override keeps the module out, as it does a Dense.
  kept = jmp_lab.linen.with_policy(
      GPT2MLP(), f"mixed_{fmt}",
      path_overrides={"c_proj": "mixed_bfloat16,o=bf16"})
  report = audit_step(functools.partial(jax.grad(loss, argnums=1), kept),
                      params)
  assert _kinds(report) == ["dot_general"] * 3 + [fmt] * 3


class Router(nn.Module):
  """A mixture of experts' router, as MaxText writes its gate: the
  logits of a param of its own."""

  @nn.compact
  def __call__(self, x):
    gate = self.param("gate", nn.initializers.normal(0.02), (x.shape[-1], 32))
    return jnp.einsum("bd,de->be", x, gate)


class LoRA(nn.Module):
  """A low-rank adapter's two factors, ``x @ a @ b``."""

  @nn.compact
  def __call__(self, x):
    a = self.param("a", nn.initializers.normal(0.02), (x.shape[-1], 32))
    b = self.param("b", nn.initializers.zeros, (32, x.shape[-1]))
    return x @ a @ b


class LearnedQuery(nn.Module):
  """Attention pooling with a learned query (the weight on the left of
  the scores' matmul) over computed keys."""

  @nn.compact
  def __call__(self, x):
    query = self.param("query", nn.initializers.normal(0.02),
                       (32, x.shape[-1]))
    return jnp.einsum("qd,bd->bq", query, x)


class ParamMatmuls(nn.Module):

  @nn.compact
  def __call__(self, x):
    return jnp.concatenate([Router(name="router")(x), LoRA(name="lora")(x),
                            LearnedQuery(name="pool")(x)], axis=-1)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("path", ["router", "lora", "pool"])
def test_every_matmul_of_a_param_is_block_scaled_and_an_override_keeps_it_out(
    fmt, path):
  """The guide's three cases of a weight matmul a module writes itself, one
  by one: a router's logits, LoRA's two factors, a learned query (the
  weight on the left). Each runs its three GEMMs block-scaled, and a path
  override on its module keeps exactly its GEMMs in bf16."""
  gemms = {"router": 3, "lora": 6, "pool": 3}
  x = jax.random.normal(jax.random.key(0), (64, 64))

  def loss(model, params, x):
    return jnp.square(model.apply(params, x).astype(jnp.float32)).sum()

  def step(model):
    # The input's gradient too, as inside a model: every GEMM runs.
    return functools.partial(jax.grad(loss, argnums=(1, 2)), model)

  model = jmp_lab.linen.with_policy(ParamMatmuls(), f"mixed_{fmt}")
  params = model.init(jax.random.key(1), x)
  report = audit_step(step(model), params, x)
  assert _kinds(report) == [fmt] * sum(gemms.values())
  kept = jmp_lab.linen.with_policy(
      ParamMatmuls(), f"mixed_{fmt}",
      path_overrides={path: "mixed_bfloat16,o=bf16"})
  report = audit_step(step(kept), params, x)
  assert _kinds(report) == (["dot_general"] * gemms[path]
                            + [fmt] * (sum(gemms.values()) - gemms[path]))


def _through_each_matrix(x, w, how):
  """``x`` through ``tanh(x @ w[i])`` for each matrix of ``w``, taken as
  ``how`` says: indexed, ``jnp.take``, in a ``fori_loop``, or as a
  ``lax.scan``'s ``xs``."""
  if how == "scan":
    return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]
  if how == "fori":
    return jax.lax.fori_loop(0, w.shape[0], lambda i, h: jnp.tanh(h @ w[i]),
                             x)
  for i in range(w.shape[0]):
    wi = w[i] if how == "index" else jnp.take(w, i, axis=0)
    x = jnp.tanh(x @ wi)
  return x


class StackedWeights(nn.Module):
  """Three matrices of one stacked param, taken as public code takes an
  expert's or a layer's: indexed, ``jnp.take``, in a ``fori_loop``, or as a
  ``lax.scan``'s ``xs``; or three Dense layers holding them (``how=
  "dense"``, params ``Dense_0..2``)."""
  how: str

  @nn.compact
  def __call__(self, x):
    if self.how == "dense":
      for _ in range(3):
        x = jnp.tanh(nn.Dense(64, use_bias=False)(x))
      return x
    w = self.param("w", nn.initializers.normal(0.1), (3, 64, 64))
    return _through_each_matrix(x, w, self.how)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("how", ["index", "take", "fori", "scan"])
def test_a_matrix_taken_from_stacked_weights_is_a_weight(fmt, how):
  """An expert's matrix ``w[e]`` of stacked weights, or a layer's scanned
  over, ran in bf16 under the block-scaled keys: only a param read whole,
  or laid out again, was taken for a weight. Each is now block-scaled, with
  the numbers of Dense layers holding the same matrices."""
  x = jax.random.normal(jax.random.key(0), (64, 64))

  def loss(model, params, x):
    return jnp.square(model.apply(params, x).astype(jnp.float32)).sum()

  stacked = jmp_lab.linen.with_policy(StackedWeights(how), f"mixed_{fmt}")
  dense = jmp_lab.linen.with_policy(StackedWeights("dense"), f"mixed_{fmt}")
  params = stacked.init(jax.random.key(1), x)
  as_dense = {"params": {f"Dense_{i}": {"kernel": params["params"]["w"][i]}
                         for i in range(3)}}
  report = audit_step(jax.grad(functools.partial(loss, stacked),
                               argnums=(0, 1)), params, x)
  assert set(_kinds(report)) == {fmt}
  # Un-jitted: jit lets XLA keep a fused bf16 tanh in fp32 across its
  # fusions, which differ between a loop and straight-line code.
  stacked_loss, (stacked_grads, _) = jax.value_and_grad(
      functools.partial(loss, stacked), argnums=(0, 1))(params, x)
  dense_loss, (dense_grads, _) = jax.value_and_grad(
      functools.partial(loss, dense), argnums=(0, 1))(as_dense, x)
  chex.assert_trees_all_equal(stacked_loss, dense_loss)
  chex.assert_trees_all_equal(
      stacked_grads["params"]["w"],
      jnp.stack([dense_grads["params"][f"Dense_{i}"]["kernel"]
                 for i in range(3)]))


class NnxStackedWeights(nnx.Module):
  """:class:`StackedWeights` as NNX code writes it: one ``nnx.Param`` of
  three matrices, or three ``nnx.Linear`` layers holding them."""

  def __init__(self, how: str, rngs: nnx.Rngs):
    self.how = how
    if how == "dense":
      self.layers = nnx.List([nnx.Linear(64, 64, use_bias=False, rngs=rngs)
                              for _ in range(3)])
    else:
      self.w = nnx.Param(nnx.initializers.normal(0.1)(rngs.params(),
                                                      (3, 64, 64)))

  def __call__(self, x):
    if self.how == "dense":
      for layer in self.layers:
        x = jnp.tanh(layer(x))
      return x
    w = self.w[...]
    return _through_each_matrix(x, w, self.how)


@pytest.mark.parametrize("how", ["index", "take", "fori", "scan"])
def test_a_matrix_taken_from_stacked_weights_is_a_weight_on_nnx(how):
  """The same on NNX: each matrix of an ``nnx.Param`` of stacked weights
  is block-scaled, with the numbers of ``nnx.Linear`` layers holding the
  same matrices."""
  x = jax.random.normal(jax.random.key(0), (64, 64))
  stacked = jmp_lab.nnx.with_policy(NnxStackedWeights(how, nnx.Rngs(1)),
                                    "mixed_mxfp8")
  dense = NnxStackedWeights("dense", nnx.Rngs(2))
  for i, layer in enumerate(dense.layers):
    layer.kernel[...] = stacked.w[...][i]
  dense = jmp_lab.nnx.with_policy(dense, "mixed_mxfp8")

  def loss(model, x):
    return jnp.square(model(x).astype(jnp.float32)).sum()

  graph, state = nnx.split(stacked)
  report = audit_step(jax.grad(
      lambda s, x: loss(nnx.merge(graph, s), x), argnums=(0, 1)), state, x)
  assert set(_kinds(report)) == {"mxfp8"}
  # Un-jitted, as on linen.
  stacked_loss, stacked_grads = nnx.value_and_grad(loss)(stacked, x)
  dense_loss, dense_grads = nnx.value_and_grad(loss)(dense, x)
  chex.assert_trees_all_equal(stacked_loss, dense_loss)
  chex.assert_trees_all_equal(
      stacked_grads["w"][...],
      jnp.stack([dense_grads["layers"][i]["kernel"][...] for i in range(3)]))


class PerTokenExperts(nn.Module):
  """Each token's expert matrix gathered from stacked weights."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.1), (4, 64, 64))
    expert = jnp.argmax(x[:, :4], axis=-1)
    return jnp.einsum("td,tdh->th", x, w[expert])


def test_a_matrix_per_token_is_a_weight_on_every_route():
  """One semantics: autocast took ``w[expert_of_each_token]`` for a weight
  (a stored value), linen did not."""
  x = jax.random.normal(jax.random.key(0), (64, 64))
  params = PerTokenExperts().init(jax.random.key(1), x)

  def loss(apply, params, x):
    return jnp.square(apply(params, x).astype(jnp.float32)).sum()

  routes = {
      "with_policy": jmp_lab.linen.with_policy(PerTokenExperts(),
                                               "mixed_mxfp8").apply,
      "autocast": jmp_lab.autocast(PerTokenExperts().apply, "mixed_mxfp8"),
  }
  gemms = {name: sorted((r.kind, r.lhs_shape, r.rhs_shape) for r in
                        audit_step(jax.grad(functools.partial(loss, apply),
                                            argnums=(0, 1)),
                                   params, x).matmuls)
           for name, apply in routes.items()}
  assert gemms["with_policy"] == gemms["autocast"]
  assert {kind for kind, _, _ in gemms["autocast"]} == {"mxfp8"}


class PassedOnKernel(nn.Module):
  """A kernel read through what MaxText's layers wrap theirs in."""
  how: str

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.lecun_normal(), (64, 128))
    if self.how == "constraint":
      w = jax.lax.with_sharding_constraint(
          w, jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(),
                                        P(None, "data")))
    elif self.how == "logical":
      w = nn.with_logical_constraint(w, ("embed", "mlp"))
    elif self.how == "checkpoint_name":
      w = checkpoint_name(w, "kernel")
    elif self.how == "optimization_barrier":
      w = jax.lax.optimization_barrier(w)
    return x @ w


@pytest.mark.parametrize("how", ["constraint", "logical", "checkpoint_name",
                                 "optimization_barrier"])
def test_a_kernel_read_through_a_constraint_or_a_name_is_a_weight(how):
  """A kernel passed through a sharding constraint, ``checkpoint_name`` or
  an optimization barrier ran in bf16 under linen, silently (autocast
  block-scaled it)."""
  mesh = jax.make_mesh((1,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  x = jnp.ones((32, 64))
  model = jmp_lab.linen.with_policy(PassedOnKernel(how), "mixed_mxfp8")
  with jax.set_mesh(mesh), nn.logical_axis_rules([("embed", None),
                                                  ("mlp", "data")]):
    params = model.init(jax.random.key(0), x)
    report = audit_step(jax.grad(
        lambda p, x: model.apply(p, x).astype(jnp.float32).sum(),
        argnums=(0, 1)), params, x)
  assert _kinds(report) == ["mxfp8"] * 3


class NnxPassedOnKernel(nnx.Module):
  """:class:`PassedOnKernel` on NNX."""

  def __init__(self, how: str, rngs: nnx.Rngs):
    self.how = how
    self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(),
                                                       (64, 128)))

  def __call__(self, x):
    w = self.w[...]
    if self.how == "constraint":
      w = jax.lax.with_sharding_constraint(
          w, jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(),
                                        P(None, "data")))
    elif self.how == "checkpoint_name":
      w = checkpoint_name(w, "kernel")
    elif self.how == "optimization_barrier":
      w = jax.lax.optimization_barrier(w)
    return x @ w


@pytest.mark.parametrize("how", ["constraint", "checkpoint_name",
                                 "optimization_barrier"])
def test_a_kernel_read_through_a_constraint_or_a_name_is_a_weight_on_nnx(how):
  """The same on NNX."""
  mesh = jax.make_mesh((1,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  x = jnp.ones((32, 64))
  model = jmp_lab.nnx.with_policy(NnxPassedOnKernel(how, nnx.Rngs(0)),
                                  "mixed_mxfp8")
  graph, state = nnx.split(model)
  with jax.set_mesh(mesh):
    report = audit_step(jax.grad(
        lambda s, x: nnx.merge(graph, s)(x).astype(jnp.float32).sum(),
        argnums=(0, 1)), state, x)
  assert _kinds(report) == ["mxfp8"] * 3


class MlpBlock(nn.Module):
  """A pre-LN MLP block with its residual."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(128, name="up")(nn.LayerNorm()(x))
    return x + nn.Dense(64, name="down")(nn.gelu(h))


class RematBlocks(nn.Module):
  """Two blocks under ``nn.remat`` with a policy, as Flax's examples and
  MaxText write them."""
  policy: Any

  @nn.compact
  def __call__(self, x):
    block = nn.remat(MlpBlock, policy=self.policy)
    for i in range(2):
      x = block(name=f"block_{i}")(x)
    return x


class NnxMlpBlock(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(64, rngs=rngs)
    self.up = nnx.Linear(64, 128, rngs=rngs)
    self.down = nnx.Linear(128, 64, rngs=rngs)

  def __call__(self, x):
    return x + self.down(nnx.gelu(self.up(self.norm(x))))


class NnxRematBlocks(nnx.Module):
  """:class:`RematBlocks` on NNX: each block's call under ``nnx.remat``."""

  def __init__(self, policy, rngs: nnx.Rngs):
    self.policy = policy
    self.blocks = nnx.List([NnxMlpBlock(rngs) for _ in range(2)])

  def __call__(self, x):
    for block in self.blocks:
      x = nnx.remat(lambda b, x: b(x), policy=self.policy)(block, x)
    return x


REMAT_POLICIES = {
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "dots_without_batch_dims":
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "names_but_these": jax.checkpoint_policies.save_any_names_but_these(
        "unused"),
}


def _remat_step_gemms(front_end: str, policy_name: str, policy: str,
                      vmapped: bool = False):
  """The kinds of the GEMMs one gradient step of the remat blocks runs;
  ``vmapped``: the model ``jax.vmap``-ed over a batch of inputs, as code
  that writes a model for one example does."""
  x = jax.random.normal(jax.random.key(0), (64, 64))
  remat_policy = REMAT_POLICIES[policy_name]
  if front_end == "linen":
    model = jmp_lab.linen.with_policy(RematBlocks(remat_policy), policy)
    params = model.init(jax.random.key(1), x)
    apply = lambda p, x: model.apply(p, x)  # noqa: E731
  else:
    model = jmp_lab.nnx.with_policy(
        NnxRematBlocks(remat_policy, nnx.Rngs(1)), policy)
    graph, params = nnx.split(model)
    apply = lambda s, x: nnx.merge(graph, s)(x)  # noqa: E731
  if vmapped:
    apply = jax.vmap(apply, in_axes=(None, 0))
    x = jnp.stack([x, -x])
  loss = lambda p, x: apply(p, x).astype(jnp.float32).sum()  # noqa: E731
  report = audit_step(jax.grad(loss, argnums=(0, 1)), params, x)
  return _kinds(report)


@pytest.mark.parametrize("front_end", ["linen", "nnx"])
@pytest.mark.parametrize("remat_policy", sorted(REMAT_POLICIES))
def test_a_remat_policy_saves_block_scaled_products_as_it_saves_dots(
    front_end, remat_policy):
  """A remat policy picks what to save by primitive, and a block-scaled
  product is no ``dot_general``: under ``dots_with_no_batch_dims_saveable``
  (MaxText's "minimal", Flax's examples) the backward ran the forward
  GEMMs again, as under full remat (a step compiled for a B200 ran 26
  GEMMs against bf16's 23). Now each policy runs as many GEMMs under
  MXFP8 as under bf16."""
  bf16 = _remat_step_gemms(front_end, remat_policy, "mixed_bfloat16")
  mxfp8 = _remat_step_gemms(front_end, remat_policy, "mixed_mxfp8")
  assert set(bf16) == {"dot_general"}
  assert mxfp8 == ["mxfp8"] * len(bf16)


@pytest.mark.parametrize("front_end", ["linen", "nnx"])
@pytest.mark.parametrize("remat_policy",
                         ["nothing", "dots_without_batch_dims"])
def test_a_remat_policy_sees_block_scaled_products_under_vmap(
    front_end, remat_policy):
  """Under ``vmap`` a product's named output gains the mapped axis, and
  the policy's view of it took it for (B, M, N): any remat with a policy
  in a policed model vmapped over its inputs raised a ValueError (too many
  values to unpack) inside the policy. The mapped axis is rows, as it is
  of bf16's dot with a shared weight: the same GEMMs as bf16."""
  bf16 = _remat_step_gemms(front_end, remat_policy, "mixed_bfloat16",
                           vmapped=True)
  mxfp8 = _remat_step_gemms(front_end, remat_policy, "mixed_mxfp8",
                            vmapped=True)
  assert set(bf16) == {"dot_general"}
  assert mxfp8 == ["mxfp8"] * len(bf16)


def test_checkpoint_policy_wraps_a_policy_once():
  """The same policy gives the same wrapper, so that two traces of one
  ``jax.checkpoint`` carry equal params (a new closure each time made
  each trace's remat differ)."""
  dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  wrapped = jmp_lab.block_scaled.checkpoint_policy(dots)
  assert jmp_lab.block_scaled.checkpoint_policy(dots) is wrapped
  assert jmp_lab.block_scaled.checkpoint_policy(wrapped) is wrapped
  assert jmp_lab.block_scaled.checkpoint_policy(None) is None


def test_saving_block_scaled_products_leaves_the_gradients_as_they_were():
  """The saved products are the ones the backward would have computed
  again: the gradients equal those without remat, to the bit."""
  x = jax.random.normal(jax.random.key(0), (64, 64))
  saving = jmp_lab.linen.with_policy(
      RematBlocks(REMAT_POLICIES["dots_without_batch_dims"]), "mixed_mxfp8")
  plain = jmp_lab.linen.with_policy(RematBlocks(None), "mixed_mxfp8")
  params = saving.init(jax.random.key(1), x)

  def grads(model):
    return jax.grad(lambda p: jnp.square(
        model.apply(p, x).astype(jnp.float32)).sum())(params)

  chex.assert_trees_all_equal(grads(saving), grads(plain))


class RowsOfATable(nn.Module):
  """Rows of a table of the module's own looked up by token ids, then
  multiplied by a computed value: two activations."""

  @nn.compact
  def __call__(self, ids, h):
    table = self.param("table", nn.initializers.normal(1.0), (128, 64))
    return jnp.einsum("btd,bsd->bts", table[ids], h)


def test_rows_looked_up_from_a_param_are_no_weight():
  """A review found that taking every gather of a weight for a weight
  block-scaled this product of two activations, the token rows tiled as a
  weight. Only whole matrices of stacked weights are parts of a weight."""
  ids = jnp.arange(64).reshape(2, 32) % 128
  h = jax.random.normal(jax.random.key(0), (2, 32, 64))
  model = jmp_lab.linen.with_policy(RowsOfATable(), "mixed_mxfp8")
  params = model.init(jax.random.key(1), ids, h)
  report = audit_step(jax.grad(
      lambda p, h: model.apply(p, ids, h).astype(jnp.float32).sum(),
      argnums=(0, 1)), params, h)
  assert _kinds(report) == ["dot_general"] * 3


def _fp32_accumulating_dot(lhs, rhs, dims, precision=None,
                           preferred_element_type=None, **_):
  return jax.lax.dot_general(lhs, rhs, dims, precision="highest",
                             preferred_element_type=jnp.float32)


class OwnDotGeneral(nn.Module):
  """A Dense given a matmul of its own, and a tie written by hand."""

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(256, 64)
    x = nn.Dense(64, dot_general=_fp32_accumulating_dot)(embed(ids))
    return x @ embed.embedding.T


class NnxTiedByHand(nnx.Module):

  def __init__(self, rngs):
    self.embed = nnx.Embed(256, 64, rngs=rngs)
    self.dense = nnx.Linear(64, 64, dot_general=_fp32_accumulating_dot,
                            rngs=rngs)

  def __call__(self, ids):
    return self.dense(self.embed(ids)) @ self.embed.embedding[...].T


def test_a_layers_own_matmul_and_a_tie_by_hand_stay_as_they_are():
  """A layer given its own ``dot_general=`` keeps it, as the docs say, and
  a tied head written as ``x @ embed.embedding.T`` stays in bf16, as
  ``Embed.attend`` does: an embedding's table is no weight matmul's."""
  ids = jnp.zeros((4, 32), jnp.int32)
  model = jmp_lab.linen.with_policy(OwnDotGeneral(), "mixed_mxfp8")
  params = model.init(jax.random.key(0), ids)
  report = audit_step(jax.grad(lambda p: jnp.square(model.apply(
      p, ids).astype(jnp.float32)).sum()), params)
  assert {r.kind for r in report.matmuls} == {"dot_general"}, report.table()

  nnx_model = jmp_lab.nnx.with_policy(NnxTiedByHand(nnx.Rngs(0)),
                                      "mixed_mxfp8")
  graph, state = nnx.split(nnx_model)
  report = audit_step(jax.grad(lambda s: jnp.square(nnx.merge(graph, s)(
      ids).astype(jnp.float32)).sum()), state)
  assert {r.kind for r in report.matmuls} == {"dot_general"}, report.table()


def test_a_modules_own_weight_matmul_under_fp8():
  """Current-scaled fp8 (stateless) reaches it as it reaches a Dense, to
  the bit; delayed fp8 keeps its state in a layer, so it cannot, and says
  so once per module (before, both ran in bf16 without a word)."""
  x = jax.random.normal(jax.random.key(0), (64, 64))

  def loss(model, params):
    return jnp.square(model.apply(params, x).astype(jnp.float32)).sum()

  policy = "mixed_bfloat16,matmul=fp8_current"
  own = jmp_lab.linen.with_policy(GPT2MLP(), policy)
  dense = jmp_lab.linen.with_policy(GPT2MLP(nn.Dense), policy)
  params = own.init(jax.random.key(1), x)
  report = audit_step(functools.partial(jax.grad(loss, argnums=1), own),
                      params)
  assert report.fp8_flop_share == 1.0
  own_loss, own_grads = jax.value_and_grad(functools.partial(loss, own))(
      params)
  dense_loss, dense_grads = jax.value_and_grad(functools.partial(
      loss, dense))(_as_dense(params))
  chex.assert_trees_all_equal(own_loss, dense_loss)
  chex.assert_trees_all_equal(_as_dense(own_grads), dense_grads)

  delayed = jmp_lab.linen.with_policy(GPT2MLP(), "mixed_fp8")
  with pytest.warns(UserWarning, match="matmul=fp8 does not reach the "
                    "weight matmul '.*c_fc' writes itself") as caught:
    params = delayed.init(jax.random.key(1), x)
    loss(delayed, params)
  assert len([w for w in caught if "does not reach" in str(w.message)]) == 2
  report = audit_step(functools.partial(jax.grad(loss, argnums=1), delayed),
                      params)
  assert report.fp8_flop_share == 0.0 and report.half_flop_share == 1.0


class NnxConv1D(nnx.Module):
  """A layer that multiplies by its own ``nnx.Param``, as public NNX code
  writes one: ``x @ self.kernel.T``."""

  def __init__(self, inputs, features, rngs):
    self.kernel = nnx.Param(nnx.initializers.normal(0.02)(
        rngs.params(), (features, inputs)))

  def __call__(self, x):
    return x @ self.kernel[...].T


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_an_nnx_modules_own_weight_matmul_is_block_scaled_as_linear_is(fmt):
  x = jax.random.normal(jax.random.key(0), (64, 64))
  own = jmp_lab.nnx.with_policy(NnxConv1D(64, 96, nnx.Rngs(0)), f"mixed_{fmt}")
  linear = nnx.Linear(64, 96, use_bias=False, rngs=nnx.Rngs(0))
  linear.kernel[...] = own.kernel[...].T
  linear = jmp_lab.nnx.with_policy(linear, f"mixed_{fmt}")

  def loss(model):
    return jnp.square(model(x).astype(jnp.float32)).sum()

  graph, state = nnx.split(own)
  report = audit_step(jax.grad(lambda s: loss(nnx.merge(graph, s))), state)
  assert _kinds(report) == [fmt] * 3
  own_loss, own_grads = nnx.jit(nnx.value_and_grad(loss))(own)
  linear_loss, linear_grads = nnx.jit(nnx.value_and_grad(loss))(linear)
  chex.assert_trees_all_equal(own_loss, linear_loss)
  chex.assert_trees_all_equal(own_grads["kernel"][...].T,
                              linear_grads["kernel"][...])


class CallsTheProductItself(nn.Module):
  """A layer that calls ``jmp_lab.block_scaled.dot_general`` on its param."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.02), (x.shape[-1], 64))
    return bs.dot_general(x, w, DIMS, fmt="nvfp4")


def test_a_block_scaled_product_the_code_calls_is_not_quantized_twice():
  """The Hadamard transform inside a product the code calls itself is
  jmp_lab's own small GEMM, not a weight matmul to block-scale again.
  Under autocast it was: the transform of an input handed in as it is
  multiplied a stored value, and ran as a fourth NVFP4 GEMM."""
  x = jax.random.normal(jax.random.key(0), (64, 64))
  model = jmp_lab.linen.with_policy(CallsTheProductItself(), "mixed_nvfp4")
  params = model.init(jax.random.key(1), x)
  report = audit_step(jax.grad(lambda p: model.apply(p, x).sum()), params)
  assert _kinds(report) == ["nvfp4"] * 3
  assert len([r for r in report.matmuls if r.kind == "hadamard"]) == 2

  def loss(w, x):
    return bs.dot_general(x, w, DIMS, fmt="nvfp4").astype(jnp.float32).sum()

  report = audit_step(jax.grad(jmp_lab.autocast(loss, "mixed_nvfp4")),
                      params["params"]["w"], x)
  assert [r.kind for r in report.matmuls].count("nvfp4") == 3


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_a_modules_own_weight_matmul_compiles_block_scaled_for_a_b200(fmt):
  require_cuda_plugin()
  from jmp_lab.diagnostics import compiled_report
  x = jax.ShapeDtypeStruct((256, 64), jnp.float32)
  model = jmp_lab.linen.with_policy(GPT2MLP(), f"mixed_{fmt}")
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  report = compiled_report(
      jax.grad(lambda p, x: jnp.square(model.apply(p, x)).sum(),
               argnums=(0, 1)), params, x, target="b200")
  assert len(report.block_scaled_gemms) == 6
  assert not [g for g in report.gemms if g.block_scaled is None]
