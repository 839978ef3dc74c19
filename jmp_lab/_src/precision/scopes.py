"""Named scopes that carry precision decisions through a trace.

A front end marks each module call with its compute dtype, the train step
marks the loss as an fp32 island whose matmuls run in the compute dtype, and
a user marks a region with :func:`scope`. jax keeps named scopes on every
equation (``source_info.name_stack``), so the interpreter reads each op's
:class:`Region` from them, and code that picks a kernel at trace time asks
:func:`current_compute_dtype`. The innermost marker wins.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util as _source_info

from jmp_lab._src.matmul_modes import FP8_MODES

PREFIX = "jmp_lab:"
_CAST = PREFIX + "cast"
_AGREE = PREFIX + "agree"
_ISLAND = PREFIX + "island:"
_REDUCE = PREFIX + "reduce:"
_MATMUL = "+"  # "jmp_lab:bfloat16+mxfp8": module_scope's matmul format
_PARAM = PREFIX + "param"
HALF_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def is_floating(dtype: Any) -> bool:
  """A floating dtype the rules move values between: 16 bits or more.
  fp8 values are the fp8 kernels' own (they choose their scales): the rules
  neither cast them nor give them a role."""
  try:
    return (dtype is not None and jnp.issubdtype(dtype, jnp.floating)
            and np.dtype(dtype).itemsize >= 2)
  except TypeError:
    return False


def is_half(dtype: Any) -> bool:
  return dtype is not None and np.dtype(dtype) in HALF_DTYPES


@dataclasses.dataclass(frozen=True)
class Region:
  """How the ops of a region run.

  Attributes:
    compute: the half dtype ops compute in, or None: ops run as written.
    matmul: the half dtype matmuls run in, or None: matmuls run as written.
    block_scaled: ``"mxfp8"`` or ``"nvfp4"``: weight matmuls (a matmul
      with a stored operand, as ``x @ w`` or ``w @ x``) block-scaled
      (:mod:`jmp_lab.block_scaled`; autocast's ``matmul=`` key), or None.
    fp8: ``"fp8_current"``: a module's own weight matmuls in fp8 with
      current scaling (:func:`jmp_lab.fp8.dot_general`); ``"fp8"``: the
      delayed scaling a module's own matmul cannot keep state for (warned
      of, in the compute dtype); or None.
  """

  compute: Optional[np.dtype]
  matmul: Optional[np.dtype]
  block_scaled: Optional[str] = None
  fp8: Optional[str] = None

  @classmethod
  def of(cls, dtype: Any) -> "Region":
    """Every op under the rules in ``dtype`` (as written unless half)."""
    dtype = np.dtype(dtype)
    return cls(dtype, dtype) if dtype in HALF_DTYPES else AS_WRITTEN

  @classmethod
  def island(cls, matmul_dtype: Any) -> "Region":
    """An fp32 island: ops as written, matmuls in ``matmul_dtype``."""
    dtype = np.dtype(matmul_dtype)
    return cls(None, dtype if dtype in HALF_DTYPES else None)


AS_WRITTEN = Region(None, None)


def _checked_dtype(dtype: Any, what: str) -> np.dtype:
  """``dtype`` (a dtype, a scalar type or a numpy name) if floating."""
  try:
    dtype = np.dtype(jnp.dtype(dtype))
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or (
      dtype.itemsize < 2):
    raise ValueError(f"{what} must be a floating dtype of 16 bits or more "
                     f"(bfloat16, float16, float32, float64), got {dtype!r}")
  return dtype


def scope(dtype: Any) -> contextlib.AbstractContextManager:
  """Ops traced inside run with ``dtype`` as the compute dtype.

  ``scope(jnp.float32)`` keeps a region of an autocast function as written;
  ``scope(jnp.bfloat16)`` puts a region under the half rules. The innermost
  scope wins. It is a ``jax.named_scope``, so it also names the region in
  profiles. :func:`jmp_lab.linen.with_policy` and
  :func:`jmp_lab.nnx.with_policy` mark every module call this way.

  Example::

    >>> import jax, jax.numpy as jnp, jmp_lab
    >>> def f(x, w):
    ...   with jmp_lab.precision.scope(jnp.float32):   # a head kept in fp32
    ...     return x @ w
    >>> audit = jmp_lab.diagnostics.audit_step(
    ...     jmp_lab.autocast(f, "mixed_bfloat16"), jnp.ones((8, 8)), jnp.ones((8, 8)))
    >>> audit.half_flop_share
    0.0
  """
  return jax.named_scope(PREFIX + _checked_dtype(dtype, "scope dtype").name)


def module_scope(dtype: Any, matmul: Optional[str] = None
                 ) -> contextlib.AbstractContextManager:
  """A front end's mark of a module call: :func:`scope`, and with
  ``matmul`` (a policy's ``matmul=`` key) the weight matmuls the module's
  own code writes (a ``dot_general`` or ``einsum`` of a param it read, as
  Hugging Face's ``FlaxConv1D`` writes its product) in that format:
  ``"mxfp8"``/``"nvfp4"`` block-scaled (as :func:`jmp_lab.autocast`
  block-scales them), ``"fp8_current"`` in current-scaled fp8, ``"fp8"``
  warned of (delayed scaling keeps its state in a layer) and left in
  ``dtype``.

  >>> import jax.numpy as jnp
  >>> with module_scope(jnp.bfloat16, "mxfp8"):
  ...   innermost_region(current_path()).block_scaled
  'mxfp8'
  """
  name = PREFIX + _checked_dtype(dtype, "scope dtype").name
  return jax.named_scope(name if matmul is None
                         else name + _MATMUL + matmul)


def island(matmul_dtype: Any) -> contextlib.AbstractContextManager:
  """Ops traced inside run as written (an fp32 island), except matmuls,
  which run in ``matmul_dtype``: how a train step runs its ``loss_fn``, so
  that a head or ``linear_cross_entropy`` in the loss computes in half while
  the loss's own arithmetic stays fp32. Module calls inside open their own
  :func:`scope`, which wins."""
  dtype = _checked_dtype(matmul_dtype, "island matmul dtype")
  return jax.named_scope(_ISLAND + dtype.name)


def policy_cast_scope() -> contextlib.AbstractContextManager:
  """Casts traced inside are policy decisions: they are kept, even of an
  fp32 value, and their results count as computed in their dtype (a cast a
  front end makes at a module boundary, or of a param it reads)."""
  return jax.named_scope(_CAST)


def agreement_cast_scope() -> contextlib.AbstractContextManager:
  """Casts traced inside only make a traced program type-check (an op whose
  inputs must share a dtype, given one the policy changed): the interpreter
  drops them and lets the op's own rule choose its dtypes."""
  return jax.named_scope(_AGREE)


def scope_names(name_stack: Any) -> tuple[str, ...]:
  """The named scopes of a jax name stack, outermost first."""
  stack = getattr(name_stack, "stack", None)
  if stack is None:
    return tuple(n for n in str(name_stack).split("/") if n)
  return tuple(s.name for s in stack if type(s).__name__ == "Scope")


def marker_region(name: str) -> Optional[Region]:
  """The region a scope name sets, or None for a scope that is not one."""
  if (not name.startswith(PREFIX) or name in (_CAST, _AGREE, _PARAM)
      or name.startswith(_REDUCE)):
    return None
  if name.startswith(_ISLAND):
    return Region.island(name[len(_ISLAND):])
  dtype, _, matmul = name[len(PREFIX):].partition(_MATMUL)
  region = Region.of(dtype)
  if not matmul or region.compute is None:
    return region
  if matmul in FP8_MODES:
    return dataclasses.replace(region, fp8=matmul)
  return dataclasses.replace(region, block_scaled=matmul)


def innermost_region(path: tuple[str, ...]) -> Optional[Region]:
  """The region of the innermost marker on ``path`` (None: no marker)."""
  for name in reversed(path):
    region = marker_region(name)
    if region is not None:
      return region
  return None


def is_policy_cast(path: tuple[str, ...]) -> bool:
  return _CAST in path


def param_read_scope() -> contextlib.AbstractContextManager:
  """Casts traced inside read a param (a front end's read of a layer's
  weight or bias): the interpreter takes the result, and its transposes and
  reshapes, for a weight (:func:`module_scope`'s block-scaled matmuls)."""
  return jax.named_scope(_PARAM)


def is_param_read(path: tuple[str, ...]) -> bool:
  return _PARAM in path


def is_agreement_cast(path: tuple[str, ...]) -> bool:
  return _AGREE in path


def user_path(path: tuple[str, ...]) -> str:
  """``path`` joined with ``/``, without jmp_lab's markers: the module
  path a user's regular expressions match."""
  return "/".join(n for n in path if not n.startswith(PREFIX))


def current_path() -> tuple[str, ...]:
  """The named scopes around the code being traced now."""
  return scope_names(_source_info.current_name_stack())


def current_compute_dtype() -> Optional[np.dtype]:
  """The dtype matmuls run in at the code being traced (the innermost
  :func:`scope` or :func:`island`), or None outside one.

  Code that must pick a half dtype itself asks this: a fused attention
  kernel inside a layer given ``dtype=jnp.float32``, or
  :func:`jmp_lab.losses.linear_cross_entropy` in a train step's loss.
  """
  region = innermost_region(current_path())
  if region is None:
    return None
  return region.matmul if region.matmul is not None else np.dtype(jnp.float32)


def reduce_scope(dtype: Any) -> contextlib.AbstractContextManager:
  """Weight gradients computed inside are summed across devices in
  ``dtype`` (a policy's reduce dtype): code that computes a weight's
  gradient itself, :func:`jmp_lab.losses.linear_cross_entropy`'s kernel
  gradient, asks :func:`current_reduce_dtype`. The train steps open it
  around the loss, and the policy modules around the model, when the
  policy has a reduce dtype."""
  return jax.named_scope(_REDUCE + _checked_dtype(dtype, "reduce dtype").name)


def current_reduce_dtype() -> Optional[np.dtype]:
  """The innermost :func:`reduce_scope`'s dtype at the code being traced,
  or None outside one."""
  for name in reversed(current_path()):
    if name.startswith(_REDUCE):
      return np.dtype(name[len(_REDUCE):])
  return None
