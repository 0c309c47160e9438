"""Technique 4 of the article: graph compilation (torch.compile).

The article's PyTorch/torch_npu call::

    model = torch.compile(model, backend="npu")

kuai compiles the whole *training step*, not the model's forward:
``step = kuai.compile(model, optimizer)`` captures forward, backward, the loss scaler, clipping
and AdamW's update on its first call, fuses them, plans the memory across forward and backward,
and replays the captured step on every later call (python/kuai/_compile.py, docs/compile.md).
``kuai.TrainStep(model, optimizer)`` is the same step run eagerly; the losses agree.

Where the article is too broad: "10-20% faster" and "the first run compiles (about 30 s)" are
figures of one backend and one model. kuai's capture costs one step's time plus the planning,
and what replays gain depends on the model's size: below are this machine's times of the first
(capture) call and the later (replayed) ones, against the eager step's.
"""

import _common as c
import kuai


def run(args, make_step):
    model = c.make_model(args)
    step = make_step(model, c.adamw(model, args))
    losses, ms = [], []
    for _, (x, y) in zip(range(args.steps), c.make_loader(args)):
        out, t = c.timed(lambda: float(step(x, y)["loss"]))  # float(): wait for the step
        losses.append(out)
        ms.append(t)
    return step, losses, ms


def main():
    args = c.parse(__doc__)
    _, eager, eager_ms = run(args, kuai.TrainStep)
    step, compiled, comp_ms = run(args, kuai.compile)
    rel = max(abs(a - b) / abs(b) for a, b in zip(compiled, eager))
    for i, (a, b) in enumerate(zip(eager, compiled)):
        print(f"step {i}: eager loss {a:.6f}  compiled loss {b:.6f}")
    print(f"compiled: captures {step.captures}, replays {step.replays}; first call "
          f"{comp_ms[0]:.1f} ms, later {c.steady(comp_ms):.2f} ms/step "
          f"(eager {c.steady(eager_ms):.2f})")
    c.result(captures=step.captures, replays=step.replays, eager_last=eager[-1],
             compiled_last=compiled[-1], max_rel_diff=rel, first_call_ms=comp_ms[0],
             replay_ms=c.steady(comp_ms), eager_ms=c.steady(eager_ms))


if __name__ == "__main__":
    main()
