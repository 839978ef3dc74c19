"""jmp_lab: mixed-precision training for JAX and Flax on NVIDIA GPUs.

The public API lives here; each concept has its own module:

* :mod:`jmp_lab.policy` -- precision policies and cast helpers;
* :mod:`jmp_lab.loss_scale` -- loss scales, ``all_finite`` and ``select_tree``;
* :mod:`jmp_lab.state` -- both optimizers' states and their accessors
  (``master_params``, ``current_loss_scale``, ``skipped_steps``,
  ``last_step_applied``);
* :mod:`jmp_lab.optimizer` -- ``mixed_precision``: fp32 master weights and
  loss-scale state inside an optax transformation;
* :mod:`jmp_lab.fused` -- ``fused_adamw``: the same, as one Pallas kernel
  pass (:mod:`jmp_lab.kernels` holds the backends);
* :mod:`jmp_lab.fp8` -- fp8 matmuls with per-tensor (delayed or current)
  scaling, for policies with ``matmul=fp8``;
* :mod:`jmp_lab.block_scaled` -- Blackwell's MXFP8 and NVFP4 block-scaled
  matmuls, for policies with ``matmul=mxfp8`` or ``matmul=nvfp4``;
* :mod:`jmp_lab.precision` -- the precision engine: ``autocast(fn,
  policy)`` for any JAX function, the rules (as data) the Flax front ends
  share, and scopes;
* :mod:`jmp_lab.attention` -- attention with the fp32 softmax inside a
  fused kernel (cuDNN, Pallas), chosen by the platform compiled for;
* :mod:`jmp_lab.losses` -- fp32 losses, and ``linear_cross_entropy``, which
  never stores the logits;
* :mod:`jmp_lab.linen` -- policies applied to Flax linen modules;
* :mod:`jmp_lab.nnx` -- policies applied to Flax NNX module graphs, and the
  NNX optimizer and train step;
* :mod:`jmp_lab.training` -- scaled value-and-grad (its gradients marked
  ``ScaledGradients`` for the optimizers), TrainState, the step;
* :mod:`jmp_lab.diagnostics` -- gradient histograms, step audits, memory
  reports and a host-side training recorder;
* :mod:`jmp_lab.jmp` -- jmp's API on jmp_lab's classes, for migrating:
  ``from jmp_lab import jmp``.
"""

# First, before anything could start jax's backend: on a machine without an
# NVIDIA GPU, jax's CUDA plugin (the gpu-compile extra) would print a
# configuration error at every start and not register for compiles for an
# H100. Importing _src/cuda_plugin.py turns its version check off there.
from jmp_lab._src import cuda_plugin as _cuda_plugin  # noqa: F401
from jmp_lab import (attention, block_scaled, diagnostics, fp8, kernels, linen, losses, nnx,
                     precision, sharding)
from jmp_lab.autocast import autocast
from jmp_lab.fused import flat_params, fused_adamw, unflatten_params
from jmp_lab.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
)
from jmp_lab.optimizer import mixed_precision
from jmp_lab.policy import (
    PRESETS,
    Policy,
    cast_floating,
    get_policy,
    half_dtype,
)
from jmp_lab.state import (
    FusedAdamWState,
    MixedPrecisionState,
    current_loss_scale,
    last_step_applied,
    master_params,
    skipped_steps,
)
from jmp_lab.training import (
    ScaledGradients,
    TrainState,
    make_train_step,
    scaled_value_and_grad,
    train_step,
)

__version__ = "0.1.0"

__all__ = [
    "DynamicLossScale",
    "FusedAdamWState",
    "LossScale",
    "MixedPrecisionState",
    "NoOpLossScale",
    "PRESETS",
    "Policy",
    "ScaledGradients",
    "StaticLossScale",
    "TrainState",
    "all_finite",
    "attention",
    "autocast",
    "block_scaled",
    "cast_floating",
    "current_loss_scale",
    "diagnostics",
    "fp8",
    "flat_params",
    "fused_adamw",
    "get_policy",
    "half_dtype",
    "kernels",
    "last_step_applied",
    "linen",
    "losses",
    "make_train_step",
    "master_params",
    "mixed_precision",
    "nnx",
    "precision",
    "scaled_value_and_grad",
    "select_tree",
    "sharding",
    "skipped_steps",
    "train_step",
    "unflatten_params",
]
