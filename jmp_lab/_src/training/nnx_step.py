"""The NNX training step: :class:`Optimizer` (a jmp_lab optimizer in an
``nnx.Optimizer``) and :func:`train_step` over the train-step core.

The implementation behind :mod:`jmp_lab.nnx`'s training half.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jmp_lab import _checks
from jmp_lab._src.numerics import fp8_state as fp8
from jmp_lab._src.numerics.fp8_quantize import observed_finite
from jmp_lab._src.precision.nnx_layers import policy_dtypes
from jmp_lab._src.precision.nnx_layers import Fp8State
from jmp_lab._src.precision_warnings import recording, warn_unless_half
from jmp_lab._src.training import step as step_core
from jmp_lab.kernels import layout as flat_layout
from jmp_lab._src.loss_scale import LossScale, select_tree
from jmp_lab._src.policy import Policy
from jmp_lab._src.optim import scaled
from jmp_lab._src.optim.states import (FusedAdamWState, current_loss_scale,
                           last_step_applied, master_params,
                           optimizer_policy, skipped_steps)
from jmp_lab._src.training.value_and_grad import scaled_value_and_grad


# ---------------------------------------------------------------------------
# The optimizer.
# ---------------------------------------------------------------------------


class Optimizer(nnx.Optimizer):
  """``nnx.Optimizer`` for a jmp_lab optimizer: master, loss scale, skips.

  ``tx`` is :func:`jmp_lab.mixed_precision` (any optax transformation
  inside, every ``master`` mode) or :func:`jmp_lab.fused_adamw` (tree
  layout). ``update(model, grads)`` takes the gradients of the *scaled*
  loss (:attr:`loss_scale`), marked as :func:`~jmp_lab.scaled_value_and_grad`
  returns them (:func:`train_step` does the scaling), and writes
  params equal to ``cast(master)``. A non-finite step changes nothing but
  the loss scale and :attr:`skipped_steps`: params, moments and ``step``
  (applied steps) keep their values.

  Example::

    >>> import jax.numpy as jnp, optax, jmp_lab
    >>> from flax import nnx
    >>> model = jmp_lab.nnx.with_policy(nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
    ...                                 "p=bf16,c=bf16,o=f32")
    >>> optimizer = jmp_lab.nnx.Optimizer(model, jmp_lab.fused_adamw(
    ...     1e-3, policy="p=bf16,c=bf16,o=f32",
    ...     loss_scale=jmp_lab.StaticLossScale(2.0**10)), wrt=nnx.Param)
    >>> _, grads = jmp_lab.scaled_value_and_grad(
    ...     lambda m: m(jnp.ones((1, 2))).sum(), optimizer.loss_scale,
    ...     value_and_grad=nnx.value_and_grad)(model)
    >>> optimizer.update(model, grads)
    >>> master = optimizer.master_params(model)
    >>> bool(jnp.all(model.kernel.get_raw_value() == master["kernel"].astype(jnp.bfloat16)))
    True
  """

  def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, *,
               wrt: Any = nnx.Param):
    _checks.check_transformation(tx, "jmp_lab.nnx.Optimizer's tx")
    if not isinstance(model, nnx.Module):
      raise TypeError(f"jmp_lab.nnx.Optimizer needs a flax.nnx.Module, got "
                      f"{type(model).__name__}")
    params = nnx.state(model, wrt)
    if not jax.tree_util.tree_leaves(params):
      raise ValueError(
          f"jmp_lab.nnx.Optimizer's wrt={wrt!r} selects no variable of the "
          f"{type(model).__name__}: nothing would be trained. Give the "
          f"filter of its params (nnx.Param, the default)")
    # The Variables, as Flax's nnx.Optimizer gives them: the state's
    # param-shaped arrays keep their metadata (out_sharding), so
    # nnx.get_partition_spec lays them out as the params.
    opt_state = tx.init(params)
    state = step_core.jmp_lab_state(opt_state, "jmp_lab.nnx.Optimizer")
    if isinstance(state, FusedAdamWState) and isinstance(
        state.layout, flat_layout.FlatLayout):
      raise ValueError(
          "jmp_lab.nnx.Optimizer needs fused_adamw's tree layout (the NNX "
          "model owns its params as a tree); got layout='flat'")
    _check_model_agrees(model, state.policy)
    self.graph = None
    self.step = nnx.training.optimizer.OptState(jnp.zeros((), jnp.uint32))
    self.tx = tx
    self.wrt = wrt
    self.opt_state = nnx.data(_opt_state_variables(opt_state, params))

  def _pure_opt_state(self) -> Any:
    return nnx.as_pure(self.opt_state)

  @property
  def loss_scale(self) -> LossScale:
    """The loss scale for the next forward pass."""
    return current_loss_scale(self._pure_opt_state())

  @property
  def skipped_steps(self) -> jax.Array:
    return skipped_steps(self._pure_opt_state())

  @property
  def last_step_applied(self) -> jax.Array:
    return last_step_applied(self._pure_opt_state())

  def master_params(self, model: nnx.Module) -> Any:
    """The fp32 master as a pure ``nnx.State`` dict tree (None where no
    master is kept: fp32 params, ``master="none"``)."""
    return master_params(self._pure_opt_state(), _pure_params(model, self.wrt))

  @property
  def policy(self) -> Optional[Policy]:
    """The policy the optimizer was built with (kept in its state)."""
    return optimizer_policy(self._pure_opt_state())

  def update(self, model: nnx.Module, grads: Any, /, *, also_finite=None,
             **kwargs) -> None:
    """Applies ``grads`` to ``model``'s params: those of the *scaled*
    loss marked (:class:`~jmp_lab.ScaledGradients`, as
    :func:`~jmp_lab.scaled_value_and_grad` returns them), or plain
    gradients of the unscaled loss (see :mod:`jmp_lab.training`);
    ``also_finite``: scalar bools that must be True too for the step to
    apply."""
    params = _pure_params(model, self.wrt)
    # The mark (gradients of the scaled loss) survives the filtering.
    marked = isinstance(grads, scaled.ScaledGradients)
    grads = scaled.unmarked(grads)
    grads = nnx.as_pure(nnx.state(grads, self.wrt)) if isinstance(
        grads, nnx.State) else grads
    _checks.check_grads(grads, params)
    grads = scaled.ScaledGradients(grads) if marked else grads
    new_params, new_opt_state = step_core.update(
        self.tx, grads, self._pure_opt_state(), params, also_finite, **kwargs)
    nnx.update(model, new_params)
    nnx.update(self.opt_state, nnx.state(
        nnx.training.optimizer.to_opt_state(new_opt_state)))
    self.step[...] += last_step_applied(new_opt_state).astype(jnp.uint32)


def _check_model_agrees(model: nnx.Module, policy: Optional[Policy]) -> None:
  """Refuses an optimizer whose policy computes in another dtype than the
  model's (``with_policy``), naming both."""
  dtypes = policy_dtypes(model)
  if policy is None or dtypes is None or dtypes[0] == policy.compute_dtype:
    return
  raise ValueError(
      f"jmp_lab.nnx.Optimizer: the model computes in {dtypes[0].name} "
      f"(jmp_lab.nnx.with_policy) but the optimizer's policy ({policy}) "
      f"computes in {policy.compute_dtype.name}; give both the same policy")


def _opt_state_variables(opt_state: Any, params: Any) -> Any:
  """Flax's ``to_opt_state``: each param-shaped array an ``OptVariable``
  with its param's metadata. A Variable with an ``out_sharding`` can only
  be made under a mesh: outside one (the model was built under
  ``jax.set_mesh``, the optimizer after it), under the params' own."""
  try:
    return nnx.training.optimizer.to_opt_state(opt_state)
  except ValueError as e:
    meshes = {x.sharding.mesh for x in jax.tree_util.tree_leaves(
        nnx.as_pure(params)) if isinstance(
            getattr(x, "sharding", None), jax.sharding.NamedSharding)}
    if "mesh" not in str(e) or len(meshes) != 1:
      raise
    with jax.set_mesh(meshes.pop()):
      return nnx.training.optimizer.to_opt_state(opt_state)


def _pure_params(model: nnx.Module, wrt: Any) -> Any:
  """The stored (not cast-on-read) values of ``model``'s ``wrt`` variables."""
  return nnx.as_pure(nnx.state(model, wrt))


# ---------------------------------------------------------------------------
# The train step.
# ---------------------------------------------------------------------------

LossFn = Callable[[nnx.Module, Any], Any]

_LOSS_FN_CONTRACT = (
    "loss_fn(model, batch) must return a floating scalar loss, or "
    "(loss, metrics) with metrics a dict")


def _split_loss_output(out: Any) -> tuple[Any, dict[str, Any]]:
  loss, metrics = step_core.loss_and_aux(out, _LOSS_FN_CONTRACT)
  return loss, _checks.checked_metrics(metrics, _LOSS_FN_CONTRACT)


def train_step(model: nnx.Module, optimizer: Optimizer, batch: Any, *,
               loss_fn: LossFn) -> dict[str, Any]:
  """One mixed-precision step on ``model``, in place; returns the metrics.

  ``loss_fn(model, batch)`` runs the forward pass and returns the loss, or
  ``(loss, metrics)``. The loss times the optimizer's loss scale is
  differentiated with respect to the optimizer's ``wrt`` variables; the
  optimizer unscales, checks, updates or skips. On a skipped step the
  model's other state (batch statistics, RNG counts) is put back as it was,
  so a skipped step changes nothing but the loss scale, and what the model
  sowed in it: a new sown variable, or a tuple of sown values grown by the
  step, stays as sown (a sown value of the same structure, one reduced by
  ``reduce_fn``, is put back).

  Returns:
    ``loss``, the ``loss_scale`` used, ``grads_finite``, ``skipped_steps``
    and the loss_fn's own metrics (the linen step's metrics).
  """
  if not isinstance(optimizer, Optimizer):
    got = ("flax.nnx.Optimizer (Flax's own, which keeps no fp32 master, "
           "loss scale or skipped steps)" if isinstance(optimizer, nnx.Optimizer)
           else type(optimizer).__name__)
    raise TypeError(
        f"optimizer must be a jmp_lab.nnx.Optimizer, got {got}; build "
        f"jmp_lab.nnx.Optimizer(model, jmp_lab.mixed_precision(optax.adamw"
        f"(...), policy=...), wrt=nnx.Param)")
  others = nnx.Not(optimizer.wrt)
  before = nnx.as_pure(nnx.state(model, others))  # arrays: a snapshot
  loss_scale = optimizer.loss_scale

  def forward(model):
    return _split_loss_output(loss_fn(model, batch))

  # The fp8 scaling state is differentiated too: its gradient is what the
  # step observed (each tensor's amax), from which fp8.next_meta computes
  # the new state; it never reaches the optimizer.
  # The loss runs under the policy's loss rules (a head or
  # linear_cross_entropy in loss_fn computes in half, its arithmetic fp32).
  policy = optimizer.policy
  with recording() as matmuls:
    (loss, metrics), grads = scaled_value_and_grad(
        forward, loss_scale, has_aux=True, value_and_grad=nnx.value_and_grad,
        argnums=nnx.DiffState(0, nnx.Any(optimizer.wrt, Fp8State)),
        policy=policy)(model)
  if policy is not None:
    warn_unless_half(policy, matmuls, lambda: _loss_jaxpr(loss_fn, model,
                                                          batch),
                     "jmp_lab.nnx.train_step")
  scaled_grads, fp8_observed = nnx.split_state(scaled.unmarked(grads),
                                               optimizer.wrt, ...)
  scaled_grads = scaled.ScaledGradients(scaled_grads)
  steps_before = optimizer.step[...]  # where next_meta writes the amaxes
  # A non-finite observed amax skips the step too.
  optimizer.update(model, scaled_grads, also_finite=(
      observed_finite(fp8_observed) if fp8_observed else None))
  applied = optimizer.last_step_applied
  nnx.update(model, _kept_unless_applied(
      applied, nnx.as_pure(nnx.state(model, others)), before))
  if fp8_observed:  # kept on a skipped step, like everything else
    # Leaf by leaf: the gradient state nests each Fp8State's dict value
    # differently from nnx.state, in the same (sorted) order.
    treedef = jax.tree_util.tree_structure(fp8_observed)
    old = treedef.unflatten(jax.tree_util.tree_leaves(
        nnx.state(model, Fp8State)))
    # next_meta in two halves, the scales from the kept histories (see
    # fp8.write_amaxes).
    written = fp8.write_amaxes(old, fp8_observed, steps_before)
    kept = treedef.unflatten(select_tree(
        applied, jax.tree_util.tree_leaves(written),
        jax.tree_util.tree_leaves(old)))
    nnx.update(model, fp8.rescale(kept, applied))
  return step_core.metrics(metrics, loss, loss_scale,
                           optimizer._pure_opt_state(),
                           optimizer.skipped_steps)


def _kept_unless_applied(applied: jax.Array, after: Any, before: Any) -> Any:
  """``after``'s state, where a skipped step puts back ``before``'s values:
  path by path, so that what the model sowed in the step (a variable
  ``before`` lacks, or a tuple of sown values one longer) stays as sown."""
  old = dict(nnx.to_flat_state(before))

  def kept(path, value):
    if path not in old or (jax.tree_util.tree_structure(value)
                           != jax.tree_util.tree_structure(old[path])):
      return value
    return select_tree(applied, value, old[path])

  return nnx.from_flat_state([(path, kept(path, value))
                              for path, value in nnx.to_flat_state(after)])


def _loss_jaxpr(loss_fn: LossFn, model: nnx.Module, batch: Any):
  """The jaxpr of ``loss_fn`` on a copy of ``model`` (its state updates,
  such as batch statistics, are dropped)."""
  graphdef, state = nnx.split(model)
  return jax.make_jaxpr(
      lambda state: loss_fn(nnx.merge(graphdef, state), batch))(state)


def make_train_step(loss_fn: LossFn, *, donate: bool = True
                    ) -> Callable[[nnx.Module, Optimizer, Any], dict]:
  """``nnx.jit(train_step)`` for ``loss_fn``; with ``donate=True`` the old
  params, master and moments' buffers are reused for the new ones."""
  return nnx.jit(functools.partial(train_step, loss_fn=loss_fn),
                 donate_argnums=(0, 1) if donate else ())


def split_train_step(loss_fn: LossFn, model: nnx.Module, optimizer: Optimizer
                     ) -> tuple[Callable[[Any, Any], tuple[Any, dict]], Any]:
  """:func:`train_step` as a pure function of the split state.

  Returns ``(step, state)``: ``step(state, batch) -> (new_state, metrics)``
  for ``jax.jit``, :func:`jmp_lab.diagnostics.audit_step` and
  :func:`jmp_lab.diagnostics.compiled_report`, and the model's and
  optimizer's ``state``; ``nnx.update((model, optimizer), new_state)`` puts
  a step's result back into the objects.
  """
  graphdef, state = nnx.split((model, optimizer))

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    metrics = train_step(model, optimizer, batch, loss_fn=loss_fn)
    return nnx.state((model, optimizer)), metrics

  return step, state
