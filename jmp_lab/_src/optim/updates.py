"""What the train steps know of a jmp_lab optimizer's update function.

A jmp_lab optimizer is an ``optax.GradientTransformationExtraArgs`` whose
``update`` is one of these classes (not a closure), so a train step can ask
it, as data, for its policy and whether it can hand back the params its
kernel wrote. The state carries the policy too
(:func:`jmp_lab.state.optimizer_policy`); the update answers before there is
a state (``TrainState.create``).
"""

from __future__ import annotations

import abc
from typing import Any, Optional

from jmp_lab._src.policy import Policy


class Update:
  """The update of a jmp_lab optimizer
  (:class:`jmp_lab.optimizer.MixedPrecisionUpdate`,
  :class:`jmp_lab.fused.FusedUpdate`).

  Attributes:
    policy: the precision policy the optimizer was built with.
  """

  policy: Policy


class WritesParams(Update, abc.ABC):
  """An update that can hand back the new params its kernel wrote, with no
  ``updates`` tree and no ``optax.apply_updates`` pass
  (:class:`jmp_lab.fused.FusedUpdate`); the train steps use it where they
  can."""

  @abc.abstractmethod
  def new_params(self, grads: Any, state: Any, params: Any = None, *,
                 also_finite: Any = None) -> tuple[Any, Any]:
    """``(new params, new state)``."""


def policy_of(tx: Any) -> Optional[Policy]:
  """The policy a jmp_lab optimizer ``tx`` was built with, or None for any
  other optax transformation."""
  update = getattr(tx, "update", None)
  return update.policy if isinstance(update, Update) else None
