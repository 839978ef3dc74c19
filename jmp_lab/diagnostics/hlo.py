"""A reader for XLA's optimized HLO text: instructions, shapes, bytes, launches.

:mod:`jmp_lab.diagnostics.compiled` asks a compiled GPU module what it does:
how many kernels it launches, which GEMMs run in which dtypes, which
collectives move which dtypes, and how many bytes cross kernel boundaries.
This module is the parsing half: it turns ``compiled.as_text()`` into
computations of :class:`Instruction` s, with every shape resolved.

Example::

  >>> text = '''
  ... ENTRY %main (a: f32[4,8]) -> f32[4] {
  ...   %a = f32[4,8]{1,0} parameter(0)
  ...   ROOT %r = f32[4]{0} fusion(%a), kind=kInput, calls=%c
  ... }'''
  >>> module = parse_module(text)
  >>> [(i.name, i.opcode, i.result_bytes) for i in module.entry.instructions]
  [('a', 'parameter', 128), ('r', 'fusion', 16)]
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Optional

# Bytes per element of XLA's primitive types.
_ITEMSIZE = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
    "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4,
    "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
    "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e8m0fnu": 1,
    "f4e2m1fn": 0.5,  # NVFP4 values, two to a byte on the GPU
    "token": 0,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Array:
  """One array type, e.g. ``bf16[8,1024]``."""

  dtype: str
  dims: tuple[int, ...]

  @property
  def bytes(self) -> int:
    return int(math.prod(self.dims) * _ITEMSIZE.get(self.dtype, 0))

  def __str__(self) -> str:
    return f"{self.dtype}[{','.join(map(str, self.dims))}]"


def parse_arrays(type_text: str) -> list[Array]:
  """Every array in a (possibly tuple) HLO type, in order."""
  return [Array(dtype, tuple(int(d) for d in dims.split(",") if d))
          for dtype, dims in _ARRAY.findall(type_text)
          if dtype in _ITEMSIZE]


@dataclasses.dataclass
class Instruction:
  """One HLO instruction, with its operands' types resolved."""

  name: str
  opcode: str
  result: list[Array]
  operands: list[str]
  operand_types: list[list[Array]]
  attributes: str
  operand_text: str = ""

  @property
  def result_bytes(self) -> int:
    return sum(a.bytes for a in self.result)

  @property
  def operand_bytes(self) -> int:
    return sum(a.bytes for arrays in self.operand_types for a in arrays)

  @property
  def op_name(self) -> str:
    """jax's name stack for the op (``jit(step)/.../dot_general``), or ''."""
    match = re.search(r'op_name="([^"]*)"', self.attributes)
    return match.group(1) if match else ""

  @property
  def parameter_number(self) -> Optional[int]:
    """For a ``parameter`` instruction, its index."""
    return int(self.operand_text) if self.opcode == "parameter" else None

  def attribute(self, key: str) -> Optional[str]:
    """The value of ``key=...`` (e.g. ``calls``, ``custom_call_target``)."""
    match = re.search(rf"\b{re.escape(key)}=(\"[^\"]*\"|[^,\s]+)",
                      self.attributes)
    return match.group(1).strip('"') if match else None

  def backend_config(self) -> dict:
    """The JSON ``backend_config``, or {}."""
    start = self.attributes.find("backend_config=")
    if start < 0:
      return {}
    text = self.attributes[start + len("backend_config="):]
    if not text.startswith("{"):
      return {}
    try:
      return json.JSONDecoder().raw_decode(text)[0]
    except ValueError:
      return {}


@dataclasses.dataclass
class Computation:
  name: str
  is_entry: bool
  instructions: list[Instruction]


@dataclasses.dataclass
class Module:
  computations: dict[str, Computation]

  @property
  def entry(self) -> Computation:
    return next(c for c in self.computations.values() if c.is_entry)


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")


def _balanced(text: str, start: int) -> int:
  """The index just past the bracket group that opens at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] in "([{":
      depth += 1
    elif text[i] in ")]}":
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


def _parse_instruction(name: str, rest: str, types: dict[str, list[Array]]
                       ) -> Optional[Instruction]:
  if rest.startswith("("):
    end = _balanced(rest, 0)
  else:
    end = rest.find(" ")
  type_text, rest = rest[:end], rest[end:].strip()
  match = re.match(r"([\w\-]+)\(", rest)
  if not match:
    return None
  opcode = match.group(1)
  close = _balanced(rest, match.end() - 1)
  operand_text = rest[match.end():close - 1]
  attributes = rest[close:].lstrip(", ")
  operands = re.findall(r"%([\w.\-]+)", operand_text)
  result = parse_arrays(type_text)
  types[name] = result
  return Instruction(name, opcode, result, operands,
                     [types.get(o, []) for o in operands], attributes,
                     operand_text.strip())


def parse_module(text: str) -> Module:
  """Parses the text of an HLO module (``compiled.as_text()``)."""
  computations: dict[str, Computation] = {}
  current: Optional[Computation] = None
  types: dict[str, list[Array]] = {}
  for line in text.splitlines():
    stripped = line.strip()
    if current is None:
      header = _HEADER.match(stripped)
      if header:
        current = Computation(header.group(2), bool(header.group(1)), [])
        types = {}
        for param in re.finditer(r"([\w.\-]+):\s*(\([^)]*\)|[^,()]+)",
                                 header.group(3)):
          types[param.group(1)] = parse_arrays(param.group(2))
      continue
    if stripped == "}":
      computations[current.name] = current
      current = None
      continue
    match = _INSTRUCTION.match(line)
    if match:
      instruction = _parse_instruction(match.group(1), match.group(2), types)
      if instruction is not None:
        current.instructions.append(instruction)
  return Module(computations)


__all__ = [
    "Array",
    "Computation",
    "Instruction",
    "Module",
    "parse_arrays",
    "parse_module",
]
