"""The compression hooks kuai runs on its communication thread (see the package's docstring)."""


class CompressionHook:
    """A cast around DDP's all-reduce, run by the engine (not called from Python)."""

    def __init__(self, dtype, name=None):
        self.dtype = dtype  # what the wire carries: "fp16", "bf16", or "none" (fp32)
        self.__name__ = name or f"{dtype}_compress_hook"

    def __call__(self, state, bucket):
        raise RuntimeError(f"{self.__name__} runs inside kuai's communication thread; register it "
                           "with model.register_comm_hook(state, hook) instead of calling it")

    def __repr__(self):
        return f"<kuai comm hook {self.__name__}>"


class ErrorFeedback:
    """The state that turns error feedback on: each element's rounding error, kept per bucket in
    fp32, is added to the next step's gradient before it is rounded."""


fp16_compress_hook = CompressionHook("fp16")
bf16_compress_hook = CompressionHook("bf16")
allreduce_hook = CompressionHook("none", "allreduce_hook")  # PyTorch's default: the plain fp32 all-reduce
