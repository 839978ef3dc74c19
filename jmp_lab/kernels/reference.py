"""The fused AdamW update in plain jnp: the reference and the fallback.

:func:`adamw_elementwise` is the one definition of the arithmetic. Every
backend (this reference, the Pallas interpret/Triton kernel and the Mosaic GPU
kernel) calls it on the values it has loaded, so they cannot drift apart. It
follows ``optax.adamw``'s operation order, with one deliberate change: the
bias corrections are applied as multiplications by reciprocals computed once
per step. Compilers rewrite ``x / scalar`` into ``x * (1 / scalar)`` in some
code paths and not others (XLA does inside Pallas interpret mode), which made
backends disagree by an ulp; an explicit reciprocal leaves nothing to rewrite.
The fused optimizer therefore tracks ``mixed_precision(optax.adamw(...))`` to
about one fp32 ulp of the bias-corrected moments per step.

Scalars travel as two small arrays, because a kernel takes arrays:

* ``hyper`` (f32[5]): learning rate, the reciprocals of Adam's two bias
  corrections, loss scale, and the gradient-clipping factor (1 if none);
* ``flags`` (i32[2], or i32[3] for stochastic rounding): 1 if every gradient
  is finite (else 0), the index of the first element that is *not*
  weight-decayed (flat layout; 0 in the tree layout), and the step's
  rounding seed (a uint32 bit pattern, :func:`jmp_lab.rounding.step_seed`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lab.kernels import quantized
from jmp_lab.kernels import remainder as remainder_lib
from jmp_lab.kernels.remainder import reachable_half
from jmp_lab.kernels import rounding
from jmp_lab.kernels import stats

LR, INV_BIAS1, INV_BIAS2, SCALE, CLIP = range(5)
NUM_HYPER = 5
FINITE, DECAY_BOUNDARY, SEED = range(3)


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
  """The static part of the update (baked into the kernel).

  ``half_dtype`` is the params' dtype when a separate fp32 master is kept
  (the kernel then also writes the half copy), or None when the params are
  fp32 and *are* the master (the kernel then writes the update itself, so
  that ``p + u`` outside is the very sum the master took).
  """

  b1: float
  b2: float
  eps: float
  weight_decay: float
  half_dtype: Optional[np.dtype]
  # The master kept as bf16 params + a uint16 remainder (tree layout only):
  # the kernel joins them, updates, and splits again (jmp_lab.remainder).
  remainder: bool = False
  # No master (master="none", tree layout only): the half params are updated
  # in place, the new fp32 values rounded to half_dtype: to nearest, or
  # stochastically (bf16) with jmp_lab.rounding.counter_bits.
  direct: bool = False
  stochastic: bool = False
  # 8-bit moments (jmp_lab.kernels.quantized): "int8", "float8_e4m3fn" or
  # None. Leaves whose moment is a QuantizedMoment are dequantized, updated
  # and quantized again; the others' moments are plain arrays.
  mu_quant: Optional[str] = None
  nu_quant: Optional[str] = None

  def quant_kind(self, second: bool) -> Optional[str]:
    """The 8-bit kind of the second (``second``) or first moment."""
    return self.nu_quant if second else self.mu_quant


class Outputs(NamedTuple):
  master: jax.Array   # new fp32 master (new params when half_dtype is None,
                      # new half params when config.direct)
  mu: jax.Array
  nu: jax.Array
  extra: jax.Array    # the half copy, or the fp32 update when no master


def adamw_elementwise(config: AdamWConfig, g, p, mu, nu, decays,
                      lr, inv_bias1, inv_bias2, scale, clip, *,
                      sqrt=jnp.sqrt, bits=None) -> Outputs:
  """One AdamW step on loaded values (any backend's arrays).

  Args:
    config: static hyperparameters.
    g: scaled gradients (param dtype); p, mu, nu: fp32 master (the half
      params when ``config.direct``) and moments (fp32 or bf16).
    decays: bool array, whether each element is weight-decayed.
    lr, inv_bias1, inv_bias2, scale: f32 scalars
      (``inv_bias = 1 / (1 - b ** count)``); clip: the factor that clips the
      unscaled gradients to the global norm (1 when not clipping).
    sqrt: the square root the backend can lower (Mosaic GPU has only rsqrt).
    bits: uint32 random bits like ``p`` (``config.stochastic`` only).
  """
  g = (g.astype(jnp.float32) / scale) * clip
  # (Moments stay as they come: optax multiplies a bf16 mu by b1 in bf16.)
  p = p.astype(jnp.float32)
  # optax.scale_by_adam: moments, then bias correction, then the ratio.
  mu = (1 - config.b1) * g + config.b1 * mu
  nu = (1 - config.b2) * (g * g) + config.b2 * nu
  step = (mu * inv_bias1) / (sqrt(nu * inv_bias2) + config.eps)
  # optax.add_decayed_weights, then scale_by_learning_rate (flipped sign).
  if config.weight_decay:
    step = jnp.where(decays, step + config.weight_decay * p, step)
  update = step * -lr
  new_p = p + update
  if config.half_dtype is None:
    return Outputs(new_p, mu, nu, update)
  if config.direct:
    target = (rounding.stochastic_round_bf16(new_p, bits) if config.stochastic
              else new_p.astype(config.half_dtype))
    # Where apply_updates lands the params (as mixed_precision's "none").
    half = reachable_half(p.astype(config.half_dtype),
                          target.astype(jnp.float32), config.half_dtype).half
    return Outputs(half, mu, nu, half)
  # The params outside are cast(old master); optax.apply_updates will add
  # u = cast(new) - cast(old) in fp32. Where that sum cannot land on
  # cast(new), snap the master to where it does land (see jmp_lab.remainder).
  exact = reachable_half(p.astype(config.half_dtype), new_p, config.half_dtype)
  new_p, reached = exact.master, exact.half
  return Outputs(new_p, mu, nu, reached)


def inverse_bias_corrections(b1: float, b2: float, count_inc: jax.Array):
  """``1 / (1 - b ** count)``, the bias correction as optax computes it."""
  return 1 / (1 - b1**count_inc), 1 / (1 - b2**count_inc)


def element_indices(shape: tuple[int, int], row_offset) -> jax.Array:
  """Flat indices of a ``(rows, lanes)`` block that starts at ``row_offset``."""
  rows = jax.lax.broadcasted_iota(jnp.int32, shape, 0) + row_offset
  lanes = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  return rows * shape[1] + lanes


def fused_update(config: AdamWConfig, g, p, mu, nu, hyper, flags) -> Outputs:
  """The whole update on flat ``(rows, lanes)`` buffers, in jnp.

  On a non-finite step every output equals its input (the "extra" output is
  the old half copy, or a zero update).
  """
  decays = element_indices(p.shape, 0) < flags[DECAY_BOUNDARY]
  # 8-bit moments: a block a row, so the rows' (rows, 1, 256) view.
  rows = (lambda x: x) if not (quantized.is_quantized(mu) or  # noqa: E731
                               quantized.is_quantized(nu)) else (
      lambda x: x.reshape(x.shape[0], 1, -1))
  out = adamw_elementwise(config, rows(g), rows(p),
                          _moment_in(config, mu, False, rows),
                          _moment_in(config, nu, True, rows), rows(decays),
                          hyper[LR], hyper[INV_BIAS1], hyper[INV_BIAS2],
                          hyper[SCALE], hyper[CLIP])
  back = lambda x: x.reshape(p.shape)  # noqa: E731
  new_mu = _moment_out(config, out.mu, mu, False, back)
  new_nu = _moment_out(config, out.nu, nu, True, back)
  finite = flags[FINITE] == 1
  unchanged_extra = (jnp.zeros_like(p) if config.half_dtype is None
                     else p.astype(config.half_dtype))
  return Outputs(*(_kept(finite, new, old) for new, old in
                   zip((back(out.master), new_mu, new_nu, back(out.extra)),
                       (p, mu, nu, unchanged_extra))))


tree_grad_stats = stats.grad_stats


def _element_indices(shape, index_map) -> jax.Array:
  """Each element's flat index in its leaf (the leaf may be a shard)."""
  local = jnp.arange(math.prod(shape), dtype=jnp.int32)
  if index_map is not None:
    global_shape, base = index_map
    local = rounding.global_index(local, tuple(shape), global_shape, base)
  return local.reshape(shape)


def _moment_in(config: AdamWConfig, moment, second: bool, shaped):
  """A leaf's moment as the elementwise step takes it: fp32 blocks
  ``(..., blocks, block)`` for a quantized one, else as stored and
  ``shaped`` as the leaf's other operands."""
  if not quantized.is_quantized(moment):
    return shaped(moment)
  return quantized.load(moment, config.quant_kind(second), second)


def _moment_out(config: AdamWConfig, value, like, second: bool, back):
  """The new moment stored as ``like`` is: quantized from its blocks, or
  ``back`` in the leaf's shape in its dtype."""
  if not quantized.is_quantized(like):
    return back(value).astype(like.dtype)
  return quantized.store(value, config.quant_kind(second), second)


def _kept(finite, new, old):
  """``new`` where the step is finite, else ``old`` (bit for bit, also for
  a quantized moment's codes and scales)."""
  return jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new,
                                old)


def tree_update(config: AdamWConfig, decays, g, p, mu, nu, hyper, flags, *,
                write_extra: bool, remainders=None,
                index_maps=None) -> Outputs:
  """:func:`fused_update` over lists of leaves: XLA fuses it leaf by leaf.

  With ``config.remainder``, ``p`` are the bf16 params and ``remainders``
  their uint16 remainders; the outputs are then ``(new remainders, mu, nu,
  new params)``. With ``config.direct``, ``p`` are the half params and the
  outputs ``(new params, mu, nu, None)``; stochastic rounding draws
  ``counter_bits(flags[SEED], leaf number, element index)``; with
  ``index_maps`` (a ``(global shape, base)`` per leaf, when the leaves are
  shards) the index is the element's in the whole leaf
  (:func:`jmp_lab.kernels.rounding.global_index`). Moments are stored as
  they come (fp32, bf16, or a :class:`~jmp_lab.kernels.quantized.
  QuantizedMoment`) and computed in fp32.
  """
  finite = flags[FINITE] == 1
  leaves = []
  for i, (g_, p_, mu_, nu_, decay) in enumerate(zip(g, p, mu, nu, decays)):
    master = (remainder_lib.join(p_, remainders[i]) if config.remainder
              else p_)
    bits = (rounding.counter_bits(
        jax.lax.bitcast_convert_type(flags[SEED], jnp.uint32), i,
        _element_indices(p_.shape, None if index_maps is None
                         else index_maps[i]))
            if config.stochastic else None)
    # A quantized leaf runs in its blocks' shape, (..., blocks, block).
    block = mu_.block if quantized.is_quantized(mu_) else (
        nu_.block if quantized.is_quantized(nu_) else None)
    shaped = ((lambda x: x) if block is None  # noqa: E731
              else (lambda x: quantized.blocked(x, block)))
    out = adamw_elementwise(
        config, shaped(g_), shaped(master), _moment_in(config, mu_, False,
                                                       shaped),
        _moment_in(config, nu_, True, shaped), jnp.bool_(decay), hyper[LR],
        hyper[INV_BIAS1], hyper[INV_BIAS2], hyper[SCALE], hyper[CLIP],
        bits=None if bits is None else shaped(bits))
    back = lambda x: x if x is None else x.reshape(p_.shape)  # noqa: E731
    new_mu = _moment_out(config, out.mu, mu_, False, back)
    new_nu = _moment_out(config, out.nu, nu_, True, back)
    new_master, extra = back(out.master), back(out.extra)
    if config.remainder:
      new = (remainder_lib.split(new_master)[1], new_mu, new_nu, extra)
      leaves.append([_kept(finite, a, b) for a, b in
                     zip(new, (remainders[i], mu_, nu_, p_))])
      continue
    if config.direct:
      new = (new_master, new_mu, new_nu)
      leaves.append([_kept(finite, a, b) for a, b in
                     zip(new, (p_, mu_, nu_))] + [None])
      continue
    unchanged_extra = (jnp.zeros_like(p_) if config.half_dtype is None
                       else p_.astype(config.half_dtype))
    new = (new_master, new_mu, new_nu, extra)
    leaves.append([_kept(finite, a, b) for a, b in
                   zip(new, (p_, mu_, nu_, unchanged_extra))])
  master, mu, nu, extra = (list(x) for x in zip(*leaves)) if leaves else (
      [], [], [], [])
  keep_extra = (write_extra or config.remainder) and not config.direct
  return Outputs(master, mu, nu, extra if keep_extra else None)


__all__ = [
    "NUM_HYPER",
    "adamw_elementwise",
    "AdamWConfig",
    "element_indices",
    "fused_update",
    "inverse_bias_corrections",
    "Outputs",
    "tree_grad_stats",
    "tree_update",
]
