"""Memory-lean masters of mixed_precision: remainder, none + rounding."""

import functools
import os
import pathlib
import subprocess
import sys

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings

import jmp_lab
from jmp_lab import remainder, rounding
from conftest import (CPU_COMPILE_FLAGS, EMITTER_FLAGS, FLOAT0,
                      run_under_xla_cpu_defaults)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tree_bits_equal(a, b) -> bool:
  """Whether two trees hold the same bit patterns (so -0.0 != 0.0)."""
  def bits(x):
    x = np.asarray(jax.random.key_data(x) if jnp.issubdtype(
        getattr(x, "dtype", None), jax.dtypes.prng_key) else x)
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind == "f" or (
        x.dtype == jnp.bfloat16) else x
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  return len(la) == len(lb) and all(
      np.asarray(x).dtype == np.asarray(y).dtype
      and np.array_equal(bits(x), bits(y)) for x, y in zip(la, lb))

BF16 = "p=bf16,c=bf16,o=f32"


def params_of(seed=0):
  rng = np.random.default_rng(seed)
  return {"a": jnp.asarray(rng.normal(size=(257,)), jnp.bfloat16),
          "step": jnp.int32(3),
          "w": jnp.asarray(rng.normal(size=(16, 24)) * 0.1, jnp.bfloat16)}


def grads_at(params, step, scale, poison=False):
  def leaf(x):
    if x.dtype != jnp.bfloat16:
      return np.zeros(x.shape, FLOAT0)
    g = jnp.sin(x.astype(jnp.float32) * (step + 1)) * scale
    return (g.at[0].set(jnp.inf) if poison else g).astype(x.dtype)
  return jax.tree_util.tree_map(leaf, params)


# LLVM's default level, which tests/conftest.py lowers for CI time: where a
# test compares two different programs bit for bit, which sums XLA:CPU
# contracts into FMAs depends on it.
PRODUCTION_LLVM = {"xla_backend_optimization_level": 3}


def train(tx, params, steps, poison_at=(), compiler_options=None):
  state = tx.init(params)

  @functools.partial(jax.jit, compiler_options=compiler_options)
  def step(params, state, i, poison):
    scale = jmp_lab.current_loss_scale(state).loss_scale
    grads = jax.lax.cond(poison, lambda: grads_at(params, i, scale, True),
                         lambda: grads_at(params, i, scale))
    updates, state = tx.update(jmp_lab.ScaledGradients(grads), state, params)
    return optax.apply_updates(params, updates), state

  for i in range(steps):
    params, state = step(params, state, i, i in poison_at)
  return params, state


def make(master="float32", rounding="nearest", lr=1e-3, policy=BF16, **kwargs):
  return jmp_lab.mixed_precision(
      optax.adamw(lr, weight_decay=0.1), policy=policy, master=master,
      rounding=rounding, loss_scale=jmp_lab.DynamicLossScale(2.0**12,
                                                             growth_interval=50),
      **kwargs)


# --- the remainder encoding --------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(hnp.arrays(np.uint32, (64,)))
def test_split_join_is_exact_off_ties(bits):
  master = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.float32)
  master = remainder.untie(jnp.where(jnp.isfinite(master), master, 1.0))
  params, rem = remainder.split(master)
  chex.assert_trees_all_equal(params, master.astype(jnp.bfloat16))
  assert tree_bits_equal(remainder.join(params, rem), master)


def test_exact_ties_are_why_masters_are_untied():
  """(bf16, low 16 bits) cannot tell the two exact ties apart: untie moves
  them one fp32 ulp towards the bf16 value they round to."""
  even_up, odd_up = 0x3F80_8000, 0x3F81_8000  # rounds down / up to even
  ties = jax.lax.bitcast_convert_type(
      jnp.array([even_up, odd_up], jnp.uint32), jnp.float32)
  joined = remainder.join(*remainder.split(ties))
  assert not tree_bits_equal(joined, ties)  # the ambiguity, without untie
  untied = remainder.untie(ties)
  chex.assert_trees_all_equal(untied.astype(jnp.bfloat16),
                              ties.astype(jnp.bfloat16))
  assert tree_bits_equal(remainder.join(*remainder.split(untied)), untied)
  np.testing.assert_array_equal(
      jax.lax.bitcast_convert_type(untied, jnp.uint32),
      [even_up - 1, odd_up + 1])


# --- master="remainder" -------------------------------------------------------

def test_remainder_is_bit_identical_to_the_fp32_master_over_1000_steps():
  params = params_of()
  want, want_state = train(make("float32"), params, 1000, poison_at=(7, 500))
  got, got_state = train(make("remainder"), params, 1000, poison_at=(7, 500))
  assert tree_bits_equal(got, want)
  assert tree_bits_equal(jmp_lab.master_params(got_state, got),
                         jmp_lab.master_params(want_state))
  assert int(got_state.skipped_steps) == int(want_state.skipped_steps) == 2
  assert got_state.master_params is None
  chex.assert_type(jax.tree_util.tree_leaves(got_state.master_remainder),
                   jnp.uint16)


def test_remainder_state_is_half_the_master_bytes():
  params = params_of()
  nbytes = lambda tree: sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
  full = make("float32").init(params)
  lean = make("remainder").init(params)
  assert nbytes(lean.master_remainder) * 2 == nbytes(full.master_params) - 4  # int leaf


def test_master_params_of_a_remainder_state_needs_the_params():
  state = make("remainder").init(params_of())
  with pytest.raises(ValueError, match=r"master_params\(opt_state, params\)"):
    jmp_lab.master_params(state)


# --- master="none" -------------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["mixed_precision", "fused_adamw"])
def test_nearest_rounding_stalls_where_stochastic_rounding_moves(optimizer):
  """At a learning rate whose updates are below half a bf16 ulp, round to
  nearest loses them; stochastic rounding keeps them in expectation."""
  params = params_of()
  steps, lr = 200, 1e-5
  build = make if optimizer == "mixed_precision" else (
      lambda master, rounding="nearest", lr=lr: fused(
          "reference", master=master, rounding=rounding, lr=lr))
  _, master_state = train(build("float32", lr=lr), params, steps)
  nearest, _ = train(build("none", lr=lr), params, steps)
  stochastic, _ = train(build("none", "stochastic", lr=lr), params, steps)
  master = jmp_lab.master_params(master_state)["w"]
  moved = lambda w: float(jnp.mean(jnp.abs(  # noqa: E731
      w.astype(jnp.float32) - params["w"].astype(jnp.float32))))
  assert moved(nearest["w"]) < 0.2 * moved(master)
  assert 0.5 * moved(master) < moved(stochastic["w"]) < 2 * moved(master)


@pytest.mark.parametrize("with_jit", [True, False])
@pytest.mark.parametrize("source", ["jax.random", "counter_bits"])
def test_stochastic_rounding_is_unbiased_and_reproducible(with_jit, source):
  """Unbiased under jit too, where a float error term (x - bf16(x)) would be
  rewritten to 0 by XLA's excess precision (jax issue 23007)."""
  x = jnp.full((20000,), 1.0 + 2.0**-9, jnp.float32)  # a quarter of a bf16 ulp

  def round_(x):
    if source == "jax.random":
      bits = jax.random.bits(jax.random.key(3), x.shape, jnp.uint32)
    else:
      seed = rounding.step_seed(jnp.array([0, 3], jnp.uint32), jnp.int32(5))
      bits = rounding.counter_bits(seed, 2, jnp.arange(x.size))
    return rounding.stochastic_round_bf16(x, bits)

  rounded = (jax.jit(round_) if with_jit else round_)(x)
  assert set(np.unique(np.asarray(rounded, np.float32))) == {1.0, 1.0078125}
  assert float(jnp.mean(rounded.astype(jnp.float32))) == pytest.approx(
      float(x[0]), abs=2e-4)
  chex.assert_trees_all_equal(rounded, round_(x))


def test_counter_bits_differ_by_stream_seed_and_index():
  seed = rounding.step_seed(jnp.array([0, 3], jnp.uint32), jnp.int32(0))
  other_step = rounding.step_seed(jnp.array([0, 3], jnp.uint32), jnp.int32(1))
  index = jnp.arange(1 << 16)
  streams = [rounding.counter_bits(s, k, index) for s, k in
             ((seed, 0), (seed, 1), (other_step, 0))]
  for bits in streams:
    low = np.asarray(bits & 0xFFFF)
    assert len(np.unique(np.asarray(bits))) == index.size  # a bijection
    assert abs(low.mean() / 0xFFFF - 0.5) < 0.01
  assert np.mean(np.asarray(streams[0]) == np.asarray(streams[1])) < 1e-3
  assert np.mean(np.asarray(streams[0]) == np.asarray(streams[2])) < 1e-3


def test_stochastic_runs_repeat_and_a_skipped_step_draws_nothing():
  params = params_of()
  tx = make("none", "stochastic", rounding_seed=5)
  first, state = train(tx, params, 20, poison_at=(4,))
  again, _ = train(tx, params, 20, poison_at=(4,))
  assert tree_bits_equal(first, again)
  state0 = tx.init(params)
  _, skipped = tx.update(jmp_lab.ScaledGradients(
      grads_at(params, 0, 4096.0, poison=True)), state0, params)
  assert tree_bits_equal(skipped.rounding_key, state0.rounding_key)
  assert int(skipped.skipped_steps) == 1


# --- bad input -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(master="fp32"), r"unknown master 'fp32'.*'float32', 'remainder', 'none'"),
    (dict(master="none", rounding="up"), r"unknown rounding 'up'.*'nearest', 'stochastic'"),
    (dict(rounding="stochastic"), r"rounding='stochastic' needs master='none'"),
    (dict(master="remainder", rounding="stochastic"),
     r"rounding='stochastic' needs master='none'"),
    (dict(master="remainder", policy="p=f16,c=f16"),
     r"master='remainder' needs bfloat16 params.*float16"),
    (dict(master="none", rounding="stochastic", policy="p=f16,c=f16"),
     r"rounding='stochastic' needs bfloat16 params, got float16"),
    (dict(master="remainder", policy="float32"),
     r"master='remainder' needs half params.*float32"),
])
def test_bad_master_modes_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    make(**kwargs)


# --- fused_adamw: remainder and moment dtypes ---------------------------------

def fused(backend, lr=1e-3, **kwargs):
  return jmp_lab.fused_adamw(
      lr, weight_decay=0.1, policy=BF16, backend=backend,
      loss_scale=jmp_lab.DynamicLossScale(2.0**12, growth_interval=50), **kwargs)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_fused_remainder_is_bit_identical_to_the_fused_fp32_master(
    backend, request):
  if backend == "reference" and EMITTER_FLAGS:
    # Its last check holds two implementations (the fused reference and
    # optax's) to the same bits, which they reach only as XLA:CPU's default
    # emitters and instruction set round them (tests/conftest.py).
    run_under_xla_cpu_defaults(request.node.nodeid)
    return
  params = params_of()
  llvm = PRODUCTION_LLVM if backend == "reference" else None
  want, want_state = train(fused(backend), params, 60, poison_at=(7,),
                           compiler_options=llvm)
  got, got_state = train(fused(backend, master="remainder"), params, 60,
                         poison_at=(7,), compiler_options=llvm)
  assert tree_bits_equal(got, want)
  assert tree_bits_equal(jmp_lab.master_params(got_state, got),
                         jmp_lab.master_params(want_state))
  assert got_state.master_params is None and int(got_state.skipped_steps) == 1
  if backend == "reference":
    # ... and to mixed_precision's remainder mode. (Interpret mode drifts
    # from optax by one bf16 ulp in 2 of 640 elements over these 60 steps,
    # in the fp32-master mode as much: XLA:CPU compiles the kernel body's
    # arithmetic a little differently.)
    wrapped, _ = train(make("remainder"), params, 60, poison_at=(7,),
                       compiler_options=llvm)
    assert tree_bits_equal(got, wrapped)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_fused_bf16_moments_match_optax_mu_dtype(backend):
  """optax computes the moments in fp32 and stores mu in mu_dtype; the fused
  optimizer does the same, and can store nu in bf16 too (optax cannot)."""
  params = params_of()
  ref = jmp_lab.mixed_precision(
      optax.adamw(1e-3, weight_decay=0.1, mu_dtype=jnp.bfloat16), policy=BF16,
      loss_scale=jmp_lab.DynamicLossScale(2.0**12, growth_interval=50))
  want, _ = train(ref, params, 40, poison_at=(7,))
  got, state = train(fused(backend, mu_dtype=jnp.bfloat16), params, 40,
                     poison_at=(7,))
  assert tree_bits_equal(got, want)
  chex.assert_type(jax.tree_util.tree_leaves(state.mu), jnp.bfloat16)
  lean, lean_state = train(fused(backend, master="remainder", mu_dtype="bfloat16",
                                 nu_dtype="bfloat16"), params, 40)
  chex.assert_type(jax.tree_util.tree_leaves(lean_state.nu), jnp.bfloat16)
  full, _ = train(fused(backend), params, 40)
  chex.assert_trees_all_close(lean["w"].astype(jnp.float32),
                              full["w"].astype(jnp.float32), atol=0.02)


def test_fused_remainder_trains_in_a_donated_train_state():
  import flax.linen as nn
  from jmp_lab import linen as jl
  model = jl.with_policy(nn.Dense(3), BF16)
  params = model.init(jax.random.key(0), jnp.ones((2, 4)))["params"]
  make_state = lambda master: jmp_lab.TrainState.create(  # noqa: E731
      apply_fn=model.apply, params=params, policy=BF16,
      tx=fused("reference", master=master))

  def loss_fn(params, state, batch):
    return jnp.mean(state.apply_fn({"params": params}, batch).astype(jnp.float32) ** 2)

  step = jmp_lab.make_train_step(loss_fn)
  full, lean = make_state("float32"), make_state("remainder")
  for _ in range(5):
    full, _ = step(full, jnp.ones((2, 4)))
    lean, _ = step(lean, jnp.ones((2, 4)))
  assert tree_bits_equal(lean.params, full.params)
  assert tree_bits_equal(lean.master_params, full.master_params)


@pytest.mark.parametrize("kwargs,match", [
    (dict(master="remainder", layout="flat"), r"need layout='tree'"),
    (dict(master="none", layout="flat"), r"master='none'.*need layout='tree'"),
    (dict(rounding="stochastic"), r"rounding='stochastic' needs master='none'"),
    (dict(mu_dtype=jnp.float16),
     r"mu_dtype must be float32, bfloat16, 'int8' or 'float8_e4m3fn'.*float16"),
    # int8 is a moment dtype since issue 46 (block-quantized); int4 is not
    (dict(nu_dtype="int4"),
     r"nu_dtype must be float32, bfloat16, 'int8' or 'float8_e4m3fn'.*'int4'"),
])
def test_fused_bad_master_modes_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    fused("reference", **kwargs)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_fused_none_nearest_is_bit_identical_to_mixed_precision(backend):
  params = params_of()
  want, _ = train(make("none"), params, 40, poison_at=(7,))
  got, state = train(fused(backend, master="none"), params, 40, poison_at=(7,))
  assert tree_bits_equal(got, want)
  assert state.master_params is None and state.master_remainder is None
  assert jmp_lab.master_params(state) is None
  assert int(state.skipped_steps) == 1


def test_fused_stochastic_backends_agree_runs_repeat_and_skips_draw_nothing():
  params = params_of()
  tx = lambda backend: fused(backend, master="none", rounding="stochastic",  # noqa: E731
                             rounding_seed=11, mu_dtype="bfloat16",
                             nu_dtype="bfloat16")
  first, _ = train(tx("reference"), params, 20, poison_at=(4,))
  again, _ = train(tx("reference"), params, 20, poison_at=(4,))
  interpreted, _ = train(tx("interpret"), params, 20, poison_at=(4,))
  assert tree_bits_equal(first, again)
  assert tree_bits_equal(first, interpreted)
  # A skipped step leaves count and key alone: the next step rounds as the
  # skipped one would have (its gradients scaled by the backed-off scale).
  opt = tx("reference")
  state0 = opt.init(params)
  _, skipped = opt.update(jmp_lab.ScaledGradients(
      grads_at(params, 0, 4096.0, poison=True)), state0, params)
  assert tree_bits_equal((skipped.rounding_key, skipped.count),
                         (state0.rounding_key, state0.count))
  after_skip, _ = opt.update.new_params(jmp_lab.ScaledGradients(
      grads_at(params, 0, 2048.0)), skipped, params)
  direct, _ = opt.update.new_params(jmp_lab.ScaledGradients(
      grads_at(params, 0, 4096.0)), state0, params)
  assert tree_bits_equal(after_skip, direct)
  other_seed, _ = train(fused("reference", master="none", rounding="stochastic",
                              rounding_seed=12), params, 20)
  assert not tree_bits_equal(other_seed["w"], first["w"])


def test_fused_none_stochastic_trains_in_a_donated_train_state():
  import flax.linen as nn
  from jmp_lab import linen as jl
  model = jl.with_policy(nn.Dense(3), BF16)
  params = model.init(jax.random.key(0), jnp.ones((2, 4)))["params"]
  state = jmp_lab.TrainState.create(
      apply_fn=model.apply, params=params, policy=BF16,
      tx=fused("reference", master="none", rounding="stochastic",
               mu_dtype="bfloat16", nu_dtype="bfloat16"))

  def loss_fn(params, state, batch):
    return jnp.mean(state.apply_fn({"params": params}, batch).astype(jnp.float32) ** 2)

  step = jmp_lab.make_train_step(loss_fn)
  losses = []
  for _ in range(20):
    state, metrics = step(state, jnp.ones((2, 4)))  # donates the old state
    losses.append(float(metrics["loss"]))
  assert losses[-1] < 0.9 * losses[0]
  assert jmp_lab.master_params(state.opt_state) is None  # nothing kept
  chex.assert_type(jax.tree_util.tree_leaves(state.params), jnp.bfloat16)
  chex.assert_type(jax.tree_util.tree_leaves(state.opt_state.mu), jnp.bfloat16)


def test_fused_remainder_needs_bf16_params():
  with pytest.raises(ValueError, match="master='remainder' needs bfloat16 params"):
    jmp_lab.fused_adamw(1e-3, policy="p=f16,c=f16", master="remainder",
                        loss_scale=jmp_lab.NoOpLossScale())


# --- checkpoints ----------------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["mixed_precision", "fused_adamw"])
@pytest.mark.parametrize("master,rounding", [
    ("remainder", "nearest"), ("none", "stochastic")])
def test_lean_states_survive_an_orbax_round_trip(optimizer, master, rounding,
                                                 tmp_path):
  """Saved after 5 steps and restored into a fresh state: the restored run
  continues bit for bit (remainders, rounding key and all)."""
  ocp = pytest.importorskip("orbax.checkpoint")
  params = params_of()
  tx = (make(master, rounding) if optimizer == "mixed_precision" else
        fused("reference", master=master, rounding=rounding,
              mu_dtype="bfloat16", nu_dtype="bfloat16"))
  params, state = train(tx, params, 5, poison_at=(2,))
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ckpt", {"params": params, "opt": state})
    checkpointer.wait_until_finished()
    target = {"params": jax.tree_util.tree_map(jnp.zeros_like, params),
              "opt": tx.init(params_of(seed=1))}
    restored = checkpointer.restore(tmp_path / "ckpt", target)
  assert tree_bits_equal(restored, {"params": params, "opt": state})

  def go_on(params, state):
    for i in range(5, 10):
      updates, state = tx.update(jmp_lab.ScaledGradients(grads_at(
          params, i, jmp_lab.current_loss_scale(state).loss_scale)), state,
          params)
      params = optax.apply_updates(params, updates)
    return params, state

  assert tree_bits_equal(go_on(restored["params"], restored["opt"]),
                         go_on(params, state))


def test_remainder_is_bit_identical_on_the_digits_cnn_without_fma(tmp_path):
  """On real data (the digits CNN, bf16 params, 8 steps of Adam), the
  remainder master equals the fp32 master bit for bit at every step. XLA:CPU
  contracts optax's update into FMAs differently in the two compiled
  programs (1 fp32 ulp in some elements, seen from the second step), so the
  check runs with a CPU target without FMA, in a subprocess."""
  script = tmp_path / "digits_bits.py"
  script.write_text(f'''
import sys
sys.path.insert(0, {str(ROOT / "examples")!r})
import digits_cnn, numpy as np, jax, optax, jmp_lab
from jmp_lab import linen as jl
(x, y), _ = digits_cnn.load_data()
policy = jmp_lab.get_policy("p=bf16,c=bf16,o=f32")
model = jl.with_policy(digits_cnn.SimpleCNN(), policy)
params = model.init(jax.random.key(0), x[:1])["params"]
states = {{m: jmp_lab.TrainState.create(
    apply_fn=model.apply, params=params, policy=policy,
    tx=jmp_lab.mixed_precision(optax.adam(1e-3), policy=policy, master=m,
                               loss_scale=jmp_lab.NoOpLossScale()))
          for m in ("float32", "remainder")}}
step = jmp_lab.make_train_step(digits_cnn.loss_fn)
order = np.random.default_rng(0).permutation(len(x))
for i in range(8):
  batch = {{"x": x[order[i * 64:(i + 1) * 64]], "y": y[order[i * 64:(i + 1) * 64]]}}
  states = {{m: step(s, batch)[0] for m, s in states.items()}}
  a, b = (jax.tree_util.tree_leaves(s.master_params) for s in states.values())
  assert all(np.array_equal(np.asarray(u).view(np.uint32), np.asarray(v).view(np.uint32))
             for u, v in zip(a, b)), i
print("bit-identical steps:", i + 1)
''')
  # (On the floor lane CPU_COMPILE_FLAGS caps the ISA at AVX, after SSE4_2:
  # neither has FMA.)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_cpu_max_isa=SSE4_2 {CPU_COMPILE_FLAGS}")
  out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "bit-identical steps: 8" in out.stdout
