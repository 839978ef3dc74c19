"""Losses computed in fp32, including one that never stores the logits.

The implementation behind :mod:`jmp_lab.losses`, whose docstring describes it
with examples.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lab._src.precision.scopes import (current_compute_dtype,
                                           current_reduce_dtype)
from jmp_lab.kernels.platform import importable
from jmp_lab.kernels import linear_cross_entropy as fused_kernels

# The widest vocabulary block by default: its logits (tokens x block, in the
# hidden's dtype) are the largest temporary. A wider block moves a little
# fewer bytes for several times the temporaries; the figures by block size
# are in benchmarks/RESULTS.md.
DEFAULT_BLOCK = 8192


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
  """Softmax computed in fp32, returned in ``x``'s dtype."""
  return jax.nn.softmax(x.astype(jnp.float32), axis=axis).astype(x.dtype)


def log_softmax(x: jax.Array, axis: int = -1) -> jax.Array:
  """Log-softmax computed and returned in fp32."""
  return jax.nn.log_softmax(x.astype(jnp.float32), axis=axis)


def softmax_cross_entropy_with_integer_labels(logits: jax.Array,
                                              labels: jax.Array) -> jax.Array:
  """Per-example cross-entropy, computed and returned in fp32."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels)


def linear_cross_entropy(hidden: jax.Array, kernel: jax.Array,
                         labels: jax.Array, *,
                         where: Optional[jax.Array] = None,
                         block_size: Optional[int] = None,
                         logit_soft_cap: Optional[float] = None,
                         implementation: str = "auto",
                         vocab_shards: int = 1) -> jax.Array:
  """Per-token fp32 cross-entropy of ``hidden @ kernel``, logits never stored.

  The same loss has three implementations:

  * ``"xla"`` -- the vocabulary in blocks of ``block_size`` columns, each
    block's logits a GEMM XLA compiles for any target. A block's logits are
    written to memory and read back (in the hidden's dtype), one block alive
    at a time.
  * ``"triton"`` -- three Pallas Triton kernels
    (:mod:`jmp_lab.kernels.linear_cross_entropy`) that keep each tile of
    logits in registers: nothing of size ``tokens x vocabulary`` touches
    memory. For bf16 or fp16 hidden states whose width is a multiple of 16.
    Compiled for an H100 it moves about a tenth of the XLA path's bytes
    (``benchmarks/RESULTS.md``).
  * ``"interpret"`` -- the Triton kernels in Pallas interpret mode, on any
    device (slow; for tests).

  ``"auto"`` (the default) uses the Triton kernels in a step compiled for
  CUDA when they take the call and this jax has Pallas' Triton backend, and
  the XLA path otherwise: on a CPU, for fp32 hidden states (Triton would
  run their dots in TF32), for widths that are not a multiple of 16, and
  for widths over 768, where the kernels split their gradient sums over
  programs that each recompute the logits and the roofline model prices
  the extra products above the bytes they save. The choice is made by the
  platform the step is compiled for (``jax.lax.platform_dependent``), as in
  :func:`jmp_lab.attention.dot_product_attention`. The kernels keep the
  logits in fp32, where XLA's path rounds them to the hidden's dtype (as a
  half-precision LM head does), so the two differ by that rounding.

  Under a half policy's rules (a train step's loss, a module under
  ``with_policy``, :func:`jmp_lab.autocast`) wider hidden states are cast to
  the compute dtype first, so the model's fp32 output takes the kernels and
  half GEMMs as a bf16 one does (:func:`jmp_lab.precision.current_compute_dtype`).
  Under a policy with a reduce dtype (a train step's loss, a module under
  ``with_policy``), the kernel's gradient is accumulated and returned in it
  before it is cast to the kernel's dtype, so its sum across devices runs in
  the reduce dtype, as a Dense kernel's does (XLA's path: ``"auto"`` takes
  it under a reduce dtype).

  **Tensor parallelism.** With the vocabulary split over ``N`` devices (the
  kernel's ``V`` sharded over a mesh axis of size ``N``, as MaxText's
  ``"vocab"`` rule does), pass ``vocab_shards=N``: the XLA path then walks
  each device's part of the vocabulary in blocks and keeps the hidden's
  gradient per part until the last block, so it is summed across the
  devices once a step, not once per block. (The kernels do not split the
  vocabulary: ``"auto"`` takes XLA's path.) ``N`` must be the kernel's
  actual split: another value gives the same loss and gradients, but the
  per-block sums come back.

  Args:
    hidden: ``(..., D)`` the final hidden states (bf16 under a half policy).
    kernel: ``(D, V)`` the output projection; for tied embeddings the table
      transposed (``embedding.T``). It is cast to ``hidden``'s dtype: the
      matmuls run in that dtype with fp32 accumulation, and the kernel's
      gradient is accumulated in fp32 and returned in the kernel's dtype.
    labels: ``(...)`` int labels in ``[0, V)`` where ``where`` is True.
    where: ``(...)`` bool; False tokens (padding, ignored labels such as
      -100) get loss 0 and no gradient.
    block_size: vocabulary columns per block (default: up to
      :data:`DEFAULT_BLOCK`; one that divides the vocabulary if there is a
      multiple of 64 that does, else balanced blocks). A ragged last block is
      padded and masked.
    logit_soft_cap: if set, logits become ``cap * tanh(logits / cap)``
      (Gemma 2's soft cap) before the softmax.
    vocab_shards: how many devices the vocabulary is split over (tensor
      parallelism; see above). ``V`` must divide evenly.
    implementation: ``"auto"``, ``"triton"``, ``"interpret"`` or ``"xla"``
      (above). ``block_size`` applies to ``"xla"`` only.

  Returns:
    ``(...)`` the loss of each token, fp32.

  Raises:
    ValueError, TypeError: for shapes, dtypes or arguments that do not fit,
      naming the argument.
  """
  hidden, kernel, labels, where = _checked(hidden, kernel, labels, where,
                                           block_size, logit_soft_cap)
  _check_vocab_shards(vocab_shards, kernel.shape[1])
  policed = current_compute_dtype()
  if (policed is not None and jnp.dtype(policed).itemsize == 2
      and jnp.dtype(hidden.dtype).itemsize > 2):
    hidden = hidden.astype(policed)
  reduce_dtype = current_reduce_dtype()
  why_not_fused = _why_not_fused(implementation, hidden, vocab_shards,
                                 reduce_dtype)
  vocab = kernel.shape[1]
  cap = None if logit_soft_cap is None else float(logit_soft_cap)
  flat = (hidden.reshape(-1, hidden.shape[-1]), kernel,
          labels.reshape(-1).astype(jnp.int32), where.reshape(-1))

  def with_xla():
    blocking = _Blocking(
        _block_size(vocab // vocab_shards, block_size), vocab,
        jnp.dtype(kernel.dtype).name, vocab_shards,
        None if reduce_dtype is None else np.dtype(reduce_dtype).name)
    return _linear_cross_entropy(*flat, blocking, cap)

  def with_kernels(interpret):
    layout = fused_kernels.Tiling(hidden.shape[-1], vocab, cap)
    return _fused_linear_cross_entropy(*flat, layout, interpret,
                                       jnp.dtype(kernel.dtype).name)

  if implementation == "auto":
    if why_not_fused or fused_kernels.why_xla_is_cheaper(hidden.shape[-1]):
      losses = with_xla()
    else:  # the kernels where the step is compiled for CUDA
      losses = jax.lax.platform_dependent(
          cuda=functools.partial(with_kernels, False), default=with_xla)
  elif implementation == "xla":
    losses = with_xla()
  else:
    losses = with_kernels(interpret=implementation == "interpret")
  return losses.reshape(hidden.shape[:-1])


IMPLEMENTATIONS = ("auto", "triton", "interpret", "xla")


def _why_not_fused(implementation, hidden, vocab_shards: int = 1,
                   reduce_dtype=None) -> str:
  """Why the kernels cannot take this call ("" if they can); raises for an
  explicit kernel implementation that cannot. The kernels neither split
  the vocabulary over devices nor return the kernel's gradient in a reduce
  dtype, so ``"auto"`` takes XLA's path for either."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"linear_cross_entropy's implementation must be one of "
                     f"{', '.join(map(repr, IMPLEMENTATIONS))}, got "
                     f"{implementation!r}")
  why = fused_kernels.why_unsupported(hidden.shape[-1], hidden.dtype)
  if not why and vocab_shards > 1:
    why = (f"vocab_shards={vocab_shards}: the kernels do not split the "
           f"vocabulary over devices (use implementation='xla')")
  if not why and reduce_dtype is not None and implementation == "auto":
    why = "a reduce dtype: the kernels return the gradient in the kernel's"
  if not why and not importable("jax.experimental.pallas.triton"):
    why = "this jax has no Pallas Triton backend"
    if implementation == "interpret":
      why = ""  # interpret mode needs only Pallas itself
  if why and implementation in ("triton", "interpret"):
    raise ValueError(f"linear_cross_entropy's implementation "
                     f"{implementation!r} cannot take this call: {why}")
  return why


def _checked(hidden, kernel, labels, where, block_size, logit_soft_cap):
  hidden, kernel, labels = (jnp.asarray(x) for x in (hidden, kernel, labels))
  if not jnp.issubdtype(hidden.dtype, jnp.floating) or hidden.ndim < 1:
    raise TypeError(f"linear_cross_entropy's hidden must be a floating "
                    f"array (..., D), got {hidden.dtype}{list(hidden.shape)}")
  if kernel.ndim != 2 or kernel.shape[0] != hidden.shape[-1]:
    raise ValueError(
        f"linear_cross_entropy's kernel must be (D, V) with D = "
        f"{hidden.shape[-1]} (hidden's last dim; for tied embeddings pass "
        f"the table transposed, embedding.T), got {list(kernel.shape)}")
  if not jnp.issubdtype(kernel.dtype, jnp.floating):
    raise TypeError(f"linear_cross_entropy's kernel must be floating, got "
                    f"{kernel.dtype}")
  if tuple(labels.shape) != tuple(hidden.shape[:-1]) or not jnp.issubdtype(
      labels.dtype, jnp.integer):
    raise ValueError(
        f"linear_cross_entropy's labels must be integers of shape "
        f"{list(hidden.shape[:-1])} (hidden's without D), got "
        f"{labels.dtype}{list(labels.shape)}")
  if where is None:
    where = jnp.ones(labels.shape, bool)
  else:
    where = jnp.asarray(where)
    if tuple(where.shape) != tuple(labels.shape) or where.dtype != bool:
      raise ValueError(
          f"linear_cross_entropy's where must be bool of shape "
          f"{list(labels.shape)}, got {where.dtype}{list(where.shape)}")
  if block_size is not None and (not isinstance(block_size, int)
                                 or isinstance(block_size, bool)
                                 or block_size < 1):
    raise ValueError(f"block_size must be a positive int, got {block_size!r}")
  if logit_soft_cap is not None and not (
      isinstance(logit_soft_cap, (int, float)) and logit_soft_cap > 0):
    raise ValueError(f"logit_soft_cap must be a positive number or None, "
                     f"got {logit_soft_cap!r}")
  return hidden, kernel, labels, where


def _check_vocab_shards(vocab_shards: Any, vocab: int) -> None:
  if not isinstance(vocab_shards, int) or isinstance(vocab_shards, bool):
    raise TypeError(f"vocab_shards must be an int (the devices the "
                    f"vocabulary is split over), got {vocab_shards!r}")
  if vocab_shards < 1 or vocab % vocab_shards:
    raise ValueError(
        f"vocab_shards must be a positive int that divides the vocabulary "
        f"({vocab}), got {vocab_shards!r}")


def _block_size(vocab: int, block_size: Optional[int]) -> int:
  if block_size is not None:
    return min(block_size, vocab)
  if vocab <= DEFAULT_BLOCK:
    return vocab
  # A block that divides the vocabulary needs no padded copy of the kernel:
  # the largest multiple of 64 that does, if it is not much smaller.
  for block in range(DEFAULT_BLOCK * 5 // 4 // 64 * 64, DEFAULT_BLOCK // 2,
                     -64):
    if vocab % block == 0:
      return block
  # Otherwise balanced blocks, a multiple of 128 (the GEMM's tile).
  blocks = math.ceil(vocab / DEFAULT_BLOCK)
  return -(-math.ceil(vocab / blocks) // 128) * 128


def _row_blocks(kernel, hidden_dtype, block: int,
                shards: int = 1) -> tuple[jax.Array, ...]:
  """The kernel as blocks of vocabulary rows, each ``(rows, D)`` in the
  hidden's dtype (their vocabulary ids: :func:`_block_ids`). A tied embedding's kernel
  is ``table.T``, so its rows are the table itself: the transposes cancel.
  XLA fuses the slicing into the policy's cast of the kernel.

  One shard: blocks of ``block`` rows, the last padded with zero rows (ids
  past the vocabulary). ``shards`` > 1 (the vocabulary split over that many
  devices, tensor parallelism): block ``i`` takes rows ``i * block ...`` of
  every shard's part, so each device slices its own rows and the blocks'
  products stay on the device that holds them (the last block of each part
  may be shorter; nothing is padded)."""
  rows = kernel.astype(hidden_dtype).T
  vocab = rows.shape[0]
  if shards == 1:
    blocks = math.ceil(vocab / block)
    if blocks * block != vocab:
      rows = jnp.pad(rows, ((0, blocks * block - vocab), (0, 0)))
    return tuple(rows[i * block:(i + 1) * block] for i in range(blocks))
  by_shard = rows.reshape(shards, vocab // shards, rows.shape[1])
  return tuple(by_shard[:, lo:hi].reshape(shards * (hi - lo), -1)
               for lo, hi in _part_ranges(vocab // shards, block))


def _part_ranges(part: int, block: int) -> list[tuple[int, int]]:
  return [(lo, min(lo + block, part)) for lo in range(0, part, block)]


class _Ids(NamedTuple):
  """Which vocabulary ids a block's rows hold (static): ``shards`` runs of
  ``hi - lo`` ids, the run of shard ``s`` starting at ``s * part + lo``."""
  lo: int
  hi: int
  part: int
  shards: int
  vocab: int

  @property
  def masked(self) -> bool:
    """Whether ids past the vocabulary may be among them (one shard: the
    last block is padded; every block is masked alike, as it always was)."""
    return self.shards == 1

  def ids(self) -> jax.Array:
    # jnp ops, not numpy constants: the rules' rebuilt custom_vjp traces
    # these rules again and takes no captured constants.
    run = self.lo + jnp.arange(self.hi - self.lo)
    if self.shards == 1:
      return run
    return (jnp.arange(self.shards)[:, None] * self.part
            + run[None, :]).reshape(-1)


def _block_ids(blocking) -> list[_Ids]:
  """The vocabulary ids of each block's rows (:func:`_row_blocks`); ids
  past the vocabulary are padding."""
  block, vocab, shards = blocking.block, blocking.vocab, blocking.shards
  if shards == 1:
    return [_Ids(i * block, (i + 1) * block, vocab, 1, vocab)
            for i in range(math.ceil(vocab / block))]
  part = vocab // shards
  return [_Ids(lo, hi, part, shards, vocab)
          for lo, hi in _part_ranges(part, block)]


def _block_logits(hidden, block_rows, block_ids: "_Ids", cap):
  """One block's logits in fp32 (soft-capped), the padding at -inf, their
  vocabulary ids, and ``tanh`` of the cap (None without one) for the
  backward pass."""
  # The GEMM in the hidden's dtype (its result too, as a bf16 LM head's
  # is); the softmax in fp32.
  logits = jax.lax.dot_general(hidden, block_rows,
                               (((1,), (1,)), ((), ()))).astype(jnp.float32)
  capped = None
  if cap is not None:
    capped = jnp.tanh(logits / cap)
    logits = cap * capped
  ids = block_ids.ids()
  if block_ids.masked:
    logits = jnp.where(ids < block_ids.vocab, logits, -jnp.inf)
  return logits, ids, capped


class _Blocking(NamedTuple):
  """The static layout of one call: block width, vocabulary, kernel dtype,
  the vocabulary's shards, and the dtype the kernel's gradient is
  accumulated and summed across devices in (the reduce dtype, else the
  kernel's)."""
  block: int
  vocab: int
  kernel_dtype: str
  shards: int = 1
  grad_dtype: Optional[str] = None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _linear_cross_entropy(hidden, kernel, labels, where, blocking, cap):
  return _forward(hidden, kernel, labels, where, blocking, cap)[0]


def _online_logsumexp(a, b):
  """Combine two partial log-sum-exps, each ``(maximum, sum of exp(x -
  maximum), label logit)``: the reducer of :func:`_block_statistics`."""
  max_a, sum_a, label_a = a
  max_b, sum_b, label_b = b
  maximum = jnp.maximum(max_a, max_b)
  # exp(-inf - -inf) is nan: a part that has seen only -inf adds nothing.
  def rescaled(part_max, part_sum):
    return jnp.where(part_max == -jnp.inf, 0.0,
                     part_sum * jnp.exp(part_max - maximum))
  return (maximum, rescaled(max_a, sum_a) + rescaled(max_b, sum_b),
          label_a + label_b)


def _block_statistics(logits, ids, labels):
  """A block's per-token maximum, sum of ``exp(logit - maximum)`` and
  correct-class logit (0 if the label is in another block), in ONE pass
  over the logits: a variadic reduction with the online log-sum-exp as its
  reducer. ``max`` then ``sum(exp(x - max))`` would be two reductions, and
  compiled for an H100 each reads the whole block (benchmarks/RESULTS.md)."""
  label_logits = jnp.where(ids[None, :] == labels[:, None], logits, 0.0)
  zero = jnp.zeros((), jnp.float32)
  return jax.lax.reduce(
      (logits, jnp.ones_like(logits), label_logits),
      (jnp.array(-jnp.inf, jnp.float32), zero, zero),
      _online_logsumexp, (1,))


#: The name scope of the loss's ops, forward and backward: a profile or a
#: compiled report (e.g. a collective's ``op_name``) finds them by it.
SCOPE = "linear_cross_entropy"


@jax.named_scope(SCOPE)
def _forward(hidden, kernel, labels, where, blocking, cap):
  row_blocks = _row_blocks(kernel, hidden.dtype, blocking.block,
                           blocking.shards)
  tokens = hidden.shape[0]
  carry = (jnp.full((tokens,), -jnp.inf), jnp.zeros((tokens,)),
           jnp.zeros((tokens,)))
  for i, (block_rows, ids) in enumerate(zip(row_blocks,
                                            _block_ids(blocking))):
    # (unrolled: see _backward_rule)
    logits, ids, _ = _block_logits(hidden, block_rows, ids, cap)
    carry = _online_logsumexp(carry, _block_statistics(logits, ids, labels))
    if i + 1 < len(row_blocks):  # one block's logits alive at a time
      hidden, carry = jax.lax.optimization_barrier((hidden, carry))
  maximum, total, label_logit = carry
  lse = maximum + jnp.log(total)
  losses = jnp.where(where, lse - label_logit, 0.0)
  # The row blocks are kept for the backward pass, not the kernel: they are
  # the same bytes, and the backward pass need not slice them again.
  return losses, (hidden, row_blocks, labels, where, lse)


def _forward_rule(hidden, kernel, labels, where, blocking, cap):
  return _forward(hidden, kernel, labels, where, blocking, cap)


@jax.named_scope(SCOPE)
def _backward_rule(blocking, cap, residuals, g):
  hidden, row_blocks, labels, where, lse = residuals
  vocab, shards = blocking.vocab, blocking.shards
  grad_dtype = blocking.grad_dtype or blocking.kernel_dtype
  # The barrier keeps XLA from merging the recomputed logits with the
  # forward pass's (which would keep every block alive until here).
  hidden, row_blocks = jax.lax.optimization_barrier((hidden, row_blocks))
  g = jnp.where(where, g, 0.0).astype(jnp.float32)

  def hidden_part(d_logits, block_rows):
    """The block's part of the hidden's gradient. With the vocabulary in
    shards it is kept per shard, ``(shards, tokens, D)``: each device sums
    its own blocks, and the shards are summed once, after the last block
    (summed here, XLA would all-reduce every block's part)."""
    if shards == 1:
      return jnp.dot(d_logits, block_rows, preferred_element_type=jnp.float32)
    tokens, width = d_logits.shape[0], block_rows.shape[1]
    return jnp.einsum("tsn,snd->std",
                      d_logits.reshape(tokens, shards, -1),
                      block_rows.reshape(shards, -1, width),
                      preferred_element_type=jnp.float32)

  def step(d_hidden, ids, block_rows):
    logits, ids, capped = _block_logits(hidden, block_rows, ids, cap)
    probs = jnp.exp(logits - lse[:, None])
    d_logits = (probs - (ids[None, :] == labels[:, None])) * g[:, None]
    if capped is not None:
      d_logits = d_logits * (1.0 - capped * capped)
    # Both gradient GEMMs over half operands, accumulated in fp32; the
    # hidden's gradient is summed over blocks in fp32.
    d_logits = d_logits.astype(hidden.dtype)
    d_hidden = d_hidden + hidden_part(d_logits, block_rows)
    # The block's rows of the kernel gradient are complete after one GEMM
    # (accumulated in fp32 inside it): written in the kernel's dtype (or the
    # reduce dtype, which their sum across devices then runs in), not
    # written in fp32 and converted by another kernel.
    d_rows = jax.lax.dot_general(d_logits, hidden, (((0,), (0,)), ((), ())),
                                 preferred_element_type=grad_dtype)
    return d_hidden, d_rows

  # Unrolled, not a loop: XLA's cost model counts a loop's body once, so a
  # loop would hide the blocks' bytes from compiled reports; and the rows of
  # the kernel gradient are simply concatenated.
  d_hidden = jnp.zeros(hidden.shape if shards == 1 else
                       (shards,) + hidden.shape, jnp.float32)
  d_rows = []
  for i, (block_rows, ids) in enumerate(zip(row_blocks,
                                            _block_ids(blocking))):
    d_hidden, rows_i = step(d_hidden, ids, block_rows)
    d_rows.append(rows_i)
    if i + 1 < len(row_blocks):  # the next block waits: one alive at a time
      hidden, d_hidden = jax.lax.optimization_barrier((hidden, d_hidden))
  if shards == 1:
    d_kernel = jnp.concatenate(d_rows)[:vocab].T
  else:  # each block holds rows of every shard's part
    width = hidden.shape[1]
    d_kernel = jnp.concatenate([r.reshape(shards, -1, width) for r in d_rows],
                               axis=1).reshape(vocab, width).T
    d_hidden = d_hidden.sum(axis=0)
  d_kernel = d_kernel.astype(blocking.kernel_dtype)
  return (d_hidden.astype(hidden.dtype), d_kernel,
          np.zeros(labels.shape, jax.dtypes.float0),
          np.zeros(where.shape, jax.dtypes.float0))


_linear_cross_entropy.defvjp(_forward_rule, _backward_rule)


# ---------------------------------------------------------------------------
# The same loss by the Pallas kernels: no logits in memory.
# ---------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused_linear_cross_entropy(hidden, kernel, labels, where, layout,
                                interpret, kernel_dtype):
  return _fused_forward(hidden, kernel, labels, where, layout, interpret,
                        kernel_dtype)[0]


@jax.named_scope(SCOPE)
def _fused_forward(hidden, kernel, labels, where, layout, interpret,
                   kernel_dtype):
  del kernel_dtype  # the backward pass's: the kernel gradient's dtype
  rows = fused_kernels.vocabulary_rows(kernel, hidden.dtype)
  lse, label_logit = fused_kernels.statistics(hidden, rows, labels, layout,
                                              interpret=interpret)
  losses = jnp.where(where, lse - label_logit, 0.0)
  return losses, (hidden, rows, labels, where, lse)


@jax.named_scope(SCOPE)
def _fused_backward(layout, interpret, kernel_dtype, residuals, g):
  hidden, rows, labels, where, lse = residuals
  g = jnp.where(where, g, 0.0).astype(jnp.float32)
  d_hidden = fused_kernels.hidden_gradient(hidden, rows, labels, lse, g,
                                           layout, interpret=interpret)
  d_rows = fused_kernels.rows_gradient(hidden, rows, labels, lse, g, layout,
                                       kernel_dtype, interpret=interpret)
  return (d_hidden, d_rows[:layout.vocab].T,
          np.zeros(labels.shape, jax.dtypes.float0),
          np.zeros(where.shape, jax.dtypes.float0))


_fused_linear_cross_entropy.defvjp(_fused_forward, _fused_backward)
