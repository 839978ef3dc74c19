"""``mixed_precision``: fp32 master weights and the loss scale around any
optax transformation (the face :mod:`jmp_lab.optimizer` has the docs)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import jax.numpy as jnp
import optax

from jmp_lab import _checks
from jmp_lab._src.optim import boxes, gate, masters, scaled
from jmp_lab._src.optim.states import MixedPrecisionState, ParamsSpec
from jmp_lab._src.optim.updates import Update
from jmp_lab._src.loss_scale import LossScale, check_loss_scale, fresh_copy
from jmp_lab._src.optim.scaled import default_loss_scale
from jmp_lab._src.policy import Policy, get_policy


def mixed_precision(
    inner: optax.GradientTransformation,
    *,
    policy: Union[Policy, str],
    loss_scale: Optional[LossScale] = None,
    axis_name: Optional[Union[str, Sequence[str]]] = None,
    master: str = "float32",
    rounding: str = "nearest",
    rounding_seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with fp32 master weights and loss scaling.

  Args:
    inner: any optax transformation (``chain``, ``clip_by_global_norm``,
      schedules, ``inject_hyperparams``, ``MultiSteps``...). It sees fp32
      master params and unscaled fp32 gradients only.
    policy: the precision policy (or its spec); params must be in its
      ``param_dtype``.
    loss_scale: the initial :class:`~jmp_lab.LossScale`. Omitted, the policy
      chooses (:func:`jmp_lab.loss_scale.default_loss_scale`): a
      ``DynamicLossScale()`` for an fp16 compute dtype, none
      (``NoOpLossScale``) for bf16 and fp32, as ``torch.amp`` does.
    axis_name: inside ``shard_map``, the mapped axis name(s) over which the
      finite check must agree (under plain ``jit`` with sharded arrays the
      check is global already).
    master: how the fp32 master is kept, for half params:

      * ``"float32"`` (default): an fp32 copy, 4 B/param;
      * ``"remainder"``: bf16 params only; the state keeps the lower 16 bits
        of the fp32 master (2 B/param) and the master is rebuilt exactly
        from params and remainder every step (:mod:`jmp_lab.remainder`):
        the trajectory is bit-identical to ``"float32"``;
      * ``"none"``: no master; the half params are updated directly, rounded
        by ``rounding``. With ``"nearest"`` an update smaller than half a
        param ulp rounds away and is lost (training can stall at small
        learning rates); ``"stochastic"`` (bf16 only) rounds up or down with
        probability by distance, so updates survive in expectation.

      ``jmp_lab.master_params(state, params)`` returns the fp32 master in the
      modes that keep one.
    rounding: ``"nearest"`` or ``"stochastic"`` (``master="none"`` only).
    rounding_seed: the seed of the stochastic-rounding key, kept in the
      state: runs are reproducible, and a skipped step draws nothing.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update(grads, state,
    params)`` takes the gradients in the param dtype: those of the *scaled*
    loss marked as :class:`~jmp_lab.ScaledGradients` (as
    :func:`~jmp_lab.scaled_value_and_grad` returns them) are divided by the
    loss scale; plain ones are taken as the unscaled loss's (divided by 1,
    with a :class:`~jmp_lab.precision.PrecisionWarning` once where the loss
    scale is not ``NoOpLossScale``: see :mod:`jmp_lab.training`).
    ``params`` is required. ``also_finite=`` takes scalar bools that must be
    True too for the step to apply (a train step's other evidence of an
    overflow, such as fp8's amaxes); other keyword arguments go to
    ``inner``.
  """
  _checks.check_transformation(inner, "mixed_precision's inner")
  policy = get_policy(policy)
  if loss_scale is None:
    loss_scale = default_loss_scale(policy)
  check_loss_scale(loss_scale)
  update = MixedPrecisionUpdate(
      optax.with_extra_args_support(inner), policy, loss_scale,
      masters.Master.of(master, rounding, rounding_seed, policy), axis_name)
  return optax.GradientTransformationExtraArgs(update.init, update)


@dataclasses.dataclass(frozen=True, eq=False)
class MixedPrecisionUpdate(Update):
  """The update of a :func:`mixed_precision` (hashed by identity):
  ``update(grads, state, params)`` gives optax's ``(updates, new state)``;
  its ``init`` is the transformation's.

  Attributes:
    inner: the wrapped transformation (with extra-args support).
    policy: the precision policy (the state keeps it too).
    loss_scale: the initial loss scale.
    master: how the fp32 master is kept (:class:`~.masters.Master`).
    axis_name: the mapped axis the finite check agrees over.
  """

  inner: optax.GradientTransformationExtraArgs
  policy: Policy
  loss_scale: LossScale
  master: masters.Master
  axis_name: Optional[Union[str, Sequence[str]]]

  def init(self, given) -> MixedPrecisionState:
    # Built from the values (Flax's nnx.Optimizer inits with the model's
    # Variables and updates with their values; linen's may be boxed), then
    # wrapped as the params are, so Flax's layout flows shard it as optax's.
    scaled.warn_if_wrapped("jmp_lab.mixed_precision", fused=False,
                           loss_scale=self.loss_scale)
    params = boxes.values_of(given)
    _checks.check_params(params, self.policy)
    # The inner transformation sees the fp32 master's trainable leaves.
    master = masters.as_f32(params) if self.master.half_params else params
    return boxes.wrapped_like_params(MixedPrecisionState(
        inner_state=self.inner.init(gate.floating_only(master, params)),
        loss_scale=fresh_copy(self.loss_scale),
        skipped_steps=jnp.zeros((), jnp.int32),
        last_step_applied=jnp.ones((), bool),
        params_spec=ParamsSpec.of(params), policy=self.policy,
        **self.master.init_tree(params)), given)

  def __call__(self, grads, state, params=None, *, also_finite=None,
               **extra_args):
    # A state built from NNX Variables, updated by hand with their values
    # (Flax's own nnx.Optimizer hands it the values): the values, and the
    # new state wrapped again. Linen's boxes are kept throughout.
    given = state
    state = boxes.variable_values(state)
    _check_call(state, params)
    updates, new_state = self._update(grads, state, params, also_finite,
                                      extra_args)
    return updates, boxes.rewrapped_state(given, new_state) if (
        given is not state) else new_state

  def _update(self, grads, state, params, also_finite, extra_args):
    # Marked gradients (of the scaled loss) are divided by the loss scale;
    # plain ones are the unscaled loss's (see scaled.received).
    grads, carried_scale = scaled.received(
        self, grads, params, state.loss_scale, self.loss_scale,
        "jmp_lab.mixed_precision's update")
    state.params_spec.check(params)
    _checks.check_params(params, self.policy)
    _checks.check_grads(grads, params)
    # 1. Unscale to fp32 and check, once, that everything is finite.
    grads32, finite = gate.unscale_and_check(grads, params, carried_scale,
                                             self.axis_name, also_finite)
    # 2. The inner transformation, on the fp32 master.
    trainable = gate.floating_only(self.master.read(state, params), params)
    inner_updates, new_inner_state = self.inner.update(
        grads32, state.inner_state, trainable, **extra_args)
    new_trainable = optax.apply_updates(trainable, inner_updates)
    # 3. Skip on device: a non-finite step leaves master and inner untouched.
    new_trainable, new_inner_state = gate.select_tree(
        finite, (new_trainable, new_inner_state),
        (trainable, state.inner_state))
    new_state = state._replace(
        master_params=None, inner_state=new_inner_state,
        loss_scale=state.loss_scale.adjust(finite),
        skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
        last_step_applied=finite)
    # 4. Updates that land the params exactly on cast(new master).
    return self.master.write(params, new_trainable, inner_updates, finite,
                             state, new_state)


def _check_call(state, params) -> None:
  if params is None:
    raise ValueError(
        "mixed_precision's update needs params: call "
        "tx.update(grads, opt_state, params)")
  if not isinstance(state, MixedPrecisionState):
    raise TypeError(
        f"mixed_precision's update needs the state its init returned, got "
        f"{type(state).__name__}")
