"""Tests for jmp_lab.losses: fp32 losses, and the cross-entropy of a linear
layer over vocabulary blocks that never stores the logits."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax.linen as nn
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jmp_lab
from jmp_lab import linen as jl
from jmp_lab import losses
from jmp_lab.diagnostics.audit import compiled_sub_jaxprs
from cuda_compile import require_cuda_plugin  # noqa: E402

TOKENS, WIDTH, VOCAB = 48, 32, 1000


def problem(dtype=jnp.float32, vocab=VOCAB, key=0):
  k1, k2, k3, k4 = jax.random.split(jax.random.key(key), 4)
  hidden = jax.random.normal(k1, (2, TOKENS // 2, WIDTH)).astype(dtype)
  kernel = jax.random.normal(k2, (WIDTH, vocab)) * 0.3
  labels = jax.random.randint(k3, (2, TOKENS // 2), 0, vocab)
  where = jax.random.bernoulli(k4, 0.8, labels.shape)
  return hidden, kernel, labels, where


def stored(hidden, kernel, labels, where=None, cap=None):
  """The stored-logits reference: the head in the hidden's dtype, the loss
  in fp32."""
  logits = (hidden @ kernel.astype(hidden.dtype)).astype(jnp.float32)
  if cap is not None:
    logits = cap * jnp.tanh(logits / cap)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  return loss if where is None else jnp.where(where, loss, 0.0)


def value_and_grads(fn, hidden, kernel):
  return jax.value_and_grad(lambda h, k: fn(h, k).sum(), argnums=(0, 1))(
      hidden, kernel)


@pytest.mark.parametrize("block", [VOCAB, 256, 300, 64],
                         ids=["one block", "ragged last block", "uneven",
                              "many blocks"])
@pytest.mark.parametrize("cap", [None, 8.0], ids=["no cap", "soft cap"])
def test_fp32_equals_the_stored_logits_loss_and_gradients(block, cap):
  hidden, kernel, labels, where = problem()
  got = value_and_grads(lambda h, k: losses.linear_cross_entropy(
      h, k, labels, where=where, block_size=block, logit_soft_cap=cap),
                        hidden, kernel)
  want = value_and_grads(lambda h, k: stored(h, k, labels, where, cap),
                         hidden, kernel)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_per_token_losses_masked_tokens_and_ignored_labels():
  hidden, kernel, labels, where = problem()
  labels = jnp.where(where, labels, -100)   # ignored labels, out of range
  got = losses.linear_cross_entropy(hidden, kernel, labels, where=where,
                                    block_size=128)
  chex.assert_shape(got, labels.shape)
  chex.assert_type(got, jnp.float32)
  assert float(jnp.abs(jnp.where(where, 0.0, got)).max()) == 0.0
  chex.assert_trees_all_close(got, stored(hidden, kernel,
                                          jnp.where(where, labels, 0), where),
                              rtol=1e-5, atol=1e-6)
  d_hidden = jax.grad(lambda h: losses.linear_cross_entropy(
      h, kernel, labels, where=where).sum())(hidden)
  assert float(jnp.abs(jnp.where(where[..., None], 0.0, d_hidden)).max()) == 0


def test_bf16_is_as_close_to_fp32_as_the_stored_bf16_path_is():
  hidden, kernel, labels, _ = problem()
  exact = value_and_grads(lambda h, k: stored(h, k, labels), hidden, kernel)
  half = hidden.astype(jnp.bfloat16)

  def distance(result):
    (loss, (dh, dk)), (loss0, (dh0, dk0)) = result, exact
    return [float(jnp.abs(loss - loss0) / jnp.abs(loss0)),
            float(jnp.abs(dh.astype(jnp.float32) - dh0).max()
                  / jnp.abs(dh0).max()),
            float(jnp.abs(dk - dk0).max() / jnp.abs(dk0).max())]

  blocked = distance(value_and_grads(lambda h, k: losses.linear_cross_entropy(
      h, k, labels, block_size=256), half, kernel))
  materialized = distance(value_and_grads(
      lambda h, k: stored(h, k, labels), half, kernel))
  for got, reference in zip(blocked, materialized):
    assert got <= 1.5 * reference + 1e-6, (blocked, materialized)


def test_no_stored_logits_and_half_gemms():
  """No intermediate of the whole (tokens, vocab) shape, in any dtype; every
  GEMM over bf16 operands."""
  hidden, kernel, labels, _ = problem(jnp.bfloat16)
  fn = jax.grad(lambda h, k: losses.linear_cross_entropy(
      h, k, labels, block_size=256).sum(), argnums=(0, 1))
  jaxpr = jax.make_jaxpr(fn)(hidden, kernel).jaxpr

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      yield eqn
      for inner in compiled_sub_jaxprs(eqn):
        yield from walk(inner)

  eqns = list(walk(jaxpr))
  shapes = {tuple(v.aval.shape) for e in eqns for v in e.outvars
            if hasattr(v.aval, "shape")}
  assert not any(s[-1:] == (VOCAB,) and np.prod(s) >= TOKENS * VOCAB
                 for s in shapes), shapes
  gemms = [e for e in eqns if e.primitive.name == "dot_general"]
  assert gemms and all(
      np.dtype(v.aval.dtype) == np.dtype(jnp.bfloat16)
      for e in gemms for v in e.invars)


def test_tied_embedding_gradient_reaches_the_table():
  hidden, _, labels, _ = problem()
  table = jax.random.normal(jax.random.key(5), (VOCAB, WIDTH)) * 0.3

  def tied(table):
    return losses.linear_cross_entropy(hidden, table.T, labels,
                                       block_size=300).mean()

  want = jax.grad(lambda t: stored(hidden, t.T, labels).mean())(table)
  chex.assert_trees_all_close(jax.grad(tied)(table), want, rtol=1e-5,
                              atol=1e-7)


class JitAndShardedTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_under_jit_and_grad(self):
    hidden, kernel, labels, where = problem()
    fn = self.variant(functools.partial(value_and_grads, lambda h, k: (
        losses.linear_cross_entropy(h, k, labels, where=where,
                                    block_size=200))))
    chex.assert_trees_all_close(
        fn(hidden, kernel),
        value_and_grads(lambda h, k: stored(h, k, labels, where), hidden,
                        kernel), rtol=1e-5, atol=1e-6)

  def test_data_parallel_batch_matches_one_device(self):
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    hidden, kernel, labels, where = problem()
    shard = lambda x: jax.device_put(  # noqa: E731
        x, NamedSharding(mesh, P("data")))
    fn = jax.jit(functools.partial(value_and_grads, lambda h, k: (
        losses.linear_cross_entropy(h, k, labels, where=where,
                                    block_size=256))))
    got = fn(shard(hidden), kernel)
    want = fn(hidden, kernel)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_policy_with_a_reduce_dtype_keeps_the_kernel_gradient_fp32():
  """Its GEMM accumulates in fp32 and the gradient comes back in the
  kernel's dtype: an fp32 kernel's gradient is summed across devices in fp32."""
  hidden, kernel, labels, _ = problem(jnp.bfloat16)
  grad = jax.grad(lambda k: losses.linear_cross_entropy(
      hidden, k, labels, block_size=256, implementation="xla").sum())
  jaxpr = jax.make_jaxpr(grad)(kernel).jaxpr
  weight_gemms = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"
                  and e.outvars[0].aval.shape[-1] == WIDTH]
  assert weight_gemms and all(
      np.dtype(e.params["preferred_element_type"]) == np.dtype(jnp.float32)
      for e in weight_gemms)
  chex.assert_type(grad(kernel), jnp.float32)
  # The kernels accumulate in fp32 registers and write the kernel's dtype.
  chex.assert_type(jax.grad(lambda k: losses.linear_cross_entropy(
      hidden, k, labels, implementation="interpret").sum())(kernel),
                   jnp.float32)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"kernel": jnp.ones((WIDTH + 1, 10))}, ValueError, r"kernel must be \(D, V\)"),
    ({"labels": jnp.zeros((3,), jnp.int32)}, ValueError, "labels must be integers"),
    ({"where": jnp.ones((2, TOKENS // 2))}, ValueError, "where must be bool"),
    ({"block_size": 0}, ValueError, "block_size must be a positive int"),
    ({"logit_soft_cap": -1.0}, ValueError, "logit_soft_cap must be a positive"),
    ({"hidden": jnp.ones((2, 3), jnp.int32)}, TypeError, "hidden must be a floating"),
])
def test_bad_input_names_the_argument(kwargs, error, match):
  hidden, kernel, labels, _ = problem()
  args = {"hidden": hidden, "kernel": kernel, "labels": labels, **kwargs}
  with pytest.raises(error, match=match):
    losses.linear_cross_entropy(args.pop("hidden"), args.pop("kernel"),
                                args.pop("labels"), **args)


def test_the_old_helper_names_stay():
  assert jl.softmax_cross_entropy_with_integer_labels is (
      losses.softmax_cross_entropy_with_integer_labels)
  assert jmp_lab.nnx.log_softmax is losses.log_softmax
  chex.assert_type(jl.softmax(jnp.ones(3, jnp.bfloat16)), jnp.bfloat16)


def test_compiled_for_an_h100_each_blocks_logits_are_read_once_a_pass():
  """Compiled for an H100: outside the GEMMs, one kernel a pass reads a
  block's logits. In the forward pass that is the block's log-sum-exp and
  correct-class logit, one variadic reduction (max and then sum(exp) would
  be two, each reading the block: 0.82 GB a step at GPT-2's shapes); in the
  backward pass, the kernel that writes the logits' gradient. The kernel's
  gradient leaves its GEMM in the kernel's dtype (no fp32 copy converted by
  another kernel)."""
  require_cuda_plugin()
  tokens, width, vocab, block = 4096, 128, 16384, 2048
  hidden = jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16)
  kernel = jax.ShapeDtypeStruct((width, vocab), jnp.bfloat16)
  labels = jax.ShapeDtypeStruct((tokens,), jnp.int32)
  fn = jax.grad(lambda h, k, y: losses.linear_cross_entropy(
      h, k, y, block_size=block, implementation="xla").sum(), argnums=(0, 1))
  report = jmp_lab.diagnostics.compiled_report(fn, hidden, kernel, labels,
                                               target="h100")
  block_bytes = tokens * block * 2  # one block's bf16 logits
  readers = [k for k in report.kernel_records
             if k.opcode != "custom-call" and k.io_bytes >= block_bytes]
  forward = [k for k in readers if "transpose(" not in k.op_name]
  backward = [k for k in readers if "transpose(" in k.op_name]
  assert len(forward) == vocab // block, [k.name for k in forward]
  assert len(backward) == vocab // block, [k.name for k in backward]
  assert "f32[2048,128]" not in report.hlo_text  # a block's kernel gradient


# --- the Pallas kernels (implementation="triton"; "interpret" on a CPU) -------


def half_distance(fn, hidden, kernel, labels, where, cap=None):
  """Relative distance of ``fn``'s half-precision per-token losses and
  gradients from the fp32 stored-logits reference: worst token's loss, then
  the worst element of each gradient. (The summed loss is no measure: its
  tokens' errors cancel by chance.)"""
  def per_token_and_grads(fn, hidden):
    loss, vjp = jax.vjp(fn, hidden, kernel)
    return loss, vjp(jnp.ones_like(loss))

  exact = per_token_and_grads(lambda h, k: stored(h, k, labels, where, cap),
                              hidden.astype(jnp.float32))
  got = per_token_and_grads(fn, hidden)
  return [float(jnp.abs(a.astype(jnp.float32) - b).max() / jnp.abs(b).max())
          for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(exact))]


@pytest.mark.parametrize("tokens, width, vocab, cap, dtype", [
    (48, 32, 100, None, jnp.bfloat16),     # one tile of 128 rows
    (48, 32, 1000, None, jnp.bfloat16),    # many tiles, the last ragged
    (70, 48, 256, 8.0, jnp.float16),       # tokens padded to a tile; soft cap
    (40, 1040, 130, None, jnp.bfloat16),   # wide: read per step, 5 groups
], ids=["one tile", "ragged vocab", "padded tokens, soft cap, fp16",
        "wide hidden"])
@pytest.mark.parametrize("implementation", ["interpret", "triton"])
def test_kernels_are_as_close_to_fp32_as_the_stored_half_path(
    tokens, width, vocab, cap, dtype, implementation):
  """The kernels with masks and ignored labels, no farther from fp32 than
  the stored-logits path in the same half dtype. On a CPU in interpret
  mode (the same bodies Triton compiles); on a GPU, Triton itself
  (benchmarks/gpu_run.sh's kernels part runs it)."""
  if implementation == "triton" and jax.devices()[0].platform != "gpu":
    pytest.skip("Triton runs on a GPU (benchmarks/gpu_run.sh runs it)")
  k1, k2, k3, k4 = jax.random.split(jax.random.key(3), 4)
  hidden = jax.random.normal(k1, (tokens, width)).astype(dtype)
  kernel = jax.random.normal(k2, (width, vocab)) * 0.1
  where = jax.random.bernoulli(k4, 0.8, (tokens,))
  labels = jnp.where(where, jax.random.randint(k3, (tokens,), 0, vocab), -100)
  fused = half_distance(lambda h, k: losses.linear_cross_entropy(
      h, k, labels, where=where, logit_soft_cap=cap,
      implementation=implementation), hidden, kernel, labels, where, cap)
  half = half_distance(lambda h, k: stored(h, k, labels, where, cap),
                       hidden, kernel, labels, where, cap)
  for got, reference in zip(fused, half):
    assert got <= 1.5 * reference + 1e-6, (fused, half)
  losses_ = losses.linear_cross_entropy(hidden, kernel, labels, where=where,
                                        implementation=implementation)
  chex.assert_type(losses_, jnp.float32)
  assert float(jnp.abs(jnp.where(where, 0.0, losses_)).max()) == 0.0


def close_to_fp32(got, want):
  """Within bf16 rounding of the fp32 reference: the kernels keep the logits
  in fp32, XLA's path rounds them to bf16, so the two are compared with the
  reference, not with each other."""
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a = a.astype(jnp.float32)
    chex.assert_trees_all_close(a, b, rtol=0, atol=2e-2 * float(
        jnp.abs(b).max()))


class KernelJitTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_kernels_under_jit_and_grad(self):
    hidden, kernel, labels, where = problem(jnp.bfloat16)
    got = self.variant(functools.partial(value_and_grads, lambda h, k: (
        losses.linear_cross_entropy(h, k, labels, where=where,
                                    implementation="interpret"))))(
                                        hidden, kernel)
    close_to_fp32(got, value_and_grads(
        lambda h, k: stored(h, k, labels, where),
        hidden.astype(jnp.float32), kernel))
    chex.assert_type(got[1], [jnp.bfloat16, jnp.float32])


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_no_tokens_gives_no_losses_and_zero_gradients(implementation):
  """An empty batch (every sequence filtered out) is a valid call."""
  hidden = jnp.ones((0, WIDTH), jnp.bfloat16)
  labels = jnp.zeros((0,), jnp.int32)
  kernel = jnp.ones((WIDTH, VOCAB))
  fn = lambda k: losses.linear_cross_entropy(  # noqa: E731
      hidden, k, labels, implementation=implementation)
  chex.assert_shape(fn(kernel), (0,))
  chex.assert_trees_all_equal(jax.grad(lambda k: fn(k).sum())(kernel),
                              jnp.zeros_like(kernel))


def test_tied_table_gradient_through_the_kernels():
  hidden, _, labels, _ = problem(jnp.bfloat16)
  table = jax.random.normal(jax.random.key(5), (VOCAB, WIDTH)) * 0.3
  got = jax.grad(lambda t: losses.linear_cross_entropy(
      hidden, t.T, labels, implementation="interpret").mean())(table)
  want = jax.grad(lambda t: stored(hidden.astype(jnp.float32), t.T,
                                   labels).mean())(table)
  close_to_fp32(got, want)


@pytest.mark.parametrize("kwargs, match", [
    ({"implementation": "cuda"}, "implementation must be one of"),
    ({"implementation": "triton"}, "bf16 or fp16"),
    ({"implementation": "interpret",
      "hidden": jnp.ones((4, 40), jnp.bfloat16)}, "multiple of 16"),
])
def test_kernels_refuse_what_they_cannot_take(kwargs, match):
  hidden, kernel, labels, _ = problem()   # fp32 hidden
  args = {"hidden": hidden, "kernel": kernel, "labels": labels, **kwargs}
  if args["hidden"].shape[-1] != WIDTH:
    args["kernel"] = jnp.ones((40, 10))
    args["labels"] = jnp.zeros((4,), jnp.int32)
  with pytest.raises(ValueError, match=match):
    losses.linear_cross_entropy(args.pop("hidden"), args.pop("kernel"),
                                args.pop("labels"), **args)


def test_auto_keeps_fp32_hidden_on_the_xla_path_everywhere():
  """fp32 operands would run the kernels' dots in TF32: "auto" gives fp32
  hidden states XLA's path even when compiled for CUDA."""
  require_cuda_plugin()
  hidden = jax.ShapeDtypeStruct((256, 64), jnp.float32)
  kernel = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
  labels = jax.ShapeDtypeStruct((256,), jnp.int32)
  report = jmp_lab.diagnostics.compiled_report(
      lambda h, k, y: losses.linear_cross_entropy(h, k, y).sum(), hidden,
      kernel, labels, target="h100")
  assert report.pallas_kernels == []


def test_compiled_for_an_h100_auto_runs_the_kernels_without_the_logits():
  """Compiled for an H100, "auto" runs the three Triton kernels: no buffer
  of (tokens, block) logits, no register spill, no GEMM with an fp32
  operand, and a fraction of the XLA path's bytes (GPT-2's shapes:
  benchmarks/RESULTS.md)."""
  require_cuda_plugin()
  tokens, width, vocab = 4096, 256, 16384
  hidden = jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((vocab, width), jnp.float32)   # tied
  labels = jax.ShapeDtypeStruct((tokens,), jnp.int32)

  def report(implementation):
    fn = jax.grad(lambda h, t, y: losses.linear_cross_entropy(
        h, t.T, y, implementation=implementation).mean(), argnums=(0, 1))
    return jmp_lab.diagnostics.compiled_report(fn, hidden, table, labels,
                                               target="h100")

  fused, xla = report("auto"), report("xla")
  names = sorted(k.name for k in fused.pallas_kernels)
  assert names == ["_hidden_gradient_kernel", "_rows_gradient_kernel",
                   "_statistics_kernel"], names
  assert all(k.spill_bytes == 0 for k in fused.pallas_kernels)
  assert fused.fp32_gemms == []
  assert f"[{tokens},{vocab}]" not in fused.hlo_text
  assert fused.bytes_accessed <= 0.25 * xla.bytes_accessed, (
      fused.bytes_accessed, xla.bytes_accessed)
  # The roofline model counts the kernels' products: the logits once
  # forward, then recomputed and multiplied once in each gradient kernel.
  product = 2.0 * tokens * width * vocab
  assert sum(g.flops * g.times for g in fused.gemms if g.kind == "pallas") == (
      5 * product)
  assert {g.math for g in fused.gemms} == {"16-bit"}


def test_compiled_for_an_h100_auto_keeps_wide_hidden_on_the_xla_path():
  """Over 768 columns the gradient kernels would recompute the logits per
  group of columns: "auto" keeps XLA's path, "triton" still runs them."""
  require_cuda_plugin()
  tokens, width, vocab = 1024, 1024, 4096
  args = (jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16),
          jax.ShapeDtypeStruct((vocab, width), jnp.float32),
          jax.ShapeDtypeStruct((tokens,), jnp.int32))

  def kernels(implementation):
    fn = jax.grad(lambda h, t, y: losses.linear_cross_entropy(
        h, t.T, y, implementation=implementation).mean(), argnums=(0, 1))
    return jmp_lab.diagnostics.compiled_report(fn, *args, target="h100")

  assert kernels("auto").pallas_kernels == []
  forced = kernels("triton")
  assert len(forced.pallas_kernels) == 3
  # 2 groups of 512 columns: each gradient kernel computes the logits twice.
  product = 2.0 * tokens * width * vocab
  assert sum(g.flops for g in forced.gemms if g.kind == "pallas") == (
      7 * product)


def test_kernels_split_by_tokens_across_devices():
  """Batch-sharded under jit, each device runs the kernels on its own tokens
  (no gathered hidden states) and the kernel's gradient is summed across
  devices; the result equals one device's."""
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  hidden, kernel, labels, where = problem(jnp.bfloat16)
  fn = jax.jit(functools.partial(value_and_grads, lambda h, k: (
      losses.linear_cross_entropy(h, k, labels, where=where,
                                  implementation="interpret"))))
  sharded = jax.device_put(hidden, NamedSharding(mesh, P("data")))
  chex.assert_trees_all_close(fn(sharded, kernel), fn(hidden, kernel),
                              rtol=1e-5, atol=1e-6)
  hlo = fn.lower(sharded, kernel).compile().as_text()
  assert "all-gather" not in hlo


@pytest.mark.model_compile
def test_compiled_on_8_h100s_each_device_runs_its_own_tokens():
  """Data parallel on 8 H100s: the kernels see 1/8 of the tokens each, and
  the only collective is the kernel gradient's all-reduce (which any
  data-parallel step has)."""
  require_cuda_plugin()
  tokens, width, vocab = 4096, 256, 8192
  fn = jax.grad(lambda h, t, y: losses.linear_cross_entropy(
      h, t.T, y).mean(), argnums=(0, 1))
  report = jmp_lab.diagnostics.compiled_report(
      fn, jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16),
      jax.ShapeDtypeStruct((vocab, width), jnp.float32),
      jax.ShapeDtypeStruct((tokens,), jnp.int32), target="h100", devices=8,
      in_specs=(P("data"), P(), P("data")))
  assert len(report.pallas_kernels) == 3
  assert [c.kind for c in report.collectives] == ["all-reduce"]
  assert f"bf16[{tokens // 8},{width}]" in report.hlo_text
  assert f"bf16[{tokens},{width}]" not in report.hlo_text


def test_kernels_under_vmap_equal_one_call_per_example():
  """vmap over examples: per-example losses and both gradients (the
  kernel's per example, and a batched kernel) equal unbatched calls."""
  hidden, kernel, labels, where = problem(jnp.bfloat16)
  kernels = jnp.stack([kernel, kernel * 0.5])

  def loss(h, k, y, w):
    return losses.linear_cross_entropy(h, k, y, where=w,
                                       implementation="interpret").sum()

  grads = jax.vmap(jax.value_and_grad(loss, argnums=(0, 1)))
  got = grads(hidden, kernels, labels, where)
  want = [jax.value_and_grad(loss, argnums=(0, 1))(
      hidden[i], kernels[i], labels[i], where[i]) for i in range(2)]
  chex.assert_trees_all_close(got, jax.tree.map(lambda *x: jnp.stack(x),
                                                *want), rtol=1e-5, atol=1e-6)
  shared = jax.vmap(loss, in_axes=(0, None, 0, 0))(hidden, kernel, labels,
                                                   where)
  chex.assert_trees_all_close(shared, jnp.stack(
      [loss(hidden[i], kernel, labels[i], where[i]) for i in range(2)]),
                              rtol=1e-5)


class _PinnedFloat32LM(nn.Module):
  """A language model as public code writes it: every layer pins
  dtype=float32, the head is the embedding table (tied), and it returns
  its loss from the last hidden states."""

  @nn.compact
  def __call__(self, tokens, targets, implementation):
    embed = nn.Embed(VOCAB, WIDTH, dtype=jnp.float32,
                     param_dtype=jnp.float32)
    x = embed(tokens)
    x = x + nn.Dense(WIDTH, dtype=jnp.float32,
                     param_dtype=jnp.float32)(nn.gelu(x))
    x = nn.LayerNorm(dtype=jnp.float32)(x)
    return losses.linear_cross_entropy(x, embed.embedding.T, targets,
                                       implementation=implementation)


def test_kernels_under_a_policy_on_a_model_that_pins_float32():
  """with_policy reaches the pinned layers, so the hidden states arrive in
  bf16 and the kernels take them (they refuse fp32); the tied table's
  gradient comes back fp32 and matches the fp32 model's."""
  tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, VOCAB)
  targets = jnp.roll(tokens, -1, axis=1)
  model = jl.with_policy(_PinnedFloat32LM(), "mixed_bfloat16")
  params = model.init(jax.random.key(1), tokens, targets, "xla")

  def grads(module, implementation):
    return jax.value_and_grad(lambda p: module.apply(
        p, tokens, targets, implementation).mean())(params)

  loss, got = grads(model, "interpret")
  loss32, want = grads(_PinnedFloat32LM(), "xla")
  chex.assert_type(jax.tree.leaves(got), jnp.float32)
  np.testing.assert_allclose(loss, loss32, rtol=2e-2)
  close_to_fp32(got, want)
  with pytest.raises(ValueError, match="bf16 or fp16"):
    _PinnedFloat32LM().apply(params, tokens, targets, "interpret")


# --- tensor parallelism and the reduce dtype (issue 39) -----------------------


@pytest.mark.parametrize("shards", [2, 4])
@pytest.mark.parametrize("cap", [None, 8.0], ids=["no cap", "soft cap"])
def test_vocab_shards_give_the_same_loss_and_gradients(shards, cap):
  """Walking each shard's part of the vocabulary in blocks is the same sum
  in another order."""
  hidden, kernel, labels, where = problem()
  def run(vocab_shards):
    return value_and_grads(lambda h, k: losses.linear_cross_entropy(
        h, k, labels, where=where, block_size=48, logit_soft_cap=cap,
        implementation="xla", vocab_shards=vocab_shards), hidden, kernel)
  chex.assert_trees_all_close(run(shards), run(1), rtol=1e-5, atol=1e-6)


def test_vocab_shards_must_divide_the_vocabulary():
  hidden, kernel, labels, _ = problem()
  for bad in (0, 7):
    with pytest.raises(ValueError, match="vocab_shards must be a positive int"):
      losses.linear_cross_entropy(hidden, kernel, labels, vocab_shards=bad)
  for bad in (2.0, True):
    with pytest.raises(TypeError, match="vocab_shards must be an int"):
      losses.linear_cross_entropy(hidden, kernel, labels, vocab_shards=bad)
  with pytest.raises(ValueError, match="use implementation='xla'"):
    losses.linear_cross_entropy(hidden.astype(jnp.bfloat16),
                                kernel.astype(jnp.bfloat16), labels,
                                vocab_shards=2, implementation="interpret")


@pytest.mark.parametrize("policy, kernels", [
    ("p=bf16,c=bf16,o=f32", True),
    ("p=bf16,c=bf16,o=f32,reduce=float32", False)])
def test_auto_takes_xla_where_the_kernels_cannot_reduce_in_the_reduce_dtype(
    policy, kernels):
  """Compiled for an H100, ``"auto"`` runs the Pallas kernels, but not under
  a reduce dtype (their kernel gradient comes back in the kernel's dtype,
  so ``reduce=float32`` would not reach the head)."""
  from jmp_lab.diagnostics import compiled  # pylint: disable=import-outside-toplevel
  hidden = jax.ShapeDtypeStruct((1024, 768), jnp.bfloat16)
  kernel = jax.ShapeDtypeStruct((768, 4096), jnp.bfloat16)
  labels = jnp.zeros((1024,), jnp.int32)

  def loss(k, h):
    return losses.linear_cross_entropy(h, k, labels).mean()
  grad = jmp_lab.scaled_value_and_grad(loss, jmp_lab.NoOpLossScale(),
                                       policy=policy)
  report = compiled.compiled_report(grad, kernel, hidden, target="h100")
  assert ("_rows_gradient_kernel" in report.pallas_summary()) == kernels


def test_under_a_reduce_dtype_the_bf16_kernels_gradient_is_summed_in_it():
  """A bf16 head used in the loss under a policy with ``reduce=float32``:
  its gradient GEMMs write fp32 (summed across devices in fp32) and the
  gradient is cast to bf16 after; without the reduce dtype they write bf16."""
  hidden, kernel, labels, _ = problem(jnp.bfloat16)
  kernel = kernel.astype(jnp.bfloat16)

  def weight_gemm_dtypes(policy):
    def loss(k, h):
      return losses.linear_cross_entropy(h, k, labels, block_size=256,
                                         implementation="xla").mean()
    grad = jmp_lab.scaled_value_and_grad(loss, jmp_lab.NoOpLossScale(),
                                         policy=policy)
    jaxpr = jax.make_jaxpr(grad)(kernel, hidden).jaxpr
    eqns = [e for j in [jaxpr] + [s for e in jaxpr.eqns
                                  for s in compiled_sub_jaxprs(e)]
            for e in j.eqns]
    return {np.dtype(e.params["preferred_element_type"]).name for e in eqns
            if e.primitive.name == "dot_general"
            and e.outvars[0].aval.shape[-1] == WIDTH
            and e.outvars[0].aval.shape[0] != TOKENS}
  assert weight_gemm_dtypes("p=bf16,c=bf16,o=f32,reduce=float32") == {"float32"}
  assert weight_gemm_dtypes("p=bf16,c=bf16,o=f32") == {"bfloat16"}
