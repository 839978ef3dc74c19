"""One mixed-precision training step, readable top to bottom.

The implementation behind :mod:`jmp_lab.training`, whose docstring describes it
with examples.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional, Union

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jmp_lab import _checks
from jmp_lab._src.numerics import fp8_state as fp8
from jmp_lab._src.optim import fused_flat as fused
from jmp_lab._src.optim import updates
from jmp_lab._src.precision_warnings import recording, warn_unless_half
from jmp_lab._src.training import step as step_core
from jmp_lab._src.training.value_and_grad import scaled_value_and_grad
from jmp_lab._src.loss_scale import LossScale, select_tree
from jmp_lab._src.policy import Policy, get_policy
from jmp_lab._src.optim.states import (FusedAdamWState, current_loss_scale,
                           last_step_applied, master_params,
                           skipped_steps)


class TrainState(flax.struct.PyTreeNode):
  """Params, optimizer state and model state for mixed-precision training.

  Attributes:
    step: applied (not skipped) optimizer steps, int32.
    params: params in ``policy.param_dtype``.
    opt_state: the optimizer state; holds the fp32 master and loss scale.
    model_state: other variable collections (e.g. ``{"batch_stats": ...}``);
      ``{}`` when the model has none.
    apply_fn: the model's apply function (e.g. from ``jmp_lab.linen``).
    tx: the optimizer, normally :func:`jmp_lab.mixed_precision`.
    policy: the precision policy.
    flat: whether ``params`` is :func:`jmp_lab.fused_adamw`'s flat buffer
      (``TrainState.create(..., flat_params=True)``); ``params_tree`` is
      then the tree view, and ``loss_fn`` receives that view.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  model_state: Any
  apply_fn: Callable[..., Any] = flax.struct.field(pytree_node=False)
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
  policy: Policy = flax.struct.field(pytree_node=False)
  flat: bool = flax.struct.field(pytree_node=False, default=False)

  @classmethod
  def create(cls, *, apply_fn: Callable[..., Any], params: Any,
             tx: optax.GradientTransformation,
             policy: Union[Policy, str, None] = None,
             model_state: Optional[Any] = None,
             flat_params: bool = False) -> "TrainState":
    """Casts ``params`` to the policy's param dtype and initialises ``tx``.

    ``policy`` may be left out: it is then the jmp_lab optimizer's (``tx``'s)
    or, failing that, the model's (``with_policy(...).apply`` or an
    ``autocast`` function). Given, it must agree with both.

    The state owns its arrays: params already in the param dtype, and the
    model state, are copied, so a donated step never deletes arrays the
    caller still holds.

    With ``flat_params=True`` (``tx`` must be
    ``jmp_lab.fused_adamw(..., layout="flat")``) the params are kept as the optimizer's flat buffer: the loss function
    reads them through a tree view, gradients arrive flat, and the kernel
    writes the new params in place -- no packing, unpacking or
    ``apply_updates`` pass. Integer params are not kept in that mode.

    Raises:
      TypeError: if ``tx`` is not an optax transformation, ``apply_fn`` is
        not callable, or ``tx`` is not a jmp_lab optimizer (``fused_adamw``
        with ``flat_params``).
      ValueError: with ``flat_params``, if ``tx`` keeps the tree layout;
        if the model's policy (``with_policy(...).apply``, an ``autocast``
        function), the optimizer's and ``policy`` differ in their param or
        compute dtype.
    """
    _checks.check_transformation(tx, "TrainState.create's tx")
    if not callable(apply_fn):
      raise TypeError(f"apply_fn must be callable, got "
                      f"{type(apply_fn).__name__} {apply_fn!r}")
    known = [("the model's (apply_fn)", _checks.model_policy(apply_fn)),
             ("the optimizer's (tx)", updates.policy_of(tx))]
    if policy is None:
      policy = known[1][1] or known[0][1]
      if policy is None:
        raise TypeError(
            "TrainState.create needs a policy: give policy=..., or a tx "
            "built by jmp_lab.mixed_precision / jmp_lab.fused_adamw (whose "
            "policy it then takes)")
    policy = get_policy(policy)
    _checks.check_policies_agree(known + [("TrainState.create's", policy)],
                                 "TrainState.create")
    _checks.check_trainable_params(params)
    params = _owned(params, policy.cast_to_param(params))
    model_state = _owned(model_state, model_state) if model_state else {}
    opt_state = tx.init(params)
    jmp_lab_state = step_core.jmp_lab_state(opt_state, "TrainState.create")
    if flat_params:
      if not isinstance(jmp_lab_state, FusedAdamWState):
        raise TypeError(
            f"flat_params=True needs tx=jmp_lab.fused_adamw(...), whose "
            f"state keeps flat buffers; got a {type(jmp_lab_state).__name__}")
      params = fused.flat_params(opt_state, params)
    return cls(step=jnp.zeros((), jnp.int32), params=params,
               opt_state=opt_state, model_state=model_state,
               apply_fn=apply_fn, tx=tx, policy=policy, flat=bool(flat_params))

  @property
  def params_tree(self) -> Any:
    """The params as a tree (a view of the flat buffer when ``flat``)."""
    if self.flat:
      return fused.unflatten_params(self.opt_state, self.params)
    return self.params

  @property
  def loss_scale(self) -> LossScale:
    """The loss scale for the next forward pass."""
    return current_loss_scale(self.opt_state)

  @property
  def master_params(self) -> Any:
    """The fp32 master params (rebuilt from the params with
    ``master="remainder"``; the params themselves where no master is kept:
    fp32 params, or ``master="none"``)."""
    master = master_params(self.opt_state, self.params_tree)
    return self.params_tree if master is None else master

  @property
  def skipped_steps(self) -> jax.Array:
    return skipped_steps(self.opt_state)

  def apply_gradients(self, *, grads: Any, model_state: Optional[Any] = None,
                      also_finite: Any = None, **extra_args) -> "TrainState":
    """Applies the gradients of the *scaled* loss.

    On a non-finite step (or one where a flag of ``also_finite`` is False)
    only the loss scale and the skip counter change: ``params``, ``step`` and
    ``model_state`` keep their old values.
    """
    params, opt_state = step_core.update(self.tx, grads, self.opt_state,
                                         self.params, also_finite,
                                         **extra_args)
    applied = last_step_applied(opt_state)
    new_model_state = self.model_state
    if model_state is not None:
      new_model_state = select_tree(applied, model_state, self.model_state)
    return self.replace(step=self.step + applied.astype(jnp.int32),
                        params=params, opt_state=opt_state,
                        model_state=new_model_state)


def _owned(caller_tree: Any, tree: Any) -> Any:
  """``tree`` with copies of the arrays that are also in ``caller_tree``.

  A donated step deletes its input buffers; the caller's own arrays must not
  be among them (the params twin of ``loss_scale.fresh_copy``).
  """
  return jax.tree_util.tree_map(
      lambda mine, theirs: jnp.copy(mine)
      if mine is theirs and isinstance(mine, jax.Array) else mine,
      tree, caller_tree)


LossFn = Callable[[Any, TrainState, Any], Any]

_LOSS_FN_CONTRACT = (
    "loss_fn(params, state, batch) must return a floating scalar loss, or "
    "(loss, aux) with aux a dict with the optional keys 'model_state' and "
    "'metrics' (a dict), or (loss, (model_state, metrics))")


def _split_loss_output(out: Any, state: TrainState
                       ) -> tuple[Any, tuple[Any, dict[str, Any]]]:
  """``(loss, (model_state, metrics))`` from whatever ``loss_fn`` returned."""
  loss, aux = step_core.loss_and_aux(out, _LOSS_FN_CONTRACT)
  if aux is None:
    model_state, metrics = state.model_state, {}
  elif isinstance(aux, Mapping):
    unknown = set(aux) - {"model_state", "metrics"}
    if unknown:
      raise TypeError(f"{_LOSS_FN_CONTRACT}; got aux keys {sorted(unknown)}")
    model_state = aux.get("model_state", state.model_state)
    metrics = aux.get("metrics", {})
  elif isinstance(aux, tuple) and len(aux) == 2:
    model_state, metrics = aux
  else:
    raise TypeError(f"{_LOSS_FN_CONTRACT}; got aux {_described(aux)}")
  return loss, (model_state, _checks.checked_metrics(metrics,
                                                     _LOSS_FN_CONTRACT))


def _described(value: Any) -> str:
  """``float32[32, 10]`` for an array (a tracer in a traced step too), the
  type's name otherwise."""
  if hasattr(value, "shape") and hasattr(value, "dtype"):
    return f"{value.dtype}{list(value.shape)} (an array)"
  return f"of type {type(value).__name__}"


def _fp8_meta(model_state: Any) -> Any:
  """The delayed fp8 scaling state in ``model_state``, or None."""
  if isinstance(model_state, Mapping):
    return model_state.get(fp8.COLLECTION)
  return None


def train_step(state: TrainState, batch: Any, *, loss_fn: LossFn
               ) -> tuple[TrainState, dict[str, Any]]:
  """One mixed-precision training step.

  Args:
    state: the :class:`TrainState`.
    batch: whatever ``loss_fn`` reads (inputs, labels, a dropout key...).
    loss_fn: ``loss_fn(params, state, batch)`` runs the forward pass with
      ``params`` (not ``state.params``: those are what is differentiated)
      and returns the loss, or ``(loss, aux)`` where ``aux`` is a dict with
      the optional keys ``"model_state"`` (the updated model state, e.g.
      batch statistics; default ``state.model_state``) and ``"metrics"``
      (a dict of extra metrics).

  Returns:
    ``(new_state, metrics)``; metrics hold ``loss``, the ``loss_scale`` used,
    ``grads_finite``, ``skipped_steps`` and the loss_fn's own metrics.

  Under an fp8 policy (:mod:`jmp_lab.fp8`) ``state.model_state`` holds the
  ``_overwrite_with_gradient`` collection: the step replaces it with
  :func:`jmp_lab.fp8.next_meta` of its gradient (the amaxes it observed:
  updated histories and next scales), and keeps it on a skipped step.
  """
  # 1-3. Forward in the compute dtype, backward through the scaled loss.
  # The fp8 scaling state (jmp_lab.fp8) is differentiated too: its gradient
  # is what the step observed (each tensor's amax), from which next_meta
  # computes the new state; it never reaches tx.
  loss_scale = state.loss_scale
  fp8_meta = _fp8_meta(state.model_state)

  def normalized(params, fp8_meta, state, batch):
    if fp8_meta is not None:
      state = state.replace(model_state={**state.model_state,
                                         fp8.COLLECTION: fp8_meta})
    if state.flat:  # the loss reads a tree view; the gradient arrives flat
      params = fused.unflatten_params(state.opt_state, params)
    return _split_loss_output(loss_fn(params, state, batch), state)

  # The loss runs under the policy's loss rules: a head or
  # linear_cross_entropy in loss_fn computes in half, its arithmetic in fp32.
  with recording() as matmuls:
    (loss, (model_state, metrics)), (scaled_grads, fp8_observed) = (
        scaled_value_and_grad(normalized, loss_scale, has_aux=True,
                              argnums=(0, 1), policy=state.policy)(
                                  state.params, fp8_meta, state, batch))
  # A policy that computes in half while every matmul runs in fp32 is a
  # silent mistake (a model not wrapped, a layer dtype kept): say so once,
  # at trace time.
  warn_unless_half(state.policy, matmuls, lambda: jax.make_jaxpr(normalized)(
      state.params, fp8_meta, state, batch), "jmp_lab.train_step")
  if fp8_meta is not None:
    # next_meta in two halves: the amaxes written now, the scales computed
    # from the histories the skip decision kept (see fp8.write_amaxes).
    model_state = {**state.model_state, **model_state,
                   fp8.COLLECTION: fp8.write_amaxes(fp8_meta, fp8_observed,
                                                    state.step)}

  # 4-5. Unscale, check, update the fp32 master or skip; adjust the scale.
  # On a skipped step the model state, fp8 scaling state included, is kept;
  # a non-finite observed amax skips the step too.
  new_state = state.apply_gradients(
      grads=scaled_grads, model_state=model_state,
      also_finite=step_core.fp8_observed(fp8_meta, fp8_observed))
  applied = last_step_applied(new_state.opt_state)
  if fp8_meta is not None:
    kept = new_state.model_state
    new_state = new_state.replace(model_state={
        **kept, fp8.COLLECTION: fp8.rescale(kept[fp8.COLLECTION], applied)})

  return new_state, step_core.metrics(metrics, loss, loss_scale,
                                      new_state.opt_state,
                                      new_state.skipped_steps)


def make_train_step(loss_fn: LossFn, *, donate: bool = True,
                    state_sharding: Any = None, batch_sharding: Any = None,
                    ) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
  """``jax.jit(train_step)`` for ``loss_fn``, donating the old state.

  With ``donate=True`` the old state's buffers (params, master, optimizer
  moments) are reused for the new one, so a step needs no second copy of
  them; do not use the old state after the call.

  For data parallelism give the layout: ``state_sharding`` (a tree of
  ``NamedSharding`` like the state, e.g.
  :func:`jmp_lab.sharding.state_shardings`, which splits the optimizer state
  over the data axis: ZeRO-1) and ``batch_sharding`` (e.g.
  ``NamedSharding(mesh, P("data"))``). The new state comes back in the same
  layout, step after step; metrics are replicated.

  Example::

    >>> import flax.linen as nn, jax, jax.numpy as jnp, optax, jmp_lab
    >>> model = jmp_lab.linen.with_policy(nn.Dense(3), "mixed_float16")
    >>> x, y = jnp.ones((4, 2)), jnp.array([0, 1, 2, 0])
    >>> state = jmp_lab.TrainState.create(
    ...     apply_fn=model.apply, policy="mixed_float16",
    ...     params=model.init(jax.random.key(0), x)["params"],
    ...     tx=jmp_lab.mixed_precision(optax.adam(1e-2), policy="mixed_float16",
    ...                                loss_scale=jmp_lab.DynamicLossScale()))
    >>> def loss_fn(params, state, batch):
    ...   logits = state.apply_fn({"params": params}, batch[0])
    ...   return optax.softmax_cross_entropy_with_integer_labels(
    ...       logits, batch[1]).mean()
    >>> step = jmp_lab.make_train_step(loss_fn)
    >>> state, metrics = step(state, (x, y))
    >>> int(state.step), bool(metrics["grads_finite"])
    (1, True)
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got "
                    f"{type(loss_fn).__name__} {loss_fn!r}")
  step = functools.partial(train_step, loss_fn=loss_fn)
  donate_argnums = (0,) if donate else ()
  if state_sharding is None and batch_sharding is None:
    return _refusing_donated(jax.jit(step, donate_argnums=donate_argnums),
                             donate)
  if state_sharding is None or batch_sharding is None:
    raise ValueError(
        "give both state_sharding and batch_sharding (a data-parallel step "
        "needs the layout of each), or neither")
  mesh = getattr(batch_sharding, "mesh", None)
  if mesh is None:
    raise TypeError(f"batch_sharding must be a NamedSharding, got "
                    f"{type(batch_sharding).__name__}")
  metrics = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return _refusing_donated(jax.jit(
      step, donate_argnums=donate_argnums,
      in_shardings=(state_sharding, batch_sharding),
      out_shardings=(state_sharding, metrics)), donate)


def _refusing_donated(jitted: Callable, donate: bool) -> Callable:
  """``jitted``, refusing a state an earlier call donated with a message that
  says what to do (jax's own says only that a buffer was deleted). The jit
  stages (``lower``, ``trace``) are kept for audits and compiled reports."""
  if not donate:
    return jitted

  @functools.wraps(jitted)
  def step(state, batch):
    for leaf in jax.tree_util.tree_leaves(state):
      if isinstance(leaf, jax.Array) and not isinstance(
          leaf, jax.core.Tracer) and leaf.is_deleted():
        raise RuntimeError(
            "the state given to the train step was donated to an earlier "
            "call of it, which deleted its buffers: pass the state that call "
            "returned (state, metrics = step(state, batch)), or build the "
            "step with jmp_lab.make_train_step(loss_fn, donate=False) to "
            "keep using an old state")
    return jitted(state, batch)

  for stage in ("lower", "trace", "eval_shape"):
    if hasattr(jitted, stage):
      setattr(step, stage, getattr(jitted, stage))
  return step


