"""``fused_adamw``: unscale + finite-gated AdamW + fp32 master + half copy.

Same semantics and state fields as
``mixed_precision(optax.adamw(...), policy=..., loss_scale=...)``, but the
update is one kernel pass over persistent flat buffers instead of the dozen
tree-wide XLA ops of the unfused path:

1. a finite-flag pass over the gradients (global, like every jmp_lab check);
2. one kernel pass that reads p, m, v and g and writes p, m, v and the half
   copy, in place; a non-finite flag means nothing new is written.

Per parameter (fp32 master, m, v; half gradients) that is 14 B read, 14 B
written and 2 B for the flag pass: about 30 B.

State layout: ``master_params``, ``mu`` and ``nu`` are ``(rows, 256)`` fp32
buffers, padded to whole kernel blocks; :func:`jmp_lab.master_params` still
returns the master as a tree. Gradients that arrive as a tree are packed into
one buffer first, which costs a pass over memory (``benchmarks/
fused_update.py`` measures it); a model that reads its params from the flat
buffer (:func:`flat_params`, :func:`unflatten_params`) hands in flat
gradients and gets flat updates back, and skips that pass.

Example::

  >>> tx = jmp_lab.fused_adamw(1e-3, policy="p=bf16,c=bf16,o=f32",
  ...                          loss_scale=jmp_lab.DynamicLossScale())
  >>> state = tx.init(params)
  >>> updates, state = tx.update(scaled_grads, state, params)
  >>> params = optax.apply_updates(params, updates)   # == cast(master)
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from jmp_lab import _tree, kernels
from jmp_lab.kernels import layout as flat_layout
from jmp_lab.kernels.reference import AdamWConfig, inverse_bias_corrections
from jmp_lab.loss_scale import LossScale, fresh_copy
from jmp_lab.optimizer import (check_grads, check_params,
                               find_mixed_precision_state, keeps_master_copy,
                               unscale_and_check)
from jmp_lab.policy import Policy, get_policy

ScalarOrSchedule = Union[float, Callable[[jax.Array], jax.Array]]


class FusedAdamWState(NamedTuple):
  """State of :func:`fused_adamw`."""

  count: jax.Array                       # applied (not skipped) steps, int32
  master_params: Optional[jax.Array]     # flat fp32, or None for fp32 params
  mu: jax.Array                          # flat fp32 first moment
  nu: jax.Array                          # flat fp32 second moment
  loss_scale: LossScale
  skipped_steps: jax.Array               # int32
  layout: flat_layout.FlatLayout         # static: where each leaf lives

  def master_tree(self) -> Optional[Any]:
    """The fp32 master as a tree (non-trainable leaves are None)."""
    if self.master_params is None:
      return None
    return flat_layout.unpack(self.layout, self.master_params)


def is_flat(layout: flat_layout.FlatLayout, params: Any) -> bool:
  """Whether ``params`` is the flat buffer form (see :func:`flat_params`)."""
  return isinstance(params, jax.Array) and params.shape == (
      layout.rows, flat_layout.LANES)


def flat_params(opt_state: Any, params: Any) -> jax.Array:
  """``params`` as one flat ``(rows, 256)`` buffer in the param dtype.

  Keep the params in this form and let the model read them through
  :func:`unflatten_params`: the gradients then arrive flat, and
  ``update(flat_grads, state, flat_params)`` skips packing the gradient tree
  (a pass over memory) and returns flat updates.
  """
  state = find_mixed_precision_state(opt_state)
  if not isinstance(state, FusedAdamWState):
    raise TypeError("flat params need a fused_adamw optimizer state")
  dtype = jax.tree_util.tree_leaves(params)[0].dtype
  return flat_layout.pack(state.layout, params, dtype)


def unflatten_params(opt_state: Any, flat: jax.Array) -> Any:
  """The params tree viewed from a flat buffer (integer leaves are None)."""
  state = find_mixed_precision_state(opt_state)
  if not isinstance(state, FusedAdamWState):
    raise TypeError("flat params need a fused_adamw optimizer state")
  return flat_layout.unpack(state.layout, flat)


def _check_hyperparameters(learning_rate, b1, b2, eps, weight_decay):
  is_number = isinstance(learning_rate, (int, float)) and not isinstance(
      learning_rate, bool)
  is_scalar_array = (_tree.is_floating_array(learning_rate)
                     and jnp.ndim(learning_rate) == 0)
  if not (callable(learning_rate) or is_number or is_scalar_array):
    raise TypeError(
        f"learning_rate must be a number, a scalar float array or a schedule, "
        f"got {learning_rate!r}")
  for name, value in (("b1", b1), ("b2", b2)):
    if not 0 <= value < 1:
      raise ValueError(f"{name} must be in [0, 1), got {value}")
  if not (eps >= 0 and math.isfinite(eps)):
    raise ValueError(f"eps must be finite and >= 0, got {eps}")
  if not (weight_decay >= 0 and math.isfinite(weight_decay)):
    raise ValueError(f"weight_decay must be finite and >= 0, got {weight_decay}")


def _decay_mask(mask, params):
  if mask is None:
    return jax.tree_util.tree_map(lambda _: True, params)
  return mask(params) if callable(mask) else mask


def fused_adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    *,
    policy: Union[Policy, str],
    loss_scale: LossScale,
    mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
    backend: str = "auto",
    max_grad_norm: Optional[float] = None,
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  """Mixed-precision AdamW as one fused kernel pass.

  Args:
    learning_rate: a number or an optax schedule (it does not advance on
      skipped steps).
    b1, b2, eps, weight_decay: as ``optax.adamw`` (``eps_root`` is 0).
    policy: the precision policy; params must be in its ``param_dtype``.
    loss_scale: the initial :class:`~jmp_lab.LossScale`.
    mask: which params are weight-decayed, as ``optax.adamw``'s mask: a tree
      of bools like the params, or a function of the params returning one.
    backend: ``"auto"``, ``"mosaic"``, ``"triton"``, ``"interpret"`` or
      ``"reference"`` (see :mod:`jmp_lab.kernels`). An explicit backend that
      this device cannot run raises ``ValueError``.
    max_grad_norm: if set, clip the *unscaled* gradients to this global norm
      first, as ``optax.clip_by_global_norm`` would (the norm is computed in
      the same read as the finite flag; the factor joins the unscale).
    axis_name: inside ``shard_map``, the axis the finite check combines over.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update(grads, state,
    params)`` takes gradients of the scaled loss in the param dtype.
  """
  policy = get_policy(policy)
  if not isinstance(loss_scale, LossScale):
    raise TypeError(
        f"loss_scale must be a NoOpLossScale, StaticLossScale or "
        f"DynamicLossScale, got {type(loss_scale).__name__}")
  _check_hyperparameters(learning_rate, b1, b2, eps, weight_decay)
  if max_grad_norm is not None and not (
      isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0
      and math.isfinite(max_grad_norm)):
    raise ValueError(
        f"max_grad_norm must be a finite number > 0 or None, got "
        f"{max_grad_norm!r}")
  backend = kernels.resolve_backend(backend)
  keep_master = keeps_master_copy(policy)
  config = AdamWConfig(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                       half_dtype=policy.param_dtype if keep_master else None)

  def init_fn(params):
    check_params(params, policy)
    layout = flat_layout.make_layout(params, _decay_mask(mask, params))
    # Two separate buffers: one array for both moments would make a donated
    # state donate the same buffer twice.
    zeros = lambda: jnp.zeros((layout.rows, flat_layout.LANES), jnp.float32)  # noqa: E731
    return FusedAdamWState(
        count=jnp.zeros((), jnp.int32),
        master_params=(flat_layout.pack(layout, params, jnp.float32)
                       if keep_master else None),
        mu=zeros(), nu=zeros(), loss_scale=fresh_copy(loss_scale),
        skipped_steps=jnp.zeros((), jnp.int32), layout=layout)

  def update_fn(grads, state, params=None, **extra_args):
    del extra_args  # AdamW takes none; accepted for optax API compatibility.
    if params is None:
      raise ValueError(
          "fused_adamw's update needs params: call "
          "tx.update(grads, opt_state, params)")
    check_params(params, policy)
    check_grads(grads, params)
    layout = state.layout
    flat = is_flat(layout, params)

    # Pass 1: the global finite flag (fused unscale + isfinite + reduce), and
    # the global norm for clipping, from the same read.
    grads32, finite = unscale_and_check(grads, params, state.loss_scale,
                                        axis_name)
    clip = jnp.float32(1.0)
    if max_grad_norm is not None:
      norm = optax.tree.norm(grads32)
      if axis_name is not None:
        norm = jnp.sqrt(jax.lax.psum(norm**2, axis_name))
      clip = jnp.where(norm < max_grad_norm, 1.0, max_grad_norm / norm)

    # Pass 2: one kernel over flat buffers. Tree gradients are packed first
    # (a pass); flat ones, from a model reading flat params, are used as is.
    flat_grads = grads if flat else flat_layout.pack(layout, grads,
                                                     policy.param_dtype)
    if keep_master:
      flat_params = state.master_params
    else:
      flat_params = params if flat else flat_layout.pack(layout, params,
                                                         jnp.float32)
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    inv_bias1, inv_bias2 = inverse_bias_corrections(b1, b2, state.count + 1)
    hyper = jnp.stack([jnp.asarray(x, jnp.float32) for x in
                       (lr, inv_bias1, inv_bias2, state.loss_scale.loss_scale,
                        clip)])
    flags = jnp.stack([finite.astype(jnp.int32),
                       jnp.asarray(layout.decay_boundary, jnp.int32)])
    out = kernels.fused_update(backend, config, flat_grads, flat_params,
                               state.mu, state.nu, hyper, flags)

    # Updates: the half copy minus the params (exact: see the kernel), or
    # the fp32 update itself when the params are the master.
    new_values = out.extra if flat else flat_layout.unpack(
        layout, out.extra, rest=params)
    updates = jax.tree_util.tree_map(
        lambda new, p: (new.astype(jnp.float32) - p.astype(jnp.float32)
                        if keep_master else new)
        if _tree.is_floating_array(p) else jnp.zeros_like(p),
        new_values, params)
    new_state = FusedAdamWState(
        count=state.count + finite.astype(jnp.int32),
        master_params=out.master if keep_master else None,
        mu=out.mu, nu=out.nu,
        loss_scale=state.loss_scale.adjust(finite),
        skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
        layout=layout)
    return updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
