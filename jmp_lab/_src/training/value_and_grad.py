"""Differentiating a scaled loss: ``scaled_value_and_grad``, and the loss
rules a train step runs its loss under."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence, Union

import jax
import jax.numpy as jnp

from jmp_lab.kernels import pytrees
from jmp_lab._src.precision import interpreter, scopes
from jmp_lab._src.precision.interpreter import apply_rules
from jmp_lab._src.precision.rules import make_rules
from jmp_lab._src.precision.scopes import HALF_DTYPES
from jmp_lab._src.precision_warnings import warn_if_half_loss
from jmp_lab._src.loss_scale import LossScale, check_loss_scale
from jmp_lab._src.optim import scaled
from jmp_lab._src.policy import Policy, get_policy


def scaled_value_and_grad(
    fun: Callable[..., Any],
    loss_scale: LossScale,
    *,
    has_aux: bool = False,
    argnums: Union[int, Sequence[int]] = 0,
    value_and_grad: Callable[..., Callable] = jax.value_and_grad,
    policy: Union[Policy, str, None] = None,
) -> Callable[..., tuple[Any, Any]]:
  """Like ``jax.value_and_grad``, but differentiates ``loss * scale``.

  Args:
    fun: returns a scalar floating loss, or ``(loss, aux)`` with ``has_aux``.
    loss_scale: the :class:`~jmp_lab.LossScale` to scale the loss by.
    has_aux: whether ``fun`` returns ``(loss, aux)``.
    argnums: which positional arguments to differentiate.
    value_and_grad: the transformation that differentiates (called with
      ``has_aux``, and ``argnums`` where it takes one): ``jax.value_and_grad``,
      ``flax.nnx.value_and_grad`` for NNX modules (``argnums`` may then be an
      ``nnx.DiffState``), or ``equinox.filter_value_and_grad`` for Equinox
      models (it differentiates the first argument's arrays; ``argnums``
      must stay 0).
    policy: with a half compute dtype, ``fun`` runs under the policy's loss
      rules (:func:`jmp_lab.precision.island`): its matmuls (a head applied
      outside the model, :func:`jmp_lab.losses.linear_cross_entropy`) in the
      compute dtype, its own arithmetic as written (fp32), and a model
      under ``with_policy`` inside by its own rules. With a reduce dtype,
      a weight gradient ``fun`` computes itself (``linear_cross_entropy``'s
      table) is returned in it. None: ``fun`` as written.

  Returns:
    A function returning ``(loss, grads)`` (``((loss, aux), grads)`` with
    ``has_aux``): ``loss`` is the *unscaled* fp32 loss and ``grads`` are the
    gradients of the scaled loss, in the dtypes of the differentiated
    arguments, marked as :class:`~jmp_lab.ScaledGradients` (a tuple of
    them where ``argnums`` is a sequence). Hand them as they are to a
    :func:`~jmp_lab.mixed_precision` or :func:`~jmp_lab.fused_adamw`
    optimizer (``tx.update``, Flax's ``apply_gradients``,
    ``nnx.Optimizer.update``), which divides them by the loss scale;
    ``grads.grads`` is the plain (scaled) tree.

  Example::

    >>> import jax.numpy as jnp, jmp_lab
    >>> loss_fn = lambda w, x: jnp.sum((w * x).astype(jnp.float32))
    >>> scale = jmp_lab.StaticLossScale(1024.0)
    >>> loss, grads = jmp_lab.scaled_value_and_grad(loss_fn, scale)(
    ...     jnp.ones(2, jnp.float16), jnp.full(2, 3.0, jnp.float16))
    >>> float(loss), grads.grads.dtype, float(grads.grads[0])
    (6.0, dtype('float16'), 3072.0)
  """
  check_loss_scale(loss_scale)
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {type(fun).__name__} {fun!r}")

  under_policy = fun if policy is None else under_loss_rules(fun, policy)

  def scaled_fun(*args, **kwargs):
    out = under_policy(*args, **kwargs)
    loss, aux = out if has_aux else (out, None)
    if jnp.ndim(loss) != 0 or not pytrees.is_floating_value(loss):
      raise TypeError(
          f"the loss must be a floating scalar, got "
          f"{pytrees.leaf_description(loss)}")
    # A loss computed in half (a policy with a half output) lost its digits
    # before this cast: said once, where it is traced.
    warn_if_half_loss(loss)
    # The loss is fp32 whatever the compute dtype: scaling a half-precision
    # loss would overflow long before the gradients do.
    loss = jnp.asarray(loss).astype(jnp.float32)
    return loss_scale.scale(loss), (loss, aux)

  differentiate = _transformation(value_and_grad, argnums)

  def value_and_scaled_grad(*args, **kwargs):
    (_, (loss, aux)), grads = differentiate(scaled_fun)(*args, **kwargs)
    # Marked, so that a jmp_lab optimizer divides them by the loss scale
    # (it takes plain gradients as the unscaled loss's).
    return ((loss, aux) if has_aux else loss), scaled.mark(
        grads, per_argument=isinstance(argnums, (tuple, list)))

  return value_and_scaled_grad


def _transformation(value_and_grad: Callable[..., Callable],
                    argnums: Any) -> Callable[[Callable], Callable]:
  """``fun -> value_and_grad(fun, has_aux=True[, argnums=argnums])``.

  ``jax.value_and_grad`` and ``nnx.value_and_grad`` name ``argnums``;
  Equinox's ``filter_value_and_grad`` differentiates its first argument
  and refuses ``argnums`` (a ValueError from inside it), so a transformation
  that does not name it gets none, unless one other than the first argument
  was asked for.
  """
  if not callable(value_and_grad):
    raise TypeError(f"value_and_grad must be a transformation such as "
                    f"jax.value_and_grad, got {type(value_and_grad).__name__} "
                    f"{value_and_grad!r}")
  try:
    parameters = inspect.signature(value_and_grad).parameters
  except (TypeError, ValueError):  # no signature to read: call it as jax's
    parameters = {"argnums": None}
  if "argnums" in parameters:
    return lambda fun: value_and_grad(fun, argnums=argnums, has_aux=True)
  if not (isinstance(argnums, int) and argnums == 0):
    name = getattr(value_and_grad, "__qualname__", repr(value_and_grad))
    raise TypeError(
        f"value_and_grad={getattr(value_and_grad, '__module__', '')}.{name} "
        f"takes no argnums: it differentiates the first argument, so "
        f"argnums={argnums!r} cannot be honoured; leave argnums at 0 and put "
        f"what to differentiate together in the first argument (a tuple)")
  return lambda fun: value_and_grad(fun, has_aux=True)


def under_loss_rules(fun: Callable[..., Any], policy: Union[Policy, str]
                     ) -> Callable[..., Any]:
  """``fun`` (a train step's loss) under ``policy``'s loss rules, where the
  policy computes in half, and in its reduce dtype's scope, where it has
  one (a weight gradient the loss computes itself, as
  ``linear_cross_entropy``'s table gradient, then takes that dtype); else
  ``fun``.

  The loss is an fp32 island whose matmuls run in the compute dtype
  (:func:`jmp_lab.precision.island`): a head or ``linear_cross_entropy``
  applied in the loss computes in half, the loss's own arithmetic stays as
  written (fp32), and modules under ``with_policy`` inside keep their own
  rules. NNX objects among the arguments (an NNX model) are split and
  merged around the trace, as NNX's own transforms do.
  """
  policy = get_policy(policy)
  if policy.reduce_dtype is not None:
    fun = _under_reduce_scope(fun, policy.reduce_dtype)
  if policy.compute_dtype not in HALF_DTYPES:
    return fun
  rules = make_rules(policy.compute_dtype, island=True)

  def run(*args, **kwargs):
    if interpreter.holds_nnx_objects((args, kwargs)):
      return interpreter.call_under_rules(fun, args, kwargs, rules)
    return apply_rules(fun, rules)(*args, **kwargs)

  return run


def _under_reduce_scope(fun: Callable[..., Any], dtype) -> Callable[..., Any]:
  """``fun`` traced inside :func:`~jmp_lab._src.precision.scopes.reduce_scope`:
  a weight gradient the loss computes itself (``linear_cross_entropy``'s
  kernel) is summed across devices in the reduce dtype."""
  @functools.wraps(fun)
  def scoped(*args, **kwargs):
    with scopes.reduce_scope(dtype):
      return fun(*args, **kwargs)
  return scoped
