"""`bench --isa avx2`: the run in a child process whose libraries are capped at AVX2, and whose report says so."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from transformers_flexcache.__main__ import main
from transformers_flexcache.bench import isa
from transformers_flexcache.bench.command import rerun_for_isa
from transformers_flexcache.compile import cpu_facts, isa_limit

HAS_AVX512 = "avx512f" in (cpu_facts().hardware_flags or cpu_facts().flags)

# What a child under the caps reads: the report's ISA facts, and the ISA oneDNN's verbose mode names as it runs a linear.
CHILD = """
import json, os, torch
from transformers_flexcache.bench.report import isa_info
torch.set_num_threads(1)
weight = torch.randn(64, 64)
packed = torch.ops.mkldnn._reorder_linear_weight(weight, 4)
torch.ops.mkldnn._linear_pointwise(torch.randn(4, 64), packed, None, "none", [], "")
names = {name: os.environ.get(name) for name in %r}
print("RESULT " + json.dumps({"isa": isa_info(), "env": names, "capability": torch.backends.cpu.get_cpu_capability()}))
"""


def test_the_child_command_reruns_the_same_arguments_with_every_cap_set():
    command, environ = isa.child_command(["bench", "--isa", "avx2", "--quick"], "avx2")
    assert command == [sys.executable, "-m", "transformers_flexcache", "bench", "--isa", "avx2", "--quick"]
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "CT2_FORCE_CPU_ISA"):
        assert environ[name].lower() == "avx2"
    assert isa.applied("avx2", environ) and not isa.applied("avx2", {})
    assert isa.isa_environment("native") == {}
    with pytest.raises(ValueError, match="not one of"):
        isa.isa_environment("avx512")


@pytest.mark.skipif(not HAS_AVX512, reason="the caps remove nothing on a CPU without AVX-512")
def test_a_child_under_the_caps_sees_them_and_its_kernels_and_report_say_avx2(tmp_path):
    command, environ = isa.child_command([], "avx2")
    environ["ONEDNN_VERBOSE"] = "1"
    names = list(isa.ISA_ENVIRONMENTS["avx2"])
    done = subprocess.run(
        [sys.executable, "-c", CHILD % (names,)], env=environ, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["env"] == isa.ISA_ENVIRONMENTS["avx2"]
    assert result["capability"] == "AVX2"
    facts = result["isa"]
    assert facts["flags"] == ["avx2"] and "avx512f" in facts["hardware_flags"]
    assert facts["torch_capability"] == "AVX2" and not facts["vnni"] and not facts["bf16_native"]
    assert "ATEN_CPU_CAPABILITY=avx2" in facts["isa_limit"]
    # oneDNN itself dispatched at AVX2 (its verbose line names the ISA it runs)
    isa_lines = [line for line in done.stdout.splitlines() if ",info,cpu,isa:" in line]
    assert isa_lines and all("AVX2" in line and "512" not in line for line in isa_lines), isa_lines


def test_caps_are_read_from_the_environment_and_the_lowest_wins():
    assert isa_limit({}) == (None, {})
    level, named = isa_limit({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"})
    assert level == 2 and named == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    assert isa_limit({"ONEDNN_MAX_CPU_ISA": "ALL"})[0] is None
    assert isa_limit({"MKL_ENABLE_INSTRUCTIONS": "AVX512"})[0] == 3


def test_native_runs_in_place_and_a_capped_process_does_not_start_another(monkeypatch):
    class Args:
        isa = "native"
        argv = ["bench"]

    assert rerun_for_isa(Args) is None
    Args.isa = "avx2"
    for name, value in isa.ISA_ENVIRONMENTS["avx2"].items():
        monkeypatch.setenv(name, value)
    assert rerun_for_isa(Args) is None  # already the child


def test_bench_isa_avx2_runs_the_command_in_a_child_with_the_caps(monkeypatch):
    for name in isa.ISA_ENVIRONMENTS["avx2"]:
        monkeypatch.delenv(name, raising=False)
    seen = {}

    def fake_run(command, env, check):
        seen.update(command=command, env=env)
        return subprocess.CompletedProcess(command, 3)

    monkeypatch.setattr(isa.subprocess, "run", fake_run)
    argv = ["bench", "--isa", "avx2", "--quick", "--models", "t5", "--no-progress"]
    assert main(argv) == 3  # the child's status
    assert seen["command"][-len(argv) :] == argv
    assert all(seen["env"][name] == value for name, value in isa.ISA_ENVIRONMENTS["avx2"].items())


def test_bench_refuses_an_unknown_isa(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--isa", "avx512"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not HAS_AVX512, reason="the caps remove nothing on a CPU without AVX-512")
def test_a_quick_bench_under_isa_avx2_reports_the_capped_cpu(tmp_path):
    path = tmp_path / "bench.json"
    argv = ["bench", "--isa", "avx2", "--quick", "--models", "t5", "--strategies", "dynamic", "--calls", "1"]
    argv += ["--threads", "1", "--no-progress", "--no-ctranslate2", "--compile-cache", "none", "--json", str(path)]
    done = subprocess.run([sys.executable, "-m", "transformers_flexcache", *argv], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    machine = json.loads(path.read_text())["machine"]
    assert machine["isa"]["flags"] == ["avx2"] and machine["isa"]["int8_bits"] in (7, None)
    assert "limited by ATEN_CPU_CAPABILITY=avx2" in machine["cpu_line"] and "an emulation" in machine["cpu_line"]
    assert "--isa avx2: running in a child process" in done.stdout
