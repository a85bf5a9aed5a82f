"""`bench --isa avx2` (and `bench-profile --isa avx2`): the run in a child process whose kernels are capped at AVX2.

Design decisions:
- The libraries read their caps once, when they load (ATen's dispatch, oneDNN's, MKL's, FBGEMM's and CTranslate2's
  CPU detection, inductor's vector ISA when it first compiles), so a cap needs a process that starts with it: the
  command runs itself again with the variables of `ISA_ENVIRONMENTS` set, and returns the child's exit status. A
  process that already has them runs in place (the child itself, or a shell that set them).
- It is an emulation of an AVX2 CPU: the same cores, caches, memory bandwidth and clock as the machine's, only the
  instructions capped. `cpu_facts()` reads the caps (`compile/cpu.py`), so the report's CPU line, the int8 bits, the
  kernels `"auto"` chooses and the compile cache's key are those of the capped process.
"""

from __future__ import annotations

import os
import subprocess
import sys

ISA_CHOICES = ("native", "avx2")

# The variables that cap each library at AVX2 (values in each library's own spelling).
ISA_ENVIRONMENTS = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",  # ATen's kernels and inductor's generated code
        "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN (torch's and CTranslate2's)
        "DNNL_MAX_CPU_ISA": "AVX2",  # oneDNN's older name
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
        "CT2_FORCE_CPU_ISA": "AVX2",
    }
}


def isa_environment(isa: str) -> dict[str, str]:
    """The variables that `--isa isa` sets (empty for `native`).

    Raises:
        ValueError: `isa` is not one of `ISA_CHOICES`.
    """
    if isa not in ISA_CHOICES:
        raise ValueError(f"--isa {isa!r} is not one of {ISA_CHOICES}")
    return dict(ISA_ENVIRONMENTS.get(isa, {}))


def applied(isa: str, environ=None) -> bool:
    """Whether this process already runs under `isa`'s caps (every variable set to its value)."""
    environ = os.environ if environ is None else environ
    return all(environ.get(name) == value for name, value in isa_environment(isa).items())


def child_command(argv: list[str], isa: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of the child that runs `argv` (this command's arguments) under `isa`."""
    return [sys.executable, "-m", "transformers_flexcache", *argv], {**os.environ, **isa_environment(isa)}


def run_in_child(argv: list[str], isa: str) -> int:
    """Runs `argv` in a child under `isa`'s caps, its output on this process's; returns its exit status."""
    command, environ = child_command(argv, isa)
    shown = " ".join(f"{name}={value}" for name, value in isa_environment(isa).items())
    print(f"--isa {isa}: running in a child process with {shown} (an emulation: this CPU's caches and memory)")
    sys.stdout.flush()
    return subprocess.run(command, env=environ, check=False).returncode
