"""The planner: every module-level precision question, answered in one place.

A front end (:mod:`.linen`, :mod:`.nnx`) describes a module by its path and
the module object, and asks the :class:`Plan`: which policy the module
computes in (:meth:`Plan.decide`), what its inputs, params and outputs are
cast to, what its own ``dtype`` attribute becomes for the call, and which
matmul its Dense-like layers run (fp8, the reduce dtype's, or the compute
dtype's). The front ends hold no precision decision of their own: they apply
these answers with their framework's mechanics.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from jmp_lab._src.policy import MATMUL_MODES, Policy

F32 = np.dtype(jnp.float32)

# What a rule resolves to for a module that runs as written (rules.AS_WRITTEN).
_AS_WRITTEN = "as_written"

# Kinds of layer a front end can adapt (Plan.matmul_mode).
DENSE, EINSUM, CONV, EMBED = "dense", "einsum", "conv", "embed"


@dataclasses.dataclass(frozen=True)
class Decision:
  """What the plan decided for one module.

  Attributes:
    policy: the policy the module computes in; None: it runs as written.
    overridden: a rule matched the module or one of its parents (its
      output is then the override's ``output_dtype``).
  """

  policy: Optional[Policy]
  overridden: bool

  @property
  def as_written(self) -> bool:
    return self.policy is None

  @property
  def compute_dtype(self) -> np.dtype:
    """The dtype the module's call runs in (fp32 when as written)."""
    return F32 if self.policy is None else self.policy.compute_dtype


@dataclasses.dataclass(frozen=True)
class Plan:
  """A policy and its module rules (first match wins).

  Example::

    >>> import flax.linen as nn
    >>> from jmp_lab._src.policy import get_policy
    >>> from jmp_lab._src.precision.rules import rules_from_options
    >>> policy = get_policy("mixed_bfloat16")
    >>> plan = Plan(policy, rules_from_options(policy))
    >>> plan.decide([("norm", nn.LayerNorm())]).compute_dtype   # fp32 norms
    dtype('float32')
    >>> plan.decide([("mlp", nn.Dense(4))]).compute_dtype
    dtype(bfloat16)
  """

  policy: Policy
  rules: tuple  # of rules.PrecisionRule, first match wins

  def decide(self, chain: Sequence[tuple[str, Any]]) -> Decision:
    """The decision for the first module of ``chain``: ``(path, module)``
    pairs from the module up to the model. The first rule matching the
    module decides; else its nearest matched parent's; else the policy."""
    for path, module in chain:
      for rule in self.rules:
        if rule.matches(path, module):
          resolved = rule.resolve(self.policy, module)
          return Decision(None if resolved == _AS_WRITTEN else resolved,
                          True)
    return Decision(self.policy, False)

  def output_dtype(self, decision: Decision, top: bool) -> Optional[np.dtype]:
    """What a module's floating outputs are cast to: an override's output
    dtype; the model's: the policy's ``output_dtype``; any other module's:
    the compute dtype (None: as written)."""
    if decision.as_written:
      return None
    if decision.overridden:
      return decision.policy.output_dtype
    return self.policy.output_dtype if top else self.policy.compute_dtype

  def param_dtype(self, decision: Decision, param_path: str
                  ) -> Optional[np.dtype]:
    """The dtype a param is read in: a path rule matching the param's own
    path, else its module's compute dtype (None: as stored)."""
    for rule in self.rules:
      if rule.matches_params and re.search(rule.path, param_path):
        resolved = rule.resolve(self.policy)
        return None if resolved == _AS_WRITTEN else resolved.compute_dtype
    return None if decision.as_written else decision.policy.compute_dtype

  def own_matmul(self, decision: Decision, mode: Optional[str],
                 layer_sets_matmul: bool) -> Optional[str]:
    """The ``matmul=`` format of the weight matmuls a module's own code
    writes (a ``dot_general`` of its param, as Hugging Face's
    ``FlaxConv1D`` writes it): the policy's, unless the module runs as
    written, its layer's matmul (``mode``) is jmp_lab's product already
    (Dense, DenseGeneral, Einsum), or the layer was given a matmul of its
    own (``dot_general=``, ``einsum_op=``: ``layer_sets_matmul``), which it
    keeps as written."""
    if decision.as_written or mode in MATMUL_MODES or layer_sets_matmul:
      return None
    return decision.policy.matmul

  def layer_dtype(self, decision: Decision) -> Optional[np.dtype]:
    """What a layer's own ``dtype`` attribute is for its call (None: left
    as it is): the module's compute dtype. A public model passes a config's
    ``dtype=float32`` to every layer; the policy wins over it (a
    ``"layer_dtype"`` rule keeps it: the decision is then that dtype)."""
    return None if decision.as_written else decision.compute_dtype

  def matmul_mode(self, decision: Decision, kind: Optional[str],
                  own_matmul: bool) -> Optional[str]:
    """How a layer of ``kind`` runs its matmul: ``"fp8"`` or
    ``"fp8_current"`` (Dense-like and Einsum layers under an fp8 policy),
    ``"reduce"`` (its weight gradient summed in the reduce dtype), or None
    (the compute dtype). A layer that sets its own matmul keeps it. fp8
    wins over the reduce dtype: its weight gradient comes out of the fp8
    GEMM."""
    if decision.as_written or own_matmul or kind is None:
      return None
    policy = decision.policy
    if policy.matmul is not None and kind in (DENSE, EINSUM):
      return policy.matmul
    if policy.reduce_dtype is not None and kind in (DENSE, EINSUM, CONV):
      return "reduce"
    return None

  def bias_reduce_dtype(self, decision: Decision, fp8_bias_inside: bool
                        ) -> Optional[np.dtype]:
    """The dtype a layer's bias gradient is summed in when the front end
    attaches it (None: flax's own, in the compute dtype). The fp8 product
    that adds the bias sums its gradient in fp32 already."""
    if decision.as_written or fp8_bias_inside:
      return None
    return decision.policy.reduce_dtype

  def tied_logits(self, decision: Decision) -> Optional[tuple]:
    """For an embedding's ``attend`` (tied logits) under a reduce dtype:
    ``(compute dtype, reduce dtype)``: the GEMM in the model's compute
    dtype, the table's gradient summed in the reduce dtype."""
    if decision.as_written or decision.policy.reduce_dtype is None:
      return None
    return self.policy.compute_dtype, decision.policy.reduce_dtype
