"""`transformers-flexcache bench --quick`: the command runs, compares every strategy with DynamicCache, reports."""

from __future__ import annotations

import contextlib
import gc
import io
import json

import pytest
import torch
from transformers import DynamicCache

from tests.model_cases import LLAMA
from transformers_flexcache.__main__ import main
from transformers_flexcache.bench.measure import FIGURES, CacheStorageTracker
from transformers_flexcache.bench.models import DEFAULT_MODELS
from transformers_flexcache.bench.report import PEERS, format_model
from transformers_flexcache.bench.strategies import BASELINE, DYNAMIC_INT8, STRATEGIES, strategies_for
from transformers_flexcache.cache import FlexibleStaticCache
from transformers_flexcache.compile import cpu_facts

# Figures that only torch strategies report (CTranslate2 exposes no cache allocations or compiled graphs).
TORCH_ONLY = {
    "cache_allocations",
    "cache_bytes_allocated",
    "peak_cache_bytes",
    "compiled_graphs",
    "compile_s",
    "forward_ms",
    "largest_batch_forward_ms",
}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    json_path = folder / "bench.json"
    args = ["bench", "--quick", "--calls", "3", "--threads", "1", "--no-progress", "--json", str(json_path)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(args)
    return status, json.loads(json_path.read_text()), printed.getvalue()


def test_quick_bench_exits_zero_and_says_every_output_equals_dynamic_cache(quick_run):
    status, report, printed = quick_run
    assert status == 0
    assert "exact strategies generated exactly DynamicCache's tokens on every call" in " ".join(printed.split())
    assert "TIMINGS ARE NOT MEANINGFUL" in printed.splitlines()[0]
    assert report["outputs_equal"] is True
    assert report["failures"] == []
    # dynamic is compared with nothing; each other strategy with it on every call
    assert report["num_compared_calls"] >= len(DEFAULT_MODELS) * 2 * report["settings"]["calls"]


@pytest.mark.parametrize("model_name", DEFAULT_MODELS)
def test_quick_bench_json_has_every_figure_for_every_strategy_of_each_model(quick_run, model_name):
    _, report, _ = quick_run
    model = report["models"][model_name]
    strategies = model["strategies"]
    assert {BASELINE, "static", "flexible_static-exact"} <= set(strategies)
    for name, figures in strategies.items():
        is_torch = name not in PEERS
        for figure in FIGURES:
            assert figure in figures, (name, figure)
            assert figure in figures["vs_dynamic"], (name, figure)
            if is_torch or figure not in TORCH_ONLY:
                assert figures[figure] is not None, (name, figure)
        assert figures["outputs_equal"] is True or not figures["exact"], name
        assert len(figures["calls"]) == report["settings"]["calls"], name
        assert figures["vs_dynamic"]["wall_s"] == pytest.approx(figures["wall_s"] / strategies[BASELINE]["wall_s"])


def test_quick_bench_flexible_cache_allocates_only_on_the_warm_up_call(quick_run):
    _, report, _ = quick_run
    flexible = report["models"]["t5"]["strategies"]["flexible_static-exact"]
    assert flexible["warm_up"]["cache_allocations"] > 0
    assert [call["cache_allocations"] for call in flexible["calls"]] == [0] * report["settings"]["calls"]
    dynamic = report["models"]["t5"]["strategies"][BASELINE]
    assert all(call["cache_allocations"] > 0 for call in dynamic["calls"])


def test_storage_tracker_counts_each_new_dynamic_cache_storage_and_never_a_reused_flexible_one():
    config = LLAMA.build_config()
    tracker = CacheStorageTracker()
    dynamic = DynamicCache(config=config)
    keys = torch.zeros(2, config.num_key_value_heads, 3, 8)
    dynamic.update(keys, keys, 0)
    tracker.observe(dynamic)
    dynamic.update(keys, keys, 0)  # torch.cat: new key and value storages
    tracker.observe(dynamic)
    assert tracker.allocations == 4

    flexible = FlexibleStaticCache(config=config, max_batch_size=2, max_cache_len=8)
    tracker.start_call()
    tracker.observe(flexible)
    flexible.update(keys, keys, 0)
    tracker.observe(flexible)
    assert tracker.allocations == 2 * config.num_hidden_layers
    assert tracker.bytes_allocated == flexible.nbytes


def test_quick_bench_tables_fit_in_100_columns(quick_run):
    _, _, printed = quick_run
    lines = printed.split("\n\n", 1)[1].splitlines()  # after the header: the machine's CPU name and cache folder
    assert max(len(line) for line in lines) <= 100


def test_long_notes_and_failures_wrap_at_100_columns_and_keep_every_word(quick_run):
    _, report, _ = quick_run
    model = dict(report["models"]["t5"])
    # only the rows without notes of their own (int8 rows have some: their scores against the reference's)
    model["strategies"] = {name: f for name, f in model["strategies"].items() if not f["int8"] and f["outputs_equal"]}
    words = [f"word{i}" for i in range(60)]
    model["notes"] = [" ".join(words)]
    model["failures"] = [" ".join(reversed(words))]
    bandwidth = report["machine"]["read_bandwidth_bytes_per_s"]
    lines = format_model("t5", model, bandwidth=bandwidth).splitlines()
    assert any(line.startswith("  floor: ") for line in lines)
    assert max(len(line) for line in lines) <= 100
    notes = [line for line in lines if line.startswith("  note: ") or line.startswith("        word")]
    assert " ".join(notes).split()[1:] == words


def test_quick_bench_has_a_ctranslate2_row_for_the_models_it_converts(quick_run):
    # .ci/run installs the [ctranslate2] extra: without it this test fails rather than the row going missing
    _, report, printed = quick_run
    for name in ("t5", "marian"):
        row = report["models"][name]["strategies"]["ctranslate2"]
        assert row["outputs_equal"] is True, name
    assert "ctranslate2 is not installed" not in printed


def test_quick_bench_reports_a_measured_bandwidth_floor_for_every_model(quick_run):
    _, report, _ = quick_run
    assert report["machine"]["read_bandwidth_bytes_per_s"] > 1e8
    for model in report["models"].values():
        assert model["decode_step_bytes"]["weights"] > 0
        assert model["floor_step_ms"] > 0
        assert model["strategies"][BASELINE]["largest_batch_step_vs_floor"] > 0


def test_compiled_strategies_run_by_default_for_every_model_int8_for_t5_and_marian_and_not_in_a_quick_run():
    defaults = [s for s in STRATEGIES if s.default]
    fp32 = {"static-compiled", "flexible_static-padded-compiled", "flexible_static-bucketed-compiled"}
    int8 = {"flexible_static-padded-compiled-int8", "flexible_static-bucketed-compiled-int8"}
    assert {s.name for s in defaults if s.compile} == fp32 | int8
    for model_name, expected in [("t5", fp32 | int8), ("llama", fp32), ("marian", fp32 | int8), ("whisper", fp32)]:
        chosen = strategies_for(model_name, defaults, named=False, quick=False)
        assert {s.name for s in chosen if s.compile} == expected, model_name
    assert not any(s.compile for s in strategies_for("t5", defaults, named=False, quick=True))
    assert strategies_for("bart", defaults, named=True, quick=True) == defaults  # named: run everywhere


def test_unknown_strategy_is_refused_with_the_valid_names(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--strategies", "dynamic,paged"])
    assert exit_info.value.code == 2
    assert "paged" in capsys.readouterr().err


def test_bench_runs_a_local_checkpoint_folder_under_the_eager_strategies(tmp_path):
    torch.manual_seed(0)
    LLAMA.upstream_class(LLAMA.build_config()).save_pretrained(tmp_path / "llama")
    json_path = tmp_path / "bench.json"
    args = ["bench", "--model", str(tmp_path / "llama"), "--calls", "2", "--new-tokens", "3", "--max-batch-size", "2"]
    args += ["--strategies", "dynamic,static,flexible_static-exact"]  # the compiled ones would compile for minutes
    status = main([*args, "--threads", "1", "--no-progress", "--json", str(json_path)])
    report = json.loads(json_path.read_text())
    assert status == 0
    assert list(report["models"]) == ["llama"]
    assert report["models"]["llama"]["description"] == str(tmp_path / "llama")
    assert {BASELINE, "static", "flexible_static-exact"} <= set(report["models"]["llama"]["strategies"])
    assert report["outputs_equal"] is True


def test_header_says_which_inductor_cache_the_run_uses_and_how_full_it_was(tmp_path, monkeypatch):
    from transformers_flexcache.bench.command import inductor_cache_state
    from transformers_flexcache.bench.report import _inductor_cache_line

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    (tmp_path / "fxgraph").mkdir()
    (tmp_path / "fxgraph" / "a").write_text("x")
    (tmp_path / "b").write_text("x")
    state = inductor_cache_state(fresh=False)
    assert state == {"dir": str(tmp_path), "new": False, "files_at_start": 2}
    assert _inductor_cache_line(state) == f"\ninductor cache: {tmp_path} (2 files at the start)"
    empty = tmp_path / "empty"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(empty))
    assert "empty at the start: compile times of a first start" in _inductor_cache_line(
        inductor_cache_state(fresh=False)
    )
    assert "new and empty" in _inductor_cache_line(inductor_cache_state(fresh=True))


@pytest.mark.parametrize("model_name", DEFAULT_MODELS)
def test_quick_bench_times_the_forward_inside_each_decode_step(quick_run, model_name):
    _, report, _ = quick_run
    for name, figures in report["models"][model_name]["strategies"].items():
        if name in PEERS:
            continue
        assert 0 < figures["forward_ms"] < figures["step_latency_ms"], name
        assert 0 < figures["largest_batch_forward_ms"] < figures["largest_batch_step_ms"], name
        assert figures["largest_batch_forward_vs_floor"] == pytest.approx(
            figures["largest_batch_forward_ms"] / figures["floor_step_ms"]
        )


class _CompiledModel:
    """What ForwardTimer needs of a model under compile_config: `get_compiled_call`."""

    def get_compiled_call(self, config):
        return lambda **inputs: inputs["x"] + config


def test_forward_timer_wraps_the_compiled_call_for_one_generate_and_keeps_only_decode_forwards():
    from transformers_flexcache.bench.measure import ForwardTimer

    model = _CompiledModel()
    with ForwardTimer(model, compiled=True) as timer:
        call = model.get_compiled_call(1)
        assert [call(x=2), call(x=3), call(x=4)] == [3, 4, 5]
    assert "get_compiled_call" not in model.__dict__  # the class's method again
    assert len(timer.seconds) == 3 and all(s >= 0 for s in timer.seconds)
    timer.seconds = [5.0, 1.0, 2.0, 3.0]
    assert timer.decode_forwards(4) == [1.0, 2.0, 3.0]  # the prefill ran through the timed callable
    assert timer.decode_forwards(5) == [5.0, 1.0, 2.0, 3.0]  # it did not: every timed forward was a decode step
    assert timer.decode_forwards(4, hook_s=[0.5, 0.5, 0.5, 0.5]) == [0.5, 1.5, 2.5]
    # eager: the prefill runs through the class's __call__ (untimed) but its hook ran; hook k is inside forward k,
    # and StepTimer.step_s takes the same hook_s[1:] out of the gaps, so forwards and steps stay comparable
    assert timer.decode_forwards(5, hook_s=[4.0, 0.5, 0.25, 1.0, 2.0]) == [4.5, 0.75, 1.0, 1.0]


def test_forward_timer_on_an_eager_model_wraps_its_call_and_restores_it():
    from transformers_flexcache.bench.measure import ForwardTimer

    model = torch.nn.Linear(2, 2)
    with ForwardTimer(model, compiled=False) as timer:
        model.__call__(torch.zeros(1, 2))
        model.__call__(torch.zeros(1, 2))
    assert "__call__" not in model.__dict__
    assert len(timer.seconds) == 2


@pytest.mark.parametrize("model_name", ["t5", "marian"])
def test_quick_bench_has_an_int8_reference_and_a_ctranslate2_int8_row_with_an_int8_floor(quick_run, model_name):
    _, report, _ = quick_run
    model = report["models"][model_name]
    strategies = model["strategies"]
    reference = strategies[DYNAMIC_INT8]
    assert reference["int8"] and reference["reference"] == BASELINE and not reference["exact"]
    assert reference["token_agreement"] is not None  # int8 against fp32 tokens: reported, not required
    ct2 = strategies["ctranslate2-int8"]
    assert ct2["int8"] and ct2["reference"] == DYNAMIC_INT8 and not ct2["exact"]
    assert 0 < model["int8_floor_step_ms"] < model["floor_step_ms"]
    assert reference["floor_step_ms"] == model["int8_floor_step_ms"]
    error = model["logits_error"]["int8"]
    assert 0 < error["max_abs_diff"] < error["max_abs_logit"] and 0 <= error["top1_agreement"] <= 1


@pytest.mark.parametrize("model_name", DEFAULT_MODELS)
def test_quick_bench_reports_the_median_step_at_every_batch_of_the_stream(quick_run, model_name):
    _, report, printed = quick_run
    model = report["models"][model_name]
    batches = {str(call["batch_size"]) for call in model["stream"]}
    for name, figures in model["strategies"].items():
        assert set(figures["step_ms_by_batch"]) == batches, name
        assert all(value > 0 for value in figures["step_ms_by_batch"].values()), name
    assert "decode step by batch (median ms)" in printed


def test_quick_bench_header_says_which_instructions_the_cpu_has_and_which_kernels_ran(quick_run):
    _, report, printed = quick_run
    isa = report["machine"]["isa"]
    assert isa["linear_kernels"] in ("onednn", "mkl") and isa["torch_capability"]
    assert isa["one_row_linears"] in ("inductor", "library")
    fbgemm = "fbgemm" in torch.backends.quantized.supported_engines
    facts = cpu_facts()
    expected = "library" if facts.amx else "fbgemm" if fbgemm else "library" if facts.vnni else "inductor"
    assert isa["int8_linears"] == expected
    assert (
        isa["vnni"] == facts.vnni and isa["bf16_native"] == facts.bf16 and isa["int8_bits"] == (8 if facts.vnni else 7)
    )
    header = printed.split("\n\n", 1)[0]
    assert f"CPU: {facts.describe()}" in header and "fp32 linears compiled on" in printed


def test_named_compiled_int8_rows_run_in_a_quick_run_against_the_eager_int8_model_and_load_their_graphs_again(
    tmp_path,
):
    # A frozen inductor compile of the tiny T5 in int8 (about half a minute), then the same run again on its compile
    # cache: every graph loaded, none compiled, the same figures of agreement.
    json_path = tmp_path / "bench.json"
    args = ["bench", "--quick", "--models", "t5", "--calls", "2", "--threads", "1", "--no-progress"]
    args += ["--strategies", "flexible_static-padded-compiled-int8", "--json", str(json_path)]
    args += ["--compile-cache", str(tmp_path / "cache"), "--artifact", "none"]  # torch.compile's route
    runs = []
    for _ in range(2):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            status = main(args)
        assert status == 0 and f"compile cache: {tmp_path / 'cache'}" in printed.getvalue()
        runs.append(json.loads(json_path.read_text())["models"]["t5"])
    first, second = (run["compile_cache"] for run in runs)
    assert first["found"] == "cold" and first["misses"] >= 1 and first["hits"] == 0
    assert second["found"] == "warm" and second["misses"] == 0 and second["hits"] == first["misses"]
    agreement = [
        {
            key: run["strategies"]["flexible_static-padded-compiled-int8"][key]
            for key in ("token_agreement", "max_score_diff")
        }
        for run in runs
    ]
    assert agreement[0] == agreement[1]
    strategies = runs[0]["strategies"]
    assert set(strategies) == {BASELINE, DYNAMIC_INT8, "flexible_static-padded-compiled-int8", *PEERS}
    compiled = strategies["flexible_static-padded-compiled-int8"]
    assert compiled["reference"] == DYNAMIC_INT8 and not compiled["exact"]  # agreement reported, not required
    # which tokens a compiled int8 call gives is tests/compile/test_quantization.py's to check (against eager int8, within a
    # tolerance derived on this machine): here, that the agreement is reported
    assert 0 < compiled["token_agreement"] <= 1
    assert compiled["max_score_diff"] is not None and compiled["max_score_diff_vs_fp32"] is not None
    assert compiled["compiled_graphs"] >= 1


def test_quick_bench_freezes_the_collectors_heap_for_the_stream_only(quick_run, monkeypatch, tmp_path):
    _, report, printed = quick_run
    for model in report["models"].values():
        assert model["gc"]["frozen_objects"] > 0 and model["gc"]["collections"] >= 0
    assert "garbage collector during the stream:" in printed and gc.get_freeze_count() == 0

    # Frozen while the stream's calls run, not during the warm-ups; --no-gc-freeze leaves it alone.
    from transformers_flexcache.bench.torch_runner import TorchRunner

    seen = []
    run = TorchRunner.run
    monkeypatch.setattr(
        TorchRunner, "run", lambda self, *a, **k: seen.append(gc.get_freeze_count()) or run(self, *a, **k)
    )
    args = ["bench", "--quick", "--models", "t5", "--calls", "2", "--strategies", "dynamic", "--no-ctranslate2"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*args, "--threads", "1", "--no-progress", "--json", str(tmp_path / "a.json")]) == 0
        assert (
            main([*args, "--threads", "1", "--no-progress", "--no-gc-freeze", "--json", str(tmp_path / "b.json")]) == 0
        )
    assert seen[0] == 0 and all(count > 0 for count in seen[1:3]) and seen[3:] == [0, 0, 0]
    assert json.loads((tmp_path / "b.json").read_text())["models"]["t5"]["gc"]["frozen_objects"] == 0
    assert gc.get_freeze_count() == 0


def test_bench_artifact_goes_to_compiled_flexible_strategies_only(monkeypatch, tmp_path):
    # `bench --artifact DIR`: each compiled flexible strategy warms up with warmup(..., artifact=DIR/<model>/<name>)
    # (stood in for here: the real one builds AOTInductor packages, tests/compile/test_generate_artifact.py); eager
    # strategies run as without it.
    import transformers_flexcache.bench.torch_runner as torch_runner

    seen = {}

    def fake_warmup(model, make_inputs, *, max_new_tokens, artifact=None, **kwargs):
        seen[artifact] = kwargs["compile_config"]
        raise RuntimeError("stood in")

    monkeypatch.setattr(torch_runner, "warmup", fake_warmup)
    args = ["bench", "--quick", "--models", "t5", "--calls", "1", "--no-ctranslate2", "--threads", "1"]
    strategies = "dynamic,flexible_static-exact,flexible_static-bucketed-compiled"
    with contextlib.redirect_stdout(io.StringIO()):
        main([*args, "--no-progress", "--strategies", strategies, "--artifact", str(tmp_path / "art")])
    assert list(seen) == [str(tmp_path / "art" / "t5" / "flexible_static-bucketed-compiled")]
    assert seen[str(tmp_path / "art" / "t5" / "flexible_static-bucketed-compiled")] is not None


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--compile-cache", "{cache}"], "{cache}/artifacts/t5/flexible_static-bucketed-compiled"),
        (["--compile-cache", "{cache}", "--artifact", "none"], None),
        (["--compile-cache", "none"], None),
        (["--compile-cache", "{cache}", "--artifact", "{art}"], "{art}/t5/flexible_static-bucketed-compiled"),
    ],
    ids=["default-in-the-compile-cache", "none", "no-compile-cache", "named"],
)
def test_bench_artifacts_default_to_the_compile_cache_s_folder(monkeypatch, tmp_path, flags, expected):
    # By default a compiled flexible strategy warms up from (or builds) its artifact in the compile cache's folder, so
    # that a second run loads its graphs; `--artifact none` or no compile cache: torch.compile, as generate does.
    import transformers_flexcache.bench.torch_runner as torch_runner

    seen = []

    def fake_warmup(model, make_inputs, *, max_new_tokens, artifact=None, **kwargs):
        seen.append(artifact)
        raise RuntimeError("stood in")

    monkeypatch.setattr(torch_runner, "warmup", fake_warmup)
    places = {"cache": str(tmp_path / "cache"), "art": str(tmp_path / "art")}
    args = ["bench", "--quick", "--models", "t5", "--calls", "1", "--no-ctranslate2", "--threads", "1"]
    args += ["--no-progress", "--strategies", "dynamic,flexible_static-bucketed-compiled"]
    args += [flag.format(**places) for flag in flags]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(args)
    assert seen == [None if expected is None else expected.format(**places)]
    header = printed.getvalue().split("\n\n", 1)[0]
    assert ("compiled artifacts:" in header) == (expected is not None)


@pytest.mark.slow
def test_a_second_bench_run_loads_the_artifacts_the_first_built_traces_nothing_and_gives_dynamic_cache_s_tokens(
    tmp_path,
):
    # The default route of a compiled flexible strategy on a compile cache: the first run builds its artifact
    # (AOTInductor, about a minute for the tiny T5), the second loads it: no graph traced, the same tokens.
    json_path = tmp_path / "bench.json"
    args = ["bench", "--quick", "--models", "t5", "--calls", "3", "--threads", "1", "--no-progress"]
    args += ["--strategies", "dynamic,flexible_static-bucketed-compiled", "--no-ctranslate2"]
    args += ["--compile-cache", str(tmp_path / "cache"), "--json", str(json_path)]
    runs = []
    for _ in range(2):
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(args) == 0
        runs.append(json.loads(json_path.read_text())["models"]["t5"])
    for run, done in zip(runs, ("built and loaded", "loaded"), strict=True):
        compiled = run["strategies"]["flexible_static-bucketed-compiled"]
        assert compiled["outputs_equal"] is True  # DynamicCache's tokens on every call
        assert compiled["compiled_graphs"] == 0  # nothing traced: warm-up and stream ran the artifact's graphs
        artifact = compiled["warm_up"]["artifact"]
        assert artifact["built"] == (done != "loaded") and artifact["graphs"] >= 2
        assert any(f"compiled artifact {done} in" in note for note in run["notes"])
