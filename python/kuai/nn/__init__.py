"""kuai.nn: modules, layers and models (kuai::nn), under PyTorch's names.

``Module`` is the engine's module: subclass it in Python as ``torch.nn.Module``; a parameter
(``Parameter(t)``: a leaf tensor that requires grad) or module assigned to an attribute is
registered with it, in order, so ``named_parameters()``, ``state_dict()`` and
``load_state_dict()`` are the engine's own.
"""

from kuai._kuai.nn import (  # noqa: F401
    GPT,
    MLP,
    AttentionModule,
    Block,
    CausalSelfAttention,
    DecoderBlock,
    Embedding,
    GPTConfig,
    LayerNorm,
    Linear,
    LlamaAttention,
    LlamaBlock,
    Module,
    RMSNorm,
    SwiGLU,
)
from kuai.nn import functional, utils  # noqa: F401,E402
from kuai.nn.containers import ModuleList, Sequential  # noqa: F401,E402
from kuai.nn import parallel  # noqa: F401,E402


def Parameter(data, requires_grad=True):
    """A parameter: ``data`` as a leaf tensor (the same storage) that requires grad."""
    return data.detach().requires_grad_(requires_grad)
