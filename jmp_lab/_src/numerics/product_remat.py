"""How a block-scaled product looks to a remat policy: as the ``dot_general``
it stands for.

jax's remat policies (``jax.checkpoint_policies``) decide what to save by
primitive: ``dots_with_no_batch_dims_saveable`` (MaxText's ``"minimal"``,
Flax's examples) saves the output of each ``dot_general`` without batch
dimensions. A block-scaled product reaches remat as none of the primitives
they save: a ``custom_vjp`` whose GEMM is cuDNN's custom call inside
``lax.platform_dependent`` on a GPU, and a batched ``dot_general`` over the
dequantized operands elsewhere (``(B, M, K) x (B, N, K)``, ``B = 1`` for a
Dense). So under that policy its output was not saved and the backward ran
each forward GEMM again, as under full remat.

Each product's output is named (:func:`mark_product`, a ``checkpoint_name``
that carries the product's sizes), and :func:`checkpoint_policy`
(public as :func:`jmp_lab.block_scaled.checkpoint_policy`) wraps a policy
so that it is asked about that name as about the ``dot_general`` the layer
wrote. The engine wraps the policy of every ``jax.checkpoint``/``nn.remat``/
``nnx.remat`` in a policed model.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Optional

import jax
from jax.ad_checkpoint import checkpoint_name

#: The prefix of a product's name; its shape as the layer wrote it follows.
PRODUCT_NAME = "jmp_lab_block_scaled_product:"


def mark_product(y: jax.Array, contraction: int) -> jax.Array:
  """``y`` (B, M, N), a block-scaled product over ``contraction`` values,
  named so that :func:`checkpoint_policy` finds it. The name carries the
  product's batch, contraction and column sizes: under ``vmap`` the value a
  policy is asked about gains the mapped axes, anywhere in its shape."""
  batch, _, columns = y.shape
  return checkpoint_name(
      y, f"{PRODUCT_NAME}b={batch}:k={contraction}:n={columns}")


def _product_sizes(prim: Any, params: dict) -> Optional[dict[str, int]]:
  """The batch, contraction and column sizes in a product's name; None for
  anything else. The primitive is told by its name: jax keeps
  ``checkpoint_name``'s primitive private."""
  name = params.get("name") if getattr(prim, "name", None) == "name" else None
  if not isinstance(name, str) or not name.startswith(PRODUCT_NAME):
    return None
  fields = (field.split("=") for field in
            name[len(PRODUCT_NAME):].split(":"))
  return {key: int(value) for key, value in fields}


def _as_dot_general(policy: Callable[..., Any], out_aval: Any,
                    sizes: dict[str, int]) -> Any:
  """What ``policy`` says of the ``dot_general`` a product stands for: no
  batch dimensions for one matrix (``B = 1``: a Dense, or a batch of one),
  one for a batch of them (an expert's matrix per token). Axes ``vmap``
  added are rows, as a mapped input's are to a shared weight's product."""
  batch, contraction, columns = sizes["b"], sizes["k"], sizes["n"]
  rows = math.prod(out_aval.shape) // (batch * columns)
  operand = lambda *shape: jax.ShapeDtypeStruct(shape, out_aval.dtype)  # noqa: E731
  if batch == 1:
    lhs, rhs = operand(rows, contraction), operand(contraction, columns)
    dimension_numbers = (((1,), (0,)), ((), ()))
  else:
    rows //= batch
    lhs = operand(batch, rows, contraction)
    rhs = operand(batch, contraction, columns)
    dimension_numbers = (((2,), (1,)), ((0,), (0,)))
  return policy(jax.lax.dot_general_p, lhs, rhs,
                dimension_numbers=dimension_numbers, precision=None,
                preferred_element_type=out_aval.dtype, out_sharding=None)


def checkpoint_policy(policy: Optional[Callable[..., Any]]
                      ) -> Optional[Callable[..., Any]]:
  """A remat policy that takes each block-scaled product for the
  ``dot_general`` it stands for.

  jax's policies pick what to save by primitive, and a block-scaled product
  reaches them as none they save (a cuDNN custom call inside
  ``lax.platform_dependent`` on a GPU, a batched product of the dequantized
  operands elsewhere): under
  ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable`` its output
  was not saved, and the backward ran the forward GEMM again. The policy
  returned is asked about a product's output as about a ``dot_general``
  of its shapes (no batch dimensions for one matrix), and about everything
  else as ``policy`` is. ``None`` (save nothing) stays ``None``. Unwrapped,
  a policy that saves named values (``save_any_names_but_these``) saves
  every product's output by its name, where it would not save a bf16
  ``dot_general``.

  Models under :func:`jmp_lab.linen.with_policy`,
  :func:`jmp_lab.nnx.with_policy` and :func:`jmp_lab.autocast` need no
  call: the engine wraps the policy of every ``jax.checkpoint``,
  ``nn.remat`` and ``nnx.remat`` inside them. Wrap it yourself where
  ``jax.checkpoint`` is applied outside a policed call, or around
  :func:`dot_general` called directly:

  >>> import jax, jax.numpy as jnp
  >>> import jmp_lab
  >>> x = jax.random.normal(jax.random.key(0), (64, 64), jnp.bfloat16)
  >>> w = jax.random.normal(jax.random.key(1), (64, 32), jnp.bfloat16)
  >>> def loss(x, w):
  ...   y = jmp_lab.block_scaled.dot_general(x, w, (((1,), (0,)), ((), ())),
  ...                                        fmt="mxfp8")
  ...   return jnp.tanh(y).astype(jnp.float32).sum()
  >>> def gemms(policy):  # the GEMMs one step runs
  ...   step = jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1))
  ...   return len(jmp_lab.diagnostics.audit_step(step, x, w).matmuls)
  >>> dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  >>> gemms(dots), gemms(jmp_lab.block_scaled.checkpoint_policy(dots))
  (4, 3)
  """
  if policy is not None and not callable(policy):
    raise TypeError(f"policy must be a remat policy (a callable, such as "
                    f"jax.checkpoint_policies.dots_with_no_batch_dims_saveable"
                    f") or None, got {type(policy).__name__} {policy!r}")
  if policy is None or getattr(policy, "_jmp_lab_sees_products", False):
    return policy
  try:  # one wrapper a policy: the same policy, the same remat params
    return _WRAPPED[policy]
  except (KeyError, TypeError):  # not yet, or not weakly referable
    pass

  def policy_checkpoint_policy(prim, *avals, **params):
    sizes = _product_sizes(prim, params)
    if sizes is None:
      return policy(prim, *avals, **params)
    return _as_dot_general(policy, avals[0], sizes)

  policy_checkpoint_policy._jmp_lab_sees_products = True
  policy_checkpoint_policy.__wrapped__ = policy
  try:
    _WRAPPED[policy] = policy_checkpoint_policy
  except TypeError:
    pass
  return policy_checkpoint_policy


_WRAPPED: "weakref.WeakKeyDictionary[Callable[..., Any], Callable[..., Any]]" = (
    weakref.WeakKeyDictionary())
