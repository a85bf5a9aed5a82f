"""Llama: no module changes; the override only adds `cache_implementation="flexible_static"` to generate.

Upstream's Llama (transformers==5.24.0) reaches its cache only through `cache.update(...)`,
`cache.get_seq_length()` (positions) and `cache.get_mask_sizes(...)` (causal mask), all of which
`FlexibleStaticCache` answers for the live batch and length. So `LlamaAttention` and `LlamaModel` stay upstream's.
"""

from transformers import GenerationMixin
from transformers.models.llama.modeling_llama import LlamaForCausalLM

from transformers_flexcache.models.modeling import FlexModelMixin


class FlexLlamaForCausalLM(FlexModelMixin, LlamaForCausalLM, GenerationMixin):
    """`LlamaForCausalLM` whose generate accepts `cache_implementation="flexible_static"`."""


FLEX_MODEL_CLASSES = [FlexLlamaForCausalLM]
