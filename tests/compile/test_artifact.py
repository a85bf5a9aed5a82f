"""The compiled artifact's key and manifest checks (`compile/artifact.py`) without compiling a graph: what differs
is named, and a folder without a readable manifest, with a missing or changed file, is refused with the reason.
The engine's artifacts, compiled and loaded: tests/serving/test_artifact.py (slow)."""

from __future__ import annotations

import json

import pytest
import torch

from transformers_flexcache.compile import ArtifactRefused, artifact, compile_config_for_cpu, load_artifact
from transformers_flexcache.compile.artifact import differences, program_signature, weights_digest


def key(**changes) -> dict:
    base = {
        "torch": "2.13.0",
        "transformers": "5.24.0",
        "threads": 1,
        "cpu": {
            "vendor": "AuthenticAMD",
            "family": 25,
            "model": 17,
            "flags": ["avx2", "avx512f"],
            "capability": "AVX512",
        },
        "model": {"class": "T5", "dtype": "torch.float32", "quantization": None},
        "weights": "aa",
        "shapes": [[1, 16, 16]],
    }
    return {**base, **changes}


@pytest.mark.parametrize(
    ("found", "message"),
    [
        (key(torch="2.12.0"), "torch 2.12.0 in the artifact, 2.13.0 here"),
        (key(weights="bb"), "weights differ"),
        (key(shapes=[[2, 16, 16]]), "shapes differ"),
        (key(model={"class": "T5", "dtype": "torch.float32", "quantization": "int8"}), "model quantization differ"),
        (
            key(
                cpu={
                    "vendor": "GenuineIntel",
                    "family": 6,
                    "model": 143,
                    "flags": ["amx_tile", "avx2", "avx512f"],
                    "capability": "AVX512",
                }
            ),
            "CPU: amx_tile missing here; vendor GenuineIntel in the artifact, AuthenticAMD here; family 6 in the artifact",
        ),
    ],
    ids=["torch", "weights", "shapes", "quantization", "cpu"],
)
def test_each_difference_of_the_key_is_named(found, message):
    assert message in "; ".join(differences(found, key()))
    assert differences(key(), key()) == []


def test_the_weights_digest_sees_a_change_of_one_value():
    model = torch.nn.Linear(4, 3)
    before = weights_digest(model)
    assert weights_digest(model) == before
    with torch.no_grad():
        model.weight[1, 2] += 1e-3
    assert weights_digest(model) != before


def write(folder, manifest) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "graphs").mkdir(exist_ok=True)
    (folder / "manifest.json").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))


def test_a_folder_without_a_readable_manifest_is_refused(tmp_path):
    with pytest.raises(ArtifactRefused, match="holds no manifest.json"):
        load_artifact(tmp_path / "absent", key())
    write(tmp_path / "garbled", "{not json")
    with pytest.raises(ArtifactRefused, match="manifest.json is unreadable"):
        load_artifact(tmp_path / "garbled", key())


def test_a_missing_or_changed_graph_file_is_refused_before_anything_loads(tmp_path):
    graph = "graphs/1_16_16.pt2"
    write(tmp_path, {"key": key(), "files": {graph: {"shape": [1, 16, 16], "bytes": 4, "sha256": "0" * 64}}})
    with pytest.raises(ArtifactRefused, match=f"{graph} is missing"):
        load_artifact(tmp_path, key())
    (tmp_path / graph).write_bytes(b"abcd")
    with pytest.raises(ArtifactRefused, match=f"{graph} changed since it was written"):
        load_artifact(tmp_path, key())
    with pytest.raises(ArtifactRefused, match="compiled for another setting: torch 2.13.0 in the artifact, 9 here"):
        load_artifact(tmp_path, key(torch="9"))


def test_a_lazy_load_checks_the_key_now_and_each_file_at_its_first_use(tmp_path, caplog):
    """`load_artifact(lazy=True)` (a server's): the key, the manifest and the files' sizes are checked at once; a
    graph's bytes (SHA-256) and torch's loader at its first use or `load_next()`, where a damaged file is a warning
    and no graph (its shape compiles), never a graph of other bytes; the other graphs are not affected."""
    import hashlib
    import logging

    damaged, unloadable = "graphs/1_16_16.pt2", "graphs/2_16_16.pt2"
    (tmp_path / "graphs").mkdir()
    (tmp_path / damaged).write_bytes(b"abcd")
    (tmp_path / unloadable).write_bytes(b"not a package")
    files = {
        damaged: {"shape": [1, 16, 16], "bytes": 4, "sha256": "0" * 64},  # the bytes changed since
        unloadable: {"shape": [2, 16, 16], "bytes": 13, "sha256": hashlib.sha256(b"not a package").hexdigest()},
    }
    write(tmp_path, {"key": key(), "files": files})
    with pytest.raises(ArtifactRefused, match=f"{damaged} changed since it was written"):
        load_artifact(tmp_path, key())  # eager: refused as a whole
    with pytest.raises(ArtifactRefused, match="compiled for another setting"):
        load_artifact(tmp_path, key(torch="9"), lazy=True)  # the key is never deferred
    loaded = load_artifact(tmp_path, key(), lazy=True)
    first, second = loaded.graphs[(1, 16, 16)], loaded.graphs[(2, 16, 16)]
    assert loaded.pending == 2 and not first.loaded and first.error is None
    with caplog.at_level(logging.WARNING):
        assert first.runner() is None and first.runner() is None  # checked once
    assert f"{damaged} changed since it was written" in first.error and not first.pending
    assert caplog.text.count("compiled artifact graph not used, compiling its shape instead") == 1
    with pytest.raises(ArtifactRefused, match="changed since it was written"):
        first([])  # never run
    assert loaded.pending == 1 and loaded.load_next() and loaded.pending == 0 and not loaded.load_next()
    assert f"{unloadable} did not load" in second.error and second.runner() is None
    assert "0 of 2 graphs loaded" in loaded.describe()
    with pytest.raises(ArtifactRefused, match="is missing"):
        (tmp_path / damaged).unlink()
        load_artifact(tmp_path, key(), lazy=True)  # a missing file: at once, as its size


def test_shapes_whose_graphs_are_equal_share_one_package_and_its_file_is_checked_once(tmp_path):
    # A generate call's first decode step and its later steps have other descriptions and the same graph: the
    # manifest names the later one `same_as` the first, which alone has a file; both load as one package.
    graph = "graphs/a.pt2"
    (tmp_path / "graphs").mkdir()
    (tmp_path / graph).write_bytes(b"abcd")
    files = {
        graph: {"shape": ["a"], "bytes": 4, "sha256": "0" * 64, "extra": {"state": 1}},
        "graphs/b.pt2": {"shape": ["b"], "same_as": graph, "extra": {"state": 2}},
    }
    write(tmp_path, {"key": key(), "files": files})
    loaded = load_artifact(tmp_path, key(), lazy=True)
    assert loaded.graphs[("a",)] is loaded.graphs[("b",)] and len(loaded.packages) == 1 and loaded.pending == 1
    assert loaded.extras == {("a",): {"state": 1}, ("b",): {"state": 2}}  # each description keeps its own
    assert "0 of 1 graphs loaded" in loaded.describe()
    # an alias whose file the folder does not hold: refused
    write(tmp_path, {"key": key(), "files": {"graphs/b.pt2": files["graphs/b.pt2"]}})
    with pytest.raises(ArtifactRefused, match="is the same as graphs/a.pt2, which it does not hold"):
        load_artifact(tmp_path, key(), lazy=True)


def test_a_program_signature_is_equal_for_equal_graphs_only():
    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, x, scale: float):
            return self.linear(x) * scale

    step = Step()

    def signature(x, scale=2.0, options=None):
        program = torch.export.export(step, (x, scale), strict=False)
        return program_signature(program, options or {"freezing": True})

    first = signature(torch.randn(2, 4))
    assert signature(torch.randn(2, 4)) == first  # other values, the same graph
    assert signature(torch.randn(3, 4)) != first  # another shape
    assert signature(torch.randn(4, 2).T) != first  # other strides
    assert signature(torch.randn(2, 4), scale=3.0) != first  # a value the graph holds
    assert signature(torch.randn(2, 4), options={"freezing": False}) != first  # other settings
    other = Step()
    step_before, step = step, other
    assert signature(torch.randn(2, 4)) != first  # another module's weights
    step = step_before
    # graph passes by their class and uuid (as inductor's cache keys them), not by the objects' addresses
    one, two = compile_config_for_cpu(), compile_config_for_cpu()
    assert signature(torch.randn(2, 4), options=dict(one.options)) == signature(
        torch.randn(2, 4), options=dict(two.options)
    )
    mkl = compile_config_for_cpu(linear_kernels="mkl")
    assert signature(torch.randn(2, 4), options=dict(mkl.options)) != signature(
        torch.randn(2, 4), options=dict(one.options)
    )


def test_a_package_this_process_wrote_is_linked_only_while_its_bytes_are_those_it_was_written_with(tmp_path):
    source = tmp_path / "first" / "graph.pt2"
    source.parent.mkdir()
    source.write_bytes(b"package bytes")
    key = ("weights digest", "program signature")
    artifact._WRITTEN[key] = (source, artifact._sha256(source))
    try:
        assert artifact._link_written(key, tmp_path / "linked.pt2")
        assert (tmp_path / "linked.pt2").samefile(source)
        assert not artifact._link_written(("other weights", "program signature"), tmp_path / "other.pt2")
        assert not artifact._link_written((None, "program signature"), tmp_path / "none.pt2")  # no weights digest
        source.write_bytes(b"package bytez")  # changed since it was written: built instead
        assert not artifact._link_written(key, tmp_path / "changed.pt2")
        source.unlink()  # removed: built instead
        assert not artifact._link_written(key, tmp_path / "removed.pt2")
        assert not any((tmp_path / name).exists() for name in ("other.pt2", "none.pt2", "changed.pt2", "removed.pt2"))
    finally:
        artifact._WRITTEN.pop(key, None)


def test_a_program_signature_takes_int8_weights_without_a_storage():
    # torchao's int8 weights have no storage to take an address of (the first bench run of an int8 strategy failed
    # there): the objects stand for their values, one model's in both exports
    from transformers_flexcache import quantize

    model = quantize(torch.nn.Sequential(torch.nn.Linear(64, 64)).eval(), "int8")
    first, second = (
        program_signature(torch.export.export(model, (torch.randn(2, 64),), strict=False), {}) for _ in range(2)
    )
    assert first == second
    other = quantize(torch.nn.Sequential(torch.nn.Linear(64, 64)).eval(), "int8")
    assert program_signature(torch.export.export(other, (torch.randn(2, 64),), strict=False), {}) != first


def test_an_artifact_written_before_encoders_were_exported_is_refused_by_name():
    caller = {"graph": "serving engine decode step", "inputs": ["decoder_input_ids"]}
    old = key(caller=caller)
    new = key(caller={**caller, "encoder": ["packed_encoder"]})
    assert differences(old, new) == [
        "the artifact holds no encoder graphs (written before encoders were exported): compile it again"
    ]
    assert differences(key(caller={**caller, "encoder": []}), new) == [
        "encoder graphs [] in the artifact, ['packed_encoder'] here"
    ]
    assert differences(key(caller={**caller, "inputs": []}), old) == ["caller inputs differ"]


def test_loading_a_graph_registers_the_package_s_ops_first(tmp_path):
    """An int8 model's graphs call the package's own ops (`transformers_flexcache::int8_fbgemm_mm`); torch's loader
    refuses a package whose ops are not registered ("Could not find schema"), which a fresh process that loads an
    artifact (and compiles nothing) had not done. Run in a new interpreter, so that no other test registered them."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from pathlib import Path\n"
        "from transformers_flexcache.compile import PackageGraph\n"
        "assert not hasattr(torch.ops.transformers_flexcache, 'int8_fbgemm_mm')\n"
        f"graph = PackageGraph(Path({str(tmp_path)!r}), 'graphs/absent.pt2', {{}})\n"
        "assert graph.runner() is None and 'is missing' in graph.error\n"
        "assert hasattr(torch.ops.transformers_flexcache, 'int8_fbgemm_mm')\n"
        "assert hasattr(torch.ops.transformers_flexcache, 'int8_dot_products')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
