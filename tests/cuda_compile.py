"""Whether this installation can compile for an H100 without one."""

import pytest


def require_cuda_plugin() -> None:
  """Skips the calling test unless a CUDA plugin matching the installed jax
  is there (the gpu-compile extra's ``jax-cuda12-plugin``, or the
  ``jax-cuda13-plugin`` of the GPU machines): what
  :func:`jmp_lab.diagnostics.compile_for_gpu` needs."""
  from jmp_lab.diagnostics import compiled  # pylint: disable=import-outside-toplevel
  try:
    compiled.cuda_plugin()
  except RuntimeError as e:
    pytest.skip(f"no CUDA plugin to compile for an H100 with: {e}")
