"""Models written the way public Flax, NNX and Equinox code is written.

jmp_lab's own examples build layers with ``dtype=None`` and let the policy
decide. Public model code does not. It passes a config's ``dtype`` (fp32
by default) to every layer. It ties its embeddings, writes its own RMSNorm
and its own attention with ``jax.nn.softmax``, scans its layers, and uses
BatchNorm with an ``axis_name``. These models follow that code:

* :class:`ResNet` -- flax's ``examples/imagenet/models.py``: ``Conv`` and
  ``BatchNorm`` partials with ``dtype`` and ``axis_name``, residual blocks,
  a ``Dense`` head with ``dtype``.
* :class:`TransformerLM` -- flax's ``examples/lm1b/models.py``: a
  ``TransformerConfig`` whose ``dtype`` every ``Embed``, ``Dense``,
  ``LayerNorm`` and ``MultiHeadDotProductAttention`` gets. It builds its
  attention without an ``attention_fn`` and computes the logits with the
  tied embedding's ``attend``. Config switches select the model's own
  :class:`RMSNorm` and :class:`SelfAttention` (its own ``jax.nn.softmax``),
  and layers scanned with ``nn.scan``.
* :class:`GriffinLM` -- a recurrent LM in the style of RecurrentGemma's
  linen Griffin: ``dtype=None`` layers that promote their inputs with fp32
  params, public helper methods that return their argument, its own
  ``RMSNorm``, a ``custom_jvp`` square root, and a ``lax.scan`` recurrence
  that asserts its inputs agree in dtype and accumulates in fp32.
* :class:`HFGPT2LM` -- GPT-2 as Hugging Face transformers'
  ``modeling_flax_gpt2.py`` writes it: every projection a ``FlaxConv1D``
  that multiplies by its own transposed kernel with ``lax.dot_general``
  (no ``nn.Dense``), flax's ``dot_product_attention_weights`` with an
  additive ``finfo.min`` bias, and the tied head as a bias-free ``Dense``
  applied with the token table's transpose (``lm_head.apply``).
* :class:`GemmaLM` -- an NNX decoder in the style of Gemma's Flax code.
  ``nnx.Embed``, ``nnx.Einsum`` and ``nnx.Linear`` all get
  ``dtype=jnp.float32`` and ``param_dtype``. The model has its own
  ``RMSNorm`` (with ``1 + scale``), its own attention with soft-capped
  logits and ``jax.nn.softmax``, gated-GELU MLPs, and tied logits through
  ``Embed.attend``.
* :class:`EqxTransformer` -- an Equinox decoder built from ``eqx.nn``
  layers (``Embedding``, ``Linear``, ``LayerNorm``, ``MultiheadAttention``).
  It is applied per example with ``jax.vmap``, as Equinox code is.

The data helpers read data already on the machine: scikit-learn's
handwritten digits, and the bytes of the Python standard library's sources.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import struct

from examples.common import stdlib_text

# ---------------------------------------------------------------------------
# Linen ResNet, as flax/examples/imagenet/models.py writes it.
# ---------------------------------------------------------------------------

ModuleDef = Any


class ResNetBlock(nn.Module):
  """ResNet block."""

  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.conv(self.filters, (3, 3), self.strides)(x)
    y = self.norm()(y)
    y = self.act(y)
    y = self.conv(self.filters, (3, 3))(y)
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters, (1, 1), self.strides,
                           name="conv_proj")(residual)
      residual = self.norm(name="norm_proj")(residual)
    return self.act(residual + y)


class ResNet(nn.Module):
  """ResNetV1.5, sized down for 8x8 digits."""

  stage_sizes: Sequence[int] = (1, 1)
  num_classes: int = 10
  num_filters: int = 16
  dtype: Any = jnp.float32
  act: Callable = nn.relu
  conv: ModuleDef = nn.Conv
  axis_name: Optional[str] = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(self.conv, use_bias=False, dtype=self.dtype)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train,
                             momentum=0.9, epsilon=1e-5, dtype=self.dtype,
                             axis_name=self.axis_name)
    x = conv(self.num_filters, (3, 3), name="conv_init")(x)
    x = norm(name="bn_init")(x)
    x = nn.relu(x)
    for i, block_size in enumerate(self.stage_sizes):
      for j in range(block_size):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = ResNetBlock(self.num_filters * 2**i, strides=strides, conv=conv,
                        norm=norm, act=self.act)(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
    x = jnp.asarray(x, self.dtype)
    return x


# ---------------------------------------------------------------------------
# Linen Transformer LM, as flax/examples/lm1b/models.py writes it.
# ---------------------------------------------------------------------------


@struct.dataclass
class TransformerConfig:
  """Global hyperparameters used to minimize obnoxious kwarg plumbing."""

  vocab_size: int = 256
  dtype: Any = jnp.float32
  emb_dim: int = 64
  num_heads: int = 4
  num_layers: int = 2
  qkv_dim: int = 64
  mlp_dim: int = 128
  max_len: int = 128
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  deterministic: bool = True
  norm: str = "layernorm"      # "rmsnorm": the model's own RMSNorm class
  attention: str = "flax"      # "custom": the model's own SelfAttention
  scan_layers: bool = False    # the blocks under nn.scan
  kernel_init: Callable = nn.initializers.xavier_uniform()
  bias_init: Callable = nn.initializers.normal(stddev=1e-6)


class RMSNorm(nn.Module):
  """The model's own RMSNorm (not Flax's class)."""

  epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones_init(), (x.shape[-1],))
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + self.epsilon) * scale


def _norm(config: TransformerConfig, name: Optional[str] = None):
  if config.norm == "rmsnorm":
    return RMSNorm(name=name)
  return nn.LayerNorm(dtype=config.dtype, name=name)


class SelfAttention(nn.Module):
  """The model's own causal self-attention, with its own softmax."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x):
    config = self.config
    head_dim = config.qkv_dim // config.num_heads
    dense = functools.partial(nn.DenseGeneral, dtype=config.dtype,
                              kernel_init=config.kernel_init, use_bias=False)
    q, k, v = (dense((config.num_heads, head_dim), name=n)(x)
               for n in ("query", "key", "value"))
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k) / jnp.sqrt(head_dim)
    length = x.shape[-2]
    mask = jnp.tril(jnp.ones((length, length), bool))
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("...hqk,...khd->...qhd", weights, v)
    return dense(x.shape[-1], axis=(-2, -1), name="out")(out)


class AddPositionEmbs(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs):
    config = self.config
    pos_embedding = self.param(
        "pos_embedding", nn.initializers.normal(stddev=0.02),
        (1, config.max_len, inputs.shape[-1]))
    return inputs + pos_embedding[:, :inputs.shape[1], :]


class MlpBlock(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs):
    config = self.config
    x = nn.Dense(config.mlp_dim, dtype=config.dtype,
                 kernel_init=config.kernel_init,
                 bias_init=config.bias_init)(inputs)
    x = nn.relu(x)
    return nn.Dense(inputs.shape[-1], dtype=config.dtype,
                    kernel_init=config.kernel_init,
                    bias_init=config.bias_init)(x)


class DecoderBlock(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs, decoder_mask=None):
    config = self.config
    x = _norm(config)(inputs)
    if config.attention == "custom":
      x = SelfAttention(config)(x)
    else:
      x = nn.MultiHeadDotProductAttention(
          num_heads=config.num_heads, dtype=config.dtype,
          qkv_features=config.qkv_dim, kernel_init=config.kernel_init,
          bias_init=config.bias_init, use_bias=False, broadcast_dropout=False,
          dropout_rate=config.attention_dropout_rate,
          deterministic=config.deterministic)(x, mask=decoder_mask)
    x = x + inputs
    z = _norm(config)(x)
    z = MlpBlock(config=config)(z)
    return x + z


class ScannedBlock(nn.Module):
  """A DecoderBlock in ``nn.scan``'s (carry, x) -> (carry, y) form."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, carry, decoder_mask):
    return DecoderBlock(self.config)(carry, decoder_mask), None


class TransformerLM(nn.Module):
  """A decoder-only LM with tied input and output embeddings."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs):
    config = self.config
    shared_embedding = nn.Embed(
        num_embeddings=config.vocab_size, features=config.emb_dim,
        embedding_init=nn.initializers.normal(stddev=1.0), dtype=config.dtype)
    y = shared_embedding(inputs.astype("int32"))
    y = AddPositionEmbs(config=config, name="posembed_output")(y)
    decoder_mask = nn.make_causal_mask(inputs, dtype=config.dtype)
    if config.scan_layers:
      blocks = nn.scan(ScannedBlock, variable_axes={"params": 0},
                       split_rngs={"params": True}, in_axes=(nn.broadcast,),
                       length=config.num_layers)
      y, _ = blocks(config, name="decoder")(y, decoder_mask)
    else:
      for lyr in range(config.num_layers):
        y = DecoderBlock(config=config, name=f"encoderdecoderblock_{lyr}")(
            y, decoder_mask)
    y = _norm(config, name="encoderdecoder_norm")(y)
    logits = shared_embedding.attend(y)
    return logits / jnp.sqrt(y.shape[-1])


# ---------------------------------------------------------------------------
# Linen, in the style of RecurrentGemma's Griffin (recurrentgemma/jax).
# ---------------------------------------------------------------------------


@struct.dataclass
class GriffinConfig:
  vocab_size: int = 256
  width: int = 64
  lru_width: int = 64
  mlp_expansion: int = 2
  conv_width: int = 4
  num_layers: int = 2
  dtype: Any = None           # as recurrentgemma's layers: None
  param_dtype: Any = jnp.float32


@jax.custom_jvp
def sqrt_bound_derivative(x, max_gradient):
  """``sqrt(x)`` whose derivative is bounded (recurrentgemma's, so that
  bf16 training does not produce NaNs near 0)."""
  return jnp.sqrt(x)


@sqrt_bound_derivative.defjvp
def _sqrt_bound_derivative_jvp(primals, tangents):
  x, max_gradient = primals
  x_tangent, _ = tangents
  clipped = 1.0 / jnp.maximum(4.0 / max_gradient ** 2, x)
  return jnp.sqrt(x), 0.5 * jnp.sqrt(clipped) * x_tangent


def linear_scan(x, a, h0=None, acc_dtype=jnp.float32):
  """``h_t = a_t * h_{t-1} + x_t`` along axis 1, accumulated in
  ``acc_dtype``; recurrentgemma's ``scan.linear_scan`` checks its inputs
  the same way."""
  assert x.ndim == 3
  assert a.shape == x.shape[-a.ndim:]
  assert a.dtype == x.dtype
  assert type(a) is type(x)
  if h0 is None:
    h0 = jnp.zeros((x.shape[0], x.shape[2]), dtype=acc_dtype)

  def step(h, inputs):
    x_t, a_t = inputs
    h = a_t.astype(acc_dtype) * h + x_t.astype(acc_dtype)
    return h, h.astype(x.dtype)

  last, ys = jax.lax.scan(step, h0, (jnp.swapaxes(x, 0, 1),
                                      jnp.swapaxes(a, 0, 1)))
  return jnp.swapaxes(ys, 0, 1), last


class Conv1D(nn.Module):
  """A causal depthwise temporal convolution, params promoted with the
  input (``nn.dtypes.promote_dtype``)."""

  width: int
  temporal_width: int
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.variance_scaling(
        0.01, "fan_in", "normal"), (self.temporal_width, self.width),
                   self.param_dtype)
    b = self.param("b", nn.initializers.zeros_init(), (self.width,),
                   self.param_dtype)
    x, w, b = nn.dtypes.promote_dtype(x, w, b, dtype=self.dtype)
    out = x * w[-1]
    for shift in range(1, self.temporal_width):
      shifted = jnp.pad(x[:, :-shift], ((0, 0), (shift, 0), (0, 0)))
      out = out + shifted * w[-1 - shift]
    return out + b


class RGLRU(nn.Module):
  """The Real-Gated Linear Recurrent Unit, as recurrentgemma writes it:
  public helper methods that convert to and from its state's layout
  (identities for real values), the input promoted with an fp32 param, and
  the recurrence through :func:`linear_scan`, which asserts that its inputs
  agree in dtype."""

  width: int
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def setup(self):
    self.a_real_param = self.param(
        "a_param", nn.initializers.uniform(scale=1.0), (self.width,),
        self.param_dtype)
    dense = functools.partial(nn.Dense, self.width, dtype=self.dtype,
                              param_dtype=self.param_dtype)
    self.input_gate = dense(name="input_gate")
    self.a_gate = dense(name="a_gate")

  def merged_to_complex(self, x):
    return x      # real-valued: the layout is already the state's

  def complex_to_merged(self, x):
    return x

  def __call__(self, x, segment_pos):
    x, a_real_param = nn.dtypes.promote_dtype(x, self.a_real_param,
                                              dtype=self.dtype)
    gate_x = jax.nn.sigmoid(self.input_gate(x))
    gate_a = jax.nn.sigmoid(self.a_gate(x))
    log_a = -8.0 * gate_a * jax.nn.softplus(a_real_param)
    a, a_squared = jnp.exp(log_a), jnp.exp(2 * log_a)
    x = self.merged_to_complex(x)
    gated_x = x * gate_x
    reset = (segment_pos == 0).astype(a.dtype)
    multiplier = sqrt_bound_derivative(1 - a_squared, 1000)
    multiplier = reset[..., None] + (1 - reset)[..., None] * multiplier
    normalized_x = gated_x * multiplier.astype(x.dtype)
    y, _ = linear_scan(normalized_x, a * (1 - reset[..., None]))
    return self.complex_to_merged(y)


class RecurrentBlock(nn.Module):
  config: GriffinConfig

  @nn.compact
  def __call__(self, x, segment_pos):
    config = self.config
    dense = functools.partial(nn.Dense, dtype=config.dtype,
                              param_dtype=config.param_dtype)
    y = jax.nn.gelu(dense(config.lru_width, name="linear_y")(x))
    x = dense(config.lru_width, name="linear_x")(x)
    x = Conv1D(config.lru_width, config.conv_width, dtype=config.dtype,
               param_dtype=config.param_dtype, name="conv_1d")(x)
    x = RGLRU(config.lru_width, dtype=config.dtype,
              param_dtype=config.param_dtype, name="rg_lru")(x, segment_pos)
    return dense(config.width, name="linear_out")(x * y)


class GriffinRMSNorm(nn.Module):
  """recurrentgemma's RMSNorm: its own class, scale applied as
  ``1 + scale``, params promoted with the input."""

  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],),
                       self.param_dtype)
    x, scale = nn.dtypes.promote_dtype(x, scale, dtype=self.dtype)
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + 1e-6) * (1 + scale)


class GriffinBlock(nn.Module):
  config: GriffinConfig

  @nn.compact
  def __call__(self, x, segment_pos):
    config = self.config
    raw = x
    x = GriffinRMSNorm(config.dtype, config.param_dtype)(x)
    x = RecurrentBlock(config, name="recurrent")(x, segment_pos)
    residual = x + raw
    x = GriffinRMSNorm(config.dtype, config.param_dtype)(residual)
    hidden = config.width * config.mlp_expansion
    dense = functools.partial(nn.Dense, dtype=config.dtype,
                              param_dtype=config.param_dtype)
    gate = jax.nn.gelu(dense(hidden, name="ffw_gate")(x))
    x = dense(config.width, name="ffw_out")(gate * dense(hidden,
                                                         name="ffw_up")(x))
    return x + residual


class GriffinLM(nn.Module):
  """A Griffin-style recurrent LM (recurrent blocks only) with tied logits:
  ``embedder.encode`` and ``embedder.decode`` are public helpers, as in
  recurrentgemma."""

  config: GriffinConfig = GriffinConfig()

  @nn.compact
  def __call__(self, tokens):
    config = self.config
    embedder = nn.Embed(config.vocab_size, config.width, dtype=config.dtype,
                        param_dtype=config.param_dtype, name="embedder")
    x = embedder(tokens) * jnp.sqrt(config.width).astype(
        jnp.float32 if config.dtype is None else config.dtype)
    segment_pos = jnp.broadcast_to(jnp.arange(tokens.shape[-1]),
                                   tokens.shape)
    for i in range(config.num_layers):
      x = GriffinBlock(config, name=f"block_{i}")(x, segment_pos)
    x = GriffinRMSNorm(config.dtype, config.param_dtype, name="final_norm")(x)
    return embedder.attend(x)


# ---------------------------------------------------------------------------
# NNX, in the style of Gemma's Flax code.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
  vocab_size: int = 256
  embed_dim: int = 64
  hidden_dim: int = 128
  num_heads: int = 4
  head_dim: int = 16
  num_layers: int = 2
  attn_logits_soft_cap: Optional[float] = 50.0
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32


class GemmaRMSNorm(nnx.Module):
  """Gemma's RMSNorm: its own class, scale applied as ``1 + scale``."""

  def __init__(self, dim: int, *, param_dtype=jnp.float32):
    self.scale = nnx.Param(jnp.zeros((dim,), param_dtype))

  def __call__(self, x):
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    normed_inputs = x * jax.lax.rsqrt(var + 1e-06)
    return normed_inputs * (1 + self.scale[...])


class GemmaAttention(nnx.Module):
  """Causal attention with soft-capped logits and its own softmax."""

  def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs):
    self.config = config
    kw = dict(dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
    self.qkv_einsum = nnx.Einsum(
        "BTD,SNDH->SBTNH", (3, config.num_heads, config.embed_dim,
                            config.head_dim), **kw)
    self.attn_vec_einsum = nnx.Einsum(
        "BTNH,NHD->BTD", (config.num_heads, config.head_dim,
                          config.embed_dim), **kw)

  def __call__(self, x):
    config = self.config
    query, key, value = self.qkv_einsum(x)
    query = query * config.head_dim**-0.5
    logits = jnp.einsum("BTNH,BSNH->BTNS", query, key)
    if config.attn_logits_soft_cap is not None:
      logits = jnp.tanh(logits / config.attn_logits_soft_cap)
      logits = logits * config.attn_logits_soft_cap
    length = x.shape[1]
    mask = jnp.tril(jnp.ones((length, length), bool))[None, :, None, :]
    logits = jnp.where(mask, logits, -2.3819763e38)
    probs = jax.nn.softmax(logits, axis=-1).astype(key.dtype)
    encoded = jnp.einsum("BTNS,BSNH->BTNH", probs, value)
    return self.attn_vec_einsum(encoded)


class GemmaMLP(nnx.Module):
  def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs):
    kw = dict(use_bias=False, dtype=config.dtype,
              param_dtype=config.param_dtype, rngs=rngs)
    self.gate = nnx.Linear(config.embed_dim, config.hidden_dim, **kw)
    self.up = nnx.Linear(config.embed_dim, config.hidden_dim, **kw)
    self.down = nnx.Linear(config.hidden_dim, config.embed_dim, **kw)

  def __call__(self, x):
    return self.down(nnx.gelu(self.gate(x)) * self.up(x))


class GemmaBlock(nnx.Module):
  def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs):
    self.pre_attention_norm = GemmaRMSNorm(config.embed_dim,
                                           param_dtype=config.param_dtype)
    self.attn = GemmaAttention(config, rngs=rngs)
    self.pre_ffw_norm = GemmaRMSNorm(config.embed_dim,
                                     param_dtype=config.param_dtype)
    self.mlp = GemmaMLP(config, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.pre_attention_norm(x))
    return x + self.mlp(self.pre_ffw_norm(x))


class GemmaLM(nnx.Module):
  """A decoder with tied embeddings: the logits are ``embedder.attend``."""

  def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embedder = nnx.Embed(config.vocab_size, config.embed_dim,
                              dtype=config.dtype,
                              param_dtype=config.param_dtype, rngs=rngs)
    self.layers = nnx.List([GemmaBlock(config, rngs=rngs)
                            for _ in range(config.num_layers)])
    self.final_norm = GemmaRMSNorm(config.embed_dim,
                                   param_dtype=config.param_dtype)

  def __call__(self, tokens):
    x = self.embedder(tokens) * jnp.sqrt(self.config.embed_dim)
    for layer in self.layers:
      x = layer(x)
    return self.embedder.attend(self.final_norm(x))


# ---------------------------------------------------------------------------
# Equinox, applied per example with jax.vmap.
# ---------------------------------------------------------------------------


class EqxBlock(eqx.Module):
  norm1: eqx.nn.LayerNorm
  attention: eqx.nn.MultiheadAttention
  norm2: eqx.nn.LayerNorm
  mlp_in: eqx.nn.Linear
  mlp_out: eqx.nn.Linear

  def __init__(self, dim: int, heads: int, hidden: int, *, key):
    k1, k2, k3 = jax.random.split(key, 3)
    self.norm1 = eqx.nn.LayerNorm(dim)
    self.attention = eqx.nn.MultiheadAttention(heads, dim, key=k1)
    self.norm2 = eqx.nn.LayerNorm(dim)
    self.mlp_in = eqx.nn.Linear(dim, hidden, key=k2)
    self.mlp_out = eqx.nn.Linear(hidden, dim, key=k3)

  def __call__(self, x, mask):
    h = jax.vmap(self.norm1)(x)
    x = x + self.attention(h, h, h, mask=mask)
    h = jax.vmap(self.norm2)(x)
    return x + jax.vmap(self.mlp_out)(jax.nn.gelu(jax.vmap(self.mlp_in)(h)))


class EqxTransformer(eqx.Module):
  """A decoder-only byte LM from eqx.nn layers; ``model(tokens)`` takes one
  ``(T,)`` sequence (``jax.vmap`` it over a batch)."""

  embedding: eqx.nn.Embedding
  positions: jax.Array
  blocks: list
  norm: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4,
               hidden: int = 128, layers: int = 2, max_len: int = 128, *,
               key):
    keys = jax.random.split(key, layers + 3)
    self.embedding = eqx.nn.Embedding(vocab, dim, key=keys[0])
    self.positions = 0.02 * jax.random.normal(keys[1], (max_len, dim))
    self.blocks = [EqxBlock(dim, heads, hidden, key=k) for k in keys[3:]]
    self.norm = eqx.nn.LayerNorm(dim)
    self.head = eqx.nn.Linear(dim, vocab, key=keys[2])

  def __call__(self, tokens):
    length = tokens.shape[0]
    x = jax.vmap(self.embedding)(tokens) + self.positions[:length]
    mask = jnp.tril(jnp.ones((length, length), bool))
    for block in self.blocks:
      x = block(x, mask)
    return jax.vmap(self.head)(jax.vmap(self.norm)(x))


# ---------------------------------------------------------------------------
# GPT-2 as Hugging Face transformers' modeling_flax_gpt2.py writes it.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  vocab_size: int = 256
  n_positions: int = 64
  n_embd: int = 64
  n_layer: int = 2
  n_head: int = 4
  layer_norm_epsilon: float = 1e-5
  dtype: Any = jnp.float32


class HFConv1D(nn.Module):
  """``FlaxConv1D``: every projection of transformers' Flax GPT-2. Its own
  kernel, stored ``(features, inputs)``, multiplied by its transpose with
  ``lax.dot_general`` in the config's dtype: no ``nn.Dense``."""

  features: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, inputs):
    inputs = jnp.asarray(inputs, self.dtype)
    kernel = self.param("kernel", nn.initializers.normal(stddev=0.02),
                        (self.features, inputs.shape[-1]))
    kernel = jnp.asarray(kernel.transpose(), self.dtype)
    y = jax.lax.dot_general(inputs, kernel,
                            (((inputs.ndim - 1,), (0,)), ((), ())))
    bias = self.param("bias", nn.initializers.zeros, (self.features,))
    return y + jnp.asarray(bias, self.dtype)


class HFGPT2Attention(nn.Module):
  """``FlaxGPT2Attention``: one ``c_attn`` projection split three ways, a
  causal mask made once in ``setup``, an additive bias of ``finfo.min``,
  flax's ``dot_product_attention_weights`` and its own ``einsum``."""

  config: GPT2Config

  def setup(self):
    config = self.config
    self.head_dim = config.n_embd // config.n_head
    self.c_attn = HFConv1D(3 * config.n_embd, dtype=config.dtype)
    self.c_proj = HFConv1D(config.n_embd, dtype=config.dtype)
    self.causal_mask = nn.make_causal_mask(
        jnp.ones((1, config.n_positions), dtype="bool"), dtype="bool")

  def _split_heads(self, x):
    return x.reshape(x.shape[:2] + (self.config.n_head, self.head_dim))

  def __call__(self, hidden_states):
    dtype = self.config.dtype
    query, key, value = jnp.split(self.c_attn(hidden_states), 3, axis=2)
    query, key, value = map(self._split_heads, (query, key, value))
    length = query.shape[1]
    mask = jnp.broadcast_to(self.causal_mask[:, :, :length, :length],
                            (query.shape[0], 1, length, length))
    bias = jax.lax.select(mask > 0, jnp.full(mask.shape, 0.0).astype(dtype),
                          jnp.full(mask.shape, jnp.finfo(dtype).min
                                   ).astype(dtype))
    weights = nn.attention.dot_product_attention_weights(
        query, key, bias=bias, deterministic=True, dtype=dtype)
    out = jnp.einsum("...hqk,...khd->...qhd", weights, value)
    return self.c_proj(out.reshape(out.shape[:2] + (self.config.n_embd,)))


class HFGPT2Block(nn.Module):
  """``FlaxGPT2Block``: pre-norm attention and an MLP of two ``Conv1D`` with
  ``gelu_new`` (the tanh approximation)."""

  config: GPT2Config

  @nn.compact
  def __call__(self, x):
    config = self.config
    norm = functools.partial(nn.LayerNorm, epsilon=config.layer_norm_epsilon,
                             dtype=config.dtype)
    x = x + HFGPT2Attention(config, name="attn")(norm(name="ln_1")(x))
    h = norm(name="ln_2")(x)
    h = HFConv1D(4 * config.n_embd, dtype=config.dtype, name="c_fc")(h)
    h = jax.nn.gelu(h, approximate=True)
    return x + HFConv1D(config.n_embd, dtype=config.dtype, name="c_proj")(h)


class HFGPT2LM(nn.Module):
  """``FlaxGPT2LMHeadModule``: token and position ``nn.Embed`` tables,
  blocks named by their index, a final LayerNorm, and the tied head as
  transformers writes it: a bias-free ``nn.Dense`` applied with the token
  table's transpose as its kernel (``lm_head.apply``)."""

  config: GPT2Config

  def setup(self):
    config = self.config
    embed = functools.partial(
        nn.Embed, features=config.n_embd, dtype=config.dtype,
        embedding_init=nn.initializers.normal(stddev=0.02))
    self.wte = embed(config.vocab_size)
    self.wpe = embed(config.n_positions)
    self.blocks = [HFGPT2Block(config, name=str(i))
                   for i in range(config.n_layer)]
    self.ln_f = nn.LayerNorm(epsilon=config.layer_norm_epsilon,
                             dtype=config.dtype)
    self.lm_head = nn.Dense(config.vocab_size, use_bias=False,
                            dtype=config.dtype)

  def __call__(self, input_ids):
    positions = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]),
                                 input_ids.shape)
    x = self.wte(input_ids.astype("i4")) + self.wpe(positions.astype("i4"))
    for block in self.blocks:
      x = block(x)
    x = self.ln_f(x)
    shared_kernel = self.wte.variables["params"]["embedding"].T
    return self.lm_head.apply({"params": {"kernel": shared_kernel}}, x)


# ---------------------------------------------------------------------------
# Data already on the machine.
# ---------------------------------------------------------------------------


def digits(split: str = "train", seed: int = 0):
  """scikit-learn's 8x8 handwritten digits as (N, 8, 8, 1) fp32 in [0, 1]
  and int32 labels; a fixed 80/20 split."""
  from sklearn.datasets import load_digits  # the examples extra ships it
  data = load_digits()
  images = (data.images / 16.0).astype(np.float32)[..., None]
  labels = data.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(labels))
  cut = int(0.8 * len(labels))
  chosen = order[:cut] if split == "train" else order[cut:]
  return images[chosen], labels[chosen]


def stdlib_bytes(limit: int = 1 << 20) -> np.ndarray:
  """The char-transformer example's default text (the standard library's
  sources), its first ``limit`` bytes as uint8."""
  return np.frombuffer(stdlib_text(limit), dtype=np.uint8)


def text_batches(data: np.ndarray, batch: int, length: int, seed: int = 0):
  """Endless random (batch, length + 1) windows of ``data`` as int32."""
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - length - 1, size=batch)
    yield np.stack([data[s:s + length + 1] for s in starts]).astype(np.int32)
