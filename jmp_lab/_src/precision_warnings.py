"""Precision diagnostics a train step reports: matmul counts and warnings.

They listen to the engine (:mod:`jmp_lab._src.precision.observers`) from
outside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np

from jmp_lab._src.precision import observers
from jmp_lab._src.precision.scopes import HALF_DTYPES
from jmp_lab._src.matmuls import matmul_records
from jmp_lab._src.policy import Policy
# The class and the call site are shared with the optimizers' warning.
from jmp_lab._src.user_warnings import (PrecisionWarning,  # noqa: F401
                                        user_stacklevel)


@dataclasses.dataclass
class MatmulCount:
  """Matmuls the rules ran (see :func:`recording`): ``half`` with half (or
  fp8) operands, ``full`` left with a wider floating operand;
  ``recast_in_loss`` of them were written with wider operands and put in
  half by a train step's loss rules, outside any model policy
  (:func:`jmp_lab.precision.island`); ``in_model`` ran inside a model's
  policy (a wrapped module's call, an autocast region)."""

  half: int = 0
  full: int = 0
  recast_in_loss: int = 0
  in_model: int = 0

  def add(self, operand_dtypes: Sequence[np.dtype],
          written_dtypes: Sequence[np.dtype], in_loss: bool,
          in_model: bool = False) -> None:
    floating = [np.dtype(d) for d in operand_dtypes
                if jnp.issubdtype(d, jnp.floating)]
    if len(floating) < 2:
      return
    self.in_model += bool(in_model)
    if all(d.itemsize <= 2 for d in floating):
      self.half += 1
    else:
      self.full += 1
    self.recast_in_loss += bool(in_loss) and any(
        np.dtype(d).itemsize > 2 for d in written_dtypes
        if d is not None and jnp.issubdtype(d, jnp.floating))


@contextlib.contextmanager
def recording():
  """Counts the matmuls the rules run while the block traces.

  >>> import jax, jax.numpy as jnp, jmp_lab
  >>> from jmp_lab.precision import recording
  >>> with recording() as count:
  ...   _ = jmp_lab.autocast(jnp.matmul, "mixed_bfloat16")(jnp.ones((2, 2)),
  ...                                                      jnp.ones((2, 2)))
  >>> count
  MatmulCount(half=1, full=0, recast_in_loss=0, in_model=1)
  """
  count = MatmulCount()
  with observers.listening(count.add):
    yield count


def warn_unless_half(policy: Policy, count: MatmulCount,
                     trace: Callable[[], Any], where: str) -> None:
  """Warns (:class:`PrecisionWarning`) when ``policy`` computes in half
  precision but no matmul of the model does.

  ``count`` holds what the rules ran while the loss was traced. When they
  did not run at all (the model is not wrapped by a front end or
  :func:`jmp_lab.autocast`), ``trace()`` gives the loss's jaxpr, whose
  matmuls are read instead: a model that casts by hand is not warned
  about. The warning points at the user's line that traced the step.
  """
  if policy.compute_dtype not in HALF_DTYPES:
    return
  if count.recast_in_loss and not count.in_model:
    # Only the loss's rules ran matmuls: the model is not wrapped. A wrapped
    # model whose head runs in the loss (a tied head, a chunked head) has
    # its head recast there, in half: nothing ran in fp32.
    warnings.warn(
        f"{where}: the policy ({policy}) computes in "
        f"{policy.compute_dtype.name}, but the model's matmuls are written in "
        f"fp32 and run outside any model policy: only the loss's rules put "
        f"them in half, and every other op stays fp32: wrap the model with "
        f"jmp_lab.linen.with_policy, jmp_lab.nnx.with_policy or "
        f"jmp_lab.autocast", PrecisionWarning, stacklevel=user_stacklevel())
    return
  if count.half or count.full:
    if not count.half:
      warnings.warn(
          f"{where}: the policy ({policy}) computes in "
          f"{policy.compute_dtype.name}, but every matmul of the model runs "
          f"in fp32: the policy's overrides (keep_layer_dtypes=True, or "
          f"class/path overrides) keep them there", PrecisionWarning,
          stacklevel=user_stacklevel())
    return
  records = matmul_records(trace())
  if records and not any(r.half for r in records):
    warnings.warn(
        f"{where}: the policy ({policy}) computes in "
        f"{policy.compute_dtype.name}, but every matmul of the loss runs in "
        f"fp32: wrap the model with jmp_lab.linen.with_policy, "
        f"jmp_lab.nnx.with_policy or jmp_lab.autocast", PrecisionWarning,
        stacklevel=user_stacklevel())


def warn_if_half_loss(loss: Any) -> None:
  """Warns (:class:`PrecisionWarning`) when a loss function returned a half
  precision loss: a policy whose output dtype is half (``"c=f16"`` means
  ``o=f16`` too) hands the loss half logits, and a loss computed from them
  (log-softmax, the mean) loses digits in half. Said where the loss is
  traced (once per compile under ``jit``), pointing at the user's line."""
  dtype = np.dtype(getattr(loss, "dtype", np.float32))
  if dtype not in HALF_DTYPES:
    return
  warnings.warn(
      f"the loss is {dtype.name}: the loss function computed it in half "
      f"precision (a policy whose output dtype is {dtype.name} hands it "
      f"{dtype.name} logits; 'c=f16' means o=f16 too), where it keeps about "
      f"{3 if dtype == np.float16 else 2} significant digits and its "
      f"gradient starts in {dtype.name}. Compute the loss in float32: give "
      f"the policy a float32 output (o=f32; 'p=f32,c=f16,o=f32' is "
      f"'mixed_float16'), cast the logits (logits.astype(jnp.float32)), or "
      f"use jmp_lab.losses' fp32 losses", PrecisionWarning,
      stacklevel=user_stacklevel())
