"""An optax wrapper that keeps fp32 master weights and the loss-scale state.

``mixed_precision(inner, policy=..., loss_scale=...)`` turns any optax
transformation into a mixed-precision one. The wrapper's state holds:

* ``master_params`` -- an fp32 copy of the params, or None when the params are
  already float32/float64 (then they *are* the master and no copy is kept);
* ``inner_state`` -- the wrapped transformation's state, which only ever sees
  fp32 master weights and unscaled fp32 gradients;
* ``loss_scale`` -- the :class:`~jmp_lab.LossScale`;
* ``skipped_steps`` -- how many steps were skipped for non-finite gradients.

One ``update`` does, on device and without a host sync:

1. unscale the (scaled, param-dtype) gradients to fp32 and check, once and
   globally, that they are finite;
2. run ``inner.update`` on the fp32 master;
3. if anything was non-finite, keep the master and the inner state exactly as
   they were (so ``count`` and LR schedules do not advance), count the skip
   and back the scale off; otherwise take the new master and maybe grow the
   scale;
4. return updates such that ``optax.apply_updates(params, updates)`` equals
   ``cast(new_master, param_dtype)`` bit for bit.

Gradient accumulation: wrap the accumulator *inside*,
``mixed_precision(optax.MultiSteps(inner, k), ...)``. Each micro-batch's
gradients are then unscaled with the scale they were computed under before
they are accumulated in fp32, so the loss scale may change freely inside an
accumulation window without mixing scales. A non-finite micro-batch is dropped
(the accumulator does not see it; the window waits for one more finite
micro-batch) and the scale backs off. ``optax.MultiSteps(mixed_precision(...))``
would accumulate *scaled* half-precision gradients across scale changes; do
not do that.

Example::

  >>> import jax, jax.numpy as jnp, optax, jmp_lab
  >>> tx = jmp_lab.mixed_precision(
  ...     optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
  ...     policy="p=bf16,c=bf16,o=f32", loss_scale=jmp_lab.DynamicLossScale())
  >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
  >>> state = tx.init(params)
  >>> grads = {"w": jnp.full(3, 2.0**15, jnp.bfloat16)}  # scaled gradients
  >>> updates, state = tx.update(grads, state, params)
  >>> params = optax.apply_updates(params, updates)
  >>> bool(jnp.all(params["w"] == jmp_lab.master_params(state)["w"].astype(jnp.bfloat16)))
  True
  >>> grads = {"w": jnp.full(3, jnp.inf, jnp.bfloat16)}  # an overflow: skipped
  >>> updates, state = tx.update(grads, state, params)
  >>> bool(state.last_step_applied), int(state.skipped_steps)
  (False, 1)
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import optax

from jmp_lab import _checks, _exact, _tree, remainder
from jmp_lab import rounding as rounding_lib
from jmp_lab.loss_scale import (LossScale, default_loss_scale, fresh_copy,
                                select_tree)
from jmp_lab.policy import Policy, get_policy
from jmp_lab.state import MixedPrecisionState


def _exact_half_updates(params: Any, new_master: Any) -> tuple[Any, Any]:
  """Updates with ``apply_updates(params, updates) == cast(new_master)``.

  Returns ``(updates, new_master)``, the master snapped where needed (see
  :mod:`jmp_lab._exact`).
  """

  def leaf(p, m):
    if not _tree.is_floating_array(p):
      return _exact.ReachableHalf(m, p, jnp.zeros_like(p))
    return _exact.reachable_half(p, m, p.dtype)

  out = jax.tree_util.tree_map(leaf, params, new_master)
  is_out = lambda x: isinstance(x, _exact.ReachableHalf)  # noqa: E731
  updates = jax.tree_util.tree_map(lambda o: o.update, out, is_leaf=is_out)
  master = jax.tree_util.tree_map(lambda o: o.master, out, is_leaf=is_out)
  return updates, master


def _direct_half_updates(params, new_trainable, finite, state, new_state,
                         rounding):
  """``master="none"``: updates that move the half params to the new fp32
  values rounded to the param dtype (to nearest, or stochastically with the
  state's key; a skipped step leaves the key as it was)."""
  leaves, treedef = jax.tree_util.tree_flatten(
      new_trainable, is_leaf=lambda x: x is None)
  if rounding == "stochastic":
    key, step_key = jax.random.split(
        jax.random.wrap_key_data(state.rounding_key))
    targets = [None if x is None else rounding_lib.stochastic_round_bf16(
        x, jax.random.bits(jax.random.fold_in(step_key, i), x.shape,
                           jnp.uint32)) for i, x in enumerate(leaves)]
    new_state = new_state._replace(rounding_key=jnp.where(
        finite, jax.random.key_data(key), state.rounding_key))
  else:
    targets = leaves
  rounded = _checks.merge_floating(treedef.unflatten(targets), params)

  def leaf(p, target):
    if not _tree.is_floating_array(p):
      return jnp.zeros_like(p)
    # The update that takes p to the rounded value (see jmp_lab._exact).
    half = target.astype(p.dtype).astype(jnp.float32)
    return _exact.reachable_half(p, half, p.dtype).update

  return jax.tree_util.tree_map(leaf, params, rounded), new_state


# --------------------------------------------------------------------------
# The transformation.
# --------------------------------------------------------------------------


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
    params)`` takes the gradients of the *scaled* loss, in the param dtype.
    ``params`` is required. Extra keyword arguments go to ``inner``.
  """
  _checks.check_transformation(inner, "mixed_precision's inner")
  policy = get_policy(policy)
  if loss_scale is None:
    loss_scale = default_loss_scale(policy)
  _checks.check_loss_scale(loss_scale)
  inner = optax.with_extra_args_support(inner)
  _checks.check_master_mode(master, rounding, policy)
  keep_master = _checks.keeps_master_copy(policy)
  to_f32 = lambda tree: jax.tree_util.tree_map(  # noqa: E731
      lambda x: x.astype(jnp.float32) if _tree.is_floating_array(x) else x,
      tree)

  def init_fn(params):
    _checks.check_params(params, policy)
    master32 = to_f32(params) if keep_master else None
    remainders = None
    if keep_master and master == "remainder":
      # The params are the master exactly: every remainder starts at zero.
      remainders = jax.tree_util.tree_map(
          lambda x: jnp.zeros(x.shape, jnp.uint16)
          if _tree.is_floating_array(x) else None, params)
    trainable = _checks.floating_only(params if master32 is None else master32,
                                      params)
    return MixedPrecisionState(
        master_params=master32 if master == "float32" else None,
        inner_state=inner.init(trainable),
        loss_scale=fresh_copy(loss_scale),
        skipped_steps=jnp.zeros((), jnp.int32),
        last_step_applied=jnp.ones((), bool),
        params_spec=_checks.ParamsSpec.of(params),
        master_remainder=remainders,
        # Raw key data (uint32), which every checkpointer can save.
        rounding_key=(jax.random.key_data(jax.random.key(rounding_seed))
                      if rounding == "stochastic" else None))

  def update_fn(grads, state, params=None, **extra_args):
    if params is None:
      raise ValueError(
          "mixed_precision's update needs params: call "
          "tx.update(grads, opt_state, params)")
    if not isinstance(state, MixedPrecisionState):
      raise TypeError(
          f"mixed_precision's update needs the state its init returned, got "
          f"{type(state).__name__}")
    _checks.check_state_matches(state.params_spec, params)
    _checks.check_params(params, policy)
    _checks.check_grads(grads, params)

    # 1. Unscale to fp32 and check, once, that everything is finite.
    grads32, finite = _checks.unscale_and_check(grads, params,
                                                state.loss_scale, axis_name)

    # 2. The inner transformation, on the fp32 master (rebuilt from the
    # remainder, or the params themselves in fp32 when none is kept).
    if master == "remainder":
      master32 = state.master_tree(params)
    elif master == "none":
      master32 = to_f32(params)
    else:
      master32 = params if state.master_params is None else state.master_params
    trainable = _checks.floating_only(master32, params)
    inner_updates, new_inner_state = inner.update(
        grads32, state.inner_state, trainable, **extra_args)
    new_trainable = optax.apply_updates(trainable, inner_updates)

    # 3. Skip on device: a non-finite step leaves master and inner untouched.
    new_trainable, new_inner_state = select_tree(
        finite, (new_trainable, new_inner_state),
        (trainable, state.inner_state))
    new_state = MixedPrecisionState(
        master_params=None,
        inner_state=new_inner_state,
        loss_scale=state.loss_scale.adjust(finite),
        skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
        last_step_applied=finite,
        params_spec=state.params_spec)

    # 4. Updates that land the params exactly on cast(new_master).
    if master == "none" and keep_master:
      return _direct_half_updates(params, new_trainable, finite, state,
                                  new_state, rounding)
    if state.master_params is None and master == "float32":
      # The params are the master, and apply_updates(p, u) is by definition
      # how the new master was computed: hand back u itself (zero if skipped).
      updates = _checks.merge_floating(
          jax.tree_util.tree_map(
              lambda u: jnp.where(finite, u, jnp.zeros_like(u)),
              inner_updates),
          jax.tree_util.tree_map(jnp.zeros_like, params))
      return updates, new_state
    updates, new_master = _exact_half_updates(
        params, _checks.merge_floating(new_trainable, params))
    if master == "remainder":
      return updates, new_state._replace(master_remainder=jax.tree_util.tree_map(
          lambda m, r: None if r is None else remainder.split(m)[1],
          new_master, state.master_remainder, is_leaf=lambda x: x is None))
    return updates, new_state._replace(master_params=new_master)

  update_fn.policy = policy  # read by TrainState.create's agreement check
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
