"""kuai.utils.data: ``DataLoader(dataset, batch_size, num_workers, pin_memory, prefetch_factor)``
over token files, the article's call for kuai's prefetching loader (kuai.data.DataLoader).

Worker threads (not processes: no pickling, no copies between address spaces) cut windows of
``seq_len + 1`` tokens from the memory-mapped file into batch buffers allocated once, and a
bounded queue holds ``prefetch_factor`` batches per worker, handed out in a fixed order whatever
the workers' timing (so a run resumes at an exact position: ``state_dict()``). ``pin_memory``
matters where a device copies batches by DMA; on the CPU backend the buffers already are the
memory the step reads, so it is accepted and changes nothing.
"""

from kuai._kuai.data import DataLoader as _DataLoader
from kuai._kuai.data import RandomWindows, SequentialWindows, TokenFile


class TokenDataset:
    """Windows of seq_len + 1 tokens of a token file (``kuai prepare``'s output): inputs are the
    first seq_len, targets the same shifted by one. ``shuffle`` draws windows at random offsets
    (the trainer's sampling), else they follow each other."""

    def __init__(self, path, seq_len, begin=0, end=None):
        self.file = TokenFile(str(path))
        self.seq_len = int(seq_len)
        self.begin, self.end = begin, end

    def __len__(self):
        return (self._stop() - self.begin - 1) // self.seq_len

    def _stop(self):
        return len(self.file) if self.end is None else self.end


def DataLoader(dataset, batch_size=1, shuffle=True, num_workers=2, pin_memory=False,
               prefetch_factor=2, seed=0, rank=None, world_size=None, drop_last=True):
    """An endless iterator of (x, y) int32 (batch_size, seq_len) batches over ``dataset``, each
    rank of a distributed run reading its own rows (rank and world size from kuai.distributed
    when not given)."""
    if not isinstance(dataset, TokenDataset):
        raise TypeError("DataLoader: kuai loads token files: pass "
                        "kuai.utils.data.TokenDataset(path, seq_len)")
    if not drop_last:
        raise ValueError("DataLoader: kuai's batches are whole (drop_last=True)")
    del pin_memory  # the batch buffers are the step's own memory on the CPU backend
    import kuai.distributed as dist

    if rank is None:
        rank = dist.get_rank()
    if world_size is None:
        world_size = dist.get_world_size()
    kw = dict(begin=dataset.begin, end=dataset.end, rank=rank, world_size=world_size)
    if shuffle:
        source = RandomWindows(dataset.file, batch_size, dataset.seq_len, seed=seed, **kw)
    else:
        source = SequentialWindows(dataset.file, batch_size, dataset.seq_len, **kw)
    return _DataLoader(source, num_workers=num_workers, prefetch_factor=prefetch_factor)
