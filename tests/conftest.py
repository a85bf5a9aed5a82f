"""Settings for the whole suite.

The default run is spread over processes by pytest-xdist (`-n auto --maxprocesses 4 --dist loadfile`, set in
pyproject.toml; `-n 0` runs in one process): each worker gets one torch thread and compiles inductor's kernels in
its own process, so that two workers on two cores do not oversubscribe them (OpenMP threads spin on a busy core).
"""

from __future__ import annotations

import os


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # read when torch._inductor.config is first imported
        import torch

        torch.set_num_threads(1)
