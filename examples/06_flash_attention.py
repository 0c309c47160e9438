"""Technique 6 of the article: FlashAttention, called directly and swapped in automatically.

The article's PyTorch/torch_npu code::

    from ops_transformer import flash_attention
    output = flash_attention(query=Q, key=K, value=V)

    import ascend_transformer_boost
    model = ascend_transformer_boost.optimize(model)

kuai has both: ``kuai.flash_attention(q, k, v, is_causal=True)`` takes the arguments of
``kuai.scaled_dot_product_attention`` (the naive attention, which keeps the (T, T)
probabilities for backward) and gives the same output; ``kuai.optimize(model)`` swaps every
attention module of a model to flash and returns what it replaced (module, from, to); the
parameters are untouched, so the loss is the same and state dicts stay valid.
docs/flash_attention.md describes the kernels.

Where the article is too broad: "3x faster and 80% less memory above 1024 tokens" are one
device's figures. FlashAttention never builds the T x T matrix, so the memory it saves grows
with T; its speed against the naive kernel depends on T and the machine (kuai's "auto" switches
to flash from T = 2048, the crossover it measured on CPUs). Below is what kuai measures here.
"""

import _common as c
import kuai


def add_flags(p):
    p.add_argument("--long_t", type=int, default=1024, help="T of the memory/time comparison")
    p.add_argument("--head_dim", type=int, default=32)


def attention(fn, q, k, v):
    """Forward and backward of fn(q, k, v, causal); returns the output and q's gradient."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, is_causal=True)
    kuai.sum(out).backward()
    return out.detach(), q.grad


def max_diff(a, b):
    return float(abs(a.numpy() - b.numpy()).max())


def main():
    args = c.parse(__doc__, add_flags)
    kuai.manual_seed(args.seed)
    shape = (2, args.n_head, args.seq_len, args.head_dim)
    q, k, v = (kuai.randn(*shape) for _ in range(3))
    out_n, dq_n = attention(kuai.scaled_dot_product_attention, q, k, v)
    out_f, dq_f = attention(kuai.flash_attention, q, k, v)
    diff, grad_diff = max_diff(out_n, out_f), max_diff(dq_n, dq_f)
    print(f"T={args.seq_len}: flash - naive: output {diff:.2e}, dq {grad_diff:.2e}")

    shape = (1, args.n_head, args.long_t, args.head_dim)
    q, k, v = (kuai.randn(*shape) for _ in range(3))
    measured = {}
    for name, fn in (("naive", kuai.scaled_dot_product_attention), ("flash", kuai.flash_attention)):
        attention(fn, q, k, v)  # warm-up
        (_, peak), ms = c.timed(lambda: c.peak_bytes(lambda: attention(fn, q, k, v)))
        measured[name] = (peak, ms)
        print(f"T={args.long_t} {name}: peak {peak / 2**20:.2f} MiB, {ms:.2f} ms forward+backward")

    model = c.make_model(args)
    x, y = next(c.make_loader(args))
    before = float(model(x, y))
    replaced = kuai.optimize(model)  # [(module, from, to), ...]
    after = float(model(x, y))
    for module, old, new in replaced:
        print(f"kuai.optimize: {module}: {old} -> {new}")
    (peak_n, ms_n), (peak_f, ms_f) = measured["naive"], measured["flash"]
    c.result(max_diff=diff, grad_max_diff=grad_diff, long_t=args.long_t, peak_naive=peak_n,
             peak_flash=peak_f, memory_saved=1 - peak_f / peak_n, ms_naive=ms_n, ms_flash=ms_f,
             replaced=len(replaced), loss_before=before, loss_after=after)


if __name__ == "__main__":
    main()
