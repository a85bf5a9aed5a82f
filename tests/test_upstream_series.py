"""upstream/series, the feature as a patch series for transformers 5.25.0, must keep applying and keep working.

The tests download the 5.25.0 source distribution with pip (skipped, with the reason, when the registry cannot be
reached) and apply each patch's code in order as `upstream/check.sh` does: `git apply --check`, then `git apply`, both
without the patch's tests/, docs/ and utils/ hunks (the sdist has none of those folders; `upstream/check.sh --tree DIR`
applies them to a reference tree). The default suite then runs
`upstream/check_request.py` (the original request for six models, eager and sdpa) on the patched source through
PYTHONPATH, with this package off the path and refused at import: about 45 s here, the download included. Under
`-m slow`, `upstream/check.sh` runs everything in a temporary venv: the series' own tests and the compiled decode step
too (about 5 minutes here), and `upstream/check_family.py` runs on the patched source: every encoder-decoder model type
of 5.25.0's auto mappings, eager and sdpa, a second shorter `generate(cache_implementation="static")` and one user-built
cache serving batch 1-4 and shorter encoder inputs, against DynamicCache (about 3 minutes here): with the v2 series all
69 (model, attention) pairs pass both checks (T5Gemma and T5Gemma2 since PR 5 keeps the capacity of the cross cache
their `_prepare_cache_for_generation` replaces).

The series' own tests are in its patches (each PR's tests/ hunks, run fail-before/pass-after by
`upstream/check_tree.py` on a reference tree); the out-of-tree `upstream/tests/test_static_cache_series.py` of v1 was
removed with v2.
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

CODE_ONLY = ["--exclude=tests/*", "--exclude=docs/*", "--exclude=utils/*"]

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the `git` program")


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


@pytest.fixture(scope="module")
def patched_tree(sdist, tmp_path_factory) -> Path:
    """The sdist with the code of every patch of upstream/series applied, each after a dry run."""
    folder = tmp_path_factory.mktemp("patched")
    with tarfile.open(sdist) as archive:
        archive.extractall(folder, filter="data")
    tree = folder / f"transformers-{VERSION}"
    subprocess.run(["git", "init", "-q"], cwd=tree, check=True)  # git apply then reads paths from the tree's root
    for name in (UPSTREAM / "series").read_text().split():
        for dry_run in (["--check"], []):
            result = subprocess.run(
                ["git", "apply", *dry_run, *CODE_ONLY, str(UPSTREAM / name)], cwd=tree, capture_output=True, text=True
            )
            assert result.returncode == 0, f"{name} does not apply on top of the patches before it: {result.stderr}"
    return tree


def test_series_lists_every_patch_in_merge_order():
    listed = (UPSTREAM / "series").read_text().split()
    assert sorted(listed) == sorted(p.name for p in UPSTREAM.glob("*.patch")), "upstream/series and the patches differ"
    assert listed == sorted(listed), "upstream/series must list the patches in the order they merge"


def test_series_applies_in_order_to_the_sdist(patched_tree):
    assert "def get_kv(" in (patched_tree / "src" / "transformers" / "cache_utils.py").read_text()


def test_patched_transformers_serves_the_original_request_without_this_package(patched_tree, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(patched_tree / "src"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(UPSTREAM / "check_request.py"), "--no-compile"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, (
        f"upstream/check_request.py failed:\n{result.stdout[-4000:]}\n{result.stderr[-2000:]}"
    )
    assert str(patched_tree) in result.stdout.splitlines()[0], "the check did not run on the patched source"


@pytest.mark.slow
def test_patched_transformers_serves_the_encoder_decoder_family_without_this_package(patched_tree, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(patched_tree / "src"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(UPSTREAM / "check_family.py"), "--json", str(tmp_path / "family.json")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    lines = result.stdout.splitlines()
    ran_there = lines and str(patched_tree) in lines[0]
    assert ran_there, f"the check did not run on the patched source: {result.stderr[-2000:]}"
    failures = [line for line in lines if " FAIL" in line or "NOT CHECKED" in line]
    assert result.returncode == 0, "upstream/check_family.py failed:\n" + "\n".join(failures)[-6000:]


@pytest.mark.slow
def test_check_script_passes_in_a_fresh_venv(sdist):
    env = {**os.environ, "PYTHON": sys.executable, "TRANSFORMERS_SDIST": str(sdist), "PYTHONPATH": ""}
    result = subprocess.run(
        ["bash", str(UPSTREAM / "check.sh")], env=env, capture_output=True, text=True, timeout=1800
    )
    assert result.returncode == 0, f"upstream/check.sh failed:\n{result.stdout[-4000:]}\n{result.stderr[-2000:]}"
    assert "all checks passed" in result.stdout
