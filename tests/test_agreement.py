"""Ops whose inputs must share a dtype, given one the policy changed.

Public model code hands a policed layer's output to an op that insists on
one dtype for several inputs: jax-ml/bonsai's Qwen3 (NNX) takes its KV cache
as an argument, made by ``init_cache(..., jnp.float32)``, and writes each
step's keys into it with ``lax.dynamic_update_slice``; an RNN starts its
carry from float32 zeros. Under ``with_policy`` these crashed in jax's own
type check ("lax.dynamic_update_slice requires arguments to have the same
dtypes, got float32, bfloat16"), where the model runs without jmp_lab.

The rule, on every route: a write keeps its buffer's dtype (torch.autocast's
in-place copy); the other ops get one dtype, chosen by the rules that
``autocast`` applies to the program as written.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
import flax.linen as nn

import jmp_lab

HEADS, HEAD_DIM, WIDTH, VOCAB, CACHE, BATCH = 2, 8, 16, 24, 8, 2


# ---- a bonsai-style decoder: the cache made outside the model ----------------


class LayerCache(nnx.Module):
  """As bonsai's Qwen3 writes it: made by the caller, in a dtype it picks."""

  def __init__(self, dtype):
    shape = (BATCH, CACHE, HEADS, HEAD_DIM)
    self.k_cache = nnx.Cache(jnp.zeros(shape, dtype))
    self.v_cache = nnx.Cache(jnp.zeros(shape, dtype))
    self.cur_ind = nnx.Variable(jnp.zeros((), jnp.int32))


class Attention(nnx.Module):
  def __init__(self, rngs):
    self.q_proj = nnx.Linear(WIDTH, HEADS * HEAD_DIM, rngs=rngs)
    self.k_proj = nnx.Linear(WIDTH, HEADS * HEAD_DIM, rngs=rngs)
    self.v_proj = nnx.Linear(WIDTH, HEADS * HEAD_DIM, rngs=rngs)
    self.o_proj = nnx.Linear(HEADS * HEAD_DIM, WIDTH, rngs=rngs)

  def __call__(self, x, cache: LayerCache):
    b, t, _ = x.shape
    split = lambda y: y.reshape(b, t, HEADS, HEAD_DIM)  # noqa: E731
    q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(
        self.v_proj(x))
    start = cache.cur_ind[...]
    indices = (0, start, 0, 0)
    # bonsai's lines: the policed layer's output written into the cache.
    cache.v_cache.set_value(
        jax.lax.dynamic_update_slice(cache.v_cache[...], v, indices))
    cache.k_cache.set_value(
        jax.lax.dynamic_update_slice(cache.k_cache[...], k, indices))
    logits = jnp.einsum("bthd,bshd->bhts", q, cache.k_cache[...])
    logits = logits / np.sqrt(HEAD_DIM)
    visible = (jnp.arange(CACHE)[None, :]
               <= start + jnp.arange(t)[:, None])
    logits = jnp.where(visible, logits, jnp.finfo(jnp.bfloat16).min)
    weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(
        logits.dtype)
    out = jnp.einsum("bhts,bshd->bthd", weights, cache.v_cache[...])
    cache.cur_ind.set_value(start + t)
    return self.o_proj(out.reshape(b, t, HEADS * HEAD_DIM))


class Decoder(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.attn = Attention(rngs)
    self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

  def __call__(self, tokens, cache: LayerCache):
    x = self.embed(tokens)
    return self.head(x + self.attn(x, cache))


PROMPT = np.random.default_rng(0).integers(0, VOCAB, (BATCH, 4))
NEXT = np.random.default_rng(1).integers(0, VOCAB, (2, BATCH, 1))


def _nnx_decode(policy):
  """Prefill, then two decode steps, the cache made outside in float32."""
  model = Decoder(nnx.Rngs(0))
  if policy is not None:
    model = jmp_lab.nnx.with_policy(model, policy)
  cache = LayerCache(jnp.float32)
  step = nnx.jit(lambda model, cache, tokens: model(tokens, cache))
  outs = [np.asarray(step(model, cache, tokens), np.float32)
          for tokens in [PROMPT, *NEXT]]
  return outs, cache


class LinenDecoder(nn.Module):
  """The linen form: the float32 cache made by the code itself for the
  prompt, then handed back in for each decode step."""

  @nn.compact
  def __call__(self, tokens, cache=None, start=0):
    x = nn.Embed(VOCAB, WIDTH)(tokens)
    q, k, v = jnp.split(nn.Dense(3 * WIDTH)(x), 3, axis=-1)
    if cache is None:
      cache = (jnp.zeros((BATCH, CACHE, WIDTH), jnp.float32),) * 2
    keys = jax.lax.dynamic_update_slice(cache[0], k, (0, start, 0))
    values = jax.lax.dynamic_update_slice(cache[1], v, (0, start, 0))
    t = tokens.shape[1]
    visible = jnp.arange(CACHE)[None, :] <= start + jnp.arange(t)[:, None]
    logits = jnp.einsum("btd,bsd->bts", q, keys) / np.sqrt(WIDTH)
    logits = jnp.where(visible, logits, -1e9)
    out = jnp.einsum("bts,bsd->btd", jax.nn.softmax(logits, axis=-1), values)
    return nn.Dense(VOCAB)(x + out), (keys, values)


def _linen_decode(policy):
  plain = LinenDecoder()
  variables = plain.init(jax.random.key(0), PROMPT)
  model = plain if policy is None else jmp_lab.linen.with_policy(plain,
                                                                 policy)
  step = jax.jit(model.apply, static_argnums=3)
  logits, cache = step(variables, PROMPT, None, 0)
  outs, start = [np.asarray(logits, np.float32)], PROMPT.shape[1]
  for tokens in NEXT:
    logits, cache = step(variables, tokens, cache, start)
    outs.append(np.asarray(logits, np.float32))
    start += 1
  return outs, cache


DECODES = {"nnx": _nnx_decode, "linen": _linen_decode}


@pytest.mark.parametrize("route", DECODES)
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_float32_cache_from_outside_prefills_and_decodes(route, policy):
  """Prefill and two decode steps run; the logits are within half-precision
  tolerance of the plain model's; the cache the NNX model keeps stays
  float32 (linen's comes back as an output, in the output dtype)."""
  outs, cache = DECODES[route](policy)
  want, _ = DECODES[route](None)
  tolerance = {"mixed_bfloat16": 0.05, "mixed_float16": 0.01}[policy]
  for got, expected in zip(outs, want):
    scale = float(np.max(np.abs(expected)))
    np.testing.assert_allclose(got, expected, atol=tolerance * scale)
  for array in jax.tree.leaves(cache):
    if jnp.issubdtype(array.dtype, jnp.floating):
      assert array.dtype == jnp.float32


# ---- the rule on each primitive, on both routes -----------------------------
#
# Each case: a float32 buffer or carry ``h`` the code made, and ``new``, the
# policed layer's output (bf16 under the policy). ``autocast`` traces the
# same function as written, with a matmul where the layer is.


def _cases(new_fn):
  """``{name: fn(h, xs)}``; ``new_fn(h, x)`` is the policed computation."""
  dimension_numbers = jax.lax.ScatterDimensionNumbers(
      update_window_dims=(1,), inserted_window_dims=(0,),
      scatter_dims_to_operand_dims=(0,))
  return {
      "dynamic_update_slice": lambda h, xs: jax.lax.dynamic_update_slice(
          h, new_fn(h, xs[0])[:1], (1, 0)),
      "scatter": lambda h, xs: jax.lax.scatter(
          h, jnp.array([[0]]), new_fn(h, xs[0])[:1], dimension_numbers),
      "concatenate": lambda h, xs: jax.lax.concatenate(
          [new_fn(h, xs[0]), h], 0),
      "select_n": lambda h, xs: jax.lax.select(
          xs[0] > 0, new_fn(h, xs[0]), h),
      "while": lambda h, xs: jax.lax.fori_loop(
          0, 3, lambda i, c: new_fn(c, xs[i]), h),
      "scan": lambda h, xs: jax.lax.scan(
          lambda c, x: (new_fn(c, x), c.sum()), h, xs)[0],
      "cond": lambda h, xs: jax.lax.cond(
          xs.sum() > 0, lambda: new_fn(h, xs[0]), lambda: h),
      "while_loop": lambda h, xs: jax.lax.while_loop(
          lambda c: c[0] < xs.shape[0],
          lambda c: (c[0] + 1, new_fn(c[1], xs[c[0]])), (0, h))[1],
      "switch": lambda h, xs: jax.lax.switch(
          (xs.sum() > 0).astype(jnp.int32),
          [lambda: h, lambda: new_fn(h, xs[0])]),
      "clamp": lambda h, xs: jax.lax.clamp(h - 0.5, new_fn(h, xs[0]), h + 0.5),
      "pad": lambda h, xs: jax.lax.pad(
          new_fn(h, xs[0]), h[0, 0], [(0, 1, 0), (0, 0, 0)]),
  }


class Cell(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

  def __call__(self, h, x):
    return jnp.tanh(self.linear(h) + x)


class Model(nnx.Module):
  def __init__(self, case, rngs):
    self.cell = Cell(rngs)
    self.case = case

  def __call__(self, xs):
    h = jnp.zeros((BATCH, WIDTH), jnp.float32)
    return _cases(self.cell)[self.case](h, xs)


XS = jnp.asarray(np.random.default_rng(2).normal(size=(3, BATCH, WIDTH)),
                 jnp.float32)
CASES = list(_cases(None))


def _autocast_fn(case):
  def fn(kernel, bias, xs):
    cell = lambda h, x: jnp.tanh(h @ kernel + bias + x)  # noqa: E731
    return _cases(cell)[case](jnp.zeros((BATCH, WIDTH), jnp.float32), xs)
  return jmp_lab.autocast(fn, "mixed_bfloat16")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_with_policy_and_autocast_agree_on_each_primitive(case, jitted):
  """The policed NNX model runs (it raised jax's dtype error before), gives
  the output dtype, and computes what ``autocast`` computes for the same
  function; both are within bf16 tolerance of the plain float32 model."""
  plain = Model(case, nnx.Rngs(0))
  want = np.asarray(plain(XS))
  model = jmp_lab.nnx.with_policy(Model(case, nnx.Rngs(0)), "mixed_bfloat16")
  kernel, bias = model.cell.linear.kernel.get_raw_value(), \
      model.cell.linear.bias.get_raw_value()
  policed = nnx.jit(lambda m, xs: m(xs)) if jitted else (
      lambda m, xs: m(xs))
  cast = _autocast_fn(case)
  cast = jax.jit(cast) if jitted else cast
  got = policed(model, XS)
  got_autocast = cast(kernel, bias, XS)
  chex.assert_type([got, got_autocast], jnp.float32)  # the output dtype
  chex.assert_trees_all_close(got, got_autocast)
  chex.assert_trees_all_close(got, want, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("case", ["dynamic_update_slice", "scatter"])
def test_a_write_keeps_its_buffers_dtype_under_autocast(case):
  """A bf16 write into a float32 buffer lands in float32 (torch's in-place
  copy): the buffer is not read down to bf16 to take it."""
  jaxpr = jax.make_jaxpr(_autocast_fn(case))(
      jnp.ones((WIDTH, WIDTH)), jnp.zeros((WIDTH,)), XS)
  names = {"dynamic_update_slice": "dynamic_update_slice",
           "scatter": "scatter"}
  writes = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == names[case]]
  assert writes
  for eqn in writes:
    assert eqn.outvars[0].aval.dtype == jnp.float32
    assert all(v.aval.dtype == jnp.float32 for v in eqn.invars
               if jnp.issubdtype(v.aval.dtype, jnp.floating))


LOOPS = ("scan", "while_loop", "fori_loop", "cond", "switch")
AGREED_PRIMITIVES = (jax.lax.dynamic_update_slice_p, jax.lax.concatenate_p,
                     jax.lax.select_n_p, jax.lax.clamp_p, jax.lax.pad_p,
                     jax.lax.scatter_p)


def _patched() -> list:
  return ([p.name for p in AGREED_PRIMITIVES if "bind" in vars(p)]
          + [name for name, f in zip(LOOPS, ORIGINAL_LOOPS)
             if getattr(jax.lax, name) is not f])


ORIGINAL_LOOPS = tuple(getattr(jax.lax, name) for name in LOOPS)


def test_agreement_is_only_in_place_while_tracing_under_rules():
  """Outside the engine's trace, jax's primitives and public loop functions
  are its own again, after a policed call that returned and after one that
  raised, and jax's own checks stand."""
  model = jmp_lab.nnx.with_policy(Model("scan", nnx.Rngs(0)), "mixed_bfloat16")
  model(XS)
  assert _patched() == []
  with pytest.raises(TypeError):
    model(XS[..., :3])  # the Linear refuses the width: an error mid-trace
  assert _patched() == []
  with pytest.raises(TypeError, match="same dtypes"):
    jax.lax.dynamic_update_slice(jnp.zeros((2,), jnp.float32),
                                 jnp.ones((1,), jnp.bfloat16), (0,))


def test_a_bad_scan_body_still_gets_jaxs_own_error():
  """A body that returns no ``(carry, y)`` pair: jax's message, not an
  unpacking error of jmp_lab's."""
  class Bad(nnx.Module):
    def __init__(self, rngs):
      self.cell = Cell(rngs)

    def __call__(self, xs):
      h = jnp.zeros((BATCH, WIDTH), jnp.float32)
      return jax.lax.scan(lambda c, x: self.cell(c, x), h, xs)

  model = jmp_lab.nnx.with_policy(Bad(nnx.Rngs(0)), "mixed_bfloat16")
  with pytest.raises(TypeError, match="scan body output must be a pair"):
    model(XS)


def test_fp32_values_written_into_a_stored_buffer_stay_fp32():
  """Rotary angles built from integers and written into a zeros table stay
  fp32 where they are used (the write's result took the buffer's role,
  and the product with a half activation ran in bf16)."""
  def rotate(kernel, x):
    h = x @ kernel
    angles = jnp.arange(WIDTH // 2, dtype=jnp.float32)[None, :] * 0.37
    table = jnp.ones((BATCH, WIDTH), jnp.float32).at[:, :WIDTH // 2].set(
        jnp.cos(angles))
    return h * table
  jaxpr = jax.make_jaxpr(jmp_lab.autocast(rotate, "mixed_bfloat16"))(
      jnp.ones((WIDTH, WIDTH)), jnp.ones((BATCH, WIDTH))).jaxpr
  (product,) = [e for e in jaxpr.eqns if e.primitive.name == "mul"
                and e.outvars[0].aval.shape == (BATCH, WIDTH)]
  assert product.outvars[0].aval.dtype == jnp.float32


def test_linen_captured_intermediates_keep_their_dtypes():
  """The model's output is cast to the output dtype; what
  ``capture_intermediates`` returns beside it is left as computed (it was
  all cast to float32)."""
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(nn.Dense(8)(x))

  model = jmp_lab.linen.with_policy(Net(), "mixed_bfloat16")
  x = jnp.ones((2, 4))
  variables = Net().init(jax.random.key(0), x)
  out, state = model.apply(variables, x, capture_intermediates=True)
  chex.assert_type(out, jnp.float32)
  chex.assert_type(state["intermediates"]["Dense_0"]["__call__"][0],
                   jnp.bfloat16)
