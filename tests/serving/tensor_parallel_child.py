"""One rank of `tests/serving/test_engine_tensor_parallel.py`, started by `torchrun --nproc-per-node 2` (gloo on CPU).

Usage: `torchrun --nproc-per-node 2 --standalone tests/serving/tensor_parallel_child.py ROOT`, from the repository
root. ROOT holds `job.json` (the model folder, the engine's capacities, the requests) and receives `rank<r>.json`.
Rank 0 runs the engine's scheduler and takes the requests (from two threads, as a server would); rank 1 follows it
step for step (`Engine.follow`). Both load the model with transformers' own `tp_plan="auto"`.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers.distributed import DistributedConfig

from model_overrides.llama import FlexLlamaForCausalLM
from transformers_flexcache.serving import Engine

TIMEOUT_S = 120


def lead(engine: Engine, requests: list[dict]) -> list:
    handles = [None] * len(requests)

    def submit(indices):
        for index in indices:
            request = requests[index]
            inputs = {name: torch.tensor(value) for name, value in request["inputs"].items()}
            handles[index] = engine.submit(**inputs, seed=request["seed"], **request["kwargs"])
            time.sleep(0.02)  # later requests join a running batch

    threads = [threading.Thread(target=submit, args=(range(start, len(requests), 2),)) for start in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    return [handle.result(timeout=TIMEOUT_S).tolist() for handle in handles]


def main() -> None:
    torch.set_num_threads(1)
    root = Path(sys.argv[1])
    job = json.loads((root / "job.json").read_text())
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    result: dict = {}
    try:
        model = FlexLlamaForCausalLM.from_pretrained(
            job["folder"], distributed_config=DistributedConfig(tp_plan="auto"), attn_implementation="sdpa"
        ).eval()
        engine = Engine(model, cache_config=job["cache_config"])
        result["storage_heads"] = [spec.num_heads for spec in engine.cache.layer_specs]
        result["nbytes"] = engine.nbytes
        if rank == 0:
            result["tokens"] = lead(engine, job["requests"])
            result["stats"] = dict(engine.stats)
            engine.close(drain=True, timeout=TIMEOUT_S)
        else:
            engine.follow(timeout=TIMEOUT_S)
            result["stats"] = dict(engine.stats)
    except Exception:  # reported to the test, which fails with it
        result["error"] = traceback.format_exc()[-3000:]
    (root / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
