"""Compiled artifacts on the engine: `Engine.save_artifact(DIR)` once, then `Engine.warmup(artifact=DIR)` loads the
graphs without tracing (dynamo's counters do not move, through warm-up and serving), the token encoder runs the
artifact's graph (dynamic rows and positions: a single row, several, a length-1 input padded into a batch; one of
length 1 alone runs eagerly, as with a compiled encoder), and the requests get upstream generate's tokens; a damaged
folder is a warning and a compile (still the right tokens), and an artifact of another key (weights, torch, CPU,
shapes) is refused with a message that names which. An int8 model's artifact holds its cross-attention projections
too, and its server answers the cold-compiled int8 server's tokens.

One artifact (the padded policy: one decode graph, and the packed encoder's) is compiled for the module, with
AOTInductor, the damaged folder's test compiles once more, and an int8 model's artifact (with its projections) is
compiled and compared with its cold compile: minutes on a busy 2-core machine, so the module is `slow` (the key's
comparison and the manifest's checks without a compile: tests/compile/test_artifact.py).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import shutil
from collections import Counter

import pytest
import torch

from tests.helpers import own_copy
from tests.model_cases import MODEL_CASES
from tests.serving.test_engine import TIMEOUT, assert_same_output, capacities, reference, request_stream
from transformers_flexcache.compile import compile_config_for_cpu, compiled_graph_count, quantize
from transformers_flexcache.serving import Engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """`(upstream, override, cache_config, folder)`: the tiny T5's artifact, written by an engine of the padded
    policy."""
    torch._dynamo.reset()
    case = next(case for case in MODEL_CASES if case.name == "t5")
    upstream, flex = case.build("sdpa")
    config = {**capacities(flex), "shape_policy": "padded"}
    folder = tmp_path_factory.mktemp("artifact") / "t5"
    with Engine(flex, cache_config=config, compile_config=compile_config_for_cpu()) as engine:
        manifest = engine.save_artifact(folder)
    assert sorted(manifest["files"]) == ["graphs/4_40_16.pt2", "graphs/packed_encoder.pt2"]
    assert manifest["key"]["caller"]["encoder"] == ["packed_encoder"]
    return upstream, flex, config, folder


def serve_stream(engine, stream, *, together: bool = False) -> list:
    """The outputs of `stream`'s requests; `together`: all queued before the scheduler plans, so that those that fit
    the seats are admitted at once (their encoders run as one batch)."""
    with engine._lock if together else contextlib.nullcontext():  # the scheduler plans under this lock
        handles = [engine.submit(**own_copy(inputs), seed=seed, **kwargs) for inputs, kwargs, seed in stream]
    return [handle.result(timeout=TIMEOUT) for handle in handles]


def encoder_lengths_stream(case, lengths: list[int], *, first_seed: int) -> list:
    """One-row, one-seat requests (greedy, sampling) of encoder inputs of `lengths` tokens."""
    generator = torch.Generator().manual_seed(first_seed)
    methods = [{}, {"do_sample": True, "top_k": 20}, {"min_new_tokens": 3}]
    return [
        (case.make_inputs(1, length, generator), {"max_new_tokens": 5, **methods[i % 3]}, first_seed + i)
        for i, length in enumerate(lengths)
    ]


def request_groups(case) -> list[tuple[list, bool]]:
    """`(requests, together)` served one group after the other: a length-1 input alone, a single row of 7, the 4
    seats' requests of 1, 5, 12 and 3 tokens admitted together, then `request_stream`'s (beams, sampling)."""
    alone = [encoder_lengths_stream(case, [length], first_seed=50 + length) for length in (1, 7)]
    batch = encoder_lengths_stream(case, [1, 5, 12, 3], first_seed=70)
    return [(requests, False) for requests in alone] + [(batch, True), (request_stream(case, num_requests=5), False)]


def serve_groups(engine, upstream, groups) -> None:
    """Serve `groups` (`request_groups`) and check every output against upstream generate's."""
    expected = [[reference(upstream, inputs, kwargs, seed) for inputs, kwargs, seed in reqs] for reqs, _ in groups]
    outputs = [serve_stream(engine, requests, together=together) for requests, together in groups]
    for want_group, got_group in zip(expected, outputs, strict=True):
        for want, got in zip(want_group, got_group, strict=True):
            assert_same_output(want, got)


def test_an_engine_loads_the_artifact_traces_nothing_and_serves_generate_s_tokens(compiled):
    upstream, flex, config, folder = compiled
    case = next(case for case in MODEL_CASES if case.name == "t5")
    traced = compiled_graph_count()
    with Engine(flex, cache_config=config, compile_config=compile_config_for_cpu()) as engine:
        assert engine.warmup(artifact=folder) == 1
        assert engine.artifact is not None and engine.artifact_refused is None
        serve_groups(engine, upstream, request_groups(case))
        calls = engine.encoder_graph_calls["packed_encoder"]
    assert compiled_graph_count() == traced  # neither the warm-up nor any request traced a graph
    # the encoder ran in the artifact's graph: a single row of 7, the 4 rows padded to 12 (the length-1 input among
    # them); the length-1 input alone ran eagerly (as a compiled encoder runs it)
    assert calls[(1, 7)] >= 1 and calls[(4, 12)] == 1, calls
    assert (1, 1) not in calls


def test_an_int8_engine_s_artifact_runs_its_encoder_and_projections_from_the_package(tmp_path):
    pytest.importorskip("torchao")
    case = next(case for case in MODEL_CASES if case.name == "t5")
    _, flex = case.build("sdpa")
    flex = quantize(flex, "int8")
    config = {**capacities(flex), "shape_policy": "padded"}
    groups = request_groups(case)
    torch._dynamo.reset()
    with Engine(flex, cache_config=config, compile_config=compile_config_for_cpu()) as engine:
        names = engine.steps.encoder_graph_names()
        manifest = engine.save_artifact(tmp_path / "int8")
        engine.warmup()  # the cold-compiled server: torch.compile of the decode step, the encoder, the projections
        cold = [serve_stream(engine, requests, together=together) for requests, together in groups]
    assert names[0] == "packed_encoder" and "projections" in names  # and each's `_library` twin where it has one
    assert sorted(manifest["files"]) == sorted(["graphs/4_40_16.pt2", *(f"graphs/{name}.pt2" for name in names)])
    traced = compiled_graph_count()
    with Engine(flex, cache_config=config, compile_config=compile_config_for_cpu()) as engine:
        assert engine.warmup(artifact=tmp_path / "int8") == 1 and engine.artifact_refused is None
        loaded = [serve_stream(engine, requests, together=together) for requests, together in groups]
        calls = engine.encoder_graph_calls
    assert compiled_graph_count() == traced
    # int8 tokens against the compiled int8 server's (the compiled int8 routes against eager int8, within int8's own
    # noise: tests/compile/test_quantization.py)
    for cold_group, loaded_group in zip(cold, loaded, strict=True):
        for want, got in zip(cold_group, loaded_group, strict=True):
            assert_same_output(want, got)
    projected = sum((calls.get("projections", Counter()) + calls.get("projections_library", Counter())).values())
    # each group's requests joined (their cross-attention keys projected in the package), but the length-1 input
    # alone (eager, as compiled projections leave one position)
    assert projected >= len(groups) - 1, calls
    encoded = calls.get("packed_encoder", Counter()) + calls.get("packed_encoder_library", Counter())
    assert encoded[(1, 7)] >= 1 and encoded[(4, 12)] == 1, calls


def damaged_copy(folder, copy_, name: str):
    """A copy of the artifact `folder` at `copy_` whose file `name` has one byte flipped in its middle."""
    shutil.copytree(folder, copy_)
    graph = copy_ / name
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    return copy_


def test_a_damaged_artifact_is_a_warning_and_a_compile_with_the_right_tokens(compiled, tmp_path, caplog):
    upstream, flex, config, folder = compiled
    damaged = damaged_copy(folder, tmp_path / "damaged", "graphs/4_40_16.pt2")
    case = next(case for case in MODEL_CASES if case.name == "t5")
    torch._dynamo.reset()
    traced = compiled_graph_count()
    with (
        caplog.at_level(logging.WARNING),
        Engine(flex, cache_config=config, compile_config=compile_config_for_cpu()) as engine,
    ):
        assert engine.warmup(artifact=damaged) == 1
        # the key held, so the engine took the artifact: its encoder graph (checked at the warm-up) serves; the
        # decode graph was checked when it loaded (idle or at its first use), found damaged and not used: its shape
        # compiled, and the requests get upstream's tokens
        serve_groups(engine, upstream, request_groups(case))
        assert engine.encoder_graph_calls["packed_encoder"]
    assert engine.artifact is not None and engine.artifact_refused is None
    assert "graphs/4_40_16.pt2 changed since it was written" in engine.artifact.graphs[(4, 40, 16)].error
    assert "compiled artifact graph not used, compiling its shape instead" in caplog.text
    assert compiled_graph_count() > traced  # compiled in this process instead


def test_a_damaged_encoder_graph_refuses_the_artifact_at_the_warm_up(compiled, tmp_path):
    """The encoder side is checked and loaded before the engine serves (every request needs it), so its damage
    refuses the folder as a whole, by name, where a decode graph's is found at its load (the test above)."""
    _, flex, config, folder = compiled
    damaged = damaged_copy(folder, tmp_path / "damaged-encoder", "graphs/packed_encoder.pt2")
    assert "graphs/packed_encoder.pt2 changed since it was written" in refusal(flex, config, damaged)


def refusal(flex, config, folder) -> str | None:
    """Why an engine refuses the artifact `folder` (None: it loads)."""
    with Engine(flex, cache_config=config, compile_config=compile_config_for_cpu()) as engine:
        loaded = engine._load_artifact(folder)
        assert loaded == (engine.artifact_refused is None)
        return engine.artifact_refused


def edited(folder, tmp_path, edit) -> object:
    """A copy of the artifact `folder` whose manifest's key `edit(key)` changed."""
    copy_ = tmp_path / "edited"
    shutil.copytree(folder, copy_)
    manifest = json.loads((copy_ / "manifest.json").read_text())
    edit(manifest["key"])
    (copy_ / "manifest.json").write_text(json.dumps(manifest))
    return copy_


def test_the_artifact_loads_for_its_own_key(compiled):
    _, flex, config, folder = compiled
    assert refusal(flex, config, folder) is None


def test_other_weights_are_refused_by_name(compiled):
    _, flex, config, folder = compiled
    other = copy.deepcopy(flex)
    with torch.no_grad():
        next(other.parameters())[0, 0] += 1.0
    assert "weights differ" in refusal(other, config, folder)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda key: key.update(torch="2.0.0"), f"torch 2.0.0 in the artifact, {torch.__version__} here"),
        (lambda key: key["cpu"]["flags"].append("avx512_4fmaps"), "CPU: avx512_4fmaps missing here"),  # Xeon Phi only
        (lambda key: key.update(transformers="4.0.0"), "transformers 4.0.0 in the artifact"),
        (lambda key: key.update(threads=64), "threads 64 in the artifact"),
    ],
    ids=["torch", "cpu", "transformers", "threads"],
)
def test_an_artifact_of_another_environment_is_refused_by_name(compiled, tmp_path, edit, message):
    _, flex, config, folder = compiled
    assert message in refusal(flex, config, edited(folder, tmp_path, edit))


def test_other_capacities_are_refused(compiled):
    _, flex, config, folder = compiled
    assert "shapes differ" in refusal(flex, {**config, "max_cache_len": 32}, folder)


def test_a_missing_manifest_or_graph_is_refused(compiled, tmp_path):
    _, flex, config, folder = compiled
    copy_ = tmp_path / "partial"
    shutil.copytree(folder, copy_)
    (copy_ / "graphs" / "4_40_16.pt2").unlink()
    assert "graphs/4_40_16.pt2 is missing" in refusal(flex, config, copy_)
    (copy_ / "manifest.json").unlink()
    assert "holds no manifest.json" in refusal(flex, config, copy_)
    assert "holds no manifest.json" in refusal(flex, config, tmp_path / "nothing")


def test_save_artifact_leaves_a_folder_that_is_not_an_artifact_alone(compiled, tmp_path):
    _, flex, config, _ = compiled
    (tmp_path / "mine.txt").write_text("not an artifact")
    with Engine(flex, cache_config=config, compile_config=compile_config_for_cpu()) as engine:
        with pytest.raises(ValueError, match="is not a compiled artifact, and is left alone"):
            engine.save_artifact(tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "not an artifact"
