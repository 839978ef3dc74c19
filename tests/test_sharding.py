"""Data parallel and ZeRO-1 on the two CPU devices of the test set-up."""

import pathlib
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jmp_lab
from jmp_lab import linen as jl
from jmp_lab import sharding

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POLICY = "p=bf16,c=bf16,o=f32"


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.LayerNorm()(nn.relu(nn.Dense(64)(x)))
    return nn.Dense(10)(x)


def loss_fn(params, state, batch):
  logits = state.apply_fn({"params": params}, batch["x"])
  return jl.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_state(optimizer):
  model = jl.with_policy(MLP(), POLICY)
  params = model.init(jax.random.key(0), jnp.ones((1, 32)))["params"]
  loss_scale = jmp_lab.DynamicLossScale(2.0**10)
  tx = (jmp_lab.mixed_precision(optax.adamw(1e-2), policy=POLICY,
                                loss_scale=loss_scale)
        if optimizer == "mixed_precision" else
        jmp_lab.fused_adamw(1e-2, policy=POLICY, loss_scale=loss_scale,
                            backend=optimizer.split("-")[1]))
  return jmp_lab.TrainState.create(apply_fn=model.apply, params=params,
                                   tx=tx, policy=POLICY)


def batches(n, poison_at=()):
  rng = np.random.default_rng(0)
  for i in range(n):
    x = rng.normal(size=(16, 32)).astype(np.float32)
    if i in poison_at:
      x[11, 3] = np.inf  # in the second device's half of the batch
    yield {"x": x, "y": rng.integers(0, 10, 16).astype(np.int32)}


@pytest.mark.parametrize("optimizer", ["mixed_precision", "fused_adamw-reference"])
@pytest.mark.parametrize("zero1", [False, True])
def test_data_parallel_and_zero1_equal_the_single_device_run(optimizer, zero1):
  """6 steps, one with an inf on one device only: both devices skip it, the
  state stays in its layout, and the result equals one device's run to the
  rounding of the gradient sum's order. (The Pallas kernels under ZeRO-1:
  test_zero1_fused_kernels_clip_and_skip_over_the_whole_model.)"""
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  single = make_state(optimizer)
  single_step = jmp_lab.make_train_step(loss_fn, donate=False)
  state = make_state(optimizer)
  layout = sharding.state_shardings(state, mesh, shard_optimizer_state=zero1)
  state = jax.device_put(state, layout)
  step = jmp_lab.make_train_step(
      loss_fn, state_sharding=layout,
      batch_sharding=NamedSharding(mesh, P("data")))
  for batch in batches(6, poison_at=(3,)):
    single, _ = single_step(single, batch)
    state, metrics = step(state, batch)
  assert int(state.skipped_steps) == 1 == int(single.skipped_steps)
  chex.assert_trees_all_close(
      jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), state.params),
      jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), single.params),
      rtol=1e-2, atol=1e-3)
  # Adam's steps (lr 1e-2) divide by the gradients' own scale, so bf16
  # gradients summed in another order move the master by a few % of a step.
  chex.assert_trees_all_close(state.master_params, single.master_params,
                              rtol=1e-2, atol=5e-4)
  master = jmp_lab.master_params(state.opt_state)["Dense_0"]["kernel"]
  assert master.sharding.spec == (P("data") if zero1 else P())
  assert state.params["Dense_0"]["kernel"].sharding.spec == P()
  full = sharding.bytes_per_device(single.opt_state)
  per_device = sharding.bytes_per_device(state.opt_state)
  # 1/2 of the optimizer state per device, give or take the scalars and the
  # odd-sized leaves (the 10-wide bias is split; nothing here is odd).
  assert per_device == pytest.approx(full / 2 if zero1 else full, rel=0.01)



def test_zero1_fp8_scaling_state_equals_the_single_device_run():
  """Under ZeRO-1 on 2 devices the fp8 step observes each tensor's amax over
  the whole batch (both halves), updates the scaling state once, replicated,
  and keeps it on the step that one device's inf makes non-finite: from the
  same params, histories and scales equal one device's run bit for bit (a
  max does not depend on the order); after, to the rounding of the gradient
  sum's order, as the params do."""
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))

  def fp8_state():
    model = jl.with_policy(MLP(), "mixed_fp8", fp8_history_length=4)
    variables = model.init(jax.random.key(0), jnp.ones((1, 32)))
    return jmp_lab.TrainState.create(
        apply_fn=model.apply, params=variables["params"], policy="mixed_fp8",
        model_state={k: v for k, v in variables.items() if k != "params"},
        tx=jmp_lab.mixed_precision(optax.adamw(1e-2), policy="mixed_fp8"))

  def fp8_loss(params, state, batch):
    logits = state.apply_fn({"params": params, **state.model_state}, batch["x"])
    return jl.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  single = fp8_state()
  single_step = jmp_lab.make_train_step(fp8_loss, donate=False)
  state = fp8_state()
  layout = sharding.state_shardings(state, mesh, shard_optimizer_state=True)
  state = jax.device_put(state, layout)
  step = jmp_lab.make_train_step(
      fp8_loss, state_sharding=layout,
      batch_sharding=NamedSharding(mesh, P("data")))
  metas, single_metas = [], []
  for batch in batches(6, poison_at=(3,)):
    single, _ = single_step(single, batch)
    state, _ = step(state, batch)
    metas.append(jax.device_get(state.model_state))
    single_metas.append(jax.device_get(single.model_state))
  assert int(state.skipped_steps) == 1 == int(single.skipped_steps)
  chex.assert_trees_all_equal(metas[3], metas[2])  # kept on the skipped step
  # From the same params, the same amaxes bit for bit: the first step's.
  chex.assert_trees_all_equal(metas[0], single_metas[0])
  # Later steps start from params that differ by the gradient sum's
  # rounding, which can move an activation's amax by one bf16 step.
  chex.assert_trees_all_close(jax.device_get(state.model_state),
                              jax.device_get(single.model_state), rtol=1e-2)
  history = state.model_state["_overwrite_with_gradient"]["Dense_0"][
      "Fp8DotGeneral_0"]["input_amax_history"]
  assert np.count_nonzero(np.asarray(history)) == 4  # 5 applied steps, ring of 4
  # The weight gradients are sums over the batch in another order (each
  # device's half, then across devices), and AdamW turns a gradient near
  # zero whose rounding differs into up to half a step of lr = 1e-2.
  chex.assert_trees_all_close(state.master_params, single.master_params,
                              rtol=1e-2, atol=5e-3)


class OddMLP(nn.Module):
  """A 31 x 7 layer: its params split over no device count above 1, so
  under ZeRO-1 they stay whole on every device beside the split leaves."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(nn.relu(nn.Dense(7)(x[:, :31])))


@pytest.mark.parametrize("lean", [{}, {"master": "none", "rounding": "stochastic"}],
                         ids=["fp32-master", "stochastic"])
def test_zero1_fused_kernels_clip_and_skip_over_the_whole_model(lean):
  """ZeRO-1 with the multi-tensor kernels (interpret) on 2 devices, clipping
  active and an inf on one device: the clip norm sums every shard once
  (split leaves over the devices, the whole 31 x 7 layer once), the skip is
  global, and the run equals one device's. Stochastic rounding keeps the
  leaves whole (its bits depend on the element's index in its leaf), and
  its run equals one device's too."""
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  model = jl.with_policy(OddMLP(), POLICY)

  def make():
    params = model.init(jax.random.key(0), jnp.ones((1, 32)))["params"]
    tx = jmp_lab.fused_adamw(1e-2, policy=POLICY, max_grad_norm=0.05,
                             loss_scale=jmp_lab.DynamicLossScale(2.0**10),
                             backend="interpret", **lean)
    return jmp_lab.TrainState.create(apply_fn=model.apply, params=params,
                                     tx=tx, policy=POLICY)

  single, state = make(), make()
  single_step = jmp_lab.make_train_step(loss_fn, donate=False)
  layout = sharding.state_shardings(state, mesh)
  state = jax.device_put(state, layout)
  step = jmp_lab.make_train_step(loss_fn, state_sharding=layout,
                                 batch_sharding=NamedSharding(mesh, P("data")))
  for batch in batches(4, poison_at=(2,)):
    single, _ = single_step(single, batch)
    state, _ = step(state, batch)
  assert int(state.skipped_steps) == 1 == int(single.skipped_steps)
  mu = jmp_lab.state.find_state(state.opt_state).mu
  # (Dense_0 is the 10-wide layer: flax names modules as they are built.)
  assert mu["Dense_0"]["kernel"].sharding.spec == P(None, "data")
  assert mu["Dense_1"]["kernel"].sharding.spec == P()
  chex.assert_trees_all_close(
      jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), state.params),
      jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), single.params),
      rtol=1e-2, atol=1e-3)
  # Adam's step hardly sees a global clip factor (m / sqrt(v) cancels it);
  # the first moment is the clipped gradients' average, so it shows one.
  chex.assert_trees_all_close(mu, jmp_lab.state.find_state(single.opt_state).mu,
                              rtol=1e-2, atol=1e-5)


def test_bad_layouts_are_refused():
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  state = make_state("mixed_precision")
  with pytest.raises(ValueError, match="axis_name 'batch' is not an axis.*'data'"):
    sharding.state_shardings(state, mesh, "batch")
  with pytest.raises(TypeError, match="must be a jmp_lab.TrainState"):
    sharding.state_shardings(state.opt_state, mesh)
  with pytest.raises(ValueError, match="give both state_sharding and batch_sharding"):
    jmp_lab.make_train_step(loss_fn, state_sharding=sharding.state_shardings(
        state, mesh))


def test_zero1_step_reduce_scatters_and_all_gathers_on_8_h100s():
  """Compiled for 8 H100s: with the optimizer state split, the gradients are
  reduce-scattered into each device's rows and the new params all-gathered;
  replicated, they are all-reduced."""
  from benchmarks import train_step
  size = train_step.ModelSize(layers=1, width=256, heads=4, seq_len=128,
                              vocab=4096, batch=8)
  config = next(c for c in train_step.CONFIGS if c.name == "bf16-o2")
  state = jax.eval_shape(lambda: train_step.make_state(config, size))
  kinds = {zero1: train_step.compiled_step_report(
      config, size, "h100", devices=8, zero1=zero1).collective_bytes()
           for zero1 in (False, True)}
  print(kinds)
  total = lambda moved, kind: sum(v for k, v in moved.items()  # noqa: E731
                                  if k.startswith(kind))
  replicated, zero1 = kinds[False], kinds[True]
  assert total(replicated, "reduce-scatter") == total(replicated, "all-gather") == 0
  # Every gradient byte that was all-reduced is now reduce-scattered...
  assert total(zero1, "reduce-scatter") == pytest.approx(
      total(replicated, "all-reduce"), rel=0.01)
  assert total(zero1, "all-reduce") < 100  # the finite flag and the loss
  # ... and each device all-gathers the others' new bf16 params from its
  # own 1/8 (the operand counted is the shard).
  params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
  assert total(zero1, "all-gather") == pytest.approx(2 * params / 8, rel=0.01)



def test_zero1_default_fused_kernels_run_on_each_devices_shards_on_8_h100s():
  """The default fused_adamw (tree layout, multi-tensor Triton kernels)
  under jit with the state split over 8 H100s: each device runs the kernels
  on its own shards, so the gradients are reduce-scattered and only the new
  bf16 params all-gathered; the fp32 state is never gathered (before
  jmp_lab.kernels.partitioned it was, every step)."""
  from benchmarks import train_step
  size = train_step.ModelSize(layers=1, width=256, heads=4, seq_len=128,
                              vocab=4096, batch=8)
  config = next(c for c in train_step.CONFIGS if c.name == "bf16-o2+fused")
  state = jax.eval_shape(lambda: train_step.make_state(config, size))
  report = train_step.compiled_step_report(config, size, "h100", devices=8,
                                           zero1=True)
  moved = report.collective_bytes()
  print(moved, report.pallas_summary())
  params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
  assert not any(k.startswith("all-gather f32") for k in moved), moved
  assert moved["all-gather bf16"] == pytest.approx(2 * params / 8, rel=0.01)
  assert moved["reduce-scatter bf16"] == pytest.approx(2 * params, rel=0.01)
  assert not any(k.startswith("all-reduce bf16") for k in moved), moved
  kernels = report.pallas_kernels
  assert {k.name for k in kernels} == {"jmp_lab_grad_stats",
                                       "jmp_lab_multi_tensor_adamw"}, kernels
  assert all(k.spill_bytes == 0 for k in kernels), kernels

# --- the fused update, sharded by rows (ZeRO-1 inside shard_map) ---------------


@pytest.mark.parametrize("spec,backend,moments", [
    (POLICY, "reference", "float32"), (POLICY, "interpret", "float32"),
    ("mixed_bfloat16", "reference", "float32"),
    ("mixed_bfloat16", "interpret", "float32"),
    # 8-bit moments: a row of the buffers is a quantization block, and
    # every device quantizes its own rows
    (POLICY, "reference", "int8"), (POLICY, "interpret", "float8_e4m3fn")])
def test_sharded_fused_update_equals_the_single_device_update(spec, backend,
                                                              moments):
  """Each device reduce-scatters its own gradients into its rows, updates
  them and all-gathers the params: the same as one device updating
  everything from the gradient of the whole batch, with the finite flag
  (an inf on device 1 only) and the clip norm (clipping active) global."""
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  model = jl.with_policy(MLP(), spec)
  params = model.init(jax.random.key(0), jnp.ones((1, 32)))["params"]
  params = jmp_lab.get_policy(spec).cast_to_param(params)
  options = dict(policy=spec, backend=backend, layout="flat", max_grad_norm=0.5,
                 loss_scale=jmp_lab.DynamicLossScale(2.0**10),
                 mu_dtype=moments, nu_dtype=moments)
  single = jmp_lab.fused_adamw(1e-2, **options)
  sharded = jmp_lab.fused_adamw(1e-2, axis_name="data", shards=2, **options)

  def scaled_grads(params, state, batch):
    scale = jmp_lab.current_loss_scale(state).loss_scale
    return jax.grad(lambda p: loss_fn(p, model_state, batch).astype(
        jnp.float32) * scale)(params)

  model_state = type("S", (), {"apply_fn": staticmethod(model.apply),
                               "model_state": {}})()
  state_specs = jax.tree_util.tree_map(
      lambda s: s.spec, sharding.optimizer_state_shardings(
          jax.eval_shape(sharded.init, params), mesh))

  def local_step(params, state, batch):
    return sharded.update.new_params(
        jmp_lab.ScaledGradients(scaled_grads(params, state, batch)), state,
        params)

  sharded_step = jax.jit(jax.shard_map(
      local_step, mesh=mesh, in_specs=(P(), state_specs, P("data")),
      out_specs=(P(), state_specs),
      # jax 0.10 cannot mark the all-gathered params replicated.
      check_vma=hasattr(jax.lax, "all_gather_invariant")))
  single_step = jax.jit(lambda params, state, batch: single.update.new_params(
      jmp_lab.ScaledGradients(scaled_grads(params, state, batch)), state,
      params))
  a, a_state = params, single.init(params)
  b, b_state = params, sharded.init(params)
  assert b_state.mu.shape[0] % 2 == 0
  assert isinstance(b_state.mu, jmp_lab.state.QuantizedMoment) == (
      moments != "float32")
  for batch in batches(5, poison_at=(2,)):
    a, a_state = single_step(a, a_state, batch)
    b, b_state = sharded_step(b, b_state, batch)
  assert int(b_state.skipped_steps) == int(a_state.skipped_steps) == 1
  codes = getattr(b_state.mu, "codes", b_state.mu)
  assert codes.sharding.spec == P("data")
  if moments != "float32":
    assert b_state.nu.scales.sharding.spec == P("data")
  f32 = lambda t: jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), t)  # noqa: E731
  # Gradients summed in another order (the shards') can flip the sign of an
  # element's near-zero Adam direction: one step of lr = 1e-2 apart (one of
  # 2,048 elements by 0.0098 in the params, 0.0100 in the master, on jax
  # 0.12). Every other element agrees to 5e-4.
  one_step = dict(rtol=1e-2, atol=1e-2)
  chex.assert_trees_all_close(f32(b), f32(a), **one_step)
  if jmp_lab.master_params(a_state) is not None:
    chex.assert_trees_all_close(jmp_lab.master_params(b_state),
                                jmp_lab.master_params(a_state), **one_step)
    moved = jax.tree_util.tree_map(
        lambda x, y: int(np.sum(np.abs(x - y) > 5e-4 + 1e-2 * np.abs(y))),
        jmp_lab.master_params(b_state), jmp_lab.master_params(a_state))
    # (8-bit moments: such a flip can also move a code, and its block's
    # other elements a little)
    assert sum(jax.tree_util.tree_leaves(moved)) <= (
        2 if moments == "float32" else 64), moved


def test_sharded_fused_update_needs_flat_layout_and_an_axis():
  with pytest.raises(ValueError, match="shards=2.*needs layout='flat', an axis_name"):
    jmp_lab.fused_adamw(1e-3, policy=POLICY, shards=2,
                        loss_scale=jmp_lab.NoOpLossScale())
  with pytest.raises(ValueError, match="shards must be an int >= 1, got 0"):
    jmp_lab.fused_adamw(1e-3, policy=POLICY, shards=0, layout="flat",
                        axis_name="data", loss_scale=jmp_lab.NoOpLossScale())


def test_sharded_fused_update_compiles_for_8_h100s_as_one_kernel_per_device():
  """shard_map over 8 H100s, reduce=float32: the flat gradient is
  reduce-scattered in f32 into each device's rows, one Triton kernel updates
  them (no spills), and the new bf16 params are all-gathered; no gradient is
  all-reduced."""
  from benchmarks import train_step
  from jmp_lab.diagnostics import compiled
  size = train_step.ModelSize(layers=1, width=256, heads=4, seq_len=128,
                              vocab=4096, batch=8)
  policy = jmp_lab.get_policy("p=bf16,c=bf16,o=f32,reduce=float32")
  model = jl.with_policy(train_step.GPT(size), policy)
  params = jax.eval_shape(lambda: policy.cast_to_param(model.init(
      jax.random.key(0), jnp.zeros((1, size.seq_len), jnp.int32))["params"]))
  mesh = compiled.gpu_mesh("h100", 8)
  tx = jmp_lab.fused_adamw(3e-4, policy=policy, loss_scale=jmp_lab.NoOpLossScale(),
                           layout="flat", axis_name="data", shards=8,
                           backend="triton")
  state = jax.eval_shape(tx.init, params)
  specs = jax.tree_util.tree_map(
      lambda s: s.spec, sharding.optimizer_state_shardings(state, mesh))

  def local(params, state, batch):
    grads = jax.grad(lambda p: train_step.loss_fn(
        p, type("S", (), {"apply_fn": staticmethod(model.apply),
                          "model_state": {}})(), batch))(params)
    return tx.update.new_params(grads, state, params)

  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P("data")),
                               out_specs=(P(), specs), check_vma=False),
                 donate_argnums=(0, 1))
  batch = jax.ShapeDtypeStruct((8 * size.batch, size.seq_len + 1), jnp.int32)
  report = compiled.compiled_report(step, params, state, batch, devices=8,
                                    in_specs=(P(), specs, P("data")))
  moved = report.collective_bytes()
  print(moved, report.pallas_summary())
  rows = state.mu.shape[0]
  assert moved["reduce-scatter f32"] == rows * 256 * 4
  assert moved["all-gather bf16"] == rows * 256 * 2 // 8
  assert not any(k.startswith("all-reduce") and v > 16 for k, v in moved.items())
  (kernel,) = report.pallas_kernels
  assert kernel.backend == "triton" and kernel.spill_bytes == 0
