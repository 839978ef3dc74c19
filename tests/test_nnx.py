"""Tests for jmp_lab.nnx: policies on NNX module graphs, the NNX optimizer
and train step. They mirror the linen tests (test_linen, test_training)."""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import parameterized
from flax import nnx

import jmp_lab
from jmp_lab.diagnostics.audit import compiled_sub_jaxprs
from jmp_lab import nnx as jnnx

from conftest import tree_bits_equal
from cuda_compile import require_cuda_plugin  # noqa: E402

F32, BF16, F16 = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16),
                  np.dtype(jnp.float16))


class ConvNet(nnx.Module):
  """Conv + BatchNorm + Linear + LayerNorm + GroupNorm + RMSNorm + dropout."""

  def __init__(self, rngs):
    self.conv = nnx.Conv(1, 8, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.dense = nnx.Linear(6 * 6 * 8, 32, rngs=rngs)
    self.ln = nnx.LayerNorm(32, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.gn = nnx.GroupNorm(32, num_groups=4, rngs=rngs)
    self.rms = nnx.RMSNorm(32, rngs=rngs)
    self.head = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x):
    x = self.bn(self.conv(x))
    x = nnx.relu(x).reshape((x.shape[0], -1))
    x = self.dropout(self.ln(self.dense(x)))
    return self.head(self.rms(self.gn(x)))


def primitive_dtypes(jaxpr, names):
  """(primitive, operand dtypes, output dtypes) for every eqn named in
  ``names``, recursively."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in names:
      found.append((eqn.primitive.name,
                    tuple(np.dtype(v.aval.dtype) for v in eqn.invars),
                    tuple(np.dtype(v.aval.dtype) for v in eqn.outvars)))
    for inner in compiled_sub_jaxprs(eqn):
      found += primitive_dtypes(inner, names)
  return found


def convnet(spec, **kwargs):
  return jnnx.with_policy(ConvNet(nnx.Rngs(0, dropout=1)), spec, **kwargs)


X = jnp.ones((2, 6, 6, 1))
SPECS = ["float32", "mixed_bfloat16", "mixed_float16", "p=bf16,c=bf16,o=bf16"]


# --- the policy -------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
def test_matmuls_in_compute_dtype_and_norm_reductions_in_fp32(spec):
  policy = jmp_lab.get_policy(spec)
  model = convnet(spec)
  graphdef, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(X))(state)
  matmuls = primitive_dtypes(jaxpr.jaxpr, {"dot_general", "conv_general_dilated"})
  assert {name for name, _, _ in matmuls} == {"dot_general", "conv_general_dilated"}
  for name, operands, _ in matmuls:
    assert operands == (policy.compute_dtype,) * 2, (name, operands)
  reductions = primitive_dtypes(jaxpr.jaxpr, {"reduce_sum"})
  assert len(reductions) >= 6  # batch, layer, group and rms norm statistics
  assert all(operands == (F32,) for _, operands, _ in reductions), reductions


@pytest.mark.parametrize("spec", SPECS)
def test_dtypes_of_params_stats_and_outputs(spec):
  policy = jmp_lab.get_policy(spec)
  model = convnet(spec)
  chex.assert_type(jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)),
                   policy.param_dtype)
  out = model(X)
  chex.assert_type(out, policy.output_dtype)
  stats = nnx.state(model, nnx.BatchStat)
  chex.assert_type(jax.tree_util.tree_leaves(stats), F32)
  chex.assert_tree_all_finite(stats)
  assert not np.allclose(model.bn.mean.get_raw_value(), 0.0)  # updated
  # Outside a module call a param reads as stored (nnx.state, checkpoints);
  # inside one, in its module's compute dtype (test_fp32_norm_default...).
  assert model.dense.kernel[...].dtype == policy.param_dtype
  assert model.ln.scale[...].dtype == policy.param_dtype


class Probe(nnx.Module):
  """A custom module (no Flax layer): records its input and param dtypes."""

  def __init__(self, n):
    self.w = nnx.Param(jnp.ones((n,)))
    self.seen = nnx.Variable(jnp.zeros((2,), jnp.int32))

  def __call__(self, x):
    w = self.w[...]
    self.seen[...] = jnp.array([_code(x.dtype), _code(w.dtype)])
    return x * w


def _code(dtype):
  return {F32: 32, BF16: 16, F16: 15}[np.dtype(dtype)]


class ProbedLayerNorm(nnx.LayerNorm):
  """A LayerNorm (so the fp32 default applies) that records its input dtype."""

  def __call__(self, x, *args, **kwargs):
    self.seen = nnx.Variable(jnp.array(_code(x.dtype)))
    return super().__call__(x, *args, **kwargs)


class Wrapper(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(3, 4, rngs=rngs)
    self.body = Probe(4)
    self.norm = ProbedLayerNorm(4, rngs=rngs)
    self.head = Probe(4)

  def __call__(self, x):
    return self.head(self.norm(self.body(self.dense(x))))


def seen(model):
  model(jnp.ones((2, 3)))
  return {"body": tuple(int(v) for v in model.body.seen[...]),
          "head": tuple(int(v) for v in model.head.seen[...]),
          "norm": int(model.norm.seen[...])}


def test_fp32_norm_default_and_its_output_back_in_compute_dtype():
  got = seen(jnnx.with_policy(Wrapper(nnx.Rngs(0)), "mixed_bfloat16"))
  assert got == {"body": (16, 16), "norm": 32, "head": (16, 16)}
  got = seen(jnnx.with_policy(Wrapper(nnx.Rngs(0)), "mixed_bfloat16",
                              fp32_norms=False))
  assert got["norm"] == 16


class _SowsAndDrops(nnx.Module):
  """Holds an RNG stream (its Dropout) and sows an intermediate."""

  def __init__(self, rngs):
    self.dense = nnx.Linear(32, 32, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x):
    h = self.dropout(self.dense(x))
    self.sow(nnx.Intermediate, "h", h)
    return h.sum()


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)':DeprecationWarning")
def test_a_model_that_sows_runs_under_plain_jax_transforms_when_merged():
  """Split, then merged inside ``jax.jit``/``grad``/``vmap``, as a plain NNX
  model can be. The call sows a new variable; jmp_lab used to put the
  whole state back then, the RNG counts it left alone included, and NNX
  refuses to write those from inside the transform ("Cannot mutate
  RngCount from a different trace level"). Now only the sown value and
  changed variables go back."""
  x = jnp.ones((4, 32))
  results = {}
  for policy in (None, "mixed_bfloat16"):
    model = _SowsAndDrops(nnx.Rngs(0))
    if policy:
      model = jnnx.with_policy(model, policy)
    model.eval()
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    call = lambda p: nnx.merge(graph, p, rest)(x)  # noqa: E731
    grads = jax.grad(call)(params)
    results[policy] = (jax.jit(call)(params),
                       [v.get_value() for v in jax.tree.leaves(
                           grads, is_leaf=lambda v: isinstance(v, nnx.Variable))],
                       jax.vmap(call, in_axes=(None,), axis_size=2)(params))
  chex.assert_trees_all_close(results["mixed_bfloat16"], results[None],
                              rtol=2e-2, atol=2e-2)


def test_a_path_override_that_matches_nothing_warns():
  """A misspelt override used to change nothing, silently."""
  with pytest.warns(UserWarning) as caught:
    jnnx.with_policy(Wrapper(nnx.Rngs(0)), "mixed_float16",
                     path_overrides={"params/head": "float32",
                                     "^head$": "float32", "body/w$": "f32"})
  messages = [str(w.message) for w in caught]
  assert len(messages) == 1 and "'params/head' matches no module or param "\
      "path of Wrapper" in messages[0] and "'head'" in messages[0], messages
  assert caught[0].filename == __file__


def test_class_override_applies_to_inputs_and_params():
  got = seen(jnnx.with_policy(Wrapper(nnx.Rngs(0)), "mixed_float16",
                              class_overrides={Probe: "float32"}))
  assert got["body"] == (32, 32) and got["head"] == (32, 32)


def test_path_override_on_a_module_and_on_a_single_param():
  got = seen(jnnx.with_policy(Wrapper(nnx.Rngs(0)), "mixed_float16",
                              path_overrides={"^head$": "float32"}))
  assert got["head"] == (32, 32) and got["body"] == (15, 15)
  got = seen(jnnx.with_policy(Wrapper(nnx.Rngs(0)), "mixed_float16",
                              path_overrides={"body/w$": "float32"}))
  assert got["body"] == (15, 32)


def test_applying_a_policy_again_replaces_it():
  model = jnnx.with_policy(Wrapper(nnx.Rngs(0)), "mixed_float16")
  assert seen(jnnx.with_policy(model, "mixed_bfloat16"))["body"] == (16, 16)
  assert isinstance(model.body, Probe) and type(model).__name__ == "Wrapper"
  assert jnnx.policy_dtypes(model) == (BF16, F32)


class LM(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(11, 8, rngs=rngs)
    self.out = nnx.Linear(8, 5, rngs=rngs)

  def __call__(self, tokens):
    return self.out(self.embed(tokens))


def test_integer_inputs_pass_through_embed_and_the_graph_is_unchanged():
  plain = LM(nnx.Rngs(0))
  paths = [p for p, _ in nnx.to_flat_state(nnx.state(plain))]
  model = jnnx.with_policy(LM(nnx.Rngs(0)), "mixed_bfloat16")
  assert [p for p, _ in nnx.to_flat_state(nnx.state(model))] == paths
  chex.assert_type(model(jnp.array([[1, 2, 3]])), jnp.float32)


def test_attention_softmax_is_fp32_and_matches_flax_in_fp32():
  attn = nnx.MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 5, 8))
  mask = nnx.make_causal_mask(jnp.ones((2, 5)))
  reference = attn(x, mask=mask, deterministic=True)  # Flax's, all fp32
  jnnx.with_policy(attn, "float32")
  assert attn.attention_fn is jnnx.dot_product_attention
  chex.assert_trees_all_close(attn(x, mask=mask, deterministic=True),
                              reference, atol=1e-6)
  jnnx.with_policy(attn, "mixed_bfloat16")
  graphdef, state = nnx.split(attn)
  jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(
      x, mask=mask, deterministic=True))(state)
  (exp,) = primitive_dtypes(jaxpr.jaxpr, {"exp"})
  assert exp[1] == (F32,)  # the softmax
  matmuls = primitive_dtypes(jaxpr.jaxpr, {"dot_general"})
  assert all(operands == (BF16, BF16) for _, operands, _ in matmuls)


def test_reduce_dtype_reaches_linear_weight_gradients_and_the_embed_table():
  model = jnnx.with_policy(LM(nnx.Rngs(0)), "mixed_bfloat16,reduce=float32")
  tokens = jnp.array([[1, 2, 3]])
  assert jnnx.policy_dtypes(model.embed) == (F32, BF16)  # table read in f32
  jaxpr = jax.make_jaxpr(nnx.grad(lambda m: m(tokens).sum()))(model)
  dots = primitive_dtypes(jaxpr.jaxpr, {"dot_general"})
  # forward bf16; the weight gradient accumulates and comes out in fp32
  assert any(operands == (BF16, BF16) and outputs == (F32,)
             for _, operands, outputs in dots), dots
  grads = nnx.grad(lambda m: m(tokens).sum())(model)
  chex.assert_type(jax.tree_util.tree_leaves(grads), jnp.float32)
  default = model.out.dot_general
  jnnx.with_policy(model, "mixed_bfloat16")  # applied again: taken back
  assert model.out.dot_general is jax.lax.dot_general is not default
  jnnx.with_policy(model, "mixed_fp8")  # and fp8 may follow
  assert isinstance(model.out.fp8_meta, jnnx.Fp8State)


class SharedLinear(nnx.Module):
  """One Linear called twice: its bias gradient comes from both calls."""

  def __init__(self, rngs):
    self.linear = nnx.Linear(6, 6, rngs=rngs)

  def __call__(self, x):
    return self.linear(nnx.relu(self.linear(x)))


# (a constructor of a layer, input shape): every layer whose bias or weight
# gradient the reduce dtype reaches, biases broadcast every way flax does.
REDUCE_LAYERS = [
    (lambda r: nnx.Linear(6, 3, rngs=r), (4, 5, 6)),
    (lambda r: nnx.LinearGeneral((5, 6), (2, 3), axis=(-2, -1), rngs=r), (4, 5, 6)),
    (lambda r: nnx.Conv(4, 3, (3,), rngs=r), (2, 7, 4)),
    (lambda r: nnx.ConvTranspose(4, 3, (3,), rngs=r), (2, 7, 4)),
    (lambda r: nnx.Einsum("btd,dhk->bthk", (4, 3, 2), (3, 2), rngs=r), (2, 5, 4)),
    (lambda r: nnx.Einsum("btd,dh->hbt", (4, 3), (3, 1, 1), rngs=r), (2, 5, 4)),
    (SharedLinear, (4, 6)),
]


@pytest.mark.parametrize("make, shape", REDUCE_LAYERS,
                         ids=[str(i) for i in range(len(REDUCE_LAYERS))])
def test_reduce_dtype_gradients_equal_autodiff_in_fp32(make, shape):
  """In fp32, reduce=float32 changes where gradients are summed, not their
  values (weights, and biases attached after the call)."""
  x = jax.random.normal(jax.random.key(0), shape)
  plain = make(nnx.Rngs(0))
  weights = jax.random.normal(jax.random.key(2), plain(x).shape)
  reduced = jnnx.with_policy(make(nnx.Rngs(0)), "float32,reduce=float32")
  loss = lambda m: jnp.sum(m(x) * weights)  # noqa: E731
  want = nnx.state(nnx.grad(loss)(plain))
  got = nnx.state(nnx.jit(nnx.grad(loss))(reduced))
  chex.assert_trees_all_close(jax.tree_util.tree_leaves(got),
                              jax.tree_util.tree_leaves(want),
                              rtol=1e-5, atol=1e-5)


def test_reduce_dtype_sums_bias_and_einsum_weight_gradients_in_it():
  def gradient_ops(spec):
    model = jnnx.with_policy(
        nnx.Einsum("btd,dk->btk", (6, 8), (8,), rngs=nnx.Rngs(0)), spec)
    x = jnp.ones((4, 5, 6))
    jaxpr = jax.make_jaxpr(nnx.grad(lambda m: m(x).sum()))(model).jaxpr
    sums = [outputs for _, _, outputs in primitive_dtypes(jaxpr, {"reduce_sum"})]
    dots = [outputs for _, _, outputs in primitive_dtypes(jaxpr, {"dot_general"})]
    return sums, dots

  sums, dots = gradient_ops("mixed_bfloat16")
  assert (BF16,) in sums and (F32,) not in dots
  sums, dots = gradient_ops("mixed_bfloat16,reduce=float32")
  assert (BF16,) not in sums and (F32,) in sums
  assert (F32,) in dots  # the weight gradient's product

def test_bad_arguments():
  with pytest.raises(TypeError, match="flax.nnx.Module.*linen"):
    jnnx.with_policy(lambda x: x, "mixed_bfloat16")
  with pytest.raises(TypeError, match="class_overrides keys"):
    jnnx.with_policy(Wrapper(nnx.Rngs(0)), "float32", class_overrides={"x": "f32"})
  with pytest.raises(ValueError, match="invalid path_overrides pattern"):
    jnnx.with_policy(Wrapper(nnx.Rngs(0)), "float32", path_overrides={"(": "f32"})
  with pytest.raises(ValueError, match="unknown key"):
    jnnx.with_policy(Wrapper(nnx.Rngs(0)), "x=f32")


# --- the optimizer and the train step -----------------------------------------

class BNNet(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(5, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, rngs=rngs)
    self.dropout = nnx.Dropout(0.2, rngs=rngs)
    self.head = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(self.dropout(nnx.relu(self.bn(self.dense(x)))))


def bn_loss(model, batch):
  logits = model(batch["x"])
  loss = jnnx.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return loss, {"logit_mean": jnp.mean(logits)}


BATCH = {"x": jax.random.normal(jax.random.key(1), (8, 5)),
         "y": jnp.arange(8) % 3}


def make_tx(spec, loss_scale, kind="mixed_precision", **kwargs):
  if kind == "fused_adamw":
    return jmp_lab.fused_adamw(1e-2, policy=spec, loss_scale=loss_scale,
                               backend="reference", **kwargs)
  return jmp_lab.mixed_precision(optax.adam(1e-2), policy=spec,
                                 loss_scale=loss_scale, **kwargs)


def make_bn(spec, loss_scale, kind="mixed_precision", **kwargs):
  model = jnnx.with_policy(BNNet(nnx.Rngs(0, dropout=1)), spec)
  optimizer = jnnx.Optimizer(model, make_tx(spec, loss_scale, kind, **kwargs),
                             wrt=nnx.Param)
  return model, optimizer


def stored_params(model):
  return nnx.as_pure(nnx.state(model, nnx.Param))


def assert_params_are_cast_master(model, optimizer):
  master = optimizer.master_params(model)
  params = stored_params(model)
  chex.assert_trees_all_equal(params, jax.tree_util.tree_map(
      lambda m, p: m.astype(p.dtype), master, params))


class TrainStepTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("mixed_bfloat16", "p=f16,c=f16,o=f32")
  def test_step_updates_params_stats_and_metrics(self, spec):
    model, optimizer = make_bn(spec, jmp_lab.DynamicLossScale(2.0**8))
    before = stored_params(model)
    stats = nnx.as_pure(nnx.state(model, nnx.BatchStat))
    step, state = jnnx.split_train_step(bn_loss, model, optimizer)
    state, metrics = self.variant(step)(state, BATCH)
    nnx.update((model, optimizer), state)
    assert bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 0
    assert int(optimizer.step[...]) == 1 and "logit_mean" in metrics
    chex.assert_type(metrics["loss"], jnp.float32)
    assert not np.allclose(model.bn.mean.get_raw_value(), stats["bn"]["mean"])
    chex.assert_type(jax.tree_util.tree_leaves(
        nnx.state(model, nnx.BatchStat)), jnp.float32)
    chex.assert_trees_all_equal_dtypes(stored_params(model), before)

  @parameterized.parameters(
      ("p=bf16,c=bf16,o=f32", "mixed_precision", {"master": "remainder"}),
      ("p=f16,c=f16,o=f32", "fused_adamw", {}),
      ("p=bf16,c=bf16,o=f32", "fused_adamw", {"master": "remainder"}))
  def test_params_equal_cast_master_every_step(self, spec, kind, kwargs):
    model, optimizer = make_bn(spec, jmp_lab.DynamicLossScale(2.0**8), kind,
                               **kwargs)
    step = jnnx.make_train_step(bn_loss)
    losses = [float(step(model, optimizer, BATCH)["loss"]) for _ in range(6)]
    assert losses[-1] < losses[0]
    if jmp_lab.get_policy(spec).param_dtype != F32:
      assert_params_are_cast_master(model, optimizer)
    assert int(optimizer.step[...]) == 6

  def test_remainder_master_trains_like_the_fp32_master(self):
    """The params agree bit for bit; the master to an fp32 ulp: XLA:CPU
    contracts optax's update into FMAs differently in the two programs (on a
    target without FMA they are bit-identical: test_lean)."""
    runs = []
    for master in ("float32", "remainder"):
      model, optimizer = make_bn("p=bf16,c=bf16,o=f32",
                                 jmp_lab.DynamicLossScale(2.0**8),
                                 master=master)
      step = jnnx.make_train_step(bn_loss)
      for _ in range(4):
        step(model, optimizer, BATCH)
      runs.append((stored_params(model), optimizer.master_params(model)))
    tree_bits_equal(runs[0][0], runs[1][0])
    chex.assert_trees_all_close(runs[0][1], runs[1][1], rtol=2e-7, atol=0)

  def test_skipped_step_changes_only_the_scale_and_the_counter(self):
    model, optimizer = make_bn("p=f16,c=f16,o=f32", jmp_lab.DynamicLossScale(2.0**8))
    step = jnnx.make_train_step(bn_loss, donate=False)
    step(model, optimizer, BATCH)  # moments and stats are not at init
    before = nnx.as_pure(nnx.state((model, optimizer)))
    poisoned = {"x": BATCH["x"].at[0, 0].set(jnp.inf), "y": BATCH["y"]}
    metrics = step(model, optimizer, poisoned)
    assert not bool(metrics["grads_finite"])
    after = nnx.as_pure(nnx.state((model, optimizer)))
    # Everything but the loss scale, its counter and the skip count: params,
    # batch statistics, dropout RNG counts, master, moments, step.
    scale_before, scale_after = (optimizer_scale_paths(s) for s in (before, after))
    chex.assert_trees_all_equal(without(before, scale_before),
                                without(after, scale_after))
    assert int(optimizer.step[...]) == 1 and int(optimizer.skipped_steps) == 1
    assert float(optimizer.loss_scale.loss_scale) == 2.0**7

  @pytest.mark.filterwarnings(
      "ignore:Using 'Module.sow\\(\\)':DeprecationWarning")
  def test_a_model_that_sows_trains_and_a_skipped_step_keeps_its_state(self):
    """The step put the model's other state back through one select over
    the whole state before and after, which the values a model sows (new
    variables) did not fit ("leaf paths differ"): now path by path, the
    sown value kept as made."""
    model = jnnx.with_policy(_SowsAndDrops(nnx.Rngs(0, dropout=1)),
                             "mixed_bfloat16")
    optimizer = jnnx.Optimizer(model, jmp_lab.mixed_precision(
        optax.sgd(1e-3), policy="mixed_bfloat16"), wrt=nnx.Param)

    def loss_fn(model, x):
      return jnp.square(model(x).astype(jnp.float32) / 100)

    step = jnnx.make_train_step(loss_fn, donate=False)
    x = jnp.ones((4, 32))
    losses = [float(step(model, optimizer, x)["loss"]) for _ in range(3)]
    assert losses[-1] < losses[0]
    assert len(model.h.get_value()) >= 1   # what the model sowed
    nnx.pop(model, nnx.Intermediate)
    before = nnx.as_pure(nnx.state(model, nnx.Not(nnx.Intermediate)))
    metrics = step(model, optimizer, x.at[0, 0].set(jnp.inf))
    assert not bool(metrics["grads_finite"])
    chex.assert_trees_all_equal(
        nnx.as_pure(nnx.state(model, nnx.Not(nnx.Intermediate))), before)

  def test_make_train_step_donates_the_old_buffers(self):
    model, optimizer = make_bn("mixed_bfloat16", jmp_lab.DynamicLossScale())
    step = jnnx.make_train_step(bn_loss)
    old = model.dense.kernel.get_raw_value()
    step(model, optimizer, BATCH)
    step(model, optimizer, BATCH)
    assert old.is_deleted() and int(optimizer.step[...]) == 2

  def test_bad_optimizer_and_loss_fn(self):
    model = jnnx.with_policy(BNNet(nnx.Rngs(0, dropout=1)), "mixed_bfloat16")
    with pytest.raises(TypeError, match="must be a jmp_lab optimizer"):
      jnnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    with pytest.raises(ValueError, match="tree layout"):
      jnnx.Optimizer(model, jmp_lab.fused_adamw(
          1e-3, policy="mixed_bfloat16", layout="flat",
          loss_scale=jmp_lab.NoOpLossScale()), wrt=nnx.Param)
    optimizer = jnnx.Optimizer(model, make_tx(
        "mixed_bfloat16", jmp_lab.NoOpLossScale()), wrt=nnx.Param)
    with pytest.raises(TypeError, match="jmp_lab.nnx.Optimizer"):
      jnnx.train_step(model, nnx.Optimizer(model, optax.adam(1e-3),
                                           wrt=nnx.Param), BATCH, loss_fn=bn_loss)
    with pytest.raises(TypeError, match="floating scalar loss"):
      jnnx.train_step(model, optimizer, BATCH,
                      loss_fn=lambda m, b: m(b["x"]))
    with pytest.raises(TypeError, match="metrics of type list"):
      jnnx.train_step(model, optimizer, BATCH,
                      loss_fn=lambda m, b: (m(b["x"]).sum(), [1]))


def optimizer_scale_paths(state):
  """Flat paths of the loss scale and skip counter inside a pure state."""
  return {path for path, _ in jax.tree_util.tree_leaves_with_path(state)
          if any(name in jax.tree_util.keystr(path)
                 for name in ("loss_scale", "counter", "skipped_steps",
                              "last_step_applied"))}


def without(state, paths):
  return [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state)
          if path not in paths]


# --- checkpoints ---------------------------------------------------------------

def test_orbax_restores_model_and_optimizer_bit_for_bit(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  model, optimizer = make_bn("p=bf16,c=bf16,o=f32", jmp_lab.DynamicLossScale(2.0**8),
                             master="remainder")
  step = jnnx.make_train_step(bn_loss, donate=False)
  for _ in range(3):
    step(model, optimizer, BATCH)
  saved = nnx.state((model, optimizer))
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ckpt", saved)
    checkpointer.wait_until_finished()
    fresh_model, fresh_optimizer = make_bn(
        "p=bf16,c=bf16,o=f32", jmp_lab.DynamicLossScale(2.0**8), master="remainder")
    target = nnx.state((fresh_model, fresh_optimizer))
    restored = checkpointer.restore(tmp_path / "ckpt", target)
  nnx.update((fresh_model, fresh_optimizer), restored)
  tree_bits_equal(nnx.as_pure(nnx.state((fresh_model, fresh_optimizer))),
                  nnx.as_pure(saved))
  for _ in range(2):  # and training goes on exactly as it would have
    a = step(model, optimizer, BATCH)
    b = step(fresh_model, fresh_optimizer, BATCH)
    assert float(a["loss"]) == float(b["loss"])
  tree_bits_equal(nnx.as_pure(nnx.state((fresh_model, fresh_optimizer))),
                  nnx.as_pure(nnx.state((model, optimizer))))


# --- diagnostics ---------------------------------------------------------------

def test_audit_of_an_nnx_step_finds_every_matmul_in_half():
  model, optimizer = make_bn("mixed_bfloat16", jmp_lab.DynamicLossScale())
  step, state = jnnx.split_train_step(bn_loss, model, optimizer)
  report = jmp_lab.diagnostics.audit_step(step, state, BATCH,
                                          policy="mixed_bfloat16")
  # 2 forward; 2 weight gradients and the head's input gradient
  assert len(report.matmuls) == 5
  assert report.half_flop_share == 1.0 and not report.fp32_could_be_half


def test_compiled_for_h100_report_of_an_nnx_step():
  require_cuda_plugin()
  model, optimizer = make_bn("mixed_bfloat16", jmp_lab.DynamicLossScale())
  step, state = jnnx.split_train_step(bn_loss, model, optimizer)
  report = jmp_lab.diagnostics.compiled_report(step, state, BATCH,
                                               donate_argnums=0)
  assert report.gemms and report.gemm_flop_share("16-bit") == 1.0
  assert report.scope(jmp_lab.training.UPDATE_SCOPE)  # the update's kernels
  assert report.memory["argument"] > 0


class _AttentionModel(nnx.Module):
  def __init__(self, rngs):
    self.attention = nnx.MultiHeadAttention(
        num_heads=2, in_features=16, qkv_features=16, decode=False, rngs=rngs)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(self.attention(x))


@pytest.mark.parametrize("policy, fp8_share, fp32_products", [
    ("mixed_fp8", 0.81, 0),
    ("mixed_bfloat16,matmul=fp8_current", 0.81, 0),
    ("mixed_bfloat16,reduce=float32", 0.0, 5),
])
def test_linear_general_and_so_attention_projections_get_the_policy(
    policy, fp8_share, fp32_products):
  """nnx.LinearGeneral's dot_general defaults to None (meaning
  lax.dot_general), so with_policy took it for a layer's own matmul and left
  it alone: nnx.MultiHeadAttention's four projections got neither fp8 (5.9%
  of the step's FLOPs were fp8: the head's) nor the reduce dtype (1 weight
  gradient in fp32: the head's). Now they get both: all Dense FLOPs fp8
  (attention's own two matmuls stay bf16), 4 + 1 weight gradients in fp32."""
  x = jax.random.normal(jax.random.key(0), (2, 8, 16))
  y = jnp.zeros((2, 8), jnp.int32)
  model = jmp_lab.nnx.with_policy(_AttentionModel(nnx.Rngs(0)), policy)
  optimizer = jmp_lab.nnx.Optimizer(model, jmp_lab.mixed_precision(
      optax.adam(1e-3), policy=policy, loss_scale=jmp_lab.NoOpLossScale()),
      wrt=nnx.Param)

  def loss_fn(model, batch):
    return jmp_lab.nnx.softmax_cross_entropy_with_integer_labels(
        model(batch[0]), batch[1]).mean()

  step, state = jmp_lab.nnx.split_train_step(loss_fn, model, optimizer)
  audit = jmp_lab.diagnostics.audit_step(step, state, (x, y))
  assert audit.fp8_flop_share == pytest.approx(fp8_share, abs=0.01)
  wide = [r for r in audit.matmuls if r.accumulation_dtype == "float32"
          and r.operand_dtypes == ("bfloat16", "bfloat16")]
  assert len(wide) == fp32_products
  _, metrics = jax.jit(step)(state, (x, y))
  assert np.isfinite(float(metrics["loss"]))
