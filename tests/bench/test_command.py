"""`transformers-flexcache bench --quick`: the command runs, compares every strategy with DynamicCache, reports."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from transformers import DynamicCache

from tests.model_cases import LLAMA
from transformers_flexcache.__main__ import main
from transformers_flexcache.bench.command import BASELINE, STRATEGIES
from transformers_flexcache.bench.measure import FIGURES, CacheStorageTracker
from transformers_flexcache.bench.models import DEFAULT_MODELS
from transformers_flexcache.cache import FlexibleStaticCache

# Figures that only torch strategies report (CTranslate2 exposes no cache allocations or compiled graphs).
TORCH_ONLY = {"cache_allocations", "cache_bytes_allocated", "peak_cache_bytes", "compiled_graphs"}


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
    assert "every strategy generated exactly DynamicCache's tokens on every call" in printed
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
        is_torch = name != "ctranslate2"
        for figure in FIGURES:
            assert figure in figures, (name, figure)
            assert figure in figures["vs_dynamic"], (name, figure)
            if is_torch or figure not in TORCH_ONLY:
                assert figures[figure] is not None, (name, figure)
        assert figures["outputs_equal"] is True, name
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


def test_compiled_strategies_run_only_when_named():
    assert [s.name for s in STRATEGIES if s.compile and s.default] == []


def test_unknown_strategy_is_refused_with_the_valid_names(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--strategies", "dynamic,paged"])
    assert exit_info.value.code == 2
    assert "paged" in capsys.readouterr().err


def test_bench_runs_a_local_checkpoint_folder_under_every_default_strategy(tmp_path):
    torch.manual_seed(0)
    LLAMA.upstream_class(LLAMA.build_config()).save_pretrained(tmp_path / "llama")
    json_path = tmp_path / "bench.json"
    args = ["bench", "--model", str(tmp_path / "llama"), "--calls", "2", "--new-tokens", "3", "--max-batch-size", "2"]
    status = main([*args, "--threads", "1", "--no-progress", "--json", str(json_path)])
    report = json.loads(json_path.read_text())
    assert status == 0
    assert list(report["models"]) == ["llama"]
    assert report["models"]["llama"]["description"] == str(tmp_path / "llama")
    assert {BASELINE, "static", "flexible_static-exact"} <= set(report["models"]["llama"]["strategies"])
    assert report["outputs_equal"] is True
