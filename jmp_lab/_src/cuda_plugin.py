"""jax's CUDA plugin on a machine without an NVIDIA GPU: quiet, and kept for
compiling for one.

The ``gpu-compile`` extra installs jax's CUDA plugin, whose compiler builds a
step for an H100 on a CPU-only machine
(:func:`jmp_lab.diagnostics.compile_for_gpu`). When jax starts a backend it
initializes every installed plugin. The CUDA plugin first checks the CUDA
libraries' versions; without a GPU (no driver) that check fails, jax logs a
"Jax plugin configuration error ... Unable to load CUDA" traceback on every
run, and the plugin is left unregistered, so a compile for an H100 fails too.

Where no NVIDIA GPU can be present, the check can only fail, so jmp_lab
turns it off with the plugin's own switch (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK``)
before jax starts: the plugin registers, jax's attempt to open a CUDA device
fails quietly (jax logs it at INFO level) and jax runs on the CPU, and a
compile for an H100 works without ``JAX_PLATFORMS=cpu``. Where a GPU may be
present, or the platforms were chosen (``JAX_PLATFORMS`` or
``jax.config.update("jax_platforms", ...)``), nothing changes: a real GPU
user keeps jax's version check and its messages.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable, MutableMapping, Optional

import jax

SKIP_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
# The files jax itself reads to tell whether an NVIDIA GPU may be here
# (jax._src.hardware_utils.has_visible_nvidia_gpu): a GPU, a container's
# control device, WSL2's GPU bridge.
GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
# The plugin modules jax discovers: CUDA 12 (the gpu-compile extra's) and 13.
PLUGIN_MODULES = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def plugin_installed() -> bool:
  """Whether a CUDA plugin jax would initialize is installed (found, not
  imported: importing it loads CUDA's libraries)."""
  for name in PLUGIN_MODULES:
    try:
      if importlib.util.find_spec(name) is not None:
        return True
    except (ImportError, ValueError):
      continue
  return False


def gpu_may_be_present() -> bool:
  """jax's own test: an NVIDIA device file exists."""
  return any(os.path.exists(path) for path in GPU_DEVICE_FILES)


def configured_platforms() -> Optional[str]:
  """``jax.config.jax_platforms``: set by ``JAX_PLATFORMS`` when jax was
  imported, or by ``jax.config.update``."""
  return getattr(jax.config, "jax_platforms", None)


def quiet_without_gpu(
    environ: MutableMapping[str, str] = os.environ,
    installed: Callable[[], bool] = plugin_installed,
    gpu: Callable[[], bool] = gpu_may_be_present,
    platforms: Callable[[], Optional[str]] = configured_platforms) -> bool:
  """Turns the CUDA plugin's version check off where it can only fail.

  Runs when jmp_lab is imported, before jax starts a backend. Returns
  whether it did: a CUDA plugin is installed, no NVIDIA GPU may be present,
  the platforms were not chosen and the switch was not already set.
  Setting the switch after jax started a backend changes nothing.
  """
  # Chosen platforms: the plugin skips the check itself unless CUDA is among
  # them, and then the user asked for CUDA and its messages.
  if SKIP_CHECK in environ or environ.get("JAX_PLATFORMS") or platforms():
    return False
  if not installed() or gpu():
    return False
  environ[SKIP_CHECK] = "1"
  return True


# jmp_lab/__init__.py imports this module first, before jax can have started
# a backend through jmp_lab.
quiet_without_gpu()
