"""Technique 3 of the article: gradient accumulation instead of a big batch.

The article's PyTorch/torch_npu loop::

    for i, (data, target) in enumerate(dataloader):
        with torch.npu.amp.autocast():
            output = model(data)
            loss = criterion(output, target) / accumulation_steps
        loss.backward()
        if (i + 1) % accumulation_steps == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

kuai runs the same loop (``loss = model(x, y) / accumulation_steps``, a step every k
micro-batches) and compares it with one batch k times as big: the same update (up to rounding),
and the allocator's peak of each (kuai.memory).

Where the article is wrong:
- Its snippet is buggy: it calls ``loss.backward()`` and then ``scaler.step(optimizer)``. With
  fp16 the backward must be ``scaler.scale(loss).backward()``: the scaler unscales gradients it
  never scaled (they are divided by the scale, and small fp16 gradients underflow). Fixed below.
- "50% less memory" (and "each forward takes 1/4 of the memory") is only about *activations*:
  they shrink ~1/k. Parameters, gradients and AdamW's two moments are the same size whatever the
  batch, so the total shrinks by much less when the model, not the batch, fills the memory.
  (This example's model is tiny, so its activations dominate; for a 7B model the fp32
  weights, gradients and moments alone are 16 bytes per parameter, ~112 GB, whatever the batch.)
"""

import _common as c
import kuai


def add_flags(p):
    p.add_argument("--accum", type=int, default=4, help="accumulation_steps (k)")


def rows(t, i, n):
    return kuai.from_numpy(t.numpy()[i * n:(i + 1) * n].copy())


def train(args, k):
    """args.steps updates over batches of k * args.batch rows, as k micro-batches of args.batch
    (k > 1) or one batch (k = 1); returns the last loss, the peak of the last update above the
    resident memory, and that resident memory (parameters and AdamW's moments; zero_grad frees
    the gradients, so they are part of the peak, the same size in both runs)."""
    model = c.make_model(args)
    opt = c.adamw(model, args)
    scaler = kuai.amp.GradScaler(init_scale=2.0**12)
    micro = args.batch * args.accum // k
    loader = c.make_loader(args, batch_size=args.batch * args.accum)

    def update(x, y):
        total = 0.0
        for i in range(k):
            with kuai.amp.autocast("fp16"):
                loss = model(rows(x, i, micro), rows(y, i, micro)) / k
            scaler.scale(loss).backward()  # the article's loss.backward() is the bug
            total = kuai.add(loss.detach(), total) if i else loss.detach()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return total

    for _ in range(args.steps - 1):
        update(*next(loader))
    resident = kuai.memory.memory_allocated()
    loss, peak = c.peak_bytes(lambda: update(*next(loader)))
    return float(loss), peak, resident


def main():
    args = c.parse(__doc__, add_flags)
    k = args.accum
    loss_full, peak_full, resident = train(args, 1)
    loss_acc, peak_acc, _ = train(args, k)
    mib = 1 / 2**20
    print(f"one batch of {k * args.batch}: peak {peak_full * mib:.2f} MiB above "
          f"{resident * mib:.2f} MiB resident (weights, AdamW moments)")
    print(f"{k} micro-batches of {args.batch}: peak {peak_acc * mib:.2f} MiB "
          f"({peak_acc / peak_full:.2f}x); weights, moments and gradients do not shrink: total "
          f"{(resident + peak_acc) / (resident + peak_full):.2f}x")
    c.result(k=k, loss_full=loss_full, loss_accum=loss_acc, peak_full=peak_full,
             peak_accum=peak_acc, peak_ratio=peak_acc / peak_full, resident=resident,
             total_ratio=(resident + peak_acc) / (resident + peak_full))


if __name__ == "__main__":
    main()
