"""kuai.distributed.algorithms.ddp_comm_hooks: gradient compression around DDP's all-reduce.

``model.register_comm_hook(state, default_hooks.fp16_compress_hook)``, as in PyTorch. No
collective library compresses gradients by itself (the Ascend article's claim that HCCL does
"natively" is wrong): compression is a cast around the collective. kuai's hooks run in C++ on the
communication thread: each bucket is divided by the world size first (so an fp16 sum cannot
overflow where the fp32 average would not), rounded to fp16 or bf16, summed in that dtype on the
wire (half the bytes) and widened back into the fp32 bucket. ``state=ErrorFeedback()`` keeps each
element's rounding error and adds it to the next step's gradient before rounding.
"""

from kuai.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: F401
from kuai.distributed.algorithms.ddp_comm_hooks.default_hooks import ErrorFeedback  # noqa: F401
