"""Shared bits of the examples: the article's ten training techniques, written for kuai.

``args = parse(__doc__)`` reads the common flags (--steps, --data, the model's shape, --batch,
--lr, --seed); ``make_model(args)`` builds the small GPT, ``make_loader(args)`` the article's
DataLoader call over the token file, ``adamw(model, args)`` the optimizer; ``peak_bytes(fn)``
measures the allocator's peak while fn runs, ``timed(fn)`` its time and ``steady(values)`` the mean
after the first (warm-up) value; ``result(k=v, ...)`` prints the one ``RESULT`` line
that the tests (python/tests/test_examples.py) parse.

Run from the repository root: ``PYTHONPATH=build/python python3 examples/NN_name.py --steps 3``.
"""

import argparse
import pathlib
import time

import kuai

ROOT = pathlib.Path(__file__).resolve().parents[1]


def parse(doc, extra=None):
    """The common flags; ``extra(parser)`` may add a script's own."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="training steps")
    p.add_argument("--data", default=str(ROOT / "data" / "kjv.bin"), help="token file")
    p.add_argument("--vocab_size", type=int, default=256)
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_head", type=int, default=2)
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=3)
    if extra is not None:
        extra(p)
    return p.parse_args()


def make_model(args, **over):
    """kuai.nn.GPT of the flags' shape (fields in ``over`` replace them), seeded: two calls give
    the same weights."""
    cfg = dict(vocab_size=args.vocab_size, n_layer=args.n_layer, n_head=args.n_head,
               d_model=args.d_model, seq_len=args.seq_len)
    cfg.update(over)
    kuai.manual_seed(args.seed)
    return kuai.nn.GPT(kuai.nn.GPTConfig(**cfg), seed=args.seed)


def adamw(model, args, **kw):
    return kuai.optim.AdamW(model.parameters(), lr=args.lr, **kw)


def make_loader(args, batch_size=None, num_workers=2, seq_len=None, seed=7):
    """The article's DataLoader call: the same seed gives the same batches in the same order."""
    dataset = kuai.utils.data.TokenDataset(args.data, seq_len or args.seq_len)
    return kuai.utils.data.DataLoader(dataset, batch_size=batch_size or args.batch,
                                      num_workers=num_workers, pin_memory=True,
                                      prefetch_factor=4, seed=seed)


def peak_bytes(fn):
    """(what fn returns, the allocator's peak above what was allocated before it ran)."""
    kuai.memory.reset_peak_memory_stats()
    base = kuai.memory.memory_allocated()
    out = fn()
    return out, kuai.memory.max_memory_allocated() - base


def timed(fn):
    """(what fn returns, its wall time in ms)."""
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def steady(values):
    """The mean of values after the first (the warm-up or capture); the first if there is one."""
    rest = values[1:] or values
    return sum(rest) / len(rest)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def result(**kv):
    """The script's final line: ``RESULT k=v ...`` (no spaces inside a value)."""
    print("RESULT " + " ".join(f"{k}={_fmt(v)}" for k, v in kv.items()), flush=True)

