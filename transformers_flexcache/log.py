"""Loggers of this package, under transformers' verbosity.

`transformers.logging.set_verbosity_error()` (or `TRANSFORMERS_VERBOSITY=error`) silences transformers' own warnings;
a user who does that expects ours to go quiet too. Our loggers keep their own names (`transformers_flexcache.*`, so
that `logging.getLogger("transformers_flexcache")` configures them), and a filter drops every record below
transformers' current verbosity.
"""

from __future__ import annotations

import logging

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
