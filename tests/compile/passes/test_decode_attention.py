"""`compile.passes.decode_attention.OneQueryAttention`: a compiled decode step's attention (one query position) as inductor's loops.

The oracle is eager SDPA on the same inputs; the profile tells whether torch's flash attention kernel still runs.
Generate-level equality with DynamicCache under `compile_config_for_cpu()` (which runs the pass) is tested with the
compiled paths (`tests/compile/test_config.py`, `tests/generate/test_bucketed.py`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_within_float_noise
from transformers_flexcache import compile_config_for_cpu
from transformers_flexcache.compile.config import compile_settings
from transformers_flexcache.compile.passes import OneQueryAttention, OneRowLinears

FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def attention(query, key, value, mask, scale):
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return output.transpose(1, 2).reshape(query.shape[0], query.shape[2], -1)


def exact_attention(query, key, value, mask, scale):
    """`attention` in float64 on the same inputs: the exact reference of the float32 outputs' noise."""
    mask = mask.double() if mask is not None and mask.is_floating_point() else mask
    return attention(query.double(), key.double(), value.double(), mask, scale)


def compiled_attention(inputs, decode_attention: str):
    """The compiled attention's output and whether the flash kernel ran in it."""
    config = compile_config_for_cpu(decode_attention=decode_attention)
    with torch.no_grad(), compile_settings(config):
        compiled = torch.compile(attention, backend="inductor", dynamic=False, options=config.options)
        compiled(*inputs)
        with torch.profiler.profile() as profile:
            output = compiled(*inputs)
    return output, FLASH in {event.key for event in profile.key_averages()}


def one_query_inputs(rows=3, heads=4, positions=13, head_dim=16, mask="float", scale=None, queries=1):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(rows, heads, queries, head_dim, generator=generator)
    key, value = (torch.randn(rows, heads, positions, head_dim, generator=generator) for _ in range(2))
    hidden = torch.rand(rows, 1, queries, positions, generator=generator) < 0.3
    hidden[..., -1] = False  # every row attends somewhere
    masks = {
        "none": None,
        "bool": ~hidden,
        "float": torch.randn(rows, heads, queries, positions, generator=generator).masked_fill(hidden, float("-inf")),
        "float min": torch.zeros(rows, 1, queries, positions).masked_fill(hidden, torch.finfo(torch.float32).min),
    }
    return query, key, value, masks[mask], scale


@pytest.mark.parametrize(
    ("mask", "scale"),
    [("none", None), ("bool", None), ("float", None), ("float min", None), ("float", 1.0), ("bool", 0.3)],
)
def test_one_query_attention_runs_without_the_flash_kernel_with_eager_sdpa_outputs(mask, scale):
    inputs = one_query_inputs(mask=mask, scale=scale)
    output, flash = compiled_attention(inputs, "inductor")
    assert not flash
    assert_within_float_noise(output, attention(*inputs), exact_attention(*inputs))
    library, flash = compiled_attention(inputs, "library")
    assert flash
    assert_within_float_noise(output, library, exact_attention(*inputs))


def test_a_row_hidden_entirely_by_the_mask_gives_zeros_as_the_kernel_does():
    query, key, value, mask, scale = one_query_inputs(mask="float")
    mask[1] = float("-inf")
    output, flash = compiled_attention((query, key, value, mask, scale), "inductor")
    library, _ = compiled_attention((query, key, value, mask, scale), "library")
    assert not flash and torch.equal(output[1], torch.zeros_like(output[1]))
    exact = exact_attention(query, key, value, mask, scale).nan_to_num()  # eager SDPA's all-hidden row: NaN
    assert_within_float_noise(output, library, exact)


def test_several_query_positions_are_left_to_the_kernel():
    inputs = one_query_inputs(queries=3)
    output, flash = compiled_attention(inputs, "inductor")
    assert flash
    assert_within_float_noise(output, attention(*inputs), exact_attention(*inputs))


def test_configs_with_the_pass_compare_equal_and_it_keys_inductor_s_cache_apart():
    # Upstream's generate compiles again when the config compares unequal: a pass without equality recompiled every
    # call of Whisper's generate (which copies the generation config).
    assert compile_config_for_cpu() == compile_config_for_cpu()
    assert OneQueryAttention() in compile_config_for_cpu().options["post_grad_custom_post_pass"]
    assert (
        "post_grad_custom_post_pass"
        not in compile_config_for_cpu(
            linear_kernels="mkl", one_row_linears="library", int8_linears="library", decode_attention="library"
        ).options
    )
    assert OneQueryAttention().uuid() == OneQueryAttention().uuid() != OneRowLinears().uuid()


def test_unknown_decode_attention_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"decode_attention='flash' is not one of \('auto', 'inductor', 'library'\)"):
        compile_config_for_cpu(decode_attention="flash")
