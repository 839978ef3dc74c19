"""A linear layer and its cross-entropy in three Pallas Triton kernels.

:func:`jmp_lab.losses.linear_cross_entropy` computed in XLA writes each
vocabulary block's logits to memory and reads them back, several passes a
step (counted in ``benchmarks/RESULTS.md``). These
kernels keep each ``(tokens, block)`` tile of logits in registers, as Apple's
Cut Cross-Entropy does in Triton:

* :func:`statistics` -- one program per tile of tokens walks the vocabulary:
  the tile's logits (``hidden @ rows.T``, fp32 accumulation), their online
  log-sum-exp and the correct-class logit, all in fp32;
* :func:`hidden_gradient` -- one program per tile of tokens (and group of
  hidden columns) walks the vocabulary again, recomputes the logits and sums
  ``d_logits @ rows`` in fp32 registers;
* :func:`rows_gradient` -- one program per tile of vocabulary rows (and
  group of columns) walks the tokens and sums ``d_logits.T @ hidden``.

Each gradient is written once, by the one program that owns it, so no atomic
additions are needed (CCE adds its partial gradients atomically, moving a
tile of each per pair of tiles). The price is compute: the logits GEMM runs
three times (forward and once in each backward kernel), against twice in
the XLA path. ``benchmarks/RESULTS.md`` has the compiled figures.

Tiling and limits. ``rows`` is the kernel as vocabulary rows, ``(V, D)``,
padded to whole tiles (a tied embedding's table is this already); the
hidden states are ``(N, D)``, padded to whole tiles of tokens. Operands are
bf16 or fp16 (the GEMMs are half-precision tensor-core dots with fp32
accumulation; fp32 operands would run in TF32, so fp32 stays on XLA's path).
``D`` must be a multiple of 16. The tile sizes were chosen by compiling for
an H100 without register spills or shared-memory overflow (each kernel's
registers are reported by ``compiled_report``); they are not tuned on a GPU.

The same bodies run in Pallas interpret mode (``interpret=True``) on any
device, which is how the CPU tests check them against XLA's path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning

from jmp_lab.kernels.mesh import leading_mesh_axes, split_over
from jmp_lab.kernels.platform import quiet_triton_deprecation

# Tokens per program in the forward kernel, vocabulary rows per step of its
# loop; the padded vocabulary is a multiple of the largest vocabulary tile.
FORWARD_TOKENS, FORWARD_VOCAB = 64, 128
HIDDEN_GRAD_TOKENS, HIDDEN_GRAD_VOCAB = 32, 64
ROWS_GRAD_TOKENS, ROWS_GRAD_VOCAB = 32, 32
TOKEN_MULTIPLE = max(FORWARD_TOKENS, HIDDEN_GRAD_TOKENS, ROWS_GRAD_TOKENS)
VOCAB_MULTIPLE = max(FORWARD_VOCAB, HIDDEN_GRAD_VOCAB, ROWS_GRAD_VOCAB)
# The widest fp32 accumulator a backward program holds, in columns of D for
# its tile: 32 x 768 fp32 is 96 registers a thread at 8 warps. Wider D is
# split over programs, each recomputing the logits.
MAX_ACCUMULATED_COLUMNS = 768
NUM_WARPS = 8
# The widest hidden tile a program loads once and holds through its loop
# over the vocabulary; wider ones it reads again at each step (an unrolled
# sum over more chunks overflows shared memory when compiled for an H100).
MAX_HELD_COLUMNS = 768
# The forward kernel's limit is lower: it also carries three fp32 running
# statistics per token. At D = 768 (GPT-2 small) the Triton of jax 0.12
# allocates it 255 registers and spills 104 B (jax 0.10's: 226, none);
# reading the tile again at each step (from L2) takes it to 128 registers on
# both, and moves the same bytes through HBM.
FORWARD_MAX_HELD_COLUMNS = 512


def _triton_dot(*args, **kwargs):
  """Pallas Triton's ``dot`` (``jax.experimental.pallas.triton.dot`` on
  every supported jax; ``pl.dot``, which jax 0.12 removed, was its old
  name). Imported where a kernel is traced, so that importing jmp_lab needs
  no Triton backend."""
  from jax.experimental.pallas import triton as plt
  return plt.dot(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class Tiling:
  """The static shape of one call: hidden width, vocabulary, soft cap."""
  width: int              # D
  vocab: int              # V: rows at or past it are padding
  cap: Optional[float]    # Gemma 2's logit soft cap, or None

  @property
  def chunk(self) -> int:
    """Columns of D per dot: Triton's tiles are powers of two."""
    for chunk in (256, 128, 64, 32, 16):
      if self.width % chunk == 0:
        return chunk
    raise ValueError(f"the fused linear_cross_entropy needs a hidden width "
                     f"that is a multiple of 16, got {self.width}")

  @property
  def chunks(self) -> int:
    return self.width // self.chunk

  @property
  def chunks_per_group(self) -> int:
    """Chunks of D whose gradient one backward program accumulates."""
    most = max(1, MAX_ACCUMULATED_COLUMNS // self.chunk)
    return max(n for n in range(1, most + 1) if self.chunks % n == 0)

  @property
  def groups(self) -> int:
    return self.chunks // self.chunks_per_group


def why_unsupported(width: int, dtype) -> str:
  """Why the kernels cannot take this call ("" when they can). See
  :func:`why_xla_is_cheaper` for whether ``"auto"`` should use them."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return (f"hidden is {jnp.dtype(dtype).name}: the kernels take bf16 or "
            f"fp16 (fp32 dots would run in TF32)")
  if width % 16:
    return f"the hidden width {width} is not a multiple of 16"
  return ""


def gemm_flops(kernel_name: str, hidden_dims: Sequence[int],
               rows_dims: Sequence[int]) -> Optional[float]:
  """The matmul FLOPs one call of this module's kernel ``kernel_name`` runs,
  from its first two operands' shapes (hidden ``(N, D)``, rows ``(V, D)``);
  None for another kernel. Pallas' Triton lowering drops a ``pallas_call``'s
  cost estimate, so :func:`jmp_lab.diagnostics.compiled_report` asks here
  for the roofline model. One ``(N, D) x (D, V)`` product is ``2 N D V``:
  the forward kernel runs it once; each gradient kernel recomputes the
  logits once per group of columns and then runs its own product."""
  if len(hidden_dims) != 2 or len(rows_dims) != 2 or hidden_dims[1] % 16:
    return None
  (tokens, width), vocab = hidden_dims, rows_dims[0]
  product = 2.0 * tokens * width * vocab
  if kernel_name == "_statistics_kernel":
    return product
  if kernel_name in ("_hidden_gradient_kernel", "_rows_gradient_kernel"):
    return product * (Tiling(width, vocab, None).groups + 1)
  return None


def why_xla_is_cheaper(width: int) -> str:
  """Why ``"auto"`` keeps XLA's path for this width ("" if it need not).

  A width whose gradient sums do not fit one program's registers (over
  :data:`MAX_ACCUMULATED_COLUMNS`) splits them over groups of programs
  that each recompute the logits: at 2,048, 11 logits-sized products a
  step against XLA's 4, which the roofline model prices above the bytes
  the kernels save (``benchmarks/RESULTS.md``)."""
  if width > MAX_ACCUMULATED_COLUMNS:
    return (f"the hidden width {width} is over {MAX_ACCUMULATED_COLUMNS}, "
            f"where the kernels recompute the logits for each group of "
            f"columns")
  return ""


def _logits(hidden, rows_ref, vocab_slice, tiling: Tiling):
  """A tile's fp32 logits (soft-capped) and ``tanh`` of the cap's argument
  (None without a cap) for the backward pass. ``hidden`` is the held tile's
  chunks, or ``(hidden_ref, token_slice)`` to read it chunk by chunk in a
  loop (wide D: an unrolled sum would stage every chunk in shared memory)."""
  def chunk_logits(hidden_chunk, c):
    return _triton_dot(hidden_chunk,
                  rows_ref[vocab_slice, pl.ds(c * tiling.chunk, tiling.chunk)],
                  trans_b=True).astype(jnp.float32)

  if isinstance(hidden, list):
    logits = sum(chunk_logits(h, c) for c, h in enumerate(hidden))
  else:
    hidden_ref, token_slice = hidden
    zeros = jnp.zeros((token_slice.size, vocab_slice.size), jnp.float32)
    logits = jax.lax.fori_loop(
        0, tiling.chunks, lambda c, acc: acc + chunk_logits(
            hidden_ref[token_slice, pl.ds(c * tiling.chunk, tiling.chunk)],
            c), zeros)
  capped = None
  if tiling.cap is not None:
    capped = jnp.tanh(logits / tiling.cap)
    logits = tiling.cap * capped
  return logits, capped


def _hidden_chunks(hidden_ref, token_slice, tiling: Tiling):
  return [hidden_ref[token_slice, pl.ds(c * tiling.chunk, tiling.chunk)]
          for c in range(tiling.chunks)]


def _held_hidden(hidden_ref, token_slice, tiling: Tiling,
                 max_held: int = MAX_HELD_COLUMNS):
  """The program's hidden tile, loaded once and held through the loop over
  the vocabulary where it fits (D up to ``max_held``); None where it must be
  read again at each step (from L2: the same tile each time)."""
  if tiling.width > max_held:
    return None
  return _hidden_chunks(hidden_ref, token_slice, tiling)


def _statistics_kernel(hidden_ref, rows_ref, labels_ref, lse_ref, label_ref,
                       *, tiling: Tiling, vocab_tiles: int):
  tokens = pl.ds(pl.program_id(0) * FORWARD_TOKENS, FORWARD_TOKENS)
  labels = labels_ref[tokens]
  held = _held_hidden(hidden_ref, tokens, tiling, FORWARD_MAX_HELD_COLUMNS)

  def step(j, carry):
    maximum, total, label_logit = carry
    hidden = held or (hidden_ref, tokens)
    logits, _ = _logits(hidden, rows_ref,
                        pl.ds(j * FORWARD_VOCAB, FORWARD_VOCAB), tiling)
    ids = j * FORWARD_VOCAB + jnp.arange(FORWARD_VOCAB)
    logits = jnp.where(ids[None, :] < tiling.vocab, logits, -jnp.inf)
    label_logit = label_logit + jnp.sum(
        jnp.where(ids[None, :] == labels[:, None], logits, 0.0), axis=1)
    new_max = jnp.maximum(maximum, jnp.max(logits, axis=1))
    # The first tile always has a real row, so new_max is finite and
    # exp(-inf - new_max) is 0.
    total = total * jnp.exp(maximum - new_max) + jnp.sum(
        jnp.exp(logits - new_max[:, None]), axis=1)
    return new_max, total, label_logit

  zeros = jnp.zeros((FORWARD_TOKENS,), jnp.float32)
  maximum, total, label_logit = jax.lax.fori_loop(
      0, vocab_tiles, step, (zeros - jnp.inf, zeros, zeros))
  lse_ref[tokens] = maximum + jnp.log(total)
  label_ref[tokens] = label_logit


def _logits_gradient(logits, capped, ids, labels, lse, g, tiling: Tiling,
                     dtype):
  """``g * (softmax - onehot)`` of a tile, through the soft cap, in the
  operands' dtype for the gradient GEMMs."""
  probs = jnp.exp(logits - lse[:, None])
  onehot = (ids[None, :] == labels[:, None]).astype(jnp.float32)
  d_logits = (probs - onehot) * g[:, None]
  if capped is not None:
    d_logits = d_logits * (1.0 - capped * capped)
  return jnp.where(ids[None, :] < tiling.vocab, d_logits, 0.0).astype(dtype)


def _hidden_gradient_kernel(hidden_ref, rows_ref, labels_ref, lse_ref, g_ref,
                            d_hidden_ref, *, tiling: Tiling, vocab_tiles: int):
  tokens = pl.ds(pl.program_id(0) * HIDDEN_GRAD_TOKENS, HIDDEN_GRAD_TOKENS)
  first_chunk = pl.program_id(1) * tiling.chunks_per_group
  labels, lse, g = labels_ref[tokens], lse_ref[tokens], g_ref[tokens]
  held = _held_hidden(hidden_ref, tokens, tiling)

  def columns(c):
    return pl.ds((first_chunk + c) * tiling.chunk, tiling.chunk)

  def step(j, sums):
    vocab = pl.ds(j * HIDDEN_GRAD_VOCAB, HIDDEN_GRAD_VOCAB)
    hidden = held or (hidden_ref, tokens)
    logits, capped = _logits(hidden, rows_ref, vocab, tiling)
    ids = j * HIDDEN_GRAD_VOCAB + jnp.arange(HIDDEN_GRAD_VOCAB)
    d_logits = _logits_gradient(logits, capped, ids, labels, lse, g, tiling,
                                hidden_ref.dtype)
    return tuple(s + _triton_dot(d_logits, rows_ref[vocab, columns(c)])
                 for c, s in enumerate(sums))

  sums = jax.lax.fori_loop(
      0, vocab_tiles, step,
      tuple(jnp.zeros((HIDDEN_GRAD_TOKENS, tiling.chunk), jnp.float32)
            for _ in range(tiling.chunks_per_group)))
  for c, s in enumerate(sums):
    d_hidden_ref[tokens, columns(c)] = s.astype(d_hidden_ref.dtype)


def _rows_gradient_kernel(hidden_ref, rows_ref, labels_ref, lse_ref, g_ref,
                          d_rows_ref, *, tiling: Tiling, token_tiles: int):
  vocab = pl.ds(pl.program_id(0) * ROWS_GRAD_VOCAB, ROWS_GRAD_VOCAB)
  first_chunk = pl.program_id(1) * tiling.chunks_per_group
  ids = pl.program_id(0) * ROWS_GRAD_VOCAB + jnp.arange(ROWS_GRAD_VOCAB)

  def step(i, sums):
    tokens = pl.ds(i * ROWS_GRAD_TOKENS, ROWS_GRAD_TOKENS)
    held = _held_hidden(hidden_ref, tokens, tiling)
    logits, capped = _logits(held or (hidden_ref, tokens), rows_ref, vocab,
                             tiling)
    d_logits = _logits_gradient(logits, capped, ids, labels_ref[tokens],
                                lse_ref[tokens], g_ref[tokens], tiling,
                                hidden_ref.dtype)
    # This program's group of columns of the hidden states.
    mine = held if tiling.groups == 1 and held else [
        hidden_ref[tokens, pl.ds((first_chunk + c) * tiling.chunk,
                                 tiling.chunk)]
        for c in range(tiling.chunks_per_group)]
    return tuple(s + _triton_dot(d_logits, h, trans_a=True)
                 for h, s in zip(mine, sums))

  sums = jax.lax.fori_loop(
      0, token_tiles, step,
      tuple(jnp.zeros((ROWS_GRAD_VOCAB, tiling.chunk), jnp.float32)
            for _ in range(tiling.chunks_per_group)))
  for c, s in enumerate(sums):
    d_rows_ref[vocab, pl.ds((first_chunk + c) * tiling.chunk,
                            tiling.chunk)] = s.astype(d_rows_ref.dtype)


def _whole(shape):
  """The whole array for every program: each kernel slices its own tiles
  (Triton's blocks must be powers of two; D and V need not be)."""
  return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _call(kernel, grid, operands, out_shape, interpret: bool, num_stages: int):
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton  # GPU only
    quiet_triton_deprecation()
    compiler_params = pltriton.CompilerParams(num_warps=NUM_WARPS,
                                              num_stages=num_stages)
  return pl.pallas_call(
      kernel, grid=grid, in_specs=[_whole(x.shape) for x in operands],
      out_specs=jax.tree.map(lambda s: _whole(s.shape), out_shape),
      out_shape=out_shape, compiler_params=compiler_params,
      interpret=interpret)(*operands)


def _check_rows(rows):
  if rows.shape[0] % VOCAB_MULTIPLE:
    raise ValueError(f"rows {rows.shape} must be padded to a multiple of "
                     f"{VOCAB_MULTIPLE} vocabulary rows")


def _pad_first_axis(x, multiple: int, at_least: int = 0):
  """``x`` with zeros appended along its first axis, to a multiple of
  ``multiple`` (and at least ``at_least`` long)."""
  length = max(x.shape[0], at_least)
  extra = length + -length % multiple - x.shape[0]
  if not extra:
    return x
  return jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1))


def _pad_tokens(*per_token):
  """Pads each array's first axis (tokens) to whole tiles, at least one:
  zero hidden states, label 0, and a zero gradient, so padded tokens add
  nothing."""
  return tuple(_pad_first_axis(x, TOKEN_MULTIPLE, at_least=1)
               for x in per_token)


def vocabulary_rows(kernel, dtype):
  """The ``(D, V)`` kernel as the kernels read it: ``(V, D)`` rows in
  ``dtype``, padded with zero rows to whole tiles (rows at or past ``V``
  are masked). A tied embedding's kernel is ``table.T``, so its rows are the
  table itself: the transposes cancel."""
  return _pad_first_axis(kernel.astype(dtype).T, VOCAB_MULTIPLE)


def _local_statistics(hidden, rows, labels, tiling, interpret):
  tokens = hidden.shape[0]
  hidden, labels = _pad_tokens(hidden, labels)
  kernel = functools.partial(_statistics_kernel, tiling=tiling,
                             vocab_tiles=rows.shape[0] // FORWARD_VOCAB)
  out = (jax.ShapeDtypeStruct(labels.shape, jnp.float32),) * 2
  # One stage: two would double the shared memory of the held hidden tile.
  lse, label_logit = _call(kernel, (hidden.shape[0] // FORWARD_TOKENS,),
                           (hidden, rows, labels), out, interpret,
                           num_stages=1)
  return lse[:tokens], label_logit[:tokens]


def _local_hidden_gradient(hidden, rows, labels, lse, g, tiling, interpret):
  tokens = hidden.shape[0]
  hidden, labels, lse, g = _pad_tokens(hidden, labels, lse, g)
  kernel = functools.partial(_hidden_gradient_kernel, tiling=tiling,
                             vocab_tiles=rows.shape[0] // HIDDEN_GRAD_VOCAB)
  grid = (hidden.shape[0] // HIDDEN_GRAD_TOKENS, tiling.groups)
  return _call(kernel, grid, (hidden, rows, labels, lse, g),
               jax.ShapeDtypeStruct(hidden.shape, hidden.dtype), interpret,
               num_stages=2)[:tokens]


def _local_rows_gradient(hidden, rows, labels, lse, g, tiling, interpret,
                         dtype):
  hidden, labels, lse, g = _pad_tokens(hidden, labels, lse, g)
  kernel = functools.partial(_rows_gradient_kernel, tiling=tiling,
                             token_tiles=hidden.shape[0] // ROWS_GRAD_TOKENS)
  grid = (rows.shape[0] // ROWS_GRAD_VOCAB, tiling.groups)
  return _call(kernel, grid, (hidden, rows, labels, lse, g),
               jax.ShapeDtypeStruct(rows.shape, dtype), interpret,
               num_stages=2)


# ---------------------------------------------------------------------------
# Across devices. A pallas_call has no partitioning rule of its own: under
# jit with batch-sharded hidden states XLA would gather them and run the
# whole batch's loss on every device. These rules split the kernels by
# tokens (jax's custom_partitioning, as its cuDNN attention uses): each
# device runs its own tokens, the vocabulary rows are replicated, and the
# rows' gradient is summed over the devices that split the tokens. Under
# shard_map, or on one device, the kernels run as they are.
# ---------------------------------------------------------------------------


def _partitioner(local_fn, rule: str, static: int,
                 reduce_over_tokens: bool):
  """``local_fn`` under custom_partitioning: its operands, named by the
  Shardy ``rule`` (n: tokens, d: hidden width, v: vocabulary rows), are
  split by tokens; its last ``static`` arguments are static."""
  operands = rule.split("->")[0].count(",") + 1
  wrapped = custom_partitioning(
      local_fn, static_argnums=tuple(range(operands, operands + static)))

  def partition(*args):
    statics, (mesh, arg_shapes, result_shape) = args[:static], args[static:]
    axes = leading_mesh_axes(arg_shapes[0].sharding)
    arg_shardings = tuple(
        split_over(mesh, axes if i != 1 else (), shape.ndim)
        for i, shape in enumerate(arg_shapes))     # operand 1: the rows

    def lower(*xs):
      out = local_fn(*xs, *statics)
      return jax.lax.psum(out, axes) if reduce_over_tokens and axes else out

    results = jax.tree.map(
        lambda r: split_over(mesh, () if reduce_over_tokens else axes,
                                 r.ndim), result_shape)
    return mesh, lower, results, arg_shardings

  def infer(*args):
    mesh, arg_shapes, result_shape = args[static:]
    axes = (() if reduce_over_tokens
            else leading_mesh_axes(arg_shapes[0].sharding))
    return jax.tree.map(lambda r: split_over(mesh, axes, r.ndim),
                        result_shape)

  wrapped.def_partition(
      partition=partition, infer_sharding_from_operands=infer,
      sharding_rule=rule, need_replication_factors=("d", "v"),
      **({"reduction_factors": ("n",)} if reduce_over_tokens else {}))
  return wrapped


_statistics = _partitioner(_local_statistics, "n d, v d, n -> n, n",
                           static=2, reduce_over_tokens=False)
_hidden_gradient = _partitioner(_local_hidden_gradient,
                                "n d, v d, n, n, n -> n d", static=2,
                                reduce_over_tokens=False)
_rows_gradient = _partitioner(_local_rows_gradient,
                              "n d, v d, n, n, n -> v d", static=3,
                              reduce_over_tokens=True)


def _vmappable(fn, per_token: bool):
  """``fn(*operands)`` with a ``vmap`` rule (custom_partitioning has none).

  A batch over tokens that shares the vocabulary rows is more tokens, for
  kernels whose results are per token (``per_token``): they run once on
  the flattened batch. Anything else (per-example rows' gradients, batched
  rows) runs one batch element at a time (``lax.map``)."""
  batchable = jax.custom_batching.custom_vmap(fn)

  @batchable.def_vmap
  def rule(axis_size, in_batched, *operands):
    full = [x if batched else jnp.broadcast_to(x, (axis_size,) + x.shape)
            for x, batched in zip(operands, in_batched)]
    if per_token and not in_batched[1]:
      flat = [x.reshape((-1,) + x.shape[2:]) for x in full]
      flat[1] = operands[1]
      out = batchable(*flat)
      out = jax.tree.map(
          lambda r: r.reshape((axis_size, -1) + r.shape[1:]), out)
    else:
      out = jax.lax.map(lambda xs: batchable(*xs), tuple(full))
    return out, jax.tree.map(lambda _: True, out)

  return batchable


def statistics(hidden, rows, labels, tiling: Tiling, *, interpret=False):
  """Per token: fp32 log-sum-exp of the logits and the label's logit."""
  _check_rows(rows)
  return _vmappable(lambda h, r, y: _statistics(h, r, y, tiling, interpret),
                    per_token=True)(hidden, rows, labels)


def hidden_gradient(hidden, rows, labels, lse, g, tiling: Tiling, *,
                    interpret=False):
  """``d_logits @ rows`` without the logits, in the hidden's dtype."""
  _check_rows(rows)
  return _vmappable(
      lambda *xs: _hidden_gradient(*xs, tiling, interpret),
      per_token=True)(hidden, rows, labels, lse, g)


def rows_gradient(hidden, rows, labels, lse, g, tiling: Tiling, dtype, *,
                  interpret=False):
  """``d_logits.T @ hidden`` without the logits, accumulated in fp32 and
  written in ``dtype`` (the kernel's); summed over the devices that split
  the tokens."""
  _check_rows(rows)
  name = jnp.dtype(dtype).name
  return _vmappable(
      lambda *xs: _rows_gradient(*xs, tiling, interpret, name),
      per_token=False)(hidden, rows, labels, lse, g)


__all__ = [
    "TOKEN_MULTIPLE",
    "VOCAB_MULTIPLE",
    "gemm_flops",
    "hidden_gradient",
    "rows_gradient",
    "statistics",
    "Tiling",
    "vocabulary_rows",
    "why_unsupported",
    "why_xla_is_cheaper",
]
