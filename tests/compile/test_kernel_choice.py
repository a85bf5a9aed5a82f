"""`compile.kernel_choice`: a linear's kernel measured once per CPU and shape, kept on disk, read back."""

from __future__ import annotations

import json

import pytest

from transformers_flexcache.compile import kernel_choice
from transformers_flexcache.compile.cpu import forced


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TRANSFORMERS_FLEXCACHE_KERNEL_CHOICES", str(tmp_path))
    kernel_choice._TABLES.clear()
    yield tmp_path
    kernel_choice._TABLES.clear()


def test_a_shape_is_measured_once_saved_per_cpu_and_read_back(table_dir, monkeypatch):
    assert kernel_choice.choice(2, 64, 96) is None  # not measured: the passes keep the rule
    table = kernel_choice.measure_linears([(64, 96)], [2])
    entry = table["2x64x96"]
    assert entry["choice"] in entry["ms"] and set(entry["ms"]) <= {"onednn", "mkl"}
    files = list(table_dir.glob("*.json"))
    assert len(files) == 1 and "2x64x96" in json.loads(files[0].read_text())
    kernel_choice._TABLES.clear()  # a new process reads the file
    monkeypatch.setattr(kernel_choice, "measure", lambda *a, **k: pytest.fail("measured twice"))
    assert kernel_choice.choice(2, 64, 96) == entry["choice"]
    kernel_choice.measure_linears([(64, 96)], [2])
    assert kernel_choice.choice(None, 64, 96) is None  # dynamic rows: not measured


def test_another_cpu_has_a_table_of_its_own(table_dir):
    kernel_choice.measure_linears([(64, 96)], [2])
    with forced(flags=frozenset({"avx2", "fma"})):
        kernel_choice._TABLES.clear()
        assert kernel_choice.choice(2, 64, 96) is None


def test_a_challenger_must_beat_the_rule_by_the_margin(table_dir, monkeypatch):
    def fake_runners(rows, k, n, candidates):
        return {name: (lambda: None) for name in candidates if name != "inductor"}

    monkeypatch.setattr(kernel_choice, "_runners", fake_runners)
    times = iter([])

    def clock():
        return next(times)

    # onednn (the rule on a CPU that is not Intel's) 1.00 ms against mkl 0.97 ms: within the margin, the rule stays
    with forced(vendor="AuthenticAMD"):
        monkeypatch.setattr(kernel_choice.time, "perf_counter", clock)
        rounds, calls = 3, 1
        values = []
        for _ in range(rounds):
            values += [0.0, 1.0e-3, 0.0, 0.97e-3]
        times = iter(values)
        entry = kernel_choice.measure(2, 8, 8, rounds=rounds, calls=calls)
    assert entry["rule"] == "onednn" and entry["choice"] == "onednn"
