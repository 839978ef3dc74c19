"""Half-precision GEMMs with a wider result, on every platform.

A GEMM of bf16 or fp16 operands that accumulates and returns fp32 is what
tensor cores do, and what jmp_lab asks for where a sum must stay wide (the
weight gradients of :mod:`jmp_lab.reduce`, a matmul that asks for an fp32
result under :mod:`jmp_lab.autocast`). XLA:CPU cannot run all of them; this
module is the one place that knows.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import lax

from jmp_lab._src.precision import scopes


def accumulated(product: Callable[..., jax.Array], operands: Sequence[Any],
                accumulate_dtype: Any) -> jax.Array:
  """``product(*operands)``, a GEMM of half operands that accumulates and
  returns ``accumulate_dtype`` (its ``preferred_element_type``).

  Compiled for a CPU the operands are cast to ``accumulate_dtype`` first:
  XLA:CPU's runtime cannot run every half x half -> fp32 GEMM (a Dense on
  3-D inputs failed with "Unsupported element type for DotThunk::Execute:
  BF16 x BF16 = F32"), and half values multiply exactly in fp32, so the sum
  is the same. The branch is chosen where the step is lowered
  (``lax.platform_dependent``): a step compiled for a GPU, on a CPU-only
  machine too, keeps its half GEMM, and so do jaxpr audits
  (:func:`jmp_lab.diagnostics.audit_step` reads the default branch).
  Used by :mod:`jmp_lab.reduce`'s weight gradients and by
  :mod:`jmp_lab.autocast`'s matmul rule (a matmul that asks for an fp32
  result keeps it, with half operands).

  >>> import jax, jax.numpy as jnp
  >>> x = jnp.ones((4, 2, 3), jnp.bfloat16)
  >>> out = accumulated(lambda a, b: jax.lax.dot_general(
  ...     a, b, (((0, 1), (0, 1)), ((), ())),
  ...     preferred_element_type=jnp.float32), (x, x), jnp.float32)
  >>> out.dtype, float(out[0, 0])
  (dtype('float32'), 8.0)
  """
  accumulate_dtype = np.dtype(accumulate_dtype)
  if all(np.dtype(x.dtype) == accumulate_dtype for x in operands):
    return product(*operands)

  def upcast_first(*operands):
    with scopes.scope(accumulate_dtype):  # as written under the rules too
      # The barrier keeps XLA:CPU from folding the casts back into the GEMM.
      return product(*lax.optimization_barrier(
          tuple(x.astype(accumulate_dtype) for x in operands)))

  return lax.platform_dependent(*operands, cpu=upcast_first, default=product)
