"""Precision rules as data: which ops and which modules compute in what.

Two kinds of rules, both data:

* **Op rules** (:class:`Rules`): which primitives are matmuls, which run in
  fp32 (:data:`FP32_OPS`), which compute in the compute dtype
  (:data:`COMPUTE_OPS`), and which named-scope paths run as written. The
  interpreter (:mod:`.interpreter`) applies them to every op.
* **Module rules** (:class:`PrecisionRule`): an ordered list, first match
  wins, each matching a module by a path regex, a class, a class-name
  pattern or a predicate, and saying what the module does: compute in a
  policy, be an fp32 island, keep its own ``dtype``, run as written, or run
  its matmuls in fp8. :func:`rules_from_options` builds them from the
  ``with_policy`` keyword arguments. The planner (:mod:`.plan`) reads them.

Modelled on qwix's ``QuantizationRule`` (first match wins) and on
``torch.autocast``'s per-op lists.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import jax.numpy as jnp
import numpy as np

from jmp_lab._src.policy import (BLOCK_SCALED_MODES, MATMUL_MODES, Policy,
                                 canonicalize_dtype, get_policy,
                                 is_norm_class, layer_dtype)
from jmp_lab._src.precision import scopes
from jmp_lab._src.precision.ops import COMPUTE_OPS, FP32_OPS, MATMUL_OPS
from jmp_lab._src.user_warnings import user_stacklevel

PolicySpec = Union[Policy, str]

_KNOWN_OPS = COMPUTE_OPS | FP32_OPS | MATMUL_OPS


@dataclasses.dataclass(frozen=True)
class Rules:
  """The op rules :func:`jmp_lab.autocast` applies (see :mod:`jmp_lab.precision`).

  Attributes:
    compute_dtype: the compute dtype outside any :func:`~jmp_lab.precision.scope`.
    fp32_ops: primitive names that run in fp32 from half inputs.
    exclude: compiled regular expressions over named-scope paths; an op
      under a matching path runs as written.
    island: the region outside any scope is an fp32 island whose matmuls
      run in ``compute_dtype`` (how a train step runs its loss).
    block_scaled: ``"mxfp8"`` or ``"nvfp4"``: in every half region, weight
      matmuls are block-scaled (:class:`~jmp_lab.precision.Region`), or None.
  """

  compute_dtype: np.dtype
  fp32_ops: frozenset = FP32_OPS
  exclude: tuple = ()
  island: bool = False
  block_scaled: Optional[str] = None

  @property
  def default_region(self) -> scopes.Region:
    if self.island:
      return scopes.Region.island(self.compute_dtype)
    return scopes.Region.of(self.compute_dtype)

  def region(self, path: tuple[str, ...]) -> scopes.Region:
    """The region of an op at named-scope ``path``: excluded paths run as
    written, else the innermost scope wins, else the default."""
    if self.exclude:
      joined = scopes.user_path(path)
      if any(pattern.search(joined) for pattern in self.exclude):
        return scopes.AS_WRITTEN
    region = scopes.innermost_region(path)
    region = self.default_region if region is None else region
    if self.block_scaled is not None and region.compute is not None:
      return dataclasses.replace(region, block_scaled=self.block_scaled)
    return region

  def compute_for(self, path: tuple[str, ...]) -> Optional[np.dtype]:
    """The half dtype ops at ``path`` compute in, or None (as written)."""
    return self.region(path).compute


def make_rules(compute_dtype: Any, *, fp32_ops: Optional[Iterable[str]] = None,
               extra_fp32_ops: Iterable[str] = (),
               exclude: Union[str, Iterable[str], None] = None,
               island: bool = False,
               block_scaled: Optional[str] = None) -> Rules:
  """Checked :class:`Rules`; see :func:`jmp_lab.autocast` for the arguments.

  >>> import jax.numpy as jnp
  >>> rules = make_rules(jnp.bfloat16, extra_fp32_ops=["tanh"], exclude="head")
  >>> "tanh" in rules.fp32_ops, rules.compute_for(("model", "head"))
  (True, None)
  """
  compute_dtype = canonicalize_dtype(compute_dtype, what="compute_dtype")
  ops = FP32_OPS if fp32_ops is None else _op_names(fp32_ops, "fp32_ops")
  ops = ops | _op_names(extra_fp32_ops, "extra_fp32_ops")
  if block_scaled not in (None, *BLOCK_SCALED_MODES):
    raise ValueError(f"block_scaled must be None or one of "
                     f"{', '.join(BLOCK_SCALED_MODES)}, got {block_scaled!r}")
  return Rules(compute_dtype, frozenset(ops), _patterns(exclude, "exclude"),
               bool(island), block_scaled)


def _patterns(patterns: Union[str, Iterable[str], None], what: str) -> tuple:
  if isinstance(patterns, str):
    patterns = (patterns,)
  compiled = []
  for pattern in patterns or ():
    if not isinstance(pattern, str):
      raise TypeError(f"{what} must hold regular expressions (str), got "
                      f"{type(pattern).__name__} {pattern!r}")
    compiled.append(_compiled(pattern, what))
  return tuple(compiled)


def _compiled(pattern: str, what: str) -> re.Pattern:
  try:
    return re.compile(pattern)
  except re.error as e:
    raise ValueError(f"invalid {what} pattern {pattern!r}: {e}") from None


def _op_names(names: Iterable[str], what: str) -> frozenset:
  if isinstance(names, str):
    names = (names,)
  names = tuple(names)
  unknown = [n for n in names if not isinstance(n, str) or n not in _KNOWN_OPS]
  if unknown:
    raise ValueError(
        f"{what} has unknown primitive names {unknown!r}; accepted: "
        f"{', '.join(sorted((COMPUTE_OPS | FP32_OPS) - {'copy_p'}))}")
  return frozenset(names)


# ---------------------------------------------------------------------------
# Module rules.
# ---------------------------------------------------------------------------

#: The keyword actions of a :class:`PrecisionRule` (besides a policy):
#: ``"fp32"``: an fp32 island (params in the param dtype, computation in
#: fp32, the output handed back in the compute dtype); ``"layer_dtype"``:
#: the layer computes in its own ``dtype`` (a rule with it matches only
#: layers that set one); ``"as_written"``: no casts and no op rules;
#: ``"fp8"``/``"fp8_current"``: the policy's Dense/Linear matmuls in fp8;
#: ``"mxfp8"``/``"nvfp4"``: block-scaled (:mod:`jmp_lab.block_scaled`);
#: ``"reduce"``: computes in the reduce dtype (an embedding table whose
#: gradient is summed in it) and hands back the compute dtype.
ACTIONS = ("fp32", "layer_dtype", "as_written", "fp8", "fp8_current", "mxfp8",
           "nvfp4", "reduce")

#: What an ``"as_written"`` rule resolves to.
AS_WRITTEN = "as_written"


def fp32_island(policy: Policy) -> Policy:
  """The policy of an fp32 island (e.g. a norm) inside ``policy``.

  It keeps params in ``policy.param_dtype``, computes in fp32 and hands its
  output back in ``policy.compute_dtype``, so the half-precision activations
  around it stay half precision.
  """
  return Policy(policy.param_dtype, jnp.float32, policy.compute_dtype,
                policy.reduce_dtype)


def layer_island(policy: Policy, dtype: Any) -> Policy:
  """The policy of a layer that keeps its own ``dtype`` (``with_policy(...,
  keep_layer_dtypes=True)``): it computes in ``dtype`` and hands its output
  back in the compute dtype."""
  return Policy(policy.param_dtype, dtype, policy.compute_dtype,
                policy.reduce_dtype)


def reduce_island(policy: Policy) -> Policy:
  """The policy of an embedding under a policy with a reduce dtype: the table
  is read in the reduce dtype (its gradient, a scatter-add of rows, is
  accumulated and summed across devices in it) and the rows are handed on
  in the compute dtype."""
  return Policy(policy.param_dtype, policy.reduce_dtype, policy.compute_dtype,
                policy.reduce_dtype)


@dataclasses.dataclass(frozen=True)
class PrecisionRule:
  """One module rule: which modules it matches and what they do.

  A module matches when every matcher given matches it. Rules are tried in
  order, first match wins; a module no rule matches takes its nearest
  matched parent's answer, else the policy's. A rule with only ``path`` also
  matches params by their path (``"head/kernel"``): such a param is read in
  the rule's compute dtype.

  Attributes:
    action: a policy (or its spec) the module computes in, or one of
      :data:`ACTIONS`.
    path: a regular expression, ``re.search``-ed against the module path
      (``"Block_0/Dense_1"``, NNX: ``"blocks/0/mlp"``).
    cls: a class (or tuple of classes); the module must be an instance.
    class_name: a regular expression ``re.search``-ed against the module's
      class name.
    predicate: a function of the module returning a bool.

  Example::

    >>> import flax.linen as nn, jmp_lab
    >>> rules = [jmp_lab.precision.PrecisionRule("float32", path="^head$"),
    ...          jmp_lab.precision.PrecisionRule("fp32", cls=nn.Dense)]
    >>> model = jmp_lab.linen.with_policy(nn.Dense(3), "mixed_bfloat16",
    ...                                   rules=rules)
  """

  action: Union[Policy, str]
  path: Optional[str] = None
  cls: Union[type, tuple[type, ...], None] = None
  class_name: Optional[str] = None
  predicate: Optional[Callable[[Any], bool]] = None

  def __post_init__(self):
    if all(m is None for m in (self.path, self.cls, self.class_name,
                               self.predicate)):
      raise ValueError("a PrecisionRule needs a matcher: path=, cls=, "
                       "class_name= or predicate=")
    for name in ("path", "class_name"):
      value = getattr(self, name)
      if value is not None and not isinstance(value, str):
        raise TypeError(f"PrecisionRule {name} must be a regular expression "
                        f"(str), got {type(value).__name__} {value!r}")
      if value is not None:
        _compiled(value, f"PrecisionRule {name}")
    classes = self.cls if isinstance(self.cls, tuple) else (self.cls,)
    if self.cls is not None and not all(isinstance(c, type) for c in classes):
      raise TypeError(f"PrecisionRule cls must be a class or a tuple of "
                      f"classes, got {self.cls!r}")
    if self.predicate is not None and not callable(self.predicate):
      raise TypeError(f"PrecisionRule predicate must be callable, got "
                      f"{self.predicate!r}")
    if not (isinstance(self.action, str) and self.action in ACTIONS):
      get_policy(self.action)  # raises for a bad spec, naming it

  @property
  def matches_params(self) -> bool:
    return self.path is not None and self.cls is None and (
        self.class_name is None and self.predicate is None)

  def matches(self, path: str, module: Any) -> bool:
    """Whether the module ``module`` at ``path`` matches."""
    cls = getattr(type(module), "_jmp_lab_base", type(module))
    if self.path is not None and not (path and re.search(self.path, path)):
      return False
    if self.cls is not None and not issubclass(cls, self.cls):
      return False
    if self.class_name is not None and not re.search(self.class_name,
                                                     cls.__name__):
      return False
    if self.predicate is not None and not self.predicate(module):
      return False
    if self.action == "layer_dtype" and layer_dtype(module) is None:
      return False
    return True

  def resolve(self, base: Policy, module: Any = None
              ) -> Union[Policy, str]:
    """The policy this rule gives a module under ``base`` (or
    :data:`AS_WRITTEN`)."""
    if self.action == "fp32":
      return fp32_island(base)
    if self.action == "layer_dtype":
      return layer_island(base, layer_dtype(module))
    if self.action == AS_WRITTEN:
      return AS_WRITTEN
    if self.action in MATMUL_MODES:
      return dataclasses.replace(base, matmul=self.action)
    if self.action == "reduce":
      return reduce_island(base) if base.reduce_dtype is not None else base
    return get_policy(self.action)


def _is_norm(module: Any) -> bool:
  return is_norm_class(getattr(type(module), "_jmp_lab_base", type(module)))


def _mapping(given: Any, name: str, example: str) -> Iterable[tuple]:
  """The items of an overrides argument: a mapping, or None for none."""
  if given is None:
    return ()
  if not isinstance(given, Mapping):
    raise TypeError(f"{name} must be a mapping (a dict such as {example}), "
                    f"got {type(given).__name__} {given!r}")
  return given.items()


def rules_from_options(
    policy: Policy, *, rules: Iterable[PrecisionRule] = (),
    class_overrides: Optional[Mapping[type, PolicySpec]] = None,
    path_overrides: Optional[Mapping[str, PolicySpec]] = None,
    fp32_norms: bool = True, keep_layer_dtypes: bool = False,
    embed_classes: tuple[type, ...] = ()) -> tuple[PrecisionRule, ...]:
  """The module rules a ``with_policy`` call means, in order.

  ``rules`` first, then ``path_overrides`` (module and param paths), then
  ``class_overrides``, then the defaults: every class whose name ends in
  ``Norm`` (:func:`jmp_lab.policy.is_norm_class`) is an fp32 island
  (``fp32_norms``), an embedding reads its table in the reduce dtype (when
  the policy has one), and a layer with its own ``dtype`` computes in it
  (``keep_layer_dtypes``).

  Raises:
    TypeError: overrides that are not a mapping, a ``class_overrides`` key
      that is not a class, a rule that is not a :class:`PrecisionRule`, a
      flag that is not a bool.
    ValueError: a bad policy spec or an invalid regular expression.
  """
  for name, flag in (("fp32_norms", fp32_norms),
                     ("keep_layer_dtypes", keep_layer_dtypes)):
    if not isinstance(flag, bool):
      raise TypeError(f"{name} must be a bool, got {flag!r}")
  found = []
  for rule in rules:
    if not isinstance(rule, PrecisionRule):
      raise TypeError(f"rules must hold jmp_lab.precision.PrecisionRule, got "
                      f"{type(rule).__name__} {rule!r}")
    found.append(rule)
  for pattern, spec in _mapping(path_overrides, "path_overrides",
                                "{'head': 'mixed_bfloat16'}"):
    _compiled(pattern, "path_overrides")
    found.append(PrecisionRule(get_policy(spec), path=pattern))
  for cls, spec in _mapping(class_overrides, "class_overrides",
                            "{nn.Dense: 'float32'}"):
    if not isinstance(cls, type):
      raise TypeError(f"class_overrides keys must be classes, got {cls!r}")
    found.append(PrecisionRule(get_policy(spec), cls=cls))
  if fp32_norms:
    found.append(PrecisionRule("fp32", predicate=_is_norm))
  if policy.reduce_dtype is not None and embed_classes:
    found.append(PrecisionRule("reduce", cls=tuple(embed_classes)))
  if keep_layer_dtypes:
    found.append(PrecisionRule("layer_dtype", predicate=lambda m: True))
  return tuple(found)


def unmatched_path_overrides(rules: Iterable[PrecisionRule],
                             paths: Iterable[str]) -> list[str]:
  """The patterns of the path-only rules (``path_overrides``, or a
  :class:`PrecisionRule` with only ``path``) that match none of ``paths``
  (a model's module and param paths): overrides that change nothing, most
  often a misspelt name.

  >>> rules = rules_from_options(get_policy("mixed_bfloat16"),
  ...                            path_overrides={"head": "float32",
  ...                                            "haed": "float32"})
  >>> unmatched_path_overrides(rules, ["Dense_0", "head", "head/kernel"])
  ['haed']
  """
  paths = [p for p in paths if p]
  return [rule.path for rule in rules if rule.matches_params
          and not any(re.search(rule.path, p) for p in paths)]


def warn_unmatched_path_overrides(rules: Iterable[PrecisionRule],
                                  paths: Iterable[str], model: str) -> None:
  """Warns once for each of :func:`unmatched_path_overrides`, naming the
  pattern and a few of ``model``'s paths, at the user's line."""
  paths = sorted({p for p in paths if p}, key=lambda p: (p.count("/"), p))
  for pattern in unmatched_path_overrides(rules, paths):
    examples = ", ".join(repr(p) for p in paths[:4])
    warnings.warn(
        f"path override {pattern!r} matches no module or param path of "
        f"{model}, so it changes nothing (a regular expression, searched in "
        f"each path; this model's include {examples})",
        stacklevel=user_stacklevel())
