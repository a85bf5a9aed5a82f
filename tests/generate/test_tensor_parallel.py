"""Tensor parallelism with transformers' own plans: `torchrun --nproc-per-node 2`, gloo on CPU.

One torchrun launch (`tests/generate/tensor_parallel_child.py`) runs every case on both ranks; each test reads its case.
For Llama (4 heads, 2 kv heads; `tp_plan="auto"`: q/k/v colwise, o rowwise) each rank's storage holds 1 kv head.
Jamba's own plan (`"auto"`) shards only its experts up to transformers 5.24: attention runs whole on every rank, and
both upstream's DynamicCache and the flexible cache hold both kv heads there; from 5.25 it shards the attention
projections instead (`JambaConfig.base_model_tp_plan`), and each rank holds 1, as with our plan that shards them.
Its Mamba layers are in no plan: every rank holds their full states.
Tokens are compared with a single-process run of upstream's model with DynamicCache on the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import JambaConfig

from tests.helpers import run_on_two_ranks
from tests.model_cases import JAMBA, LLAMA

TIMEOUT_S = 300
# Jamba's attention projections, sharded as Llama's are (keys name module paths of the causal-LM model).
JAMBA_ATTENTION_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
}
# kv heads per rank of Jamba's attention layer under its own plan: 1 where the plan shards `k_proj` (transformers
# 5.25), 2 where it runs attention whole (5.24).
JAMBA_AUTO_HEADS = 1 if JambaConfig.base_model_tp_plan.get("layers.*.self_attn.k_proj") == "colwise" else 2
# (case name, model case, tp_plan, kv heads of each layer's storage per rank; None: a Mamba layer)
CASES = [
    (f"{model.name}-{plan_name}-{attn}", model, plan, heads, attn)
    for model, plan_name, plan, heads in (
        (LLAMA, "auto", "auto", [1, 1]),
        (JAMBA, "auto", "auto", [None, JAMBA_AUTO_HEADS]),
        (JAMBA, "attention", JAMBA_ATTENTION_PLAN, [None, 1]),
    )
    for attn in ("eager", "sdpa")
]
# Calls of one stream on one model: batches and prompts of different shapes, on one storage.
CALLS = [
    {"ids": [[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], "max_new_tokens": 6},
    {"ids": [[21, 22, 23]], "max_new_tokens": 4},
    {"ids": [[31, 32, 33, 34], [0, 41, 42, 43], [51, 52, 53, 54]], "max_new_tokens": 5},
]


def _inputs(call: dict) -> dict:
    input_ids = torch.tensor(call["ids"])
    return {"input_ids": input_ids, "attention_mask": (input_ids != 0).long()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Save the models, run every case under torchrun once; returns (each rank's results, reference tokens)."""
    root = tmp_path_factory.mktemp("tensor_parallel")
    jobs, reference = [], {}
    for name, case, plan, _, attn in CASES:
        folder = root / case.name
        upstream, _ = case.build(attn)
        if not folder.exists():
            upstream.save_pretrained(folder)
        reference[name] = [
            upstream.generate(**_inputs(call), max_new_tokens=call["max_new_tokens"], do_sample=False).tolist()
            for call in CALLS
        ]
        calls = [
            {"inputs": {k: v.tolist() for k, v in _inputs(c).items()}, "max_new_tokens": c["max_new_tokens"]}
            for c in CALLS
        ]
        jobs.append(
            {"name": name, "model": case.name, "folder": str(folder), "tp_plan": plan, "attn": attn, "calls": calls}
        )
    (root / "jobs.json").write_text(json.dumps(jobs))
    ranks = run_on_two_ranks(Path(__file__).parent / "tensor_parallel_child.py", root, timeout=TIMEOUT_S)
    return ranks, reference


@pytest.mark.parametrize(("name", "heads"), [pytest.param(c[0], c[3], id=c[0]) for c in CASES])
def test_tensor_parallel_flexible_tokens_equal_a_single_process_dynamic_cache_and_each_rank_holds_its_heads(
    ranks, name, heads
):
    results, reference = ranks
    for rank, by_case in enumerate(results):
        result = by_case[name]
        assert "error" not in result, f"rank {rank}:\n{result.get('error')}"
        assert result["tokens"] == reference[name], f"rank {rank}"
        assert result["dynamic_cache_tokens"] == reference[name][-1]  # upstream under TP, the same tokens
        assert result["storage_heads"] == heads, f"rank {rank}"
        # What upstream's DynamicCache holds on this rank for the same call: the same heads, never more.
        assert result["dynamic_cache_heads"] == heads, f"rank {rank}"
        assert result["num_allocations"] == 2  # the first call's storage, grown once for the third call's batch
    assert results[0][name]["held_nbytes"] == results[1][name]["held_nbytes"]
