"""What one ``fused_adamw`` is: its checked configuration, shared by the
layouts' steps (:mod:`.fused_tree`, :mod:`.fused_flat`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lab.kernels.reference import inverse_bias_corrections

ScalarOrSchedule = Union[float, Callable[[jax.Array], jax.Array]]


@dataclasses.dataclass(frozen=True, eq=False)
class FusedSpec:
  """The static part of a ``fused_adamw``: checked arguments and the
  kernel's configuration (hashed by identity).

  Attributes:
    policy, loss_scale, learning_rate, b1, b2, eps, weight_decay, mask,
      max_grad_norm, axis_name, shards: ``fused_adamw``'s arguments.
    backend: the flat layout's backend; ``tree_backend`` the tree layout's.
    layout: ``"tree"`` or ``"flat"``.
    master: how the fp32 master is kept (:class:`~.masters.Master`).
    config: the kernel's static configuration.
    mu_dtype, nu_dtype: the moments' stored dtypes.
  """

  policy: Any            # a jmp_lab.Policy
  loss_scale: Any        # a jmp_lab.LossScale
  learning_rate: ScalarOrSchedule
  b1: float
  b2: float
  eps: float
  weight_decay: float
  mask: Any
  max_grad_norm: Optional[float]
  axis_name: Optional[str]
  shards: int
  backend: str
  tree_backend: str
  layout: str
  master: Any            # a masters.Master
  config: Any            # a kernels.AdamWConfig
  mu_dtype: np.dtype
  nu_dtype: np.dtype

  def hyper(self, count: jax.Array, clip: jax.Array, scale: jax.Array
            ) -> jax.Array:
    """The kernel's f32[5] scalars: learning rate, Adam's two inverse bias
    corrections, the loss scale and the clip factor."""
    lr = (self.learning_rate(count) if callable(self.learning_rate)
          else self.learning_rate)
    inv_bias1, inv_bias2 = inverse_bias_corrections(self.b1, self.b2,
                                                    count + 1)
    return jnp.stack([jnp.asarray(x, jnp.float32) for x in
                      (lr, inv_bias1, inv_bias2, scale, clip)])

  def clip_factor(self, sumsq: jax.Array) -> jax.Array:
    """The factor that clips the unscaled gradients to ``max_grad_norm``."""
    if self.max_grad_norm is None:
      return jnp.float32(1.0)
    norm = jnp.sqrt(sumsq)
    return jnp.where(norm < self.max_grad_norm, 1.0, self.max_grad_norm / norm)

  def decay_mask(self, params: Any) -> Any:
    if self.mask is None:
      return jax.tree_util.tree_map(lambda _: True, params)
    return self.mask(params) if callable(self.mask) else self.mask

  def next_state(self, state: Any, finite: jax.Array, master, mu, nu,
                 remainders=None) -> Any:
    """The state after a step: the counters and loss scale advance by the
    finite flag; the kernel's outputs are the new buffers."""
    return state._replace(
        count=state.count + finite.astype(jnp.int32),
        master_params=master if self.master.fp32_copy else None,
        master_remainder=remainders, mu=mu, nu=nu,
        loss_scale=state.loss_scale.adjust(finite),
        skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
        last_step_applied=finite)
