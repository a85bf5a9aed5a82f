"""The `serve` command's own decisions: default capacities from the model's config, refusals before serving (exit
status 2, naming the flag and the fix), and `--compile` (slow: inductor)."""

from __future__ import annotations

import argparse

import pytest

from transformers_flexcache import zoo
from transformers_flexcache.__main__ import main
from transformers_flexcache.server import cli

from .helpers import build_app, new_tokens, openai_client, reference, save_checkpoint, serving


def flags(**given) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["unused"])
    for name, value in given.items():
        setattr(args, name, value)
    return args


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        ("llama", {"max_batch_size": 8, "max_cache_len": 128}),  # max_position_embeddings=128
        ("t5", {"max_batch_size": 8, "max_cache_len": 512, "max_encoder_len": 512}),  # relative positions: no cap
        ("bart", {"max_batch_size": 8, "max_cache_len": 64, "max_encoder_len": 64}),  # a learned table of 64
        ("whisper", {"max_batch_size": 8, "max_cache_len": 64}),  # the engine takes max_source_positions
    ],
)
def test_capacities_default_to_512_positions_capped_by_the_models_own(model_type, expected):
    assert cli.engine_cache_config(flags(), zoo.tiny_config(model_type)) == expected


def test_flags_set_the_capacities_and_compile_sets_the_bucketed_policy():
    args = flags(
        max_batch_size=4, max_cache_len=100, max_encoder_len=200, compile=True, buckets={"max_batch_size": [2]}
    )
    assert cli.engine_cache_config(args, zoo.tiny_config("t5")) == {
        "max_batch_size": 4,
        "max_cache_len": 100,
        "max_encoder_len": 200,
        "shape_policy": "bucketed",
        "buckets": {"max_batch_size": [2]},
    }


@pytest.mark.parametrize(
    ("model_type", "buckets", "num_shapes", "policy_default"),
    [
        ("t5", {"max_batch_size": [1, 4], "max_cache_len": [256], "max_encoder_len": [256]}, 12, 144),
        ("llama", {"max_batch_size": [1, 4], "max_cache_len": [64]}, 6, 16),
        ("whisper", {"max_batch_size": [1, 4], "max_cache_len": [32]}, 6, 12),  # one encoder length: Whisper's own
    ],
)
def test_compile_without_buckets_compiles_a_dozen_shapes_at_most(model_type, buckets, num_shapes, policy_default):
    # The bucketed policy's own default (powers of two) would make `--compile` compile up to 144 graphs first.
    from tests.model_cases import MODEL_CASES
    from transformers_flexcache.serving import Engine

    _, model = next(case for case in MODEL_CASES if case.name == model_type).build()
    cache_config = cli.engine_cache_config(flags(compile=True), model.config)
    assert cache_config["buckets"] == buckets
    with Engine(model, cache_config=cache_config) as engine:
        assert len(engine.decode_shapes()) == num_shapes
    del cache_config["buckets"]
    with Engine(model, cache_config=cache_config) as engine:
        assert len(engine.decode_shapes()) == policy_default


def test_default_buckets_keep_a_capacity_of_one_as_its_only_size():
    from transformers_flexcache.serving.buckets import default_buckets

    assert default_buckets({"max_batch_size": 1, "max_cache_len": 1}) == {
        "max_batch_size": [1],
        "max_cache_len": [1],
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    save_checkpoint("llama", folder)
    return folder


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--max-batch-size", "0"], "--max-batch-size=0 must be a positive int"),
        (["--port", "70000"], "--port=70000 must be a positive int up to 65535"),
        (["--buckets", '{"max_batch_size": [2]}'], "--buckets sets the compiled shapes: pass --compile with it"),
        (["--compile", "--buckets", '{"max_batch_size": [3, 2]}'], "the engine refused these settings"),
    ],
    ids=["seats", "port", "buckets-alone", "bad-buckets"],
)
def test_a_refused_command_exits_2_before_serving_with_the_flag_and_the_fix(checkpoint, capsys, extra, expected):
    assert main(["serve", str(checkpoint), *extra]) == 2
    assert expected in capsys.readouterr().err


def test_a_folder_without_a_checkpoint_or_a_tokenizer_is_refused(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "is not a checkpoint folder" in capsys.readouterr().err
    from tests.model_cases import MODEL_CASES

    upstream, _ = next(case for case in MODEL_CASES if case.name == "llama").build("sdpa")
    upstream.save_pretrained(tmp_path / "no-tokenizer")
    assert main(["serve", str(tmp_path / "no-tokenizer")]) == 2
    assert "has no tokenizer or processor that loads" in capsys.readouterr().err


@pytest.mark.slow
def test_a_compiled_server_warms_up_every_bucket_and_answers_with_generates_tokens(tmp_path):
    upstream = save_checkpoint("t5", tmp_path)
    args = flags(
        compile=True,
        max_batch_size=2,
        max_cache_len=16,
        max_encoder_len=16,
        buckets={"max_batch_size": [1], "max_cache_len": [16], "max_encoder_len": [16]},
    )
    model, tokenizer, processor = cli.load_checkpoint(str(tmp_path))
    engine = cli.build_engine(args, model, tokenizer)
    engine.warmup()  # 2 decode shapes (the command does it once its port is open: test_warm_start.py)
    from transformers_flexcache.server.app import create_app

    app = create_app(engine, tokenizer=tokenizer, processor=processor, model_name="tiny")
    with serving(app) as base_url:
        response = openai_client(base_url).completions.create(
            model="tiny", prompt="abcdef", max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
        )
    expected = new_tokens(upstream, reference(upstream, tokenizer, "abcdef", max_new_tokens=8, do_sample=False), 0)
    assert response.choices[0].model_extra["token_ids"] == expected[0]


def test_eager_encoder_compiles_the_decode_step_only_and_keys_the_artifact_apart(tmp_path):
    """`--eager-encoder` (a float16 BART's or Marian's way to an artifact): the engine's compile config leaves the
    encoder eager, so its artifact holds no encoder graph, and the key says so: an artifact of either kind is refused
    by the other, by name."""
    save_checkpoint("t5", tmp_path)
    model, tokenizer, _ = cli.load_checkpoint(str(tmp_path))
    base = {"compile": True, "max_batch_size": 2, "max_cache_len": 16, "max_encoder_len": 16}
    eager = cli.build_engine(flags(**base, eager_encoder=True), model, tokenizer)
    compiled = cli.build_engine(flags(**base), model, tokenizer)
    try:
        assert eager.compile_config.compile_encoder is False and compiled.compile_config.compile_encoder is True
        assert eager.steps.encoder_graph_names() == [] and compiled.steps.encoder_graph_names() == ["packed_encoder"]
    finally:
        eager.close()
        compiled.close()
    parser = argparse.ArgumentParser()
    cli.add_compile_arguments(parser)
    assert parser.parse_args(["unused", "--out", "x", "--eager-encoder"]).eager_encoder is True


def test_build_app_is_what_the_command_serves(checkpoint):
    # The tests' servers use the command's loader: the same override class and tokenizer.
    app = build_app(checkpoint, cache_config={"max_batch_size": 1, "max_cache_len": 8})
    served = app.state.served
    assert served.model_class == "FlexLlamaForCausalLM" and served.takes_text and not served.takes_audio
    served.engine.close()
