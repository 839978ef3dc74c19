"""A policy reaches model code as people write it.

The models (benchmarks/real_models.py) are written as public Flax, NNX and
Equinox code is. They pass ``dtype=jnp.float32`` to every layer, tie their
embeddings, write their own RMSNorm and attention, scan their layers and use
BatchNorm with an ``axis_name``. Under ``mixed_bfloat16`` every matmul FLOP
of their train steps must run in bf16, traced and compiled for an H100;
norms and softmax must run in fp32; and the loss must stay within 2% of fp32
training on the same data.
"""

import pathlib
import sys
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

import jmp_lab
from jmp_lab import linen as jl
from jmp_lab.autocast import PrecisionWarning
from jmp_lab.diagnostics import audit_step
from jmp_lab.diagnostics.audit import compiled_sub_jaxprs

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import model_reach as mr  # noqa: E402
from benchmarks import real_models as rm  # noqa: E402
from cuda_compile import require_cuda_plugin  # noqa: E402

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
CASES = ["resnet", "linen_lm", "linen_lm_custom", "griffin", "hf_gpt2",
         "gemma", "equinox"]


def eqns_named(jaxpr, names, path=()):
  """``(eqn, named-scope path)`` for every equation named in ``names``."""
  found = []
  for eqn in jaxpr.eqns:
    here = path + tuple(str(eqn.source_info.name_stack).split("/"))
    if eqn.primitive.name in names:
      found.append((eqn, "/".join(here)))
    for inner in compiled_sub_jaxprs(eqn):
      found += eqns_named(inner, names, here)
  return found


@pytest.mark.parametrize("name", CASES)
def test_every_matmul_flop_of_the_train_step_runs_in_bf16(name):
  case = mr.CASES[name]("mixed_bfloat16")
  report = audit_step(case.step, case.state, next(case.batches),
                      policy="mixed_bfloat16")
  assert report.half_flop_share == 1.0, report.table()
  assert not report.fp32_could_be_half
  assert len(report.matmuls) >= 12


@pytest.mark.parametrize("name", CASES)
def test_exp_log_rsqrt_and_sums_of_the_forward_pass_run_in_fp32(name):
  """Softmax (flax's attention and the models' own), the norms' statistics
  (flax's, a model's own RMSNorm class, Equinox's LayerNorm) and the loss."""
  case = mr.CASES[name]("mixed_bfloat16")
  jaxpr = jax.make_jaxpr(case.forward)(case.state, next(case.batches)).jaxpr
  sensitive = eqns_named(jaxpr, {"exp", "log", "rsqrt", "reduce_sum"})
  assert len(sensitive) >= 3
  for eqn, where in sensitive:
    assert np.dtype(eqn.invars[0].aval.dtype) == F32, (where, eqn)


def _compiled_gemms(case):
  report = jmp_lab.diagnostics.compiled_report(
      case.step, case.state, next(case.batches), target="h100",
      fail_on_spill=False)
  return report.gemms


@pytest.mark.model_compile
@pytest.mark.parametrize("name", CASES)
def test_compiled_for_an_h100_no_gemm_or_convolution_has_an_f32_operand(name):
  require_cuda_plugin()
  case = mr.CASES[name]("mixed_bfloat16")
  gemms = _compiled_gemms(case)
  audit = audit_step(case.step, case.state, next(case.batches))
  # The GEMMs checked are the step's matmul work, not a few of them (XLA
  # merges some and, on jax 0.12, drops a gradient GEMM nothing reads).
  compiled_flops = sum(g.flops * g.times for g in gemms)
  assert compiled_flops >= 0.75 * sum(r.flops for r in audit.matmuls)
  assert [g.operands for g in gemms if "f32" in (g.lhs.dtype, g.rhs.dtype)
          ] == []


@pytest.mark.model_compile
@pytest.mark.parametrize("policy", ["mixed_fp8",
                                    "mixed_bfloat16,matmul=fp8_current"])
@pytest.mark.parametrize("name", ["linen_lm", "gemma"])
def test_fp8_reaches_layers_with_their_own_float32_dtype(name, policy):
  """XLA rewrites quantize-dequantize into an fp8 GEMM only around a half
  GEMM: the operands are quantized from the compute dtype, not fp32. What
  the audit counts as fp8 compiles to fp8 (under current scaling Gemma's
  gated MLP compiled 52% against 71% audited: its shared input was
  quantized once and XLA merged the gate and up GEMMs)."""
  require_cuda_plugin()
  case = mr.CASES[name](policy)
  batch = next(case.batches)
  audit = audit_step(case.step, case.state, batch)
  report = jmp_lab.diagnostics.compiled_report(
      case.step, case.state, batch, target="h100", fail_on_spill=False)
  assert audit.fp8_flop_share > 0.6
  # Every FLOP the audit counts as fp8 runs in an fp8 GEMM. (Compared as
  # FLOPs, not shares: jax 0.12's XLA drops one of Gemma's 16-bit gradient
  # GEMMs that nothing reads, which raises the compiled share to 0.75.)
  audited = audit.fp8_flop_share * sum(r.flops for r in audit.matmuls)
  compiled = sum(g.flops * g.times for g in report.gemms if g.math == "fp8")
  assert compiled == pytest.approx(audited)


@pytest.mark.parametrize("name, steps, seeds", [
    ("resnet", 100, 4),   # its small loss is noisy from seed to seed
    ("linen_lm", 60, 1), ("linen_lm_custom", 60, 1), ("griffin", 60, 1),
    ("hf_gpt2", 60, 1), ("gemma", 60, 1), ("equinox", 60, 1)])
@pytest.mark.floor_lane
def test_loss_within_2_percent_of_fp32_on_the_same_data(name, steps, seeds):
  def loss(policy):
    return mr.train_on_seeds(mr.CASES[name], policy, steps, seeds)

  assert abs(loss("mixed_bfloat16") / loss("float32") - 1) < 0.02


# ---------------------------------------------------------------------------
# The pieces, one at a time.
# ---------------------------------------------------------------------------


def test_the_smallest_repro_a_dense_with_its_own_float32_dtype():
  model = jl.with_policy(nn.Dense(8, dtype=jnp.float32), "mixed_bfloat16")
  x = jnp.ones((4, 16))
  params = model.init(jax.random.key(0), x)
  assert audit_step(model.apply, params, x).half_flop_share == 1.0
  kept = jl.with_policy(nn.Dense(8, dtype=jnp.float32), "mixed_bfloat16",
                        keep_layer_dtypes=True)
  assert audit_step(kept.apply, params, x).half_flop_share == 0.0


def test_keep_layer_dtypes_is_warned_about_when_nothing_is_left_in_half():
  config = rm.TransformerConfig(max_len=16)
  model = jl.with_policy(rm.TransformerLM(config), "mixed_bfloat16",
                         keep_layer_dtypes=True)
  tokens = jnp.ones((2, 17), jnp.int32)
  params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
  state = jmp_lab.TrainState.create(
      apply_fn=model.apply, params=params, policy="mixed_bfloat16",
      tx=jmp_lab.mixed_precision(optax.adam(1e-3), policy="mixed_bfloat16",
                                 loss_scale=jmp_lab.NoOpLossScale()))

  def loss_fn(params, state, tokens):
    logits = state.apply_fn({"params": params}, tokens[:, :-1])
    return jl.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]).mean()

  with pytest.warns(PrecisionWarning, match="every matmul of the model runs "
                    "in fp32: the policy's overrides"):
    jmp_lab.make_train_step(loss_fn)(state, tokens)


def test_a_path_override_keeps_one_layer_in_fp32():
  model = jl.with_policy(rm.ResNet(), "mixed_bfloat16",
                         path_overrides={"Dense_0": "float32"})
  x = jnp.ones((2, 8, 8, 1))
  variables = model.init(jax.random.key(0), x)
  report = audit_step(lambda v, x: model.apply(v, x, mutable=["batch_stats"]),
                      variables, x)
  dtypes = {r.operand_dtypes for r in report.matmuls}
  assert ("float32", "float32") in dtypes and ("bfloat16", "bfloat16") in dtypes
  assert [r.kind for r in report.matmuls
          if r.operand_dtypes == ("float32", "float32")] == ["dot_general"]


def _read_dtypes(model, params, tokens, path):
  """The dtypes the param at ``path`` is read in by the model's ops."""
  jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, tokens))(
      params).jaxpr
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  index = [jax.tree_util.keystr(p) for p, _ in leaves].index(path)
  var = jaxpr.invars[index]
  return {np.dtype(e.params["new_dtype"]) if e.primitive.name ==
          "convert_element_type" else np.dtype(var.aval.dtype)
          for e in jaxpr.eqns if var in e.invars}


def test_a_models_own_norm_class_is_an_fp32_island_and_can_be_taken_back():
  config = rm.TransformerConfig(norm="rmsnorm", max_len=16)
  tokens = jnp.ones((2, 16), jnp.int32)
  model = jl.with_policy(rm.TransformerLM(config), "mixed_bfloat16")
  params = model.init(jax.random.key(0), tokens)["params"]
  scale = "['encoderdecoder_norm']['scale']"
  assert _read_dtypes(model, params, tokens, scale) == {F32}
  back = jl.with_policy(rm.TransformerLM(config), "mixed_bfloat16",
                        class_overrides={rm.RMSNorm: "mixed_bfloat16"})
  assert _read_dtypes(back, params, tokens, scale) == {BF16}
  # Taken back, its statistics still run in fp32 by the op rules.
  jaxpr = jax.make_jaxpr(back.apply)({"params": params}, tokens).jaxpr
  assert {np.dtype(e.invars[0].aval.dtype) for e, where in eqns_named(
      jaxpr, {"rsqrt", "reduce_sum"}) if "encoderdecoder_norm" in where} == {
          F32}


def test_flax_attention_built_without_attention_fn_gets_the_fp32_softmax():
  attention = nn.MultiHeadDotProductAttention(num_heads=2, dtype=jnp.float32)
  x = jnp.ones((2, 8, 16))
  model = jl.with_policy(attention, "p=bf16,c=bf16,o=bf16")
  params = model.init(jax.random.key(0), x, x)
  jaxpr = jax.make_jaxpr(model.apply)(params, x, x).jaxpr
  (exp, _), = eqns_named(jaxpr, {"exp"})
  assert np.dtype(exp.invars[0].aval.dtype) == F32
  assert attention.attention_fn is nn.dot_product_attention  # unchanged


# ---- tied embeddings ---------------------------------------------------------


class TiedLM(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(32, 16, dtype=jnp.float32)
    return embed.attend(nn.Dense(16, dtype=jnp.float32)(embed(tokens)))


class NnxTiedLM(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(32, 16, rngs=rngs)   # its dtype is always set
    self.dense = nnx.Linear(16, 16, dtype=jnp.float32, rngs=rngs)

  def __call__(self, tokens):
    return self.embed.attend(self.dense(self.embed(tokens)))


def _attend_gemms(jaxpr):
  return [e for e, _ in eqns_named(jaxpr, {"dot_general"})
          if e.outvars[0].aval.shape[-1] == 32 or e.outvars[0].aval.shape == (
              32, 16)]


@pytest.mark.parametrize("reduce", [None, "float32"])
def test_tied_logits_gemm_in_bf16_with_the_tables_gradient(reduce):
  policy = "mixed_bfloat16" + (f",reduce={reduce}" if reduce else "")
  model = jl.with_policy(TiedLM(), policy)
  tokens = jnp.arange(12).reshape(2, 6) % 32
  params = model.init(jax.random.key(0), tokens)["params"]
  loss = lambda p: model.apply({"params": p}, tokens).astype(  # noqa: E731
      jnp.float32).std()
  jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
  gemms = _attend_gemms(jaxpr)
  assert gemms and all(tuple(np.dtype(v.aval.dtype) for v in e.invars)
                       == (BF16, BF16) for e in gemms)
  if reduce:  # the table's gradient GEMM accumulates in the reduce dtype
    assert any(e.outvars[0].aval.shape == (32, 16)
               and np.dtype(e.outvars[0].aval.dtype) == F32 for e in gemms)
  plain = TiedLM()
  want = jax.grad(lambda p: plain.apply({"params": p}, tokens).std())(params)
  got = jax.grad(loss)(params)
  chex.assert_trees_all_close(got, want, atol=0.02 * float(max(
      jnp.abs(x).max() for x in jax.tree_util.tree_leaves(want))))


def test_nnx_tied_logits_gemm_in_bf16():
  model = jmp_lab.nnx.with_policy(NnxTiedLM(nnx.Rngs(0)), "mixed_bfloat16")
  tokens = jnp.arange(12).reshape(2, 6) % 32
  graphdef, state = nnx.split(model)

  def loss(state):
    return nnx.merge(graphdef, state)(tokens).std()

  jaxpr = jax.make_jaxpr(jax.grad(loss))(state).jaxpr
  gemms = _attend_gemms(jaxpr)
  assert len(gemms) >= 2 and all(
      tuple(np.dtype(v.aval.dtype) for v in e.invars) == (BF16, BF16)
      for e in gemms)
  # Called directly, outside the model's own call, too.
  jaxpr = jax.make_jaxpr(lambda h: model.embed.attend(h))(jnp.ones((2, 16)))
  assert [tuple(np.dtype(v.aval.dtype) for v in e.invars)
          for e in _attend_gemms(jaxpr.jaxpr)] == [(BF16, BF16)]


# ---- BatchNorm with axis_name, data parallel ------------------------------------


def test_batchnorm_with_axis_name_under_shard_map_matches_one_device():
  mesh = Mesh(np.array(jax.devices()[:2]), ("batch",))
  images, _ = rm.digits("train")
  x = jnp.asarray(images[:8])
  synced = jl.with_policy(rm.ResNet(axis_name="batch"), "mixed_bfloat16")
  single = jl.with_policy(rm.ResNet(), "mixed_bfloat16")
  variables = single.init(jax.random.key(0), x)

  def data_parallel(variables, x):
    return jax.shard_map(
        lambda v, x: synced.apply(v, x, mutable=["batch_stats"]),
        mesh=mesh, in_specs=(P(), P("batch")), out_specs=(P("batch"), P()),
    )(variables, x)

  (logits, stats), (want, want_stats) = (
      jax.jit(data_parallel)(variables, x),
      single.apply(variables, x, mutable=["batch_stats"]))
  chex.assert_trees_all_close(logits, want, atol=0.05, rtol=0.05)
  chex.assert_trees_all_close(stats, want_stats, atol=1e-3, rtol=1e-3)
  report = audit_step(data_parallel, variables, x)
  assert report.half_flop_share == 1.0 and len(report.matmuls) >= 6


# ---- mistakes made loud --------------------------------------------------------


def _lm_state(apply_fn, params, policy="mixed_bfloat16", tx_policy=None):
  return jmp_lab.TrainState.create(
      apply_fn=apply_fn, params=params, policy=policy,
      tx=jmp_lab.mixed_precision(optax.adam(1e-3),
                                 policy=tx_policy or policy,
                                 loss_scale=jmp_lab.NoOpLossScale()))


def test_a_model_not_wrapped_under_a_half_policy_is_warned_about():
  model = rm.TransformerLM(rm.TransformerConfig(max_len=16))
  tokens = jnp.ones((2, 17), jnp.int32)
  params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
  state = _lm_state(model.apply, params)

  def loss_fn(params, state, tokens):
    logits = state.apply_fn({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]).mean()

  with pytest.warns(PrecisionWarning, match="wrap the model with"):
    jmp_lab.make_train_step(loss_fn)(state, tokens)
  # Wrapped, nothing to say.
  wrapped = jl.with_policy(model, "mixed_bfloat16")
  with warnings.catch_warnings():
    warnings.simplefilter("error", PrecisionWarning)
    jmp_lab.make_train_step(loss_fn)(_lm_state(wrapped.apply, params), tokens)


def test_model_and_optimizer_policies_that_disagree_are_refused():
  model = jl.with_policy(nn.Dense(4), "mixed_bfloat16")
  params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
  with pytest.raises(ValueError, match=r"the model's \(apply_fn\) policy "
                     r"\(params=float32,compute=bfloat16,output=float32\) "
                     r"and the optimizer's \(tx\) policy \(params=float32,"
                     r"compute=float16"):
    _lm_state(model.apply, params, policy="mixed_bfloat16",
              tx_policy="mixed_float16")
  with pytest.raises(ValueError, match=r"the model's \(apply_fn\) policy "
                     r".* and TrainState.create's policy \(params=float32,"
                     r"compute=float16"):
    _lm_state(model.apply, params, policy="mixed_float16",
              tx_policy="mixed_bfloat16")


def test_nnx_optimizer_whose_policy_disagrees_with_the_model_is_refused():
  model = jmp_lab.nnx.with_policy(nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
                                  "mixed_bfloat16")
  with pytest.raises(ValueError, match=r"the model computes in bfloat16 .*"
                     r"optimizer's policy \(params=float32,compute=float16"):
    jmp_lab.nnx.Optimizer(model, jmp_lab.mixed_precision(
        optax.adam(1e-3), policy="mixed_float16",
        loss_scale=jmp_lab.DynamicLossScale()), wrt=nnx.Param)


def test_nnx_model_not_wrapped_is_warned_about():
  model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  optimizer = jmp_lab.nnx.Optimizer(model, jmp_lab.mixed_precision(
      optax.adam(1e-3), policy="mixed_bfloat16",
      loss_scale=jmp_lab.NoOpLossScale()), wrt=nnx.Param)
  step = jmp_lab.nnx.make_train_step(lambda m, x: jnp.mean(m(x) ** 2))
  with pytest.warns(PrecisionWarning, match="jmp_lab.nnx.train_step"):
    step(model, optimizer, jnp.ones((2, 4)))


# ---- checkpoints ---------------------------------------------------------------


@pytest.mark.floor_lane
def test_flax_pure_dict_checkpoint_route_restores_the_fp32_master_exactly(
    tmp_path):
  """Flax's documented route: nnx.to_pure_dict -> orbax -> replace_by_pure_dict."""
  ocp = pytest.importorskip("orbax.checkpoint")
  model = jmp_lab.nnx.with_policy(
      rm.GemmaLM(rm.GemmaConfig(num_layers=1), rngs=nnx.Rngs(0)),
      "mixed_bfloat16")
  optimizer = jmp_lab.nnx.Optimizer(model, mr._optimizer("mixed_bfloat16",
                                                         1e-2), wrt=nnx.Param)
  step = jmp_lab.nnx.make_train_step(
      lambda m, t: jmp_lab.nnx.softmax_cross_entropy_with_integer_labels(
          m(t[:, :-1]), t[:, 1:]).mean())
  batches = mr._text_batches(4, 16)
  for _ in range(3):
    step(model, optimizer, next(batches))
  stored = jax.tree_util.tree_map(np.asarray, nnx.to_pure_dict(
      nnx.state(model, nnx.Param)))
  chex.assert_type(jax.tree_util.tree_leaves(stored), jnp.float32)
  # The params hold fractions bf16 cannot: a bf16 round trip would lose them.
  assert any(not np.array_equal(x, np.asarray(x, jnp.bfloat16).astype(
      np.float32)) for x in jax.tree_util.tree_leaves(stored))

  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", nnx.to_pure_dict(nnx.state(model)))
  checkpointer.wait_until_finished()
  fresh = jmp_lab.nnx.with_policy(
      rm.GemmaLM(rm.GemmaConfig(num_layers=1), rngs=nnx.Rngs(1)),
      "mixed_bfloat16")
  graphdef, abstract = nnx.split(fresh)
  restored = checkpointer.restore(tmp_path / "state",
                                  nnx.to_pure_dict(abstract))
  nnx.replace_by_pure_dict(abstract, restored)
  nnx.update(fresh, abstract)
  chex.assert_trees_all_equal(
      jax.tree_util.tree_map(np.asarray, nnx.to_pure_dict(
          nnx.state(fresh, nnx.Param))), stored)
  tokens = next(batches)[:, :-1]
  chex.assert_trees_all_equal(fresh(tokens), model(tokens))


def test_nnx_keep_layer_dtypes_keeps_fp32_layers_in_fp32():
  case = mr.gemma_case("mixed_bfloat16")
  assert audit_step(case.forward, case.state,
                    next(case.batches)).half_flop_share == 1.0
  model = jmp_lab.nnx.with_policy(rm.GemmaLM(rm.GemmaConfig(num_layers=1),
                                             rngs=nnx.Rngs(0)),
                                  "mixed_bfloat16", keep_layer_dtypes=True)
  graphdef, state = nnx.split(model)
  tokens = jnp.ones((2, 8), jnp.int32)
  report = audit_step(lambda s: nnx.merge(graphdef, s)(tokens), state)
  # The einsums of its own attention (no dtype of their own) stay in bf16.
  assert 0.0 < report.half_flop_share < 0.5


class Remat(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.remat(nn.Dense)(4, name="inner")(x)


def test_a_layer_the_rules_cannot_reach_is_named_in_one_warning(monkeypatch):
  from jmp_lab._src.precision import control, observers

  def cannot(params, context):
    raise control._CannotRebuild("for this test")

  # Neither rebuilt at the rules' dtypes nor rewritten with its own types.
  monkeypatch.setattr(control, "_REBUILT", {})
  monkeypatch.setattr(control, "_same_type_params", cannot)
  model = jl.with_policy(Remat(), "mixed_bfloat16")
  x = jnp.ones((2, 3))
  params = model.init(jax.random.key(0), x)  # init runs under the rules too
  monkeypatch.setattr(observers, "_WARNED", set())
  with pytest.warns(UserWarning, match=r"the remat2 at 'Remat' runs as "
                    r"written \(for this test; its matmuls under "
                    r"'inner' stay as written\)") as record:
    model.apply(params, x)
    model.apply(params, x)
  assert len([w for w in record if "runs as written" in str(w.message)]) == 1


@pytest.mark.parametrize("policy", ["mixed_bfloat16,reduce=float32",
                                    "mixed_fp8",
                                    "mixed_bfloat16,matmul=fp8_current"])
@pytest.mark.parametrize("name", ["resnet", "linen_lm", "linen_lm_custom",
                                  "gemma"])
def test_the_other_policies_train_model_code_as_written(name, policy):
  """Two jitted steps of each model under the reduce and fp8 policies, on
  a CPU. Before: under reduce=float32 the transformers raised
  "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"
  (XLA:CPU); under mixed_fp8 a state built from init's params and
  batch_stats alone (the ResNet case did that) failed in flax with "the
  collection is empty", and so did layers under an nn.scan that lists only
  params, which now say what to add at init."""
  if (name, policy) == ("linen_lm_custom", "mixed_fp8"):
    with pytest.raises(ValueError, match=r"variable_axes=\{'params': 0, "
                       r"jmp_lab.fp8.COLLECTION: 0\}"):
      mr.CASES[name](policy)
    return
  case = mr.CASES[name](policy)
  step = jax.jit(case.step)
  state = case.state
  for _ in range(2):
    state, metrics = step(state, next(case.batches))
  assert np.isfinite(float(metrics["loss"]))
  assert int(metrics["skipped_steps"]) == 0


# ---- Blackwell's block-scaled formats on model code as written ----------------

# The weight matmuls of one step's forward, as the audit sees them (a
# scanned body once): each runs three block-scaled GEMMs a step. Attention's
# products of two computed values and tied logits (``Embed.attend``) stay in
# bf16, as do convolutions: the keys block-scale Dense/Linear/Einsum layers
# and, under autocast, products with a stored weight.
WEIGHT_MATMULS = {"resnet": 1, "linen_lm": 12, "linen_lm_custom": 6,
                  "griffin": 16, "hf_gpt2": 9, "gemma": 10, "equinox": 13}


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("name", CASES)
def test_block_scaled_keys_reach_every_weight_matmul_of_model_code(name, fmt):
  """Layers with their own ``dtype=float32`` (lm1b, Gemma's NNX Einsum and
  Linear), ``nn.scan``, a recurrent block, Hugging Face's GPT-2, whose
  ``FlaxConv1D`` multiplies by its own kernel (before, its eight
  projections ran in bf16), and Equinox under ``autocast``, whose
  ``Linear`` computes ``weight @ x`` under ``jax.vmap`` (before, the
  Equinox model ran no GEMM block-scaled)."""
  case = mr.CASES[name](f"mixed_{fmt}")
  report = audit_step(case.step, case.state, next(case.batches))
  kinds = [r.kind for r in report.matmuls]
  assert kinds.count(fmt) == 3 * WEIGHT_MATMULS[name], kinds
  assert set(kinds) <= {fmt, "hadamard", "dot_general", "conv"}, kinds


def test_a_path_override_reaches_a_head_applied_inside_the_models_call():
  """Hugging Face's GPT-2 ties its head as ``self.lm_head.apply({"params":
  {"kernel": wte.T}}, x)``: a root of its own, whose path was ``""``. Its
  override (``"lm_head"``, the docs' advice under NVFP4) warned that it
  matched nothing, and the head stayed in NVFP4."""
  tokens = jnp.zeros((4, 64), jnp.int32)
  model = jl.with_policy(rm.HFGPT2LM(rm.GPT2Config()), "mixed_nvfp4",
                         path_overrides={"lm_head": "mixed_bfloat16"})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    params = model.init(jax.random.key(0), tokens)
  report = audit_step(jax.grad(lambda p: model.apply(p, tokens).astype(
      jnp.float32).sum()), params)
  kinds = [r.kind for r in report.matmuls]
  assert kinds.count("nvfp4") == 3 * 8, kinds   # the blocks' eight Conv1D
  head = [r for r in report.matmuls if r.kind == "dot_general"
          and 256 in r.out_shape + r.lhs_shape + r.rhs_shape]
  assert len(head) == 3 and all(r.operand_dtypes == ("bfloat16", "bfloat16")
                                for r in head), head


@pytest.mark.parametrize("name", ["linen_lm", "linen_lm_custom", "griffin",
                                  "hf_gpt2", "gemma", "equinox"])
@pytest.mark.floor_lane
def test_block_scaled_keys_train_model_code_near_bf16(name):
  """60 steps on the same batches (emulated on the CPU as a B200 computes
  them): MXFP8 within 1% of bf16's loss, NVFP4 within 3%."""
  loss = {policy: mr.train_on_seeds(mr.CASES[name], policy, 60, 1)
          for policy in ("mixed_bfloat16", "mixed_mxfp8", "mixed_nvfp4")}
  assert loss["mixed_mxfp8"] / loss["mixed_bfloat16"] - 1 < 0.01, loss
  assert loss["mixed_nvfp4"] / loss["mixed_bfloat16"] - 1 < 0.03, loss


@pytest.mark.model_compile
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("name", ["hf_gpt2", "gemma", "equinox"])
def test_model_code_compiles_its_weight_gemms_block_scaled_for_a_b200(
    name, fmt):
  """NNX layers with ``dtype=float32`` and Equinox through ``autocast``:
  every GEMM the audit block-scales is cuDNN's block-scaled GEMM compiled
  for a B200; what is left is the tied logits' bf16 GEMM."""
  require_cuda_plugin()
  case = mr.CASES[name](f"mixed_{fmt}")
  report = jmp_lab.diagnostics.compiled_report(
      case.step, case.state, next(case.batches), target="b200",
      fail_on_spill=False)
  assert sum(g.times for g in report.block_scaled_gemms) == (
      3 * WEIGHT_MATMULS[name])
  assert {g.block_scaled for g in report.block_scaled_gemms} == {fmt}
  assert report.block_scaled_flop_share() > 0.8
  assert {g.math for g in report.gemms if g.block_scaled is None} == {"16-bit"}
