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
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lab import _tree
from jmp_lab.loss_scale import LossScale, all_finite, fresh_copy, select_tree
from jmp_lab.policy import Policy, get_policy


class MixedPrecisionState(NamedTuple):
  """State of :func:`mixed_precision`."""

  master_params: Optional[optax.Params]
  inner_state: optax.OptState
  loss_scale: LossScale
  skipped_steps: jax.Array  # int32 scalar

  def master_tree(self) -> Optional[optax.Params]:
    """The master params as a tree (None when the params are the master)."""
    return self.master_params


# --------------------------------------------------------------------------
# Finding the mixed-precision state inside a (possibly nested) optimizer state.
# --------------------------------------------------------------------------


def _is_mixed_precision_state(x: Any) -> bool:
  # Every jmp_lab optimizer state exposes these; the fused optimizer's state
  # is a different NamedTuple with the same public fields.
  return isinstance(x, tuple) and hasattr(x, "_fields") and {
      "loss_scale", "skipped_steps"} <= set(x._fields) and hasattr(
          type(x), "master_tree")


def find_mixed_precision_state(opt_state: Any) -> Any:
  """Returns the one jmp_lab mixed-precision state inside ``opt_state``.

  Raises:
    ValueError: if there is none, or more than one.
  """
  found = [
      x for x in jax.tree_util.tree_leaves(
          opt_state, is_leaf=_is_mixed_precision_state)
      if _is_mixed_precision_state(x)
  ]
  if len(found) != 1:
    raise ValueError(
        f"expected exactly one jmp_lab mixed-precision state in opt_state, "
        f"found {len(found)}; build the optimizer with "
        f"jmp_lab.mixed_precision(...) or jmp_lab.fused_adamw(...)")
  return found[0]


def master_params(opt_state: Any) -> Optional[optax.Params]:
  """The fp32 master params held in ``opt_state`` (nested or not).

  Returns None when the policy's ``param_dtype`` is float32 (or float64): the
  params are then the master and no copy is kept.
  """
  return find_mixed_precision_state(opt_state).master_tree()


def current_loss_scale(opt_state: Any) -> LossScale:
  """The loss scale to use for the next forward pass."""
  return find_mixed_precision_state(opt_state).loss_scale


def skipped_steps(opt_state: Any) -> jax.Array:
  """How many steps were skipped for non-finite gradients so far."""
  return find_mixed_precision_state(opt_state).skipped_steps


# --------------------------------------------------------------------------
# Checks on the trees handed to init and update (trace-time, no sync).
# --------------------------------------------------------------------------


def keeps_master_copy(policy: Policy) -> bool:
  """Whether params of ``policy.param_dtype`` need a separate fp32 master."""
  return policy.param_dtype.itemsize < 4


def check_params(params: Any, policy: Policy) -> None:
  """Raises if a floating param is not in ``policy.param_dtype``."""
  for path, leaf in _tree.leaves_with_paths(params):
    if _tree.is_floating_array(leaf) and leaf.dtype != policy.param_dtype:
      raise ValueError(
          f"param {path} is {_tree.leaf_description(leaf)} but the policy's "
          f"param_dtype is {policy.param_dtype.name}; cast the params with "
          f"policy.cast_to_param(params) first")


def check_grads(grads: Any, params: Any) -> None:
  """Raises if ``grads`` does not match ``params`` leaf for leaf."""
  mismatch = _tree.first_structure_mismatch(params, grads)
  if mismatch is not None:
    raise ValueError(f"grads do not match params: {mismatch}")
  for (path, p), (_, g) in zip(_tree.leaves_with_paths(params),
                               _tree.leaves_with_paths(grads)):
    if jnp.shape(p) != jnp.shape(g):
      raise ValueError(
          f"gradient {path} has shape {jnp.shape(g)} but its param has shape "
          f"{jnp.shape(p)}")
    if _tree.is_floating_array(p):
      if jnp.result_type(g) != p.dtype:
        raise ValueError(
            f"gradient {path} is {_tree.leaf_description(g)} but its param is "
            f"{_tree.leaf_description(p)}; gradients must be in the param "
            f"dtype (differentiate the scaled loss with respect to the params)")
    elif _tree.is_floating_value(g):
      raise ValueError(
          f"gradient {path} is floating ({_tree.leaf_description(g)}) but its "
          f"param is {_tree.leaf_description(p)}, which is not trainable")


# --------------------------------------------------------------------------
# Splitting trainable (floating) leaves from the rest.
# --------------------------------------------------------------------------


def floating_only(tree: Any, like: Any) -> Any:
  """``tree`` with None wherever ``like`` has a non-floating leaf.

  The inner optimizer sees only trainable leaves: integer params (and their
  float0 gradients) would break most optax transforms.
  """
  return jax.tree_util.tree_map(
      lambda x, ref: x if _tree.is_floating_array(ref) else None, tree, like)


def merge_floating(floating: Any, rest: Any) -> Any:
  """Fills the None holes of :func:`floating_only` back in from ``rest``."""
  return jax.tree_util.tree_map(
      lambda f, r: r if f is None else f, floating, rest,
      is_leaf=lambda x: x is None)


def unscale_and_check(grads: Any, params: Any, loss_scale: LossScale,
                      axis_name=None) -> tuple[Any, jax.Array]:
  """Unscaled fp32 trainable gradients, and whether all of them are finite.

  The one global finite check of every jmp_lab optimizer: under ``jit`` XLA
  fuses the unscale into the reduction, so it reads each gradient once.
  """
  grads32 = floating_only(loss_scale.unscale(grads), params)
  return grads32, all_finite(grads32, axis_name=axis_name)


# --------------------------------------------------------------------------
# Handing back params that equal cast(master) exactly.
# --------------------------------------------------------------------------


def exact_half_updates(params: Any, new_master: Any) -> tuple[Any, Any]:
  """Updates such that ``apply_updates(params, updates) == cast(new_master)``.

  ``optax.apply_updates`` computes ``(p + u).astype(p.dtype)``, in fp32 for
  fp32 updates. With ``u = cast(m) - p`` that is exact unless the param moves
  across many binades in one step (a value landing very near zero, e.g. on a
  sign change): then ``u`` rounds in fp32 and ``p + u`` can round to a
  neighbour of ``cast(m)``. No fp32 ``u`` can reach ``cast(m)`` in that case,
  so the master is snapped to the half value ``p + u`` does reach. The snap
  moves the master by at most a few fp32 ulps of the old param -- the same
  size as the rounding of the fp32 master update itself -- and only for the
  elements where it is needed.

  Returns:
    ``(updates, new_master)``, with the master possibly snapped.
  """

  def leaf(p, m):
    if not _tree.is_floating_array(p):
      return _UpdateAndMaster(jnp.zeros_like(p), m)
    target = m.astype(p.dtype)
    u = target.astype(jnp.float32) - p.astype(jnp.float32)
    reached = (p.astype(jnp.float32) + u).astype(p.dtype)  # what optax does
    m = jnp.where(reached == target, m, reached.astype(m.dtype))
    return _UpdateAndMaster(u, m)

  pairs = jax.tree_util.tree_map(leaf, params, new_master)
  is_pair = lambda x: isinstance(x, _UpdateAndMaster)  # noqa: E731
  updates = jax.tree_util.tree_map(lambda t: t.update, pairs, is_leaf=is_pair)
  master = jax.tree_util.tree_map(lambda t: t.master, pairs, is_leaf=is_pair)
  return updates, master


class _UpdateAndMaster(NamedTuple):
  update: Any
  master: Any


# --------------------------------------------------------------------------
# The transformation.
# --------------------------------------------------------------------------


def mixed_precision(
    inner: optax.GradientTransformation,
    *,
    policy: Union[Policy, str],
    loss_scale: LossScale,
    axis_name: Optional[Union[str, Sequence[str]]] = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with fp32 master weights and loss scaling.

  Args:
    inner: any optax transformation (``chain``, ``clip_by_global_norm``,
      schedules, ``inject_hyperparams``, ``MultiSteps``...). It sees fp32
      master params and unscaled fp32 gradients only.
    policy: the precision policy (or its spec); params must be in its
      ``param_dtype``.
    loss_scale: the initial :class:`~jmp_lab.LossScale`.
    axis_name: inside ``shard_map``, the mapped axis name(s) over which the
      finite check must agree (under plain ``jit`` with sharded arrays the
      check is global already).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update(grads, state,
    params)`` takes the gradients of the *scaled* loss, in the param dtype.
    ``params`` is required. Extra keyword arguments go to ``inner``.
  """
  policy = get_policy(policy)
  if not isinstance(loss_scale, LossScale):
    raise TypeError(
        f"loss_scale must be a NoOpLossScale, StaticLossScale or "
        f"DynamicLossScale, got {type(loss_scale).__name__}")
  inner = optax.with_extra_args_support(inner)
  keep_master = keeps_master_copy(policy)

  def init_fn(params):
    check_params(params, policy)
    master = (jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float32) if _tree.is_floating_array(x) else x,
        params) if keep_master else None)
    trainable = floating_only(params if master is None else master, params)
    return MixedPrecisionState(
        master_params=master,
        inner_state=inner.init(trainable),
        loss_scale=fresh_copy(loss_scale),
        skipped_steps=jnp.zeros((), jnp.int32))

  def update_fn(grads, state, params=None, **extra_args):
    if params is None:
      raise ValueError(
          "mixed_precision's update needs params: call "
          "tx.update(grads, opt_state, params)")
    check_params(params, policy)
    check_grads(grads, params)

    # 1. Unscale to fp32 and check, once, that everything is finite.
    grads32, finite = unscale_and_check(grads, params, state.loss_scale,
                                        axis_name)

    # 2. The inner transformation, on the fp32 master.
    master = params if state.master_params is None else state.master_params
    trainable = floating_only(master, params)
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
        skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32))

    # 4. Updates that land the params exactly on cast(new_master).
    if state.master_params is None:
      # The params are the master, and apply_updates(p, u) is by definition
      # how the new master was computed: hand back u itself (zero if skipped).
      updates = merge_floating(
          jax.tree_util.tree_map(
              lambda u: jnp.where(finite, u, jnp.zeros_like(u)),
              inner_updates),
          jax.tree_util.tree_map(jnp.zeros_like, params))
      return updates, new_state
    updates, new_master = exact_half_updates(
        params, merge_floating(new_trainable, params))
    return updates, new_state._replace(master_params=new_master)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
