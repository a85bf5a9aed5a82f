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

from transformers_flexcache.log import quiet_dependencies

# torchao's import-time lines (its CUDA kernel libraries, pytree's deprecation of its enums) go through torch's own
# log handler, which writes past pytest's capture, between the progress dots: dropped as the commands drop them, from
# this file's import on. Installed in pytest_configure they did not hold in pytest-xdist's controller on torch 2.15:
# two register_constant() lines after the summary (`-n 2`, test_executorch's test and test_cpu.py; none with the
# filters installed here). Which import of the controller reached torchao there was not traced.
_QUIET = contextlib.ExitStack()
_QUIET.enter_context(quiet_dependencies())


def pytest_unconfigure(config):
    _QUIET.close()


def pytest_configure(config):
    cache_home = tempfile.mkdtemp(prefix="flexcache-tests-cache-")
    os.environ["XDG_CACHE_HOME"] = cache_home
    config.add_cleanup(lambda: shutil.rmtree(cache_home, ignore_errors=True))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # read when torch._inductor.config is first imported
        import torch

        torch.set_num_threads(1)
