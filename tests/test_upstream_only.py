"""upstream/upstream_only.py: the upstream checks refuse this package's code, and each finds the shared guard when run
as a script (from any folder, with this package installed: what `upstream/check.sh` does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = REPO_ROOT / "upstream"
TIMEOUT = 300  # seconds: importing torch and transformers on a busy machine, with room to spare


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )  # fmt: skip


def test_after_refuse_flexcache_this_packages_code_cannot_be_imported(tmp_path):
    code = (
        f"import sys; sys.path.insert(0, {str(UPSTREAM)!r}); import upstream_only; upstream_only.refuse_flexcache()\n"
        "for name in ('transformers_flexcache', 'model_overrides'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ImportError as error:\n"
        "        print(error)\n"
        "    else:\n"
        "        print(name, 'imported')\n"
    )
    result = run(["-c", code], tmp_path)  # PYTHONPATH puts this repository first: importable without the guard
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"{name} imported during the upstream check; run it without transformers-flexcache"
        for name in ("transformers_flexcache", "model_overrides")
    ]


@pytest.mark.parametrize("script", ["check_request.py", "check_family.py"])
def test_each_upstream_check_runs_as_a_script_with_the_shared_guard(script, tmp_path):
    result = run([str(UPSTREAM / script), "--help"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage:")
