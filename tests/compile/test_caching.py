"""`compile.caching`: a compile cache entry written by one compile and loaded by the next, whose graphs run on the
weights of the model at hand; an entry that does not check out (changed, partial, unloadable) is discarded with a
warning and compiled anew, never loaded; the key changes with the CPU and the versions.

Each compile is a frozen two-linear model under `compile_config_for_cpu()` (packed oneDNN or MKL weights, the graphs
inductor's cache refused before `compile/fx_cache.py`); dynamo is reset between compiles, as a new process starts.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from tests.helpers import assert_within_float_noise, in_double
from transformers_flexcache import compile_config_for_cpu
from transformers_flexcache.compile import caching, cpu
from transformers_flexcache.compile.config import compile_settings

FACTS = {"test": "two linears"}


def two_linears(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).eval()


def compile_in(directory, seed: int = 0) -> caching.WarmStart:
    """One compile of `two_linears(seed)` at 3 rows in the compile cache `directory`, as a new process would (dynamo
    reset); its outputs checked against the eager model's. Returns what the cache said."""
    torch._dynamo.reset()
    model, inputs = two_linears(seed), torch.randn(3, 16)
    config = compile_config_for_cpu()
    with caching.compile_cache(directory, FACTS) as state, torch.no_grad(), compile_settings(config):
        compiled = torch.compile(model, backend="inductor", dynamic=False, options=config.options)
        assert_within_float_noise(compiled(inputs), model(inputs), in_double(model)(inputs.double()))
    torch._dynamo.reset()
    return state


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A compile cache folder that one compile wrote."""
    directory = tmp_path_factory.mktemp("written")
    state = compile_in(directory)
    assert state.found == "cold" and state.misses == 1 and state.hits == 0
    return directory


@pytest.fixture
def copied(written, tmp_path):
    """A copy of `written` that a test may damage, and its entry's folder."""
    directory = tmp_path / "cache"
    shutil.copytree(written, directory)
    (entry,) = [path for path in directory.iterdir() if path.is_dir()]
    return directory, entry


def test_a_second_compile_loads_the_graph_and_runs_it_on_the_weights_of_the_model_at_hand(copied):
    directory, entry = copied
    assert {path.name for path in entry.iterdir()} >= {"artifacts.bin", "manifest.json", "key.json", "inductor"}
    state = compile_in(directory, seed=1)  # other weights, same sizes: checked against its own eager outputs
    assert state.found == "warm" and state.loaded >= 1
    assert (state.traced, state.hits, state.misses, state.bypasses) == (1, 1, 0, 0)


def test_files_that_the_manifest_does_not_list_are_removed_before_anything_is_loaded(copied):
    directory, entry = copied
    stray = entry / "inductor" / "half-built.so"  # what a process killed while building a kernel leaves
    stray.write_bytes(b"\x7fELF truncated")
    state = compile_in(directory)
    assert state.found == "warm" and state.hits == 1 and not stray.exists()


def _change_a_listed_file(entry):
    manifest = json.loads((entry / "manifest.json").read_text())
    name = next(name for name in manifest["files"] if name.startswith("inductor/"))
    data = bytearray((entry / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (entry / name).write_bytes(bytes(data))


def _unloadable_artifacts(entry):
    # a well-formed file of ours, listed with its checksum, whose contents torch's loader refuses
    payload = b"not torch's artifacts"
    path = entry / "artifacts.bin"
    path.write_bytes(caching.MAGIC + caching.hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["files"]["artifacts.bin"] = {"bytes": path.stat().st_size, "sha256": caching._sha256(path)}
    (entry / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda entry: (entry / "manifest.json").unlink(), "no manifest"),
        (lambda entry: (entry / "manifest.json").write_text("{"), "unreadable manifest"),
        (_change_a_listed_file, "changed since it was written"),
        (lambda entry: (entry / "artifacts.bin").write_bytes(b"\0" * 8), "artifacts.bin changed"),
        (_unloadable_artifacts, "artifacts did not load"),
    ],
    ids=["partial", "unreadable-manifest", "changed-kernel-or-graph", "truncated-artifacts", "unloadable-artifacts"],
)
def test_an_entry_that_does_not_check_out_is_discarded_with_a_warning_and_compiled_anew(
    copied, caplog, damage, reason
):
    directory, entry = copied
    damage(entry)
    with caplog.at_level(logging.WARNING, logger="transformers_flexcache.compile.caching"):
        state = compile_in(directory)  # outputs checked: never the damaged graph
    assert state.found == "discarded" and reason in state.reason
    assert state.hits == 0 and state.misses == 1
    assert any("discarded, compiling from nothing" in record.getMessage() for record in caplog.records)
    again = compile_in(directory)  # written anew, whole
    assert again.found == "warm" and again.hits == 1 and again.misses == 0


def test_the_key_changes_with_the_cpu_s_instruction_sets_and_the_versions(monkeypatch):
    key = caching.cache_key(caching.environment_facts())
    with cpu.forced(vnni=not cpu.cpu_facts().vnni):  # kernels built for one CPU must not load on another
        assert caching.cache_key(caching.environment_facts()) != key
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert caching.cache_key(caching.environment_facts()) != key


def test_the_default_folder_is_under_the_user_s_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert caching.default_cache_dir() == tmp_path / "transformers-flexcache" / "compile"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert caching.default_cache_dir() == tmp_path / "home" / ".cache" / "transformers-flexcache" / "compile"
