"""kuai.compile and kuai.TrainStep: one whole training step, run by the engine.

``step = kuai.compile(model, optimizer)`` captures the step on its first call (forward of every
micro-batch, backward, the loss scaler, clipping, AdamW's update, zero_grad), fuses it, plans its
memory and replays it after; Python runs only while it captures. ``kuai.TrainStep`` is the same
step eager. Call ``step(x, y)``, ``step([(x, y), ...])`` (one pair per micro-batch with
accumulation) or ``step(loader)``; it returns a dict of device tensors (loss, grad_norm, and for
fp16 skipped and loss_scale): nothing is read on the host.

Unlike ``torch.compile(model)``, kuai compiles the *step*, not the model's forward: the memory
plan spans forward and backward (activations freed the moment backward is done with them) and the
optimizer's update joins the graph, which is where a CPU step's time goes besides the matmuls.
"""

from kuai._kuai import TrainStep as _TrainStep


class TrainStep(_TrainStep):
    __doc__ = __doc__

    def __init__(self, model, optimizer, loss_fn=None, accumulation_steps=1, precision="fp32",
                 max_grad_norm=1.0, scaler=None, compile=False, ddp=None):
        super().__init__(model, optimizer, loss_fn=loss_fn, accumulation_steps=accumulation_steps,
                         precision=precision, max_grad_norm=max_grad_norm, scaler=scaler,
                         compile=compile,
                         ddp=ddp._build_reducer() if hasattr(ddp, "_build_reducer") else ddp)


def compile(model, optimizer=None, *, loss_fn=None, accumulation_steps=1, precision="fp32",
            max_grad_norm=1.0, scaler=None):
    """Captures model's training step with optimizer; returns the step to call each iteration."""
    if optimizer is None:
        raise TypeError("kuai.compile(model, optimizer, ...): kuai compiles the whole training "
                        "step (forward, backward and the update), so it needs the optimizer")
    return TrainStep(model, optimizer, loss_fn=loss_fn, accumulation_steps=accumulation_steps,
                     precision=precision, max_grad_norm=max_grad_norm, scaler=scaler,
                     compile=True)
