"""What the examples share: their command-line checks and their text."""

import argparse
import glob
import os
import sysconfig

import jmp_lab


def policy_spec(text: str) -> str:
  """An argparse ``type`` for ``--policy``: the spec, checked.

  A typo is an argparse error with jmp_lab's message (the presets, and the
  closest name), not a traceback.
  """
  try:
    jmp_lab.get_policy(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return text


POLICY_HELP = ("a preset (float32, mixed_bfloat16, mixed_float16, mixed_fp8) "
               "or a spec such as p=bf16,c=bf16,o=f32")


def stdlib_text(max_bytes: int = 4_000_000) -> bytes:
  """The first ``max_bytes`` of the Python standard library's ``*.py``
  sources, in sorted file order: real text every Python install has."""
  stdlib = sysconfig.get_paths()["stdlib"]
  chunks, total = [], 0
  for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
    with open(path, "rb") as f:
      chunk = f.read()
    chunks.append(chunk)
    total += len(chunk)
    if total >= max_bytes:
      break
  return b"".join(chunks)[:max_bytes]
