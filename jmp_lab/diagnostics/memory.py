"""Memory: compiled figures, state bytes per parameter, activation bytes.

:func:`memory_row` measures one configuration (a policy and optimizer):
parameter and master bytes and optimizer-state bytes from the params and the
optimizer's state alone, and, where given a loss and a step, the activation
bytes the backward pass keeps and XLA's compiled memory analysis of the step;
:func:`memory_report` puts rows side by side.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jmp_lab.kernels import pytrees
from jmp_lab._src.optim.states import find_state

# --------------------------------------------------------------------------
# Memory report.
# --------------------------------------------------------------------------


def compiled_memory(compiled) -> dict[str, int]:
  """XLA's ``memory_analysis()`` of a compiled function, in bytes.

  Keys: ``argument``, ``output``, ``alias``, ``temp`` and ``peak``. Where the
  backend reports no peak, it is arguments + outputs - aliased + temporaries.
  """
  stats = compiled.memory_analysis()
  if stats is None:
    return {}
  memory = {k: int(getattr(stats, k + "_size_in_bytes", 0)) for k in
            ("argument", "output", "alias", "temp")}
  memory["peak"] = int(getattr(stats, "peak_memory_in_bytes", 0)) or (
      memory["argument"] + memory["output"] - memory["alias"] + memory["temp"])
  return memory


def _leaf_bytes(x: Any) -> int:
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    # A typed PRNG key (e.g. the stochastic-rounding key) has no numpy
    # dtype: count the words it is made of.
    x = jax.eval_shape(jax.random.key_data, x)
  return x.size * np.dtype(x.dtype).itemsize


def _is_floating_leaf(x: Any) -> bool:
  """A floating array, or one's shape and dtype alone (``jax.eval_shape``
  gives them: a model too large to build is counted all the same)."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return jnp.issubdtype(x.dtype, jnp.floating)
  return pytrees.is_floating_array(x)


def _floating_leaves(tree: Any) -> list[Any]:
  return [x for x in jax.tree_util.tree_leaves(tree) if _is_floating_leaf(x)]


def _tree_bytes(tree: Any) -> int:
  return sum(_leaf_bytes(x) for x in jax.tree_util.tree_leaves(tree)
             if hasattr(x, "dtype"))


def activation_bytes(loss_fn: Callable[..., Any], *args) -> int:
  """Bytes the backward pass keeps from the forward pass, minus the inputs.

  These are the residuals ``jax.vjp`` saves (activations, and half copies of
  params made inside the step); arguments themselves are not counted.
  """
  from jax._src.ad_checkpoint import saved_residuals  # no public equivalent
  return sum(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
             for aval, source in saved_residuals(loss_fn, *args)
             if not source.startswith("from the argument"))


@dataclasses.dataclass
class MemoryRow:
  """The memory figures of one configuration (:func:`memory_row`).

  Attributes:
    name: the configuration's name, the table's first column.
    params: how many parameters (elements of the floating param arrays).
    param_bytes: the params plus the fp32 master copy the optimizer stores.
    optimizer_bytes: the rest of the optimizer's state: moments,
      remainders, the loss scale, counters and keys.
    activation_bytes: what the backward pass keeps from the forward pass
      (:func:`activation_bytes`); None without a loss.
    compiled: XLA's memory analysis of the step (:func:`compiled_memory`);
      empty without a step.
    device_peak: the device's ``memory_stats()["peak_bytes_in_use"]`` after
      compiling the step (GPUs report it); None where there is none.
    grad_bytes: the gradients, in the params' dtypes.
  """

  name: str
  params: int
  param_bytes: int
  optimizer_bytes: int
  activation_bytes: Optional[int]
  compiled: dict[str, int]
  device_peak: Optional[int]
  grad_bytes: int = 0

  @property
  def state_bytes_per_param(self) -> float:
    """Params plus optimizer state (master, remainder, moments) per param."""
    return (self.param_bytes + self.optimizer_bytes) / max(self.params, 1)

  @property
  def with_grads_bytes_per_param(self) -> float:
    """:attr:`state_bytes_per_param` plus the gradients (the usual "16
    bytes per parameter" of mixed-precision Adam counts them)."""
    return self.state_bytes_per_param + self.grad_bytes / max(self.params, 1)


# What each argument of memory_row takes, as its errors say it.
_PARAMS_ACCEPTED = ("a pytree of arrays (linen's model.init(...)['params']), "
                    "a flax.nnx.Module or an nnx.State")
_OPT_STATE_ACCEPTED = ("an optax state (tx.init(params)) or an nnx.Optimizer "
                       "(Flax's own or jmp_lab.nnx.Optimizer)")


def _is_transformation(value: Any) -> bool:
  """An optax transformation, or an object with its ``init`` and ``update``
  (as :func:`jmp_lab.mixed_precision` accepts)."""
  return isinstance(value, optax.GradientTransformation) or (
      callable(getattr(value, "init", None))
      and callable(getattr(value, "update", None)))


def _shown(value: Any, width: int = 72) -> str:
  """A bad value as an error names it: its type and its repr on one line,
  cut short (a model's or a tree's repr would fill the screen)."""
  text = " ".join(repr(value).split())
  if len(text) > width:
    text = text[:width - 3] + "..."
  return f"{type(value).__name__} {text}"


def _first_hint(value: Any, hints) -> Optional[str]:
  """The hint of the first ``(test, hint)`` pair whose test ``value``
  passes, or None: what to pass instead of a value that cannot be it."""
  return next((hint for test, hint in hints if test(value)), None)


def _no_value(value: Any) -> bool:
  return value is None or callable(value)


# What to pass instead of a value that cannot be the params.
_PARAMS_HINTS = (
    (lambda v: isinstance(v, nnx.Optimizer),
     "pass the optimizer as opt_state= and its model as params="),
    (lambda v: _is_transformation(v),
     "an optax transformation holds no params: pass the params it trains"),
    (lambda v: isinstance(v, linen.Module),
     "a linen Module holds no arrays: pass model.init(rng, x)['params']"),
    (_no_value, "pass the params themselves"),
)


def _pure_params(params: Any) -> Any:
  """``params`` as a tree of arrays: an NNX model's ``nnx.Param`` values.

  Raises:
    TypeError: for an object that holds no params (an optimizer, a linen
      Module, a function).
    ValueError: for a tree without a floating array.
  """
  if isinstance(params, nnx.Module):
    # Only the params: a model's other variables (batch statistics, RNG
    # counts, caches) are no parameters and get no optimizer state.
    return nnx.as_pure(nnx.state(params, nnx.Param))
  if isinstance(params, nnx.State):
    return nnx.as_pure(params)
  hint = _first_hint(params, _PARAMS_HINTS)
  if hint is not None:
    raise TypeError(f"memory_row's params must be {_PARAMS_ACCEPTED}, got "
                    f"{_shown(params)}; {hint}")
  if not _floating_leaves(params):
    raise ValueError(
        f"memory_row's params hold no floating array, so there is no "
        f"parameter to count: got {_shown(params)}; pass {_PARAMS_ACCEPTED}")
  return params


# What to pass instead of a value that cannot be an optimizer's state.
_OPT_STATE_HINTS = (
    (lambda v: _is_transformation(v),
     "pass the transformation's state, tx.init(params)"),
    (lambda v: isinstance(v, nnx.Module),
     "pass the model as params= and its nnx.Optimizer as opt_state="),
    # nnx.state turns optax's named tuples into dicts, and with them goes
    # what tells the stored master from the moments.
    (lambda v: isinstance(v, nnx.State),
     "pass the nnx.Optimizer itself, whose state keeps optax's structure"),
    (_no_value, "pass tx.init(params), or () for an optimizer without state"),
)


def _optimizer_state(opt_state: Any) -> tuple[Any, Any]:
  """``(every array of the optimizer's state, its optax state)``: the first
  is counted, the second searched for a stored master.

  Raises:
    TypeError: for what is no optimizer state (a transformation, a model).
  """
  if isinstance(opt_state, nnx.Optimizer):
    # The step counter is part of the optimizer's state; the optax state,
    # read as its own attribute, keeps its named tuples for find_state.
    return (nnx.as_pure(nnx.state(opt_state, nnx.OptState)),
            nnx.as_pure(opt_state.opt_state))
  hint = _first_hint(opt_state, _OPT_STATE_HINTS)
  if hint is not None:
    raise TypeError(f"memory_row's opt_state must be {_OPT_STATE_ACCEPTED}, "
                    f"got {_shown(opt_state)}; {hint}")
  return opt_state, opt_state


def _stored_master_bytes(optax_state: Any) -> int:
  """Bytes of the fp32 master as stored (not one rebuilt from a remainder:
  that is the params plus the remainder, each counted where it lives)."""
  try:
    master = find_state(optax_state).master_params
  except ValueError:  # not a jmp_lab optimizer: no master
    return 0
  return _tree_bytes(master) if master is not None else 0


def _check_call(fn: Any, args: Any, fn_name: str, args_name: str) -> None:
  """Raises TypeError unless ``fn`` is None or a function and ``args`` a
  tuple or list of its positional arguments."""
  if fn is None:
    return  # args without their function are not used (a switched-off step)
  if not callable(fn):
    raise TypeError(f"memory_row's {fn_name} must be a function (or None), "
                    f"got {_shown(fn)}")
  if not isinstance(args, (tuple, list)):
    raise TypeError(
        f"memory_row's {args_name} must be a tuple or list of {fn_name}'s "
        f"positional arguments, got {_shown(args)}; a single argument x is "
        f"{args_name}=(x,)")


def _compiled_figures(step: Optional[Callable[..., Any]],
                      step_args: Sequence[Any]
                      ) -> tuple[dict[str, int], Optional[int]]:
  """XLA's memory analysis of ``step`` and the device's peak: ``({}, None)``
  without a step."""
  if step is None:
    return {}, None
  compiled = compiled_memory(jax.jit(step).lower(*step_args).compile())
  device_stats = jax.local_devices()[0].memory_stats() or {}
  return compiled, device_stats.get("peak_bytes_in_use")


def memory_row(name: str, *, params: Any, opt_state: Any,
               loss_fn: Optional[Callable[..., Any]] = None,
               loss_args: Sequence[Any] = (),
               step: Optional[Callable[..., Any]] = None,
               step_args: Sequence[Any] = ()) -> MemoryRow:
  """The memory figures of one configuration: params, optimizer, step.

  The params' and the optimizer state's bytes need only the two themselves.
  An fp32 master the optimizer stores counts with the params
  (``param_bytes``); the rest of its state (moments, a remainder, the loss
  scale, counters) is ``optimizer_bytes``. A loss adds the activation bytes
  the backward pass keeps, a step XLA's memory analysis of its compiled
  program; where either is missing, :func:`memory_report` prints "n/a".

  Args:
    name: the configuration's name, the table's first column.
    params: a pytree of arrays (linen's ``model.init(...)["params"]``), a
      ``flax.nnx.Module`` (its ``nnx.Param`` variables,
      ``nnx.state(model, nnx.Param)``) or an ``nnx.State`` of params (for
      another filter). Its floating arrays are the parameters counted;
      ``jax.ShapeDtypeStruct`` s (``jax.eval_shape``) count as arrays, so a
      model too large to build is measured from its shapes.
    opt_state: the optimizer's state: an optax state (``tx.init(params)``
      of any transformation, :func:`jmp_lab.mixed_precision` or
      :func:`jmp_lab.fused_adamw` among them; or its shapes,
      ``jax.eval_shape(tx.init, params)``), or an ``nnx.Optimizer``
      (Flax's own or :class:`jmp_lab.nnx.Optimizer`: its ``opt_state`` and
      ``step``).
    loss_fn: optional; a function whose residuals :func:`activation_bytes`
      counts, called as ``loss_fn(*loss_args)``.
    loss_args: ``loss_fn``'s positional arguments, a tuple or list; unused
      without ``loss_fn``.
    step: optional; a jittable step compiled on ``step_args`` for
      :func:`compiled_memory` (and the device's peak, on a GPU).
    step_args: ``step``'s positional arguments, a tuple or list; unused
      without ``step``.

  Returns:
    A :class:`MemoryRow`; ``activation_bytes`` is None without ``loss_fn``,
    ``compiled`` empty and ``device_peak`` None without ``step``.

  Raises:
    TypeError: for what is not one of the accepted kinds (the optimizer as
      ``params``, the transformation instead of its state, ``loss_args``
      that are not a tuple), naming the argument and what it takes.
    ValueError: for params without a floating array.

  Example (linen params and an NNX model, bf16 params; no loss, no step)::

    >>> import jax.numpy as jnp, optax, jmp_lab
    >>> from flax import nnx
    >>> policy = "p=bf16,c=bf16,o=f32"
    >>> params = {"w": jnp.zeros((256, 256), jnp.bfloat16),
    ...           "b": jnp.zeros((256,), jnp.bfloat16)}
    >>> tx = jmp_lab.mixed_precision(optax.adamw(1e-3), policy=policy)
    >>> row = jmp_lab.diagnostics.memory_row(
    ...     "fp32 master", params=params, opt_state=tx.init(params))
    >>> f"{row.state_bytes_per_param:.2f}"  # 2 + 4 (master) + 4 + 4 (moments)
    '14.00'
    >>> model = jmp_lab.nnx.with_policy(
    ...     nnx.Linear(256, 256, rngs=nnx.Rngs(0)), policy)
    >>> optimizer = jmp_lab.nnx.Optimizer(model, jmp_lab.fused_adamw(
    ...     1e-3, policy=policy, master="remainder", mu_dtype=jnp.bfloat16,
    ...     nu_dtype=jnp.bfloat16), wrt=nnx.Param)
    >>> nnx_row = jmp_lab.diagnostics.memory_row(
    ...     "nnx remainder", params=model, opt_state=optimizer)
    >>> f"{nnx_row.state_bytes_per_param:.2f}"  # 2 + 2 (remainder) + 2 + 2
    '8.00'
    >>> print(jmp_lab.diagnostics.memory_report([row, nnx_row]).table())
    | config | param+master MiB | optimizer MiB | B/param (params + state) | B/param (+ grads) | activations MiB | compiled args MiB | temp MiB | peak MiB | device peak MiB |
    |---|---|---|---|---|---|---|---|---|---|
    | fp32 master | 0.38 | 0.50 | 14.00 | 16.00 | n/a | n/a | n/a | n/a | n/a |
    | nnx remainder | 0.13 | 0.38 | 8.00 | 10.00 | n/a | n/a | n/a | n/a | n/a |
  """
  if not isinstance(name, str):
    raise TypeError(f"memory_row's name must be a str (the table's first "
                    f"column), got {_shown(name)}")
  params = _pure_params(params)
  state_arrays, optax_state = _optimizer_state(opt_state)
  _check_call(loss_fn, loss_args, "loss_fn", "loss_args")
  _check_call(step, step_args, "step", "step_args")
  master_bytes = _stored_master_bytes(optax_state)
  floating = _floating_leaves(params)
  compiled, peak = _compiled_figures(step, step_args)
  return MemoryRow(
      name=name, params=sum(x.size for x in floating),
      param_bytes=_tree_bytes(params) + master_bytes,
      optimizer_bytes=_tree_bytes(state_arrays) - master_bytes,
      activation_bytes=(None if loss_fn is None
                        else activation_bytes(loss_fn, *loss_args)),
      compiled=compiled, device_peak=peak, grad_bytes=_tree_bytes(floating))


@dataclasses.dataclass
class MemoryReport:
  """Memory rows side by side (see :func:`memory_report`)."""

  rows: list[MemoryRow]

  def table(self) -> str:
    """A markdown table, one row per configuration."""
    return _memory_table(self.rows)

  def __str__(self) -> str:
    return self.table()


def memory_report(rows: Sequence[MemoryRow]) -> MemoryReport:
  """The :class:`MemoryRow` s of several configurations, as one report."""
  return MemoryReport(list(rows))


def _mib(n_bytes: Optional[int]) -> str:
  """Bytes as MiB; "n/a" where there is no figure (0.00 would read as a
  measured zero)."""
  return "n/a" if n_bytes is None else f"{n_bytes / 2**20:.2f}"


def _memory_table(rows: Sequence[MemoryRow]) -> str:
  lines = ["| config | param+master MiB | optimizer MiB "
           "| B/param (params + state) | B/param (+ grads) "
           "| activations MiB | compiled args MiB | temp MiB | peak MiB "
           "| device peak MiB |", "|" + "---|" * 10]
  for r in rows:
    c = r.compiled
    # Two decimals: 8-bit moments' block scales are 0.03 B/param (6.03).
    lines.append(
        f"| {r.name} | {_mib(r.param_bytes)} | {_mib(r.optimizer_bytes)} | "
        f"{r.state_bytes_per_param:.2f} | "
        f"{r.with_grads_bytes_per_param:.2f} | "
        f"{_mib(r.activation_bytes)} | {_mib(c.get('argument'))} | "
        f"{_mib(c.get('temp'))} | {_mib(c.get('peak'))} | "
        # A backend without peak tracking reports nothing or 0.
        f"{_mib(r.device_peak or None)} |")
  return "\n".join(lines)


__all__ = [
    "activation_bytes",
    "compiled_memory",
    "memory_report",
    "memory_row",
    "MemoryReport",
    "MemoryRow",
]
