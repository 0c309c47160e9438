"""kuai.nn.utils: gradient clipping and activation recomputation under PyTorch's names."""

from kuai._kuai.nn import checkpoint  # noqa: F401
from kuai._kuai.optim import clip_coefficient, clip_grad_norm_, grad_norm  # noqa: F401
