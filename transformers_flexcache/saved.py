"""The stable entry point of saved folders: `modeling_flexcache.py` files written by `save_pretrained` call only this.

A folder saved today must load after any later refactor of the package, so it names an override class by its name
(`FlexT5ForConditionalGeneration`) and the format it was written in, never a module path.
"""

from __future__ import annotations

from ._version import __version__
from .models.auto_classes import FORMAT_VERSION
from .models.catalogue import flex_model_classes
from .models.generic import flex_class_for, upstream_class_named

# The formats of `modeling_flexcache.py` that this package reads (it writes `models.auto_classes.FORMAT_VERSION`).
READABLE_FORMAT_VERSIONS = (1,)


def override_class(name: str, *, format_version: int = FORMAT_VERSION) -> type:
    """The installed override class called `name`, for a folder written in `format_version`.

    Raises:
        ValueError: the format is newer than this package reads, or no override class has that name (a folder
            saved by a newer transformers-flexcache: upgrade the package).
    """
    if format_version not in READABLE_FORMAT_VERSIONS:
        raise ValueError(
            f"this folder was saved in transformers-flexcache's format {format_version}, and the installed version "
            f"{__version__} reads formats {list(READABLE_FORMAT_VERSIONS)}; upgrade transformers-flexcache"
        )
    by_name = {flex_class.__name__: flex_class for flex_class in flex_model_classes()}
    if name not in by_name:
        # A class of the generic route (generic.py) for an upstream class that no listed type names.
        upstream_class = upstream_class_named(name)
        if upstream_class is not None:
            return flex_class_for(upstream_class)
        raise ValueError(
            f"transformers-flexcache {__version__} has no override class {name!r} (it has {sorted(by_name)}); the "
            "folder was saved by another version: upgrade transformers-flexcache"
        )
    return by_name[name]
