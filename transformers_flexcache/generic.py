"""The module path that the generic route's `Flex<UpstreamName>` classes were pickled under before they moved.

Their code and module are `models/generic.py` (their `__module__`); this module resolves any `Flex<UpstreamName>` by
name, so that pickles and saved references made before that code moved keep loading.
"""

from __future__ import annotations

from .models.generic import flex_class_for, upstream_class_named

__all__ = ["flex_class_for", "upstream_class_named"]


def __getattr__(name: str):
    upstream_class = upstream_class_named(name)
    if upstream_class is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return flex_class_for(upstream_class)
