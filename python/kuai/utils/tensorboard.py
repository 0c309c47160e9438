"""kuai.utils.tensorboard.SummaryWriter: TensorBoard scalars without per-step host reads.

``writer.add_scalar("loss", loss, step)`` takes the loss as a device tensor and does not read it:
the value goes into kuai's metric ring, and a logger thread converts it ``lag`` steps later, when
the step that made it has long finished, and writes the event file (and a JSONL file if asked).
Calling ``loss.item()`` every step instead waits for the device every step, whatever the call is
named. ``kuai.host_reads_this_thread()`` counts what the training thread read.
"""

import os

from kuai._kuai import Tensor
from kuai._kuai.log import MetricLog


class SummaryWriter:
    def __init__(self, log_dir="runs", lag=2, jsonl=None, flush_secs=None):
        del flush_secs  # the logger thread writes as steps are converted
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self._log = MetricLog(tensorboard_dir=log_dir, jsonl_path=jsonl or "", lag=lag)
        self._step = None
        self._device, self._host = [], []

    def add_scalar(self, tag, scalar_value, global_step, walltime=None):
        """Queues one scalar of step ``global_step``: a one-element tensor (not read here) or a
        number. Steps are written in the order they are given."""
        if self._step is not None and global_step != self._step:
            self._push()
        self._step = global_step
        self._walltime = walltime
        if isinstance(scalar_value, Tensor):
            self._device.append((tag, scalar_value))
        else:
            self._host.append((tag, float(scalar_value)))

    def _push(self):
        if self._step is None:
            return
        self._log.push(self._step, self._device, self._host, self._walltime)
        self._step = None
        self._device, self._host = [], []

    def flush(self):
        self._push()
        self._log.flush()

    def close(self):
        self._push()
        self._log.close()

    def history(self):
        """Every step written so far, as dicts of numbers (flush first for all of them)."""
        return self._log.history()

    @property
    def event_file(self):
        return self._log.event_file

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
