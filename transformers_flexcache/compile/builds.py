"""An artifact's AOTInductor builds, several at once in forked worker processes (`write_artifact`).

One build of a t5-small-sized T5's decode step took 15.6 s on one core (AMD EPYC Zen 5; docs/compile.md), and runs on
one core: inductor's lowering in Python, then two C++ compiles one after the other (the wrapper 5.5 s, the kernels
2.5 s). A `torch.compile` of the same graph compiles its kernels in inductor's worker pool on every core; the builds
of an artifact's graphs are independent, so they run side by side instead:

- The parent exports each graph (its `ExportedProgram` is in memory, with the model's weights) and forks; the child
  builds the package from the program it inherited, under the graph's `compile_settings`, and exits: nothing is
  pickled, the graph passes and the package's own operators are there as in the parent. At most `workers` children
  run at once. A child's eager work runs on one thread (`_one_thread_in_child`: OpenMP's pool does not survive a
  fork), its generated code for the parent's threads.
- A child that fails (an exception, a signal, memory) or runs past `timeout` seconds is not trusted: its graph is
  built again in the parent, after the others, which raises the build's own error where there is one. A package is
  only ever written by one process.
- One worker, or no `os.fork` (not Linux): each graph is built in the parent as it comes, as before.

Workers: `TRANSFORMERS_FLEXCACHE_BUILD_WORKERS`, else the CPUs this process may run on (`os.sched_getaffinity`). Each
child holds what a build holds (for a bart-base-sized model about three copies of its weights at its peak).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from ..log import get_logger

logger = get_logger(__name__)

WORKERS_VARIABLE = "TRANSFORMERS_FLEXCACHE_BUILD_WORKERS"
TIMEOUT_S = 1800.0  # one child's build; past it the graph is built again in the parent
_POLL_S = 0.02


def build_workers(workers: int | None = None) -> int:
    """How many builds run at once: `workers` where given, else `$TRANSFORMERS_FLEXCACHE_BUILD_WORKERS`, else the
    CPUs this process may run on; 1 where `os.fork` is missing or the platform is not Linux.

    Raises:
        ValueError: the variable is not a whole number of at least 1.
    """
    if workers is None:
        named = os.environ.get(WORKERS_VARIABLE, "").strip()
        if named:
            try:
                workers = int(named)
            except ValueError:
                workers = 0
            if workers < 1:
                raise ValueError(
                    f"{WORKERS_VARIABLE}={named!r}: give a whole number of at least 1 (1 builds each graph in this "
                    "process)"
                )
        else:
            workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if workers < 1:
        raise ValueError(f"workers={workers}: give at least 1")
    if not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return 1
    return workers


class Builds:
    """Run `build()` callables, up to `workers` at once in forked children (see the module docstring).

    `submit(name, build)` starts one (waiting for a free worker first); `finish()` waits for all and builds again in
    this process those whose child failed. `done(name, seconds)` is called as each completes (`seconds`: its wall
    time from its start). Use as a context manager: leaving with an exception kills the children still running.
    """

    def __init__(self, workers: int, *, done=None, timeout: float = TIMEOUT_S):
        self.workers, self.timeout = workers, timeout
        self._done = done or (lambda name, seconds: None)
        self._running: dict[int, tuple] = {}  # pid -> (name, build, started)
        self._failed: list[tuple] = []  # (name, build, why)

    def __enter__(self) -> Builds:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is not None:
            self.kill()

    def submit(self, name: str, build) -> None:
        if self.workers <= 1:
            started = time.perf_counter()
            build()
            self._done(name, time.perf_counter() - started)
            return
        while len(self._running) >= self.workers:
            self._reap(block=True)
        sys.stdout.flush()
        sys.stderr.flush()
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:  # the child: build, then leave without running anything of the parent's (no atexit, no finally)
            status = 1
            try:
                _one_thread_in_child()
                build()
                status = 0
            except BaseException as error:  # noqa: BLE001 - the parent builds it again and raises the real error
                try:
                    sys.stderr.write(f"[{name}: its build failed in a worker process: {type(error).__name__}]\n")
                    sys.stderr.flush()
                except BaseException:  # noqa: BLE001
                    pass
            finally:
                os._exit(status)
        self._running[pid] = (name, build, started)

    def finish(self) -> None:
        """Wait for every child; build again here each graph whose child failed (raising its error where it fails)."""
        while self._running:
            self._reap(block=True)
        failed, self._failed = self._failed, []
        for name, build, why in failed:
            logger.warning(
                "compiled artifact: %s was not built by its worker process (%s); building it here", name, why
            )
            started = time.perf_counter()
            build()
            self._done(name, time.perf_counter() - started)

    def kill(self) -> None:
        """Stop every child still running (the build was abandoned)."""
        for pid in list(self._running):
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        self._running.clear()

    def _reap(self, *, block: bool) -> None:
        """Collect the children that ended (with `block`, wait until one has); a child past `timeout` is killed."""
        while True:
            for pid, (name, build, started) in list(self._running.items()):
                try:
                    ended, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:  # reaped by someone else (a SIGCHLD handler): its file says nothing
                    ended, status = pid, -1
                if ended == 0:
                    if time.perf_counter() - started > self.timeout:
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        del self._running[pid]
                        self._failed.append((name, build, f"past {self.timeout:.0f} s"))
                        return
                    continue
                del self._running[pid]
                if status == 0:
                    self._done(name, time.perf_counter() - started)
                else:
                    self._failed.append((name, build, _status_phrase(status)))
                return
            if not block or not self._running:
                return
            time.sleep(_POLL_S)


def _one_thread_in_child() -> None:
    """A forked child runs its eager work (the constant folding of freezing: oneDNN's weight reorders) on one thread:
    GNU OpenMP's thread pool is the parent's and does not survive a fork (a child's first parallel region waited
    forever on it). The code inductor generates names the parent's thread count (`parallel_num_threads`, which
    reads `torch.get_num_threads()` unless `cpp.threads` is set), so that count is set as `cpp.threads` first."""
    import torch
    from torch._inductor import config

    if config.cpp.threads < 1:
        config.cpp.threads = torch.get_num_threads()
    torch.set_num_threads(1)


def _status_phrase(status: int) -> str:
    if status == -1:
        return "its exit status was lost"
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}"
