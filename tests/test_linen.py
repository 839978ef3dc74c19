"""Tests for jmp_lab.linen: policies applied to unmodified linen modules."""

import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lab
from jmp_lab.diagnostics import audit_step
from jmp_lab.diagnostics.audit import compiled_sub_jaxprs
from jmp_lab import linen as jl

F32 = np.dtype(jnp.float32)


class ConvNet(nn.Module):
  """Conv + BatchNorm + Dense + LayerNorm + dropout: every default override."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu(x).reshape((x.shape[0], -1))
    x = nn.Dense(32)(x)
    x = nn.LayerNorm()(x)
    x = nn.Dropout(0.1, deterministic=not train)(x)
    x = nn.GroupNorm(num_groups=4)(x)
    x = nn.RMSNorm()(x)
    return nn.Dense(10, name="head")(x)


def primitive_operand_dtypes(jaxpr, names):
  """(primitive, operand dtypes) for every eqn named in ``names``, recursively."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in names:
      found.append((eqn.primitive.name,
                    tuple(np.dtype(v.aval.dtype) for v in eqn.invars)))
    for inner in compiled_sub_jaxprs(eqn):
      found += primitive_operand_dtypes(inner, names)
  return found


def init_and_trace(spec, **kwargs):
  model = jl.with_policy(ConvNet(), spec, **kwargs)
  x = jnp.ones((2, 6, 6, 1))
  rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
  variables = model.init(rngs, x)

  def forward(variables, x):
    return model.apply(variables, x, rngs={"dropout": jax.random.key(2)},
                       mutable=["batch_stats"])

  return model, variables, x, jax.make_jaxpr(forward)(variables, x), forward


@pytest.mark.parametrize("spec", ["float32", "mixed_bfloat16", "mixed_float16",
                                  "p=bf16,c=bf16,o=bf16"])
def test_matmuls_in_compute_dtype_and_norm_reductions_in_fp32(spec):
  policy = jmp_lab.get_policy(spec)
  _, _, _, jaxpr, _ = init_and_trace(spec)
  matmuls = primitive_operand_dtypes(jaxpr.jaxpr,
                                     {"dot_general", "conv_general_dilated"})
  assert {name for name, _ in matmuls} == {"dot_general", "conv_general_dilated"}
  for name, dtypes in matmuls:
    assert dtypes == (policy.compute_dtype,) * 2, (name, dtypes)
  reductions = primitive_operand_dtypes(jaxpr.jaxpr, {"reduce_sum"})
  assert len(reductions) >= 6  # batch, layer, group and rms norm statistics
  assert all(dtypes == (F32,) for _, dtypes in reductions), reductions


@pytest.mark.parametrize("spec", ["float32", "mixed_bfloat16", "mixed_float16",
                                  "p=bf16,c=bf16,o=bf16"])
def test_dtypes_of_params_stats_and_outputs(spec):
  policy = jmp_lab.get_policy(spec)
  _, variables, x, _, forward = init_and_trace(spec)
  chex.assert_type(jax.tree_util.tree_leaves(variables["params"]),
                   policy.param_dtype)
  out, mutated = forward(variables, x)
  chex.assert_type(out, policy.output_dtype)
  chex.assert_type(jax.tree_util.tree_leaves(variables["batch_stats"]), F32)
  chex.assert_type(jax.tree_util.tree_leaves(mutated["batch_stats"]), F32)
  chex.assert_tree_all_finite(mutated)


class Probe(nn.Module):
  """Records the dtypes it sees: its input and its param."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.ones, (x.shape[-1],))
    self.sow("intermediates", "x_dtype", jnp.zeros((), x.dtype))
    self.sow("intermediates", "w_dtype", jnp.zeros((), w.dtype))
    return x * w


class ProbedLayerNorm(nn.LayerNorm):
  """A LayerNorm (so the fp32 default applies) that records its input dtype."""

  @nn.compact
  def __call__(self, x, *args, **kwargs):
    self.sow("intermediates", "x_dtype", jnp.zeros((), x.dtype))
    return super().__call__(x, *args, **kwargs)


class Wrapper(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = Probe(name="body")(nn.Dense(4)(x))
    x = ProbedLayerNorm(name="norm")(x)
    return Probe(name="head")(x)


def seen_dtypes(model, x):
  variables = model.init(jax.random.key(0), x)
  _, state = model.apply(variables, x, mutable=["intermediates"])
  return jax.tree_util.tree_map(lambda a: a.dtype, state["intermediates"])


def test_fp32_norm_default_and_its_output_back_in_compute_dtype():
  seen = seen_dtypes(jl.with_policy(Wrapper(), "mixed_bfloat16"), jnp.ones((2, 3)))
  assert seen["norm"]["x_dtype"] == (F32,)
  assert seen["head"]["x_dtype"] == (np.dtype(jnp.bfloat16),)
  seen = seen_dtypes(jl.with_policy(Wrapper(), "mixed_bfloat16", fp32_norms=False),
                     jnp.ones((2, 3)))
  assert seen["norm"]["x_dtype"] == (np.dtype(jnp.bfloat16),)


def test_a_path_override_that_matches_nothing_warns_at_init():
  """A misspelt override used to change nothing, silently."""
  model = jl.with_policy(Wrapper(), "mixed_float16",
                         path_overrides={"^haed$": "float32",
                                         "^head$": "float32",
                                         "body/w$": "float32"})
  with pytest.warns(UserWarning) as caught:
    model.init(jax.random.key(0), jnp.ones((2, 3)))
  messages = [str(w.message) for w in caught]
  assert len(messages) == 1 and "'^haed$' matches no module or param path of "\
      "Wrapper" in messages[0] and "'head'" in messages[0], messages
  assert caught[0].filename == __file__


class _Block(nn.Module):

  @nn.compact
  def __call__(self, x, _):
    return nn.remat(nn.Dense)(4, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "mlp")), name="mlp")(x), None


class _BoxedScanned(nn.Module):
  """Boxed params (FSDP's logical partitioning) in scanned, rematerialised
  blocks, and a head: paths as large-model code makes them."""

  @nn.compact
  def __call__(self, x):
    x, _ = nn.scan(_Block, variable_axes={"params": 0},
                   split_rngs={"params": True}, length=2,
                   metadata_params={nn.PARTITION_NAME: "layers"})(
                       name="blocks")(x, None)
    return nn.Dense(3, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("mlp", "vocab")), name="head")(x)


def test_path_overrides_that_match_warn_nothing_on_boxed_scanned_params():
  """An anchored param override (``head/kernel$``) on a boxed param, and a
  module override inside ``nn.scan``/``nn.remat``: both match, so init
  says nothing (the paths are those the plan matches, not the variables'
  flattened ones, which end in ``/value`` for a boxed param)."""
  model = jl.with_policy(_BoxedScanned(), "mixed_bfloat16",
                         path_overrides={"head/kernel$": "float32",
                                         "blocks/mlp$": "float32"})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    model.init(jax.random.key(0), jnp.ones((2, 4)))


class _RematInSub(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.remat(_Block)(name="blk")(x, None)[0]


class _Outer(nn.Module):

  @nn.compact
  def __call__(self, x):
    return _RematInSub(name="sub")(x)


def test_an_anchored_override_reaches_a_module_a_lifted_transform_cloned():
  """``nn.remat``/``nn.scan`` clone a module onto a scope of its own, its
  path whole: the path was not to be prefixed again (as a module applied
  inside another's call is), and ``^sub/blk/mlp$`` matched nothing."""
  model = jl.with_policy(_Outer(), "mixed_bfloat16",
                         path_overrides={"^sub/blk/mlp$": "float32"})
  x = jnp.ones((2, 4))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    params = model.init(jax.random.key(0), x)
  report = audit_step(lambda p: model.apply(p, x), params)
  assert [r.operand_dtypes for r in report.matmuls] == [("float32",) * 2]


def test_class_override_applies_to_inputs_and_params():
  model = jl.with_policy(Wrapper(), "mixed_float16",
                         class_overrides={Probe: "float32"})
  seen = seen_dtypes(model, jnp.ones((2, 3)))
  for name in ("body", "head"):
    assert seen[name]["x_dtype"] == (F32,) and seen[name]["w_dtype"] == (F32,)


def test_path_override_on_a_module_and_on_a_single_param():
  model = jl.with_policy(Wrapper(), "mixed_float16",
                         path_overrides={"^head$": "float32"})
  seen = seen_dtypes(model, jnp.ones((2, 3)))
  assert seen["head"]["w_dtype"] == (F32,)
  assert seen["body"]["w_dtype"] == (np.dtype(jnp.float16),)
  model = jl.with_policy(Wrapper(), "mixed_float16",
                         path_overrides={"body/w$": "float32"})
  seen = seen_dtypes(model, jnp.ones((2, 3)))
  assert seen["body"]["w_dtype"] == (F32,)
  assert seen["body"]["x_dtype"] == (np.dtype(jnp.float16),)


def test_integer_inputs_pass_through_embed():
  class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      return nn.Dense(5)(nn.Embed(11, 8)(tokens))

  model = jl.with_policy(LM(), "mixed_bfloat16")
  tokens = jnp.array([[1, 2, 3]], jnp.int32)
  variables = model.init(jax.random.key(0), tokens)
  chex.assert_type(model.apply(variables, tokens), jnp.float32)
  jaxpr = jax.make_jaxpr(model.apply)(variables, tokens)
  dots = primitive_operand_dtypes(jaxpr.jaxpr, {"dot_general"})
  assert all(d == (np.dtype(jnp.bfloat16),) * 2 for _, d in dots)


def test_dropout_rng_is_used():
  model = jl.with_policy(ConvNet(), "mixed_bfloat16")
  x = jnp.ones((2, 6, 6, 1))
  variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
  outs = [model.apply(variables, x, rngs={"dropout": jax.random.key(k)},
                      mutable=["batch_stats"])[0] for k in (1, 2)]
  assert not np.allclose(outs[0], outs[1])


def test_fp32_softmax_helpers():
  x = jnp.array([[10.0, 0.0, -3.0]], jnp.bfloat16)
  chex.assert_type(jl.softmax(x), jnp.bfloat16)
  chex.assert_type(jl.log_softmax(x), jnp.float32)
  chex.assert_type(jl.softmax_cross_entropy_with_integer_labels(
      x, jnp.array([0])), jnp.float32)
  q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(jl.dot_product_attention)(q, q, q)
  exps = primitive_operand_dtypes(jaxpr.jaxpr, {"exp"})
  assert exps and all(d == (F32,) for _, d in exps)


def test_bad_arguments():
  with pytest.raises(TypeError, match="flax.linen.Module"):
    jl.with_policy(lambda x: x, "float32")
  with pytest.raises(ValueError, match="invalid path_overrides pattern"):
    jl.with_policy(Wrapper(), "float32", path_overrides={"(": "float32"})
  with pytest.raises(TypeError, match="must be classes"):
    jl.with_policy(Wrapper(), "float32", class_overrides={"Dense": "float32"})
  with pytest.raises(ValueError, match="unknown key"):
    jl.with_policy(Wrapper(), "q=f32")


def test_eager_apply_traces_the_model_once_per_call():
  """No abstract trace to find module policies: the plan is asked at each
  module call, so an apply traces the model once (it traced it twice the
  first time, with params read in another dtype than apply's)."""
  calls = []

  class Counting(nn.Module):
    @nn.compact
    def __call__(self, x):
      calls.append(x.shape)
      return nn.Dense(3)(nn.LayerNorm()(x))

  model = jl.with_policy(Counting(), "mixed_bfloat16")
  variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
  calls.clear()
  first = model.apply(variables, jnp.ones((2, 4)))
  assert len(calls) == 1
  second = model.apply(variables, jnp.ones((2, 4)))
  assert len(calls) == 2
  chex.assert_trees_all_equal(first, second)
  model.apply(variables, jnp.ones((5, 4)))
  assert len(calls) == 3
