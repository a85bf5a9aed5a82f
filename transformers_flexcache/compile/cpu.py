"""What this CPU can do, decided in one place: vendor, instruction sets, VNNI, AMX, native bf16, physical cores.

Every decision that depends on the CPU asks `cpu_facts()`: the bits of `quantize(model, "int8")`, the kernels that
`compile_config_for_cpu()`'s `"auto"` options pick, whether bf16 is native, the machine line of `bench` and
`bench-serve`. Nothing else in the package reads /proc/cpuinfo or torch's CPU probes.

Design decisions:
- torch's public answers first: `torch.cpu.get_capabilities()` (cpuinfo's detection, torch>=2.13: instruction
  sets, name, physical cores) and `torch.backends.cpu.get_cpu_capability()` (the vector width ATen's kernels
  dispatch to). /proc/cpuinfo gives what torch does not report (the vendor, family and model) and is the
  cross-check: `tests/compile/test_cpu.py` holds every answer against it on the machine the suite runs on, and
  `tests/test_torch_drift.py` fails if either torch function is renamed, so that a moved probe fails a test instead
  of silently turning a feature off (as `torch._C._cpu._is_vnni_supported`, which torch 2.13 does not have, once
  turned VNNI off on every CPU).
- VNNI means AVX512-VNNI (or AMX, whose CPUs have it): the instructions with which oneDNN's and FBGEMM's int8 kernels
  sum u8 x s8 products in 32 bits. Without them (AVX2, AVX-512 without VNNI, and AVX-VNNI alone, whose kernels
  are not measured here) the kernels sum pairs in saturating 16 bits, so int8 is quantized to 7 bits: torch's
  `torch.cpu._is_vnni_supported` and torchao's `should_reduce_range` draw the same line.
- Native bf16 means AVX512-BF16 or AMX-BF16 instructions; elsewhere torch emulates bf16 arithmetic in float32
  (oneDNN's `_is_mkldnn_bf16_supported` also says True on AVX-512 CPUs without them).
- Tests force any answer with `forced(**changes)` (a context manager), so that every CPU-dependent branch runs on
  every machine that can run it; the facts themselves are read once per process.
- The instruction sets are the ones the kernels may use, not only the ones the CPU has: the variables that cap the
  libraries' dispatch (`ISA_LIMIT_VARIABLES`: ATen's `ATEN_CPU_CAPABILITY`, which inductor's code generation also
  reads, oneDNN's `ONEDNN_MAX_CPU_ISA`, MKL's `MKL_ENABLE_INSTRUCTIONS`, FBGEMM's `FBGEMM_ENABLE_INSTRUCTIONS`, CTranslate2's `CT2_FORCE_CPU_ISA`) remove
  the sets above the lowest cap they name from `flags` (`hardware_flags` keeps /proc/cpuinfo's). So a process run
  with all of them at AVX2 on an AVX-512 CPU (`bench --isa avx2`) answers as an AVX2 CPU would: no VNNI (7-bit
  int8), no native bf16, and a compile cache entry of its own. It emulates an AVX2 CPU's instructions only: the
  caches, memory bandwidth and clock stay this CPU's.
- Inductor's FX graph cache does not key a CPU graph by the vector width its C++ code was generated for
  (torch==2.13.0: `FxGraphHashDetails` holds device facts of CUDA only), while `ATEN_CPU_CAPABILITY` changes that
  width: a process capped at AVX2 loaded the AVX-512 graphs that an uncapped one had cached, built their 16-lane
  code against 8-lane vectors, and computed garbage (an index out of bounds in a compiled T5 encoder, scores off by
  15-22). `inductor_vector_bits()` gives the width a capped process's compiles pin (`cpp.simdlen`, which is in the
  key), so that the two keep apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from collections.abc import Iterator

import torch

# torch.cpu.get_capabilities() names -> /proc/cpuinfo flag names, for the instruction sets that decide kernels.
ISA_FLAGS = {
    "avx2": "avx2",
    "fma3": "fma",
    "avx512_f": "avx512f",
    "avx512_bw": "avx512bw",
    "avx512_vl": "avx512vl",
    "avx512_dq": "avx512dq",
    "avx512_vnni": "avx512_vnni",
    "avx_vnni": "avx_vnni",
    "avx512_bf16": "avx512_bf16",
    "amx_tile": "amx_tile",
    "amx_int8": "amx_int8",
    "amx_bf16": "amx_bf16",
}

# The environment variables that cap which instructions a library's kernels dispatch to (torch's ATen and inductor,
# oneDNN (two names), MKL, FBGEMM, CTranslate2), as `bench --isa` sets them.
ISA_LIMIT_VARIABLES = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "FBGEMM_ENABLE_INSTRUCTIONS",
    "CT2_FORCE_CPU_ISA",
)
# The level of each /proc/cpuinfo flag of ISA_FLAGS: a cap at level L keeps the flags of level <= L.
_FLAG_LEVELS = {"avx2": 2, "fma": 2, "avx_vnni": 2.5}  # avx512* 3, amx* 4 (see _flag_level)


def _flag_level(flag: str) -> float:
    if flag.startswith("amx"):
        return 4
    if flag.startswith("avx512"):
        return 3
    return _FLAG_LEVELS.get(flag, 0)


def _cap_level(value: str) -> float | None:
    """The level a cap's value names (`"avx2"`, `"AVX2"`, `"AVX512_CORE"`, `"default"`, ...), None for a value this
    does not know (no cap assumed: the libraries ignore or refuse it themselves)."""
    value = value.strip().upper()
    if not value or value == "ALL":
        return None
    if "AMX" in value or value.startswith("AVX10"):
        return 4
    if value.startswith("AVX512"):
        return 3
    if value.startswith("AVX2_VNNI"):
        return 2.5
    if value.startswith("AVX2"):
        return 2
    if value.startswith("AVX"):
        return 1.5
    if value in ("DEFAULT", "GENERIC", "NONE") or value.startswith("SSE"):
        return 1
    return None


def isa_limit(environ=None) -> tuple[float | None, dict[str, str]]:
    """`(level, {variable: value})`: the lowest cap that the set `ISA_LIMIT_VARIABLES` of `environ` (default the
    process's) name, and those variables; level None where none caps anything."""
    environ = os.environ if environ is None else environ
    named = {name: environ[name] for name in ISA_LIMIT_VARIABLES if environ.get(name)}
    levels = [level for level in map(_cap_level, named.values()) if level is not None]
    return (min(levels) if levels else None), named


@dataclasses.dataclass(frozen=True)
class CpuFacts:
    """What the CPU this process runs on can do.

    Args:
        vendor (`str | None`): /proc/cpuinfo's `vendor_id` (`"GenuineIntel"`, `"AuthenticAMD"`), None where unknown.
        model_name (`str | None`): the CPU's name (`"AMD EPYC"`, `"Intel(R) Xeon(R) Platinum 8480+"`).
        family (`int | None`), model (`int | None`): /proc/cpuinfo's `cpu family` and `model` (x86).
        flags (`frozenset[str]`): the instruction sets of `ISA_FLAGS` the CPU has, in /proc/cpuinfo's names.
        capability (`str`): the vector width ATen's kernels run (`"AVX512"`, `"AVX2"`, `"DEFAULT"`, ...).
        physical_cores (`int | None`): physical cores, None where unknown.
        hardware_flags (`frozenset[str] | None`): the instruction sets of `ISA_FLAGS` the CPU has, before the caps of
            `ISA_LIMIT_VARIABLES` (None: the same as `flags`).
        isa_limit (`str`): the caps that removed flags (`"ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2"`), empty
            where none did.
    """

    vendor: str | None
    model_name: str | None
    family: int | None
    model: int | None
    flags: frozenset[str]
    capability: str
    physical_cores: int | None
    hardware_flags: frozenset[str] | None = None
    isa_limit: str = ""

    @property
    def is_intel(self) -> bool:
        return self.vendor == "GenuineIntel"

    @property
    def vnni(self) -> bool:
        """AVX512-VNNI or AMX int8: int8 kernels sum products in 32 bits (8-bit int8 is exact)."""
        return "avx512_vnni" in self.flags or "amx_int8" in self.flags

    @property
    def amx(self) -> bool:
        """AMX tiles with int8 products (Sapphire Rapids and later)."""
        return "amx_tile" in self.flags and "amx_int8" in self.flags

    @property
    def bf16(self) -> bool:
        """Native bf16 arithmetic (AVX512-BF16 or AMX-BF16); elsewhere torch emulates it."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    def describe(self) -> str:
        """One line naming the CPU and what matters about it, for reports: `"AMD EPYC (AuthenticAMD family 25 model
        17): avx2 avx512f avx512_vnni avx512_bf16; torch AVX512; 2 physical cores"`."""
        where = " ".join(
            part
            for part in (
                self.vendor,
                f"family {self.family}" if self.family is not None else None,
                f"model {self.model}" if self.model is not None else None,
            )
            if part
        )
        shown = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
        flags = " ".join(flag for flag in shown if flag in self.flags) or "no AVX2"
        cores = f"; {self.physical_cores} physical cores" if self.physical_cores else ""
        limit = ""
        if self.isa_limit:
            removed = " ".join(
                flag for flag in shown if flag in (self.hardware_flags or ()) and flag not in self.flags
            )
            limit = f"; limited by {self.isa_limit} (an emulation: the CPU has {removed or 'no more'})"
        return (
            f"{self.model_name or 'unknown CPU'} ({where or 'vendor unknown'}): {flags}; torch {self.capability}"
            f"{cores}{limit}"
        )


# torch's vector width name (`torch.backends.cpu.get_cpu_capability()`) -> inductor's `cpp.simdlen` for it
_VECTOR_BITS = {"AVX2": 256, "AVX512": 512}


def inductor_vector_bits() -> int | None:
    """The vector width (`cpp.simdlen`) that compiles pin where `ATEN_CPU_CAPABILITY` caps ATen's and inductor's
    vectors (the width inductor picks there anyway), so that inductor's FX graph cache keys their graphs apart from
    those of an uncapped process (module docstring); None where the variable is not set or names no such width."""
    if not os.environ.get("ATEN_CPU_CAPABILITY"):
        return None
    return _VECTOR_BITS.get(cpu_facts().capability.upper())


def read_proc_cpuinfo(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (`{"vendor_id": ..., "flags": ...}`), plus `"physical_cores"`
    counted over all processors (distinct `physical id`, `core id` pairs); empty where the file cannot be read."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return {}
    blocks = [block for block in text.split("\n\n") if block.strip()]
    processors = [
        dict((key.strip(), value.strip()) for key, _, value in (line.partition(":") for line in block.splitlines()))
        for block in blocks
    ]
    if not processors:
        return {}
    fields = dict(processors[0])
    cores = {(p.get("physical id"), p.get("core id")) for p in processors if "core id" in p}
    if cores:
        fields["physical_cores"] = str(len(cores))
    return fields


def _read() -> CpuFacts:
    """The facts of this CPU, from torch's public probes and /proc/cpuinfo (see the module docstring)."""
    capabilities = dict(torch.cpu.get_capabilities())
    info = read_proc_cpuinfo()
    hardware_flags = frozenset(name for torch_name, name in ISA_FLAGS.items() if capabilities.get(torch_name))
    level, named = isa_limit()
    flags = hardware_flags
    if level is not None:
        flags = frozenset(flag for flag in hardware_flags if _flag_level(flag) <= level)

    def integer(value) -> int | None:
        try:
            return int(value)
        except (TypeError, ValueError):
            return None

    return CpuFacts(
        vendor=info.get("vendor_id"),
        model_name=info.get("model name") or capabilities.get("cpu_name") or None,
        family=integer(info.get("cpu family")),
        model=integer(info.get("model")),
        flags=flags,
        capability=torch.backends.cpu.get_cpu_capability(),
        physical_cores=integer(capabilities.get("num_physical_cores")) or integer(info.get("physical_cores")),
        hardware_flags=hardware_flags,
        isa_limit=" ".join(f"{name}={value}" for name, value in named.items()) if flags != hardware_flags else "",
    )


@functools.cache
def detected() -> CpuFacts:
    """The facts of this CPU as read (never forced), once per process."""
    return _read()


_FORCED: list[CpuFacts] = []
_LOCK = threading.Lock()
# forced()'s shortcuts: the flags that `True` adds and those that `False` removes
_SHORTCUTS = {
    "vnni": ({"avx512_vnni"}, {"avx512_vnni", "amx_int8"}),
    "bf16": ({"avx512_bf16"}, {"avx512_bf16", "amx_bf16"}),
    "amx": ({"amx_tile", "amx_int8"}, {"amx_tile", "amx_int8"}),
}


def cpu_facts() -> CpuFacts:
    """The facts every CPU-dependent decision asks: those of this CPU, or those a test forced (`forced`)."""
    return _FORCED[-1] if _FORCED else detected()


@contextlib.contextmanager
def forced(**changes) -> Iterator[CpuFacts]:
    """Within the context, `cpu_facts()` answers this CPU's facts with `changes` applied, for every thread.

    `changes` are `CpuFacts` fields, or the shortcuts `vnni`, `bf16` and `amx` (`True`/`False`), which add or remove
    the flags that decide them: `forced(vnni=False)` answers as an AVX2-only CPU would for int8.

    Raises:
        ValueError: an unknown field.
    """
    fields = {field.name for field in dataclasses.fields(CpuFacts)}
    unknown = set(changes) - fields - set(_SHORTCUTS)
    if unknown:
        raise ValueError(
            f"forced({', '.join(sorted(unknown))}=...): not a CPU fact; use one of {sorted(fields | set(_SHORTCUTS))}"
        )
    facts = cpu_facts()
    flags = set(changes.pop("flags", facts.flags))
    for name, (added, removed) in _SHORTCUTS.items():
        if name in changes:
            flags = flags | added if changes.pop(name) else flags - removed
    facts = dataclasses.replace(facts, flags=frozenset(flags), **changes)
    with _LOCK:
        _FORCED.append(facts)
    try:
        yield facts
    finally:
        with _LOCK:
            del _FORCED[next(i for i in range(len(_FORCED) - 1, -1, -1) if _FORCED[i] is facts)]
