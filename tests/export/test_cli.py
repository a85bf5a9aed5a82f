"""`python -m transformers_flexcache export`: tiny saved checkpoints of every supported model type to `.pte` files,
run in ExecuTorch's runtime against upstream's eager `generate` (DynamicCache).

The command runs in this process (tests/export/conftest.py), so the package under test is this checkout's; each
model type is exported once per session, one layer per stack, with portable kernels (XNNPACK lowering takes longer;
it is covered by tests/export/test_executorch.py).
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from tests.export.conftest import CAPACITY, LLAMA_MAX_CACHE_LEN, needs_executorch, run_command
from tests.export.helpers import ONE_LAYER, assert_matches_eager_for_every_shape
from tests.model_cases import JAMBA, WHISPER_MAX_SOURCE_POSITIONS
from transformers_flexcache.export import ExecuTorchPrograms, export_model
from transformers_flexcache.export.lowering import NOT_LOWERABLE, lower_to_executorch

pytestmark = needs_executorch

SHAPES = {
    name: [(3, 10), (1, 3), (2, 7)] if ONE_LAYER[name].build_config().is_encoder_decoder else [(3, 9), (1, 3), (2, 6)]
    for name in ONE_LAYER
}
SHAPES["whisper"] = [(3, WHISPER_MAX_SOURCE_POSITIONS), (1, WHISPER_MAX_SOURCE_POSITIONS)]


# Copies of an exported architecture (BART's translation family, generic decoder-only types) go through the same
# command; their CLI runs (half a minute each on a slow CPU) run with -m slow. The default run exports BART and
# Mistral here and Marian in process (tests/export/test_programs.py).
SLOW_CLI_TYPES = {"marian", "m2m_100", "mbart", "pegasus", "qwen2", "qwen3", "gemma3_text"}


@pytest.mark.parametrize(
    "model_type",
    [
        pytest.param(name, marks=[pytest.mark.slow] if name in SLOW_CLI_TYPES else [])
        for name in ONE_LAYER
        if name not in NOT_LOWERABLE
    ],
)
def test_cli_export_of_each_model_type_generates_eager_tokens_in_executorch(cli_exports, model_type):
    upstream, path, _ = cli_exports[model_type]
    runner = ExecuTorchPrograms(path)
    assert runner.capacities["max_batch_size"] == 3
    decoder_only = not upstream.config.is_encoder_decoder
    assert runner.capacities["max_cache_len"] == (LLAMA_MAX_CACHE_LEN if decoder_only else 8)
    assert_matches_eager_for_every_shape(runner, upstream, ONE_LAYER[model_type], SHAPES[model_type], seed=2)


def test_cli_prints_each_stage_with_seconds_and_a_summary_of_methods_capacities_size_and_memory(cli_exports):
    _, path, stdout = cli_exports["t5"]
    for stage in ("load", "export", "lower", "to_executorch", "write", "total"):
        assert re.search(rf"^\s*{stage}\s+\d+\.\d s", stdout, re.MULTILINE), (stage, stdout)
    assert f"wrote {path} (" in stdout
    assert "methods: encoder, text_decoder" in stdout
    assert "capacities: max_batch_size=3, max_cache_len=8, max_encoder_len=10" in stdout
    assert "cache buffers (planned once, shared):" in stdout
    assert "planned memory of text_decoder:" in stdout


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved-llama")
    upstream, _ = ONE_LAYER["llama"].build()
    upstream.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            ["--max-batch-size", "0", "--max-cache-len", "8"], r"--max-batch-size=0 must be a positive int", id="batch"
        ),
        pytest.param(
            [*CAPACITY, "--max-encoder-len", "10"], r"llama is decoder-only: drop --max-encoder-len", id="encoder-len"
        ),
        pytest.param(
            [*CAPACITY, "--quantize", "8da4w", "--backend", "portable"],
            r"quantize='8da4w' needs backend='xnnpack'.* pass --backend xnnpack",
            id="quantize",
        ),
        pytest.param(
            [*CAPACITY, "--dtype", "bf16"], r"--dtype bf16: .*float32 and float16 ops only.* --dtype fp32", id="bf16"
        ),
    ],
)
def test_cli_refuses_bad_arguments_with_value_limit_and_fix_before_loading_anything(
    saved_llama, tmp_path, argv, message
):
    out = tmp_path / "model.pte"
    status, stdout, stderr = run_command("export", str(saved_llama), "--out", str(out), *argv)
    assert status == 2 and stdout == ""
    assert re.search(message, stderr), stderr
    assert not out.exists()


def test_cli_refuses_a_folder_without_a_checkpoint(tmp_path):
    status, _, stderr = run_command("export", str(tmp_path), "--out", str(tmp_path / "m.pte"), *CAPACITY)
    assert status == 2 and "has no config.json: MODEL_DIR must be a folder written by save_pretrained" in stderr


def test_cli_refuses_an_encoder_decoder_model_without_max_encoder_len_and_whisper_with_another_one(tmp_path):
    for name, message in [
        ("t5", "t5 is an encoder-decoder model: pass --max-encoder-len N"),
        ("whisper", f"but Whisper's log-mel features always give max_source_positions={WHISPER_MAX_SOURCE_POSITIONS}"),
    ]:
        upstream, _ = ONE_LAYER[name].build()
        upstream.save_pretrained(tmp_path / name)
        argv = [] if name == "t5" else ["--max-encoder-len", "5"]
        status, _, stderr = run_command(
            "export", str(tmp_path / name), "--out", str(tmp_path / "m.pte"), *CAPACITY, *argv
        )
        assert status == 2 and message in stderr, stderr


def test_cli_refuses_jamba_with_the_reason_before_loading_it(tmp_path):
    upstream, _ = JAMBA.build()
    upstream.save_pretrained(tmp_path)
    status, _, stderr = run_command("export", str(tmp_path), "--out", str(tmp_path / "m.pte"), *CAPACITY)
    assert status == 2
    assert "model_type='jamba' cannot be exported: its Mamba scan is a Python loop over the prompt length" in stderr
    assert not os.path.exists(tmp_path / "m.pte")


@pytest.mark.parametrize("model_type", sorted(NOT_LOWERABLE))
def test_cli_refuses_a_model_type_that_executorch_does_not_lower_before_loading_it(tmp_path, model_type):
    upstream, _ = ONE_LAYER[model_type].build()
    upstream.save_pretrained(tmp_path)
    status, _, stderr = run_command("export", str(tmp_path), "--out", str(tmp_path / "m.pte"), *CAPACITY)
    assert status == 2 and f"model_type={model_type!r} does not lower to a .pte: " in stderr, stderr
    assert "measured with executorch 1.4.1" in stderr and not os.path.exists(tmp_path / "m.pte")


@pytest.mark.slow
def test_lowering_refuses_and_removes_a_pte_whose_input_bounds_executorch_narrowed(tmp_path, monkeypatch):
    # Phi3 without its NOT_LOWERABLE entry: ExecuTorch's re-tracing narrows the batch bound of `forward` (3 -> 2).
    monkeypatch.delitem(NOT_LOWERABLE, "phi3")
    _, flex = ONE_LAYER["phi3"].build(seed=1)
    programs = export_model(flex, max_batch_size=3, max_cache_len=16)
    path = tmp_path / "phi3.pte"
    with pytest.raises(ValueError, match=r"lowered method 'forward' of this phi3 model with input bounds \[\[2, 16\]"):
        lower_to_executorch(programs, path, backend="portable")
    assert not path.exists()


def test_exported_pte_serves_every_batch_from_one_planned_cache(cli_exports):
    _, path, _ = cli_exports["llama"]
    runner = ExecuTorchPrograms(path)
    assert sorted(runner.method_names) == ["forward", "start"]
    # Both methods are loaded up front and share the buffers: a sequence that prefill started continues in decode.
    mask = torch.zeros(3, LLAMA_MAX_CACHE_LEN, dtype=torch.long)
    mask[:, :2] = 1
    runner.prefill(torch.full((3, 2), 5), mask, torch.tensor([[0, 1]] * 3), torch.arange(2))
    mask[:, 2] = 1
    assert runner.decode(torch.full((3, 1), 6), mask, torch.full((3, 1), 2), torch.tensor([2])).shape[:2] == (3, 1)
