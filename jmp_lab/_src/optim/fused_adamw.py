"""``fused_adamw``: its checks, and the dispatch to the layouts' steps
(the face :mod:`jmp_lab.fused` has the docs)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Union

import jax.numpy as jnp
import numpy as np
import optax

from jmp_lab import _checks
from jmp_lab.kernels import pytrees
from jmp_lab._src.optim import boxes, fused_flat, fused_tree, scaled
from jmp_lab._src.optim.fused_spec import FusedSpec, ScalarOrSchedule
from jmp_lab._src.optim.updates import WritesParams
from jmp_lab._src.optim.masters import Master
from jmp_lab._src.optim.states import FusedAdamWState, ParamsSpec
from jmp_lab.kernels import layout as flat_layout
from jmp_lab.kernels import quantized, registry
from jmp_lab.kernels.reference import AdamWConfig
from jmp_lab._src.loss_scale import LossScale, check_loss_scale, fresh_copy
from jmp_lab._src.optim.scaled import default_loss_scale
from jmp_lab._src.policy import Policy, get_policy

LAYOUTS = ("tree", "flat")

# Unpacking the update buffer into dozens of leaves in one XLA:GPU kernel
# spills registers (see kernels.layout.unpack); 8 leaves a kernel does not.
_LEAVES_PER_FUSION = 8


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
      fp32). ``jnp.bfloat16`` saves 2 B/param each (tree layout);
      ``"int8"`` or ``"float8_e4m3fn"`` store 8-bit codes with an fp32
      scale per block (about 1.02 B/param each:
      :mod:`jmp_lab.kernels.quantized`): in the tree layout, blocks of up
      to 256 elements along each leaf's last axis, leaves under 4,096
      elements keeping fp32 moments; in the flat layout, a row of the
      buffers (256 elements, which may span leaves). They are computed in
      fp32 either way, as optax's ``mu_dtype``; every kernel (Triton,
      Mosaic GPU) dequantizes and quantizes them in registers.
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
      ``backend="mosaic"`` with ``layout="tree"``, a lean
      mode or bf16 moments with ``layout="flat"``, ``shards`` that is not an int >= 1 or
      lacks ``layout="flat"`` and an ``axis_name``, or an out-of-range
      hyperparameter.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose update is a
    :class:`FusedUpdate`: ``update(grads, state, params)`` takes gradients
    in the param dtype, those of the scaled loss marked
    (:class:`~jmp_lab.ScaledGradients`), as
    :func:`~jmp_lab.mixed_precision`'s does (``also_finite=``: scalar bools
    that must be True too for the step to apply).
  """
  spec = _spec(learning_rate, b1, b2, eps, weight_decay, policy, loss_scale,
               mask, backend, max_grad_norm, axis_name, layout, master,
               rounding, rounding_seed, mu_dtype, nu_dtype, shards)
  return optax.GradientTransformationExtraArgs(
      functools.partial(_init, spec), FusedUpdate(spec))


def _spec(learning_rate, b1, b2, eps, weight_decay, policy, loss_scale, mask,
          backend, max_grad_norm, axis_name, layout, master, rounding,
          rounding_seed, mu_dtype, nu_dtype, shards) -> FusedSpec:
  """``fused_adamw``'s arguments, checked, as a :class:`FusedSpec`."""
  policy = get_policy(policy)
  if loss_scale is None:
    loss_scale = default_loss_scale(policy)
  check_loss_scale(loss_scale)
  _check_hyperparameters(learning_rate, b1, b2, eps, weight_decay,
                         max_grad_norm)
  backend = registry.resolve(backend)
  if layout not in LAYOUTS:
    raise ValueError(f"unknown layout {layout!r}; accepted: "
                     f"{', '.join(map(repr, LAYOUTS))}")
  if layout == "tree" and backend == "mosaic":
    raise ValueError(
        "backend='mosaic' needs layout='flat': the multi-tensor kernel of "
        "layout='tree' is Triton only (backend 'auto', 'triton', 'interpret' "
        "or 'reference')")
  keeper = Master.of(master, rounding, rounding_seed, policy)
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
  flat_moments = (np.dtype(jnp.float32), np.dtype(jnp.int8),
                  np.dtype(jnp.float8_e4m3fn))
  if layout == "flat" and (master != "float32" or mu_dtype not in flat_moments
                           or nu_dtype not in flat_moments):
    raise ValueError(
        f"master={master!r}, mu_dtype={mu_dtype.name}, nu_dtype="
        f"{nu_dtype.name} need layout='tree'; the flat buffers are an fp32 "
        f"master and fp32 or 8-bit moments")
  config = AdamWConfig(
      b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
      half_dtype=policy.param_dtype if keeper.half_params else None,
      mu_quant=quantized.kind_of(mu_dtype), nu_quant=quantized.kind_of(nu_dtype),
      **keeper.kernel_flags())
  return FusedSpec(
      policy=policy, loss_scale=loss_scale, learning_rate=learning_rate,
      b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask,
      max_grad_norm=max_grad_norm, axis_name=axis_name, shards=shards,
      backend=backend,
      tree_backend=registry.tree_backend(backend,
                                        half_params=keeper.half_params),
      layout=layout, master=keeper, config=config, mu_dtype=mu_dtype,
      nu_dtype=nu_dtype)


def _init(spec: FusedSpec, given: Any) -> FusedAdamWState:
  # Built from the values (Flax's nnx.Optimizer inits with the model's
  # Variables and updates with their values; linen's may be boxed), then
  # wrapped as the params are, so Flax's layout flows shard it as optax's.
  scaled.warn_if_wrapped("jmp_lab.fused_adamw", fused=True,
                         loss_scale=spec.loss_scale)
  params = boxes.values_of(given)
  _checks.check_params(params, spec.policy)
  common = dict(count=jnp.zeros((), jnp.int32),
                loss_scale=fresh_copy(spec.loss_scale),
                skipped_steps=jnp.zeros((), jnp.int32),
                last_step_applied=jnp.ones((), bool),
                params_spec=ParamsSpec.of(params), policy=spec.policy)
  module = fused_tree if spec.layout == "tree" else fused_flat
  return boxes.wrapped_like_params(module.init(spec, params, common), given)


@dataclasses.dataclass(frozen=True, eq=False)
class FusedUpdate(WritesParams):
  """The update of a :func:`fused_adamw`: ``update(grads, state, params)``
  gives optax's ``(updates, new state)``; :meth:`new_params` gives the
  params the kernel wrote instead.

  Attributes:
    spec: the checked configuration.
  """

  spec: FusedSpec

  def __call__(self, grads, state, params=None, *, also_finite=None,
               **extra_args):
    del extra_args  # AdamW takes none; accepted for optax API compatibility.
    _check_call(state, params)
    grads, carried_scale = self._received(grads, state, params)
    # The kernels read the values; boxed grads get boxed updates back, a
    # boxed state its new state boxed.
    updates, new_state = self._updates(boxes.unboxed(grads),
                                       boxes.values_of(state),
                                       boxes.unboxed(params), also_finite,
                                       carried_scale)
    return (boxes.boxed_like(grads, updates),
            boxes.rewrapped_state(state, new_state))

  def new_params(self, grads, state, params=None, *, also_finite=None):
    """``(new params, new state)``: the params the kernel wrote, with no
    ``updates`` tree and no ``optax.apply_updates`` pass (equal, bit for bit,
    to ``apply_updates(params, update(...)[0])``)."""
    _check_call(state, params)
    grads, carried_scale = self._received(grads, state, params)
    new, new_state = self._new_params(boxes.unboxed(grads),
                                      boxes.values_of(state),
                                      boxes.unboxed(params), also_finite,
                                      carried_scale)
    return (boxes.boxed_like(params, new),
            boxes.rewrapped_state(state, new_state))

  def _received(self, grads, state, params):
    """Marked gradients (of the scaled loss) are divided by the loss
    scale; plain ones are the unscaled loss's (see ``scaled.received``)."""
    return scaled.received(self, grads, params, state.loss_scale,
                           self.spec.loss_scale,
                           "jmp_lab.fused_adamw's update")

  def _updates(self, grads, state, params, also_finite, carried_scale):
    if isinstance(state.layout, flat_layout.TreeLayout):
      out, new_state = fused_tree.step(self.spec, grads, state, params, True,
                                       also_finite, carried_scale)
      return fused_flat.exact_updates(
          self.spec, state.layout.tree(out.extra, rest=params),
          params), new_state
    out, new_state, flat = self._flat_step(grads, state, params, also_finite,
                                           carried_scale)
    new_values = out.extra if flat else flat_layout.unpack(
        new_state.layout, out.extra, rest=params,
        leaves_per_fusion=_LEAVES_PER_FUSION)
    return fused_flat.exact_updates(self.spec, new_values, params), new_state

  def _new_params(self, grads, state, params, also_finite, carried_scale):
    half = self.spec.master.half_params
    if isinstance(state.layout, flat_layout.TreeLayout):
      # With fp32 params the kernel's master output *is* the new params.
      out, new_state = fused_tree.step(self.spec, grads, state, params, half,
                                       also_finite, carried_scale)
      new = out.extra if half else out.master
      return state.layout.tree(new, rest=params), new_state
    out, new_state, flat = self._flat_step(grads, state, params, also_finite,
                                           carried_scale)
    new_flat = out.extra if half else out.master
    if flat:
      return new_flat, new_state
    return flat_layout.unpack(new_state.layout, new_flat, rest=params,
                              leaves_per_fusion=_LEAVES_PER_FUSION), new_state

  def _flat_step(self, grads, state, params, also_finite, carried_scale):
    step = (fused_flat.sharded_step if state.layout.shards > 1
            else fused_flat.step)
    return step(self.spec, grads, state, params, also_finite, carried_scale)

  @property
  def policy(self) -> Policy:
    return self.spec.policy


def _check_call(state, params) -> None:
  if params is None:
    raise ValueError(
        "fused_adamw's update needs params: call "
        "tx.update(grads, opt_state, params)")
  if not isinstance(state, FusedAdamWState):
    raise TypeError(
        f"fused_adamw's update needs the state its init returned, got "
        f"{type(state).__name__}")


def _check_hyperparameters(learning_rate, b1, b2, eps, weight_decay,
                           max_grad_norm):
  if not callable(learning_rate):
    if pytrees.is_floating_array(learning_rate) and jnp.ndim(learning_rate):
      raise TypeError(f"learning_rate must be a scalar or a schedule, got "
                      f"{pytrees.leaf_description(learning_rate)}")
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
  """fp32 when None; fp32, bf16, int8 or fp8 (e4m3) otherwise (the 8-bit
  ones block-quantized: :mod:`jmp_lab.kernels.quantized`)."""
  if dtype is None:
    return np.dtype(jnp.float32)
  kind = quantized.kind_of(dtype)
  if kind is not None:
    return np.dtype(jnp.int8 if kind == "int8" else jnp.float8_e4m3fn)
  try:
    parsed = np.dtype(jnp.dtype(dtype))
  except TypeError:
    parsed = None
  if parsed not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
    raise ValueError(f"{name} must be float32, bfloat16, 'int8' or "
                     f"'float8_e4m3fn' (or None for float32), got {dtype!r}")
  return parsed
