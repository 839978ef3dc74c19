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
  >>> recorder.describe()
  '3 steps, none skipped; loss scale 32768 throughout'
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

  def describe(self, max_changes: int = 4) -> str:
    """What happened, in words: steps, skips, and the loss scale's path.

    A skipped step is normal with fp16 and a dynamic loss scale: the first
    steps overflow until the scale has backed off to what the gradients
    allow, as torch's ``GradScaler`` does.
    """
    history = self.history()
    steps = len(self)
    scales = history.get("loss_scale", np.zeros(0))
    skipped = history.get("skipped_steps", np.zeros(0))
    finite = history.get("grads_finite", np.zeros(0))
    if len(finite):  # exact, whenever recording began
      skips = int(np.sum(~finite.astype(bool)))
    else:  # the cumulative counter, recorded from the first step
      skips = int(skipped[-1]) if len(skipped) else 0
    text = f"{steps} step{'s' if steps != 1 else ''}, " + (
        "none skipped" if not skips else
        f"{skips} skipped (non-finite gradients: the update was not applied "
        f"and the loss scale backed off)")
    if len(scales):
      changes = [(i, scales[i - 1], scales[i]) for i in range(1, len(scales))
                 if scales[i] != scales[i - 1]]
      if not changes:
        text += f"; loss scale {scales[0]:g} throughout"
      else:
        shown = ", ".join(f"{a:g} -> {b:g} after step {i}"
                          for i, a, b in changes[:max_changes])
        more = len(changes) - max_changes
        text += (f"; loss scale {shown}" + (f" and {more} more changes"
                                            if more > 0 else "")
                 + f"; the last step ran at {scales[-1]:g}")
    return text

  def plot(self, path: Optional[str] = None):
    """Loss, loss scale (a log2 axis) and skipped steps (an integer axis)
    against the step; returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    history = self.history()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    axes[0].plot(history["loss"], lw=1, label="loss")
    axes[0].set(title="loss", xlabel="step", yscale="log")
    axes[1].plot(history["loss_scale"], lw=1, color="tab:orange",
                 label="loss scale")
    axes[1].set_yscale("log", base=2)
    axes[1].set(title="loss scale", xlabel="step")
    axes[2].step(np.arange(len(history["skipped_steps"])),
                 history["skipped_steps"], lw=1, color="tab:red",
                 where="post", label="skipped steps")
    axes[2].set(title="skipped steps (cumulative)", xlabel="step")
    axes[2].yaxis.set_major_locator(MaxNLocator(integer=True))
    skips = int(max(history["skipped_steps"], default=0))
    axes[2].set_ylim(bottom=0, top=max(1, skips) * 1.1)
    if not skips:  # a line on the axis reads as a missing plot
      axes[2].text(0.5, 0.5, "no step skipped", transform=axes[2].transAxes,
                   ha="center", va="center", color="tab:red")
    for ax in axes:
      ax.legend(fontsize=8)
    fig.tight_layout()
    if path:
      fig.savefig(path, dpi=120)
    return fig


__all__ = [
    "TrainingRecorder",
]
