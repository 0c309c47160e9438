"""Technique 5 of the article: data prefetching (DataLoader workers).

The article's PyTorch/torch_npu call::

    dataloader = torch.utils.data.DataLoader(
        dataset, batch_size=32,
        num_workers=8,      # 8 processes load in parallel
        pin_memory=True,    # page-locked memory, faster CPU->NPU copies
        prefetch_factor=4)  # 4 batches prefetched

kuai takes the same call, ``kuai.utils.data.DataLoader(kuai.utils.data.TokenDataset(path,
seq_len), batch_size=..., num_workers=..., pin_memory=True, prefetch_factor=4)``
(python/kuai/utils/data.py), and the training loop reads ``loader.last_wait_ms``: how long the
last ``next(loader)`` waited for its batch. With workers the batches are ready when the step asks
for them; with ``num_workers=0`` the step builds each batch itself.

Where the article does not apply as written:
- kuai's workers are threads, not processes: no pickling, no copies between address spaces;
  the windows are cut from the memory-mapped token file into batch buffers allocated once.
- ``pin_memory`` matters where a device copies batches by DMA; on the CPU backend the batch
  buffers already are the memory the step reads, so it is accepted and changes nothing.
- "5-15% faster" holds only when loading is the bottleneck; for token windows from a mapped file
  it rarely is: the waits below are the measure.
"""

import _common as c
import kuai


def add_flags(p):
    p.add_argument("--workers", type=int, default=2, help="num_workers of the prefetching run")


def run(args, workers):
    model = c.make_model(args)
    step = kuai.TrainStep(model, c.adamw(model, args))
    loader = c.make_loader(args, num_workers=workers)
    waits = []
    for _, (x, y) in zip(range(args.steps), loader):
        waits.append(loader.last_wait_ms)
        step(x, y)
    return c.steady(waits), loader  # the first wait is the workers' start


def main():
    args = c.parse(__doc__, add_flags)
    wait_workers, loader = run(args, args.workers)
    wait_none, _ = run(args, 0)
    print(f"num_workers={args.workers}: {wait_workers:.4f} ms waited per step; "
          f"num_workers=0: {wait_none:.4f} ms per step; position {loader.state_dict()}")
    c.result(workers=args.workers, wait_ms_workers=wait_workers, wait_ms_no_workers=wait_none,
             next_index=loader.state_dict()["next_index"], steps=args.steps)


if __name__ == "__main__":
    main()
