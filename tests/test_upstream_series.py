"""upstream/series, the feature as a patch series for transformers 5.25.0, must keep applying and keep working.

Both tests download the 5.25.0 source distribution with pip (skipped, with the reason, when the registry cannot be
reached). The first applies the patches with `patch -p1 --dry-run`, one after the other (about 15 s). The second,
under `-m slow`, runs `upstream/check.sh`: the series applied for real, the patched transformers installed in a
temporary venv beside the current torch, the series' own tests, and `upstream/check_request.py` (the original request
for six models, eager, sdpa and a compiled decode step), with this package refused at import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

UPSTREAM = Path(__file__).resolve().parents[1] / "upstream"
VERSION = "5.25.0"


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    """transformers' 5.25.0 source distribution, from the package registry."""
    folder = tmp_path_factory.mktemp("sdist")
    download = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
         f"transformers=={VERSION}", "-d", str(folder)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if download.returncode != 0:
        pytest.skip(f"pip could not download transformers=={VERSION}'s sdist: {download.stderr.strip()[-300:]}")
    return folder / f"transformers-{VERSION}.tar.gz"


def test_series_lists_every_patch_in_upstream():
    listed = (UPSTREAM / "series").read_text().split()
    assert sorted(listed) == sorted(p.name for p in UPSTREAM.glob("*.patch")), "upstream/series and the patches differ"
    assert listed == sorted(listed), "upstream/series must list the patches in the order they merge"


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the `patch` program")
def test_series_applies_in_order_to_the_sdist(sdist, tmp_path):
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path, filter="data")
    tree = tmp_path / f"transformers-{VERSION}"
    for name in (UPSTREAM / "series").read_text().split():
        patch = (UPSTREAM / name).read_bytes()
        for dry_run in (["--dry-run"], []):
            result = subprocess.run(["patch", "-p1", "-s", *dry_run], cwd=tree, input=patch, capture_output=True)
            assert result.returncode == 0, f"{name} does not apply on top of the patches before it: {result.stdout!r}"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the `patch` program")
def test_patched_transformers_serves_the_original_request_without_this_package(sdist):
    env = {**os.environ, "PYTHON": sys.executable, "TRANSFORMERS_SDIST": str(sdist), "PYTHONPATH": ""}
    result = subprocess.run(
        ["bash", str(UPSTREAM / "check.sh")], env=env, capture_output=True, text=True, timeout=1800
    )
    assert result.returncode == 0, f"upstream/check.sh failed:\n{result.stdout[-4000:]}\n{result.stderr[-2000:]}"
    assert "all checks passed" in result.stdout
