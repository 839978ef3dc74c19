"""One precision semantics on every route (jmp_lab.precision).

Each precision question is asked of the same model written for linen and
for NNX, through ``with_policy``, and (where the question has a plain-JAX
form) of a plain function through ``jmp_lab.autocast``. The answers are read
from the traced program the rules produce.
"""

import functools
import sys
import pathlib

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lab
from jmp_lab import linen as jl
from jmp_lab.diagnostics import audit_step
from jmp_lab.diagnostics.audit import compiled_sub_jaxprs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks import model_reach as mr  # noqa: E402

BF16, F16, F32 = (np.dtype(d) for d in (jnp.bfloat16, jnp.float16,
                                         jnp.float32))
POLICY = "mixed_bfloat16"


def eqns(jaxpr, names=None):
  """Every equation of ``jaxpr`` (sub-jaxprs included) named in ``names``."""
  found = []
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    if names is None or eqn.primitive.name in names:
      found.append(eqn)
    for inner in compiled_sub_jaxprs(eqn):
      found += eqns(inner, names)
  return found


def out_dtypes(jaxpr, name, shape):
  """The output dtypes of the ``name`` equations whose output has
  ``shape``."""
  return {np.dtype(e.outvars[0].aval.dtype) for e in eqns(jaxpr, {name})
          if tuple(e.outvars[0].aval.shape) == tuple(shape)}


def ruled_jaxpr(route, linen_cls, nnx_cls, x):
  """The traced forward pass of the model under ``POLICY`` by ``route``."""
  if route == "linen":
    model = jl.with_policy(linen_cls(), POLICY)
    variables = model.init(jax.random.key(0), x)
    return jax.make_jaxpr(model.apply)(variables, x)
  model = jmp_lab.nnx.with_policy(nnx_cls(nnx.Rngs(0)), POLICY)
  graphdef, state = nnx.split(model)
  return jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)


ROUTES = ["linen", "nnx"]
X = jnp.linspace(-2.0, 2.0, 4 * 8).reshape(4, 8)


# ---- matmuls in the compute dtype, whatever the layer's own dtype ----------


class LinenFp32Layer(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, dtype=jnp.float32)(x)


class NnxFp32Layer(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(8, 8, dtype=jnp.float32, rngs=rngs)

  def __call__(self, x):
    return self.dense(x)


@pytest.mark.parametrize("route", ROUTES)
def test_a_layer_pinned_to_float32_runs_its_matmul_and_bias_in_half(route):
  jaxpr = ruled_jaxpr(route, LinenFp32Layer, NnxFp32Layer, X)
  dots = eqns(jaxpr, {"dot_general"})
  assert dots and all(np.dtype(v.aval.dtype) == BF16
                      for e in dots for v in e.invars)
  assert out_dtypes(jaxpr, "add", (4, 8)) == {BF16}   # the bias add


# ---- an explicit astype(float32) is honoured --------------------------------


class LinenUpcast(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8, use_bias=False)(x).astype(jnp.float32)
    return jnp.tanh(h * 3.0 + 1.0)


class NnxUpcast(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(8, 8, use_bias=False, rngs=rngs)

  def __call__(self, x):
    h = self.dense(x).astype(jnp.float32)
    return jnp.tanh(h * 3.0 + 1.0)


@pytest.mark.parametrize("route", ROUTES)
def test_an_explicit_upcast_is_an_fp32_island(route):
  jaxpr = ruled_jaxpr(route, LinenUpcast, NnxUpcast, X)
  for name in ("mul", "add", "tanh"):
    assert out_dtypes(jaxpr, name, (4, 8)) == {F32}, name


# ---- a weakly typed literal never promotes ------------------------------------


class LinenScaled(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, use_bias=False)(x) * 0.5


class NnxScaled(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(8, 8, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.dense(x) * 0.5


def scaled(params, x):
  return (x @ params["w"]) * 0.5


@pytest.mark.parametrize("route", ROUTES + ["autocast"])
def test_a_weakly_typed_literal_does_not_promote(route):
  if route == "autocast":
    jaxpr = jax.make_jaxpr(jmp_lab.autocast(scaled, POLICY))(
        {"w": jnp.ones((8, 8))}, X)
  else:
    jaxpr = ruled_jaxpr(route, LinenScaled, NnxScaled, X)
  assert out_dtypes(jaxpr, "mul", (4, 8)) == {BF16}


# ---- custom_jvp boundaries keep the rules' dtype -----------------------------


class LinenRelu(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jax.nn.relu(nn.Dense(8)(x)) - 1.0


class NnxRelu(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return jax.nn.relu(self.dense(x)) - 1.0


def relu_mlp(params, x):
  return jax.nn.relu(x @ params["w"] + params["b"]) - 1.0


@pytest.mark.parametrize("route", ROUTES + ["autocast"])
def test_relu_through_custom_jvp_stays_half(route):
  if route == "autocast":
    fn = jmp_lab.autocast(relu_mlp, POLICY)
    params = {"w": jnp.ones((8, 8)), "b": jnp.zeros(8)}
    jaxpr = jax.make_jaxpr(fn)(params, X)
    grads = jax.grad(lambda p: fn(p, X).sum())(params)
    chex.assert_type(jax.tree_util.tree_leaves(grads), jnp.float32)
  else:
    jaxpr = ruled_jaxpr(route, LinenRelu, NnxRelu, X)
  assert out_dtypes(jaxpr, "max", (4, 8)) == {BF16}
  assert out_dtypes(jaxpr, "sub", (4, 8)) == {BF16}


def test_custom_jvp_rule_is_kept_at_the_rules_dtype():
  """relu's derivative at 0 is its custom rule's 0, not max's 0.5."""
  fn = jmp_lab.autocast(lambda x: jax.nn.relu(x).sum(), POLICY)
  grad = jax.grad(fn)(jnp.zeros(4))
  chex.assert_trees_all_equal(grad, jnp.zeros(4))


# ---- an fp32 param added outside a Dense -------------------------------------


class LinenOwnBias(nn.Module):
  @nn.compact
  def __call__(self, x):
    bias = self.param("bias", nn.initializers.zeros_init(), (8,))
    return nn.Dense(8, use_bias=False)(x) + bias


class NnxOwnBias(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(8, 8, use_bias=False, rngs=rngs)
    self.bias = nnx.Param(jnp.zeros(8))

  def __call__(self, x):
    return self.dense(x) + self.bias[...]


@pytest.mark.parametrize("route", ROUTES + ["autocast"])
def test_an_fp32_bias_added_outside_a_dense_is_read_in_half(route):
  if route == "autocast":
    jaxpr = jax.make_jaxpr(jmp_lab.autocast(
        lambda p, x: x @ p["w"] + p["b"], POLICY))(
            {"w": jnp.ones((8, 8)), "b": jnp.zeros(8)}, X)
  else:
    jaxpr = ruled_jaxpr(route, LinenOwnBias, NnxOwnBias, X)
  assert out_dtypes(jaxpr, "add", (4, 8)) == {BF16}


# ---- norms: statistics in fp32 -----------------------------------------------


class LinenOwnNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    return ScaleNorm()(nn.Dense(8)(x))


class ScaleNorm(nn.Module):
  """A model's own norm class (its name ends in Norm)."""

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones_init(), (x.shape[-1],))
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


class NnxScaleNorm(nnx.Module):
  def __init__(self, rngs):
    self.scale = nnx.Param(jnp.ones(8))

  def __call__(self, x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True)
                             + 1e-6) * self.scale[...]


class NnxOwnNorm(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(8, 8, rngs=rngs)
    self.norm = NnxScaleNorm(rngs)

  def __call__(self, x):
    return self.norm(self.dense(x))


@pytest.mark.parametrize("route", ROUTES + ["autocast"])
def test_norm_statistics_run_in_fp32(route):
  def inline(params, x):
    h = x @ params["w"]
    return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)

  if route == "autocast":
    jaxpr = jax.make_jaxpr(jmp_lab.autocast(inline, POLICY))(
        {"w": jnp.ones((8, 8))}, X)
  else:
    jaxpr = ruled_jaxpr(route, LinenOwnNorm, NnxOwnNorm, X)
  for eqn in eqns(jaxpr, {"reduce_sum", "rsqrt"}):
    assert np.dtype(eqn.invars[0].aval.dtype) == F32, eqn


# ---- rotary angles built from integers stay fp32 ------------------------------


def rotary(x, positions, base=10000.0):
  """Rotary embedding as public code writes it: angles from integer
  positions and an integer-built frequency table."""
  half = x.shape[-1] // 2
  freqs = base ** (-jnp.arange(0, half, dtype=jnp.float32) / half)
  angles = positions[:, None].astype(jnp.float32) * freqs
  x1, x2 = x[..., :half], x[..., half:]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class LinenRotary(nn.Module):
  @nn.compact
  def __call__(self, x):
    return rotary(nn.Dense(8)(x), jnp.arange(x.shape[0]) + 8188)


class NnxRotary(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return rotary(self.dense(x), jnp.arange(x.shape[0]) + 8188)


@pytest.mark.parametrize("route", ROUTES + ["autocast"])
def test_rotary_angles_at_position_8191_are_fp32(route):
  if route == "autocast":
    fn = jmp_lab.autocast(lambda x: rotary(x, jnp.arange(4) + 8188), POLICY)
    jaxpr = jax.make_jaxpr(fn)(X)
    got = fn(X.astype(jnp.bfloat16))
    want = rotary(X.astype(jnp.bfloat16).astype(jnp.float32),
                  jnp.arange(4) + 8188)
    # bf16 angles at 8191 would be off by up to 16 radians.
    chex.assert_trees_all_close(got, want, atol=5e-2)
  else:
    jaxpr = ruled_jaxpr(route, LinenRotary, NnxRotary, X)
  for eqn in eqns(jaxpr, {"sin", "cos"}):
    assert np.dtype(eqn.invars[0].aval.dtype) == F32, eqn


# ---- a module's helper methods are not boundaries ------------------------------


class LinenHelper(nn.Module):
  """Promotes to fp32 itself, then calls an identity helper: the helper's
  result is the fp32 value (it was cast back to bf16, and a dtype check in
  the model failed)."""

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones_init(), (8,),
                       jnp.float32)
    h = x.astype(jnp.float32) * scale.astype(jnp.float32)
    same = self.identity(h)
    assert same.dtype == h.dtype, (same.dtype, h.dtype)
    return same

  def identity(self, y):
    return y


class NnxHelper(nnx.Module):
  def __init__(self, rngs):
    self.scale = nnx.Param(jnp.ones(8))

  def __call__(self, x):
    h = x.astype(jnp.float32) * self.scale[...].astype(jnp.float32)
    same = self.identity(h)
    assert same.dtype == h.dtype, (same.dtype, h.dtype)
    return same

  def identity(self, y):
    return y


@pytest.mark.parametrize("route", ROUTES)
def test_helper_methods_hand_back_what_they_were_given(route):
  ruled_jaxpr(route, LinenHelper, NnxHelper, X)


# ---- params are read the same way in init, tracing and apply -------------------


class ParamDtypeProbe(nn.Module):
  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.ones_init(), (8, 8))
    self.sow("intermediates", "w", jnp.zeros((), w.dtype))
    return x @ w


def test_init_and_apply_read_params_in_the_same_dtype():
  """init read the params as created (fp32), apply in the compute dtype:
  model code that checks dtypes saw two programs."""
  model = jl.with_policy(ParamDtypeProbe(), POLICY)
  variables = model.init(jax.random.key(0), X, mutable=True)
  _, state = model.apply({"params": variables["params"]}, X,
                         mutable=["intermediates"])
  assert (variables["intermediates"]["w"][0].dtype
          == state["intermediates"]["w"][0].dtype == BF16)


# ---- the loss runs under the policy ---------------------------------------------


class Body(nn.Module):
  """Returns hidden states (the policy's fp32 output); the head is applied
  in the loss."""

  @nn.compact
  def __call__(self, x):
    return nn.LayerNorm()(jax.nn.gelu(nn.Dense(32)(x)))


def _head_state(policy="mixed_bfloat16"):
  model = jl.with_policy(Body(), policy)
  params = {"body": model.init(jax.random.key(0), X)["params"],
            "head": 0.1 * jax.random.normal(jax.random.key(1), (32, 40))}
  return jmp_lab.TrainState.create(
      apply_fn=model.apply, params=params, policy=policy,
      tx=jmp_lab.mixed_precision(optax.sgd(0.1), policy=policy,
                                 loss_scale=jmp_lab.StaticLossScale(128.0)))


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_a_head_in_the_loss_runs_in_half(implementation):
  """linear_cross_entropy on the model's fp32 output: its GEMMs in bf16
  (the XLA path), or the kernels (interpret mode) take it."""
  state = _head_state()

  def loss_fn(params, state, batch):
    hidden = state.apply_fn({"params": params["body"]}, batch["x"])
    assert hidden.dtype == F32      # the policy's output dtype
    return jmp_lab.losses.linear_cross_entropy(
        hidden, params["head"], batch["y"],
        implementation=implementation).mean()

  batch = {"x": X, "y": jnp.arange(4)}
  step = functools.partial(jmp_lab.train_step, loss_fn=loss_fn)
  jaxpr = jax.make_jaxpr(step)(state, batch)
  dots = eqns(jaxpr, {"dot_general"})
  assert dots and not [e for e in dots if F32 in (
      np.dtype(e.invars[0].aval.dtype), np.dtype(e.invars[1].aval.dtype))]
  assert audit_step(step, state, batch).half_flop_share == 1.0
  new_state, metrics = jax.jit(step)(state, batch)
  assert np.isfinite(float(metrics["loss"]))
  chex.assert_type(new_state.params["head"], jnp.float32)


def test_a_regression_loss_against_fp32_targets_stays_fp32():
  state = _head_state()

  def loss_fn(params, state, batch):
    hidden = state.apply_fn({"params": params["body"]}, batch["x"])
    pred = hidden @ params["head"]           # a head in the loss: half
    return jnp.mean(jnp.abs(pred - batch["y"]))

  batch = {"x": X, "y": jnp.full((4, 40), 1.0 + 2.0 ** -10)}
  step = functools.partial(jmp_lab.train_step, loss_fn=loss_fn)
  jaxpr = jax.make_jaxpr(step)(state, batch)
  assert out_dtypes(jaxpr, "sub", (4, 40)) == {F32}
  assert {np.dtype(v.aval.dtype) for e in eqns(jaxpr, {"dot_general"})
          for v in e.invars[:2]} == {BF16}


def test_scaled_value_and_grad_takes_the_policy_too():
  params = {"w": jnp.ones((8, 8))}
  loss = lambda p, x: jnp.sum(x @ p["w"])  # noqa: E731
  jaxpr = jax.make_jaxpr(jmp_lab.scaled_value_and_grad(
      loss, jmp_lab.StaticLossScale(2.0), policy=POLICY))(params, X)
  assert {np.dtype(v.aval.dtype) for e in eqns(jaxpr, {"dot_general"})
          for v in e.invars[:2]} == {BF16}


def test_nnx_step_runs_a_head_in_the_loss_in_half():
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.body = nnx.Linear(8, 32, rngs=rngs)
      self.head = nnx.Param(0.1 * jnp.ones((32, 40)))

  model = jmp_lab.nnx.with_policy(Model(nnx.Rngs(0)), POLICY)
  optimizer = jmp_lab.nnx.Optimizer(model, jmp_lab.mixed_precision(
      optax.sgd(0.1), policy=POLICY), wrt=nnx.Param)

  def loss_fn(model, batch):
    hidden = model.body(batch["x"]).astype(jnp.float32)
    return jmp_lab.losses.linear_cross_entropy(
        hidden, model.head.get_raw_value(), batch["y"]).mean()

  batch = {"x": X, "y": jnp.arange(4)}
  step, state = jmp_lab.nnx.split_train_step(loss_fn, model, optimizer)
  jaxpr = jax.make_jaxpr(step)(state, batch)
  dots = eqns(jaxpr, {"dot_general"})
  assert dots and all(np.dtype(v.aval.dtype) == BF16
                      for e in dots for v in e.invars[:2])


# ---- a recurrent model that checks its dtypes -----------------------------------


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_recurrent_lm_that_asserts_its_dtypes_runs_under_half_policies(
    policy):
  """The Griffin-style model (benchmarks/real_models.py) asserts in its scan
  that its inputs agree in dtype and calls identity helper methods: under
  the old front end its init and apply failed that assert."""
  case = mr.CASES["griffin"](policy)
  report = audit_step(case.step, case.state, next(case.batches),
                      policy=policy)
  assert report.half_flop_share == 1.0
  assert mr.train(case, 5) > 0


# ---- rules as data ----------------------------------------------------------------


class TwoDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, name="head")(nn.Dense(8, name="body")(x))


def _dot_dtypes(model, x):
  variables = model.init(jax.random.key(0), x)
  return [np.dtype(e.invars[0].aval.dtype)
          for e in eqns(jax.make_jaxpr(model.apply)(variables, x),
                        {"dot_general"})]


def test_precision_rules_first_match_wins_and_match_by_class_name():
  rules = [jmp_lab.precision.PrecisionRule("float32", path="^head$"),
           jmp_lab.precision.PrecisionRule("as_written", class_name="Dense")]
  model = jl.with_policy(TwoDense(), POLICY, rules=rules)
  assert _dot_dtypes(model, X) == [F32, F32]   # body: as written (fp32)
  rules = [jmp_lab.precision.PrecisionRule(
      "fp32", predicate=lambda m: m.name == "body")]
  model = jl.with_policy(TwoDense(), POLICY, rules=rules)
  assert _dot_dtypes(model, X) == [F32, BF16]


def test_the_same_rules_decide_for_nnx():
  class Two(nnx.Module):
    def __init__(self, rngs):
      self.body = nnx.Linear(8, 8, rngs=rngs)
      self.head = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
      return self.head(self.body(x))

  model = jmp_lab.nnx.with_policy(Two(nnx.Rngs(0)), POLICY, rules=[
      jmp_lab.precision.PrecisionRule("float32", path="^head$")])
  graphdef, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(X))(state)
  assert [np.dtype(e.invars[0].aval.dtype)
          for e in eqns(jaxpr, {"dot_general"})] == [BF16, F32]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"action": "float32"}, ValueError, "needs a matcher"),
    ({"action": "fp99", "path": "x"}, ValueError, "fp99"),
    ({"action": "fp32", "path": "("}, ValueError, r"invalid PrecisionRule path"),
    ({"action": "fp32", "cls": "Dense"}, TypeError, r"cls must be a class"),
    ({"action": "fp32", "predicate": 3}, TypeError, "predicate must be callable"),
])
def test_a_bad_rule_is_refused_naming_what_is_wrong(kwargs, error, match):
  with pytest.raises(error, match=match):
    jmp_lab.precision.PrecisionRule(**kwargs)
  with pytest.raises(TypeError, match="rules must hold"):
    jl.with_policy(TwoDense(), POLICY, rules=["fp32"])


def test_applying_a_policy_twice_says_to_apply_it_once():
  model = jl.with_policy(TwoDense(), POLICY)
  with pytest.raises(TypeError, match="already has a policy.*once"):
    jl.with_policy(model, POLICY)


def test_the_engines_names_are_reachable_under_jmp_lab_precision():
  old_face = sys.modules["jmp_lab.autocast"]  # jmp_lab.autocast: the function
  for name in old_face.__all__:
    assert getattr(jmp_lab.precision, name) is getattr(old_face, name), name
  assert jmp_lab.autocast.scope is jmp_lab.precision.scope


def test_nnx_attention_takes_grouped_query_attention_with_a_mask():
  """nnx's attention_fn refused grouped-query attention; the front ends now
  share one implementation."""
  q = jax.random.normal(jax.random.key(0), (2, 6, 8, 16))
  kv = jax.random.normal(jax.random.key(1), (2, 6, 2, 16))
  mask = jnp.tril(jnp.ones((6, 6), bool))[None, None]
  got = jmp_lab.nnx.dot_product_attention(q, kv, kv, mask=mask)
  want = jl.dot_product_attention(q, jnp.repeat(kv, 4, axis=2),
                                  jnp.repeat(kv, 4, axis=2), mask=mask)
  chex.assert_trees_all_close(got, want, atol=1e-5)
