"""Compiled artifacts of generate's fixed-shape calls (`compile/generate_artifact.py`, `warmup(..., artifact=DIR)`).

Fast tests: what a call's description holds (a change of the cache's plain state or of a tensor's shape is another
graph), the cache's plain state set back, a call the artifact has no graph for runs the compiled forward with a
warning, a folder compiled for another key is refused by name. The slow test builds an artifact for a tiny T5 (an
AOTInductor compile: minutes on a loaded 2-core machine), loads it into a second copy of the model and checks that
its calls trace nothing (encoder, first step and decode steps from the artifact's graphs) and give the tokens of the
cold-compiled model and of upstream's DynamicCache.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.model_cases import LLAMA, T5
from transformers_flexcache import compile_config_for_cpu, warmup
from transformers_flexcache.compile import ArtifactRefused, LoadedArtifact, load_artifact
from transformers_flexcache.compile.generate_artifact import (
    Replayer,
    Unsupported,
    artifact_of,
    describe,
    plain_state,
    set_artifact,
    set_plain_state,
)

CACHE_CONFIG = {"shape_policy": "padded", "max_batch_size": 2, "max_cache_len": 12, "max_encoder_len": 8}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def leased_cache(flex):
    """The model's flexible cache after a padded call (its layers, their plain state)."""
    inputs = T5.make_inputs(2, 5, torch.Generator().manual_seed(0))
    flex.generate(**inputs, cache_implementation="flexible_static", cache_config=CACHE_CONFIG, max_new_tokens=2)
    return flex.flexible_cache


def test_a_description_changes_with_the_cache_state_and_the_shapes():
    _, flex = T5.build("sdpa")
    cache = leased_cache(flex)
    ids = torch.zeros(2, 1, dtype=torch.long)
    digest, parts = describe({"decoder_input_ids": ids, "cache": cache, "use_cache": True})
    assert describe({"decoder_input_ids": ids.clone(), "cache": cache, "use_cache": True})[0] == digest
    assert describe({"decoder_input_ids": torch.zeros(1, 1, dtype=torch.long), "cache": cache})[0] != digest
    assert describe({"decoder_input_ids": ids, "cache": cache, "use_cache": False})[0] != digest
    state = plain_state(cache)
    assert parts["caches"][0]["state"] == state
    # one plain value of one of the cache's objects changed: another description; set back: the same one
    index, name, value = next(entry for entry in state if isinstance(entry[2], int) and not isinstance(entry[2], bool))
    changed = [[i, n, v + 1 if (i, n) == (index, name) else v] for i, n, v in state]
    set_plain_state(cache, changed)
    assert describe({"decoder_input_ids": ids, "cache": cache, "use_cache": True})[0] != digest
    set_plain_state(cache, state)
    assert plain_state(cache) == state
    assert describe({"decoder_input_ids": ids, "cache": cache, "use_cache": True})[0] == digest


def test_an_argument_that_is_not_a_tensor_value_or_cache_is_unsupported():
    with pytest.raises(Unsupported, match="object"):
        describe({"input_ids": torch.zeros(1, 1), "other": object()})


def test_a_call_without_a_graph_runs_the_compiled_forward_with_a_warning(caplog):
    _, flex = T5.build("sdpa")
    calls = []

    def compiled(**kwargs):
        calls.append(kwargs)
        return "compiled"

    replayer = Replayer(flex, LoadedArtifact("/nowhere", {}, 0.0))
    forward = replayer.wrap(compiled)
    with caplog.at_level(logging.WARNING):
        assert forward(input_ids=torch.zeros(1, 1)) == "compiled"
        assert forward(input_ids=torch.zeros(1, 1)) == "compiled"
    assert len(calls) == 2
    assert sum("holds no graph for this step" in record.getMessage() for record in caplog.records) == 1  # once


def test_set_artifact_puts_and_takes_it_away():
    _, flex = T5.build("sdpa")
    replayer = Replayer(flex, LoadedArtifact("/nowhere", {}, 0.0))
    set_artifact(flex, replayer)
    assert artifact_of(flex) is replayer
    set_artifact(flex, None)
    assert artifact_of(flex) is None


def test_warmup_with_an_artifact_needs_a_compile_config(tmp_path):
    _, flex = T5.build("sdpa")
    with pytest.raises(ValueError, match="needs the compile_config"):
        warmup(
            flex,
            lambda b, n: T5.make_inputs(b, n, torch.Generator().manual_seed(0)),
            max_new_tokens=2,
            cache_config=CACHE_CONFIG,
            artifact=tmp_path / "art",
        )
    assert not (tmp_path / "art").exists()


def _build_and_load(flex, folder, compile_config, generator, *, case=T5, cache_config=CACHE_CONFIG, new_tokens=3):
    return warmup(
        flex,
        lambda b, n: case.make_inputs(b, n, generator),
        max_new_tokens=new_tokens,
        cache_config=cache_config,
        compile_config=compile_config,
        artifact=folder,
    )


def _tokens(upstream, flex, case, shape, cache_config, compile_config, new_tokens):
    """(flex's flexible-static tokens, upstream's DynamicCache tokens) of one greedy call on seeded inputs of `shape`."""
    inputs = case.make_inputs(*shape, torch.Generator().manual_seed(shape[0] * 10 + shape[1]))
    expected = upstream.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    actual = flex.generate(
        **inputs,
        max_new_tokens=new_tokens,
        do_sample=False,
        cache_implementation="flexible_static",
        cache_config=cache_config,
        compile_config=compile_config,
    )
    return actual, expected


@pytest.mark.slow
def test_a_loaded_artifact_traces_nothing_and_gives_the_cold_compiled_tokens(tmp_path, caplog):
    # Three copies of one seeded tiny T5: one cold-compiled (warmup() without an artifact), one that builds the
    # artifact, one that loads it. The loaded one must trace nothing and answer the cold-compiled one's tokens, which
    # are upstream's DynamicCache's.
    upstream, cold = T5.build("sdpa")
    _, builder = T5.build("sdpa")
    _, loader = T5.build("sdpa")
    compile_config = compile_config_for_cpu()
    folder = tmp_path / "artifact"
    generator = torch.Generator().manual_seed(0)
    warmup(
        cold,
        lambda b, n: T5.make_inputs(b, n, generator),
        max_new_tokens=3,
        cache_config=CACHE_CONFIG,
        compile_config=compile_config,
    )
    _build_and_load(builder, folder, compile_config, generator)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["files"], "the artifact holds no graph"
    # a call's first decode step and its later steps: two descriptions, one graph, one package
    aliases = [entry["same_as"] for entry in manifest["files"].values() if "same_as" in entry]
    assert aliases and all("same_as" not in manifest["files"][name] for name in aliases)
    assert len(list((folder / "graphs").iterdir())) == len(manifest["files"]) - len(aliases)
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    with caplog.at_level(logging.WARNING):
        _build_and_load(loader, folder, compile_config, generator)
    traced = graphs["unique_graphs"] - before  # loading traces nothing
    assert isinstance(artifact_of(loader), Replayer)
    assert not any("not used" in record.getMessage() for record in caplog.records)
    encoder_calls = artifact_of(loader).encoder_side.calls["packed_encoder"]  # the warm-up's own, on the graphs
    assert encoder_calls  # the loaded graphs ran once in the warm-up (their first run's costs paid there)
    for batch_size, length in [(2, 7), (1, 4), (2, 8)]:
        inputs = T5.make_inputs(batch_size, length, torch.Generator().manual_seed(batch_size * 10 + length))
        common = {"max_new_tokens": 3, "do_sample": False, "compile_config": compile_config}
        flexible = {"cache_implementation": "flexible_static", "cache_config": CACHE_CONFIG}
        expected = upstream.generate(**inputs, max_new_tokens=3, do_sample=False)
        from_cold = cold.generate(**inputs, **common, **flexible)
        before = graphs["unique_graphs"]
        from_artifact = loader.generate(**inputs, **common, **flexible)
        traced += graphs["unique_graphs"] - before  # nor does a call
        assert torch.equal(from_cold, expected)
        assert torch.equal(from_artifact, from_cold)
    assert traced == 0, "the artifact's load or calls traced a graph"
    assert not artifact_of(loader).missed
    # the encoder ran the artifact's graph (T5 packs its encoder), at each call's own rows and positions
    calls = artifact_of(loader).encoder_side.calls["packed_encoder"] - encoder_calls
    assert calls == {(2, 7): 1, (1, 4): 1, (2, 8): 1}

    # another key (other weights): refused by name
    changed = {**manifest["key"], "weights": "0" * 64}
    with pytest.raises(ArtifactRefused, match="weights differ"):
        load_artifact(folder, changed)


@pytest.mark.slow
def test_a_decoder_only_artifact_serves_prompts_shorter_than_the_warm_up_s_without_tracing(tmp_path):
    # A padded call's prompt is left-padded to the bucket; how many columns (`num_prompt_pad`, the lender's
    # bookkeeping, which no step reads) differs from call to call and was part of the description: every call of a
    # shorter prompt than the warm-up's missed the artifact and compiled (the bench's Llama rows compiled 1-4 graphs).
    cache_config = {"shape_policy": "padded", "max_batch_size": 2, "max_cache_len": 24, "max_prompt_len": 12}
    upstream, flex = LLAMA.build("sdpa")
    compile_config = compile_config_for_cpu()
    generator = torch.Generator().manual_seed(0)
    _build_and_load(
        flex, tmp_path / "artifact", compile_config, generator, case=LLAMA, cache_config=cache_config, new_tokens=4
    )
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    for batch_size, length in [(2, 7), (1, 4), (2, 12)]:
        actual, expected = _tokens(upstream, flex, LLAMA, (batch_size, length), cache_config, compile_config, 4)
        assert torch.equal(actual, expected)
        assert flex.flexible_cache.num_prompt_pad == 12 - length  # the call's own, not the warm-up's
    assert graphs["unique_graphs"] == before, "a call traced a graph"
    assert not artifact_of(flex).missed


@pytest.mark.slow
def test_a_second_strategy_s_folder_links_the_packages_this_process_built_for_the_first(tmp_path):
    # One model, two strategies (padded, then bucketed at the same capacities), each with its own compile config: the
    # encoder side's graph is the same program, so the second folder takes the first's package (a hard link), and its
    # calls still give upstream's DynamicCache tokens.
    upstream, flex = T5.build("sdpa")
    generator = torch.Generator().manual_seed(0)
    padded, bucketed = tmp_path / "padded", tmp_path / "bucketed"
    _build_and_load(flex, padded, compile_config_for_cpu(), generator)
    set_artifact(flex, None)
    cache_config = {**CACHE_CONFIG, "shape_policy": "bucketed", "buckets": {"max_batch_size": [1]}}
    compile_config = compile_config_for_cpu()
    _build_and_load(flex, bucketed, compile_config, generator, cache_config=cache_config)
    linked = {
        path.name
        for path in (bucketed / "graphs").iterdir()
        if any(path.samefile(other) for other in (padded / "graphs").iterdir())
    }
    assert "packed_encoder.pt2" in linked
    manifests = [json.loads((folder / "manifest.json").read_text())["files"] for folder in (padded, bucketed)]
    assert manifests[0]["graphs/packed_encoder.pt2"]["sha256"] == manifests[1]["graphs/packed_encoder.pt2"]["sha256"]
    for batch_size, length in [(2, 7), (1, 4)]:
        actual, expected = _tokens(upstream, flex, T5, (batch_size, length), cache_config, compile_config, 3)
        assert torch.equal(actual, expected)
    assert not artifact_of(flex).missed
