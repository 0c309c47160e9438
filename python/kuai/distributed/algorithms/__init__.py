"""kuai.distributed.algorithms: DDP's communication hooks (``ddp_comm_hooks``)."""

from kuai.distributed.algorithms import ddp_comm_hooks  # noqa: F401
