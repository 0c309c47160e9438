"""Technique 1 of the article: mixed precision (autocast + GradScaler).

The article's PyTorch/torch_npu loop::

    scaler = torch.npu.amp.GradScaler()
    for data, target in dataloader:
        with torch.npu.amp.autocast():
            output = model(data)
            loss = criterion(output, target)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

kuai keeps that shape: ``kuai.amp.autocast("fp16")`` runs linear, matmul and attention in fp16
and keeps LayerNorm, softmax and the loss in fp32 (docs/mixed_precision.md has the table); the
parameters stay fp32 master weights. ``kuai.amp.GradScaler`` keeps its scale and overflow flag on
the device, so the loop reads nothing on the host. bf16 runs the same loop with
``GradScaler(enabled=False)``: it has fp32's exponent range and needs no loss scaling.

Where the article is wrong or too broad:
- "1.5-2x faster" is a property of hardware with fast low-precision units (tensor/cube units).
  On a CPU the gain depends on bf16 units (AVX512-BF16 / AMX); without them kuai treats
  bf16/fp16 as a storage format and multiplies in fp32 (docs/mixed_precision.md), so the gain is
  memory bandwidth, not arithmetic. The step times printed below are what this machine does.
- fp16 needs the scaler (its small gradients underflow without it); bf16 does not.
- The article's loop never calls ``optimizer.zero_grad()``: gradients would pile up. It is added.
"""

import _common as c
import kuai


def train(args, precision, scaler):
    model = c.make_model(args)
    opt = c.adamw(model, args)
    losses, ms = [], []
    reads = kuai.host_reads_this_thread()
    low = "bf16" if precision == "fp32" else precision  # fp32: autocast off
    for step, (x, y) in zip(range(args.steps), c.make_loader(args)):
        def one():
            with kuai.amp.autocast(low, enabled=precision != "fp32"):
                loss = model(x, y)
            scaler.scale(loss).backward()  # fp16: the loss times the scale; bf16: the loss
            scaler.step(opt)               # unscales, skips the step on inf/nan
            scaler.update()                # grows or backs off the scale
            opt.zero_grad()
            return loss.detach()
        loss, t = c.timed(one)
        losses.append(loss)
        ms.append(t)
    reads = kuai.host_reads_this_thread() - reads
    values = [float(v) for v in losses]  # read once, after the loop
    print(f"{precision}: loss {values[0]:.4f} -> {values[-1]:.4f}, "
          f"{c.steady(ms):.1f} ms/step", flush=True)
    return values, ms, reads


def main():
    args = c.parse(__doc__)
    fp16_scaler = kuai.amp.GradScaler(init_scale=2.0**12)
    fp16, fp16_ms, reads = train(args, "fp16", fp16_scaler)
    bf16, bf16_ms, _ = train(args, "bf16", kuai.amp.GradScaler(enabled=False))  # no scaler
    fp32, fp32_ms, _ = train(args, "fp32", kuai.amp.GradScaler(enabled=False))  # the baseline
    c.result(fp16_first=fp16[0], fp16_last=fp16[-1], fp16_scale=fp16_scaler.get_scale(),
             bf16_first=bf16[0], bf16_last=bf16[-1], fp32_first=fp32[0], fp32_last=fp32[-1],
             fp32_ms=c.steady(fp32_ms), bf16_ms=c.steady(bf16_ms), fp16_ms=c.steady(fp16_ms),
             fp16_loop_host_reads=reads)


if __name__ == "__main__":
    main()
