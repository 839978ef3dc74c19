"""Module state written under a policy: a decoder with a float32 KV cache.

Public model code allocates its KV cache in float32 and writes each step's
keys and values into it with ``dynamic_update_slice``, as its own tests do.
Under a policy those keys are bf16 (or fp16): the write met a float32
buffer and the model crashed ("lax.dynamic_update_slice requires arguments
to have the same dtypes"), where the same model runs without jmp_lab. Now a
write is cast to its destination's dtype (torch's rule for a bf16 write into
a float32 buffer) and a cache is read in the compute dtype inside a call;
``cache_dtype="compute"`` stores it in the compute dtype instead.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_lab

VOCAB, WIDTH, CACHE, BATCH = 32, 16, 8, 2
POLICIES = ["mixed_bfloat16", "mixed_float16", "p=bf16,c=bf16,o=f32",
            "mixed_bfloat16,matmul=fp8_current", "mixed_fp8"]


def _attend(q, keys, values, length):
  scores = jnp.einsum("btd,bsd->bts", q, keys) / np.sqrt(WIDTH)
  visible = jnp.arange(keys.shape[1])[None, None, :] < length
  scores = jnp.where(visible, scores, -1e9)
  return jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores, axis=-1), values)


class LinenDecoder(nn.Module):
  """Embed, one attention layer over a float32 cache, a head."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, WIDTH)(tokens)
    q, k, v = jnp.split(nn.Dense(3 * WIDTH)(x), 3, axis=-1)
    keys = self.variable("cache", "keys", jnp.zeros, (BATCH, CACHE, WIDTH),
                         jnp.float32)
    values = self.variable("cache", "values", jnp.zeros,
                           (BATCH, CACHE, WIDTH), jnp.float32)
    index = self.variable("cache", "index", lambda: jnp.array(0, jnp.int32))
    i = index.value
    keys.value = jax.lax.dynamic_update_slice(keys.value, k, (0, i, 0))
    values.value = jax.lax.dynamic_update_slice(values.value, v, (0, i, 0))
    index.value = i + tokens.shape[1]
    out = _attend(q, keys.value, values.value, index.value)
    return nn.Dense(VOCAB)(x + out)


class NnxDecoder(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.qkv = nnx.Linear(WIDTH, 3 * WIDTH, rngs=rngs)
    self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)
    self.keys = nnx.Cache(jnp.zeros((BATCH, CACHE, WIDTH), jnp.float32))
    self.values = nnx.Cache(jnp.zeros((BATCH, CACHE, WIDTH), jnp.float32))
    self.index = nnx.Cache(jnp.array(0, jnp.int32))

  def __call__(self, tokens):
    x = self.embed(tokens)
    q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
    i = self.index[...]
    self.keys[...] = jax.lax.dynamic_update_slice(self.keys[...], k, (0, i, 0))
    self.values[...] = jax.lax.dynamic_update_slice(self.values[...], v,
                                                    (0, i, 0))
    self.index[...] = i + tokens.shape[1]
    out = _attend(q, self.keys[...], self.values[...], self.index[...])
    return self.head(x + out)


PROMPT = np.random.default_rng(0).integers(0, VOCAB, (BATCH, 5))
NEXT = np.random.default_rng(1).integers(0, VOCAB, (2, BATCH, 1))


def _tolerance(policy: str) -> float:
  """Of the logits' largest magnitude: a few half ulps through two matmuls
  (fp8's e4m3 rounds 16 times as coarsely)."""
  return 0.25 if "fp8" in policy else 0.03


def _linen_run(policy, cache_dtype=None):
  """Prefill, then two decode steps: ``(logits of each, the cache)``."""
  model = LinenDecoder()
  if policy is not None:
    model = jmp_lab.linen.with_policy(model, policy, cache_dtype=cache_dtype)
  variables = LinenDecoder().init(jax.random.key(0), PROMPT)
  if policy is not None:  # the same weights: init's, cast as the policy does
    variables = {**model.init(jax.random.key(0), PROMPT),
                 "params": jax.tree.map(
                     lambda w, p: w.astype(p.dtype), variables["params"],
                     model.init(jax.random.key(0), PROMPT)["params"])}
  cache = model.init(jax.random.key(0), PROMPT)["cache"] if policy else (
      variables["cache"])
  cache = jax.tree.map(jnp.zeros_like, cache)
  apply = jax.jit(lambda params, cache, tokens: model.apply(
      {**{k: v for k, v in variables.items() if k not in ("params", "cache")},
       "params": params, "cache": cache}, tokens, mutable=["cache"]))
  outs = []
  for tokens in [PROMPT, *NEXT]:
    logits, mutated = apply(variables["params"], cache, tokens)
    cache = mutated["cache"]
    outs.append(np.asarray(logits, np.float32))
  return outs, cache


def _nnx_run(policy, cache_dtype=None):
  model = NnxDecoder(nnx.Rngs(0))
  if policy is not None:
    model = jmp_lab.nnx.with_policy(model, policy, cache_dtype=cache_dtype)
  step = nnx.jit(lambda model, tokens: model(tokens))
  outs = [np.asarray(step(model, tokens), np.float32)
          for tokens in [PROMPT, *NEXT]]
  return outs, {"keys": model.keys.get_raw_value(),
                "values": model.values.get_raw_value()}


RUNS = {"linen": _linen_run, "nnx": _nnx_run}


@pytest.mark.parametrize("route", RUNS)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_float32_cache_prefills_and_decodes_under_every_policy(route,
                                                                 policy):
  """It crashed under every half policy; now each step's logits are within
  half-precision tolerance of the unwrapped model's, and the cache keeps
  the float32 the model gave it."""
  reference, _ = RUNS[route](None)
  outs, cache = RUNS[route](policy)
  for got, want in zip(outs, reference):
    scale = np.max(np.abs(want))
    np.testing.assert_allclose(got, want, atol=_tolerance(policy) * scale)
  for array in jax.tree.leaves(cache):
    if jnp.issubdtype(array.dtype, jnp.floating):
      assert array.dtype == jnp.float32


@pytest.mark.parametrize("route", RUNS)
def test_cache_dtype_compute_stores_the_cache_in_half(route):
  """The memory route: the cache in the compute dtype (bf16), the same
  logits to bf16 tolerance."""
  reference, _ = RUNS[route](None)
  outs, cache = RUNS[route]("mixed_bfloat16", cache_dtype="compute")
  floating = [a for a in jax.tree.leaves(cache)
              if jnp.issubdtype(a.dtype, jnp.floating)]
  assert floating and all(a.dtype == jnp.bfloat16 for a in floating)
  for got, want in zip(outs, reference):
    np.testing.assert_allclose(got, want, atol=0.03 * np.max(np.abs(want)))


def test_cache_dtype_is_checked():
  for with_policy, model in ((jmp_lab.linen.with_policy, LinenDecoder()),
                             (jmp_lab.nnx.with_policy,
                              NnxDecoder(nnx.Rngs(0)))):
    with pytest.raises(ValueError, match=r"cache_dtype must be None .* or "
                                         r"'compute'.*got 'bf16'"):
      with_policy(model, "mixed_bfloat16", cache_dtype="bf16")


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_autocast_decodes_into_a_carried_float32_buffer(policy):
  """The function route: a decode loop that writes each step's keys into a
  float32 buffer it carries (``fori_loop`` + ``dynamic_update_slice``)
  keeps the buffer float32 and matches the fp32 run to half tolerance."""
  weight = jax.random.normal(jax.random.key(0), (WIDTH, WIDTH)) / 4

  def decode(x):
    def body(i, buffer):
      keys = jnp.tanh(x[i] @ weight)[None]
      return jax.lax.dynamic_update_slice(buffer, keys, (i, 0))
    buffer = jax.lax.fori_loop(0, CACHE, body,
                               jnp.zeros((CACHE, WIDTH), jnp.float32))
    return buffer @ weight, buffer

  x = jax.random.normal(jax.random.key(1), (CACHE, WIDTH))
  want, _ = decode(x)
  got, buffer = jmp_lab.autocast(decode, policy)(x)
  assert buffer.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got, np.float32), want,
                             atol=0.03 * float(jnp.max(jnp.abs(want))))


def test_flax_attention_cache_made_after_with_policy_decodes():
  """``nnx.MultiHeadAttention.init_cache`` makes its float32 KV cache when
  decoding starts, after the model was wrapped: it is policed at the
  layer's next call (it crashed, as a cache made before did)."""
  def make():
    return nnx.MultiHeadAttention(num_heads=2, in_features=WIDTH,
                                  qkv_features=WIDTH, decode=True,
                                  rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (BATCH, 1, WIDTH))
  outs = {}
  for policy in (None, "mixed_bfloat16"):
    layer = make()
    if policy is not None:
      layer = jmp_lab.nnx.with_policy(layer, policy)
    layer.init_cache((BATCH, CACHE, WIDTH), dtype=jnp.float32)
    outs[policy] = [np.asarray(layer(x * (i + 1)), np.float32)
                    for i in range(3)]
    assert layer.cached_key.get_raw_value().dtype == jnp.float32
  for got, want in zip(outs["mixed_bfloat16"], outs[None]):
    np.testing.assert_allclose(got, want, atol=0.03 * np.max(np.abs(want)))
