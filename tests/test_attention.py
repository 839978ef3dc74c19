"""Tests for jmp_lab.attention: the fp32 softmax inside a fused kernel on
CUDA (compiled for an H100 without one), the same numbers elsewhere."""

import functools
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jmp_lab
from jmp_lab import attention
from jmp_lab._src.numerics import attention as attention_impl  # its warn-once set
from jmp_lab import linen as jl
from cuda_compile import require_cuda_plugin  # noqa: E402

B, T, N, H = 2, 32, 4, 16


def qkv(dtype=jnp.float32, heads=N, kv_heads=N, key=0):
  k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
  return (jax.random.normal(k1, (B, T, heads, H)).astype(dtype),
          jax.random.normal(k2, (B, T, kv_heads, H)).astype(dtype),
          jax.random.normal(k3, (B, T, kv_heads, H)).astype(dtype))


def flax_reference(q, k, v, mask):
  """Flax's attention with the fp32 softmax, in fp32."""
  return nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                  mask=mask, force_fp32_for_softmax=True)


CAUSAL = nn.make_causal_mask(jnp.ones((B, T)))


@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-5),
                                              (jnp.bfloat16, 3e-2)])
def test_causal_on_cpu_gives_flaxs_numbers(dtype, tolerance):
  q, k, v = qkv(dtype)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fp32 cannot be fused: said once
    got = jax.jit(functools.partial(attention.dot_product_attention,
                                    causal=True))(q, k, v)
  chex.assert_type(got, dtype)
  chex.assert_trees_all_close(got.astype(jnp.float32),
                              flax_reference(q, k, v, CAUSAL),
                              atol=tolerance, rtol=tolerance)


def test_segments_and_grouped_query_heads():
  q, k, v = qkv(jnp.bfloat16, heads=N, kv_heads=2)
  segments = jnp.repeat(jnp.array([[0, 1], [2, 3]]), T // 2, axis=1)
  got = attention.dot_product_attention(q, k, v, causal=True,
                                        segment_ids=segments)
  same = segments[:, :, None] == segments[:, None, :]
  mask = jnp.logical_and(CAUSAL, same[:, None])
  want = flax_reference(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2),
                        mask)
  chex.assert_trees_all_close(got.astype(jnp.float32), want, atol=3e-2,
                              rtol=3e-2)


def test_the_cuda_branch_is_a_fused_kernel_and_the_cpu_branch_is_not():
  q, k, v = qkv(jnp.bfloat16)
  fn = functools.partial(attention.dot_product_attention, causal=True)
  cpu = jax.jit(fn).lower(q, k, v).as_text()
  assert "cudnn" not in cpu and "pallas" not in cpu
  text = jax.make_jaxpr(fn)(q, k, v).pretty_print()
  assert "platform_index" in text  # decided when lowered, by the platform


def _compiled(fn, *args, fail_on_spill=True):
  require_cuda_plugin()
  return jmp_lab.diagnostics.compiled_report(fn, *args, target="h100",
                                             fail_on_spill=fail_on_spill)


def _custom_calls(report):
  return {k.op_name.rsplit("/", 1)[-1] for k in report.kernel_records
          if k.opcode == "custom-call"}


def test_compiled_for_an_h100_cudnn_by_default_triton_for_segments():
  q = jax.ShapeDtypeStruct((8, 1024, 12, 64), jnp.bfloat16)
  segments = jax.ShapeDtypeStruct((8, 1024), jnp.int32)

  def grads(**kwargs):
    loss = lambda q, k, v: attention.dot_product_attention(  # noqa: E731
        q, k, v, causal=True, **kwargs).astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))

  fused = _compiled(grads(), q, q, q)
  assert {"dot_product_attention_fwd", "dot_product_attention_bwd"} <= (
      _custom_calls(fused))
  # XLA's own softmax-backward fusion of the materialized path spills in a
  # deviceless compile (its tiling is not autotuned there); the comparison
  # is of its bytes and memory (577 MiB of temporaries, 2.55 GB).
  materialized = _compiled(grads(implementation="xla"), q, q, q,
                           fail_on_spill=False)
  # No stored (batch, heads, T, T) scores: 24 MiB of temporaries, not ~1 GiB.
  assert fused.memory["temp"] < 64 * 2**20 < materialized.memory["temp"]
  assert fused.bytes_accessed < 0.1 * materialized.bytes_accessed
  with_segments = _compiled(
      lambda q, s: jax.grad(lambda q: attention.dot_product_attention(
          q, q, q, causal=True, segment_ids=s).astype(jnp.float32).sum())(q),
      q, segments)
  assert any(p.name.startswith("mha") for p in with_segments.pallas_kernels)


def test_what_cannot_be_fused_is_materialized_and_said_once():
  q, k, v = qkv(jnp.bfloat16)
  attention_impl._WARNED.clear()
  with pytest.warns(UserWarning, match="a mask .pass causal=True"):
    got = attention.dot_product_attention(q, k, v, mask=CAUSAL, causal=True)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    attention.dot_product_attention(q, k, v, mask=CAUSAL, causal=True)
    attention.dot_product_attention(q, k, v, mask=CAUSAL)  # asked for nothing
  chex.assert_trees_all_close(got.astype(jnp.float32),
                              flax_reference(q, k, v, CAUSAL), atol=3e-2)


@pytest.mark.parametrize("kwargs, match", [
    ({"implementation": "flash"}, "unknown attention implementation 'flash'"),
    ({"implementation": "cudnn", "segment_ids": jnp.zeros((B, T), jnp.int32)},
     "cuDNN's attention takes no segment_ids"),
    ({"implementation": "triton", "mask": CAUSAL}, "cannot take this call: a "
     "mask"),
    ({"segment_ids": jnp.zeros((B, T + 1), jnp.int32)},
     r"segment_ids must have shape \(2, 32\)"),
])
def test_bad_input_is_refused_with_the_reason(kwargs, match):
  q, k, v = qkv(jnp.bfloat16)
  with pytest.raises(ValueError, match=match):
    attention.dot_product_attention(q, k, v, causal=True, **kwargs)


# ---- as an attention_fn -------------------------------------------------------


class CausalBlock(nn.Module):
  fused: bool

  @nn.compact
  def __call__(self, x):
    if self.fused:
      return nn.MultiHeadDotProductAttention(num_heads=N, dtype=jnp.float32, attention_fn=(
          functools.partial(jl.dot_product_attention, causal=True)))(x)
    return nn.MultiHeadDotProductAttention(num_heads=N, dtype=jnp.float32)(
        x, mask=nn.make_causal_mask(x[..., 0]))


def test_linen_attention_fn_fused_under_a_policy_with_float32_layers():
  x = jax.random.normal(jax.random.key(0), (B, T, N * H))
  fused = jl.with_policy(CausalBlock(True), "mixed_bfloat16")
  masked = jl.with_policy(CausalBlock(False), "mixed_bfloat16")
  params = fused.init(jax.random.key(1), x)
  chex.assert_trees_all_close(fused.apply(params, x), masked.apply(params, x),
                              atol=5e-2, rtol=5e-2)
  report = _compiled(lambda p, x: jax.grad(lambda p: fused.apply(p, x).sum())(
      p), params, x)
  assert "dot_product_attention_fwd" in _custom_calls(report)
  assert not report.fp32_gemms


def test_nnx_attention_fn_fused():
  rngs = nnx.Rngs(0)
  layer = nnx.MultiHeadAttention(
      num_heads=N, in_features=N * H, decode=False, rngs=rngs,
      attention_fn=functools.partial(jmp_lab.nnx.dot_product_attention,
                                     causal=True))
  model = jmp_lab.nnx.with_policy(layer, "mixed_bfloat16")
  x = jax.random.normal(jax.random.key(0), (B, T, N * H))
  graphdef, state = nnx.split(model)
  report = _compiled(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
  assert "dot_product_attention_fwd" in _custom_calls(report)
  want = nnx.MultiHeadAttention(num_heads=N, in_features=N * H, decode=False,
                                rngs=nnx.Rngs(0))(
      x, mask=nn.make_causal_mask(x[..., 0]))
  chex.assert_trees_all_close(model(x), want, atol=5e-2, rtol=5e-2)
