"""The load benchmark's quick run (`bench-serve --quick`): tiny models, every strategy, every column, its own tokens
checked against upstream's DynamicCache on each request alone (its exit status)."""

from __future__ import annotations

import json

from transformers_flexcache.__main__ import main
from transformers_flexcache.bench.serve import COLUMNS, STRATEGIES


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
    assert "failed" not in printed  # no strategy's request failed (a failure is a note, not a crash)
