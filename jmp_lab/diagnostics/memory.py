"""Memory: compiled figures, state bytes per parameter, activation bytes.

:func:`memory_row` measures one configuration (a policy and optimizer):
parameter and master bytes, optimizer-state bytes, the activation bytes the
backward pass keeps, and XLA's compiled memory analysis of the step;
:func:`memory_report` puts rows side by side.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np

from jmp_lab.kernels import pytrees
from jmp_lab._src.optim.states import find_state

# --------------------------------------------------------------------------
# Memory report.
# --------------------------------------------------------------------------


def compiled_memory(compiled) -> dict[str, int]:
  """XLA's ``memory_analysis()`` of a compiled function, in bytes.

  Keys: ``argument``, ``output``, ``alias``, ``temp`` and ``peak``. Where the
  backend reports no peak, it is arguments + outputs - aliased + temporaries.
  """
  stats = compiled.memory_analysis()
  if stats is None:
    return {}
  memory = {k: int(getattr(stats, k + "_size_in_bytes", 0)) for k in
            ("argument", "output", "alias", "temp")}
  memory["peak"] = int(getattr(stats, "peak_memory_in_bytes", 0)) or (
      memory["argument"] + memory["output"] - memory["alias"] + memory["temp"])
  return memory


def _leaf_bytes(x: Any) -> int:
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    # A typed PRNG key (e.g. the stochastic-rounding key) has no numpy
    # dtype: count the words it is made of.
    x = jax.eval_shape(jax.random.key_data, x)
  return x.size * np.dtype(x.dtype).itemsize


def _tree_bytes(tree: Any) -> int:
  return sum(_leaf_bytes(x) for x in jax.tree_util.tree_leaves(tree)
             if hasattr(x, "dtype"))


def activation_bytes(loss_fn: Callable[..., Any], *args) -> int:
  """Bytes the backward pass keeps from the forward pass, minus the inputs.

  These are the residuals ``jax.vjp`` saves (activations, and half copies of
  params made inside the step); arguments themselves are not counted.
  """
  from jax._src.ad_checkpoint import saved_residuals  # no public equivalent
  return sum(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
             for aval, source in saved_residuals(loss_fn, *args)
             if not source.startswith("from the argument"))


@dataclasses.dataclass
class MemoryRow:
  name: str
  params: int                 # parameters (count)
  param_bytes: int            # params + the stored fp32 master copy
  optimizer_bytes: int        # moments, remainders, scale, counters
  activation_bytes: int
  compiled: dict[str, int]    # XLA memory_analysis of the step
  device_peak: Optional[int]  # memory_stats()["peak_bytes_in_use"] (GPU)
  grad_bytes: int = 0         # the gradients, in the param dtype

  @property
  def state_bytes_per_param(self) -> float:
    """Params plus optimizer state (master, remainder, moments) per param."""
    return (self.param_bytes + self.optimizer_bytes) / max(self.params, 1)

  @property
  def with_grads_bytes_per_param(self) -> float:
    """:attr:`state_bytes_per_param` plus the gradients (the usual "16
    bytes per parameter" of mixed-precision Adam counts them)."""
    return self.state_bytes_per_param + self.grad_bytes / max(self.params, 1)


def memory_row(name: str, *, params: Any, opt_state: Any,
               loss_fn: Callable[..., Any], loss_args: Sequence[Any],
               step: Optional[Callable[..., Any]] = None,
               step_args: Sequence[Any] = ()) -> MemoryRow:
  """The memory figures of one configuration (see :func:`memory_report`)."""
  try:  # the master as stored (not rebuilt from a remainder)
    stored_master = find_state(opt_state).master_params
  except ValueError:
    stored_master = None
  master_bytes = _tree_bytes(stored_master) if stored_master is not None else 0
  compiled, peak = {}, None
  if step is not None:
    compiled = compiled_memory(jax.jit(step).lower(*step_args).compile())
    device_stats = jax.local_devices()[0].memory_stats() or {}
    peak = device_stats.get("peak_bytes_in_use")
  floating = [x for x in jax.tree_util.tree_leaves(params)
              if pytrees.is_floating_array(x)]
  n_params = sum(x.size for x in floating)
  return MemoryRow(
      grad_bytes=_tree_bytes(floating),
      name=name, params=n_params,
      param_bytes=_tree_bytes(params) + master_bytes,
      optimizer_bytes=_tree_bytes(opt_state) - master_bytes,
      activation_bytes=activation_bytes(loss_fn, *loss_args),
      compiled=compiled, device_peak=peak)


@dataclasses.dataclass
class MemoryReport:
  """Memory rows side by side (see :func:`memory_report`)."""

  rows: list[MemoryRow]

  def table(self) -> str:
    """A markdown table, one row per configuration."""
    return _memory_table(self.rows)

  def __str__(self) -> str:
    return self.table()


def memory_report(rows: Sequence[MemoryRow]) -> MemoryReport:
  """The :class:`MemoryRow` s of several configurations, as one report."""
  return MemoryReport(list(rows))


def _memory_table(rows: Sequence[MemoryRow]) -> str:
  mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
  lines = ["| config | param+master MiB | optimizer MiB "
           "| B/param (params + state) | B/param (+ grads) "
           "| activations MiB | compiled args MiB | temp MiB | peak MiB "
           "| device peak MiB |", "|" + "---|" * 10]
  for r in rows:
    c = r.compiled
    lines.append(
        f"| {r.name} | {mib(r.param_bytes)} | {mib(r.optimizer_bytes)} | "
        f"{r.state_bytes_per_param:.1f} | {r.with_grads_bytes_per_param:.1f} | "
        f"{mib(r.activation_bytes)} | "
        f"{mib(c.get('argument', 0))} | {mib(c.get('temp', 0))} | "
        f"{mib(c.get('peak', 0))} | "
        f"{mib(r.device_peak) if r.device_peak else 'n/a'} |")
  return "\n".join(lines)


__all__ = [
    "activation_bytes",
    "compiled_memory",
    "memory_report",
    "memory_row",
    "MemoryReport",
    "MemoryRow",
]
