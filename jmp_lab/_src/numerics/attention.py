"""Attention whose fp32 softmax lives inside a fused kernel, chosen by target.

The implementation behind :mod:`jmp_lab.attention`, whose docstring describes it
with examples.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lab._src.precision.scopes import current_compute_dtype
from jmp_lab.kernels.platform import importable, quiet_triton_deprecation

IMPLEMENTATIONS = ("auto", "cudnn", "triton", "mosaic", "xla")
_HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def dot_product_attention(query, key, value, bias=None, mask=None, *,
                          causal: bool = False, segment_ids=None,
                          scale: Optional[float] = None,
                          dropout_rate: float = 0.0, dropout_rng=None,
                          deterministic: bool = True,
                          broadcast_dropout: bool = True,
                          implementation: str = "auto"):
  """Multi-head attention with an fp32 softmax, fused where it can be.

  Args:
    query: ``(..., T, N, H)``: batch dims, query length, heads, head dim.
    key, value: ``(..., S, K, H)`` with ``N`` a multiple of ``K``
      (grouped-query attention when ``K < N``).
    bias: added to the scores, broadcastable to ``(..., N, T, S)``
      (materialized path).
    mask: boolean, broadcastable to ``(..., N, T, S)``; False masks a score
      out (materialized path).
    causal: each query sees the keys at and before its own position.
    segment_ids: ``(..., T)`` int; a query sees only keys of its own segment
      (packed sequences; self-attention, ``S == T``).
    scale: the scores' scale (default ``1 / sqrt(H)``).
    dropout_rate, dropout_rng, deterministic, broadcast_dropout: dropout on
      the attention weights, as flax's (materialized path).
    implementation: ``"auto"``, ``"cudnn"``, ``"triton"``, ``"mosaic"`` or
      ``"xla"`` (see the module doc).

  Returns:
    ``(..., T, N, H)`` in ``query``'s dtype.

  Raises:
    ValueError: for an unknown ``implementation``, shapes that do not
      match, or an explicit kernel that cannot take this call (the message
      says why).
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown attention implementation {implementation!r}; "
                     f"accepted: {', '.join(IMPLEMENTATIONS)}")
  _check_shapes(query, key, value, segment_ids)
  scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
  dropout = dropout_rate > 0.0 and not deterministic
  materialize = functools.partial(
      _materialized, query, key, value, bias, mask, causal, segment_ids, scale,
      dropout_rate if dropout else 0.0, dropout_rng, broadcast_dropout)
  if implementation == "xla":
    return materialize()
  unfusable = _why_not_fused(bias, mask, dropout)
  if implementation != "auto":
    if unfusable:
      raise ValueError(f"attention implementation {implementation!r} cannot "
                       f"take this call: {unfusable}")
    why = _KERNELS[implementation][1](query, key, segment_ids)
    if why:
      raise ValueError(f"attention implementation {implementation!r} cannot "
                       f"take this call: {why}")
    return _KERNELS[implementation][0](query, key, value, causal, segment_ids,
                                       scale)
  chosen, why = (None, unfusable) if unfusable else _choose(query, key,
                                                             segment_ids)
  if chosen is None:
    if causal or segment_ids is not None:
      _warn_once(f"jmp_lab attention: runs materialized (the fp32 scores "
                 f"stored) on every platform: {why}")
    return materialize()
  fused = functools.partial(_KERNELS[chosen][0], query, key, value, causal,
                            segment_ids, scale)
  return jax.lax.platform_dependent(cuda=fused, default=materialize)


# ---------------------------------------------------------------------------
# Which kernel takes a call.
# ---------------------------------------------------------------------------


def _check_shapes(query, key, value, segment_ids) -> None:
  if not (query.ndim == key.ndim == value.ndim) or query.ndim < 3:
    raise ValueError(
        f"attention takes (..., length, heads, head_dim) arrays; got query "
        f"{query.shape}, key {key.shape}, value {value.shape}")
  if key.shape != value.shape or key.shape[-1] != query.shape[-1]:
    raise ValueError(f"key {key.shape} and value {value.shape} must match, "
                     f"with query's head dim {query.shape[-1]}")
  if query.shape[-2] % key.shape[-2]:
    raise ValueError(f"query's {query.shape[-2]} heads must be a multiple of "
                     f"key's {key.shape[-2]} (grouped-query attention)")
  if segment_ids is not None and (
      tuple(segment_ids.shape) != tuple(query.shape[:-2])
      or query.shape[-3] != key.shape[-3]):
    raise ValueError(
        f"segment_ids must have shape {tuple(query.shape[:-2])} (batch, "
        f"length) and go with self-attention; got {tuple(segment_ids.shape)} "
        f"for query {query.shape} and key {key.shape}")


def _why_not_fused(bias, mask, dropout) -> str:
  reasons = [name for name, given in (
      ("a bias", bias is not None), ("a mask (pass causal=True or "
                                     "segment_ids instead)", mask is not None),
      ("dropout (no fused kernel has it)", dropout)) if given]
  return " and ".join(reasons)


def _cudnn_limits(query, key, segment_ids) -> str:
  if not _cudnn_available():
    return "cuDNN is not installed (pip install nvidia-cudnn-cu12)"
  if segment_ids is not None:
    return "cuDNN's attention takes no segment_ids"
  if np.dtype(query.dtype) not in _HALF:
    return f"cuDNN's attention needs bf16 or fp16, got {query.dtype}"
  head = query.shape[-1]
  if head % 8 or head > 128:
    return f"cuDNN's attention needs a head dim multiple of 8 up to 128, got {head}"
  return ""


def _triton_limits(query, key, segment_ids) -> str:
  if not importable("jax.experimental.pallas.ops.gpu.attention"):
    return "jax's Pallas Triton attention cannot be imported"
  if np.dtype(query.dtype) not in _HALF:
    return f"the Triton kernel is used for bf16 or fp16, got {query.dtype}"
  for name, length in (("query", query.shape[-3]), ("key", key.shape[-3])):
    if length % _block(length):
      return f"the Triton kernel needs a {name} length that is a multiple of its block, got {length}"
  return ""


def _mosaic_limits(query, key, segment_ids) -> str:
  if not importable("jax.experimental.pallas.ops.gpu.attention_mgpu"):
    return "jax's Mosaic GPU attention cannot be imported"
  if segment_ids is not None:
    return "the Mosaic GPU attention takes no segment_ids"
  if np.dtype(query.dtype) not in _HALF:
    return f"the Mosaic GPU attention needs bf16 or fp16, got {query.dtype}"
  if query.shape[-1] % 64:
    return f"the Mosaic GPU attention needs a head dim multiple of 64, got {query.shape[-1]}"
  if query.shape[-3] % 128 or key.shape[-3] % 128:
    return "the Mosaic GPU attention needs lengths that are a multiple of 128"
  return ""


def _choose(query, key, segment_ids) -> tuple[Optional[str], str]:
  """The kernel ``"auto"`` uses on CUDA, or None and why none."""
  reasons = []
  for name in ("cudnn", "triton"):
    why = _KERNELS[name][1](query, key, segment_ids)
    if not why:
      return name, ""
    reasons.append(why)
  return None, "; ".join(reasons)


@functools.lru_cache(maxsize=None)
def _cudnn_available() -> bool:
  """Whether jax can build a cuDNN attention (it loads cuDNN at trace time,
  also when compiling for a GPU on a machine without one)."""
  q = jax.ShapeDtypeStruct((1, 8, 1, 8), jnp.bfloat16)
  try:
    jax.eval_shape(functools.partial(jax.nn.dot_product_attention,
                                     implementation="cudnn"), q, q, q)
    return True
  except Exception:  # pylint: disable=broad-except
    return False


_WARNED: set = set()


def _warn_once(message: str) -> None:
  if message not in _WARNED:
    _WARNED.add(message)
    warnings.warn(message, stacklevel=3)


# ---------------------------------------------------------------------------
# The kernels.
# ---------------------------------------------------------------------------


def _block(length: int) -> int:
  """The Triton kernel's block: the largest power of two up to 128 that
  divides ``length`` (at least 16)."""
  block = 128
  while block > 16 and length % block:
    block //= 2
  return block


def _flat_batch(x):
  """``(..., L, N, H)`` as ``(B, L, N, H)``, and the batch dims."""
  return x.reshape((-1,) + x.shape[-3:]), x.shape[:-3]


def _grouped(key, value, heads: int):
  """Key and value with their heads repeated to ``heads`` (a kernel without
  grouped-query support)."""
  repeat = heads // key.shape[-2]
  if repeat == 1:
    return key, value
  return (jnp.repeat(key, repeat, axis=-2), jnp.repeat(value, repeat,
                                                       axis=-2))


def _cudnn(query, key, value, causal, segment_ids, scale):
  del segment_ids
  q, batch = _flat_batch(query)
  out = jax.nn.dot_product_attention(
      q, _flat_batch(key)[0], _flat_batch(value)[0], scale=scale,
      is_causal=causal, implementation="cudnn")
  return out.reshape(batch + out.shape[1:])


def _triton(query, key, value, causal, segment_ids, scale):
  from jax.experimental.pallas.ops.gpu import attention as pallas_attention
  quiet_triton_deprecation()
  key, value = _grouped(key, value, query.shape[-2])
  q, batch = _flat_batch(query)
  blocks = pallas_attention.BlockSizes(
      block_q=_block(query.shape[-3]), block_k=_block(key.shape[-3]),
      block_q_dkv=32, block_kv_dkv=32, block_q_dq=32, block_kv_dq=32)
  segments = (None if segment_ids is None
              else segment_ids.reshape((-1, segment_ids.shape[-1])))
  out = pallas_attention.mha(q, _flat_batch(key)[0], _flat_batch(value)[0],
                             segments, sm_scale=scale, causal=causal,
                             block_sizes=blocks)
  return out.reshape(batch + out.shape[1:])


def _mosaic(query, key, value, causal, segment_ids, scale):
  del segment_ids
  from jax.experimental.pallas.ops.gpu import attention_mgpu
  # The kernel scales the scores by 1/sqrt(H) itself; another scale is
  # folded into the query.
  default = 1.0 / math.sqrt(query.shape[-1])
  if scale != default:
    query = (query * jnp.asarray(scale / default, query.dtype))
  q, batch = _flat_batch(query)
  config = attention_mgpu.TuningConfig(
      block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal,
      block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
  out = attention_mgpu.attention(q, _flat_batch(key)[0],
                                 _flat_batch(value)[0], config)
  return out.reshape(batch + out.shape[1:])


_KERNELS = {"cudnn": (_cudnn, _cudnn_limits),
            "triton": (_triton, _triton_limits),
            "mosaic": (_mosaic, _mosaic_limits)}


def combined_mask(mask, query, key, causal: bool, segment_ids):
  """``mask`` (or None) and the causal and segment masks, as one boolean
  mask broadcastable to ``(..., heads, T, S)``."""
  keep = None
  if causal:
    keep = jnp.tril(jnp.ones((query.shape[-3], key.shape[-3]), bool),
                    key.shape[-3] - query.shape[-3])
  if segment_ids is not None:
    same = segment_ids[..., :, None] == segment_ids[..., None, :]
    same = same[..., None, :, :]
    keep = same if keep is None else jnp.logical_and(keep, same)
  if mask is not None:
    keep = mask if keep is None else jnp.logical_and(keep, mask)
  return keep


def _materialized(query, key, value, bias, mask, causal, segment_ids, scale,
                  dropout_rate, dropout_rng, broadcast_dropout, precision=None,
                  sow=None):
  """The scores stored: computed in the inputs' dtype, then the mask,
  softmax and dropout in fp32; the weights cast back for the second
  matmul (whose gradients then stay half-precision GEMMs). ``sow`` is
  given the softmax's weights (flax's ``attention_weights``)."""
  dtype = query.dtype
  heads, groups = query.shape[-2], key.shape[-2]
  q = query * jnp.asarray(scale, dtype)
  if groups == heads:
    logits = jnp.einsum("...qhd,...khd->...hqk", q, key, precision=precision)
  else:  # grouped-query attention: a group's query heads share a key head
    q = q.reshape(q.shape[:-2] + (groups, heads // groups, q.shape[-1]))
    logits = jnp.einsum("...qgrd,...kgd->...grqk", q, key,
                        precision=precision)
    logits = logits.reshape(logits.shape[:-4] + (heads,) + logits.shape[-2:])
  # The scores leave the matmul in its dtype (tensor cores accumulate in
  # fp32 anyway) and are cast after: an fp32 result would make both of its
  # gradient matmuls fp32-by-half, off the half tensor-core path.
  logits = logits.astype(jnp.float32)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  keep = combined_mask(mask, query, key, causal, segment_ids)
  if keep is not None:
    logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(logits, axis=-1)
  if sow is not None:
    sow(weights)
  if dropout_rate > 0.0:
    keep_prob = 1.0 - dropout_rate
    shape = ((1,) * (weights.ndim - 2) + weights.shape[-2:]
             if broadcast_dropout else weights.shape)
    kept = jax.random.bernoulli(dropout_rng, keep_prob, shape)
    weights = weights * kept.astype(jnp.float32) / keep_prob
  weights = weights.astype(dtype)
  if groups == heads:
    return jnp.einsum("...hqk,...khd->...qhd", weights, value,
                      precision=precision).astype(dtype)
  weights = weights.reshape(weights.shape[:-3] + (groups, heads // groups)
                            + weights.shape[-2:])
  out = jnp.einsum("...grqk,...kgd->...qgrd", weights, value,
                   precision=precision)
  return out.reshape(query.shape).astype(dtype)


# ---------------------------------------------------------------------------
# The attention_fn the front ends give flax's attention modules.
# ---------------------------------------------------------------------------


def kernel_dtype(dtype, query) -> np.dtype:
  """The dtype a fused attention kernel runs in: the layer's own if half,
  else the compute dtype of the policy around the call, else the query's."""
  for candidate in (dtype, current_compute_dtype(), query.dtype):
    if candidate is not None and np.dtype(candidate) in (
        np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
      return np.dtype(candidate)
  return np.dtype(query.dtype)


def attention_fn(query, key, value, bias=None, mask=None, *,
                 broadcast_dropout: bool = True, dropout_rng=None,
                 dropout_rate: float = 0.0, deterministic: bool = False,
                 dtype=None, precision=None, causal: bool = False,
                 segment_ids=None, implementation: str = "auto",
                 sow=None):
  """The one attention both front ends give flax's attention modules
  (:func:`jmp_lab.linen.dot_product_attention` and
  :func:`jmp_lab.nnx.dot_product_attention` are its ``attention_fn``
  forms), grouped-query attention included.

  With ``causal=True`` or ``segment_ids`` and no mask, bias, dropout or
  sown weights, it runs :func:`dot_product_attention` (a fused kernel on
  CUDA) with its operands in the compute dtype of the policy around the
  call, even from a layer given ``dtype=jnp.float32``. Otherwise the scores
  are materialized in ``dtype`` (the query's by default) with the mask,
  softmax and dropout in fp32; ``sow(weights)`` is given the softmax's
  weights where a module asked to sow them.

  >>> import jax.numpy as jnp
  >>> q = jnp.ones((1, 4, 8, 16), jnp.bfloat16)      # 8 query heads
  >>> kv = jnp.ones((1, 4, 2, 16), jnp.bfloat16)     # 2 key/value heads
  >>> attention_fn(q, kv, kv, causal=True).shape
  (1, 4, 8, 16)
  """
  dropout = dropout_rate > 0.0 and not deterministic
  fusable = (mask is None and bias is None and sow is None and not dropout
             and precision is None and (causal or segment_ids is not None))
  dtype = (kernel_dtype(dtype, query) if fusable
           else np.dtype(query.dtype if dtype is None else dtype))
  query, key, value = (x.astype(dtype) for x in (query, key, value))
  if fusable:
    return dot_product_attention(query, key, value, causal=causal,
                                 segment_ids=segment_ids,
                                 implementation=implementation)
  _check_shapes(query, key, value, segment_ids)
  return _materialized(query, key, value, bias, mask, causal, segment_ids,
                       1.0 / math.sqrt(query.shape[-1]),
                       dropout_rate if dropout else 0.0, dropout_rng,
                       broadcast_dropout, precision, sow)
