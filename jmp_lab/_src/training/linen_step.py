"""One mixed-precision training step, readable top to bottom.

The implementation behind :mod:`jmp_lab.training`, whose docstring describes it
with examples.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Mapping, Optional, Union

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jmp_lab import _checks
from jmp_lab._src.numerics import fp8_state as fp8
from jmp_lab._src.optim import fused_flat as fused
from jmp_lab._src.optim import scaled, updates
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
    rngs: the base keys of the model's random streams, by name (e.g.
      ``{"dropout": key}``; ``{}`` when the model draws none). A step reads
      its own keys from :meth:`step_rngs`.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  model_state: Any
  apply_fn: Callable[..., Any] = flax.struct.field(pytree_node=False)
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
  policy: Policy = flax.struct.field(pytree_node=False)
  flat: bool = flax.struct.field(pytree_node=False, default=False)
  rngs: Any = flax.struct.field(default_factory=dict)

  @classmethod
  def create(cls, *, apply_fn: Callable[..., Any], params: Any,
             tx: optax.GradientTransformation,
             policy: Union[Policy, str, None] = None,
             model_state: Optional[Any] = None,
             flat_params: bool = False,
             rngs: Optional[Mapping[str, Any]] = None) -> "TrainState":
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
    Params boxed by Flax (``nn.with_logical_partitioning``) are read
    through: the buffer holds their values and carries no boxes.

    ``rngs`` holds a key per random stream the model draws in training, as
    Flax's ``apply(..., rngs=...)`` takes them (``{"dropout":
    jax.random.key(1)}``); ``loss_fn`` passes ``rngs=state.step_rngs()`` to
    ``apply_fn`` (see :meth:`step_rngs`).

    Raises:
      TypeError: if ``tx`` is not an optax transformation, ``apply_fn`` is
        not callable, or ``tx`` is not a jmp_lab optimizer (``fused_adamw``
        with ``flat_params``).
      ValueError: with ``flat_params``, if ``tx`` keeps the tree layout;
        if the model's policy (``with_policy(...).apply``, an ``autocast``
        function), the optimizer's and ``policy`` differ in their param or
        compute dtype.
      TypeError: if ``rngs`` is not a dict of names to PRNG keys.
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
            "policy it then takes; a tx that wraps one, as optax.chain does, "
            "does not tell it: give policy=... then)")
    policy = get_policy(policy)
    _checks.check_policies_agree(known + [("TrainState.create's", policy)],
                                 "TrainState.create")
    _checks.check_trainable_params(params)
    params = _owned(params, policy.cast_to_param(params))
    model_state = _owned(model_state, model_state) if model_state else {}
    rngs = {} if rngs is None else _owned(rngs, _checked_rngs(rngs))
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
               apply_fn=apply_fn, tx=tx, policy=policy, flat=bool(flat_params),
               rngs=rngs)

  def step_rngs(self) -> dict[str, jax.Array]:
    """This step's keys: each of ``rngs`` folded with the number of steps
    taken so far, applied and skipped (``step + skipped_steps``).

    Every call of the train step draws new keys (a skipped step too, so a
    retry after an overflow draws a new dropout mask), and a run resumed
    from a checkpoint draws the keys the uninterrupted run would have, as
    Flax's guide folds its dropout key with ``state.step``.

    Example::

      >>> import flax.linen as nn, jax, jax.numpy as jnp, optax, jmp_lab
      >>> model = nn.Dropout(0.5, deterministic=False)
      >>> state = jmp_lab.TrainState.create(
      ...     apply_fn=model.apply, params={"w": jnp.ones(2)},
      ...     rngs={"dropout": jax.random.key(1)},
      ...     tx=jmp_lab.mixed_precision(optax.sgd(0.1), policy="float32"))
      >>> keys = state.step_rngs()
      >>> sorted(keys), bool(keys["dropout"] == jax.random.fold_in(
      ...     jax.random.key(1), 0))
      (['dropout'], True)
    """
    taken = self.step + self.skipped_steps
    return {name: jax.random.fold_in(key, taken)
            for name, key in self.rngs.items()}

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
    """Applies ``grads``, as Flax's ``TrainState.apply_gradients`` does:
    those of the *scaled* loss marked as :class:`~jmp_lab.ScaledGradients`
    (from :func:`~jmp_lab.scaled_value_and_grad`), or plain gradients of
    the unscaled loss (see :mod:`jmp_lab.training`).

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


def _checked_rngs(rngs: Any) -> dict[str, Any]:
  """``rngs`` as a dict of names to PRNG keys (typed, ``jax.random.key``, or
  raw uint32[2], ``jax.random.PRNGKey``); a TypeError naming the bad one."""
  example = "e.g. rngs={'dropout': jax.random.key(1)}"
  if not isinstance(rngs, Mapping):
    raise TypeError(f"rngs must be a dict of stream names to PRNG keys, as "
                    f"Flax's apply takes them ({example}), got "
                    f"{_described(rngs)}")
  for name, key in rngs.items():
    typed = hasattr(key, "dtype") and jax.dtypes.issubdtype(
        key.dtype, jax.dtypes.prng_key)
    raw = (hasattr(key, "dtype") and jnp.shape(key) == (2,)
           and key.dtype == jnp.uint32)
    if not isinstance(name, str) or not ((typed and jnp.ndim(key) == 0)
                                         or raw):
      got = (_described(key) if hasattr(key, "dtype")
             else f"{type(key).__name__} {key!r}")
      raise TypeError(f"rngs must map stream names (str) to one PRNG key "
                      f"each ({example}); got {name!r}: {got}")
  return dict(rngs)


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


def _check_loss_fn(loss_fn: Any) -> None:
  """Refuses a ``loss_fn`` that cannot be called as ``loss_fn(params,
  state, batch)``, before it is traced (its own TypeError would come from
  inside the step). Callables without a readable signature pass."""
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got "
                    f"{type(loss_fn).__name__} {loss_fn!r}")
  try:
    signature = inspect.signature(loss_fn)
  except (TypeError, ValueError):
    return
  try:
    signature.bind(None, None, None)
  except TypeError:
    name = getattr(loss_fn, "__name__", None) or (
        f"functools.partial({getattr(loss_fn.func, '__name__', '...')})"
        if isinstance(loss_fn, functools.partial) else type(loss_fn).__name__)
    raise TypeError(
        f"loss_fn is called as loss_fn(params, state, batch) (state: the "
        f"TrainState, whose apply_fn and model_state it reads), but "
        f"{name}{signature} cannot take those three arguments. Add the "
        f"state: def loss_fn(params, state, batch): logits = "
        f"state.apply_fn({{'params': params}}, batch['x']) ... (an NNX "
        f"model's loss_fn(model, batch) goes to jmp_lab.nnx.make_train_step)"
        ) from None


def _check_step_arguments(state: Any, batch: Any) -> None:
  """Refuses a state that is not a jmp_lab TrainState, saying what it is:
  Flax's own TrainState, or the batch (the arguments swapped)."""
  if isinstance(state, TrainState):
    return
  if isinstance(batch, TrainState):
    raise TypeError(
        f"the train step takes (state, batch), got a "
        f"{type(state).__name__} and then a jmp_lab.TrainState: the "
        f"arguments are swapped; call state, metrics = step(state, batch)")
  from flax.training import train_state as flax_train_state  # only here
  if isinstance(state, flax_train_state.TrainState):
    raise TypeError(
        f"state must be a jmp_lab.TrainState, got "
        f"{type(state).__module__}.{type(state).__qualname__} (Flax's own "
        f"TrainState: this step reads the policy and the loss scale from "
        f"jmp_lab's; a loop of your own keeps Flax's, docs/guides/"
        f"own_loop.md); build it with jmp_lab.TrainState.create(apply_fn="
        f"..., params=..., tx=jmp_lab.mixed_precision(optax.adamw(...), "
        f"policy=...)), which takes the same apply_fn, params and tx")
  raise TypeError(
      f"state must be a jmp_lab.TrainState (from jmp_lab.TrainState.create"
      f"), got a {type(state).__name__}")


def _gradient_metrics(state: TrainState, loss_scale: LossScale,
                      scaled_grads: Any, grad_norm: bool, grads: bool
                      ) -> dict[str, Any]:
  """The unscaled gradients' global norm and the gradients themselves (fp32,
  a tree), as asked; computed from the scaled gradients the optimizer
  gets, so inf or nan on a step it skips."""
  if not (grad_norm or grads):
    return {}
  unscaled = loss_scale.unscale(scaled.unmarked(scaled_grads))
  # The norm of the tree, also for a flat state: the same sums in the same
  # order whatever the layout, so both give the same bits (one reduction over
  # the flat buffer would add in another order).
  tree = (fused.unflatten_params(state.opt_state, unscaled) if state.flat
          else unscaled)
  found = {}
  if grad_norm:
    found["grad_norm"] = optax.tree.norm(tree)
  if grads:
    found["grads"] = tree
  return found


def train_step(state: TrainState, batch: Any, *, loss_fn: LossFn,
               grad_norm: bool = False, grads: bool = False
               ) -> tuple[TrainState, dict[str, Any]]:
  """One mixed-precision training step.

  Args:
    state: the :class:`TrainState`.
    batch: whatever ``loss_fn`` reads (inputs, labels...).
    loss_fn: ``loss_fn(params, state, batch)`` runs the forward pass with
      ``params`` (not ``state.params``: those are what is differentiated)
      and returns the loss, or ``(loss, aux)`` where ``aux`` is a dict with
      the optional keys ``"model_state"`` (the updated model state, e.g.
      batch statistics; default ``state.model_state``) and ``"metrics"``
      (a dict of extra metrics). A model that draws random numbers
      (dropout) gets this step's keys from ``rngs=state.step_rngs()``.
    grad_norm: add ``grad_norm``, the global norm of the unscaled
      gradients (fp32; inf or nan on a skipped step), to the metrics.
    grads: add ``grads``, the unscaled gradients (fp32, a tree like the
      params), to the metrics.

  Returns:
    ``(new_state, metrics)``; metrics hold ``loss``, the ``loss_scale`` used,
    ``grads_finite``, ``skipped_steps`` and the loss_fn's own metrics.

  Raises:
    TypeError: if ``state`` is not a :class:`TrainState` (Flax's own, or the
      batch: the arguments swapped), or ``loss_fn`` cannot be called as
      ``loss_fn(params, state, batch)``.

  Under an fp8 policy (:mod:`jmp_lab.fp8`) ``state.model_state`` holds the
  ``_overwrite_with_gradient`` collection: the step replaces it with
  :func:`jmp_lab.fp8.next_meta` of its gradient (the amaxes it observed:
  updated histories and next scales), and keeps it on a skipped step.
  """
  _check_step_arguments(state, batch)
  _check_loss_fn(loss_fn)
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
  # The fp8 amaxes are observations, not gradients for the optimizer.
  fp8_observed = scaled.unmarked(fp8_observed)
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

  metrics = {**metrics, **_gradient_metrics(state, loss_scale, scaled_grads,
                                            grad_norm, grads)}
  return new_state, step_core.metrics(metrics, loss, loss_scale,
                                      new_state.opt_state,
                                      new_state.skipped_steps)


def make_train_step(loss_fn: LossFn, *, donate: bool = True,
                    state_sharding: Any = None, batch_sharding: Any = None,
                    grad_norm: bool = False, grads: bool = False,
                    ) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
  """``jax.jit(train_step)`` for ``loss_fn``, donating the old state.

  ``loss_fn(params, state, batch)`` is checked here: one that cannot take
  those three arguments (a ``loss_fn(params, batch)``) is refused with a
  TypeError that says what to write. ``grad_norm=True`` adds the unscaled
  gradients' global norm to the metrics, ``grads=True`` the unscaled
  gradients themselves (see :func:`train_step`).

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
  _check_loss_fn(loss_fn)
  step = functools.partial(train_step, loss_fn=loss_fn,
                           grad_norm=bool(grad_norm), grads=bool(grads))
  donate_argnums = (0,) if donate else ()
  if state_sharding is None and batch_sharding is None:
    return _checked_call(jax.jit(step, donate_argnums=donate_argnums),
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
  return _checked_call(jax.jit(
      step, donate_argnums=donate_argnums,
      in_shardings=(state_sharding, batch_sharding),
      out_shardings=(state_sharding, metrics)), donate)


def _checked_call(jitted: Callable, donate: bool) -> Callable:
  """``jitted``, refusing before jax sees them a state that is not a
  jmp_lab TrainState (Flax's, or the arguments swapped: jax's own errors
  would name an attribute or a pytree mismatch) and a state an earlier call
  donated, with a message that says what to do (jax's own says only that a
  buffer was deleted). The jit stages (``lower``, ``trace``) are kept for
  audits and compiled reports."""

  @functools.wraps(jitted)
  def step(state, batch):
    _check_step_arguments(state, batch)
    if not donate:
      return jitted(state, batch)
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
