"""kuai.distributed: multi-process training under ``mpirun``, with torch.distributed's names.

One process per rank, launched by MPI (``mpirun -np 2 python3 train.py``); kuai's process group
runs its collectives on a communication thread of the engine. ``init_process_group()`` picks MPI
when the script was launched by mpirun and a one-process group otherwise; PyTorch's
``backend="nccl"``/``"gloo"`` (or the Ascend article's ``"hccl"``) name other libraries, which kuai
refuses by name rather than pretend to use.

- ``kuai.nn.parallel.DistributedDataParallel``: gradients bucketed and all-reduced while backward
  runs, ``no_sync()`` for accumulation, compression hooks (``algorithms.ddp_comm_hooks``).
- ``kuai.distributed.optim.ZeroRedundancyOptimizer``: AdamW's state sharded over the ranks
  (ZeRO-1; ``stage=2`` also shards the gradients), optionally with the shard's moments on disk.
- ``kuai.distributed.fsdp.fully_shard``: ZeRO-3, the parameters sharded too, gathered unit by
  unit (with ``ZeroRedundancyOptimizer(stage=3)``).
"""

from kuai._kuai.distributed import (  # noqa: F401
    all_gather_into_tensor,
    all_reduce,
    barrier,
    broadcast,
    collective_stats,
    destroy_process_group,
    get_backend,
    get_rank,
    get_world_size,
    is_available,
    is_initialized,
    launched_by_mpi,
)
from kuai._kuai.distributed import init_process_group as _init_process_group


class ReduceOp:
    """The reductions kuai's all_reduce has: ``SUM`` and ``AVG`` (torch.distributed.ReduceOp's)."""

    SUM = "sum"
    AVG = "avg"


def init_process_group(backend=None, timeout=300.0, **kwargs):
    """Joins the job's ranks: MPI under mpirun (``backend="mpi"`` or ``None``), else one process
    (``"single"``). ``timeout`` (seconds) bounds every collective: a rank that died or hangs ends
    the others' wait with a message naming it. ``init_method``, ``world_size`` and ``rank`` come
    from mpirun, so given ones must agree with it."""
    for key in kwargs:
        if key not in ("init_method", "world_size", "rank"):
            raise TypeError(f"init_process_group() got an unexpected keyword argument '{key}'")
    if hasattr(timeout, "total_seconds"):  # a datetime.timedelta, as torch takes it
        timeout = timeout.total_seconds()
    _init_process_group(backend or "", float(timeout))
    for key in ("world_size", "rank"):
        want = kwargs.get(key)
        have = get_world_size() if key == "world_size" else get_rank()
        if want is not None and want not in (-1, have):
            raise ValueError(f"init_process_group: {key}={want}, but mpirun started this process "
                             f"with {key} {have}")


from kuai.distributed import algorithms, fsdp, optim  # noqa: E402,F401
from kuai.distributed.fsdp import fully_shard  # noqa: E402,F401
