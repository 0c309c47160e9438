"""kuai.amp: mixed precision (technique 1).

``autocast("bf16" | "fp16")`` runs matmul, linear and attention in the low dtype and keeps
LayerNorm, softmax and reductions in fp32 (the table is docs/mixed_precision.md); parameters stay
fp32 (the master weights) and are cast once per scope. ``GradScaler`` is fp16's dynamic loss
scaling, with PyTorch's calls (scale, unscale_, step, update, state_dict); its scale and its
overflow flag stay on the device, so the loop reads nothing on the host. bf16 keeps fp32's
exponent range and needs no scaler: ``GradScaler(enabled=False)`` keeps the same loop.
"""

from kuai._kuai.amp import (  # noqa: F401
    GradScaler,
    autocast,
    autocast_param_casts,
    get_autocast_dtype,
    is_autocast_enabled,
    reset_autocast_param_casts,
)
