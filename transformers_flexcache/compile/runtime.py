"""What the rest of the package reads or sets of torch's compile machinery: dynamo's recompile limits, its counters
of compiled graphs and compile seconds, inductor's on-disk cache, a reset. The names behind them are private to
torch; they are read here alone (`utils/torch_drift.py` guards each), so that the serving engine, the server and the
benchmark hold no private torch name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# Where a user raises the limit, for the messages that tell them to.
RECOMPILE_LIMIT_NAME = "torch._dynamo.config.recompile_limit"


def recompile_limit() -> int:
    """Graphs dynamo keeps of one function before it runs the others eagerly (`recompile_limit`)."""
    return torch._dynamo.config.recompile_limit


def raise_recompile_limits(num_graphs: int) -> None:
    """Let dynamo keep at least `num_graphs` graphs of one function, and in all (for the whole process: a server
    that serves one engine)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, num_graphs)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, num_graphs)


@contextlib.contextmanager
def recompile_limits(per_function: int, accumulated: int) -> Iterator[None]:
    """Within this context dynamo keeps `per_function` graphs of one function and `accumulated` in all; the previous
    limits are restored after."""
    with torch._dynamo.config.patch(recompile_limit=per_function, accumulated_recompile_limit=accumulated):
        yield


def compiled_graph_count() -> int:
    """Graphs that dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def compile_seconds() -> float:
    """Seconds that dynamo has spent compiling in this process so far (tracing and backend, all frames)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(compilation_time_metrics.get("_compile.compile_inner", ()))


def inductor_cache_dir() -> str:
    """The folder of inductor's on-disk cache (`TORCHINDUCTOR_CACHE_DIR`, or torch's default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


@contextlib.contextmanager
def kernel_profile_compile() -> Iterator[None]:
    """Graphs compiled within are profiled kernel by kernel (`bench-profile`): inductor records each C++ kernel in
    torch's profiler (`cpp.enable_kernel_profile`), and writes each fused group as a C++ function of its own
    (`CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM` at 0 ends a function after every group; otherwise consecutive groups
    share one function, at one row the whole step). Inductor's on-disk cache goes to a folder of its own for the
    process (`<cache>-bench-profile`): its FX graph cache does not key on the function split and would hand back
    graphs compiled without it."""
    import os
    from unittest import mock

    import torch._inductor.config as inductor_config
    from torch._inductor.codegen.cpp import CppScheduling

    folder = inductor_cache_dir().rstrip("/")
    if not folder.endswith("-bench-profile"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder + "-bench-profile"
    with (
        inductor_config.patch({"cpp.enable_kernel_profile": True}),
        mock.patch.object(CppScheduling, "MAX_FUSED_KERNEL_ARGS_NUM", 0),
    ):
        yield
