"""Adam with 8-bit moments as optax transformations, for optax chains and
:func:`jmp_lab.mixed_precision` (the face :mod:`jmp_lab.optimizer` has the
docs)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from jmp_lab.kernels import quantized


class QuantizedAdamState(NamedTuple):
  """State of :func:`scale_by_quantized_adam`: ``mu`` and ``nu`` are trees
  like the params of :class:`~jmp_lab.state.QuantizedMoment` (fp32 arrays
  where a leaf is too small to quantize)."""

  count: jax.Array
  mu: Any
  nu: Any


def _kind(dtype: Any, name: str) -> str:
  kind = quantized.kind_of(dtype)
  if kind is None:
    raise ValueError(f"{name} must be 'int8' or 'float8_e4m3fn' (8-bit "
                     f"block-quantized; for float32 or bfloat16 use "
                     f"optax.adam's mu_dtype), got {dtype!r}")
  return kind


def scale_by_quantized_adam(b1: float = 0.9, b2: float = 0.999,
                            eps: float = 1e-8, eps_root: float = 0.0, *,
                            mu_dtype: Any = "int8", nu_dtype: Any = "int8"
                            ) -> optax.GradientTransformation:
  """``optax.scale_by_adam`` with its moments stored in 8 bits.

  Each moment leaf is block-quantized (:mod:`jmp_lab.kernels.quantized`:
  int8 codes or fp8 e4m3, an fp32 scale per block of up to 256 elements
  along the last axis; leaves under 4,096 elements keep fp32). The moments
  are dequantized, updated in fp32 and quantized again inside the update, so
  XLA fuses the round trip into the step. Same arithmetic as optax's
  otherwise, so it drops into any chain, and into
  :func:`jmp_lab.mixed_precision`, which then skips overflowed steps with the
  codes untouched.

  Example::

    >>> import jax.numpy as jnp, optax, jmp_lab
    >>> tx = jmp_lab.mixed_precision(
    ...     jmp_lab.optimizer.quantized_adamw(1e-3), policy="p=bf16,c=bf16,o=f32")
    >>> state = tx.init({"w": jnp.ones((64, 256), jnp.bfloat16)})
    >>> mu = state.inner_state[0].mu["w"]
    >>> mu.codes.dtype, mu.scales.shape
    (dtype('int8'), (64, 1))

  Raises:
    ValueError: for a ``mu_dtype`` or ``nu_dtype`` other than ``"int8"`` or
      ``"float8_e4m3fn"``.
  """
  mu_kind, nu_kind = _kind(mu_dtype, "mu_dtype"), _kind(nu_dtype, "nu_dtype")

  def zero(p, kind, second):
    if not quantized.quantizable(jnp.shape(p)):
      return jnp.zeros_like(p, jnp.float32)
    return quantized.zeros(jnp.shape(p), kind, second, like=p)

  def init(params):
    return QuantizedAdamState(
        count=jnp.zeros((), jnp.int32),
        mu=jax.tree_util.tree_map(lambda p: zero(p, mu_kind, False), params),
        nu=jax.tree_util.tree_map(lambda p: zero(p, nu_kind, True), params))

  def update(updates, state, params=None):
    del params
    count = optax.safe_int32_increment(state.count)
    correction1 = 1 - jnp.asarray(b1, jnp.float32) ** count
    correction2 = 1 - jnp.asarray(b2, jnp.float32) ** count

    def leaf(g, mu, nu):
      if g is None:
        return None, mu, nu
      shaped = _as_blocks(mu)
      g32 = shaped(g.astype(jnp.float32))
      mu32 = b1 * _loaded(mu, mu_kind, False) + (1 - b1) * g32
      nu32 = b2 * _loaded(nu, nu_kind, True) + (1 - b2) * (g32 * g32)
      step = (mu32 / correction1) / (
          jnp.sqrt(nu32 / correction2 + eps_root) + eps)
      return (step.reshape(jnp.shape(g)).astype(g.dtype),
              _stored(mu32, mu, mu_kind, False),
              _stored(nu32, nu, nu_kind, True))

    is_moment = lambda x: x is None or quantized.is_quantized(x)  # noqa: E731
    out = jax.tree_util.tree_map(leaf, updates, state.mu, state.nu,
                                 is_leaf=is_moment)
    treedef = jax.tree_util.tree_structure(updates, is_leaf=is_moment)
    triples = treedef.flatten_up_to(out)
    new_updates, mu, nu = (treedef.unflatten([t[k] for t in triples])
                           for k in range(3))
    return new_updates, QuantizedAdamState(count=count, mu=mu, nu=nu)

  return optax.GradientTransformation(init, update)


def _as_blocks(moment):
  if quantized.is_quantized(moment):
    return lambda x: quantized.blocked(x, moment.block)
  return lambda x: x


def _loaded(moment, kind, second):
  if quantized.is_quantized(moment):
    return quantized.load(moment, kind, second)
  return moment


def _stored(value, like, kind, second):
  if quantized.is_quantized(like):
    return quantized.store(value, kind, second)
  return value.reshape(like.shape)


def quantized_adamw(learning_rate: Union[float, Callable], b1: float = 0.9,
                    b2: float = 0.999, eps: float = 1e-8,
                    eps_root: float = 0.0, weight_decay: float = 1e-4,
                    mask: Optional[Any] = None, *, mu_dtype: Any = "int8",
                    nu_dtype: Any = "int8") -> optax.GradientTransformation:
  """``optax.adamw`` with 8-bit moments: :func:`scale_by_quantized_adam`,
  then optax's own ``add_decayed_weights`` and learning-rate scaling (the
  same chain ``optax.adamw`` builds, so results differ from it only by the
  moments' quantization)."""
  return optax.chain(
      scale_by_quantized_adam(b1, b2, eps, eps_root, mu_dtype=mu_dtype,
                              nu_dtype=nu_dtype),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate))
