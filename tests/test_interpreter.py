"""The precision interpreter, one higher-order primitive at a time.

The interpreter (jmp_lab/_src/precision/) reads jaxpr internals that change
between jax releases: variables, equation params, custom-derivative rules.
Each test here puts one higher-order primitive around a matmul and checks,
on whatever jax runs the suite (CI runs the oldest supported and the
newest), that under ``"mixed_bfloat16"`` the matmul inside runs in bf16 and
the gradient through the primitive is autodiff's (never zeros, never
dropped), and that under ``"float32"`` value and gradient are exactly plain
JAX's. A jax release that changes how one primitive is written shows here
as one named failure.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jmp_lab
from jmp_lab.diagnostics.audit import compiled_sub_jaxprs

BF16 = np.dtype(jnp.bfloat16)


def _matmul(x, w):
  return jnp.tanh(x @ w)


@jax.custom_vjp
def _vjp_matmul(x, w):
  return _matmul(x, w)


def _vjp_fwd(x, w):
  return _matmul(x, w), (x, w)


def _vjp_bwd(residuals, g):
  x, w = residuals
  y = _matmul(x, w)
  g = g * (1 - y * y)
  return g @ w.T, x.T @ g


_vjp_matmul.defvjp(_vjp_fwd, _vjp_bwd)


_CLOSED_OVER = jnp.linspace(0.5, 1.5, 8)  # an array constant: num_consts 1


@jax.custom_vjp
def _vjp_closure_matmul(x, w):
  return _matmul(x, w) * _CLOSED_OVER


def _vjp_closure_fwd(x, w):
  return _vjp_closure_matmul(x, w), (x, w)  # inputs forwarded as residuals


def _vjp_closure_bwd(residuals, g):
  x, w = residuals
  y = _matmul(x, w)
  g = g * _CLOSED_OVER * (1 - y * y)
  return g @ w.T, x.T @ g


_vjp_closure_matmul.defvjp(_vjp_closure_fwd, _vjp_closure_bwd)


@jax.custom_jvp
def _jvp_matmul(x, w):
  return _matmul(x, w)


@_jvp_matmul.defjvp
def _jvp_rule(primals, tangents):
  (x, w), (dx, dw) = primals, tangents
  y = _matmul(x, w)
  return y, (1 - y * y) * (dx @ w + x @ dw)


def _scan(x, w):
  def body(carry, _):
    return _matmul(carry, w), None
  return jax.lax.scan(body, x, None, length=3)[0]


def _while(x, w):
  return jax.lax.fori_loop(0, 3, lambda i, c: _matmul(c, w), x)


def _cond(x, w):
  return jax.lax.cond(jnp.sum(x) > -1e9, _matmul, lambda x, w: -x, x, w)


def _pjit(x, w):
  return jax.jit(_matmul)(x, w)


def _remat(x, w):
  return jax.checkpoint(_matmul)(x, w)


def _shard_map(x, w):
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  return jax.shard_map(_matmul, mesh=mesh, in_specs=(P("data"), P()),
                       out_specs=P("data"))(x, w)


PRIMITIVES = {
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "pjit": _pjit,
    "remat": _remat,
    "custom_jvp": _jvp_matmul,
    "custom_vjp": _vjp_matmul,
    "custom_vjp_closing_over_an_array": _vjp_closure_matmul,
    "shard_map": _shard_map,
}


def _loss(fn):
  return lambda w, x: jnp.sum(fn(x, w).astype(jnp.float32) ** 2)


def _inputs():
  kx, kw = jax.random.split(jax.random.key(0))
  return (jax.random.normal(kw, (8, 8)) / 3, jax.random.normal(kx, (4, 8)))


def _dot_operand_dtypes(fn, *args):
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        found.append({np.dtype(v.aval.dtype) for v in eqn.invars[:2]})
      for inner in compiled_sub_jaxprs(eqn):
        walk(inner)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.mark.parametrize("primitive", sorted(PRIMITIVES))
def test_half_policy_reaches_the_matmul_and_keeps_the_gradient(primitive):
  w, x = _inputs()
  loss = _loss(PRIMITIVES[primitive])
  autocast = jmp_lab.autocast(loss, "mixed_bfloat16")
  dtypes = _dot_operand_dtypes(autocast, w, x)
  assert dtypes and all(d == {BF16} for d in dtypes), dtypes
  value, grad = jax.value_and_grad(autocast)(w, x)
  want_value, want_grad = jax.value_and_grad(loss)(w, x)
  chex.assert_trees_all_close(value, want_value, rtol=5e-2)
  # bf16's 8 bits of mantissa: close, and above all not zero.
  assert float(jnp.abs(grad).max()) > 0.1 * float(jnp.abs(want_grad).max())
  chex.assert_trees_all_close(grad, want_grad, rtol=0.1,
                              atol=0.05 * float(jnp.abs(want_grad).max()))


@pytest.mark.parametrize("primitive", sorted(PRIMITIVES))
def test_float32_policy_is_plain_jax(primitive):
  w, x = _inputs()
  loss = _loss(PRIMITIVES[primitive])
  value, grad = jax.value_and_grad(jmp_lab.autocast(loss, "float32"))(w, x)
  want_value, want_grad = jax.value_and_grad(loss)(w, x)
  chex.assert_trees_all_close((value, grad), (want_value, want_grad),
                              rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("primitive", ["custom_vjp", "scan", "remat"])
def test_jitted_and_vmapped_gradients_agree(primitive):
  w, x = _inputs()
  loss = jmp_lab.autocast(_loss(PRIMITIVES[primitive]), "mixed_bfloat16")
  eager = jax.grad(loss)(w, x)
  jitted = jax.jit(jax.grad(loss))(w, x)
  per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0))(w, x[:, None])
  chex.assert_trees_all_close(jitted, eager, rtol=1e-2, atol=1e-3)
  chex.assert_trees_all_close(per_example.sum(0), eager, rtol=5e-2,
                              atol=5e-2 * float(jnp.abs(eager).max()))


def _stacked_layers(h, kernels, scales):
  """A model scanned over its layers: each layer's kernel read by its GEMM,
  its norm's scale by fp32 statistics."""
  def layer(h, weights):
    kernel, scale = weights
    h = jnp.tanh(h @ kernel)
    variance = jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True)
    return (h * jax.lax.rsqrt(variance + 1e-6) * scale).astype(h.dtype), None
  return jax.lax.scan(layer, h, (kernels, scales))[0]


def test_a_scanned_stack_read_only_by_gemms_enters_the_loop_in_half():
  """The stacked fp32 kernels are cast to bf16 once, before the loop (the
  7B-class Llama's step under mixed_bfloat16 held fp32 copies of its stack
  and an fp32 stack of gradients: 1.9 GiB a device); the norm scales, read
  in fp32, enter as fp32; the values are the same as casting in the loop."""
  h = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32)), jnp.float32)
  kernels = jnp.asarray(np.random.default_rng(1).normal(size=(3, 32, 32)),
                        jnp.float32) / 6
  scales = jnp.ones((3, 32), jnp.float32) * 1.1
  cast = jmp_lab.autocast(_stacked_layers, "mixed_bfloat16")
  jaxpr = jax.make_jaxpr(cast)(h, kernels, scales).jaxpr
  (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
  xs_dtypes = [v.aval.dtype for v in scan.invars[-2:]]
  assert xs_dtypes == [jnp.bfloat16, jnp.float32], xs_dtypes
  chex.assert_trees_all_equal(
      cast(h, kernels, scales),
      cast(h, kernels.astype(jnp.bfloat16), scales))
  grads = jax.grad(lambda k: cast(h, k, scales).sum())(kernels)
  chex.assert_type(grads, jnp.float32)
  chex.assert_tree_all_finite(grads)
  # The gradient is the one of casting in the loop: each layer's bf16
  # cotangent widened to fp32, once before the loop or once in it.
  chex.assert_trees_all_equal(grads, jax.grad(
      lambda k: cast(h, k.astype(jnp.bfloat16), scales).sum())(kernels))


def _scan_of(layer):
  return lambda h, stack: jax.lax.scan(lambda c, w: (layer(c, w), None), h,
                                       stack)[0]


@pytest.mark.parametrize("name,layer", [
    # Two GEMMs read each kernel: their gradients are summed in fp32 after
    # each cast's transpose; hoisted, they would be summed in bf16.
    ("two GEMMs", lambda h, w: jnp.tanh(h @ w) + jnp.tanh(h @ w.T)),
    # A cast to half that only feeds fp32 ops runs in fp32 (Mamba's
    # exp(A_log)): hoisted, it would be rounded to bf16 first.
    ("a cast into fp32 ops", lambda h, w: h * jnp.exp(
        -w.astype(jnp.bfloat16)).sum(0)),
])
def test_a_scanned_stack_read_otherwise_stays_as_stored(name, layer):
  """Only a stack with one half read enters the loop in half."""
  del name
  h = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32)), jnp.float32)
  stack = jnp.asarray(np.random.default_rng(1).normal(size=(3, 32, 32)),
                      jnp.float32) / 6
  cast = jmp_lab.autocast(_scan_of(layer), "mixed_bfloat16")
  jaxpr = jax.make_jaxpr(cast)(h, stack).jaxpr
  (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
  assert scan.invars[-1].aval.dtype == jnp.float32
