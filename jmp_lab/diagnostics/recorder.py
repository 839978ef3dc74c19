"""A host-side recorder of the loss, the loss scale and skipped steps.

Example::

  >>> import jax.numpy as jnp
  >>> from jmp_lab.diagnostics import TrainingRecorder
  >>> recorder = TrainingRecorder()
  >>> for step in range(3):
  ...   recorder.record({"loss": jnp.float32(1.0 / (step + 1)),
  ...                    "loss_scale": jnp.float32(2.0**15),
  ...                    "skipped_steps": jnp.int32(0)})
  >>> [round(float(x), 2) for x in recorder.history()["loss"]]
  [1.0, 0.5, 0.33]
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np

# --------------------------------------------------------------------------
# Host-side recorder.
# --------------------------------------------------------------------------


class TrainingRecorder:
  """Keeps each step's metrics as device arrays; reads them afterwards.

  ``record(metrics)`` only appends references, so it never waits for the
  device; ``history()`` (or ``plot``) transfers everything at once, after
  training or whenever you choose.
  """

  KEYS = ("loss", "loss_scale", "skipped_steps", "grads_finite")

  def __init__(self, keys: Sequence[str] = KEYS):
    self.keys = tuple(keys)
    self._steps: list[dict[str, Any]] = []

  def record(self, metrics: Mapping[str, Any]) -> None:
    self._steps.append({k: metrics[k] for k in self.keys if k in metrics})

  def __len__(self) -> int:
    return len(self._steps)

  def history(self) -> dict[str, np.ndarray]:
    fetched = jax.device_get(self._steps)
    return {k: np.asarray([step[k] for step in fetched if k in step])
            for k in self.keys}

  def plot(self, path: Optional[str] = None):
    """Loss, loss scale and skipped steps against the step; returns the figure."""
    import matplotlib.pyplot as plt
    history = self.history()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    axes[0].plot(history["loss"], lw=1)
    axes[0].set(title="loss", xlabel="step", yscale="log")
    axes[1].plot(history["loss_scale"], lw=1, color="tab:orange")
    axes[1].set(title="loss scale", xlabel="step", yscale="log")
    axes[2].plot(history["skipped_steps"], lw=1, color="tab:red")
    axes[2].set(title="skipped steps (cumulative)", xlabel="step")
    fig.tight_layout()
    if path:
      fig.savefig(path, dpi=120)
    return fig
