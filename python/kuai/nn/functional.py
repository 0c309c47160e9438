"""kuai.nn.functional: the engine's ops under torch.nn.functional's names."""

from kuai._kuai import (  # noqa: F401
    cross_entropy,
    embedding,
    flash_attention,
    gelu,
    linear,
    rms_norm,
    rope,
    scaled_dot_product_attention,
    silu,
    softmax,
    swiglu,
)
from kuai._kuai import layer_norm as _layer_norm


def layer_norm(input, normalized_shape, weight, bias, eps=1e-5):
    """LayerNorm over the last axis (kuai normalises one axis: normalized_shape is its size)."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1 or shape[0] != input.shape[-1]:
        raise ValueError(
            f"layer_norm: kuai normalises the last axis only; normalized_shape {shape} "
            f"for input {input.shape}"
        )
    return _layer_norm(input, weight, bias, eps)
