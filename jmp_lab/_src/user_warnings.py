"""jmp_lab's warning about precision, and the user's line it points at.

A base-layer module: the engine (:mod:`jmp_lab._src.precision_warnings`)
and the optimizers (:mod:`jmp_lab._src.optim.scaled`) both warn with
:class:`PrecisionWarning`, at :func:`user_stacklevel`.
"""

from __future__ import annotations

import os
import sys


class PrecisionWarning(UserWarning):
  """A policy asks for half precision where the computation does not run in
  it (see ``warn_unless_half``), a loss is computed in half precision (see
  ``warn_if_half_loss``), or a loss-scaling optimizer is handed gradients
  of an unscaled loss (see :class:`jmp_lab.ScaledGradients`)."""


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Frames of these libraries are not the user's line: a warning raised while
# jax traces, Flax applies, optax chains or Equinox filters points past them.
_LIBRARIES = ("jax", "flax", "optax", "equinox")


def in_jmp_lab(filename: str) -> bool:
  """Whether ``filename`` is one of jmp_lab's own files (never the user's
  line)."""
  return os.path.abspath(filename).startswith(_PACKAGE + os.sep)


def _is_library_frame(filename: str) -> bool:
  return (in_jmp_lab(filename)
          or any(f"{os.sep}{name}{os.sep}" in filename for name in _LIBRARIES)
          or f"{os.sep}contextlib" in filename)


def user_stacklevel() -> int:
  """The ``stacklevel`` for ``warnings.warn``, called from the function
  that warns: the first frame outside jmp_lab, jax, Flax, optax and
  Equinox, which is the user's line (a loop, or the call that traced the
  step)."""
  frame, level = sys._getframe(1), 1
  while frame is not None:
    if not _is_library_frame(frame.f_code.co_filename):
      return level
    frame, level = frame.f_back, level + 1
  return 2
