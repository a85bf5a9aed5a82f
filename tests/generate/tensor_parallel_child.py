"""One rank of `tests/generate/test_tensor_parallel.py`, started by `torchrun --nproc-per-node 2` (gloo on CPU).

Usage: `torchrun --nproc-per-node 2 --standalone tests/generate/tensor_parallel_child.py ROOT`, from the repository root. ROOT
holds `jobs.json` (written by the test: model folders, plans, attention implementations, calls) and receives
`rank<r>.json`: per case, the tokens of every flexible call, the kv heads and bytes of each layer's storage, and the
kv heads that upstream's DynamicCache holds on this rank for the same call.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers.distributed import DistributedConfig

import transformers_flexcache
from model_overrides.jamba import FlexJambaForCausalLM
from model_overrides.llama import FlexLlamaForCausalLM

MODEL_CLASSES = {"llama": FlexLlamaForCausalLM, "jamba": FlexJambaForCausalLM}


def dynamic_cache_heads(cache) -> list[int | None]:
    """kv heads of each layer of upstream's cache (None for a layer without keys: Mamba)."""
    heads = []
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        heads.append(int(keys.shape[1]) if isinstance(keys, torch.Tensor) and keys.dim() == 4 else None)
    return heads


def run_case(case: dict) -> dict:
    model = (
        MODEL_CLASSES[case["model"]]
        .from_pretrained(
            case["folder"],
            distributed_config=DistributedConfig(tp_plan=case["tp_plan"]),
            attn_implementation=case["attn"],
        )
        .eval()
    )
    tokens, flexible = [], None
    for call in case["calls"]:
        inputs = {name: torch.tensor(value) for name, value in call["inputs"].items()}
        out = model.generate(
            **inputs,
            cache_implementation="flexible_static",
            max_new_tokens=call["max_new_tokens"],
            do_sample=False,
            return_dict_in_generate=True,
        )
        tokens.append(out.sequences.tolist())
        flexible = out.cache
    upstream = model.generate(
        **inputs, max_new_tokens=call["max_new_tokens"], do_sample=False, return_dict_in_generate=True
    )
    return {
        "tokens": tokens,
        "num_allocations": flexible.num_allocations,
        "storage_heads": [
            spec.num_heads if spec.layer_type != "linear_attention" else None for spec in flexible.layer_specs
        ],
        "held_nbytes": transformers_flexcache.held_nbytes(model),
        "dynamic_cache_heads": dynamic_cache_heads(upstream.cache),
        "dynamic_cache_tokens": upstream.sequences.tolist(),
    }


def main() -> None:
    torch.set_num_threads(1)
    root = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    results = {}
    for case in json.loads((root / "jobs.json").read_text()):
        try:
            results[case["name"]] = run_case(case)
        except Exception:  # reported to the test, which fails with it
            results[case["name"]] = {"error": traceback.format_exc()[-3000:]}
    (root / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
