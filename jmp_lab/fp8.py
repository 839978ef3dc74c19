"""fp8 matmuls with per-tensor scaling, for Hopper's fp8 tensor cores.

A policy with ``matmul="fp8"`` (the ``"mixed_fp8"`` preset) or
``"fp8_current"`` runs the Dense/Linear (and Einsum) matmuls of
:func:`jmp_lab.linen.with_policy` and :func:`jmp_lab.nnx.with_policy` through
:func:`dot_general` (:func:`einsum`): the inputs
and kernels are quantized to E4M3 and the output gradient to E5M2, each
divided by its own scale. The matmul itself is written as
quantize-dequantize around a ``dot_general`` in the compute dtype; XLA's GPU
compiler rewrites that pattern into one fp8 cuBLASLt GEMM with the scales
folded in (forward, input gradient and weight gradient alike), and on a CPU
the same program emulates it. It is built on Flax's ``fp8_ops`` (``in_qdq``
and ``out_qdq``, the functions behind ``Fp8DotGeneralOp``) rather than
``jax.nn.scaled_dot_general``, which takes per-block scales (MX formats,
Blackwell) rather than Hopper's per-tensor ones.

**Every product's backward is written out** (a ``custom_vjp``, both
scalings): the forward's fp8 operands are the residuals the backward reads,
so its GEMMs are fp8 under ``nn.scan`` too, and the kernel is quantized
where it lies and laid out for its GEMM as fp8 (under FSDP: gathered as
fp8, once in the forward and, with remat, once in the backward, where the
recomputed forward and the input-gradient GEMM share it). **A Dense
layer's** (a ``dot_general`` of ``lhs``'s last axes with the kernel's
first, as flax's Dense and DenseGeneral and NNX's Linear and LinearGeneral
call it) quantizes its output gradient once into the two fp8 layouts its
gradient GEMMs read (the weight gradient's with the token axis innermost,
as Hopper's fp8 GEMMs read both operands): under delayed scaling by the
Pallas Triton kernel of :mod:`jmp_lab.kernels.cast_transpose` in a step
compiled for CUDA, where XLA wrote the transposed copy in a second pass
over the first. Other products (einsums, batched dot_generals) are
differentiated by transposing the product at the dequantized operands.

**Scaling.** Transformer Engine's scale is ``fp8_max / amax``; the stored
``*_scale`` here is its reciprocal, ``amax / fp8_max`` (what a value is
multiplied by after quantization), as in Flax's ``fp8_ops``:

* ``"fp8"`` -- delayed scaling (TE's default): each tensor is quantized
  with the scale stored in its state, which the previous step computed as
  ``max(amax_history) / fp8_max`` (history length 1,024 by default); the
  step observes the tensor's own amax, and the train step then writes it
  into the history (a ring buffer) and computes the next scale, for all
  the model's tensors at once (:func:`next_meta`). The state is a :data:`Fp8Meta` dict per
  matmul: three scales and three histories.
* ``"fp8_current"`` -- current scaling: each tensor is scaled by its own
  amax, computed just before quantizing (one more read of it); no state.

**The state's gradient is an observation.** What ``jax.grad`` returns for
a matmul's state holds what this step saw of each tensor: its amax is the
largest value in the tensor's ``*_scale`` and ``*_amax_history`` slots
(the history slot holds the maxima of the tensor's parts, one per history
entry, when the tensor splits evenly; else the scale slot holds the amax).
It never reaches the optimizer:
linen keeps the state in the ``_overwrite_with_gradient`` collection
(:data:`COLLECTION`, Flax's name) of ``TrainState.model_state``, NNX in
:class:`jmp_lab.nnx.Fp8State` variables, and both train steps differentiate it and
replace it with :func:`next_meta` of it. Doing the history and scale
arithmetic there, for every tensor of the model together, rather than inside
each matmul's forward and backward (as Flax's ``fp8_ops`` do), lets XLA
compile it into a few kernels (Transformer Engine updates its scaling state
in one multi-tensor kernel for the same reason), and leaves each matmul one
amax reduction per operand, which XLA compiles into the kernel that
quantizes the operand (see ``quantize`` in
``jmp_lab/_src/numerics/fp8_quantize.py`` and ``benchmarks/fp8_breakdown.py``). On a
skipped (non-finite) step the state keeps its old value, like every other
state: an inf recorded in an amax history would pin that tensor's scale for
the next 1,024 steps. Since quantizing saturates
(an inf activation becomes the format's maximum, and the gradients can stay
finite), a step whose observed amax is not finite is skipped too
(:func:`skip_unless_finite`).

Example::

  >>> import jax, jax.numpy as jnp
  >>> from jmp_lab import fp8
  >>> meta = fp8.init_meta(history_length=4)
  >>> x, w = jnp.full((16, 32), 3.0, jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)
  >>> y, new_meta = fp8.value_and_new_meta(
  ...     lambda m: fp8.dot_general(x, w, (((1,), (0,)), ((), ())), meta=m).sum(),
  ...     meta, step=0)
  >>> float(new_meta["input_amax_history"][0])   # this step's amax of x
  3.0
  >>> round(float(new_meta["input_scale"]) * 448, 6)  # next step's: 3 / fp8_max
  3.0
"""
from jmp_lab._src.numerics.fp8_matmul import (current_dot_general,
                                              current_einsum,
                                              delayed_dot_general,
                                              delayed_einsum, dot_general,
                                              einsum, operands_in)
from jmp_lab._src.numerics.fp8_quantize import (observed_finite,
                                                quantize_operands,
                                                quantize_output_gradient)
from jmp_lab._src.numerics.fp8_state import (delayed_scale, init_meta,
                                             next_meta, rescale,
                                             value_and_new_meta, write_amaxes)

from jmp_lab._src.numerics import fp8_state as _impl

#: The fp8 format of inputs and kernels (``jnp.float8_e4m3fn``).
E4M3 = _impl.E4M3
#: The fp8 format of output gradients (``jnp.float8_e5m2``).
E5M2 = _impl.E5M2
#: The default length of the amax history of delayed scaling (1024).
AMAX_HISTORY_LENGTH = _impl.AMAX_HISTORY_LENGTH
#: The linen collection the fp8 state lives in (Flax's
#: ``_overwrite_with_gradient``).
COLLECTION = _impl.COLLECTION
#: The delayed-scaling state of one matmul: a dict of fp32 arrays
#: ``{input,kernel,output_grad}_{scale,amax_history}`` (:func:`init_meta`).
Fp8Meta = _impl.Fp8Meta

__all__ = ["AMAX_HISTORY_LENGTH", "COLLECTION", "E4M3", "E5M2", "Fp8Meta",
           "current_dot_general", "current_einsum", "delayed_dot_general",
           "delayed_einsum", "delayed_scale", "dot_general", "einsum",
           "init_meta", "next_meta", "observed_finite", "operands_in",
           "quantize_operands", "quantize_output_gradient", "rescale",
           "value_and_new_meta", "write_amaxes"]
