"""`inspect.signature` once per function.

A flexible generate call asks for the same few signatures at every call (upstream's `generate`, to bind a call's
arguments; the encoder's `forward`, to pick its arguments): about 0.1-0.3 ms each on one core of an AMD EPYC Zen 3,
every call. They are held per function, weakly (a function dropped, or a module's `forward` replaced by another
function, is read anew). A bound method's signature (its first parameter dropped) depends on its function alone, so
it is held under `__func__`; a callable that cannot be held (no weak reference to it) is read at every call.
"""

from __future__ import annotations

import inspect
import weakref

_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # function -> (bound, signature)


def signature_of(function) -> inspect.Signature:
    """`inspect.signature(function)`, held per function (see the module docstring)."""
    bound = inspect.ismethod(function)
    key = function.__func__ if bound else function
    try:
        held = _HELD.get(key)
    except TypeError:  # not weakly referenceable (e.g. some builtins): not held
        return inspect.signature(function)
    if held is not None and held[0] == bound:
        return held[1]
    signature = inspect.signature(function)
    _HELD[key] = (bound, signature)
    return signature
