"""The values of a policy's ``matmul`` key, named once (a leaf module: the
engine's scopes read them without importing the policy)."""

# How a policy's Dense/Linear matmuls run (the ``matmul`` key): in the
# compute dtype (None), or as fp8 GEMMs with E4M3 inputs and kernels and E5M2
# output gradients, scaled per tensor by delayed scaling (``"fp8"``: amax
# history, as Transformer Engine's default) or current scaling
# (``"fp8_current"``: the amax of the tensor itself), see jmp_lab.fp8; or as
# Blackwell's block-scaled GEMMs (``"mxfp8"``, ``"nvfp4"``: current scaling
# per block, no state), see jmp_lab.block_scaled.
#: The per-tensor fp8 modes (Hopper's).
FP8_MODES = ("fp8", "fp8_current")
#: The block-scaled modes (Blackwell's formats).
BLOCK_SCALED_MODES = ("mxfp8", "nvfp4")
MATMUL_MODES = FP8_MODES + BLOCK_SCALED_MODES
