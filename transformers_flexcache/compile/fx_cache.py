"""Inductor's FX graph cache for the frozen graphs of `compile_config_for_cpu()`: their packed weights keyed as the
other frozen constants are.

Design decisions:
- With freezing, inductor's FX graph cache keys a graph's frozen constants by their sizes alone and, at a hit, takes
  their values from the graph being compiled (torch==2.13.0: `FxGraphCachePickler._reduce_tensor`,
  `CompiledFxGraphConstantsWithGm`): one entry serves any weights of those sizes, and a hit runs on the weights of the
  model at hand. But it refuses every graph that holds an mkldnn-layout tensor (`CacheabilityValidator.check_tensor`:
  "mkldnn tensors unpickleable"), and the packed copies of the weights that freezing makes for MKL and oneDNN are
  such tensors, frozen constants like the others, never pickled. So no frozen CPU graph was ever cached: a second
  start of a server bypassed the cache for every graph and reused the C++ kernels alone (docs/performance.md, "Warm
  starts").
- `packed_weights_cacheable()`: within it, a frozen mkldnn constant is keyed as the other frozen constants (sizes,
  dtype, device, and its layout); any other mkldnn tensor is still refused, as torch refuses it. The packed copies
  must then exist before the key is taken (a hit runs no pass after it): inductor's own are (freezing makes them),
  and `passes.fp32_linears.OneDNNLinears` runs before freezing for that reason.
- Scoped, not installed for the process: `compile.config.compile_settings` enters it around every compile of ours
  (with freezing), and the previous functions are back when the last such context exits (`utils/torch_drift.py`
  guards the names).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_LOCK = threading.Lock()
_DEPTH = 0  # contexts open (compiles of several threads may overlap)
_SAVED: dict = {}


def _frozen_packed(tensor: torch.Tensor) -> bool:
    from torch._inductor.freezing_utils import is_frozen_param

    return tensor.is_mkldnn and is_frozen_param(tensor)


def _install() -> None:
    from torch._inductor import codecache

    validator, pickler = codecache.CacheabilityValidator, codecache.FxGraphCachePickler
    check_tensor, reduce_tensor = validator.__dict__["check_tensor"], pickler.__dict__["_reduce_tensor"]
    _SAVED.update(check_tensor=check_tensor, reduce_tensor=reduce_tensor)

    def checked(tensor: torch.Tensor) -> None:
        if not _frozen_packed(tensor):
            check_tensor.__func__(tensor)

    def reduced(self, tensor: torch.Tensor):
        if _frozen_packed(tensor):  # keyed by what the frozen constants are keyed by; the value comes from the graph
            return codecache._ident, ((tuple(tensor.shape), tensor.dtype, tensor.device, "mkldnn"),)
        return reduce_tensor(self, tensor)

    validator.check_tensor = staticmethod(checked)
    pickler._reduce_tensor = reduced


def _uninstall() -> None:
    from torch._inductor import codecache

    codecache.CacheabilityValidator.check_tensor = _SAVED.pop("check_tensor")
    codecache.FxGraphCachePickler._reduce_tensor = _SAVED.pop("reduce_tensor")


@contextlib.contextmanager
def packed_weights_cacheable() -> Iterator[None]:
    """Within this context inductor's FX graph cache takes frozen graphs that hold packed weights (see the module
    docstring); torch's own functions are back when the last such context exits."""
    global _DEPTH
    with _LOCK:
        if _DEPTH == 0:
            _install()
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                _uninstall()
