"""The load benchmark's quick run (`bench-serve --quick`): tiny models, every strategy, every column, its own tokens
checked against upstream's DynamicCache on each request alone (its exit status)."""

from __future__ import annotations

import gc
import json

from transformers_flexcache.__main__ import main
from transformers_flexcache.bench.serve import COLUMNS, STRATEGIES, LoadRow, goals


def test_the_quick_load_benchmark_prints_every_column_and_checks_its_tokens(tmp_path, capsys):
    out = tmp_path / "serve.json"
    status = main(
        ["bench-serve", "--quick", "--models", "t5", "--requests", "6", "--loads", "40,160", "--json", str(out)]
    )
    printed = capsys.readouterr().out
    assert status == 0, printed  # every request of every torch strategy equals the reference tokens
    header = next(line for line in printed.splitlines() if line.startswith("strategy"))
    assert [cell.strip() for cell in header.split("|")] == [title for _, title, _ in COLUMNS]
    report = json.loads(out.read_text())
    rows = report["models"]["t5"]["rows"]
    assert {(row["strategy"], row["offered_rps"]) for row in rows} == {(s, r) for s in STRATEGIES for r in (40, 160)}
    for row in rows:
        assert row["num_requests"] == 6 and row["failed"] == 0
        assert row["completed_rps"] > 0 and row["p99_s"] >= row["p50_s"] > 0
        if row["strategy"].startswith("in-flight"):
            assert row["cache_allocations"] == 0  # the seats were allocated before the stream, once
            assert row["tokens_equal"] == 6
    assert any(line.startswith("in-flight compiled / static batching") for line in printed.splitlines())
    assert "machine:" in printed
    assert report["models"]["t5"]["gc"]["frozen_objects"] > 0 and "garbage collector during the loads" in printed
    assert gc.get_freeze_count() == 0  # handed back after the loads
    assert "failed" not in printed  # no strategy's request failed (a failure is a note, not a crash)


def test_the_goals_read_the_saturating_load_and_each_strategys_capacity():
    def row(strategy, offered, completed, p99):
        return LoadRow(model="t5", strategy=strategy, offered_rps=offered, completed_rps=completed, p99_s=p99)

    rows = [
        row("static-batching", 2.0, 2.0, 1.0),
        row("static-batching", 4.0, 3.0, 8.0),  # below 90% of 4: static batching saturates here
        row("static-batching", 8.0, 3.5, 20.0),
        row("in-flight-compiled", 2.0, 2.0, 0.5),
        row("in-flight-compiled", 4.0, 3.9, 2.0),
        row("in-flight-compiled", 8.0, 7.0, 4.0),
        row("ctranslate2", 2.0, 2.0, 0.4),
        row("ctranslate2", 4.0, 3.9, 1.0),
        row("ctranslate2", 8.0, 5.6, 6.0),
    ]
    assert goals(rows) == [
        "static batching saturates at 4.00 req/s offered (3.00 completed)",
        "in-flight compiled / static batching there: throughput 1.30x (goal >= 1.5x), p99 0.25x (goal <= 0.5x)",
        "in-flight compiled / CTranslate2 there: throughput 1.00x (goal >= 1x), p99 2.00x (goal <= 1x)",
        "capacity (highest completed req/s over the loads): in-flight compiled 7.00, static batching 3.50 (2.00x), "
        "CTranslate2 5.60 (1.25x)",
    ]


def test_the_beam_search_stream_returns_each_requests_hypotheses_and_scores_as_generate_alone(tmp_path, capsys):
    out = tmp_path / "beams.json"
    status = main(
        [
            "bench-serve",
            "--quick",
            "--models",
            "marian",
            "--requests",
            "4",
            "--loads",
            "80",
            "--num-beams",
            "3",
            "--num-hypotheses",
            "2",
            "--strategies",
            "one-at-a-time,in-flight,ctranslate2",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert status == 0, printed  # the engine's hypotheses equal generate's on each request alone
    assert "decoding: beam search: 3 beams, 2 hypotheses with their scores" in printed
    rows = {row["strategy"]: row for row in json.loads(out.read_text())["models"]["marian"]["rows"]}
    assert set(rows) == {"one-at-a-time", "in-flight", "ctranslate2"}
    assert rows["in-flight"]["tokens_equal"] == 4 and rows["in-flight"]["failed"] == 0
    assert rows["ctranslate2"]["failed"] == 0 and rows["ctranslate2"]["completed_rps"] > 0
    (gap,) = [note.split()[3] for note in rows["in-flight"]["notes"] if note.startswith("in-flight: scores within")]
    assert float(gap) < 1e-4  # generate's sequences_scores, within float noise
    assert any(
        line.startswith("capacity (highest completed req/s over the loads): in-flight")
        for line in printed.splitlines()
    )


def test_the_quick_transcription_stream_serves_long_and_short_recordings_with_upstreams_tokens(tmp_path, capsys):
    out = tmp_path / "whisper.json"
    arguments = ["bench-serve", "--quick", "--models", "whisper", "--requests", "4", "--max-new-tokens", "6"]
    status = main([*arguments, "--loads", "20", "--json", str(out)])
    printed = capsys.readouterr().out
    assert status == 0, printed  # the engine's tokens equal upstream's generate one recording at a time
    part = json.loads(out.read_text())["models"]["whisper"]
    assert [row["strategy"] for row in part["rows"]] == ["one-at-a-time", "in-flight"]
    assert all(row["tokens_equal"] == row["num_requests"] == 4 and row["failed"] == 0 for row in part["rows"])
    assert max(part["durations_s"]) > 3  # long-form for the tiny model's 3 s window
    assert "faster-whisper: left out with --quick" in printed
