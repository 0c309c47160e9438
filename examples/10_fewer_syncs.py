"""Technique 10 of the article: fewer host synchronisations in the training loop.

The article's PyTorch/torch_npu advice::

    torch.npu.synchronize()          # don't put this in the loop
    if i % 1 == 0:
        print(f"loss: {loss.item()}")  # .item() synchronises: print every 100 steps,
                                       # or use TensorBoard's add_scalar (asynchronous)

kuai's ``kuai.utils.tensorboard.SummaryWriter`` takes the loss as a device tensor:
``writer.add_scalar("loss", loss, step)`` does not read it; kuai's metric ring holds it and a
logger thread converts it a few steps later, when its step is long done, and writes the event
file (python/kuai/utils/tensorboard.py). ``kuai.host_reads_this_thread()`` counts what the
training thread read: 0 per step with the writer, 1 per step with ``loss.item()``.

Where the article is wrong:
- PyTorch's own ``SummaryWriter.add_scalar`` is not asynchronous for a tensor: it converts the
  value to a Python float at the call (``scalar_value.item()`` inside), which is the same sync
  as the ``.item()`` it replaces. Only a writer that defers the read (as kuai's does) avoids it.
- "Print every 100 steps" still synchronises on those steps; it makes the stall rarer, not gone.
"""

import os
import tempfile

import _common as c
import kuai


def train(args, log):
    """args.steps steps of the engine's step; log(step, loss) per step. Host reads per step."""
    model = c.make_model(args)
    step = kuai.TrainStep(model, c.adamw(model, args))
    loader = c.make_loader(args)
    reads = kuai.host_reads_this_thread()
    for i in range(args.steps):
        out = step(*next(loader))  # a dict of device tensors: nothing read
        log(i, out["loss"])
    return (kuai.host_reads_this_thread() - reads) / args.steps


def add_flags(p):
    p.add_argument("--log_dir", default=None, help="TensorBoard folder (default: a new temp one)")


def main():
    args = c.parse(__doc__, add_flags)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kuai-tb-")
    writer = kuai.utils.tensorboard.SummaryWriter(log_dir)
    with_writer = train(args, lambda i, loss: writer.add_scalar("loss", loss, i))
    writer.flush()  # the logger thread converts the last steps
    history = writer.history()
    writer.close()
    printed = []
    with_item = train(args, lambda i, loss: printed.append(loss.item()))  # the per-step print
    every = 100
    with_every = train(args, lambda i, loss: i % every == 0 and printed.append(loss.item()))
    event = writer.event_file
    with open(event, "rb") as f:
        records = f.read().count(b"loss")  # one Summary.Value tagged "loss" per step
    losses = [h["loss"] for h in history]
    print(f"host reads per step: writer {with_writer}, loss.item() every step {with_item}, "
          f"every {every} steps {with_every}")
    print(f"event file {event}: {records} loss scalars; the logged losses equal the per-step "
          f".item() ones: {losses == printed[:args.steps]}")
    c.result(reads_per_step_writer=with_writer, reads_per_step_item=with_item,
             reads_per_step_every100=with_every, event_file=event,
             event_bytes=os.path.getsize(event), event_loss_scalars=records, logged=len(losses),
             logged_equal_item=losses == printed[:args.steps], last_logged=losses[-1])


if __name__ == "__main__":
    main()
