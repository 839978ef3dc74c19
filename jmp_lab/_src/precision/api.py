"""``autocast(fn, policy)``: the precision engine for any JAX function."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional, Union

from jmp_lab._src.precision.interpreter import apply_rules
from jmp_lab._src.precision.rules import Rules, make_rules
from jmp_lab._src.policy import BLOCK_SCALED_MODES, Policy, get_policy

PolicySpec = Union[Policy, str]


def autocast(fn: Callable[..., Any], policy: PolicySpec, *,
             fp32_ops: Optional[Iterable[str]] = None,
             extra_fp32_ops: Iterable[str] = (),
             exclude: Union[str, Iterable[str], None] = None
             ) -> Callable[..., Any]:
  """``fn`` under the policy's precision rules (see :mod:`jmp_lab.precision`).

  Under a half compute dtype, matmuls and convolutions run in it with fp32
  accumulation; exp, log, the sum reductions and what feeds only them
  (softmax, log-sum-exp, norm statistics, losses) run in fp32, as does what
  the code explicitly upcasts; everything else computes in the compute
  dtype, with ``fn``'s floating arguments and constants read in it where
  they are used. Floating outputs are cast to ``output_dtype``.

  Args:
    fn: any JAX function (plain JAX, Equinox, a Flax ``apply``). Its array
      arguments are traced; other arguments (Python scalars, functions,
      Equinox's static fields) are passed as they are.
    policy: a :class:`~jmp_lab.Policy` or its spec; its ``compute_dtype`` is
      the matmuls' dtype and its ``output_dtype`` the outputs'. A full
      precision compute dtype leaves ``fn`` as written.
    fp32_ops: the primitives to run in fp32 (default
      :data:`~jmp_lab.precision.FP32_OPS`).
    extra_fp32_ops: primitives to add to them (e.g. ``"tanh"``).
    exclude: regular expressions over named-scope paths whose ops run as
      written (e.g. ``"head"``; linen module paths are named scopes).

  Returns:
    An :class:`Autocast`: a function with ``fn``'s signature, whose
    ``policy`` and ``rules`` say what it does.

  Raises:
    TypeError: if ``fn`` is not callable or an ``exclude`` entry is not a
      string.
    ValueError: for a bad policy spec, a policy with per-tensor fp8 matmuls
      (``matmul=fp8``/``fp8_current``: autocast has none), an unknown
      primitive name or an invalid regular expression. Block-scaled
      matmuls (``matmul=mxfp8``/``nvfp4``) are supported: a
      ``dot_general`` is block-scaled when its right operand is stored (an
      argument such as a weight, or computed from arguments alone: ``x @
      w``) or its left operand is an argument as handed in (``w @ x``, as
      Equinox's ``Linear`` writes it), that operand as the weight; of two
      such operands the right one. A ``dot_general`` of two computed
      operands (attention's) runs in the compute dtype, as under the Flax
      front ends, where only Dense/Linear/Einsum layers are block-scaled.

  Example::

    >>> import jax, jax.numpy as jnp, jmp_lab
    >>> def attention(q, k, v):        # a custom attention, fp32 as written
    ...   weights = jax.nn.softmax(q @ k.T / 8.0)
    ...   return weights @ v
    >>> q = k = v = jnp.ones((16, 64))
    >>> jaxpr = jax.make_jaxpr(jmp_lab.autocast(attention, "mixed_bfloat16"))(q, k, v)
    >>> sorted({str(e.invars[0].aval.dtype) for e in jaxpr.eqns
    ...         if e.primitive.name in ("dot_general", "exp")})
    ['bfloat16', 'float32']
  """
  if not callable(fn):
    raise TypeError(f"autocast needs a callable fn, got {type(fn).__name__} "
                    f"{fn!r}")
  policy = get_policy(policy)
  if policy.matmul is not None and policy.matmul not in BLOCK_SCALED_MODES:
    # A per-tensor fp8 GEMM needs to know where its scaling state lives (and
    # the delayed one keeps state): an op-level rule does not.
    raise ValueError(
        f"autocast has no fp8 matmuls: policy {str(policy)!r} "
        f"asks for "
        f"matmul={policy.matmul}, which would be silently left out. Use "
        f"jmp_lab.linen.with_policy or jmp_lab.nnx.with_policy for Flax "
        f"models, or call jmp_lab.fp8.dot_general / jmp_lab.fp8.einsum in "
        f"your own layers (they compose with autocast), and give autocast "
        f"the policy without matmul= (autocast does run the block-scaled "
        f"matmul=mxfp8 and matmul=nvfp4, which keep no scaling state)")
  rules = make_rules(policy.compute_dtype, fp32_ops=fp32_ops,
                     extra_fp32_ops=extra_fp32_ops, exclude=exclude,
                     block_scaled=policy.matmul)
  return Autocast(fn, policy, rules)


@dataclasses.dataclass(frozen=True, eq=False)
class Autocast:
  """A function under a policy's op rules: what :func:`autocast` returns.

  Compared and hashed by identity, as a function is (``fn`` may be an
  Equinox model, whose arrays do not hash), so it can be a static argument
  of ``jax.jit`` or ``TrainState.apply_fn``.

  Attributes:
    fn: the function as written.
    policy: the policy (its output dtype is the outputs').
    rules: the op rules (:class:`~jmp_lab.precision.Rules`).
  """

  fn: Callable[..., Any]
  policy: Policy
  rules: Rules

  def __call__(self, *args, **kwargs):
    return apply_rules(self.fn, self.rules,
                       output_dtype=self.policy.output_dtype)(*args, **kwargs)

  @property
  def __wrapped__(self) -> Callable[..., Any]:
    return self.fn
