"""Technique 9 of the article: what a checkpoint must hold.

The article's PyTorch code, and its advice::

    # don't save this
    torch.save({'model': model.state_dict(),
                'optimizer': optimizer.state_dict()}, 'checkpoint.pt')
    # save this
    torch.save({'model': model.state_dict()}, 'checkpoint.pt')
    # "optimizer state can be re-initialised from the weights"

The advice is wrong for resuming training. The optimizer's state cannot be rebuilt from the
weights: AdamW's two moments and its step count (the bias correction), the learning-rate
schedule's position, fp16's loss scale and growth tracker, and the loader's position carry the
run's history. A weights-only file is an *export* (for inference or fine-tuning); a checkpoint to
resume from holds everything::

    kuai.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
               "scaler": scaler.state_dict(), "loader": loader.state_dict(),
               "scheduler": {"last_epoch": sched.last_epoch}, "step": step}, path)

Below: N steps straight; N/2 steps, both files saved, then a resume from each for the other
N/2. The resume from the full checkpoint equals the straight run bit for bit; the resume from
the weights (with the loader's position given back, even) does not. The full file is ~3x the
weights (two AdamW moments per parameter): that is the "3x smaller" of the article, bought with
a resume that is not the same run.
"""

import os
import tempfile

import _common as c
import kuai
import numpy as np


class Run:
    """The model, optimizer, schedule, fp16 scaler and loader of one run, fresh."""

    def __init__(self, args):
        self.model = c.make_model(args)
        self.opt = c.adamw(self.model, args, weight_decay=0.1)
        self.sched = kuai.optim.lr_scheduler.WarmupCosineLR(self.opt, 2, args.steps)
        self.scaler = kuai.amp.GradScaler(init_scale=2.0**10, growth_interval=2)
        self.loader = c.make_loader(args, num_workers=1)

    def train(self, n):
        out = []
        for _ in range(n):
            x, y = next(self.loader)
            with kuai.amp.autocast("fp16"):
                loss = self.model(x, y)
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
            kuai.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.scaler.step(self.opt)
            self.scaler.update()
            self.opt.zero_grad()
            self.sched.step()
            out.append(loss.detach())
        return [float(v) for v in out]

    def full_state(self, step):
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "scaler": self.scaler.state_dict(), "loader": self.loader.state_dict(),
                "scheduler": {"last_epoch": self.sched.last_epoch}, "step": step}

    def load_full(self, ck):
        self.model.load_state_dict(ck["model"])
        self.opt.load_state_dict(ck["optimizer"])
        self.scaler.load_state_dict(ck["scaler"])
        self.loader.load_state_dict(ck["loader"])
        for _ in range(ck["scheduler"]["last_epoch"]):
            self.sched.step()

    def same_weights(self, other):
        return all((p.numpy().view(np.uint32) == q.numpy().view(np.uint32)).all()
                   for p, q in zip(self.model.parameters(), other.model.parameters()))


def main():
    args = c.parse(__doc__)
    half = max(args.steps // 2, 1)
    straight = Run(args)
    losses = straight.train(2 * half)

    first = Run(args)
    first.train(half)
    folder = tempfile.mkdtemp(prefix="kuai-ckpt-")
    full, weights = os.path.join(folder, "full.safetensors"), os.path.join(folder, "w.safetensors")
    _, full_ms = c.timed(lambda: kuai.save(first.full_state(half), full))
    _, weights_ms = c.timed(lambda: kuai.save({"model": first.model.state_dict()}, weights))
    loader_at = first.loader.state_dict()

    resumed = Run(args)
    resumed.load_full(kuai.load(full))
    resumed_losses = resumed.train(half)
    exact = losses[half:] == resumed_losses and resumed.same_weights(straight)

    rebuilt = Run(args)  # the article's way: weights, a fresh optimizer, scaler and schedule
    rebuilt.model.load_state_dict(kuai.load(weights)["model"])
    rebuilt.loader.load_state_dict(loader_at)
    rebuilt_losses = rebuilt.train(half)
    weights_exact = losses[half:] == rebuilt_losses and rebuilt.same_weights(straight)

    full_bytes, weights_bytes = os.path.getsize(full), os.path.getsize(weights)
    for path in (full, weights):
        os.remove(path)
    os.rmdir(folder)
    print(f"straight run    last loss {losses[-1]:.6f}")
    print(f"full resume     last loss {resumed_losses[-1]:.6f} (bit-exact: {exact})")
    print(f"weights resume  last loss {rebuilt_losses[-1]:.6f} (bit-exact: {weights_exact})")
    print(f"sizes: full {full_bytes} B, weights {weights_bytes} B "
          f"({full_bytes / weights_bytes:.2f}x); save {full_ms:.1f} ms vs {weights_ms:.1f} ms")
    c.result(full_resume_bit_exact=exact, weights_resume_bit_exact=weights_exact,
             size_ratio=full_bytes / weights_bytes, full_bytes=full_bytes,
             weights_bytes=weights_bytes, straight_last=losses[-1],
             full_resume_last=resumed_losses[-1], weights_resume_last=rebuilt_losses[-1])


if __name__ == "__main__":
    main()
