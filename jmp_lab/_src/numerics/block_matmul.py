"""Block-scaled matmuls (MXFP8, NVFP4): forward and both gradient GEMMs
block-scaled, each operand quantized along its own contraction axis.

The face with the docs is :mod:`jmp_lab.block_scaled`; the quantization is
:mod:`.block_quantize`. Every product is brought to jax's ``scaled_matmul``
layout, ``(B, M, K) x (B, N, K) -> (B, M, N)``:

* forward ``y = x w``: ``x`` and ``w`` quantized along ``K``;
* input gradient ``dx = g w^T``: ``g`` along ``N``, ``w`` along ``N``;
* weight gradient ``dw = g^T x``: ``g`` and ``x`` along ``M`` (the tokens),
  under NVFP4 after the random Hadamard transform along ``M``.

Residuals (what the backward reads, kept from the forward): the weight as
the input-gradient GEMM reads it and the input as the weight-gradient GEMM
reads it, both already quantized; no full-precision operand is kept (jax's
``scaled_dot_general`` keeps both). Under NVFP4 the weight's 16x16 tiles
make one quantization serve both of its GEMMs.

On a CUDA device the GEMMs are ``jax.nn.scaled_matmul`` (XLA lowers it to
cuDNN's ``__cudnn$blockScaledDot`` on Blackwell, to dequantize plus a 16-bit
GEMM on older GPUs); elsewhere (the CPU, and jax 0.10.2, which has no CPU
lowering for it) the same quantized operands are dequantized (exactly, in
fp32) and multiplied in fp32, so a CPU trains with the numbers a GPU would,
up to the order of fp32 accumulation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from typing import Any, Callable, Iterator, Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lab._src.matmuls import BLOCK_QUANTIZE_SCOPE, contracts_nothing
from jmp_lab._src.numerics import block_quantize as bq
from jmp_lab._src.numerics import product_remat, product_types
from jmp_lab._src.numerics.consumer_layout import laid_out_for_consumer
from jmp_lab.kernels import mx_cast_transpose as mx
from jmp_lab.kernels import nvfp4_cast_transpose as nv
from jmp_lab.kernels import rounding
from jmp_lab.kernels.mesh import explicitly_sharded


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How a format trains: the format and the NVFP4 recipe's three pieces.

  Attributes:
    fmt: the block format.
    weight_tiles: 16x16 weight blocks (NVFP4's 2D scaling).
    stochastic_gradients: output gradients rounded stochastically.
    hadamard: the random Hadamard transform on the weight-gradient GEMM's
      operands.
    four_over_six: NVFP4 blocks scaled to 4 or 6, whichever is nearer
      (:mod:`.block_quantize`; off in the paper's recipe).
  """

  fmt: bq.BlockFormat
  weight_tiles: bool = False
  stochastic_gradients: bool = False
  hadamard: bool = False
  four_over_six: bool = False


RECIPES = {
    # 32x32 weight tiles: the weight's forward and input-gradient GEMMs read
    # one quantization (as NVFP4's 16x16 tiles; under FSDP one gather per
    # use), and on the char transformer it trained nearer bf16 than 1x32
    # blocks per GEMM (benchmarks/RESULTS.md). mxfp8_recipe switches back.
    "mxfp8": Recipe(bq.MXFP8, weight_tiles=True),
    "nvfp4": Recipe(bq.NVFP4, weight_tiles=True, stochastic_gradients=True,
                    hadamard=True),
}
# The overrides in force, ((name, recipe), ...): a jax user context, which
# jax.jit keys its caches on (a step traced under one recipe is traced again
# under another, not reused), and thread-local as jax's contexts are.
_OVERRIDES = jax.make_user_context(default_value=())


@contextlib.contextmanager
def mxfp8_recipe(*, weight_tiles: bool = True) -> Iterator[Recipe]:
  """MXFP8 matmuls called inside the block run with 32x32 weight tiles (the
  default: one quantization of the weight serves its forward and
  input-gradient GEMMs, so FSDP gathers it once per use) or, with
  ``weight_tiles=False``, with the weight quantized again in 1x32 blocks
  along each GEMM's contraction (Transformer Engine's MXFP8 recipe). Part of
  ``jax.jit``'s cache key, as :func:`nvfp4_recipe`.

  >>> with mxfp8_recipe(weight_tiles=False) as recipe:
  ...   recipe.weight_tiles
  False
  """
  if not isinstance(weight_tiles, bool):
    raise TypeError(f"weight_tiles must be a bool, got {weight_tiles!r}")
  with _overridden("mxfp8", Recipe(bq.MXFP8, weight_tiles)) as recipe:
    yield recipe


@contextlib.contextmanager
def _overridden(name: str, recipe: Recipe) -> Iterator[Recipe]:
  overrides = {**dict(_OVERRIDES.value), name: recipe}
  with _OVERRIDES(tuple(sorted(overrides.items()))):
    yield recipe


@contextlib.contextmanager
def nvfp4_recipe(*, weight_tiles: bool = True,
                 stochastic_rounding: bool = True,
                 hadamard: bool = True,
                 four_over_six: bool = False) -> Iterator[Recipe]:
  """NVFP4 matmuls called inside the block run with pieces of the recipe
  switched off (the ablation of ``benchmarks/block_scaled_accuracy.py``),
  or with Four Over Six switched on (arXiv 2512.02010: each block scaled
  to 4 or to 6, whichever dequantizes nearer; every NVFP4 operand).

  The recipe is part of ``jax.jit``'s cache key (a jax user context): a
  jitted step called inside the block is traced again with it.

  >>> with nvfp4_recipe(hadamard=False) as recipe:
  ...   recipe.hadamard, recipe.stochastic_gradients, recipe.four_over_six
  (False, True, False)
  """
  for name, value in (("weight_tiles", weight_tiles),
                      ("stochastic_rounding", stochastic_rounding),
                      ("hadamard", hadamard),
                      ("four_over_six", four_over_six)):
    if not isinstance(value, bool):
      raise TypeError(f"{name} must be a bool, got {value!r}")
  with _overridden("nvfp4", Recipe(bq.NVFP4, weight_tiles,
                                   stochastic_rounding, hadamard,
                                   four_over_six)) as recipe:
    yield recipe


def recipe_for(name: str) -> Recipe:
  """The recipe a format name trains with now."""
  if name not in RECIPES:
    raise ValueError(f"block-scaled format {name!r} is not supported; "
                     f"accepted: {', '.join(RECIPES)}")
  return dict(_OVERRIDES.value).get(name, RECIPES[name])


# ---- one GEMM ---------------------------------------------------------------

_WARNED: set = set()


def _warn_without_block_scaled_cores() -> None:
  """Once per process: a GPU older than Blackwell runs the GEMMs as
  dequantize plus a 16-bit GEMM (XLA's fallback)."""
  for device in jax.local_devices():
    capability = getattr(device, "compute_capability", None)
    if (device.platform == "gpu" and capability is not None
        and float(capability) < 10.0 and "old-gpu" not in _WARNED):
      _WARNED.add("old-gpu")
      warnings.warn(
          f"block-scaled matmuls (mxfp8/nvfp4) on {device.device_kind} "
          f"(compute capability {capability}) run as dequantize plus 16-bit "
          f"GEMMs: only Blackwell (10.x) has block-scaled tensor cores. The "
          f"numbers are Blackwell's; the speed is not.", stacklevel=4)


def _emulated(a: bq.Quantized, b: bq.Quantized, dtype) -> jax.Array:
  # The exact products of the dequantized operands, summed in fp32, the sum
  # rounded to ``dtype`` as the GEMM's epilogue rounds it.
  unit = jnp.float32(1)
  return jnp.einsum(
      "bmk,bnk->bmn", bq.dequantize(a._replace(global_scale=unit)),
      bq.dequantize(b._replace(global_scale=unit)),
      precision=jax.lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32).astype(dtype)


def _native(a: bq.Quantized, b: bq.Quantized, dtype) -> jax.Array:
  out = _native_product(np.dtype(dtype))(a.values, b.values, a.scales,
                                         b.scales)
  # Inside shard_map the emulated branch's product varies over the manual
  # axes its operands do, and lax.platform_dependent asks both to agree;
  # the custom_vmap around scaled_matmul drops them.
  return product_types.varying_as(out, a.values, b.values, a.scales,
                                  b.scales)


def _mapped_into_rows(x: jax.Array) -> jax.Array:
  """(V, B, R, K) as (B, V * R, K): the mapped axis joined to the rows."""
  return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, x.shape[3])


@functools.cache
def _native_product(dtype: np.dtype) -> Callable[..., jax.Array]:
  """``jax.nn.scaled_matmul`` writing ``dtype``, with a batching rule of
  its own: jax's asserts that ``vmap`` batched all four operands along one
  axis, and a model vmapped over its inputs shares its weights (batched
  values and scales of the input, unbatched ones of the weight). Here the
  mapped axis joins the rows of a batched ``a``, the columns of a batched
  ``b``, or the batch of two batched ones: one GEMM, no weight copied."""
  product = jax.custom_batching.custom_vmap(
      lambda a, b, a_scales, b_scales: jax.nn.scaled_matmul(
          a, b, a_scales, b_scales, preferred_element_type=dtype))

  @product.def_vmap
  def _batched(axis_size, in_batched, a, b, a_scales, b_scales):
    def stacked(x, batched):
      return x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))

    a_batched = any(in_batched[0::2])
    b_batched = any(in_batched[1::2])
    if a_batched:  # values and scales batched alike
      a, a_scales = stacked(a, in_batched[0]), stacked(a_scales, in_batched[2])
    if b_batched:
      b, b_scales = stacked(b, in_batched[1]), stacked(b_scales, in_batched[3])
    if a_batched and b_batched:  # (V, B, ...) -> (V * B, ...)
      merged = [x.reshape(-1, *x.shape[2:]) for x in (a, b, a_scales, b_scales)]
      out = product(*merged)
      return out.reshape(axis_size, -1, *out.shape[1:]), True
    if a_batched:  # a's (V, B, M, K) as (B, V * M, K)
      out = product(_mapped_into_rows(a), b, _mapped_into_rows(a_scales),
                    b_scales)
      return jnp.moveaxis(out.reshape(out.shape[0], axis_size, -1,
                                      out.shape[2]), 1, 0), True
    if b_batched:  # b's (V, B, N, K) as (B, V * N, K)
      out = product(a, _mapped_into_rows(b), a_scales,
                    _mapped_into_rows(b_scales))
      return jnp.moveaxis(out.reshape(*out.shape[:2], axis_size, -1),
                          2, 0), True
    return product(a, b, a_scales, b_scales), False

  return product


def scaled_product(a: bq.Quantized, b: bq.Quantized, dtype) -> jax.Array:
  """``a (B, M, K) x b (B, N, K) -> (B, M, N)`` in ``dtype``: cuDNN's
  block-scaled GEMM on CUDA, its exact emulation elsewhere.

  The GEMM writes ``dtype`` itself (a 16-bit result, where an fp32 one and a
  cast would move three times the bytes); NVFP4's global scales then
  multiply that result (in fp32, rounded once more to ``dtype``), the same
  on every platform. Under float16 NVFP4's GEMM writes fp32: before its
  global scales (each ``amax / 2688``) its result can be 2688**2 times the
  true product's, past float16's 65504."""
  _warn_without_block_scaled_cores()
  global_scales = a.values.dtype == bq.NVFP4.value_dtype
  written = (jnp.float32 if global_scales and np.dtype(dtype) == np.float16
             else dtype)
  out = jax.lax.platform_dependent(
      a, b, cuda=functools.partial(_native, dtype=written),
      default=functools.partial(_emulated, dtype=written))
  if global_scales:
    out = (out.astype(jnp.float32) * (a.global_scale * b.global_scale)
           ).astype(dtype)
  return out


# ---- the product and its backward -------------------------------------------


#: The named scope of every quantization (``CompiledReport.scope`` finds its
#: kernels and bytes; the audit names the Hadamard GEMMs in it).
QUANTIZE_SCOPE = BLOCK_QUANTIZE_SCOPE


@jax.named_scope(QUANTIZE_SCOPE)
def _quantized(x: jax.Array, recipe: Recipe, *, tiles: bool = False,
               stochastic_salt: Optional[int] = None,
               axis: int = -1) -> bq.Quantized:
  """``x`` (B, R, C) quantized along ``axis`` (padded to whole blocks,
  and with ``tiles`` along R too)."""
  x = bq.padded_to_block(x, recipe.fmt.block, axis)
  if tiles:
    x = bq.padded_to_block(x, recipe.fmt.block, axis=-2)
  return bq.quantize(x, recipe.fmt, tiles=tiles, axis=axis,
                     stochastic_salt=stochastic_salt,
                     four_over_six=recipe.four_over_six)


def _along_tokens(x: jax.Array, recipe: Recipe, **kwargs) -> bq.Quantized:
  """``x`` (B, M, C) as the weight-gradient GEMM reads it: (B, C, M),
  quantized along M (after the Hadamard transform under NVFP4). Quantized
  where it lies, blocks along M, and then the 8- or 4-bit copy transposed
  (XLA writes it transposed from the quantizing kernel), rather than the
  16-bit input transposed first."""
  if recipe.hadamard:
    with jax.named_scope(QUANTIZE_SCOPE):
      x = bq.hadamard_16(bq.padded_to_block(x, recipe.fmt.block, axis=1),
                         axis=1)
  q = _quantized(x, recipe, axis=1, **kwargs)
  return q._replace(values=jnp.swapaxes(q.values, 1, 2),
                    scales=jnp.swapaxes(q.scales, 1, 2))


def _mxfp8_both_ways(x: jax.Array) -> tuple[jax.Array, ...]:
  """XLA's path of :func:`jmp_lab.kernels.mx_cast_transpose.quantize_both_ways`
  for a 2-D ``x``: the two quantizations, the scales as their bits."""
  along_columns = bq.quantize_mxfp8(x)
  along_rows = bq.quantize_mxfp8(x, axis=0)
  bits = lambda s: jax.lax.bitcast_convert_type(s, jnp.uint8)  # noqa: E731
  return (along_columns.values, bits(along_columns.scales),
          along_rows.values.T, bits(along_rows.scales).T)


def _fused_both_ways(x: jax.Array, recipe: Recipe, salt) -> Optional[str]:
  """Which one-pass kernel quantizes ``x`` both ways, if any: MXFP8
  rounded to nearest, or NVFP4 with the Hadamard transform (Four Over Six
  too); one matrix of whole tiles (padding takes XLA's passes)."""
  if x.shape[0] != 1:
    return None
  if recipe.fmt == bq.MXFP8 and not recipe.hadamard and salt is None:
    return "mxfp8" if mx.fits(x.shape[1:]) else None
  if recipe.fmt == bq.NVFP4 and recipe.hadamard and nv.fits(x.shape[1:]):
    return "nvfp4"
  return None


def _xla_both_ways(x: jax.Array, recipe: Recipe, salt: Optional[int]
                   ) -> tuple[bq.Quantized, bq.Quantized]:
  return (_quantized(x, recipe, stochastic_salt=salt),
          _along_tokens(x, recipe, stochastic_salt=None if salt is None
                        else salt + 1))


def nvfp4_scales_and_keys(amax: jax.Array, amax_t: jax.Array,
                          salt: Optional[int], four_over_six: bool = False
                          ) -> tuple[jax.Array, jax.Array]:
  """The two copies' global scales and noise keys, from the amaxes of
  ``x`` and of its Hadamard transform, as :func:`_xla_both_ways` derives
  them (:func:`~.block_quantize.quantize_nvfp4`: the seed from the amax,
  the streams ``salt`` and ``salt + 1``; Four Over Six's room for the
  larger scale); zero keys without noise."""
  room = ({"scale_max": bq.FOUR_OVER_SIX_SCALE_MAX} if four_over_six
          else {})
  global_scales = jnp.stack([bq.nvfp4_global_scale(None, amax=a, **room)
                             for a in (amax, amax_t)])
  if salt is None:
    return global_scales, jnp.zeros((2,), jnp.uint32)
  return global_scales, jnp.stack([
      rounding.noise_stream_key(bq.content_seed(a), stream)
      for a, stream in ((amax, salt), (amax_t, salt + 1))])


def _nvfp4_both_ways(x: jax.Array, recipe: Recipe, salt: Optional[int]
                     ) -> tuple[bq.Quantized, bq.Quantized]:
  """NVFP4's two quantizations of a 2-D ``x`` by
  :func:`jmp_lab.kernels.nvfp4_cast_transpose.quantize_both_ways`: its
  kernels on a GPU, :func:`_xla_both_ways` elsewhere (the same numbers)."""
  def xla(x):
    q, q_t = _xla_both_ways(x[None], recipe, salt)
    return (q.values[0], q.scales[0], q.global_scale,
            q_t.values[0], q_t.scales[0], q_t.global_scale)

  q, s, g, q_t, s_t, g_t = nv.quantize_both_ways(
      x[0], bq.HADAMARD, stochastic=salt is not None,
      scales_and_keys=functools.partial(
          nvfp4_scales_and_keys, salt=salt,
          four_over_six=recipe.four_over_six),
      xla=xla, four_over_six=recipe.four_over_six)
  return (bq.Quantized(q[None], s[None], g),
          bq.Quantized(q_t[None], s_t[None], g_t))


def _both_ways(x: jax.Array, recipe: Recipe, salt: Optional[int] = None
               ) -> tuple[bq.Quantized, bq.Quantized]:
  """``x`` (B, M, K) as the forward or input-gradient GEMM reads it
  (quantized along K) and as the weight-gradient GEMM does
  (:func:`_along_tokens`). On a GPU one kernel writes both from one read
  of ``x`` under MXFP8 (:mod:`jmp_lab.kernels.mx_cast_transpose`), and two
  under NVFP4, the first for the amaxes
  (:mod:`jmp_lab.kernels.nvfp4_cast_transpose`)."""
  kernel = _fused_both_ways(x, recipe, salt)
  if kernel is None:
    return _xla_both_ways(x, recipe, salt)
  with jax.named_scope(QUANTIZE_SCOPE):
    if kernel == "nvfp4":
      return _nvfp4_both_ways(x, recipe, salt)
    q, s, q_t, s_t = mx.quantize_both_ways(x[0], _mxfp8_both_ways)
  one = jnp.float32(1.0)
  scales = lambda bits: jax.lax.bitcast_convert_type(  # noqa: E731
      bits, bq.MXFP8.scale_dtype)[None]
  return (bq.Quantized(q[None], scales(s), one),
          bq.Quantized(q_t[None], scales(s_t), one))


def _weight_for_input_gradient(w: jax.Array, qw: bq.Quantized,
                               recipe: Recipe) -> bq.Quantized:
  """``w`` (B, N, K) as (B, K, N) quantized along N: under tiles the
  forward's quantization transposed (the scales of a tile are one), else
  quantized again."""
  if not recipe.weight_tiles:
    return _gathered_where_read(_quantized(jnp.swapaxes(w, 1, 2), recipe))
  values = jnp.swapaxes(qw.values, 1, 2)
  block = recipe.fmt.block
  tile_scales = qw.scales[:, ::block, :]            # (B, N/16, K/16)
  scales = jnp.repeat(jnp.swapaxes(tile_scales, 1, 2), block, axis=1)
  return bq.Quantized(values, scales, qw.global_scale)


def _gathered_where_read(q: bq.Quantized) -> bq.Quantized:
  """A quantized weight laid out as its GEMM reads it
  (:func:`~jmp_lab._src.numerics.consumer_layout.laid_out_for_consumer`):
  quantized on each device's FSDP shard, then gathered as values and
  scales (one byte, or half of one, per weight), as the fp8 products
  gather. The scales travel as their bytes (uint8)."""
  scales = jax.lax.bitcast_convert_type(q.scales, jnp.uint8)
  scales = jax.lax.bitcast_convert_type(laid_out_for_consumer(scales),
                                        q.scales.dtype)
  return q._replace(values=laid_out_for_consumer(q.values), scales=scales)


def _cropped(y: jax.Array, rows: int, columns: int) -> jax.Array:
  return y[:, :rows, :columns]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def block_scaled_bmm(x: jax.Array, w: jax.Array, recipe: Recipe,
                     weight_k_major: bool = False) -> jax.Array:
  """``einsum("bmk,bnk->bmn", x, w)`` block-scaled by ``recipe``, in ``x``'s
  dtype; ``w`` is the weight. See the module doc for the three GEMMs.

  ``weight_k_major``: the weight is stored as (B, K, N) (a Dense kernel,
  ``(in, out)``) and ``w`` is its transpose. The weight-gradient GEMM then
  writes ``dw`` as (B, K, N), the weight's own layout: written as (B, N, K)
  it reached the optimizer through a transpose, and XLA cannot update a
  buffer in place from a transposing read, so it wrote each updated param
  and moment elsewhere and copied them back (1.1 GB a layer of the
  1.3B-class MXFP8 step: ``benchmarks/RESULTS.md``).

  Called without a gradient (evaluation, inference), ``x`` is quantized
  along K only, and by XLA, not by the kernels that write both layouts:
  the copy the weight gradient would read is not written, and XLA fuses
  the quantization into the kernel that produces ``x`` (a LayerNorm, an
  activation), which a Pallas kernel cannot join. The forward's numbers
  are the same (under Four Over Six, but for a block whose two candidates'
  errors tie within their last bits: the kernels sum them in their own
  order). GPT-2 small's forward compiled for a B200: 0.90x the
  modelled time under NVFP4, 0.98x under MXFP8 (``benchmarks/RESULTS.md``).
  """
  del weight_k_major  # only the backward's dw layout depends on it
  return _product(_quantized(x, recipe), x, w, recipe)[0]


def _product(qx: bq.Quantized, x: jax.Array, w: jax.Array, recipe: Recipe
             ) -> tuple[jax.Array, bq.Quantized]:
  """The forward GEMM of ``qx`` (``x`` quantized along K) and ``w``
  (quantized here), cropped to ``x``'s rows and ``w``'s; and the
  quantized weight."""
  qw = _gathered_where_read(_quantized(w, recipe, tiles=recipe.weight_tiles))
  return _cropped(scaled_product(qx, qw, x.dtype), x.shape[1],
                  w.shape[1]), qw


def _bmm_fwd(x, w, recipe, weight_k_major):
  del weight_k_major  # only the backward's dw layout depends on it
  qx, qx_t = _both_ways(x, recipe)
  y, qw = _product(qx, x, w, recipe)
  # Named, so that a remat policy that saves dots saves it (product_remat).
  y = product_remat.mark_product(y, x.shape[2])
  residuals = (_weight_for_input_gradient(w, qw, recipe), qx_t,
               product_types.empty_like(x), product_types.empty_like(w),
               jnp.zeros((0, x.shape[2]), jnp.int8))
  return y, residuals


def _bmm_bwd(recipe, weight_k_major, residuals, g):
  qw_t, qx_t, x_like, w_like, k_like = residuals
  salt = (None if not recipe.stochastic_gradients else 1)
  qg, qg_t = _both_ways(g, recipe, salt)
  dx = scaled_product(qg, qw_t, x_like.dtype)
  dx = _cropped(dx, g.shape[1], k_like.shape[1])
  if weight_k_major:
    dw = jnp.swapaxes(scaled_product(qx_t, qg_t, w_like.dtype), 1, 2)
  else:
    dw = scaled_product(qg_t, qx_t, w_like.dtype)
  dw = _cropped(dw, g.shape[2], k_like.shape[1])
  return (product_types.as_cotangent_of(dx, x_like),
          product_types.as_cotangent_of(dw, w_like))


block_scaled_bmm.defvjp(_bmm_fwd, _bmm_bwd)


# ---- dot_general and einsum -------------------------------------------------


def _as_bmk(x: jax.Array, contracting, batch) -> jax.Array:
  free = [d for d in range(x.ndim) if d not in contracting and d not in batch]
  moved = jnp.transpose(x, (*batch, *free, *contracting))
  size = lambda axes: math.prod(x.shape[d] for d in axes)  # noqa: E731
  return moved.reshape(size(batch), size(free), size(contracting))


def _k_major(ndim: int, contracting, batch) -> bool:
  """Whether a weight's axes are stored batch, contracting, then free (a
  Dense kernel's ``(in, out)``): :func:`block_scaled_bmm`'s
  ``weight_k_major``."""
  free = [d for d in range(ndim) if d not in contracting and d not in batch]
  return [*batch, *contracting, *free] == list(range(ndim))


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers,
                precision=None, preferred_element_type=None, *,
                fmt: str, out_sharding=None,
                weight: Literal["rhs", "lhs"] = "rhs") -> jax.Array:
  """``lax.dot_general(lhs, rhs, ...)`` block-scaled in ``fmt``; ``weight``
  (``"rhs"``, or ``"lhs"`` for ``w @ x``) names the weight operand, the
  other is cast to its dtype, the result is in it.

  On a mesh with explicit axes (``jax.make_mesh``'s default) the product
  runs under ``jax.sharding.auto_axes``, its result split as
  :func:`.product_types.result_spec` says: the quantization's reshapes and
  the GEMMs over a split contraction are left to the partitioner, as on a
  mesh of Auto axes (jax's typing refuses several of them, and asks a GEMM
  over a split contraction to name its result's sharding).

  A product over one value or none (an elementwise scale by a param
  written as an einsum, ``"btd,d->btd"``; a one-hot dispatch's batch
  product) is no GEMM: it runs as ``lax.dot_general`` of the unquantized
  operands in the weight's dtype. Block-scaled, its contraction padded to a
  block, it rounded both operands to E4M3 (E2M1) for nothing."""
  del precision, preferred_element_type
  if out_sharding is not None:
    raise ValueError(f"a block-scaled matmul does not take out_sharding "
                     f"(got {out_sharding!r})")
  if weight not in ("rhs", "lhs"):
    raise ValueError(f"weight must be 'rhs' or 'lhs', got {weight!r}")
  _check_floating(lhs=lhs, rhs=rhs)
  recipe_for(fmt)  # a clear error for a bad name, whichever route follows
  if contracts_nothing(lhs, dimension_numbers):
    return _unquantized(lhs, rhs, dimension_numbers, weight)
  if explicitly_sharded(lhs) or explicitly_sharded(rhs):
    return jax.sharding.auto_axes(
        functools.partial(_dot_general, dimension_numbers=dimension_numbers,
                          fmt=fmt, weight=weight),
        axes=product_types.explicit_axes(lhs, rhs),
        out_sharding=product_types.result_spec(lhs, rhs, dimension_numbers)
    )(lhs, rhs)
  return _dot_general(lhs, rhs, dimension_numbers, fmt=fmt, weight=weight)


def _check_floating(**operands: jax.Array) -> None:
  for name, operand in operands.items():
    dtype = jnp.result_type(operand)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(f"a block-scaled matmul takes floating-point operands; "
                      f"{name} is {dtype}")


def _unquantized(lhs: jax.Array, rhs: jax.Array, dimension_numbers,
                 weight: str) -> jax.Array:
  """The product in the weight's dtype, as the block-scaled one returns it."""
  dtype = jnp.result_type(rhs if weight == "rhs" else lhs)
  return jax.lax.dot_general(jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype),
                             dimension_numbers)


def _dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, *,
                 fmt: str, weight: str) -> jax.Array:
  if weight == "lhs":
    return _weight_on_the_left(lhs, rhs, dimension_numbers, fmt)
  recipe = recipe_for(fmt)
  (lc, rc), (lb, rb) = dimension_numbers
  lhs = jnp.asarray(lhs).astype(rhs.dtype)
  x = _as_bmk(lhs, tuple(lc), tuple(lb))
  w = _as_bmk(rhs, tuple(rc), tuple(rb))
  y = block_scaled_bmm(x, w, recipe, _k_major(rhs.ndim, rc, rb))
  shape = ([lhs.shape[d] for d in lb]
           + [lhs.shape[d] for d in range(lhs.ndim) if d not in lc + lb]
           + [rhs.shape[d] for d in range(rhs.ndim) if d not in rc + rb])
  return y.reshape(shape)


def _weight_on_the_left(w: jax.Array, x: jax.Array, dimension_numbers,
                        fmt: str) -> jax.Array:
  """``lax.dot_general(w, x, ...)`` with the weight on the left: the
  product with the operands swapped (so that each gets its own recipe),
  its free dimensions put back in lax's order (batch, ``w``'s, ``x``'s)."""
  (wc, xc), (wb, xb) = dimension_numbers
  y = dot_general(x, w, ((xc, wc), (xb, wb)), fmt=fmt)
  batch = len(wb)
  x_free = x.ndim - len(xc) - len(xb)
  w_free = w.ndim - len(wc) - len(wb)
  return jnp.transpose(y, (*range(batch),
                           *range(batch + x_free, batch + x_free + w_free),
                           *range(batch, batch + x_free)))


def einsum(subscripts: str, lhs: jax.Array, rhs: jax.Array, precision=None,
           preferred_element_type=None, *, fmt: str,
           out_sharding=None) -> jax.Array:
  """``jnp.einsum(subscripts, lhs, rhs)`` block-scaled in ``fmt`` (jax's
  einsum with :func:`dot_general` as its product); ``rhs`` is the weight
  (write a weight on the left as ``einsum("bi,oi->bo", x, w)``)."""
  del precision, preferred_element_type
  if out_sharding is not None:
    raise ValueError(f"a block-scaled matmul does not take out_sharding "
                     f"(got {out_sharding!r})")
  recipe_for(fmt)  # a clear error for a bad name
  return jnp.einsum(subscripts, lhs, rhs, _dot_general=_EINSUM_PRODUCTS[fmt])


def _einsum_product(fmt: str) -> Callable[..., jax.Array]:
  # What jnp.einsum calls for each pairwise product (it passes jax's
  # keyword arguments, which a block-scaled GEMM has no use for).
  def call(lhs, rhs, dimension_numbers, precision=None,
           preferred_element_type=None, **_: Any):
    return dot_general(lhs, rhs, dimension_numbers, fmt=fmt)
  return call


def _layer_matmuls(fmt: str) -> tuple[Callable, Callable]:
  def layer_dot_general(lhs, rhs, dimension_numbers, precision=None,
                        preferred_element_type=None, out_sharding=None):
    return dot_general(lhs, rhs, dimension_numbers, fmt=fmt,
                       out_sharding=out_sharding)

  def layer_einsum(subscripts, lhs, rhs, precision=None,
                   preferred_element_type=None, out_sharding=None):
    return einsum(subscripts, lhs, rhs, fmt=fmt, out_sharding=out_sharding)

  layer_dot_general.__name__ = f"{fmt}_dot_general"
  layer_einsum.__name__ = f"{fmt}_einsum"
  return layer_dot_general, layer_einsum


# One function object per format: jnp.einsum's product is a static argument.
_EINSUM_PRODUCTS = {name: _einsum_product(name) for name in RECIPES}

#: Per format: a layer's ``dot_general`` and ``einsum_op`` (one function
#: object each: an NNX module's attribute is part of its graph definition).
LAYER_MATMULS = {name: _layer_matmuls(name) for name in RECIPES}
