"""kuai.utils: activation recomputation (``checkpoint``), the article's ``DataLoader`` shape
(``data``) and metrics without per-step host reads (``tensorboard``), under PyTorch's names."""

from kuai.utils import checkpoint, data, tensorboard  # noqa: F401
