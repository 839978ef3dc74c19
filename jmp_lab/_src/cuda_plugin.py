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

import contextlib
import importlib.util
import os
import re
import sys
import tempfile
from typing import Callable, Iterator, MutableMapping, Optional

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


# What the CUDA plugin's libraries print (C++, straight to file descriptor
# 2) when jaxlib loads them on a machine without a driver: "Could not find
# cuda drivers on your machine, GPU will not be used", once per library,
# each after absl's notice that logging is not initialized. True there, and
# said at every import: noise for a CPU-only user of the gpu-compile extra.
NO_DRIVER_NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called"
    r" are written to STDERR|\S+ \S+ +\d+ cudart_stub\.cc:\d+\] Could not "
    r"find cuda drivers on your machine, GPU will not be used\.)$")


@contextlib.contextmanager
def stderr_without(noise: re.Pattern) -> Iterator[None]:
  """File descriptor 2 (what C++ libraries print to) with the lines that
  match ``noise`` left out; every other line is written to it afterwards,
  in order."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as caught:
    os.dup2(caught.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      caught.seek(0)
      kept = [line for line in caught.read().decode(errors="replace")
              .splitlines(keepends=True) if not noise.match(line.rstrip("\n"))]
      if kept:
        os.write(2, "".join(kept).encode())


def import_jax_quietly(installed: Callable[[], bool] = plugin_installed,
                       gpu: Callable[[], bool] = gpu_may_be_present) -> None:
  """``import jax`` without the CUDA plugin's no-driver lines, where they
  can only be noise: a CUDA plugin is installed, no NVIDIA GPU may be here
  and jax is not imported yet (once it is, there is nothing left to
  quiet). Everything else jax prints still shows."""
  if "jax" in sys.modules or not installed() or gpu():
    import jax  # noqa: F401
    return
  with stderr_without(NO_DRIVER_NOISE):
    import jax  # noqa: F401


# jmp_lab/__init__.py imports this module first, before jax can have started
# a backend through jmp_lab.
import_jax_quietly()
import jax  # noqa: E402  (imported above, quietly where it was noise)

quiet_without_gpu()
