"""A Llama-3 / Qwen3-style language model written as public Flax NNX LLM code
is (not as jmp_lab's examples are): its own RMSNorm in fp32, rotary
embeddings built from integer positions, grouped-query attention with a mask
built from positions (causal, optionally a sliding window), a SwiGLU MLP,
a tied or untied head, ``nnx.with_partitioning`` sharding annotations over
the mesh axes ``fsdp`` and ``tensor`` (so the model is built under a mesh:
:func:`mesh`) and a float32 KV cache for decoding written with
``dynamic_update_slice``.

Shared by the tests that run such code under jmp_lab.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 96
  width: int = 64
  layers: int = 2
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 16
  hidden: int = 128
  rope_theta: float = 10000.0
  tie_embeddings: bool = True
  sliding_window: Optional[int] = None
  qk_norm: bool = True  # Qwen3 normalises q and k per head


def mesh(fsdp: int = 1, tensor: int = 1) -> jax.sharding.Mesh:
  """The mesh the model is built under (``with jax.set_mesh(mesh()):``)."""
  return jax.make_mesh((fsdp, tensor), ("fsdp", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _kernel_init(*names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class RMSNorm(nnx.Module):
  """As public LLM code writes it: statistics in fp32, then back."""

  def __init__(self, dim: int, *, eps: float = 1e-6):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.eps = eps

  def __call__(self, x):
    dtype = x.dtype
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.scale[...]).astype(dtype)


def rope(x, positions, theta: float):
  """Rotary embeddings from integer positions ``(batch, seq)``."""
  half = x.shape[-1] // 2
  fraction = 2 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1]
  timescale = theta ** fraction
  angles = positions[..., None].astype(jnp.float32) / timescale  # (B, T, half)
  sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
  first, second = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([first * cos - second * sin,
                         second * cos + first * sin], axis=-1)
  return out.astype(x.dtype)


def attention_mask(q_positions, k_positions, window: Optional[int]):
  """``(B, Tq, Tk)``: causal by position, within the window if any."""
  mask = q_positions[:, :, None] >= k_positions[:, None, :]
  if window is not None:
    mask = mask & (q_positions[:, :, None] - k_positions[:, None, :] < window)
  return mask


class KVCache(nnx.Variable):
  """A decoding cache, its own variable type as public NNX LLM code has."""


class Attention(nnx.Module):

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.q = nnx.Linear(cfg.width, cfg.heads * cfg.head_dim, use_bias=False,
                        kernel_init=_kernel_init("fsdp", "tensor"), rngs=rngs)
    self.k = nnx.Linear(cfg.width, cfg.kv_heads * cfg.head_dim,
                        use_bias=False,
                        kernel_init=_kernel_init("fsdp", "tensor"), rngs=rngs)
    self.v = nnx.Linear(cfg.width, cfg.kv_heads * cfg.head_dim,
                        use_bias=False,
                        kernel_init=_kernel_init("fsdp", "tensor"), rngs=rngs)
    self.o = nnx.Linear(cfg.heads * cfg.head_dim, cfg.width, use_bias=False,
                        kernel_init=_kernel_init("tensor", "fsdp"), rngs=rngs)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(cfg.head_dim)
      self.k_norm = RMSNorm(cfg.head_dim)
    self.cache_k: Optional[KVCache] = None
    self.cache_v: Optional[KVCache] = None

  def init_cache(self, batch: int, length: int, dtype=jnp.float32):
    shape = (batch, length, self.cfg.kv_heads, self.cfg.head_dim)
    self.cache_k = KVCache(jnp.zeros(shape, dtype))
    self.cache_v = KVCache(jnp.zeros(shape, dtype))

  def __call__(self, x, positions, cache_index=None):
    cfg = self.cfg
    batch, seq, _ = x.shape
    q = self.q(x).reshape(batch, seq, cfg.heads, cfg.head_dim)
    k = self.k(x).reshape(batch, seq, cfg.kv_heads, cfg.head_dim)
    v = self.v(x).reshape(batch, seq, cfg.kv_heads, cfg.head_dim)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = rope(q, positions, cfg.rope_theta), rope(k, positions,
                                                    cfg.rope_theta)
    k_positions = positions
    if cache_index is not None:  # decoding: write into the cache, read it
      start = (0, cache_index, 0, 0)
      self.cache_k[...] = jax.lax.dynamic_update_slice(
          self.cache_k[...], k, start)
      self.cache_v[...] = jax.lax.dynamic_update_slice(
          self.cache_v[...], v, start)
      k, v = self.cache_k[...], self.cache_v[...]
      length = k.shape[1]
      k_positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    groups = cfg.heads // cfg.kv_heads
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(
        jnp.float32(cfg.head_dim)).astype(q.dtype)
    mask = attention_mask(positions, k_positions, cfg.sliding_window)
    if cache_index is not None:  # slots not written yet
      mask = mask & (k_positions[:, None, :] <= positions[:, -1:, None])
    scores = jnp.where(mask[:, None], scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(
        v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return self.o(out.reshape(batch, seq, cfg.heads * cfg.head_dim))


class MLP(nnx.Module):

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.gate = nnx.Linear(cfg.width, cfg.hidden, use_bias=False,
                           kernel_init=_kernel_init("fsdp", "tensor"),
                           rngs=rngs)
    self.up = nnx.Linear(cfg.width, cfg.hidden, use_bias=False,
                         kernel_init=_kernel_init("fsdp", "tensor"), rngs=rngs)
    self.down = nnx.Linear(cfg.hidden, cfg.width, use_bias=False,
                           kernel_init=_kernel_init("tensor", "fsdp"),
                           rngs=rngs)

  def __call__(self, x):
    return self.down(nnx.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.width)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.width)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, positions, cache_index=None):
    x = x + self.attn(self.attn_norm(x), positions, cache_index)
    return x + self.mlp(self.mlp_norm(x))


class LLM(nnx.Module):

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(
        cfg.vocab, cfg.width, rngs=rngs,
        embedding_init=nnx.with_partitioning(
            nnx.initializers.normal(0.02), ("tensor", "fsdp")))
    self.blocks = nnx.List([Block(cfg, rngs=rngs)
                            for _ in range(cfg.layers)])
    self.norm = RMSNorm(cfg.width)
    if not cfg.tie_embeddings:
      self.head = nnx.Linear(cfg.width, cfg.vocab, use_bias=False,
                             kernel_init=_kernel_init("fsdp", "tensor"),
                             rngs=rngs)

  def __call__(self, tokens, positions=None, cache_index=None,
               skip_lm_head: bool = False):
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, positions, cache_index)
    x = self.norm(x)
    if skip_lm_head:
      return x
    return self.lm_head(x)

  def lm_head(self, x):
    if self.cfg.tie_embeddings:
      return self.embed.attend(x)
    return self.head(x)

  def init_cache(self, batch: int, length: int, dtype=jnp.float32):
    for block in self.blocks:
      block.attn.init_cache(batch, length, dtype)


def loss_fn(model: LLM, tokens):
  """Next-token cross-entropy, the logits computed in the model."""
  logits = model(tokens[:, :-1]).astype(jnp.float32)
  labels = tokens[:, 1:]
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def batches(cfg: Config, batch: int = 4, length: int = 17, seed: int = 0):
  """Token sequences with structure to learn: each token is the previous
  plus one, modulo the vocabulary, from a random start."""
  key = jax.random.key(seed)
  while True:
    key, sub = jax.random.split(key)
    start = jax.random.randint(sub, (batch, 1), 0, cfg.vocab)
    yield (start + jnp.arange(length)) % cfg.vocab
