"""Fused optimizer kernels and the backend chooser.

Backends, one per file:

* ``"mosaic"`` (:mod:`.mosaic`) -- Mosaic GPU / ``plgpu``, for Hopper
  (compute capability >= 9.0);
* ``"triton"`` (:mod:`.pallas_triton`) -- Pallas' Triton backend, for NVIDIA
  GPUs of compute capability >= 8.0 (deprecated upstream in jax 0.11);
* ``"interpret"`` (:mod:`.pallas_triton`) -- the same Pallas kernel in
  interpret mode, on any device (slow; for tests);
* ``"reference"`` (:mod:`.reference`) -- plain jnp, the fallback everywhere.

``"auto"`` picks mosaic, then triton, then reference, and logs its choice.
"""

from __future__ import annotations

import logging
from typing import Optional

import jax

from jmp_lab.kernels import pallas_triton, reference
from jmp_lab.kernels.reference import AdamWConfig, Outputs

logger = logging.getLogger("jmp_lab")

BACKENDS = ("auto", "mosaic", "triton", "interpret", "reference")


def _compute_capability(device: jax.Device) -> Optional[float]:
  capability = getattr(device, "compute_capability", None)
  return None if capability is None else float(capability)


def available_backends(device: Optional[jax.Device] = None) -> tuple[str, ...]:
  """The backends that can run on ``device`` (default: the first device)."""
  device = device or jax.local_devices()[0]
  found = []
  capability = _compute_capability(device)
  if device.platform == "gpu" and capability is not None:
    if capability >= 9.0 and _importable("jax.experimental.pallas.mosaic_gpu"):
      found.append("mosaic")
    if capability >= 8.0 and _importable("jax.experimental.pallas.triton"):
      found.append("triton")
  found += ["interpret", "reference"]
  return tuple(found)


def _importable(module: str) -> bool:
  try:
    __import__(module)
    return True
  except ImportError:
    return False


def resolve_backend(backend: str, device: Optional[jax.Device] = None) -> str:
  """Turns ``backend`` (maybe ``"auto"``) into a backend that can run here.

  Raises:
    ValueError: for an unknown name, or an explicit backend this device
      cannot run.
  """
  if backend not in BACKENDS:
    raise ValueError(
        f"unknown fused backend {backend!r}; accepted: {', '.join(BACKENDS)}")
  device = device or jax.local_devices()[0]
  available = available_backends(device)
  if backend == "auto":
    chosen = next(b for b in ("mosaic", "triton", "reference")
                  if b in available)
    logger.info("jmp_lab fused update: backend %r on %s", chosen,
                device.device_kind)
    return chosen
  if backend not in available:
    raise ValueError(
        f"fused backend {backend!r} is not available on {device.device_kind} "
        f"({device.platform}); available here: {', '.join(available)}")
  return backend


def fused_update(backend: str, config: AdamWConfig, g, p, mu, nu, hyper,
                 flags) -> Outputs:
  """Runs the fused update with a resolved ``backend``."""
  if backend == "reference":
    return reference.fused_update(config, g, p, mu, nu, hyper, flags)
  if backend in ("interpret", "triton"):
    return pallas_triton.fused_update(config, g, p, mu, nu, hyper, flags,
                                      interpret=backend == "interpret")
  if backend == "mosaic":
    from jmp_lab.kernels import mosaic  # imports plgpu: GPU builds only
    return mosaic.fused_update(config, g, p, mu, nu, hyper, flags)
  raise ValueError(f"unresolved fused backend {backend!r}")


__all__ = ["AdamWConfig", "BACKENDS", "Outputs", "available_backends",
           "fused_update", "resolve_backend"]
