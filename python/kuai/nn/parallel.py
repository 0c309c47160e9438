"""kuai.nn.parallel.DistributedDataParallel: the module wrapper of PyTorch's DDP over kuai's
reducer (kuai::dist::DistributedDataParallel).

The wrapped module's parameters are broadcast from rank 0; every parameter's ``.grad`` is a view
into a flat bucket; a grad-ready hook hands a full bucket to the communication thread while
backward still runs (buckets in reverse registration order, the first one small); and
``loss.backward()`` returns once every bucket is averaged (autograd's end-of-backward callback
waits for them), so the loop is PyTorch's:

    model = DistributedDataParallel(model)
    loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()

``with model.no_sync():`` accumulates locally (the all-reduce runs once, with the last
micro-batch); ``register_comm_hook`` picks compression. The reducer is built at the first forward
(or when ZeRO asks for the buckets), so a hook registered before that takes effect; the weights
are broadcast then.
"""

import contextlib

import kuai
from kuai._kuai.distributed import _Reducer
from kuai._kuai.nn import Module
from kuai.distributed.algorithms.ddp_comm_hooks.default_hooks import CompressionHook, ErrorFeedback


class DistributedDataParallel(Module):
    def __init__(self, module, device_ids=None, output_device=None, bucket_cap_mb=25.0,
                 first_bucket_cap_mb=1.0, find_unused_parameters=False, overlap=True,
                 broadcast_buffers=True, gradient_as_bucket_view=True):
        super().__init__()
        if not kuai.distributed.is_initialized():
            raise RuntimeError("DistributedDataParallel: call "
                               "kuai.distributed.init_process_group() first")
        self.module = module
        for name, value in (("device_ids", device_ids), ("output_device", output_device)):
            if value not in (None, [], [0], 0, "cpu", ["cpu"]):
                raise ValueError(f"DistributedDataParallel: {name}={value!r}: kuai runs one rank "
                                 "per process on its own device (leave it None)")
        object.__setattr__(self, "_options", dict(
            bucket_cap_mb=float(bucket_cap_mb), first_bucket_mb=float(first_bucket_cap_mb),
            overlap=bool(overlap), find_unused_parameters=bool(find_unused_parameters),
            compression="none", error_feedback=False))
        object.__setattr__(self, "_reducer", None)
        object.__setattr__(self, "_sync", True)

    def _build_reducer(self):
        if self._reducer is None:
            object.__setattr__(self, "_reducer", _Reducer(self.module, **self._options))
        return self._reducer

    def register_comm_hook(self, state, hook):
        """Compression around the all-reduce: ``default_hooks.fp16_compress_hook`` or
        ``bf16_compress_hook`` (``state=ErrorFeedback()`` for error feedback, else None)."""
        if not isinstance(hook, CompressionHook):
            raise TypeError("register_comm_hook: kuai's hooks run in C++ on the communication "
                            "thread; use kuai.distributed.algorithms.ddp_comm_hooks.default_hooks"
                            f".fp16_compress_hook or bf16_compress_hook, not {hook!r}")
        if self._reducer is not None:
            raise RuntimeError("register_comm_hook must be called before the first forward")
        if state is not None and not isinstance(state, ErrorFeedback):
            raise TypeError("register_comm_hook: state is None or "
                            "ddp_comm_hooks.ErrorFeedback()")
        if state is not None and hook.dtype == "none":
            raise ValueError("register_comm_hook: error feedback needs a compressing hook")
        self._options["compression"] = hook.dtype
        self._options["error_feedback"] = state is not None

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the next one outside averages."""
        old = self._sync
        object.__setattr__(self, "_sync", False)
        try:
            yield
        finally:
            object.__setattr__(self, "_sync", old)

    def forward(self, *args, **kwargs):
        reducer = self._build_reducer()
        if kuai.is_grad_enabled():
            reducer.prepare_backward(self._sync)
        return self.module(*args, **kwargs)

    @property
    def bytes_per_sync(self):
        """Bytes all-reduced per optimizer step (halved by fp16/bf16 compression)."""
        return self._build_reducer().bytes_per_sync

    @property
    def num_buckets(self):
        return self._build_reducer().num_buckets
