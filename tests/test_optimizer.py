"""Tests for jmp_lab.mixed_precision: master weights, skipping, exactness,
composition with optax, and bad input."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import parameterized
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jmp_lab
from conftest import FLOAT0, params_of, scaled_grads_like, tree_bits_equal



class StateTest(chex.TestCase):

  def test_fp32_params_are_the_master(self):
    tx = jmp_lab.mixed_precision(optax.adam(1e-3), policy="float32",
                                 loss_scale=jmp_lab.NoOpLossScale())
    state = tx.init(params_of(jnp.float32))
    assert state.master_params is None
    assert jmp_lab.master_params(state) is None

  @parameterized.parameters(jnp.bfloat16, jnp.float16)
  def test_half_params_get_an_fp32_master(self, dtype):
    policy = jmp_lab.Policy(dtype, dtype, jnp.float32)
    params = params_of(dtype)
    tx = jmp_lab.mixed_precision(optax.adam(1e-3), policy=policy,
                                 loss_scale=jmp_lab.DynamicLossScale())
    state = tx.init(params)
    master = jmp_lab.master_params(state)
    chex.assert_trees_all_equal_structs(master, params)
    chex.assert_type(jax.tree_util.tree_leaves(master), jnp.float32)
    tree_bits_equal(jax.tree_util.tree_map(lambda m: m.astype(dtype), master),
                    params)
    chex.assert_type(state.skipped_steps, jnp.int32)

  def test_tree_get_finds_fields_inside_chain(self):
    mp = jmp_lab.mixed_precision(optax.adam(1e-3), policy="p=bf16",
                                 loss_scale=jmp_lab.DynamicLossScale(64.0))
    tx = optax.chain(mp, optax.identity())
    state = tx.init(params_of(jnp.bfloat16))
    loss_scale = optax.tree_utils.tree_get(state, "loss_scale")
    assert isinstance(loss_scale, jmp_lab.DynamicLossScale)
    chex.assert_trees_all_equal(loss_scale.loss_scale, jnp.float32(64.0))
    chex.assert_trees_all_equal(
        optax.tree_utils.tree_get(state, "skipped_steps"), jnp.int32(0))
    assert jmp_lab.master_params(state) is not None

  def test_master_params_on_foreign_state_raises(self):
    with pytest.raises(ValueError, match="exactly one"):
      jmp_lab.master_params(optax.adam(1e-3).init(params_of(jnp.float32)))

  def test_one_optimizer_per_group_names_the_fix(self):
    """``optax.multi_transform`` around jmp_lab optimizers keeps a loss
    scale and a skip decision per group; asking for the one loss scale
    says to put the combinator inside."""
    params = params_of(jnp.float32)
    leaves, treedef = jax.tree.flatten(params)
    assert len(leaves) >= 2
    labels = treedef.unflatten(["b"] + ["a"] * (len(leaves) - 1))
    tx = optax.multi_transform(
        {"a": jmp_lab.mixed_precision(optax.sgd(0.1), policy="mixed_float16"),
         "b": jmp_lab.mixed_precision(optax.sgd(0.1), policy="mixed_float16")},
        labels)
    with pytest.raises(ValueError, match=r"found 2 .*Put a combinator of "
                       r"several optimizers inside it: jmp_lab.mixed_precision"
                       r"\(optax.multi_transform"):
      jmp_lab.current_loss_scale(tx.init(params))


class SkipTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("float32", "p=bf16,c=bf16,o=f32", "p=f16,c=f16")
  def test_non_finite_step_changes_only_scale_and_counter(self, spec):
    policy = jmp_lab.get_policy(spec)
    params = params_of(policy.param_dtype)
    tx = jmp_lab.mixed_precision(
        optax.adamw(optax.linear_schedule(1e-2, 0.0, 100)), policy=policy,
        loss_scale=jmp_lab.DynamicLossScale(2.0**10, growth_interval=1))
    update = self.variant(tx.update)
    state = tx.init(params)
    grads = jmp_lab.ScaledGradients(scaled_grads_like(params, 2.0**10, key=1))
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    scale_before = float(state.loss_scale.loss_scale)

    bad = jax.tree_util.tree_map(lambda g: g.at[0].set(jnp.nan), grads)
    updates, new_state = update(bad, state, params)
    tree_bits_equal(optax.apply_updates(params, updates), params)
    tree_bits_equal(new_state.inner_state, state.inner_state)
    tree_bits_equal(new_state.master_params, state.master_params)
    assert int(new_state.skipped_steps) == int(state.skipped_steps) + 1
    assert float(new_state.loss_scale.loss_scale) == scale_before / 2
    # The schedule did not advance: adam's count is still 1.
    counts = optax.tree_utils.tree_get_all_with_path(new_state, "count")
    assert [int(c) for _, c in counts] == [1, 1]

  def test_schedule_does_not_advance_on_skipped_steps(self):
    lrs = []
    schedule = lambda count: jnp.where(count == 0, 1.0, 100.0)  # noqa: E731
    tx = jmp_lab.mixed_precision(
        optax.sgd(schedule), policy="float32",
        loss_scale=jmp_lab.DynamicLossScale(4.0))
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    for g in ([jnp.inf, 0.0], [jnp.nan, 1.0], [4.0, 8.0]):  # two skips, one step
      updates, state = tx.update(jmp_lab.ScaledGradients({"w": jnp.array(g)}),
                                 state, params)
      lrs.append(updates["w"])
    # The first applied step used count == 0, i.e. lr 1.0; scale is 4/2/2 = 1.
    chex.assert_trees_all_close(lrs[-1], jnp.array([-4.0, -8.0]))
    chex.assert_trees_all_equal(lrs[0], jnp.zeros(2))


class ExactnessTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(jnp.bfloat16, jnp.float16)
  def test_params_equal_cast_master_every_step(self, dtype):
    """Params near zero that change sign, many steps, bit for bit."""
    policy = jmp_lab.Policy(dtype, dtype, jnp.float32)
    params = {"w": jnp.linspace(-1e-3, 1e-3, 4001).astype(dtype),
              "v": (jax.random.normal(jax.random.key(0), (257,)) * 1e-5
                    ).astype(dtype)}
    tx = jmp_lab.mixed_precision(
        optax.adam(3e-4), policy=policy,
        loss_scale=jmp_lab.DynamicLossScale(2.0**8, growth_interval=10))
    state = tx.init(params)
    update = self.variant(tx.update)
    signs_flipped = 0
    for step in range(60):
      grads = jax.tree_util.tree_map(
          lambda p: (jnp.sign(p.astype(jnp.float32) + 1e-4) * 2.0**8
                     * (1 + 0.1 * jnp.sin(step + jnp.arange(p.size)))
                     ).astype(dtype), params)
      updates, state = update(jmp_lab.ScaledGradients(grads), state, params)
      new_params = optax.apply_updates(params, updates)
      master = jmp_lab.master_params(state)
      tree_bits_equal(new_params,
                      jax.tree_util.tree_map(lambda m: m.astype(dtype), master))
      signs_flipped += int(jnp.sum(jnp.sign(new_params["w"]) != jnp.sign(params["w"])))
      params = new_params
    assert signs_flipped > 100  # the test really crossed zero

  @parameterized.parameters(
      (jnp.bfloat16, 0.9999979138374329, -1.0000008344650269),
      (jnp.float16, 0.9999979138374329, -1.0000430345535278))
  def test_exact_when_a_param_crosses_zero_from_a_binade_edge(
      self, dtype, m_old, delta):
    # The master sits just below 1.0 (the half param reads 1.0) and the step
    # lands it near zero: u = cast(m) - p rounds in fp32 and p + u alone does
    # not reach cast(m). (Values found by a numerical search.)
    params = {"w": jnp.array([1.0], dtype)}
    tx = jmp_lab.mixed_precision(
        scripted_updates([m_old - 1.0, delta]),
        policy=jmp_lab.Policy(dtype, dtype, jnp.float32),
        loss_scale=jmp_lab.NoOpLossScale())
    state = tx.init(params)
    grads = {"w": jnp.zeros(1, dtype)}
    for _ in range(2):
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      master = jmp_lab.master_params(state)
      tree_bits_equal(params, {"w": master["w"].astype(dtype)})
    assert -1e-4 < float(params["w"][0]) < 0


def scripted_updates(deltas):
  """An inner transformation that returns the given fp32 updates in turn."""
  deltas = jnp.array(deltas, jnp.float32)

  def update(grads, count, params=None):
    del params
    return jax.tree_util.tree_map(
        lambda g: jnp.full(g.shape, deltas[count]), grads), count + 1

  return optax.GradientTransformation(
      lambda params: jnp.zeros((), jnp.int32), update)


class CompositionTest(chex.TestCase):

  def test_matches_plain_optax_in_fp32(self):
    params = params_of(jnp.float32)
    inner = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2))
    tx = jmp_lab.mixed_precision(inner, policy="float32",
                                 loss_scale=jmp_lab.StaticLossScale(2.0**12))
    state, ref_state = tx.init(params), inner.init(params)
    ref_params = params
    for step in range(20):
      grads = scaled_grads_like(params, 1.0, key=step)
      updates, state = tx.update(jmp_lab.ScaledGradients(
          jax.tree_util.tree_map(lambda g: g * 2.0**12, grads)), state, params)
      params = optax.apply_updates(params, updates)
      ref_updates, ref_state = inner.update(grads, ref_state, ref_params)
      ref_params = optax.apply_updates(ref_params, ref_updates)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-6)

  def test_clip_sees_unscaled_gradients(self):
    tx = jmp_lab.mixed_precision(
        optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)),
        policy="float32", loss_scale=jmp_lab.StaticLossScale(2.0**15))
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    grads = {"w": jnp.array([0.3, 0.4]) * 2.0**15}  # unscaled norm 0.5
    updates, _ = tx.update(jmp_lab.ScaledGradients(grads), state, params)
    chex.assert_trees_all_close(updates["w"], -jnp.array([0.3, 0.4]))

  def test_inject_hyperparams_changes_lr_without_recompiling(self):
    traces = []
    tx = jmp_lab.mixed_precision(
        optax.inject_hyperparams(optax.sgd)(learning_rate=1.0),
        policy="p=bf16", loss_scale=jmp_lab.StaticLossScale(1.0))

    @jax.jit
    def step(params, state):
      traces.append(None)
      updates, state = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state,
                                 params)
      return optax.apply_updates(params, updates), state

    params = {"w": jnp.zeros(2, jnp.bfloat16)}
    state = tx.init(params)
    params, state = step(params, state)
    state = optax.tree_utils.tree_set(state, learning_rate=jnp.float32(0.25))
    params, state = step(params, state)
    assert len(traces) == 1
    chex.assert_trees_all_close(params["w"].astype(jnp.float32),
                                jnp.full(2, -1.25))

  def test_multisteps_inside_accumulates_unscaled_grads(self):
    """The scale may change inside a window; a non-finite micro-batch is
    dropped and the window waits for another finite one."""
    k = 3
    tx = jmp_lab.mixed_precision(
        optax.MultiSteps(optax.sgd(1.0), every_k_schedule=k),
        policy="p=f16,c=f16", loss_scale=jmp_lab.DynamicLossScale(
            2.0**4, growth_interval=1))
    params = {"w": jnp.zeros(2, jnp.float16)}
    state = tx.init(params)
    micro = [jnp.array([1.0, 2.0]), None, jnp.array([3.0, 4.0]),
             jnp.array([5.0, 6.0])]
    applied = []
    for g in micro:
      scale = state.loss_scale.loss_scale
      grads = ({"w": jnp.array([jnp.inf, 0.0], jnp.float16)} if g is None
               else {"w": (g * scale).astype(jnp.float16)})
      updates, state = tx.update(jmp_lab.ScaledGradients(grads), state, params)
      params = optax.apply_updates(params, updates)
      applied.append(params["w"])
    # Scales went 16 -> 32 (grow) -> 16 (overflow) -> 32 -> 64 across the window.
    for before in applied[:3]:
      chex.assert_trees_all_equal(before, jnp.zeros(2, jnp.float16))
    chex.assert_trees_all_close(applied[3].astype(jnp.float32),
                                -jnp.array([3.0, 4.0]))  # mean of 3 finite
    assert int(state.skipped_steps) == 1


class IntegerLeavesTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("float32", "p=bf16")
  def test_integer_params_and_float0_grads_pass_through(self, spec):
    policy = jmp_lab.get_policy(spec)
    params = {"w": jnp.ones(3, policy.param_dtype), "n": jnp.int32(7)}
    tx = jmp_lab.mixed_precision(optax.adam(1e-2), policy=policy,
                                 loss_scale=jmp_lab.StaticLossScale(2.0))
    state = tx.init(params)
    grads = jmp_lab.ScaledGradients({"w": jnp.ones(3, policy.param_dtype),
                                     "n": np.zeros((), FLOAT0)})
    updates, state = self.variant(tx.update)(grads, state, params)
    new = optax.apply_updates(params, updates)
    chex.assert_trees_all_equal(new["n"], jnp.int32(7))
    assert float(new["w"][0]) < 1.0


class NoSyncAndShardingTest(chex.TestCase):

  def test_eager_update_needs_no_device_to_host_transfer(self):
    tx = jmp_lab.mixed_precision(optax.adam(1e-3), policy="p=bf16",
                                 loss_scale=jmp_lab.DynamicLossScale())
    params = params_of(jnp.bfloat16)
    state = tx.init(params)
    grads = jmp_lab.ScaledGradients(scaled_grads_like(params, 2.0**15, key=3))
    with jax.transfer_guard_device_to_host("disallow"):
      updates, state = tx.update(grads, state, params)
      optax.apply_updates(params, updates)

  def test_sharded_non_finite_on_one_device_skips_everywhere(self):
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    sharded = NamedSharding(mesh, P("data"))
    tx = jmp_lab.mixed_precision(optax.sgd(1.0), policy="p=bf16",
                                 loss_scale=jmp_lab.StaticLossScale(1.0))
    params = jax.device_put({"w": jnp.ones(4, jnp.bfloat16)}, sharded)
    state = tx.init(params)
    grads = jax.device_put(
        {"w": jnp.array([1, 1, 1, jnp.inf], jnp.bfloat16)}, sharded)
    updates, state = jax.jit(tx.update)(grads, state, params)
    tree_bits_equal(optax.apply_updates(params, updates), params)
    assert int(state.skipped_steps) == 1

  def test_shard_map_axis_name_combines_flags(self):
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    tx = jmp_lab.mixed_precision(optax.sgd(1.0), policy="float32",
                                 loss_scale=jmp_lab.NoOpLossScale(),
                                 axis_name="data")

    def per_device(grads, params):
      state = tx.init(params)
      updates, state = tx.update(grads, state, params)
      return updates, state.skipped_steps[None]

    updates, skipped = jax.jit(jax.shard_map(
        per_device, mesh=mesh, in_specs=(P("data"), P("data")),
        out_specs=(P("data"), P("data"))))(
            jnp.array([1.0, jnp.inf]), jnp.zeros(2))
    assert skipped.tolist() == [1, 1]
    chex.assert_trees_all_equal(updates, jnp.zeros(2))


class BadInputTest(chex.TestCase):

  def make(self, spec="p=bf16"):
    return jmp_lab.mixed_precision(optax.sgd(1.0), policy=spec,
                                   loss_scale=jmp_lab.NoOpLossScale())

  def test_params_in_wrong_dtype(self):
    with pytest.raises(ValueError, match=r"\['dense'\]\['b'\].*param_dtype is bfloat16"):
      self.make().init(params_of(jnp.float32))

  def test_grads_tree_does_not_match(self):
    tx = self.make()
    params = params_of(jnp.bfloat16)
    state = tx.init(params)
    grads = {"dense": {"w": params["dense"]["w"]}}
    with pytest.raises(ValueError, match=r"\['dense'\]\['b'\]"):
      tx.update(grads, state, params)

  def test_grad_dtype_differs_from_param(self):
    tx = self.make()
    params = params_of(jnp.bfloat16)
    state = tx.init(params)
    grads = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params)
    with pytest.raises(ValueError, match=r"\['dense'\]\['b'\] is float32.*bfloat16"):
      tx.update(grads, state, params)

  def test_grad_shape_differs(self):
    tx = self.make()
    params = params_of(jnp.bfloat16)
    state = tx.init(params)
    grads = jax.tree_util.tree_map(lambda p: p[:1], params)
    with pytest.raises(ValueError, match="shape"):
      tx.update(grads, state, params)

  def test_update_without_params(self):
    tx = self.make()
    params = params_of(jnp.bfloat16)
    with pytest.raises(ValueError, match="needs params"):
      tx.update(params, tx.init(params))

  def test_loss_scale_must_be_a_loss_scale(self):
    with pytest.raises(TypeError, match="loss_scale"):
      jmp_lab.mixed_precision(optax.sgd(1.0), policy="float32",
                              loss_scale=2.0**15)


class DonationTest(chex.TestCase):

  @parameterized.product(make_tx=[
      lambda ls: jmp_lab.mixed_precision(optax.adam(1e-3), policy="p=bf16",
                                         loss_scale=ls),
      lambda ls: jmp_lab.fused_adamw(1e-3, policy="p=bf16", loss_scale=ls),
  ])
  def test_donating_a_state_leaves_the_initial_loss_scale_intact(self, make_tx):
    # Regression: init used to put the caller's own loss-scale arrays in the
    # state, so donating one state broke every later init sharing them.
    loss_scale = jmp_lab.DynamicLossScale(2.0**8)
    tx = make_tx(loss_scale)
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    grads = jmp_lab.ScaledGradients({"w": jnp.ones(3, jnp.bfloat16)})
    step = jax.jit(tx.update, donate_argnums=1)
    step(grads, tx.init(params), params)
    state = tx.init(params)  # must not see deleted buffers
    step(grads, state, params)
    assert float(loss_scale.loss_scale) == 2.0**8
