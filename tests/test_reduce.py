"""The policy's reduce dtype: weight gradients summed across devices in it."""

import collections
import pathlib
import sys
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from jmp_lab import linen as jl
from jmp_lab import reduce as reduce_lib
from jmp_lab.diagnostics.audit import compiled_sub_jaxprs
from cuda_compile import require_cuda_plugin  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (lhs shape, rhs shape, dimension numbers): Dense, DenseGeneral over two
# axes, and a batched contraction (attention-like).
DOTS = [
    ((6, 5), (5, 3), (((1,), (0,)), ((), ()))),
    ((2, 4, 3, 5), (3, 5, 7), (((2, 3), (0, 1)), ((), ()))),
    ((4, 6, 5), (4, 5, 3), (((2,), (1,)), ((0,), (0,)))),
    ((5, 6), (3, 5), (((0,), (1,)), ((), ()))),
]


class DotGeneralTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_gradients_equal_lax_dot_general_in_fp32(self):
    """In fp32 the reduce dtype changes nothing: the same values as jax's
    own transpose rules, for every layout of dimension numbers."""
    dot = reduce_lib.dot_general(jnp.float32)
    for k, (lhs_shape, rhs_shape, dims) in enumerate(DOTS):
      lhs = jax.random.normal(jax.random.key(k), lhs_shape)
      rhs = jax.random.normal(jax.random.key(k + 10), rhs_shape)
      weights = jax.random.normal(jax.random.key(k + 20),
                                  jax.lax.dot_general(lhs, rhs, dims).shape)

      def loss(op, lhs, rhs):
        return jnp.sum(op(lhs, rhs, dims) * weights)

      want = jax.grad(lambda l, r: loss(jax.lax.dot_general, l, r),
                      argnums=(0, 1))(lhs, rhs)
      got = self.variant(jax.grad(lambda l, r: loss(dot, l, r),
                                  argnums=(0, 1)))(lhs, rhs)
      chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)

  def test_weight_gradient_gemm_accumulates_in_the_reduce_dtype(self):
    """bf16 operands, fp32 product for the weight gradient only; the input
    gradient and the forward product stay bf16."""
    x = jnp.ones((8, 4), jnp.bfloat16)
    w = jnp.ones((4, 3), jnp.bfloat16)
    dot = reduce_lib.dot_general(jnp.float32)
    dims = (((1,), (0,)), ((), ()))
    jaxpr = jax.make_jaxpr(jax.grad(
        lambda x, w: dot(x, w, dims).astype(jnp.float32).sum(),
        argnums=(0, 1)))(x, w)
    products = [(tuple(str(v.aval.dtype) for v in e.invars),
                 str(e.outvars[0].aval.dtype))
                for e in jaxpr.jaxpr.eqns if e.primitive.name == "custom_vjp_call"]
    assert products  # the custom rule is in the graph
    assert len(_fp32_products(jaxpr)) == 1, jaxpr
    grads = jax.grad(lambda x, w: dot(x, w, dims).astype(jnp.float32).sum(),
                     argnums=(0, 1))(x, w)
    chex.assert_type(grads, jnp.bfloat16)
    chex.assert_trees_all_equal(grads[1], jnp.full((4, 3), 8.0, jnp.bfloat16))


# (equation, input shape, weight shape)
EINSUMS = [
    ("btd,dhk->bthk", (2, 5, 4), (4, 3, 2)),
    ("...d,dk->...k", (2, 3, 5, 4), (4, 6)),
    ("btd,dhk->hkbt", (2, 5, 4), (4, 3, 2)),  # jnp.einsum puts w first
    ("bd,dkz->bk", (3, 4), (4, 5, 2)),         # a weight axis summed out
]


class EinsumTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_gradients_equal_jnp_einsum_in_fp32(self):
    op = reduce_lib.einsum(jnp.float32)
    for k, (equation, x_shape, w_shape) in enumerate(EINSUMS):
      x = jax.random.normal(jax.random.key(k), x_shape)
      w = jax.random.normal(jax.random.key(k + 10), w_shape)
      out_shape = jnp.einsum(equation, x, w).shape
      weights = jax.random.normal(jax.random.key(k + 20), out_shape)

      def loss(einsum, x, w):
        return jnp.sum(einsum(equation, x, w) * weights)

      want = jax.grad(lambda x, w: loss(jnp.einsum, x, w), argnums=(0, 1))(x, w)
      got = self.variant(jax.grad(lambda x, w: loss(op, x, w),
                                  argnums=(0, 1)))(x, w)
      chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)

  def test_only_the_weight_gradient_is_an_fp32_product(self):
    """Whichever operand jnp.einsum puts first, the fp32 product is the
    weight's gradient (bf16 operands); both gradients come back in bf16."""
    op = reduce_lib.einsum(jnp.float32)
    x = jnp.ones((2, 5, 4), jnp.bfloat16)
    w = jnp.ones((4, 3, 2), jnp.bfloat16)
    grad = jax.grad(lambda x, w: op("btd,dhk->hkbt", x, w).astype(
        jnp.float32).sum(), argnums=(0, 1))
    jaxpr = jax.make_jaxpr(grad)(x, w)
    products = [e for e in _all_eqns(jaxpr.jaxpr)
                if e.primitive.name == "dot_general"]
    wide = [e for e in products if e.outvars[0].aval.dtype == jnp.float32]
    assert len(wide) == 1 and wide[0].outvars[0].aval.size == w.size, products
    assert all(v.aval.dtype == jnp.bfloat16 for v in wide[0].invars)
    gx, gw = grad(x, w)
    chex.assert_type([gx, gw], jnp.bfloat16)
    chex.assert_trees_all_equal(gw, jnp.full(w.shape, 10.0, jnp.bfloat16))


@pytest.mark.parametrize("equation", ["ab,bc,cd->ad", "ab,bc", "ab,bb->a"])
def test_bad_einsum_equations_are_refused(equation):
  op = reduce_lib.einsum(jnp.float32)
  operands = [jnp.ones((2, 2))] * (equation.split("->")[0].count(",") + 1)
  with pytest.raises(ValueError, match="einsum subscripts"):
    op(equation, *operands)


def _all_eqns(jaxpr):
  """The equations of ``jaxpr`` and of every jaxpr inside it (custom_vjp
  calls, pjit) that a GPU compile runs (not the CPU branch of a
  platform-dependent choice)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for inner in compiled_sub_jaxprs(eqn):
      yield from _all_eqns(inner)


def _fp32_products(jaxpr) -> list:
  """The GEMMs and convolutions of ``jaxpr`` that a GPU compile runs with
  half operands and an fp32 result."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  return [e for e in _all_eqns(jaxpr)
          if e.primitive.name in ("dot_general", "conv_general_dilated")
          and e.outvars[0].aval.dtype == jnp.float32
          and all(v.aval.dtype in (jnp.bfloat16, jnp.float16)
                  for v in e.invars[:2])]


class SharedDense(nn.Module):
  """One Dense called twice: its bias gradient comes from both calls."""

  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(x.shape[-1])
    return dense(nn.relu(dense(x)))


class OwnCallDense(nn.Dense):
  """A Dense subclass with its own ``__call__``: jmp_lab leaves its bias to
  autodiff, since it may use it otherwise."""

  def __call__(self, x):
    return super().__call__(x) * 2.0


# (module, input shape): every layer whose bias or weight jmp_lab attaches
# a gradient to, biases broadcast every way flax does.
LAYERS = [
    (nn.Dense(3), (4, 5, 6)),
    (nn.DenseGeneral((2, 3), axis=(-2, -1)), (4, 5, 6)),
    (nn.DenseGeneral(3, batch_dims=(0,)), (4, 5, 6)),  # bias left to autodiff
    (nn.Conv(3, (3,)), (2, 7, 4)),
    (nn.ConvTranspose(3, (3,)), (2, 7, 4)),
    (nn.ConvLocal(3, (3,)), (2, 7, 4)),
    (nn.Einsum((4, 3, 2), "btd,dhk->bthk"), (2, 5, 4)),
    (nn.Einsum((4, 3), "btd,dh->hbt"), (2, 5, 4)),  # bias on a leading axis
    (SharedDense(), (4, 6)),
    (OwnCallDense(3), (4, 6)),
]


@pytest.mark.filterwarnings("ignore:policy reduce dtype")
@pytest.mark.parametrize("module, shape", LAYERS,
                         ids=[type(m).__name__ + str(i) for i, (m, _) in enumerate(LAYERS)])
def test_attached_gradients_equal_autodiff_in_fp32(module, shape):
    """In fp32, reduce=float32 changes where gradients are summed, not their
    values: every param's gradient equals the plain module's."""
    x = jax.random.normal(jax.random.key(0), shape)
    params = module.init(jax.random.key(1), x)["params"]
    weights = jax.random.normal(jax.random.key(2), module.apply(
        {"params": params}, x).shape)
    model = jl.with_policy(module, "float32,reduce=float32")

    def loss(apply, params):
      return jnp.sum(apply({"params": params}, x) * weights)

    want = jax.grad(lambda p: loss(module.apply, p))(params)
    got = jax.jit(jax.grad(lambda p: loss(model.apply, p)))(params)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


def _reductions(jaxpr, shape):
  """The dtypes of the reduce_sum results of ``shape`` in ``jaxpr``."""
  return [str(e.outvars[0].aval.dtype) for e in _all_eqns(jaxpr)
          if e.primitive.name == "reduce_sum" and e.outvars[0].aval.shape == shape]


@pytest.mark.parametrize("module", [nn.Dense(8), nn.Einsum((6, 8), "btd,dk->btk")])
def test_bias_gradients_are_summed_in_the_reduce_dtype(module):
    """Under bf16 compute a bias gradient is the output gradient summed over
    the batch: with reduce=float32 that sum is fp32 (and the partitioner's
    cross-device sum with it); without, it is bf16."""
    x = jnp.ones((4, 5, 6))

    def sums(spec):
      model = jl.with_policy(module, spec)
      params = model.init(jax.random.key(0), x)["params"]
      grad = jax.grad(lambda p: model.apply({"params": p}, x).sum())
      return _reductions(jax.make_jaxpr(grad)(params).jaxpr, (8,))

    assert sums("mixed_bfloat16") == ["bfloat16"]
    assert "float32" in sums("mixed_bfloat16,reduce=float32")
    assert "bfloat16" not in sums("mixed_bfloat16,reduce=float32")


class MLP(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(64, 16)(tokens)
    x = nn.LayerNorm()(x)
    x = nn.DenseGeneral((2, 8))(x).reshape(x.shape)
    return nn.Dense(5)(nn.relu(nn.Dense(32)(x)))


def grads_and_jaxpr(spec):
  model = jl.with_policy(MLP(), spec)
  tokens = jnp.arange(24).reshape(4, 6) % 64
  params = model.init(jax.random.key(0), tokens)["params"]

  def loss(params):
    return jnp.mean(model.apply({"params": params}, tokens) ** 2)

  return jax.grad(loss)(params), jax.make_jaxpr(jax.grad(loss))(params)


def test_linen_policy_with_reduce_keeps_values_and_widens_weight_gradients():
  base, base_jaxpr = grads_and_jaxpr("mixed_bfloat16")
  reduced, jaxpr = grads_and_jaxpr("mixed_bfloat16,reduce=float32")
  chex.assert_trees_all_close(reduced, base, rtol=0.05, atol=2e-3)
  chex.assert_type(jax.tree_util.tree_leaves(reduced), jnp.float32)
  assert "preferred_element_type=float32" not in str(base_jaxpr)
  # One weight-gradient GEMM per Dense/DenseGeneral, in fp32.
  assert len(_fp32_products(jaxpr)) == 3, jaxpr
  # The embedding table is read, and its gradient scattered, in fp32.
  jaxpr = str(jaxpr)
  assert "scatter-add" in jaxpr or "scatter_add" in jaxpr
  scatters = [line for line in jaxpr.splitlines() if "scatter" in line and "=" in line]
  assert all("bf16" not in line.split("=")[0] for line in scatters), scatters


def test_a_module_that_sets_its_own_dot_general_keeps_it():
  calls = []

  def mine(lhs, rhs, dims, precision=None, preferred_element_type=None):
    calls.append(1)
    return jax.lax.dot_general(lhs, rhs, dims, precision=precision)

  model = jl.with_policy(nn.Dense(3, dot_general=mine), "mixed_bfloat16,r=f32")
  params = model.init(jax.random.key(0), jnp.ones((2, 4)))["params"]
  model.apply({"params": params}, jnp.ones((2, 4)))
  assert calls
  assert "preferred_element_type=float32" not in str(jax.make_jaxpr(jax.grad(
      lambda p: model.apply({"params": p}, jnp.ones((2, 4))).sum()))(params))


def test_modules_the_reduce_dtype_does_not_reach_warn():
  model = jl.with_policy(nn.ConvTranspose(4, (3, 3)), "mixed_bfloat16,reduce=float32")
  with pytest.warns(UserWarning, match="does not reach ConvTranspose"):
    model.init(jax.random.key(0), jnp.ones((1, 8, 8, 3)))
  einsum = jl.with_policy(nn.Einsum((3, 4), "bd,dk->bk"), "mixed_bfloat16,r=f32")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    einsum.init(jax.random.key(0), jnp.ones((2, 3)))


class _ScannedBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    x = x + nn.Dense(8)(nn.relu(nn.Dense(16)(x)))
    return x + nn.Einsum((8, 8), "bd,dk->bk")(x), None


class _Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(_ScannedBlock, variable_axes={"params": 0},
                     split_rngs={"params": True}, length=3)
    return blocks(name="blocks")(x, None)[0]


def test_under_nn_scan_the_stacked_params_get_reduce_dtype_gradients_too():
  """nn.scan stacks its layers' params. The gradients jmp_lab attaches (the
  biases', an Einsum's kernel) are attached inside each layer's call, to the
  slice the layer reads, so they reach stacked params: no warning, the
  gradients equal flax's own, and the Einsum's kernel gradient is a GEMM
  of half operands with an fp32 result, as the Dense kernels' are (they
  were attached from the model's param outside the call, which cannot reach
  a slice: jmp_lab warned and left them in the compute dtype)."""
  x = jax.random.normal(jax.random.key(1), (4, 8))
  model = jl.with_policy(_Scanned(), "mixed_bfloat16,reduce=float32")
  params = model.init(jax.random.key(0), x)["params"]
  loss = lambda p, m: jnp.sum(m.apply({"params": p}, x) ** 2)  # noqa: E731
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    grads = jax.grad(loss)(params, model)
  plain = jax.grad(loss)(params, jl.with_policy(_Scanned(), "mixed_bfloat16"))
  chex.assert_trees_all_close(grads, plain, rtol=0.05, atol=1e-3)
  jaxpr = jax.make_jaxpr(jax.grad(loss), static_argnums=1)(params, model)
  assert len(_fp32_products(jaxpr)) >= 3, jaxpr   # two Dense, the Einsum
  summed = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "reduce_sum"
            and e.invars[0].aval.dtype == jnp.float32
            and e.invars[0].aval.ndim == 2
            and e.outvars[0].aval.shape[-1:] in ((8,), (16,))]
  assert len(summed) >= 3  # the biases' gradients, summed in fp32


@pytest.mark.parametrize("module, args", [
    (nn.Dense(4), ((2, 8, 16),)),
    (nn.Dense(4, dtype=jnp.float32), ((2, 8, 16),)),
    (nn.MultiHeadDotProductAttention(num_heads=2, dtype=jnp.float32),
     ((2, 8, 16), (2, 8, 16))),
])
def test_weight_gradients_of_3d_inputs_run_on_a_cpu(module, args):
  """XLA:CPU cannot run every bf16 x bf16 -> fp32 GEMM: a Dense on 3-D
  inputs under reduce=float32 raised "Unsupported element type for
  DotThunk::Execute: BF16 x BF16 = F32" when run. On a CPU the operands are
  upcast first (the same products); what a GPU compiles is unchanged: the
  weight gradients are GEMMs of half operands with an fp32 result."""
  inputs = [jax.random.normal(jax.random.key(i), shape)
            for i, shape in enumerate(args)]
  model = jl.with_policy(module, "mixed_bfloat16,reduce=float32")
  params = model.init(jax.random.key(0), *inputs)["params"]

  def loss(params, model):
    return jnp.sum(model.apply({"params": params}, *inputs).astype(
        jnp.float32) ** 2)

  grads = jax.jit(jax.grad(loss), static_argnums=1)(params, model)
  plain = jax.grad(loss)(params, jl.with_policy(module, "mixed_bfloat16"))
  if "key" in grads:
    # The key bias's gradient is zero (the softmax is shift-invariant per
    # query): both are bf16 rounding noise.
    for tree in (grads, plain):
      assert float(jnp.max(jnp.abs(tree["key"].pop("bias")))) < 0.05
  # Both are bf16 computations of gradients as large as 5: elements near
  # zero differ by bf16 rounding of the attention's products (0.045 on
  # jax 0.12's XLA:CPU, which orders its sums differently).
  chex.assert_trees_all_close(grads, plain, rtol=0.05, atol=5e-2)
  jaxpr = jax.make_jaxpr(jax.grad(loss), static_argnums=1)(params, model)
  kernels = [path for path, _ in
             jax.tree_util.tree_flatten_with_path(params)[0]
             if path[-1].key == "kernel"]
  assert len(_fp32_products(jaxpr)) == len(kernels)


def test_without_a_reduce_dtype_nothing_changes():
  model = jl.with_policy(nn.Dense(3), "mixed_bfloat16")
  params = model.init(jax.random.key(0), jnp.ones((2, 4)))["params"]
  jaxpr = str(jax.make_jaxpr(jax.grad(
      lambda p: model.apply({"params": p}, jnp.ones((2, 4))).sum()))(params))
  assert "custom_vjp" not in jaxpr and "preferred_element_type=float32" not in jaxpr


# --- compiled for 8 H100s ------------------------------------------------------


def collective_bytes(report):
  """Bytes of gradient sums (all-reduce, reduce-scatter) by dtype."""
  by_dtype = collections.Counter()
  for key, moved in report.collective_bytes().items():
    kind, dtype = key.split(" ", 1)
    if kind in ("all-reduce", "reduce-scatter"):
      by_dtype[dtype] += moved
  return by_dtype


# bf16 (fp32 params) only, for CI time: with bf16 params (bf16-o2) the
# same holds (benchmarks/RESULTS.md, GPT-2-small).
@pytest.mark.parametrize("policy", ["bf16"])
def test_reduce_float32_sums_gradients_in_fp32_on_8_h100s(policy):
  """A data-parallel GPT step compiled for 8 H100s: without a reduce dtype
  the weight gradients are all-reduced in bf16; with reduce=float32 every
  gradient is, biases and both embedding tables included."""
  require_cuda_plugin()
  from benchmarks import train_step
  size = train_step.ModelSize(layers=1, width=256, heads=4, seq_len=128,
                              vocab=4096, batch=8)
  configs = {c.name: c for c in train_step.ALL_CONFIGS}
  plain = collective_bytes(train_step.compiled_step_report(
      configs[policy], size, "h100", devices=8))
  reduced = collective_bytes(train_step.compiled_step_report(
      configs[f"{policy}-r32"], size, "h100", devices=8))
  print(policy, dict(plain), dict(reduced))
  assert plain["bf16"] > 0.95 * sum(plain.values())
  assert set(reduced) == {"f32"}, reduced  # every gradient summed in fp32
  # The same gradients, twice the bytes: every weight gradient now in fp32.
  assert reduced["f32"] == pytest.approx(
      2 * plain["bf16"] + plain["f32"] - 2 * reduced["bf16"], rel=0.01)


CONVS = [  # (lhs NHWC, kernel HWIO, strides, padding, lhs dilation, rhs dilation)
    ((2, 9, 9, 3), (3, 3, 3, 4), (1, 1), "SAME", (1, 1), (1, 1)),
    ((2, 9, 8, 3), (3, 2, 3, 5), (2, 1), "VALID", (1, 1), (1, 1)),
    ((1, 10, 10, 2), (3, 3, 2, 4), (2, 2), ((1, 2), (0, 1)), (1, 1), (2, 1)),
    ((1, 7, 7, 2), (2, 2, 2, 3), (1, 1), ((1, 1), (0, 1)), (2, 2), (1, 1)),
]


@pytest.mark.parametrize("lhs_shape, rhs_shape, strides, padding, lhs_dil, rhs_dil", CONVS)
def test_conv_gradients_equal_lax_in_fp32(lhs_shape, rhs_shape, strides,
                                          padding, lhs_dil, rhs_dil):
  conv = reduce_lib.conv_general_dilated(jnp.float32)
  lhs = jax.random.normal(jax.random.key(0), lhs_shape)
  rhs = jax.random.normal(jax.random.key(1), rhs_shape)

  def loss(op, lhs, rhs):
    out = op(lhs, rhs, strides, padding, lhs_dilation=lhs_dil,
             rhs_dilation=rhs_dil, dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.sum(out * jnp.cos(out))

  want = jax.grad(lambda l, r: loss(jax.lax.conv_general_dilated, l, r),
                  argnums=(0, 1))(lhs, rhs)
  got = jax.jit(jax.grad(lambda l, r: loss(conv, l, r), argnums=(0, 1)))(lhs, rhs)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


def test_conv_weight_gradient_is_a_bf16_conv_with_an_fp32_product():
  model = jl.with_policy(nn.Conv(4, (3, 3)), "mixed_bfloat16,reduce=float32")
  x = jnp.ones((2, 8, 8, 3))
  params = model.init(jax.random.key(0), x)["params"]
  loss = lambda p: model.apply({"params": p}, x).astype(jnp.float32).sum()  # noqa: E731
  jaxpr = jax.make_jaxpr(jax.grad(loss))(params)
  assert len(_fp32_products(jaxpr)) == 1, jaxpr
  plain = jl.with_policy(nn.Conv(4, (3, 3)), "mixed_bfloat16")
  chex.assert_trees_all_close(
      jax.grad(loss)(params),
      jax.grad(lambda p: plain.apply({"params": p}, x).astype(jnp.float32).sum())(params),
      rtol=0.02, atol=0.05)


@pytest.mark.parametrize("policy", [
    "mixed_bfloat16", "p=f32,c=bf16,o=f32,reduce=f32",
    "p=bf16,c=bf16,o=f32,reduce=float32"])
def test_a_users_dense_gradient_is_autodiffs_under_every_reduce_dtype(policy):
  """The user-level report on jax 0.12: under a reduce dtype every gradient
  of ``with_policy(nn.Dense(3), policy)``, kernel and bias alike, came out
  exactly zero (the interpreter read jax 0.12's custom_vjp backward output,
  a ``(cotangents, logs)`` pair, as two missing cotangents)."""
  x = jax.random.normal(jax.random.key(1), (4, 5))
  model = jl.with_policy(nn.Dense(3), policy)
  params = model.init(jax.random.key(0), x)["params"]
  grads = jax.grad(lambda p: jnp.sum(
      model.apply({"params": p}, x).astype(jnp.float32) ** 2))(params)
  plain = nn.Dense(3)
  f32 = jax.tree_util.tree_map(lambda v: v.astype(jnp.float32), params)
  want = jax.grad(lambda p: jnp.sum(plain.apply({"params": p}, x) ** 2))(f32)
  for leaf in jax.tree_util.tree_leaves(grads):
    assert float(jnp.max(jnp.abs(leaf))) > 0.1
  chex.assert_trees_all_close(
      jax.tree_util.tree_map(lambda v: v.astype(jnp.float32), grads), want,
      rtol=0.05, atol=0.05)
