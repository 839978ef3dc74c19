"""A per-thread count of nested ``with`` blocks.

The autocast interpreter and the NNX front end each ask "is this thread
inside one of my blocks?"; a thread-local depth answers it for re-entrant
blocks, and stays correct when several threads trace at once.
"""

import contextlib
import threading


class Nesting:
  """How deep this thread is inside :meth:`enter` blocks.

  >>> calls = Nesting()
  >>> calls.active
  False
  >>> with calls.enter():
  ...   with calls.enter():
  ...     pass
  ...   calls.active
  True
  >>> calls.active
  False
  """

  def __init__(self):
    self._local = threading.local()

  @contextlib.contextmanager
  def enter(self):
    self._local.depth = self.depth + 1
    try:
      yield
    finally:
      self._local.depth -= 1

  @property
  def depth(self) -> int:
    return getattr(self._local, "depth", 0)

  @property
  def active(self) -> bool:
    return self.depth > 0
