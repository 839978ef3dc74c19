"""``fused_adamw``'s flat layout: ``(rows, 256)`` fp32 buffers, one kernel
for everything; and its ZeRO-1 form inside ``shard_map`` (``shards``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jmp_lab import _checks
from jmp_lab.kernels import pytrees
from jmp_lab._src.optim import boxes, gate
from jmp_lab._src.optim.fused_spec import FusedSpec
from jmp_lab._src.optim.states import FusedAdamWState, find_state
from jmp_lab.kernels import layout as flat_layout
from jmp_lab.kernels import quantized, registry, stats


def init(spec: FusedSpec, params: Any, common: dict) -> FusedAdamWState:
  """The state: the fp32 master (half params) and zero moments, packed."""
  buffers = flat_layout.make_layout(params, spec.decay_mask(params),
                                    spec.policy.param_dtype, spec.shards)
  # Two separate buffers: one array for both moments would make a donated
  # state donate the same buffer twice.
  shape = (buffers.rows, flat_layout.LANES)

  def zeros(dtype, second):
    # 8-bit: a block is a row of 256 lanes, so ZeRO-1's row ranges never
    # split one.
    kind = quantized.kind_of(dtype)
    if kind is None:
      return jnp.zeros(shape, jnp.float32)
    return quantized.zeros(shape, kind, second)

  return FusedAdamWState(
      master_params=(flat_layout.pack(buffers, params, jnp.float32)
                     if spec.master.fp32_copy else None),
      mu=zeros(spec.mu_dtype, False), nu=zeros(spec.nu_dtype, True),
      layout=buffers, **common)


def is_flat(layout: flat_layout.FlatLayout, params: Any) -> bool:
  """Whether ``params`` is the flat buffer form (``flat_params``)."""
  return isinstance(params, jax.Array) and params.shape == (
      layout.rows, flat_layout.LANES)


def _checked(spec: FusedSpec, grads, state, params) -> bool:
  """Checks a flat-layout call; returns whether ``params`` are flat."""
  flat = is_flat(state.layout, params)
  if not flat:
    state.params_spec.check(params)
    _checks.check_params(params, spec.policy)
  _checks.check_grads(grads, params)
  return flat


def step(spec: FusedSpec, grads: Any, state: FusedAdamWState, params: Any,
         also_finite: Any, carried_scale: Any) -> tuple:
  """The flat-buffer pass: ``(outputs, new state, whether params are flat)``.

  Tree gradients are packed into one buffer first (a pass); flat ones, from
  a model reading flat params, are used as they are. The finite flag and
  the clip norm are then one reduction over that buffer (one kernel, where
  a check per leaf is a kernel per leaf; padding is zero). The gradients
  are already reduced over ``axis_name`` (every device holds all of them),
  so the norm is local: summing it over the axis would count it N times.
  The gradients are divided by ``carried_scale``, the loss scale they carry
  (the state's, or ``NoOpLossScale`` for plain gradients).
  """
  buffers = state.layout
  flat = _checked(spec, grads, state, params)
  flat_grads = grads if flat else flat_layout.pack(buffers, grads,
                                                   spec.policy.param_dtype)
  grads32, finite = gate.unscale_and_check(
      flat_grads, flat_grads, carried_scale, spec.axis_name, also_finite)
  hyper = spec.hyper(state.count,
                     spec.clip_factor(jnp.sum(jnp.square(grads32))),
                     carried_scale.loss_scale)
  if spec.master.fp32_copy:
    flat_master = state.master_params
  else:
    flat_master = params if flat else flat_layout.pack(buffers, params,
                                                       jnp.float32)
  flags = jnp.stack([finite.astype(jnp.int32),
                     jnp.asarray(buffers.decay_boundary, jnp.int32)])
  out = registry.fused_update(spec.backend, spec.config, flat_grads,
                             flat_master, state.mu, state.nu, hyper, flags)
  return (out, spec.next_state(state, finite, out.master, out.mu, out.nu),
          flat)


def sharded_step(spec: FusedSpec, grads: Any, state: FusedAdamWState,
                 params: Any, also_finite: Any, carried_scale: Any) -> tuple:
  """ZeRO-1 inside ``shard_map``: ``(outputs with the new values gathered,
  new local state, whether params are flat)``; see ``fused_adamw``'s
  ``shards``."""
  buffers, axis_name = state.layout, spec.axis_name
  flat = _checked(spec, grads, state, params)
  want = (buffers.local_rows, flat_layout.LANES)
  if state.mu.shape != want:
    raise ValueError(
        f"with shards={buffers.shards} the state's flat buffers must be "
        f"split by rows over {axis_name!r} (each device holding {want}), "
        f"got {state.mu.shape}: give shard_map in_specs "
        f"P({axis_name!r}) for them (jmp_lab.sharding."
        f"optimizer_state_shardings)")
  reduce_dtype = spec.policy.reduce_dtype or spec.policy.param_dtype
  flat_grads = grads if flat else flat_layout.pack(buffers, grads,
                                                   reduce_dtype)
  # The sum over devices of this device's rows; the mean is taken by
  # unscaling with loss scale x devices (inside the kernel's fp32 math).
  local = jax.lax.psum_scatter(flat_grads.astype(reduce_dtype), axis_name,
                               scatter_dimension=0, tiled=True)
  scale = jnp.asarray(carried_scale.loss_scale, jnp.float32) * \
      jax.lax.psum(1, axis_name)
  grads32 = local.astype(jnp.float32) / scale
  finite = stats.agree(stats.all_finite([grads32], gate.flags(also_finite)),
                       axis_name)
  sumsq = jax.lax.psum(jnp.sum(jnp.square(grads32)), axis_name)
  hyper = spec.hyper(state.count, spec.clip_factor(sumsq), scale)
  local_size = buffers.local_rows * flat_layout.LANES
  offset = jax.lax.axis_index(axis_name) * local_size
  boundary = jnp.clip(buffers.decay_boundary - offset, 0, local_size)
  flags = jnp.stack([finite.astype(jnp.int32), boundary.astype(jnp.int32)])
  if spec.master.fp32_copy:
    local_params = state.master_params
  else:
    full = params if flat else flat_layout.pack(buffers, params, jnp.float32)
    local_params = jax.lax.dynamic_slice_in_dim(
        full, jax.lax.axis_index(axis_name) * buffers.local_rows,
        buffers.local_rows)
  out = registry.fused_update(spec.backend, spec.config, local, local_params,
                             state.mu, state.nu, hyper, flags)
  new_state = spec.next_state(state, finite, out.master, out.mu, out.nu)
  # The gathered params are the same on every device: all_gather marks its
  # result varying over the axis unless told (to="invarying", in jax 0.10
  # and 0.11 alike; all_gather_invariant is public in neither).
  gather = lambda x: jax.lax.all_gather(  # noqa: E731
      x, axis_name, axis=0, tiled=True, to="invarying")
  return out._replace(master=gather(out.master), extra=gather(out.extra)), \
      new_state, flat


def exact_updates(spec: FusedSpec, new_values: Any, params: Any) -> Any:
  """Updates from the half copy (``cast(new) - params``, exact: see the
  kernel) or the fp32 update itself when the params are the master."""
  half = spec.master.half_params
  return jax.tree_util.tree_map(
      lambda new, p: (new.astype(jnp.float32) - p.astype(jnp.float32)
                      if half else new)
      if pytrees.is_floating_array(p) else jnp.zeros_like(p),
      new_values, params)


def _fused_state(opt_state: Any) -> FusedAdamWState:
  state = find_state(opt_state)
  if not isinstance(state, FusedAdamWState):
    raise TypeError(
        f"flat params need a fused_adamw optimizer state, got a "
        f"{type(state).__name__}")
  if not isinstance(state.layout, flat_layout.FlatLayout):
    raise ValueError(
        "flat params need the flat state layout: build the optimizer with "
        "jmp_lab.fused_adamw(..., layout='flat'); this state has "
        "layout='tree'")
  return state


def flat_params(opt_state: Any, params: Any) -> jax.Array:
  """``params`` as one flat ``(rows, 256)`` buffer in the param dtype.

  Needs the state of ``fused_adamw(..., layout="flat")``.

  Keep the params in this form and let the model read them through
  :func:`unflatten_params`: the gradients then arrive flat, and
  ``update(flat_grads, state, flat_params)`` skips packing the gradient tree
  (a pass over memory) and returns flat updates.

  Example::

    >>> import jax.numpy as jnp, jmp_lab
    >>> params = {"step": jnp.int32(0), "w": jnp.ones((2, 3), jnp.bfloat16)}
    >>> tx = jmp_lab.fused_adamw(1e-3, policy="p=bf16", layout="flat",
    ...                          loss_scale=jmp_lab.NoOpLossScale())
    >>> opt_state = tx.init(params)
    >>> flat = jmp_lab.flat_params(opt_state, params)
    >>> flat.dtype, jmp_lab.unflatten_params(opt_state, flat)["w"].shape
    (dtype(bfloat16), (2, 3))
  """
  state = _fused_state(opt_state)
  # A flat buffer holds values only: Flax's partition boxes (and NNX's
  # Variables) around the params are read through, as the optimizers read
  # them, rather than handed to the packer (jnp.ravel refuses a box).
  params = boxes.values_of(params)
  state.params_spec.check(params)
  return flat_layout.pack(state.layout, params, state.layout.param_dtype)


def unflatten_params(opt_state: Any, flat: jax.Array) -> Any:
  """The params tree viewed from a flat buffer (integer leaves are None).

  Differentiable: the gradient of a loss of the view, with respect to the
  flat buffer, is the flat gradient, assembled in one pass.
  """
  state = _fused_state(opt_state)
  want = (state.layout.rows, flat_layout.LANES)
  if not is_flat(state.layout, flat):
    raise ValueError(
        f"flat must be a {want} array from flat_params, got "
        f"{pytrees.leaf_description(flat)}")
  return flat_layout.view(state.layout, flat)
