"""An artifact's builds in forked worker processes (`compile/builds.py`): each runs once, in a child where workers
allow, a failed child's build runs again here, OpenMP work in a child finishes, leaving with an error stops them."""

import os
import time
from pathlib import Path

import pytest
import torch

from transformers_flexcache.compile.builds import WORKERS_VARIABLE, Builds, build_workers

pytestmark = pytest.mark.skipif(build_workers(2) < 2, reason="needs os.fork on Linux")


def writes(path: Path, *, fail_in_child: bool = False):
    parent = os.getpid()

    def build() -> None:
        if fail_in_child and os.getpid() != parent:
            raise RuntimeError("a build that fails in a worker process")
        # a parallel ATen op: GNU OpenMP's pool is the parent's, which a child must not wait on
        total = (torch.ones(2_000_000) * 2).sum().item()
        path.write_text(f"{os.getpid()} {total:.0f}")

    return build


def test_each_build_runs_once_in_a_child_process(tmp_path):
    torch.ones(2_000_000).sum()  # the parent's OpenMP pool is up before the forks
    finished = []
    with Builds(2, done=lambda name, seconds: finished.append(name), timeout=120) as builds:
        for index in range(3):
            builds.submit(f"g{index}", writes(tmp_path / f"g{index}"))
        builds.finish()
    assert sorted(finished) == ["g0", "g1", "g2"]
    for index in range(3):
        pid, total = (tmp_path / f"g{index}").read_text().split()
        assert int(pid) != os.getpid() and total == "4000000"
    assert torch.get_num_threads() >= 1 and torch._inductor.config.cpp.threads < 1  # the parent's settings untouched


def test_a_build_whose_child_fails_runs_again_here(tmp_path, caplog):
    finished = []
    with Builds(2, done=lambda name, seconds: finished.append(name), timeout=120) as builds:
        builds.submit("bad", writes(tmp_path / "bad", fail_in_child=True))
        builds.submit("good", writes(tmp_path / "good"))
        builds.finish()
    assert sorted(finished) == ["bad", "good"]
    assert int((tmp_path / "bad").read_text().split()[0]) == os.getpid()  # built here, after its child failed
    assert int((tmp_path / "good").read_text().split()[0]) != os.getpid()
    assert "bad was not built by its worker process (exit status 1); building it here" in caplog.text


def test_an_error_in_the_parent_stops_the_children(tmp_path):
    def slow() -> None:
        time.sleep(60)
        (tmp_path / "slow").write_text("finished")

    with pytest.raises(KeyError), Builds(2, timeout=120) as builds:
        builds.submit("slow", slow)
        pid = next(iter(builds._running))
        raise KeyError("the parent failed")
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # killed and reaped
    assert not (tmp_path / "slow").exists()


def test_a_child_past_its_timeout_is_built_again_here(tmp_path, caplog):
    parent = os.getpid()

    def build() -> None:
        if os.getpid() != parent:
            time.sleep(60)
        (tmp_path / "out").write_text(str(os.getpid()))

    with Builds(2, timeout=0.5) as builds:
        builds.submit("stuck", build)
        builds.finish()
    assert (tmp_path / "out").read_text() == str(parent)
    assert "stuck was not built by its worker process (past 0 s); building it here" in caplog.text


def test_one_worker_builds_here(tmp_path):
    with Builds(1) as builds:
        builds.submit("here", writes(tmp_path / "here"))
        builds.finish()
    assert int((tmp_path / "here").read_text().split()[0]) == os.getpid()


def test_workers_from_the_variable(monkeypatch):
    monkeypatch.setenv(WORKERS_VARIABLE, "3")
    assert build_workers() == 3
    monkeypatch.delenv(WORKERS_VARIABLE)
    assert build_workers() == len(os.sched_getaffinity(0))
    for bad in ("0", "two"):
        monkeypatch.setenv(WORKERS_VARIABLE, bad)
        with pytest.raises(ValueError, match=f"{WORKERS_VARIABLE}='{bad}': give a whole number of at least 1"):
            build_workers()
