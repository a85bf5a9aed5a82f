"""Loggers of this package, under transformers' verbosity; and the dependencies' import-time noise our commands drop.

`transformers.logging.set_verbosity_error()` (or `TRANSFORMERS_VERBOSITY=error`) silences transformers' own warnings;
a user who does that expects ours to go quiet too. Our loggers keep their own names (`transformers_flexcache.*`, so
that `logging.getLogger("transformers_flexcache")` configures them), and a filter drops every record below
transformers' current verbosity.

`quiet_dependencies()` (around each command of `__main__`): importing torchao (transformers' quantizers import it
whenever a model loads) logs that its CUDA kernel libraries failed to load on a machine without CUDA, and that its
enums are registered with pytree's deprecated `register_constant()`; torch's inductor imports `torch.utils.mkldnn`,
whose TorchScript classes warn that `torch.jit.script_method` is deprecated. None concerns a user of a command, who
would read them before its first line. Each is dropped by its logger (or warning category) and its message, nothing
else: another failure of torchao, or a warning about another enum, still shows.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings

from transformers.utils import logging as hf_logging


class _TransformersVerbosity(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= hf_logging.get_verbosity()


_FILTER = _TransformersVerbosity()


def get_logger(name: str) -> logging.Logger:
    """The logger `name`, which drops records below transformers' verbosity (idempotent)."""
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger


# torchao's kernel libraries for CUDA (`_C_cutlass_90a`, `_C_mxfp8`, ...), which it tries to load on any machine
_TORCHAO_KERNEL_LIBRARY = re.compile(r"^Failed to load \S*torchao[/\\]_C\w*[.\w-]*\.so: ")
_SCRIPT_METHOD_DEPRECATION = r"`torch\.jit\.script_method` is deprecated"


class _DependencyNoise(logging.Filter):
    """Drops torchao's CUDA kernel libraries failing to load without CUDA, and pytree's deprecation of
    `register_constant()` for torchao's own enums."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "torchao":
            return not (_TORCHAO_KERNEL_LIBRARY.match(record.getMessage()) and not _has_cuda())
        registered = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not (
            "register_constant()" in str(record.msg)
            and "Enum subclass" in str(record.msg)
            and getattr(registered, "__module__", "").startswith("torchao.")
        )


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


_NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_dependencies():
    """Within the context, the dependencies' import-time lines of the module docstring are dropped (undone after;
    contexts nest: each removes only its own filters)."""
    noise = _DependencyNoise()
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    for logger in loggers:
        logger.addFilter(noise)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SCRIPT_METHOD_DEPRECATION, category=DeprecationWarning)
            yield
    finally:
        for logger in loggers:
            logger.removeFilter(noise)
