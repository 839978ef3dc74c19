"""What the interpreter reports while it runs, to whoever listens.

The engine decides; diagnostics (matmul counts, precision warnings) listen
from outside it (:mod:`jmp_lab._src.precision_warnings`). A listener is a
function of the operand dtypes of each matmul the rules run, registered for
the duration of a ``with`` block on the current thread.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Callable, Sequence

import numpy as np

_local = threading.local()


@contextlib.contextmanager
def listening(on_matmul: Callable[..., None]):
  """Calls ``on_matmul(operand_dtypes, written_dtypes, in_loss)`` for each
  matmul the rules run on this thread while the block traces: the operand
  dtypes it runs with and those the code wrote; ``in_loss``: a loss's rules
  (an island with half matmuls) decided it, not a model's policy."""
  listeners = _local.__dict__.setdefault("listeners", [])
  listeners.append(on_matmul)
  try:
    yield
  finally:
    listeners.remove(on_matmul)


@contextlib.contextmanager
def muted():
  """Nothing is reported while the block runs (an abstract trace the
  interpreter makes to learn a loop's types, before the real one)."""
  saved = _local.__dict__.get("listeners", [])
  _local.listeners = []
  _local.muted = getattr(_local, "muted", 0) + 1
  try:
    yield
  finally:
    _local.listeners = saved
    _local.muted -= 1


def matmul_ran(operand_dtypes: Sequence[np.dtype],
               written_dtypes: Sequence[np.dtype], in_loss: bool,
               in_model: bool = False) -> None:
  """Tells the listeners a matmul ran with ``operand_dtypes``: put in half
  by a train step's loss rules (``in_loss``), or inside a model's policy
  (``in_model``: a front end's module call, an autocast region)."""
  for listener in getattr(_local, "listeners", ()):
    listener(operand_dtypes, written_dtypes, in_loss, in_model)


# Places the rules could not reach, warned about once each.
_WARNED: set = set()


def fp8_unreached(path: str) -> None:
  """Warns, once per module, that ``matmul=fp8`` (delayed scaling) does
  not reach a weight matmul the module writes itself."""
  if ("fp8", path) in _WARNED or getattr(_local, "muted", 0):
    return
  _WARNED.add(("fp8", path))
  warnings.warn(
      f"matmul=fp8 does not reach the weight matmul {path!r} writes itself "
      f"(a dot_general of its param): it runs in the compute dtype. Delayed "
      f"scaling keeps its state in Dense, DenseGeneral and Einsum layers "
      f"(NNX: Linear, LinearGeneral, Einsum); use matmul=fp8_current "
      f"(current scaling, no state), which reaches it, or write the layer "
      f"as one of those", stacklevel=4)


def unreached(primitive: str, path: str, why: str) -> None:
  """Warns, once per place, that the rules left an op as written."""
  if (primitive, path) in _WARNED or getattr(_local, "muted", 0):
    return
  _WARNED.add((primitive, path))
  warnings.warn(f"jmp_lab.autocast: the {primitive} at {path!r} runs as "
                f"written ({why})", stacklevel=4)
