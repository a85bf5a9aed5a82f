"""The benchmark's ExecuTorch strategies: upstream's logits processors on the programs' logits, agreement reported
apart from exactness, refusals as notes, and (slow) `bench --quick` running our `.pte` and transformers' exporter.

Cost: the fast tests take well under a second each. The slow ones share one `bench --quick` run that lowers eight
tiny programs with XNNPACK (Llama and T5: ours fp32 and 8da4w, transformers' at two batches): 744 s on one thread
of a busy 2-core machine (load average 3-4), almost all of it lowering.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json

import pytest
import torch

from tests.export.conftest import needs_executorch
from transformers_flexcache import zoo
from transformers_flexcache.__main__ import main
from transformers_flexcache.bench.executorch import Unavailable, check_runnable, reference_processors
from transformers_flexcache.bench.measure import FIGURES, CallRecord
from transformers_flexcache.bench.model_run import ModelResult, _executorch_runners
from transformers_flexcache.bench.models import BENCH_MODELS, build_models
from transformers_flexcache.bench.report import format_footer, format_model, to_json
from transformers_flexcache.bench.strategies import BASELINE, STRATEGIES, STRATEGIES_BY_NAME, strategies_for
from transformers_flexcache.bench.stream import Call

EXECUTORCH_STRATEGIES = ("executorch", "executorch-8da4w", "executorch-transformers")


def test_executorch_strategies_run_only_when_named_and_then_for_every_model():
    strategies = [STRATEGIES_BY_NAME[name] for name in EXECUTORCH_STRATEGIES]
    assert not any(strategy.default for strategy in strategies)
    defaults = [strategy for strategy in STRATEGIES if strategy.default]
    for model_name in BENCH_MODELS:
        assert not set(EXECUTORCH_STRATEGIES) & {
            s.name for s in strategies_for(model_name, defaults, named=False, quick=False)
        }
        assert strategies_for(model_name, strategies, named=True, quick=True) == strategies
    assert [strategy.exact for strategy in strategies] == [True, False, False]


@pytest.mark.parametrize("model_name", ["llama", "t5", "bart", "whisper"])
def test_reference_processors_turn_each_step_of_logits_into_the_scores_of_upstream_generate(model_name):
    model = BENCH_MODELS[model_name]
    upstream, _ = build_models(model, quick=True, with_override=False)
    config = upstream.config
    new_tokens = 5
    inputs = model.make_inputs(config, 3, 6, torch.Generator().manual_seed(0))
    if model_name == "whisper":
        # whisper-tiny's generation config suppresses tokens at the first step; the tiny one sets none.
        upstream.generation_config.begin_suppress_tokens = [3, 4, 5]
        upstream.generation_config.suppress_tokens = [6, 7]
    out = upstream.generate(
        **inputs,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        output_scores=True,
    )
    prefix_len = 1 if config.is_encoder_decoder else inputs["input_ids"].shape[1]
    assert out.sequences.shape[1] == prefix_len + new_tokens
    processors = reference_processors(upstream.generation_config, prefix_len=prefix_len, new_tokens=new_tokens)
    for step, (logits, scores) in enumerate(zip(out.logits, out.scores, strict=True)):
        got = processors(out.sequences[:, : prefix_len + step], logits.clone())
        assert torch.equal(got, scores), f"{model_name} step {step}"
        assert not torch.equal(got, logits), "upstream suppressed EOS at every step: the processors must too"


def _record(tokens: list[list[int]]) -> CallRecord:
    tokens = torch.tensor(tokens)
    return CallRecord(wall_s=0.5, num_tokens=tokens.numel(), tokens=tokens, first_token_s=0.1, step_s=[0.01, 0.02])


def _report(strategy: str, differing_tokens: list[list[int]]):
    """A run of two calls where `strategy` differs from DynamicCache in the first call only."""
    result = ModelResult("llama", "tiny llama")
    result.stream = [Call(2, 4), Call(1, 4)]
    result.new_tokens = 3
    if not STRATEGIES_BY_NAME[strategy].exact:
        result.agreement_only.add(strategy)
    result.lowering[strategy] = {"export_s": 1.0, "lower_s": 2.0, "pte_bytes": 4e6, "exports": 2}
    result.lowering[strategy]["exports_for_every_batch"] = 2
    first, second = [[5, 6, 7], [8, 9, 10]], [[11, 12, 13]]
    result.add_call({BASELINE: _record(first), strategy: _record(differing_tokens)})
    result.add_call({BASELINE: _record(second), strategy: _record(second)})
    args = argparse.Namespace(
        model=None, quick=True, calls=2, max_batch_size=2, min_length=4, max_length=4, new_tokens=3, threads=1
    )
    args.device, args.dtype, args.seed = "cpu", "float32", 0
    return to_json([result], args=args, machine={}, elapsed_s=1.0)


def test_a_quantized_strategy_reports_its_token_agreement_and_does_not_fail_the_run():
    report = _report("executorch-8da4w", [[5, 6, 7], [8, 0, 10]])  # one token of nine differs
    figures = report["models"]["llama"]["strategies"]["executorch-8da4w"]
    assert report["outputs_equal"] is True
    assert report["num_compared_calls"] == 0
    assert (figures["exact"], figures["outputs_equal"], figures["calls_equal"]) == (False, False, 1)
    assert figures["token_agreement"] == pytest.approx(8 / 9)
    assert [(c["tokens_equal"], c["rows_equal"]) for c in figures["calls"]] == [(5, 1), (3, 1)]
    assert report["agreement_only"] == [
        {
            "model": "llama",
            "strategy": "executorch-8da4w",
            "reference": "dynamic",
            "token_agreement": pytest.approx(8 / 9),
            "calls_equal": 1,
            "calls": 2,
        }
    ]
    footer = format_footer(report)
    assert "OUTPUTS DIFFER" not in footer
    assert "llama executorch-8da4w against dynamic: 89% of tokens, 1/2 calls equal" in footer
    assert "Outputs: exact strategies generated exactly DynamicCache's tokens on every call" in footer
    assert max(len(line) for line in footer.splitlines()) <= 100
    table = format_model("llama", report["models"]["llama"])
    assert " 89%" in next(line for line in table.splitlines() if line.strip().startswith("executorch-8da4w"))


def test_an_exact_executorch_strategy_whose_tokens_differ_fails_the_run():
    report = _report("executorch", [[5, 6, 7], [8, 0, 10]])
    figures = report["models"]["llama"]["strategies"]["executorch"]
    assert report["outputs_equal"] is False
    assert (figures["exact"], figures["outputs_equal"]) == (True, False)
    assert "OUTPUTS DIFFER from DynamicCache's tokens: llama executorch (calls [0])" in format_footer(report)


def test_executorch_table_shows_export_and_lowering_apart_and_the_exports_needed():
    report = _report("executorch-transformers", [[5, 6, 7], [8, 9, 10]])
    model = report["models"]["llama"]
    figures = model["strategies"]["executorch-transformers"]
    assert figures["lowering"]["exports"] == 2
    assert figures["warm_wall_s"] == pytest.approx(1.0)  # the two calls; lowering is not in it
    lines = format_model("llama", model).splitlines()
    header = next(index for index, line in enumerate(lines) if "executorch (export, lowering)" in line)
    row = lines[header + 1].split()
    assert row == ["executorch-transformers", "1.0", "2.0", "4.0", "2", "2", "2/2", "100%"]
    assert max(len(line) for line in lines) <= 100


def _args(**overrides):
    return argparse.Namespace(**{"device": "cpu", "dtype": "float32", **overrides})


@needs_executorch
def test_a_model_that_export_refuses_gets_a_note_and_no_row():
    from transformers import JambaForCausalLM

    torch.manual_seed(0)
    upstream = JambaForCausalLM(zoo.TINY_CONFIGS["jamba"]()).eval()
    result = ModelResult("jamba", "tiny jamba")
    result.capacities = {"max_batch_size": 2, "max_cache_len": 8, "max_prompt_len": 4}
    strategies = [STRATEGIES_BY_NAME[name] for name in EXECUTORCH_STRATEGIES]
    runners = _executorch_runners(strategies, upstream, None, result, _args(), log=print)
    assert runners == []
    assert result.failures == []
    assert len(result.notes) == 3
    assert all("model_type='jamba' cannot be exported: its Mamba scan" in note for note in result.notes)


@pytest.mark.parametrize(
    ("where", "generation", "message"),
    [
        pytest.param({"device": "cuda"}, {}, r"run on the CPU at float32 only \(--device cuda", id="device"),
        pytest.param({"dtype": "bfloat16"}, {}, r"--dtype bfloat16\)", id="dtype"),
        pytest.param({}, {"repetition_penalty": 1.3}, r"sets \['repetition_penalty'\]", id="generation-config"),
    ],
)
@needs_executorch
def test_an_executorch_row_is_refused_before_lowering_with_the_reason(where, generation, message):
    upstream, _ = build_models(BENCH_MODELS["llama"], quick=True, with_override=False)
    for name, value in generation.items():
        setattr(upstream.generation_config, name, value)
    where = {"device": "cpu", "dtype": "float32", **where}
    with pytest.raises(Unavailable, match=message):
        check_runnable(STRATEGIES_BY_NAME["executorch"], upstream=upstream, **where)


# --- slow: the command, lowering tiny models with XNNPACK ---------------------------------------------------------

# Batches 1, 2, 3: transformers' programs are exported at 1 and 3, the call of 2 rows runs padded to 3.
QUICK = ["--quick", "--calls", "3", "--new-tokens", "4", "--max-batch-size", "3", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def executorch_run(tmp_path_factory):
    json_path = tmp_path_factory.mktemp("bench-executorch") / "bench.json"
    strategies = ",".join(["flexible_static-exact", *EXECUTORCH_STRATEGIES])
    args = ["bench", *QUICK, "--models", "llama,t5", "--strategies", strategies, "--json", str(json_path)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(args)
    return status, json.loads(json_path.read_text()), printed.getvalue()


@pytest.mark.slow
@needs_executorch
@pytest.mark.parametrize("model_name", ["llama", "t5"])
def test_quick_bench_executorch_program_generates_dynamic_cache_tokens_on_every_call(executorch_run, model_name):
    status, report, _ = executorch_run
    assert status == 0
    assert report["failures"] == []
    strategies = report["models"][model_name]["strategies"]
    figures = strategies["executorch"]
    assert figures["exact"] is True
    assert figures["outputs_equal"] is True
    assert [call["outputs_equal"] for call in figures["calls"]] == [True] * report["settings"]["calls"]
    assert figures["token_agreement"] == 1.0
    for name in ("wall_s", "warm_wall_s", "tokens_per_s", "first_token_ms", "step_latency_ms", "peak_cache_bytes"):
        assert figures[name] is not None and figures[name] > 0, name
    assert set(FIGURES) <= set(figures)
    assert figures["vs_dynamic"]["step_latency_ms"] == pytest.approx(
        figures["step_latency_ms"] / strategies[BASELINE]["step_latency_ms"]
    )
    lowering = figures["lowering"]
    assert lowering["export_s"] > 0 and lowering["lower_s"] > 0 and lowering["pte_bytes"] > 0
    assert (lowering["exports"], lowering["exports_for_every_batch"]) == (1, 1)
    # Export must leave the override model as it was: the flexible strategy on it still matches.
    assert strategies["flexible_static-exact"]["outputs_equal"] is True


@pytest.mark.slow
@needs_executorch
@pytest.mark.parametrize("model_name", ["llama", "t5"])
def test_quick_bench_transformers_exporter_row_counts_its_exports_and_reports_agreement(executorch_run, model_name):
    _, report, _ = executorch_run
    model = report["models"][model_name]
    figures = model["strategies"]["executorch-transformers"]
    batches = {call["batch_size"] for call in model["stream"]} | {1}  # the warm-up call has one row
    assert figures["exact"] is False
    assert batches == {1, 2, 3}
    assert figures["lowering"]["exported_batches"] == [1, 3]
    assert figures["lowering"]["exports"] == 2
    assert figures["lowering"]["exports_for_every_batch"] == 3
    assert 0 <= figures["token_agreement"] <= 1
    # Row 0 is never padded (full length): its tokens are DynamicCache's on every call.
    assert all(call["rows_equal"] >= 1 for call in figures["calls"])
    assert figures["step_latency_ms"] > 0


@pytest.mark.slow
@needs_executorch
@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_quick_bench_quantized_row_reports_agreement_without_failing_and_prints_within_100_columns(executorch_run):
    status, report, printed = executorch_run
    assert status == 0
    for model_name in ("llama", "t5"):
        figures = report["models"][model_name]["strategies"]["executorch-8da4w"]
        assert figures["exact"] is False
        assert figures["lowering"]["quantized_linears"] > 0
        assert 0 <= figures["token_agreement"] <= 1
        assert {"model": model_name, "strategy": "executorch-8da4w"}.items() <= next(
            a for a in report["agreement_only"] if a["model"] == model_name and a["strategy"] == "executorch-8da4w"
        ).items()
    assert "Agreement with DynamicCache's tokens (reported, not required):" in printed
    # The bench's own text (rendered from the JSON as it was printed); ExecuTorch's lowering prints lines of its own.
    bandwidth = report["machine"]["read_bandwidth_bytes_per_s"]
    ours = [format_model(name, model, bandwidth=bandwidth) for name, model in report["models"].items()]
    ours.append(format_footer(report))
    assert all(block in printed for block in ours)
    assert [line for block in ours for line in block.splitlines() if len(line) > 100] == []
