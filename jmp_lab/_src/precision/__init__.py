"""The precision engine: rules as data, one planner, one interpreter.

Layers, bottom up (each imports only those below it):

* :mod:`.scopes` -- named scopes that carry decisions through a trace;
* :mod:`.rules` -- op lists, op :class:`~.rules.Rules`, module
  :class:`~.rules.PrecisionRule` s and the policy algebra of islands;
* :mod:`.values` -- each value's role, and casts;
* :mod:`.observers` -- what the interpreter reports, to listeners outside;
* :mod:`.handlers` -- one handler per kind of first-order primitive;
* :mod:`.tracing` and :mod:`.control` -- primitives with sub-jaxprs;
* :mod:`.interpreter` -- the jaxpr interpreter, ``apply_rules``;
* :mod:`.plan` -- the planner: every module-level precision question;
* :mod:`.api` -- ``autocast``; :mod:`.linen`, :mod:`.nnx` -- front ends
  that only apply the plan's answers.
"""

# The handlers register their choosers in the interpreter's table.
from jmp_lab._src.precision import control, handlers  # noqa: E402,F401
