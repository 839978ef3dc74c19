"""Tests for jmp_lab.loss_scale: scales, the GradScaler state machine,
pytree round trips, all_finite and select_tree."""

import dataclasses
import math

import pathlib
import tempfile

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant,
                                 rule)
from jax.sharding import Mesh, PartitionSpec as P

import jmp_lab
from jmp_lab import jmp as jmp_compat

DYNAMIC_FIELDS = ("loss_scale", "counter", "growth_interval", "growth_factor",
                  "backoff_factor", "min_loss_scale", "max_loss_scale")


def nondefault_dynamic():
  """Every field differs from its default, so a dropped field shows."""
  return jmp_lab.DynamicLossScale(
      loss_scale=96.0, growth_interval=7, growth_factor=3.0,
      backoff_factor=0.25, min_loss_scale=2.0, max_loss_scale=6144.0,
      counter=jnp.int32(5))


def assert_same_fields(a, b, fields):
  for name in fields:
    x, y = getattr(a, name), getattr(b, name)
    chex.assert_trees_all_equal(x, y)
    assert type(x) is type(y) or (hasattr(x, "dtype") and x.dtype == y.dtype), name


# --- scale / unscale -------------------------------------------------------


class ScaleUnscaleTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(jnp.float16, jnp.bfloat16, jnp.float32)
  def test_scale_keeps_dtype_and_unscale_gives_f32(self, dtype):
    loss_scale = jmp_lab.StaticLossScale(1024.0)
    tree = {"g": jnp.array([0.5, -2.0, 3.0], dtype), "step": jnp.int32(3)}
    scaled = self.variant(loss_scale.scale)(tree)
    chex.assert_type(scaled["g"], dtype)
    chex.assert_trees_all_close(scaled["g"].astype(jnp.float32),
                                jnp.array([512.0, -2048.0, 3072.0]))
    unscaled = self.variant(loss_scale.unscale)(scaled)
    chex.assert_type(unscaled["g"], jnp.float32)
    chex.assert_trees_all_close(unscaled["g"], jnp.array([0.5, -2.0, 3.0]))
    chex.assert_trees_all_equal(unscaled["step"], tree["step"])

  @chex.variants(with_jit=True, without_jit=True)
  def test_scaling_fp16_in_fp32_overflows_only_when_result_does(self):
    # 4.0 * 2**14 = 65536 overflows fp16 (max 65504); 2.0 * 2**14 does not.
    loss_scale = jmp_lab.StaticLossScale(2.0**14)
    scaled = self.variant(loss_scale.scale)(jnp.array([2.0, 4.0], jnp.float16))
    assert np.isfinite(scaled[0]) and np.isinf(scaled[1])

  def test_noop(self):
    noop = jmp_lab.NoOpLossScale()
    x = jnp.array([1.5], jnp.bfloat16)
    assert noop.scale(x) is x
    chex.assert_type(noop.unscale(x), jnp.float32)
    chex.assert_trees_all_equal(noop.loss_scale, jnp.float32(1.0))
    assert noop.adjust(jnp.array(False)) is noop
    assert jax.tree_util.tree_leaves(noop) == []

  @chex.variants(with_jit=True, without_jit=True)
  def test_python_float_loss_is_scaled(self):
    out = self.variant(lambda s: s.scale(2.0))(jmp_lab.StaticLossScale(4.0))
    chex.assert_trees_all_close(out, 8.0)


# --- jmp's bugs, which jmp_lab must not repeat -----------------------------


# --- round trips: every field survives -------------------------------------


ROUND_TRIPS = {
    "flatten_unflatten": lambda s: jax.tree_util.tree_unflatten(
        *reversed(jax.tree_util.tree_flatten(s))),
    "jit_identity": jax.jit(lambda s: s),
    "jit_adjust_true_then_identity": None,  # handled below
    "device_put": jax.device_put,
    "tree_map_copy": lambda s: jax.tree_util.tree_map(jnp.array, s),
    "device_get": jax.device_get,
}


# --- the GradScaler state machine ------------------------------------------


@dataclasses.dataclass
class GradScalerModel:
  """torch.cuda.amp.GradScaler's update rule in plain Python, in f32."""
  scale: float
  growth_interval: int
  growth_factor: float
  backoff_factor: float
  min_scale: float
  max_scale: float
  counter: int = 0

  def step(self, finite: bool):
    f32 = np.float32
    if not finite:
      self.scale = max(f32(self.scale) * f32(self.backoff_factor), f32(self.min_scale))
      self.counter = 0
    elif self.counter + 1 >= self.growth_interval:
      grown = min(f32(self.scale) * f32(self.growth_factor), f32(self.max_scale))
      if math.isfinite(grown):
        self.scale = grown
      self.counter = 0
    else:
      self.counter += 1


configs = st.fixed_dictionaries({
    "loss_scale": st.sampled_from([1.0, 3.0, 2.0**15, 1000.0]),
    "growth_interval": st.integers(1, 5),
    "growth_factor": st.sampled_from([2.0, 1.5, 4.0]),
    "backoff_factor": st.sampled_from([0.5, 0.25, 0.9]),
    "min_loss_scale": st.sampled_from([1.0, 0.5]),
    "max_loss_scale": st.sampled_from([2.0**16, 2.0**24, 5000.0, math.inf]),
}).filter(lambda c: c["min_loss_scale"] <= c["loss_scale"] <= c["max_loss_scale"])


class DynamicLossScaleMachine(RuleBasedStateMachine):
  """Steps the jitted DynamicLossScale and the Python model side by side."""

  @initialize(config=configs)
  def start(self, config):
    self.loss_scale = jmp_lab.DynamicLossScale(**config)
    self.model = GradScalerModel(
        config["loss_scale"], config["growth_interval"],
        config["growth_factor"], config["backoff_factor"],
        config["min_loss_scale"], config["max_loss_scale"])

  @rule(finite=st.booleans())
  def step(self, finite):
    self.loss_scale = _jitted_adjust(self.loss_scale, jnp.array(finite))
    self.model.step(finite)

  @invariant()
  def agrees_with_model(self):
    assert float(self.loss_scale.loss_scale) == self.model.scale
    assert int(self.loss_scale.counter) == self.model.counter
    assert np.isfinite(float(self.loss_scale.loss_scale))


_jitted_adjust = jax.jit(lambda s, finite: s.adjust(finite))
TestDynamicLossScaleMachine = DynamicLossScaleMachine.TestCase
TestDynamicLossScaleMachine.settings = settings(
    max_examples=25, stateful_step_count=30, deadline=None)


# --- bad input -------------------------------------------------------------


# --- all_finite and select_tree --------------------------------------------


class AllFiniteTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ("empty", {}, True),
      ("finite", {"a": jnp.ones(3, jnp.float16), "b": [jnp.zeros(2)]}, True),
      ("nan", {"a": jnp.ones(3), "b": [jnp.array([0.0, jnp.nan])]}, False),
      ("inf_fp16", {"a": jnp.array([jnp.inf], jnp.float16)}, False),
      ("neg_inf_bf16", {"a": jnp.array([-jnp.inf], jnp.bfloat16)}, False),
      ("ints_ignored", {"i": jnp.int32(2**31 - 1), "f": jnp.ones(2)}, True),
  )
  def test_all_finite(self, tree, expected):
    result = self.variant(jmp_lab.all_finite)(tree)
    chex.assert_shape(result, ())
    chex.assert_type(result, jnp.bool_)
    assert bool(result) == expected

  def test_combines_across_devices_in_shard_map(self):
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    x = jnp.array([1.0, jnp.inf])  # device 0 finite, device 1 not

    def local(x):
      return (jmp_lab.all_finite(x)[None],
              jmp_lab.all_finite(x, axis_name="data")[None])

    local_flags, global_flags = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(x)
    assert local_flags.tolist() == [True, False]
    assert global_flags.tolist() == [False, False]

  def test_sharded_input_under_jit_is_global(self):
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    x = jax.device_put(jnp.array([1.0, 2.0, 3.0, jnp.nan]),
                       jax.sharding.NamedSharding(mesh, P("data")))
    assert not bool(jax.jit(jmp_lab.all_finite)(x))


class SelectTreeTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_selects(self):
    a = {"w": jnp.ones(3, jnp.bfloat16), "n": jnp.int32(1), "s": jnp.float32(1)}
    b = {"w": jnp.zeros(3, jnp.bfloat16), "n": jnp.int32(2), "s": jnp.float32(2)}
    select = self.variant(jmp_lab.select_tree)
    chex.assert_trees_all_equal(select(jnp.array(True), a, b), a)
    chex.assert_trees_all_equal(select(jnp.array(False), a, b), b)
    chex.assert_trees_all_equal_dtypes(select(jnp.array(True), a, b), a)

  def test_structure_mismatch_names_the_leaf(self):
    with pytest.raises(ValueError, match=r"\['extra'\]"):
      jmp_lab.select_tree(jnp.array(True), {"w": jnp.ones(2)},
                          {"w": jnp.ones(2), "extra": jnp.ones(2)})

  def test_dtype_mismatch_names_the_leaf(self):
    with pytest.raises(ValueError, match=r"\['layer'\]\['w'\].*float32.*bfloat16"):
      jmp_lab.select_tree(jnp.array(True), {"layer": {"w": jnp.ones(2)}},
                          {"layer": {"w": jnp.ones(2, jnp.bfloat16)}})

  def test_shape_mismatch_names_the_leaf(self):
    with pytest.raises(ValueError, match=r"\[1\]"):
      jmp_lab.select_tree(jnp.array(True), [jnp.ones(2), jnp.ones(3)],
                          [jnp.ones(2), jnp.ones(4)])

  def test_non_bool_pred_raises(self):
    with pytest.raises(TypeError, match="scalar bool"):
      jmp_lab.select_tree(jnp.float32(1.0), jnp.ones(2), jnp.ones(2))


class LossScaleTest(chex.TestCase):

  @parameterized.product(cls_kwargs=[
      (jmp_lab.StaticLossScale, {}),
      (jmp_lab.DynamicLossScale, {"min_loss_scale": 1.0}),
  ])
  def test_fp16_scale_is_accepted_and_stored_as_f32(self, cls_kwargs):
    cls, kwargs = cls_kwargs
    loss_scale = cls(jnp.asarray(1024.0, jnp.float16), **kwargs)
    chex.assert_type(loss_scale.loss_scale, jnp.float32)
    step = jax.jit(lambda s, g: s.unscale(s.scale(g)))
    chex.assert_trees_all_close(step(loss_scale, jnp.ones(3, jnp.float16)),
                                jnp.ones(3))
    adjusted = jax.jit(lambda s: s.adjust(jnp.array(False)))(loss_scale)
    chex.assert_type(adjusted.loss_scale, jnp.float32)

  def test_static_scale_is_traced_not_baked_in(self):
    traces = []

    @jax.jit
    def step(loss_scale, g):
      traces.append(None)
      return loss_scale.unscale(loss_scale.scale(g) * 3.0)

    g = jnp.ones(4, jnp.float16)
    for value in (2.0, 128.0, 4096.0):
      chex.assert_trees_all_close(step(jmp_lab.StaticLossScale(value), g),
                                  3 * jnp.ones(4))
    assert len(traces) == 1
    lowered = step.lower(jmp_lab.StaticLossScale(4096.0), g).as_text()
    assert "4096" not in lowered and "4.096" not in lowered

  def test_dynamic_scale_changes_do_not_recompile(self):
    traces = []

    @jax.jit
    def adjust(loss_scale, finite):
      traces.append(None)
      return loss_scale.adjust(finite)

    loss_scale = jmp_lab.DynamicLossScale(growth_interval=1)
    for finite in [True, False, True, True]:
      loss_scale = adjust(loss_scale, jnp.array(finite))
    assert len(traces) == 1

  @parameterized.product(how=[k for k, v in ROUND_TRIPS.items() if v])
  def test_dynamic_round_trip_keeps_every_field(self, how):
    original = nondefault_dynamic()
    restored = ROUND_TRIPS[how](original)
    assert isinstance(restored, jmp_lab.DynamicLossScale)
    for name in DYNAMIC_FIELDS:
      chex.assert_trees_all_equal(np.asarray(getattr(restored, name)),
                                  np.asarray(getattr(original, name)))

  def test_dynamic_round_trip_through_sharding(self):
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, P())
    original = nondefault_dynamic()
    restored = jax.device_put(original, sharding)
    assert_same_fields(restored, original, DYNAMIC_FIELDS[2:])
    chex.assert_trees_all_equal(restored.loss_scale, original.loss_scale)
    assert restored.loss_scale.sharding == sharding

  def test_min_loss_scale_survives_jit_and_is_respected(self):
    # jmp drops min_loss_scale on flatten, so under jit the floor was lost.
    loss_scale = jmp_lab.DynamicLossScale(loss_scale=8.0, min_loss_scale=4.0)
    adjust = jax.jit(lambda s: s.adjust(jnp.array(False)))
    for _ in range(5):
      loss_scale = adjust(loss_scale)
    assert loss_scale.min_loss_scale == 4.0
    chex.assert_trees_all_equal(loss_scale.loss_scale, jnp.float32(4.0))

  def test_static_round_trip(self):
    original = jmp_lab.StaticLossScale(3.0)
    for how in ("flatten_unflatten", "jit_identity", "device_put"):
      chex.assert_trees_all_equal(ROUND_TRIPS[how](original).loss_scale,
                                  jnp.float32(3.0))

  def test_leaves_have_named_paths(self):
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(nondefault_dynamic())[0]]
    assert paths == [".loss_scale", ".counter"]

  def test_orbax_checkpoint_round_trip(self):
    tmp_path = pathlib.Path(self.enter_context(tempfile.TemporaryDirectory()))
    ocp = pytest.importorskip("orbax.checkpoint")
    original = {"scale": nondefault_dynamic(), "step": jnp.int32(11)}
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(tmp_path / "ckpt", original)
      checkpointer.wait_until_finished()
      target = jax.tree_util.tree_map(jnp.zeros_like, original)
      restored = checkpointer.restore(tmp_path / "ckpt", target)
    for name in DYNAMIC_FIELDS:
      chex.assert_trees_all_equal(np.asarray(getattr(restored["scale"], name)),
                                  np.asarray(getattr(original["scale"], name)))

  @settings(max_examples=40)
  @given(configs, st.lists(st.booleans(), min_size=32, max_size=32))
  def test_dynamic_matches_gradscaler_model(self, config, finite_flags):
    loss_scale = jmp_lab.DynamicLossScale(**config)
    model = GradScalerModel(config["loss_scale"], config["growth_interval"],
                            config["growth_factor"], config["backoff_factor"],
                            config["min_loss_scale"], config["max_loss_scale"])

    @jax.jit
    def run(loss_scale, flags):
      def body(s, finite):
        s = s.adjust(finite)
        return s, (s.loss_scale, s.counter)
      return jax.lax.scan(body, loss_scale, flags)[1]

    scales, counters = run(loss_scale, jnp.array(finite_flags))
    for i, finite in enumerate(finite_flags):
      model.step(finite)
      assert float(scales[i]) == model.scale, (i, finite_flags[: i + 1])
      assert int(counters[i]) == model.counter
      assert config["min_loss_scale"] <= float(scales[i]) <= config["max_loss_scale"]

  @parameterized.parameters(*[
      (2.0**24, True, 2.0**24),    # at max: stays, even on a growth step
      (1.0, False, 1.0),           # at min: stays
      (3.0e38, True, 3.0e38),      # max=inf but growth would overflow f32
  ])
  def test_clamping(self, start, finite, expected):
    max_scale = math.inf if start > 2.0**24 else 2.0**24
    loss_scale = jmp_lab.DynamicLossScale(start, growth_interval=1,
                                          max_loss_scale=max_scale)
    adjusted = loss_scale.adjust(jnp.array(finite))
    assert float(adjusted.loss_scale) == np.float32(expected)

  @parameterized.product(value=[0.0, -1.0, math.nan, math.inf], cls=[jmp_lab.StaticLossScale, jmp_lab.DynamicLossScale])
  def test_non_positive_or_non_finite_scale_raises(self, cls, value):
    with pytest.raises(ValueError, match="loss_scale"):
      cls(value)

  @parameterized.parameters(*[
      ({"growth_interval": 0}, "growth_interval must be >= 1, got 0"),
      ({"growth_interval": -3}, "growth_interval"),
      ({"growth_interval": 2.5}, "growth_interval must be an integer"),
      ({"growth_factor": 1.0}, "growth_factor must be > 1, got 1.0"),
      ({"growth_factor": 0.5}, "growth_factor"),
      ({"backoff_factor": 0.0}, r"backoff_factor must be in \(0, 1\), got 0.0"),
      ({"backoff_factor": 1.0}, "backoff_factor"),
      ({"backoff_factor": 1.5}, "backoff_factor"),
      ({"min_loss_scale": 8.0, "max_loss_scale": 4.0, "loss_scale": 4.0},
       "min_loss_scale 8.0 is greater than max_loss_scale 4.0"),
      ({"min_loss_scale": 0.0}, "min_loss_scale"),
      ({"loss_scale": 2.0**30}, "outside"),
  ])
  def test_bad_dynamic_config_raises(self, kwargs, match):
    with pytest.raises(ValueError, match=match):
      jmp_lab.DynamicLossScale(**kwargs)

  def test_non_scalar_scale_raises(self):
    with pytest.raises(ValueError, match="scalar"):
      jmp_lab.StaticLossScale(jnp.ones(2))

  @parameterized.product(bad=[jnp.ones(()), jnp.array([True, False]), 1])
  def test_adjust_rejects_non_bool_flags(self, bad):
    with pytest.raises(TypeError, match="scalar bool"):
      jmp_lab.DynamicLossScale().adjust(bad)


# --- float(loss_scale): the current scale ---------------------------------------


@pytest.mark.parametrize("make, expected", [
    (lambda: jmp_lab.NoOpLossScale(), 1.0),
    (lambda: jmp_lab.StaticLossScale(1024.0), 1024.0),
    (lambda: jmp_lab.DynamicLossScale(2.0**15), 2.0**15),
    # after an overflow: the scale it backed off to
    (lambda: jmp_lab.DynamicLossScale(2.0**15).adjust(jnp.array(False)), 2.0**14),
    (lambda: jmp_compat.NoOpLossScale(), 1.0),
    (lambda: jmp_compat.StaticLossScale(8.0), 8.0),
    (lambda: jmp_compat.DynamicLossScale(jnp.float32(2.0**10)), 2.0**10),
])
def test_float_of_a_loss_scale_is_its_current_scale(make, expected):
  """Before: TypeError (float() argument must be ... not 'DynamicLossScale')."""
  value = float(make())
  assert type(value) is float and value == expected


def test_float_of_a_train_states_loss_scale():
  import flax.linen as nn
  import optax
  model = jmp_lab.linen.with_policy(nn.Dense(3), "mixed_float16")
  params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
  state = jmp_lab.TrainState.create(
      apply_fn=model.apply, params=params,
      tx=jmp_lab.mixed_precision(optax.sgd(0.1), policy="mixed_float16"))
  assert float(state.loss_scale) == 2.0**15   # the dynamic default


def test_float_of_a_traced_loss_scale_says_to_use_the_array():
  with pytest.raises(TypeError, match=r"traced DynamicLossScale.*\.loss_scale"):
    jax.jit(float)(jmp_lab.DynamicLossScale())
