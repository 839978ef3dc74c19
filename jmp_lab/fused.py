"""``fused_adamw``: unscale + finite-gated AdamW + fp32 master + half copy.

Same semantics and state fields as
``mixed_precision(optax.adamw(...), policy=..., loss_scale=...)``, but the
update is done by Pallas kernels instead of the dozen tree-wide XLA ops of
the unfused path. Two state layouts:

* ``layout="tree"`` (default): master, ``mu`` and ``nu`` are trees like the
  params, updated by the multi-tensor kernels of
  :mod:`jmp_lab.kernels.multi_tensor` (16 leaves a launch, no packing): a
  statistics pass (finite flag and clip norm, 2 B/param with bf16
  gradients), then the update, in place (28 B/param). Compiled for an H100,
  the GPT-2-small step moves 71.2 GB against 71.4 for the unfused step, with
  30 update kernels against 428 (benchmarks/RESULTS.md). With fp32 params
  ``backend="auto"`` keeps XLA's per-leaf fusion, which the kernel cannot
  beat there (see :func:`jmp_lab.kernels.tree_backend`). Under ``jit``
  with the state sharded (ZeRO-1, :func:`jmp_lab.sharding.state_shardings`)
  each device runs the kernels on its own shards of the leaves, with a
  global finite flag and clip norm (:mod:`jmp_lab.kernels.partitioned`).
* ``layout="flat"``: ``(rows, 256)`` fp32 buffers, padded to whole kernel
  blocks, one kernel for everything. Gradients that arrive as a tree are
  packed first (a pass); a model that reads its params from the flat buffer
  (:func:`flat_params`, :func:`unflatten_params`, or
  ``TrainState.create(..., flat_params=True)``) hands in flat gradients.
  Fewest launches (8 on GPT-2-small), more bytes (78.5 GB a step).

The memory-lean modes (``master="remainder"`` or ``"none"``, with nearest or
stochastic rounding; bf16 ``mu_dtype``/``nu_dtype``) run in the tree layout's
kernel, which then reads and writes only what the mode keeps: down to 6
B/param of params and state, and 16 B/param of update traffic
(:mod:`jmp_lab.kernels.multi_tensor`).

:func:`jmp_lab.master_params` returns the master as a tree in both layouts.
``update.new_params(grads, state, params)`` returns the params the kernel
wrote instead of an ``updates`` tree; ``TrainState`` uses it.

Example::

  >>> import jax.numpy as jnp, optax, jmp_lab
  >>> tx = jmp_lab.fused_adamw(1e-3, policy="p=bf16,c=bf16,o=f32",
  ...                          loss_scale=jmp_lab.DynamicLossScale())
  >>> params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
  >>> state = tx.init(params)
  >>> scaled_grads = {"w": jnp.full((4, 4), 2.0**15, jnp.bfloat16)}
  >>> updates, state = tx.update(scaled_grads, state, params)
  >>> params = optax.apply_updates(params, updates)
  >>> master = jmp_lab.master_params(state)["w"]
  >>> bool(jnp.all(params["w"] == master.astype(jnp.bfloat16)))
  True
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lab import _checks, _tree, kernels, rounding as rounding_lib
from jmp_lab.kernels import layout as flat_layout
from jmp_lab.kernels.reference import AdamWConfig, inverse_bias_corrections
from jmp_lab.loss_scale import LossScale, default_loss_scale, fresh_copy
from jmp_lab.policy import Policy, get_policy
from jmp_lab.state import FusedAdamWState, find_state

ScalarOrSchedule = Union[float, Callable[[jax.Array], jax.Array]]

LAYOUTS = ("tree", "flat")

# Unpacking the update buffer into dozens of leaves in one XLA:GPU kernel
# spills registers (see kernels.layout.unpack); 8 leaves a kernel does not.
_LEAVES_PER_FUSION = 8


def _is_flat(layout: flat_layout.FlatLayout, params: Any) -> bool:
  """Whether ``params`` is the flat buffer form (see :func:`flat_params`)."""
  return isinstance(params, jax.Array) and params.shape == (
      layout.rows, flat_layout.LANES)


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
  _checks.check_state_matches(state.params_spec, params)
  return flat_layout.pack(state.layout, params, state.layout.param_dtype)


def unflatten_params(opt_state: Any, flat: jax.Array) -> Any:
  """The params tree viewed from a flat buffer (integer leaves are None).

  Differentiable: the gradient of a loss of the view, with respect to the
  flat buffer, is the flat gradient, assembled in one pass.
  """
  state = _fused_state(opt_state)
  want = (state.layout.rows, flat_layout.LANES)
  if not _is_flat(state.layout, flat):
    raise ValueError(
        f"flat must be a {want} array from flat_params, got "
        f"{_tree.leaf_description(flat)}")
  return flat_layout.view(state.layout, flat)


def _check_hyperparameters(learning_rate, b1, b2, eps, weight_decay,
                           max_grad_norm):
  if not callable(learning_rate):
    if _tree.is_floating_array(learning_rate) and jnp.ndim(learning_rate):
      raise TypeError(f"learning_rate must be a scalar or a schedule, got "
                      f"{_tree.leaf_description(learning_rate)}")
    # A NaN or inf rate would make every param NaN without a skipped step.
    _checks.check_finite_in(learning_rate, "learning_rate", low=0,
                            high=float("inf"), high_open=True)
  _checks.check_finite_in(b1, "b1", low=0, high=1, high_open=True)
  _checks.check_finite_in(b2, "b2", low=0, high=1, high_open=True)
  _checks.check_finite_in(eps, "eps", low=0, high=float("inf"),
                          high_open=True)
  _checks.check_finite_in(weight_decay, "weight_decay", low=0,
                          high=float("inf"), high_open=True)
  if max_grad_norm is not None:
    _checks.check_finite_in(max_grad_norm, "max_grad_norm", low=0,
                            high=float("inf"), low_open=True, high_open=True)


def _moment_dtype(dtype, name: str) -> np.dtype:
  """fp32 when None; fp32 or bf16 otherwise."""
  if dtype is None:
    return np.dtype(jnp.float32)
  try:
    parsed = np.dtype(jnp.dtype(dtype))
  except TypeError:
    parsed = None
  if parsed not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
    raise ValueError(f"{name} must be float32 or bfloat16 (or None for "
                     f"float32), got {dtype!r}")
  return parsed


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
    loss_scale: Optional[LossScale] = None,
    mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
    backend: str = "auto",
    max_grad_norm: Optional[float] = None,
    axis_name: Optional[str] = None,
    layout: str = "tree",
    master: str = "float32",
    rounding: str = "nearest",
    rounding_seed: int = 0,
    mu_dtype: Optional[Any] = None,
    nu_dtype: Optional[Any] = None,
    shards: int = 1,
) -> optax.GradientTransformationExtraArgs:
  """Mixed-precision AdamW as one fused kernel pass.

  Args:
    learning_rate: a number or an optax schedule (it does not advance on
      skipped steps).
    b1, b2, eps, weight_decay: as ``optax.adamw`` (``eps_root`` is 0).
    policy: the precision policy; params must be in its ``param_dtype``.
    loss_scale: the initial :class:`~jmp_lab.LossScale`. Omitted, the policy
      chooses (:func:`jmp_lab.loss_scale.default_loss_scale`): a
      ``DynamicLossScale()`` for an fp16 compute dtype, none
      (``NoOpLossScale``) for bf16 and fp32, as ``torch.amp`` does.
    mask: which params are weight-decayed, as ``optax.adamw``'s mask: a tree
      of bools like the params, or a function of the params returning one.
    backend: ``"auto"``, ``"mosaic"``, ``"triton"``, ``"interpret"`` or
      ``"reference"`` (see :mod:`jmp_lab.kernels`). An explicit backend that
      this device cannot run raises ``ValueError``.
    max_grad_norm: if set, clip the *unscaled* gradients to this global norm
      first, as ``optax.clip_by_global_norm`` would (the norm is computed in
      the same read as the finite flag; the factor joins the unscale).
    axis_name: inside ``shard_map``, the axis the finite check combines
      over. The gradients must already be reduced over it (e.g. by
      ``lax.pmean``), as for :func:`~jmp_lab.mixed_precision`: each device
      then holds the whole gradient, and the clip norm is its norm.
    layout: ``"tree"`` (default; master and moments as trees, multi-tensor
      kernels) or ``"flat"`` (flat buffers; needed for :func:`flat_params`
      and ``TrainState.create(..., flat_params=True)``). See the module doc.
    master: ``"float32"`` (default), ``"remainder"`` (bf16 params) or
      ``"none"`` (half params; tree layout for both), as
      :func:`~jmp_lab.mixed_precision`'s ``master``. With ``"remainder"``
      the kernel joins params and remainder, updates, and splits again,
      reading and writing 2 B/param less; with ``"none"`` it updates the
      half params in place (the byte budget of each mode is in
      :mod:`jmp_lab.kernels.multi_tensor`).
    rounding: ``"nearest"`` or ``"stochastic"`` (``master="none"`` with bf16
      params only). The stochastic bits are a hash of the state's key (from
      ``rounding_seed``), the count of applied steps, the leaf and the
      element (:mod:`jmp_lab.rounding`): every backend rounds alike, runs
      repeat, and a skipped step draws nothing.
    rounding_seed: the seed of the stochastic-rounding key.
    mu_dtype, nu_dtype: the dtypes Adam's moments are stored in (default
      fp32; ``jnp.bfloat16`` saves 2 B/param each; tree layout). They are
      computed in fp32 either way, as optax's ``mu_dtype``.
    shards: ZeRO-1 inside ``shard_map`` (``layout="flat"``, with
      ``axis_name`` an axis of that many devices). The flat buffers are
      padded to split into ``shards`` equal row ranges; shard the state's
      buffers by rows (``jmp_lab.sharding.optimizer_state_shardings`` does)
      and each device updates its own rows: ``update`` takes each device's
      *own, unreduced* gradients (of its part of the batch), reduce-scatters
      them into its rows (in the policy's reduce dtype, else the param
      dtype) as the mean over devices, updates, and all-gathers the new
      params. The finite flag and the clip norm are global. Give
      ``jax.shard_map`` ``check_vma=False``: the gathered params are
      marked invarying (``all_gather(..., to="invarying")``), but the
      kernels' custom derivatives are not typed for varying axes.

  Raises:
    ValueError: for an unknown backend, layout, master or rounding mode,
      ``backend="mosaic"`` with ``layout="tree"``, a lean mode or bf16
      moments with ``layout="flat"``, ``shards`` that is not an int >= 1 or
      lacks ``layout="flat"`` and an ``axis_name``, or an out-of-range
      hyperparameter.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update(grads, state,
    params)`` takes gradients of the scaled loss in the param dtype.
  """
  policy = get_policy(policy)
  if loss_scale is None:
    loss_scale = default_loss_scale(policy)
  _checks.check_loss_scale(loss_scale)
  _check_hyperparameters(learning_rate, b1, b2, eps, weight_decay,
                         max_grad_norm)
  backend = kernels.resolve_backend(backend)
  if layout not in LAYOUTS:
    raise ValueError(f"unknown layout {layout!r}; accepted: "
                     f"{', '.join(map(repr, LAYOUTS))}")
  if layout == "tree" and backend == "mosaic":
    raise ValueError(
        "backend='mosaic' needs layout='flat': the multi-tensor kernel of "
        "layout='tree' is Triton only (backend 'auto', 'triton', 'interpret' "
        "or 'reference')")
  _checks.check_master_mode(master, rounding, policy)
  if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
    raise ValueError(f"shards must be an int >= 1, got {shards!r}")
  if shards > 1 and (layout != "flat" or axis_name is None
                     or backend == "mosaic"):
    raise ValueError(
        f"shards={shards} (ZeRO-1 inside shard_map) needs layout='flat', an "
        f"axis_name, and a backend other than 'mosaic'; got layout="
        f"{layout!r}, axis_name={axis_name!r}, backend={backend!r}")
  mu_dtype, nu_dtype = (_moment_dtype(d, name) for d, name in
                        ((mu_dtype, "mu_dtype"), (nu_dtype, "nu_dtype")))
  if layout == "flat" and (master != "float32" or mu_dtype != jnp.float32
                           or nu_dtype != jnp.float32):
    raise ValueError(
        f"master={master!r}, mu_dtype and nu_dtype other than float32 need "
        f"layout='tree'; the flat buffers are an fp32 master and moments")
  keep_master = _checks.keeps_master_copy(policy)
  multi_tensor_backend = kernels.tree_backend(backend, half_params=keep_master)
  config = AdamWConfig(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                       half_dtype=policy.param_dtype if keep_master else None,
                       remainder=master == "remainder",
                       direct=keep_master and master == "none",
                       stochastic=rounding == "stochastic")

  def init_fn(params):
    _checks.check_params(params, policy)
    decay_mask = _decay_mask(mask, params)
    common = dict(count=jnp.zeros((), jnp.int32),
                  loss_scale=fresh_copy(loss_scale),
                  skipped_steps=jnp.zeros((), jnp.int32),
                  last_step_applied=jnp.ones((), bool),
                  params_spec=_checks.ParamsSpec.of(params))
    if layout == "tree":
      tree_layout = flat_layout.make_tree_layout(params, decay_mask,
                                                 policy.param_dtype)
      leaves = tree_layout.leaves(params)
      zeros = lambda dtype: tree_layout.tree(  # noqa: E731
          [jnp.zeros(x.shape, dtype) for x in leaves])
      fp32_master = keep_master and master == "float32"
      return FusedAdamWState(
          master_params=(tree_layout.tree([x.astype(jnp.float32)
                                           for x in leaves])
                         if fp32_master else None),
          # The params are the master exactly: remainders start at zero.
          master_remainder=(zeros(jnp.uint16) if master == "remainder"
                            else None),
          mu=zeros(mu_dtype), nu=zeros(nu_dtype), layout=tree_layout,
          # Raw key data (uint32), which every checkpointer can save.
          rounding_key=(jax.random.key_data(jax.random.key(rounding_seed))
                        if config.stochastic else None),
          **common)
    buffers = flat_layout.make_layout(params, decay_mask, policy.param_dtype,
                                      shards)
    # Two separate buffers: one array for both moments would make a donated
    # state donate the same buffer twice.
    zeros = lambda: jnp.zeros((buffers.rows, flat_layout.LANES), jnp.float32)  # noqa: E731
    return FusedAdamWState(
        master_params=(flat_layout.pack(buffers, params, jnp.float32)
                       if keep_master else None),
        mu=zeros(), nu=zeros(), layout=buffers, **common)

  def hyperparameters(state, clip, scale=None):
    scale = state.loss_scale.loss_scale if scale is None else scale
    return hyper_values(state.count, clip, scale)

  def hyper_values(count, clip, scale):
    lr = learning_rate(count) if callable(learning_rate) else learning_rate
    inv_bias1, inv_bias2 = inverse_bias_corrections(b1, b2, count + 1)
    return jnp.stack([jnp.asarray(x, jnp.float32) for x in
                      (lr, inv_bias1, inv_bias2, scale, clip)])

  def clip_factor(sumsq):
    if max_grad_norm is None:
      return jnp.float32(1.0)
    norm = jnp.sqrt(sumsq)
    return jnp.where(norm < max_grad_norm, 1.0, max_grad_norm / norm)

  def next_state(state, finite, master, mu, nu, remainders=None):
    keeps_fp32_master = keep_master and master is not None and not (
        config.remainder or config.direct)
    return FusedAdamWState(
        count=state.count + finite.astype(jnp.int32),
        master_params=master if keeps_fp32_master else None,
        master_remainder=remainders, mu=mu, nu=nu,
        rounding_key=state.rounding_key,
        loss_scale=state.loss_scale.adjust(finite),
        skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
        last_step_applied=finite, layout=state.layout,
        params_spec=state.params_spec)

  def check_call(grads, state, params):
    if params is None:
      raise ValueError(
          "fused_adamw's update needs params: call "
          "tx.update(grads, opt_state, params)")
    if not isinstance(state, FusedAdamWState):
      raise TypeError(
          f"fused_adamw's update needs the state its init returned, got "
          f"{type(state).__name__}")

  def tree_step(grads, state, params, write_extra):
    """The multi-tensor pass: ``(new params or updates leaves, new state)``.

    Two kernels over the leaves as they are: the gradient statistics (finite
    flag and clip norm), then the update, in place.
    """
    _checks.check_state_matches(state.params_spec, params)
    _checks.check_params(params, policy)
    _checks.check_grads(grads, params)
    tree_layout = state.layout
    g = tree_layout.leaves(grads)
    remainders = (tree_layout.leaves(state.master_remainder)
                  if config.remainder else None)
    # With a remainder the kernel reads the params and the remainder; with
    # no master, the params.
    p = tree_layout.leaves(state.master_params if keep_master and not (
        config.remainder or config.direct) else params)
    scale = jnp.asarray(state.loss_scale.loss_scale, jnp.float32)

    def scalars(sumsq, finite, scalar_args):
      count, scale, rounding_key = scalar_args
      if axis_name is not None:
        # pmin over {0, 1}: one non-finite device makes every device skip.
        # The gradients are already reduced over the axis (every device
        # holds all of them), so the norm is local: summing it would count
        # it N times.
        finite = jax.lax.pmin(finite.astype(jnp.int32),
                              axis_name).astype(bool)
      flags = [finite.astype(jnp.int32), jnp.int32(0)]
      if config.stochastic:
        seed = rounding_lib.step_seed(rounding_key, count)
        flags.append(jax.lax.bitcast_convert_type(seed, jnp.int32))
      return (hyper_values(count, clip_factor(sumsq), scale),
              jnp.stack(flags), finite)

    # One op XLA can partition leaf by leaf (ZeRO-1 under jit); inside
    # shard_map the plain program.
    out, finite = kernels.tree_step(
        multi_tensor_backend, config, tree_layout.trainable_decays, g, p,
        tree_layout.leaves(state.mu), tree_layout.leaves(state.nu),
        remainders, scale, scalars, (state.count, scale, state.rounding_key),
        write_extra=write_extra, partitionable=axis_name is None)
    if config.remainder:  # outputs: remainders, mu, nu, params
      return out, next_state(state, finite, None, tree_layout.tree(out.mu),
                             tree_layout.tree(out.nu),
                             remainders=tree_layout.tree(out.master))
    if config.direct:  # outputs: params, mu, nu; the params go in extra
      return out._replace(extra=out.master), next_state(
          state, finite, None, tree_layout.tree(out.mu),
          tree_layout.tree(out.nu))
    new_state = next_state(state, finite, tree_layout.tree(out.master),
                           tree_layout.tree(out.mu), tree_layout.tree(out.nu))
    return out, new_state

  def check_flat_call(grads, state, params) -> bool:
    """Checks a flat-layout call; returns whether ``params`` are flat."""
    flat = _is_flat(state.layout, params)
    if not flat:
      _checks.check_state_matches(state.params_spec, params)
      _checks.check_params(params, policy)
    _checks.check_grads(grads, params)
    return flat

  def flat_step(grads, state, params):
    """The flat-buffer pass: ``(outputs, new state, whether params are flat)``."""
    buffers = state.layout
    flat = check_flat_call(grads, state, params)

    # Tree gradients are packed into one buffer first (a pass); flat ones,
    # from a model reading flat params, are used as they are. The finite
    # flag and the clip norm are then one reduction over that buffer (one
    # kernel, where a check per leaf is a kernel per leaf; padding is zero).
    # The gradients are already reduced over axis_name (every device holds
    # all of them), so the norm is local: summing it over the axis would
    # count it N times.
    flat_grads = grads if flat else flat_layout.pack(buffers, grads,
                                                     policy.param_dtype)
    grads32, finite = _checks.unscale_and_check(
        flat_grads, flat_grads, state.loss_scale, axis_name)
    hyper = hyperparameters(state, clip_factor(jnp.sum(jnp.square(grads32))))
    if keep_master:
      flat_params = state.master_params
    else:
      flat_params = params if flat else flat_layout.pack(buffers, params,
                                                         jnp.float32)
    flags = jnp.stack([finite.astype(jnp.int32),
                       jnp.asarray(buffers.decay_boundary, jnp.int32)])
    out = kernels.fused_update(backend, config, flat_grads, flat_params,
                               state.mu, state.nu, hyper, flags)
    return out, next_state(state, finite, out.master, out.mu, out.nu), flat

  def sharded_flat_step(grads, state, params):
    """ZeRO-1 inside shard_map: ``(outputs with the new values gathered,
    new local state, whether params are flat)``; see ``shards``."""
    buffers = state.layout
    flat = check_flat_call(grads, state, params)
    want = (buffers.local_rows, flat_layout.LANES)
    if state.mu.shape != want:
      raise ValueError(
          f"with shards={buffers.shards} the state's flat buffers must be "
          f"split by rows over {axis_name!r} (each device holding {want}), "
          f"got {state.mu.shape}: give shard_map in_specs "
          f"P({axis_name!r}) for them (jmp_lab.sharding."
          f"optimizer_state_shardings)")
    reduce_dtype = policy.reduce_dtype or policy.param_dtype
    flat_grads = grads if flat else flat_layout.pack(buffers, grads,
                                                     reduce_dtype)
    # The sum over devices of this device's rows; the mean is taken by
    # unscaling with loss scale x devices (inside the kernel's fp32 math).
    local = jax.lax.psum_scatter(flat_grads.astype(reduce_dtype), axis_name,
                                 scatter_dimension=0, tiled=True)
    scale = jnp.asarray(state.loss_scale.loss_scale, jnp.float32) * \
        jax.lax.psum(1, axis_name)
    grads32 = local.astype(jnp.float32) / scale
    finite = jax.lax.pmin(jnp.all(jnp.isfinite(grads32)).astype(jnp.int32),
                          axis_name).astype(bool)
    sumsq = jax.lax.psum(jnp.sum(jnp.square(grads32)), axis_name)
    hyper = hyperparameters(state, clip_factor(sumsq), scale)
    local_size = buffers.local_rows * flat_layout.LANES
    offset = jax.lax.axis_index(axis_name) * local_size
    boundary = jnp.clip(buffers.decay_boundary - offset, 0, local_size)
    flags = jnp.stack([finite.astype(jnp.int32), boundary.astype(jnp.int32)])
    if keep_master:
      local_params = state.master_params
    else:
      full = params if flat else flat_layout.pack(buffers, params, jnp.float32)
      local_params = jax.lax.dynamic_slice_in_dim(
          full, jax.lax.axis_index(axis_name) * buffers.local_rows,
          buffers.local_rows)
    out = kernels.fused_update(backend, config, local, local_params, state.mu,
                               state.nu, hyper, flags)
    new_state = next_state(state, finite, out.master, out.mu, out.nu)
    # The gathered params are the same on every device: all_gather marks its
    # result varying over the axis unless told (to="invarying", in jax 0.10
    # and 0.11 alike; all_gather_invariant is public in neither).
    gather = lambda x: jax.lax.all_gather(  # noqa: E731
        x, axis_name, axis=0, tiled=True, to="invarying")
    return out._replace(master=gather(out.master), extra=gather(out.extra)), \
        new_state, flat

  def exact_updates(new_values, params):
    """Updates from the half copy (``cast(new) - params``, exact: see the
    kernel) or the fp32 update itself when the params are the master."""
    return jax.tree_util.tree_map(
        lambda new, p: (new.astype(jnp.float32) - p.astype(jnp.float32)
                        if keep_master else new)
        if _tree.is_floating_array(p) else jnp.zeros_like(p),
        new_values, params)

  def update_fn(grads, state, params=None, **extra_args):
    del extra_args  # AdamW takes none; accepted for optax API compatibility.
    check_call(grads, state, params)
    if isinstance(state.layout, flat_layout.TreeLayout):
      out, new_state = tree_step(grads, state, params, write_extra=True)
      return exact_updates(state.layout.tree(out.extra, rest=params),
                           params), new_state
    out, new_state, flat = (sharded_flat_step if state.layout.shards > 1
                            else flat_step)(grads, state, params)
    new_values = out.extra if flat else flat_layout.unpack(
        new_state.layout, out.extra, rest=params,
        leaves_per_fusion=_LEAVES_PER_FUSION)
    return exact_updates(new_values, params), new_state

  def new_params_fn(grads, state, params=None):
    """``(new params, new state)``: the params the kernel wrote, with no
    ``updates`` tree and no ``optax.apply_updates`` pass (equal, bit for bit,
    to ``apply_updates(params, update_fn(...)[0])``)."""
    check_call(grads, state, params)
    if isinstance(state.layout, flat_layout.TreeLayout):
      # With fp32 params the kernel's master output *is* the new params.
      out, new_state = tree_step(grads, state, params, write_extra=keep_master)
      new = out.extra if keep_master else out.master
      return state.layout.tree(new, rest=params), new_state
    out, new_state, flat = (sharded_flat_step if state.layout.shards > 1
                            else flat_step)(grads, state, params)
    new_flat = out.extra if keep_master else out.master
    if flat:
      return new_flat, new_state
    return flat_layout.unpack(new_state.layout, new_flat, rest=params,
                              leaves_per_fusion=_LEAVES_PER_FUSION), new_state

  # TrainState.apply_gradients takes the new params this way when it can.
  update_fn.new_params = new_params_fn
  update_fn.policy = policy  # read by TrainState.create's agreement check

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
