"""The engine on a tensor-parallel model: `torchrun --nproc-per-node 2`, gloo on CPU, transformers' own `tp_plan`.

Rank 0 takes the requests and decides every step (admissions, cancellations, the end); rank 1 follows it step for
step on its shard, so that both ranks run the same forwards and their collectives meet. Llama's 2 kv heads put 1 in
each rank's seats. Every request's tokens equal upstream's DynamicCache on the request alone, in one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers import own_copy, run_on_two_ranks
from tests.model_cases import LLAMA

TIMEOUT_S = 300
CACHE_CONFIG = {"max_batch_size": 4, "max_cache_len": 32}


def test_engine_on_two_tensor_parallel_ranks_serves_every_request_as_generate_alone(tmp_path):
    upstream, _ = LLAMA.build("sdpa")
    folder = tmp_path / "llama"
    upstream.save_pretrained(folder)
    generator = torch.Generator().manual_seed(21)
    methods = [{}, {"num_beams": 2}, {"do_sample": True, "top_k": 20}, {"min_new_tokens": 5}, {"num_beams": 3}, {}]
    requests, expected = [], []
    for index, method in enumerate(methods):
        inputs = LLAMA.make_inputs(1, 3 + 2 * index, generator)
        kwargs = {"max_new_tokens": 5 + index, **method}
        torch.manual_seed(500 + index)
        expected.append(upstream.generate(**own_copy(inputs), **kwargs).tolist())
        requests.append({"inputs": {k: v.tolist() for k, v in inputs.items()}, "kwargs": kwargs, "seed": 500 + index})
    job = {"folder": str(folder), "cache_config": CACHE_CONFIG, "requests": requests}
    (tmp_path / "job.json").write_text(json.dumps(job))
    ranks = run_on_two_ranks(Path(__file__).parent / "tensor_parallel_child.py", tmp_path, timeout=TIMEOUT_S)
    for rank, found in enumerate(ranks):
        assert "error" not in found, f"rank {rank}:\n{found.get('error')}"
        assert found["storage_heads"] == [1, 1]  # each rank's seats hold its one kv head of two
    assert ranks[0]["tokens"] == expected
    assert ranks[0]["nbytes"] == ranks[1]["nbytes"]
    # The follower ran exactly the leader's steps.
    assert ranks[1]["stats"]["decode_steps"] == ranks[0]["stats"]["decode_steps"] > 0
    assert ranks[1]["stats"]["finished"] == ranks[0]["stats"]["finished"] == len(requests)
