"""Ops whose inputs must share a dtype, traced under a policy.

A front end (``with_policy``, linen or NNX) casts at trace time: a layer's
output comes out in the compute dtype. Code that hands such a value to an op
that insists on one dtype for several inputs then fails in jax's own type
check, before the engine sees a program. Public model code does it: a
float32 KV cache passed in from outside and written with
``lax.dynamic_update_slice``, an RNN's float32 initial carry, a
``lax.cond`` whose other branch returns an fp32 value.

In the program as written every such input had one dtype. While the engine
traces (:func:`agreeing`), the inputs the policy made differ are cast so the
trace type-checks, inside :func:`~.scopes.agreement_cast_scope`:

* a write into a buffer (``dynamic_update_slice``, the ``scatter``
  family): the written value takes the buffer's dtype, as torch.autocast's
  in-place copies do; ``pad``'s padding value takes its operand's;
* the operands of ``concatenate``, ``select_n`` and ``clamp``, and the
  outputs of ``cond``/``switch`` branches (where jax refused them as
  traced): the widest dtype among them, the one jnp's promotion gives;
* a loop's carry (``scan``, ``while_loop``, ``fori_loop``): the initial
  value's dtype.

The interpreter then drops these casts (``handlers.convert``): the op's own
rule chooses its dtypes, as it does under :func:`jmp_lab.autocast`, where
the program is traced as written. So every route gives one program: a write
keeps its buffer's dtype (``handlers.into_destination``), a loop carries the
dtype its body computes (``control.scan``).

JAX has no dispatch hook like torch's autocast key. A primitive's ``bind``
is the one place every ``lax`` call of a first-order op passes, so that is
where the operands are agreed; loops and branches check their carries in
Python before they bind anything, so their public functions (``jax.lax.scan``
and the rest, which Flax's own ``nn.scan`` and ``nnx.scan`` call) are
wrapped. Both act only on the thread that is tracing under the rules, and
are in place only while some thread is. One way out remains: a function
jitted by the code, first traced inside a policed call, keeps the agreed
program in jax's cache, and a later call outside the policy with the same
mismatched types gets that program rather than jax's type error.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lab._nesting import Nesting
from jmp_lab._src.precision import scopes
from jmp_lab._src.precision.scopes import is_floating

_AGREEING = Nesting()
_LOCK = threading.Lock()
_INSTALLED = {"count": 0}


def _floating(x: Any) -> bool:
  return is_floating(getattr(x, "dtype", None))


def _agreed(x: Any, dtype: Any) -> Any:
  """``x`` in ``dtype``: a floating value of another dtype is cast inside
  the agreement scope; anything else is returned as it is."""
  if not _floating(x) or np.dtype(x.dtype) == np.dtype(dtype):
    return x
  with scopes.agreement_cast_scope():
    return jax.lax.convert_element_type(x, dtype)


def _widest(values) -> Any:
  """The promoted dtype of the floating ``values`` (None: none is)."""
  dtypes = [v.dtype for v in values if _floating(v)]
  return functools.reduce(jnp.promote_types, dtypes) if dtypes else None


def like(new: Any, reference: Any) -> Any:
  """``new``'s floating leaves in the dtypes of ``reference``'s (a loop's
  carry in its initial value's dtypes); trees of another structure are
  returned as they are, for jax to report."""
  new_leaves, new_tree = jax.tree_util.tree_flatten(new)
  ref_leaves, ref_tree = jax.tree_util.tree_flatten(reference)
  if new_tree != ref_tree:
    return new
  return new_tree.unflatten([
      _agreed(n, r.dtype) if _floating(r) else n
      for n, r in zip(new_leaves, ref_leaves)])


# ---- first-order ops: their operands at bind --------------------------------


def _into_buffer(buffer_index: int, value_index: int) -> Callable:
  def agree(args):
    args = list(args)
    if _floating(args[buffer_index]):
      args[value_index] = _agreed(args[value_index], args[buffer_index].dtype)
    return args
  return agree


def _widest_of(first: int, last: int | None = None) -> Callable:
  def agree(args):
    args = list(args)
    chosen = args[first:last]
    dtype = _widest(chosen)
    if dtype is not None:
      stop = len(args) if last is None else last
      args[first:stop] = [_agreed(x, dtype) for x in chosen]
    return args
  return agree


def _first_order_rules() -> dict:
  lax = jax.lax
  rules = {
      lax.dynamic_update_slice_p: _into_buffer(0, 1),
      lax.pad_p: _into_buffer(0, 1),
      lax.concatenate_p: _widest_of(0),
      lax.select_n_p: _widest_of(1),
      lax.clamp_p: _widest_of(0),
  }
  for name in ("scatter_p", "scatter_add_p", "scatter_sub_p", "scatter_mul_p",
               "scatter_min_p", "scatter_max_p"):
    primitive = getattr(lax, name, None)
    if primitive is not None:
      rules[primitive] = _into_buffer(0, 2)
  return rules


def _agreeing_bind(primitive, rule: Callable) -> Callable:
  bind = type(primitive).bind

  @functools.wraps(bind)
  def agreeing_bind(*args, **params):
    if _AGREEING.active:
      args = rule(args)
    return bind(primitive, *args, **params)
  return agreeing_bind


# ---- loops and branches: their carries and outputs --------------------------


def _scan(scan):
  @functools.wraps(scan)
  def agreeing_scan(f, init, xs=None, *args, **kwargs):
    if not _AGREEING.active:
      return scan(f, init, xs, *args, **kwargs)

    def body(carry, x):
      out = f(carry, x)
      if not (isinstance(out, (tuple, list)) and len(out) == 2):
        return out  # not a (carry, y) pair: jax says what is wrong
      return like(out[0], carry), out[1]
    return scan(body, init, xs, *args, **kwargs)
  return agreeing_scan


def _while_loop(while_loop):
  @functools.wraps(while_loop)
  def agreeing_while_loop(cond_fun, body_fun, init_val):
    if not _AGREEING.active:
      return while_loop(cond_fun, body_fun, init_val)
    return while_loop(cond_fun, lambda c: like(body_fun(c), c), init_val)
  return agreeing_while_loop


def _fori_loop(fori_loop):
  @functools.wraps(fori_loop)
  def agreeing_fori_loop(lower, upper, body_fun, init_val, **kwargs):
    if not _AGREEING.active:
      return fori_loop(lower, upper, body_fun, init_val, **kwargs)
    return fori_loop(lower, upper, lambda i, c: like(body_fun(i, c), c),
                     init_val, **kwargs)
  return agreeing_fori_loop


def _branches_agreed(branches, operands) -> list:
  """The branches, each casting its floating outputs to the widest dtype
  any branch gives that output (the branches as they are where their
  outputs cannot be found abstractly)."""
  try:
    shapes = [jax.eval_shape(b, *operands) for b in branches]
  except Exception:  # noqa: BLE001 (jax reports the branches' own error)
    return list(branches)
  flat = [jax.tree_util.tree_flatten(s) for s in shapes]
  if any(tree != flat[0][1] for _, tree in flat):
    return list(branches)
  targets = [_widest(outs) for outs in zip(*[leaves for leaves, _ in flat])]

  def agreed(branch):
    def run(*args):
      leaves, tree = jax.tree_util.tree_flatten(branch(*args))
      return tree.unflatten([x if t is None else _agreed(x, t)
                             for x, t in zip(leaves, targets)])
    return run
  return [agreed(b) for b in branches]


def _cond(cond):
  @functools.wraps(cond)
  def agreeing_cond(pred, true_fun, false_fun, *operands, **kwargs):
    if not operands and set(kwargs) == {"operand"}:  # jax's older form
      operands, kwargs = (kwargs["operand"],), {}
    try:
      return cond(pred, true_fun, false_fun, *operands, **kwargs)
    except TypeError:
      # Branches are traced again only where they disagreed: tracing a
      # branch twice is not free (nor, for some code, without effects).
      if not _AGREEING.active or kwargs:
        raise
    true_fun, false_fun = _branches_agreed((true_fun, false_fun), operands)
    return cond(pred, true_fun, false_fun, *operands)
  return agreeing_cond


def _switch(switch):
  @functools.wraps(switch)
  def agreeing_switch(index, branches, *operands, **kwargs):
    if not operands and set(kwargs) == {"operand"}:
      operands, kwargs = (kwargs["operand"],), {}
    try:
      return switch(index, branches, *operands, **kwargs)
    except TypeError:
      if not _AGREEING.active or kwargs:
        raise
    return switch(index, _branches_agreed(branches, operands), *operands)
  return agreeing_switch


_LOOPS = {"scan": _scan, "while_loop": _while_loop, "fori_loop": _fori_loop,
          "cond": _cond, "switch": _switch}


def _install() -> list[Callable[[], None]]:
  """Puts the agreeing versions in place; returns how to undo it."""
  undo = []
  for primitive, rule in _first_order_rules().items():
    primitive.bind = _agreeing_bind(primitive, rule)
    undo.append(functools.partial(vars(primitive).pop, "bind", None))
  for name, wrap in _LOOPS.items():
    original = getattr(jax.lax, name)
    setattr(jax.lax, name, wrap(original))
    undo.append(functools.partial(setattr, jax.lax, name, original))
  return undo


_UNDO: list = []


@contextlib.contextmanager
def agreeing():
  """While the calling thread traces inside, ops whose inputs must share a
  dtype get them agreed (see the module doc)."""
  with _LOCK:
    if _INSTALLED["count"] == 0:
      _UNDO[:] = _install()
    _INSTALLED["count"] += 1
  try:
    with _AGREEING.enter():
      yield
  finally:
    with _LOCK:
      _INSTALLED["count"] -= 1
      if _INSTALLED["count"] == 0:
        for undo in reversed(_UNDO):
          undo()
        _UNDO.clear()


__all__ = ["agreeing", "like"]
