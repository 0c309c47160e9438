"""kuai.utils.checkpoint: activation recomputation, as ``torch.utils.checkpoint``.

``y = checkpoint(block, x)`` runs ``block(x)`` keeping none of its activations (only its inputs);
backward runs the region's forward again, under the same autocast and random state, and
differentiates it. kuai's checkpoint is non-reentrant (PyTorch's ``use_reentrant=False``): the
region's ops are recorded by the one autograd engine, and gradients equal those without
recomputation bit for bit. ``policy="selective"`` keeps the products' outputs and recomputes only
the cheap ops between them (the attention core, normalisations, activations).
"""

from kuai._kuai.nn import recompute_stats, reset_recompute_stats  # noqa: F401
from kuai._kuai.nn import checkpoint as _checkpoint


def checkpoint(function, *args, use_reentrant=False, policy="full", **kwargs):
    """Runs function(*args) without keeping its activations; backward recomputes them."""
    if use_reentrant:
        raise ValueError("checkpoint: kuai's recomputation is non-reentrant "
                         "(use_reentrant=False, PyTorch's recommended mode)")
    if kwargs:
        raise TypeError("checkpoint: keyword arguments to function are not passed through "
                        f"({', '.join(sorted(kwargs))}); bind them with functools.partial")
    return _checkpoint(function, list(args), policy)
