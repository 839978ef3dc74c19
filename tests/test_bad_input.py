"""The bad-input catalogue: every public entry point refuses a mistake with a
ValueError or TypeError that names the argument, the bad value and what is
accepted -- never a jax-internal error or a silent wrong answer."""

import functools
import re

import chex
import flax.linen as nn
from flax import nnx
from flax.training import train_state as flax_ts
import jax
import jax.numpy as jnp
import optax
import pytest

import jmp_lab
from jmp_lab import linen as jl

BF16 = "p=bf16,c=bf16,o=f32"
NO_SCALE = jmp_lab.NoOpLossScale()


def params(extra=False, drop=False, width=4):
  tree = {"dense": {"w": jnp.ones((3, width), jnp.bfloat16),
                    "b": jnp.zeros((width,), jnp.bfloat16)}}
  if extra:
    tree["head"] = jnp.ones((2,), jnp.bfloat16)
  if drop:
    del tree["dense"]["b"]
  return tree


def mixed(spec=BF16):
  return jmp_lab.mixed_precision(optax.adam(1e-3), policy=spec,
                                 loss_scale=NO_SCALE)


def fused(**kwargs):
  return jmp_lab.fused_adamw(1e-3, policy=BF16, loss_scale=NO_SCALE, **kwargs)


def update_with_state_of(tx, built_for, used_with):
  state = tx.init(built_for)
  grads = jax.tree_util.tree_map(jnp.ones_like, used_with)
  return tx.update(grads, state, used_with)


def train_state(tx=None, spec="float32", **kwargs):
  model = jl.with_policy(nn.Dense(3), spec)
  variables = model.init(jax.random.key(0), jnp.ones((1, 2)))
  tx = tx or jmp_lab.mixed_precision(optax.sgd(0.1), policy=spec,
                                     loss_scale=NO_SCALE)
  return jmp_lab.TrainState.create(apply_fn=model.apply,
                                   params=variables["params"], tx=tx,
                                   policy=spec, **kwargs)


def flax_train_state():
  """Flax's own TrainState, with jmp_lab's optimizer: what a Flax user
  writes first."""
  model = jl.with_policy(nn.Dense(3), "float32")
  variables = model.init(jax.random.key(0), jnp.ones((1, 2)))
  return flax_ts.TrainState.create(apply_fn=model.apply,
                                   params=variables["params"], tx=mixed("float32"))


def mean_square_loss(params, state, batch):
  return jnp.mean(state.apply_fn({"params": params}, batch) ** 2)


def two_argument_loss(params, batch):
  return jnp.mean(params["kernel"] ** 2) + jnp.mean(batch)


def step_with(loss_output):
  def loss_fn(params, state, batch):
    loss = jnp.mean(state.apply_fn({"params": params}, batch) ** 2)
    return loss_output(loss)
  return jmp_lab.make_train_step(loss_fn, donate=False)(
      train_state(), jnp.ones((2, 2)))


# (id, thunk, exception, patterns that must all appear in the message)
CASES = [
    # --- policies ------------------------------------------------------------
    ("policy-unknown-dtype", lambda: jmp_lab.get_policy("p=f32,c=bf17"),
     ValueError, ["bf17", "accepted names", "bfloat16"]),
    ("policy-almost-dtype", lambda: jmp_lab.get_policy("compute_float16"),
     ValueError, ["compute_float16", "did you mean 'mixed_float16'?",
                  "Presets: float32, mixed_bfloat16"]),
    ("policy-typo", lambda: jmp_lab.get_policy("mixed_bf16"),
     ValueError, ["unknown dtype or preset 'mixed_bf16' in policy: did you "
                  "mean 'mixed_bfloat16'?", "Presets", "mixed_float16"]),
    ("policy-typo-before-keys",
     lambda: jmp_lab.get_policy("mixed_bf16,reduce=float32"),
     ValueError, ["did you mean 'mixed_bfloat16'?"]),
    ("policy-unknown-key", lambda: jmp_lab.get_policy("p=f32,x=bf16"),
     ValueError, ["'x'", "accepted keys", "params"]),
    ("policy-duplicate-key", lambda: jmp_lab.get_policy("p=f32,params=bf16"),
     ValueError, ["duplicate key", "params"]),
    ("policy-empty", lambda: jmp_lab.get_policy("  "),
     ValueError, ["empty", "mixed_bfloat16"]),
    ("policy-not-a-string", lambda: jmp_lab.get_policy(16),
     TypeError, ["Policy or a string", "16"]),
    ("policy-integer-dtype", lambda: jmp_lab.Policy("float32", "int8", "float32"),
     ValueError, ["int8", "accepted"]),
    ("policy-fp8-dtype",
     lambda: jmp_lab.Policy(jnp.float8_e4m3fn, jnp.float32, jnp.float32),
     ValueError, ["param_dtype", "float8_e4m3fn", "accepted"]),
    ("policy-not-a-dtype", lambda: jmp_lab.Policy(object(), "f32", "f32"),
     TypeError, ["param_dtype", "floating dtype"]),
    # --- loss scales -------------------------------------------------------
    ("static-scale-zero", lambda: jmp_lab.StaticLossScale(0.0),
     ValueError, ["loss_scale", "> 0", "0.0"]),
    ("static-scale-negative", lambda: jmp_lab.StaticLossScale(-2.0),
     ValueError, ["loss_scale", "-2.0"]),
    ("static-scale-inf", lambda: jmp_lab.StaticLossScale(float("inf")),
     ValueError, ["loss_scale", "finite", "inf"]),
    ("static-scale-vector", lambda: jmp_lab.StaticLossScale(jnp.ones(2)),
     ValueError, ["loss_scale", "scalar", "(2,)"]),
    ("dynamic-growth-interval-zero",
     lambda: jmp_lab.DynamicLossScale(growth_interval=0),
     ValueError, ["growth_interval", ">= 1", "0"]),
    ("dynamic-growth-interval-fraction",
     lambda: jmp_lab.DynamicLossScale(growth_interval=2.5),
     ValueError, ["growth_interval", "integer", "2.5"]),
    ("dynamic-growth-factor", lambda: jmp_lab.DynamicLossScale(growth_factor=1.0),
     ValueError, ["growth_factor", "> 1", "1.0"]),
    ("dynamic-backoff-factor",
     lambda: jmp_lab.DynamicLossScale(backoff_factor=1.5),
     ValueError, ["backoff_factor", "(0, 1)", "1.5"]),
    ("dynamic-min-scale-zero", lambda: jmp_lab.DynamicLossScale(min_loss_scale=0),
     ValueError, ["min_loss_scale", "> 0", "0"]),
    ("dynamic-scale-above-max",
     lambda: jmp_lab.DynamicLossScale(loss_scale=2.0**30),
     ValueError, ["1073741824", "max_loss_scale"]),
    ("dynamic-min-above-max",
     lambda: jmp_lab.DynamicLossScale(min_loss_scale=4.0, max_loss_scale=2.0,
                                      loss_scale=3.0),
     ValueError, ["min_loss_scale 4.0", "max_loss_scale 2.0"]),
    ("dynamic-float-counter", lambda: jmp_lab.DynamicLossScale(counter=1.5),
     TypeError, ["counter", "integer scalar", "float"]),
    ("adjust-vector-predicate",
     lambda: jmp_lab.DynamicLossScale().adjust(jnp.ones(2, bool)),
     TypeError, ["grads_finite", "scalar bool", "bool[2]"]),
    ("select-tree-vector-predicate",
     lambda: jmp_lab.select_tree(jnp.ones(2), 1.0, 2.0),
     TypeError, ["pred", "scalar bool", "float32[2]"]),
    ("select-tree-mismatch",
     lambda: jmp_lab.select_tree(True, {"a": jnp.ones(1)}, {"b": jnp.ones(1)}),
     ValueError, ["on_true", "['a']", "['b']"]),
    # --- mixed_precision -----------------------------------------------------
    ("mixed-uncalled-factory",
     lambda: jmp_lab.mixed_precision(optax.adam, policy=BF16, loss_scale=NO_SCALE),
     TypeError, ["inner", "GradientTransformation", "adam", "uncalled"]),
    ("mixed-string-transformation",
     lambda: jmp_lab.mixed_precision("adam", policy=BF16, loss_scale=NO_SCALE),
     TypeError, ["inner", "GradientTransformation", "'adam'"]),
    ("mixed-number-loss-scale",
     lambda: jmp_lab.mixed_precision(optax.adam(1e-3), policy=BF16,
                                     loss_scale=2.0**15),
     TypeError, ["loss_scale", "32768.0", "StaticLossScale"]),
    ("mixed-bad-policy",
     lambda: jmp_lab.mixed_precision(optax.adam(1e-3), policy="p=float17",
                                     loss_scale=NO_SCALE),
     ValueError, ["float17", "accepted"]),
    ("mixed-state-extra-leaf",
     lambda: update_with_state_of(mixed(), params(), params(extra=True)),
     ValueError, ["optimizer state does not match the params", "['head']"]),
    ("mixed-state-missing-leaf",
     lambda: update_with_state_of(mixed(), params(), params(drop=True)),
     ValueError, ["optimizer state does not match the params",
                  "['dense']['b']"]),
    ("mixed-state-other-shapes",
     lambda: update_with_state_of(mixed(), params(), params(width=5)),
     ValueError, ["optimizer state does not match the params",
                  "['dense']['b']", "bfloat16[5]", "bfloat16[4]"]),
    ("mixed-fp32-state-other-shapes",
     lambda: update_with_state_of(
         mixed("float32"), jmp_lab.cast_floating(params(), jnp.float32),
         jmp_lab.cast_floating(params(width=5), jnp.float32)),
     ValueError, ["optimizer state does not match the params",
                  "['dense']['b']"]),
    ("mixed-update-without-params",
     lambda: mixed().update(params(), mixed().init(params())),
     ValueError, ["needs params", "tx.update(grads, opt_state, params)"]),
    ("mixed-params-wrong-dtype",
     lambda: mixed().init(jmp_lab.cast_floating(params(), jnp.float32)),
     ValueError, ["['dense']['b']", "float32", "param_dtype is bfloat16"]),
    ("mixed-grads-wrong-dtype",
     lambda: mixed().update(jmp_lab.cast_floating(params(), jnp.float32),
                            mixed().init(params()), params()),
     ValueError, ["gradient ['dense']['b']", "float32", "param dtype"]),
    ("mixed-update-with-fused-state",
     lambda: mixed().update(params(), fused().init(params()), params()),
     TypeError, ["state its init returned", "FusedAdamWState"]),
    # --- fused_adamw ---------------------------------------------------------
    ("fused-nan-learning-rate",
     lambda: jmp_lab.fused_adamw(float("nan"), policy=BF16, loss_scale=NO_SCALE),
     ValueError, ["learning_rate", "finite", "nan"]),
    ("fused-inf-learning-rate",
     lambda: jmp_lab.fused_adamw(float("inf"), policy=BF16, loss_scale=NO_SCALE),
     ValueError, ["learning_rate", "finite", "inf"]),
    ("fused-nan-array-learning-rate",
     lambda: jmp_lab.fused_adamw(jnp.float32(jnp.nan), policy=BF16,
                                 loss_scale=NO_SCALE),
     ValueError, ["learning_rate", "nan"]),
    ("fused-negative-learning-rate",
     lambda: jmp_lab.fused_adamw(-1e-3, policy=BF16, loss_scale=NO_SCALE),
     ValueError, ["learning_rate", "-0.001", "[0, inf)"]),
    ("fused-string-learning-rate",
     lambda: jmp_lab.fused_adamw("1e-3", policy=BF16, loss_scale=NO_SCALE),
     TypeError, ["learning_rate", "real number", "'1e-3'"]),
    ("fused-b1-one", lambda: fused(b1=1.0),
     ValueError, ["b1", "[0, 1)", "1.0"]),
    ("fused-b2-nan", lambda: fused(b2=float("nan")),
     ValueError, ["b2", "nan"]),
    ("fused-negative-eps", lambda: fused(eps=-1e-8),
     ValueError, ["eps", "-1e-08"]),
    ("fused-inf-weight-decay", lambda: fused(weight_decay=float("inf")),
     ValueError, ["weight_decay", "inf"]),
    ("fused-zero-max-grad-norm", lambda: fused(max_grad_norm=0.0),
     ValueError, ["max_grad_norm", "(0, inf)", "0.0"]),
    ("fused-string-max-grad-norm", lambda: fused(max_grad_norm="1"),
     TypeError, ["max_grad_norm", "real number", "'1'"]),
    ("fused-number-loss-scale",
     lambda: jmp_lab.fused_adamw(1e-3, policy=BF16, loss_scale=1024),
     TypeError, ["loss_scale", "1024", "StaticLossScale"]),
    ("fused-unknown-backend", lambda: fused(backend="cuda"),
     ValueError, ["'cuda'", "accepted", "mosaic", "reference"]),
    ("fused-state-extra-leaf",
     lambda: update_with_state_of(fused(), params(), params(extra=True)),
     ValueError, ["optimizer state does not match the params", "['head']"]),
    ("fused-state-missing-leaf",
     lambda: update_with_state_of(fused(), params(), params(drop=True)),
     ValueError, ["optimizer state does not match the params",
                  "['dense']['b']"]),
    ("fused-state-other-shapes",
     lambda: update_with_state_of(fused(), params(), params(width=5)),
     ValueError, ["optimizer state does not match the params",
                  "['dense']['b']", "bfloat16[5]"]),
    ("fused-flat-params-of-mixed-state",
     lambda: jmp_lab.flat_params(mixed().init(params()), params()),
     TypeError, ["fused_adamw optimizer state", "MixedPrecisionState"]),
    ("fused-unflatten-wrong-shape",
     lambda: jmp_lab.unflatten_params(fused(layout="flat").init(params()),
                                      jnp.ones(3)),
     ValueError, ["flat must be", "float32[3]"]),
    ("fused-flat-params-of-tree-layout",
     lambda: jmp_lab.flat_params(fused().init(params()), params()),
     ValueError, ["flat params need the flat state layout", "layout='flat'",
                  "layout='tree'"]),
    ("fused-unknown-layout", lambda: fused(layout="rows"),
     ValueError, ["layout", "'rows'", "'tree', 'flat'"]),
    ("fused-state-extra-leaf-flat",
     lambda: update_with_state_of(fused(layout="flat"), params(),
                                  params(extra=True)),
     ValueError, ["optimizer state does not match the params", "['head']"]),
    # --- training helpers ----------------------------------------------------
    ("scaled-grad-number-loss-scale",
     lambda: jmp_lab.scaled_value_and_grad(jnp.sum, 128.0),
     TypeError, ["loss_scale", "128.0", "StaticLossScale"]),
    ("scaled-grad-vector-loss",
     lambda: jmp_lab.scaled_value_and_grad(lambda x: x * 2, NO_SCALE)(jnp.ones(3)),
     TypeError, ["floating scalar", "float32[3]"]),
    ("train-state-uncalled-factory", lambda: train_state(tx=optax.adam),
     TypeError, ["tx", "GradientTransformation", "uncalled"]),
    ("train-state-string-tx", lambda: train_state(tx="adamw"),
     TypeError, ["tx", "GradientTransformation", "'adamw'"]),
    ("train-state-plain-optax", lambda: train_state(tx=optax.adam(1e-3)),
     TypeError, ["tx", "jmp_lab optimizer", "mixed_precision"]),
    ("train-state-integer-params",
     lambda: jmp_lab.TrainState.create(
         apply_fn=lambda *a: None, tx=mixed("float32"),
         params={"w": jnp.ones(3), "steps": jnp.zeros((), jnp.int32)}),
     TypeError, ["int32[]", "['steps']", "model_state"]),
    ("train-state-no-policy-anywhere",
     lambda: jmp_lab.TrainState.create(apply_fn=lambda *a: None,
                                       params={"w": jnp.ones(3)},
                                       tx=optax.adam(1e-3)),
     TypeError, ["needs a policy", "policy=", "jmp_lab.mixed_precision"]),
    ("train-step-loss-fn-not-callable",
     lambda: jmp_lab.make_train_step("loss"),
     TypeError, ["loss_fn", "callable", "'loss'"]),
    ("train-step-three-tuple", lambda: step_with(lambda loss: (loss, {}, {})),
     TypeError, ["loss_fn(params, state, batch) must return", "tuple of 3"]),
    ("train-step-metrics-as-aux",
     lambda: step_with(lambda loss: (loss, {"accuracy": loss})),
     TypeError, ["'metrics'", "aux keys ['accuracy']"]),
    ("train-step-vector-loss",
     lambda: step_with(lambda loss: jnp.stack([loss, loss])),
     TypeError, ["must return a floating scalar loss", "float32[2]"]),
    ("train-step-metrics-not-dict",
     lambda: step_with(lambda loss: (loss, {"metrics": [loss]})),
     TypeError, ["metrics of type list"]),
    ("train-step-logits-as-aux",
     lambda: step_with(lambda loss: (loss, jnp.ones((32, 10)))),
     TypeError, ["got aux float32[32, 10] (an array)"]),
    # issue 40's mistakes: before, AttributeErrors from inside the step and a
    # TypeError raised inside training.py
    ("train-step-flaxs-own-train-state",
     lambda: jmp_lab.make_train_step(mean_square_loss, donate=False)(
         flax_train_state(), jnp.ones((2, 2))),
     TypeError, ["jmp_lab.TrainState", "flax.training.train_state.TrainState",
                 "Flax's own", "jmp_lab.TrainState.create("]),
    ("train-step-flaxs-own-train-state-donated",
     lambda: jmp_lab.make_train_step(mean_square_loss)(
         flax_train_state(), jnp.ones((2, 2))),
     TypeError, ["Flax's own", "jmp_lab.TrainState.create("]),
    ("train-step-flaxs-own-train-state-in-train-step",
     lambda: jax.jit(functools.partial(jmp_lab.train_step,
                                       loss_fn=mean_square_loss))(
         flax_train_state(), jnp.ones((2, 2))),
     TypeError, ["Flax's own", "jmp_lab.TrainState.create("]),
    ("train-step-arguments-swapped",
     lambda: jmp_lab.make_train_step(mean_square_loss, donate=False)(
         {"x": jnp.ones((2, 2))}, train_state()),
     TypeError, ["takes (state, batch)", "got a dict and then a "
                 "jmp_lab.TrainState", "swapped", "step(state, batch)"]),
    ("train-step-not-a-state",
     lambda: jmp_lab.make_train_step(mean_square_loss)(
         {"params": {}}, jnp.ones((2, 2))),
     TypeError, ["state must be a jmp_lab.TrainState", "dict"]),
    ("train-step-two-argument-loss-fn",
     lambda: jmp_lab.make_train_step(two_argument_loss),
     TypeError, ["loss_fn(params, state, batch)",
                 "two_argument_loss(params, batch)", "Add the state",
                 "jmp_lab.nnx.make_train_step"]),
    ("train-step-two-argument-loss-fn-in-train-step",
     lambda: jmp_lab.train_step(train_state(), jnp.ones((2, 2)),
                                loss_fn=two_argument_loss),
     TypeError, ["loss_fn(params, state, batch)", "Add the state"]),
    ("train-step-two-argument-partial",
     lambda: jmp_lab.make_train_step(functools.partial(
         lambda scale, params, batch: scale * jnp.sum(params), 2.0)),
     TypeError, ["(params, batch)", "loss_fn(params, state, batch)"]),
    ("train-state-rngs-a-bare-key",
     lambda: train_state(rngs=jax.random.key(1)),
     TypeError, ["rngs", "dict", "'dropout'", "key<fry>[]"]),
    ("train-state-rngs-not-a-key",
     lambda: train_state(rngs={"dropout": 1}),
     TypeError, ["rngs", "'dropout'", "int"]),
    ("scaled-grad-equinox-with-argnums",
     lambda: jmp_lab.scaled_value_and_grad(
         lambda a, b: jnp.sum(a * b), NO_SCALE, argnums=1,
         value_and_grad=pytest.importorskip("equinox").filter_value_and_grad),
     TypeError, ["filter_value_and_grad", "takes no argnums", "argnums=1",
                 "first argument"]),
    # --- linen ---------------------------------------------------------------
    ("linen-not-a-module",
     lambda: jl.with_policy(lambda x: x, "mixed_bfloat16"),
     TypeError, ["flax.linen.Module", "function"]),
    ("linen-bad-policy", lambda: jl.with_policy(nn.Dense(2), "p=f33"),
     ValueError, ["f33", "accepted"]),
    ("linen-class-override-not-a-class",
     lambda: jl.with_policy(nn.Dense(2), "float32",
                            class_overrides={"Dense": "float32"}),
     TypeError, ["class_overrides", "'Dense'"]),
    ("linen-bad-path-regex",
     lambda: jl.with_policy(nn.Dense(2), "float32",
                            path_overrides={"(": "float32"}),
     ValueError, ["path_overrides", "'('"]),
    # A list of pairs, or a string, was an AttributeError ('list' object
    # has no attribute 'items').
    ("linen-path-overrides-a-list",
     lambda: jl.with_policy(nn.Dense(2), "mixed_bfloat16",
                            path_overrides=[("head", "float32")]),
     TypeError, ["path_overrides must be a mapping", "list", "'head'"]),
    ("linen-class-overrides-a-list",
     lambda: jl.with_policy(nn.Dense(2), "mixed_bfloat16",
                            class_overrides=[nn.Dense]),
     TypeError, ["class_overrides must be a mapping", "list"]),
    ("nnx-path-overrides-a-string",
     lambda: jmp_lab.nnx.with_policy(
         nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "mixed_bfloat16",
         path_overrides="head=float32"),
     TypeError, ["path_overrides must be a mapping", "str",
                 "'head=float32'"]),
]


def test_a_donated_state_used_again_says_what_to_do():
  state = train_state()
  step = jmp_lab.make_train_step(
      lambda p, s, b: jnp.mean(s.apply_fn({"params": p}, b) ** 2))
  new_state, _ = step(state, jnp.ones((2, 2)))
  with pytest.raises(RuntimeError, match=r"donated to an earlier call.*"
                     r"pass the state that call returned.*donate=False"):
    step(state, jnp.ones((2, 2)))
  step(new_state, jnp.ones((2, 2)))  # the returned state works


def test_flax_own_nnx_optimizer_is_named_as_flaxs():
  from flax import nnx
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  step = jmp_lab.nnx.make_train_step(lambda m, x: jnp.mean(m(x) ** 2))
  with pytest.raises(TypeError, match=r"got flax.nnx.Optimizer \(Flax's own, "
                     r"which keeps no fp32 master.*jmp_lab.nnx.Optimizer\(model"):
    step(model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param),
         jnp.ones((1, 2)))


def test_nnx_optimizer_whose_wrt_selects_nothing_is_refused():
  from flax import nnx
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"wrt=.*BatchStat.* selects no "
                     r"variable of the Linear: nothing would be trained"):
    jmp_lab.nnx.Optimizer(model, mixed("float32"), wrt=nnx.BatchStat)


def test_the_catalogue_is_large_and_unique():
  assert len(CASES) >= 40
  assert len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize("thunk,error,patterns",
                         [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_bad_input_is_refused_clearly(thunk, error, patterns):
  with pytest.raises((TypeError, ValueError)) as raised:
    thunk()
  assert type(raised.value) is error, repr(raised.value)
  message = str(raised.value)
  for pattern in patterns:
    assert pattern in message, f"{pattern!r} not in {message!r}"
  # A message of our own, not one from inside jax.
  assert not re.search(r"incompatible shapes|cannot reshape|iteration over a "
                       r"0-d|Dict key mismatch", message)


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
def test_a_gpu_backend_compiled_for_the_cpu_is_refused_by_name(backend):
  """Pallas said only ``Only interpret mode is supported on CPU backend``,
  from inside ``pallas_call``; now the error names the backend, the
  platform and what to pass instead, and the state is left as it was."""
  from jmp_lab.kernels import registry
  if backend not in registry.available():
    pytest.skip(f"this jax cannot import the {backend} backend")
  params = {"w": jnp.ones((64, 64), jnp.bfloat16)}
  tx = jmp_lab.fused_adamw(1e-3, policy="p=bf16,c=bf16,o=f32",
                           backend=backend, layout="flat")
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  refused = (rf"fused backend '{backend}' runs its Pallas kernel on an NVIDIA "
             r"GPU only, and this step is being compiled for 'cpu'; pass "
             r"backend='auto' .* 'reference', or 'interpret'")
  before = jax.tree.map(jnp.copy, state)
  with pytest.raises(ValueError, match=refused):
    jax.jit(tx.update)(grads, state, params)
  with pytest.raises(ValueError, match=refused):  # op by op, un-jitted
    tx.update(grads, state, params)
  chex.assert_trees_all_equal(state, before)  # the state is as it was
  # Fine where it is asked for: interpret mode runs the same kernel here.
  interpret = jmp_lab.fused_adamw(1e-3, policy="p=bf16,c=bf16,o=f32",
                                  backend="interpret", layout="flat")
  jax.jit(interpret.update)(grads, interpret.init(params), params)
