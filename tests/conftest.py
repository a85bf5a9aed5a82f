"""Settings for the whole suite.

The default run is spread over processes by pytest-xdist (`-n auto --maxprocesses 4 --dist loadfile`, set in
pyproject.toml; `-n 0` runs in one process): each worker gets one torch thread and compiles inductor's kernels in
its own process, so that two workers on two cores do not oversubscribe them (OpenMP threads spin on a busy core).
The user's cache directory is a temporary one (`XDG_CACHE_HOME`): commands whose compile cache defaults to it
(`serve --compile`, `bench`) write nothing into the user's home.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile


def pytest_configure(config):
    # torchao's import-time lines (its CUDA kernel libraries, pytree's deprecation of its enums) go through torch's
    # own log handler, which writes past pytest's capture, between the progress dots: drop them as the commands do.
    from transformers_flexcache.log import quiet_dependencies

    quiet = contextlib.ExitStack()
    quiet.enter_context(quiet_dependencies())
    config.add_cleanup(quiet.close)
    cache_home = tempfile.mkdtemp(prefix="flexcache-tests-cache-")
    os.environ["XDG_CACHE_HOME"] = cache_home
    config.add_cleanup(lambda: shutil.rmtree(cache_home, ignore_errors=True))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # read when torch._inductor.config is first imported
        import torch

        torch.set_num_threads(1)
