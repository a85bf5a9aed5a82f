"""What the upstream checks (`check_request.py`, `check_family.py`) import first: they are about transformers alone,
so this package's code must not be importable while they run.

The scripts import this module from their own folder (`sys.path[0]` when run as `python upstream/<script>.py`), then
call `refuse_flexcache()` before they import torch or transformers.
"""

import importlib.abc
import os
import sys

REFUSED = ("transformers_flexcache", "model_overrides")


class _RefuseFlexcache(importlib.abc.MetaPathFinder):
    """The check is about upstream alone: importing this package's code would invalidate it."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in REFUSED:
            raise ImportError(f"{name} imported during the upstream check; run it without transformers-flexcache")
        return None


def refuse_flexcache() -> None:
    """Take this repository's root off `sys.path` (an editable install puts it there) and make any later import of
    this package's code an ImportError."""
    sys.path[:] = [
        entry for entry in sys.path if not os.path.isdir(os.path.join(entry or ".", "transformers_flexcache"))
    ]
    if not any(isinstance(finder, _RefuseFlexcache) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RefuseFlexcache())
