"""What this installation and machine can run: Pallas modules that come and
go with jax versions, the local GPU, and jax 0.11's Triton deprecation."""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Optional

import jax

from jmp_lab import _compat


def importable(module: str) -> bool:
  """Whether ``module`` imports here (the Pallas GPU modules come and go
  with jax versions: Triton's is deprecated in 0.11)."""
  try:
    __import__(module)
    return True
  except ImportError:
    return False


# The exact text jax 0.11 warns with when it lowers a Triton kernel.
TRITON_DEPRECATION = (r"The Pallas Triton backend is deprecated and will be "
                      r"removed in a future JAX version\.")


def kernel_on_cuda(kernel: Callable, xla: Callable, *args,
                   batched: Optional[Callable] = None):
  """``kernel(*args)`` in a program compiled for CUDA, ``xla(*args)``
  elsewhere and under ``vmap`` (a Pallas kernel under
  ``custom_partitioning`` has no batching rule); both must return the same
  arrays. Under ``vmap`` with every argument mapped, ``batched(*args)``
  instead (the mapped axis first in each argument and result), where a
  kernel's own op can take the mapped arguments at once. The dispatch
  every one-pass quantize kernel shares. Traced without its call site
  (:func:`jmp_lab._compat.without_call_site`), so that XLA merges calls on
  one input made from different places.

  >>> import jax.numpy as jnp
  >>> kernel_on_cuda(lambda x: x + 1, lambda x: x - 1, jnp.zeros(2))  # a CPU
  Array([-1., -1.], dtype=float32)
  """
  dispatch = jax.custom_batching.custom_vmap(
      lambda *a: jax.lax.platform_dependent(*a, cuda=kernel, default=xla))

  @dispatch.def_vmap
  def _batched(axis_size, in_batched, *a):
    del axis_size
    if batched is not None and all(in_batched):
      out = batched(*a)
    else:
      out = jax.vmap(xla, in_axes=tuple(0 if b else None for b in in_batched)
                     )(*a)
    return out, jax.tree.map(lambda _: True, out)

  # One kernel on one input from several call sites (the query, key and
  # value projections of one input) lowers to one kernel XLA can merge.
  with _compat.without_call_site():
    return dispatch(*args)


@functools.cache
def quiet_triton_deprecation() -> None:
  """Ignores jax 0.11's Triton deprecation warning, once jmp_lab builds a
  Triton kernel: only that message, only as a DeprecationWarning.

  jax warns when the kernel is lowered, which is when the jit around the
  whole step compiles, after jmp_lab's call has returned: a filter scoped to
  the call cannot see it, so this one lasts for the process, and a process
  that never builds a Triton kernel never installs it.
  """
  warnings.filterwarnings("ignore", message=TRITON_DEPRECATION,
                          category=DeprecationWarning)


def local_gpu_capability() -> Optional[float]:
  """The compute capability of the first local GPU, or None."""
  for device in jax.local_devices():
    if device.platform == "gpu":
      capability = getattr(device, "compute_capability", None)
      return None if capability is None else float(capability)
  return None


__all__ = [
    "TRITON_DEPRECATION",
    "importable",
    "kernel_on_cuda",
    "local_gpu_capability",
    "quiet_triton_deprecation",
]
