"""fp8's per-tensor scaling state: its fields, the delayed scales, and the
histories a step writes (the face :mod:`jmp_lab.fp8` has the docs)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import fp8_ops


E4M3 = jnp.float8_e4m3fn  # inputs and kernels
E5M2 = jnp.float8_e5m2    # output gradients
AMAX_HISTORY_LENGTH = 1024
COLLECTION = fp8_ops.OVERWRITE_WITH_GRADIENT

Fp8Meta = dict  # {input,kernel,output_grad}_{scale,amax_history}: f32 arrays
_TENSORS = ("input", "kernel", "output_grad")
_FIELDS = frozenset(f"{t}_{k}" for t in _TENSORS for k in ("scale", "amax_history"))


def fp8_max(tensor: str) -> float:
  return float(jnp.finfo(E5M2 if tensor == "output_grad" else E4M3).max)


def init_meta(history_length: int = AMAX_HISTORY_LENGTH) -> Fp8Meta:
  """The delayed-scaling state of one matmul: scales 1, histories 0."""
  if not isinstance(history_length, int) or history_length < 1:
    raise ValueError(f"history_length must be a positive int, got "
                     f"{history_length!r}")
  meta = {}
  for tensor in _TENSORS:
    # A scalar, not Flax's shape (1,): the fp8 GEMM reads its scales as f32
    # scalars, and XLA folds the scale's round trip through the compute
    # dtype away only when no reshape sits in it (else each scale costs a
    # one-element kernel).
    meta[f"{tensor}_scale"] = jnp.ones((), jnp.float32)
    meta[f"{tensor}_amax_history"] = jnp.zeros((history_length,), jnp.float32)
  return meta


def check_meta(meta: Any) -> None:
  expected = set(_FIELDS)
  if not isinstance(meta, dict) or set(meta) != expected:
    raise TypeError(
        f"fp8 meta must be the dict jmp_lab.fp8.init_meta() returns, with "
        f"keys {sorted(expected)}; got "
        f"{sorted(meta) if isinstance(meta, dict) else type(meta).__name__}")


def delayed_scale(amax_history: jax.Array, scale: jax.Array,
                  fp8_dtype) -> jax.Array:
  """The stored scale (``amax / fp8_max``) for the next step: from the
  largest amax of the history (its last axis), the old scale while that is
  zero or not finite (Flax's ``fp8_ops.compute_scale``)."""
  fp8_max = fp8_ops.get_fp8_max(fp8_dtype, jnp.float32)
  return fp8_ops.compute_scale(
      jnp.max(amax_history, axis=-1).reshape(jnp.shape(scale)), scale,
      fp8_max)


def _field(path) -> tuple[Optional[str], tuple]:
  """The meta field a leaf's path ends in (its last key that names one),
  and the path before it (which matmul's state it is)."""
  for i in range(len(path) - 1, -1, -1):
    key = getattr(path[i], "key", getattr(path[i], "name", None))
    if isinstance(key, str) and key in _FIELDS:
      return key, tuple(path[:i])
  return None, ()


def next_meta(meta: Any, observed: Any, step: Any) -> Any:
  """The delayed-scaling state after a step, for every matmul in ``meta``:
  :func:`write_amaxes`, then :func:`rescale`.

  ``meta`` is any tree of :data:`Fp8Meta` dicts (a model's
  ``_overwrite_with_gradient`` collection, an NNX state of
  :class:`jmp_lab.nnx.Fp8State`), ``observed`` its gradient from the step
  (the same structure; a tensor's amax is the largest value in its
  ``*_scale`` and ``*_amax_history`` slots, as the module docstring says),
  and ``step`` the number of steps applied so far (an int or integer
  scalar array: ``TrainState.step``, ``Optimizer.step``).

  Each history is a ring buffer: the step's amax replaces the entry
  ``step % history_length``, the one written ``history_length`` steps ago,
  so the history always holds the last ``history_length`` amaxes (in
  rotated order; only their maximum is read). Each tensor's next scale is
  ``max(history) / fp8_max``, the old scale while that is zero or not
  finite (Flax's ``fp8_ops.compute_scale``). Transformer Engine and Flax
  roll the history instead; writing one entry in place is elementwise, so
  XLA compiles the update of all the model's histories into a few
  horizontally fused kernels, where rolling each one costs a copy of it.
  The maxima of all the histories are reduced together, as one matrix.
  Histories stacked by ``nn.scan`` (a leading layer axis) work too.

  >>> import jax.numpy as jnp
  >>> meta = {"Dense_0": init_meta(history_length=3)}
  >>> observed = jax.tree_util.tree_map(jnp.zeros_like, meta)
  >>> observed["Dense_0"]["input_scale"] = jnp.array(8.96)
  >>> new = next_meta(meta, observed, step=4)   # 4 % 3: entry 1
  >>> new["Dense_0"]["input_amax_history"].tolist()
  [0.0, 8.960000038146973, 0.0]
  >>> round(float(new["Dense_0"]["input_scale"]), 6)   # 8.96 / 448
  0.02
  >>> new["Dense_0"]["kernel_scale"].tolist()   # nothing seen: scale kept
  1.0
  """
  return rescale(_write_amaxes(meta, observed, step, "next_meta"))


def write_amaxes(meta: Any, observed: Any, step: Any) -> Any:
  """``meta`` with the step's amaxes written into its histories (entry
  ``step % history_length`` of each), its scales unchanged: the first half
  of :func:`next_meta` (arguments as there).

  A train step that may skip the step writes the amaxes, keeps the old
  state on a skipped step, and then calls :func:`rescale` on what it kept,
  rather than computing the scales before the skip: the reduction over the
  histories then reads the kept histories, written in place, where before
  it read the step's inputs, which the in-place write overwrites, and XLA
  copied every donated history first (one kernel each: 76 of a 1.3B-class
  GPT's 81 scaling-state kernels; ``benchmarks/fp8_breakdown.py``).

  >>> import jax.numpy as jnp
  >>> meta = {"Dense_0": init_meta(history_length=3)}
  >>> observed = jax.tree_util.tree_map(jnp.zeros_like, meta)
  >>> observed["Dense_0"]["input_scale"] = jnp.array(8.96)
  >>> written = write_amaxes(meta, observed, step=4)
  >>> written["Dense_0"]["input_amax_history"].tolist()
  [0.0, 8.960000038146973, 0.0]
  >>> written["Dense_0"]["input_scale"].tolist()   # not yet rescaled
  1.0
  """
  return _write_amaxes(meta, observed, step, "write_amaxes")


def _write_amaxes(meta: Any, observed: Any, step: Any, caller: str) -> Any:
  step = _check_step(step, caller)
  leaves, treedef, by_length = _histories_by_length(meta, caller)
  try:
    seen = treedef.flatten_up_to(observed)
  except (ValueError, TypeError) as error:
    raise TypeError(
        f"{caller}'s observed must have meta's structure (the gradient "
        f"with respect to meta): {error}") from None
  new = list(leaves)
  for length, group in by_length.items():
    slices = _row_slices(leaves, group)
    # The step's amaxes: each the largest of its scale slot and of the
    # partial maxima in its history slot (see _observation), reduced for
    # all tensors together.
    amax = jnp.maximum(
        jnp.concatenate([jnp.asarray(seen[s], jnp.float32).reshape(-1)
                         for _, s, _ in group]),
        jnp.max(jnp.concatenate(
            [jnp.asarray(seen[h], jnp.float32).reshape(-1, length)
             for _, _, h in group]), axis=1))
    # The write: elementwise per history (one entry replaced), which XLA
    # fuses horizontally across all of them.
    written = jnp.arange(length) == step % length
    for (_, _, h), (begin, end) in zip(group, slices):
      new[h] = jnp.where(
          written, amax[begin:end].reshape(new[h].shape[:-1] + (1,)), new[h])
  return treedef.unflatten(new)


def rescale(meta: Any, applied: Any = True) -> Any:
  """``meta`` with each scale computed from its history: ``max(history) /
  fp8_max``, the old scale while that is zero or not finite; the second
  half of :func:`next_meta`. Where the scalar bool ``applied`` is False (a
  skipped step), the scales are kept as they are.

  >>> import jax.numpy as jnp
  >>> meta = init_meta(history_length=2)
  >>> meta["output_grad_amax_history"] = jnp.array([0.0, 5734.4])
  >>> float(rescale(meta)["output_grad_scale"])   # 5734.4 / 57344 (E5M2)
  0.10000000149011612
  >>> float(rescale(meta, applied=jnp.array(False))["output_grad_scale"])
  1.0
  """
  leaves, treedef, by_length = _histories_by_length(meta, "rescale")
  applied = jnp.asarray(applied)
  if applied.dtype != jnp.bool_ or applied.ndim != 0:
    raise TypeError(f"rescale's applied must be a scalar bool, got "
                    f"{applied!r}")
  new = list(leaves)
  for length, group in by_length.items():
    # Every history's maximum in one reduction, then each scale from its
    # slice of them, elementwise (slicing one concatenated scale array
    # instead would cost a copy per output).
    largest = jnp.max(jnp.concatenate(
        [leaves[h].reshape(-1, length) for _, _, h in group]), axis=1)
    for (t, s, _), (begin, end) in zip(group, _row_slices(leaves, group)):
      new[s] = jnp.where(applied, fp8_ops.compute_scale(
          largest[begin:end].reshape(leaves[s].shape), leaves[s],
          jnp.float32(fp8_max(t))), leaves[s])
  return treedef.unflatten(new)


def _histories_by_length(meta: Any, caller: str):
  """``meta``'s leaves, treedef, and its tensors grouped by history length:
  ``{length: [(tensor, index of its scale, index of its history)]}``."""
  leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(meta)
  by_length: dict[int, list[tuple[str, int, int]]] = {}
  for owner, fields in _group_fields(leaves_with_paths, caller).items():
    missing = _FIELDS - set(fields)
    if missing:
      raise TypeError(
          f"{caller}'s meta must hold whole jmp_lab.fp8.init_meta() dicts; "
          f"the one at {jax.tree_util.keystr(owner)} lacks {sorted(missing)}")
    for t in _TENSORS:
      history = fields[f"{t}_amax_history"]
      by_length.setdefault(leaves_with_paths[history][1].shape[-1], []).append(
          (t, fields[f"{t}_scale"], history))
  return [leaf for _, leaf in leaves_with_paths], treedef, by_length


def _row_slices(leaves: list, group: list) -> list[tuple[int, int]]:
  """Each tensor's rows among its group's (a history stacked by nn.scan is
  one row per layer)."""
  offsets = np.cumsum([0] + [leaves[s].size for _, s, _ in group])
  return list(zip(offsets[:-1], offsets[1:]))


def _check_step(step: Any, caller: str) -> jax.Array:
  dtype = jnp.result_type(step) if hasattr(step, "dtype") or isinstance(
      step, int) else None
  if (isinstance(step, bool) or dtype is None
      or not jnp.issubdtype(dtype, jnp.integer) or jnp.ndim(step) != 0):
    raise TypeError(
        f"{caller}'s step must be an integer scalar (the number of steps "
        f"applied so far, e.g. TrainState.step); got {step!r}")
  return jnp.asarray(step)


def _group_fields(leaves_with_paths, caller: str
                  ) -> dict[tuple, dict[str, int]]:
  """The leaves' indices by matmul (the path before the field's key) and
  field; a TypeError for a leaf that is no meta field."""
  groups: dict[tuple, dict[str, int]] = {}
  for index, (path, _) in enumerate(leaves_with_paths):
    field, owner = _field(path)
    if field is None:
      raise TypeError(
          f"{caller}'s meta must hold jmp_lab.fp8.init_meta() dicts; the "
          f"leaf at {jax.tree_util.keystr(path)} is not one of their fields "
          f"{sorted(_FIELDS)}")
    groups.setdefault(owner, {})[field] = index
  return groups


def value_and_new_meta(fun: Callable[[Fp8Meta], jax.Array], meta: Fp8Meta,
                       step: Any) -> tuple[jax.Array, Fp8Meta]:
  """``(fun(meta), the meta after step number step)``: what a train step
  does with the state of a function's delayed-scaled matmuls (the gradient
  with respect to it is the step's observation, :func:`next_meta` the
  rest)."""
  value, observed = jax.value_and_grad(fun)(meta)
  return value, next_meta(meta, observed, step)
