"""`cpu.cpu_facts()`: its answers hold against /proc/cpuinfo on the machine the suite runs on, and tests can force any.

A probe that torch renames or removes must fail here rather than silently turn a feature off (as VNNI detection once
read a torch function that did not exist, and answered "no VNNI" on every CPU).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from transformers_flexcache.compile import cpu
from transformers_flexcache.compile.cpu import ISA_FLAGS, cpu_facts, forced, read_proc_cpuinfo

CPUINFO = read_proc_cpuinfo()
needs_cpuinfo = pytest.mark.skipif(not CPUINFO.get("flags"), reason="no /proc/cpuinfo flags on this machine")
ON_X86 = torch.cpu.get_capabilities().get("architecture") in ("x86_64", "x86")


def cpuinfo_flags() -> set[str]:
    return set(CPUINFO.get("flags", "").split())


@needs_cpuinfo
def test_the_instruction_sets_are_those_proc_cpuinfo_lists():
    facts = cpu.detected()
    listed = {name for name in ISA_FLAGS.values() if name in cpuinfo_flags()}
    assert facts.flags == listed, f"torch reports {sorted(facts.flags)}, /proc/cpuinfo {sorted(listed)}"


@needs_cpuinfo
def test_vnni_amx_and_bf16_are_what_proc_cpuinfo_says():
    facts, flags = cpu.detected(), cpuinfo_flags()
    assert facts.vnni == ("avx512_vnni" in flags or "amx_int8" in flags)
    assert facts.amx == ("amx_tile" in flags and "amx_int8" in flags)
    assert facts.bf16 == ("avx512_bf16" in flags or "amx_bf16" in flags)


@needs_cpuinfo
def test_vnni_agrees_with_torchs_own_probe_and_torchaos():
    # torch.cpu._is_vnni_supported and torchao's should_reduce_range draw the line that `quantize` draws.
    facts = cpu.detected()
    assert torch.cpu._is_vnni_supported() == ("avx512_vnni" in facts.flags)
    pytest.importorskip("torchao")
    from torchao.utils import should_reduce_range

    if "amx_int8" not in facts.flags:  # torchao reads AVX512-VNNI alone (AMX CPUs have it anyway)
        assert should_reduce_range(torch.device("cpu")) == (not facts.vnni)


@needs_cpuinfo
def test_native_bf16_implies_onednns_bf16_kernels():
    if cpu.detected().bf16:
        assert torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@needs_cpuinfo
def test_the_vendor_family_and_model_are_proc_cpuinfos():
    facts = cpu.detected()
    assert facts.vendor == CPUINFO.get("vendor_id")
    if "cpu family" in CPUINFO:
        assert (facts.family, facts.model) == (int(CPUINFO["cpu family"]), int(CPUINFO["model"]))
    assert facts.model_name  # from /proc/cpuinfo or torch's cpuinfo


@needs_cpuinfo
def test_the_physical_cores_are_the_distinct_cores_of_proc_cpuinfo():
    if "physical_cores" not in CPUINFO:
        pytest.skip("/proc/cpuinfo lists no core ids here")
    assert cpu.detected().physical_cores == int(CPUINFO["physical_cores"])


@pytest.mark.skipif(not ON_X86, reason="ATen's x86 capability names")
def test_torchs_kernel_capability_is_the_widest_the_instruction_sets_allow():
    facts = cpu.detected()
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        pytest.skip(f"ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']} caps it on purpose")
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= facts.flags
    expected = "AVX512" if avx512 else "AVX2" if {"avx2", "fma"} <= facts.flags else "DEFAULT"
    assert facts.capability == expected


def test_describe_names_the_cpu_and_what_decides_its_kernels():
    facts = cpu_facts()
    line = facts.describe()
    assert (facts.model_name or "unknown CPU") in line and f"torch {facts.capability}" in line
    assert ("avx512_vnni" in line) == ("avx512_vnni" in facts.flags)


def test_forced_answers_change_every_decision_and_are_undone_after():
    from transformers_flexcache.compile.passes import resolve_int8_linears, resolve_linear_kernels
    from transformers_flexcache.compile.quantization import int8_bits

    before = cpu_facts()
    with forced(vnni=False, vendor="AuthenticAMD"):
        assert not cpu_facts().vnni and int8_bits() == 7
        assert resolve_int8_linears("auto") in ("fbgemm", "inductor")
        assert resolve_linear_kernels("auto") == "onednn"
        with forced(amx=True, vendor="GenuineIntel"):  # nested: the inner answer wins, then the outer's again
            assert cpu_facts().vnni and int8_bits() == 8 and resolve_int8_linears("auto") == "library"
            assert resolve_linear_kernels("auto") == "mkl"
        assert int8_bits() == 7
    assert cpu_facts() == before


def test_a_forced_answer_is_seen_by_other_threads():
    seen = []
    with forced(bf16=False, amx=False):
        thread = threading.Thread(target=lambda: seen.append((cpu_facts().bf16, cpu_facts().amx)))
        thread.start()
        thread.join()
    assert seen == [(False, False)]


def test_forcing_an_unknown_fact_is_refused_and_changes_nothing():
    before = cpu_facts()
    with pytest.raises(ValueError, match=r"forced\(avx512=...\): not a CPU fact; use one of"):
        with forced(avx512=True):
            pass
    assert cpu_facts() == before


@pytest.mark.parametrize(("capability", "bits"), [("AVX2", 256), ("AVX512", 512), ("DEFAULT", None)])
def test_a_process_capped_by_aten_cpu_capability_pins_inductor_s_vector_width(monkeypatch, capability, bits):
    from transformers_flexcache import compile_config_for_cpu

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    with forced(capability=capability):
        assert cpu.inductor_vector_bits() is None  # not capped: inductor picks, as it always did
        assert "cpp.simdlen" not in compile_config_for_cpu().options
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability.lower())
        assert cpu.inductor_vector_bits() == bits
        assert compile_config_for_cpu().options.get("cpp.simdlen") == bits


# Compiled with compile_config_for_cpu()'s options, into the cache folder of argv[1]; prints the largest difference
# from the eager function.
_VECTOR_PROGRAM = """
import sys, torch
from transformers_flexcache import compile_config_for_cpu

def f(x, index):
    return (x.exp() * 2 + 1)[index].sum(-1)

options = compile_config_for_cpu().options
compiled = torch.compile(f, dynamic=False, options=options)
x, index = torch.randn(37, 53, generator=torch.Generator().manual_seed(0)), torch.tensor([3, 0, 36, 5])
print((compiled(x, index) - f(x, index)).abs().max().item())
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="needs ATen's AVX-512 kernels")
def test_a_process_capped_at_avx2_does_not_load_the_avx512_graphs_of_an_uncapped_one(tmp_path):
    # Inductor's FX graph cache keys no CPU graph by its vector width: without the pinned width the capped process
    # loaded the uncapped one's 16-lane graph, built it against 8-lane vectors, and was off by about 100.
    import subprocess
    import sys

    environ = {key: value for key, value in os.environ.items() if key not in cpu.ISA_LIMIT_VARIABLES}
    environ.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    for extra in ({}, {"ATEN_CPU_CAPABILITY": "avx2"}):
        result = subprocess.run(
            [sys.executable, "-c", _VECTOR_PROGRAM],
            env={**environ, **extra},
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert float(result.stdout.strip().splitlines()[-1]) < 1e-3, (extra, result.stdout)
