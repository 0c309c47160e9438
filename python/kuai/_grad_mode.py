"""kuai.no_grad() / kuai.enable_grad(): the engine's grad mode as a context manager and decorator."""

import functools

from kuai._kuai import is_grad_enabled, set_grad_enabled


class _GradModeContext:
    _mode = True

    def __enter__(self):
        self._prev = is_grad_enabled()
        set_grad_enabled(self._mode)
        return self

    def __exit__(self, *exc):
        set_grad_enabled(self._prev)
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with self.__class__():
                return fn(*args, **kwargs)

        return wrapped


class no_grad(_GradModeContext):
    """Ops in this scope record no autograd graph (inference, parameter updates)."""

    _mode = False


class enable_grad(_GradModeContext):
    """Ops in this scope record the autograd graph again (inside a no_grad scope)."""

    _mode = True
