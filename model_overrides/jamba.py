"""Jamba: no module changes; the override only adds `cache_implementation="flexible_static"` to generate.

Upstream's Jamba (transformers==5.24.0) reaches its cache only through public `Cache` methods:
- `JambaAttention` calls `cache.update(...)`; `JambaModel` takes positions from `cache.get_seq_length()` and builds
  the causal mask from `cache.get_mask_sizes(...)` (both find the first attention layer through `cache.is_linear`).
- `JambaMambaMixer` calls `cache.get_conv_state`, `get_recurrent_state`, `update_conv_state`,
  `update_recurrent_state` and `is_recording_past`. While decoding it writes the returned states in place
  (`causal_conv1d_update` and `selective_state_update` call `copy_` on them).

`FlexibleStaticCache` answers all of these for the live batch, and its conv and recurrent getters return views of
`[max_batch_size, ...]` storage, so those in-place writes land in the cache. So `JambaMambaMixer`, `JambaAttention`
and `JambaModel` stay upstream's.
"""

from transformers import GenerationMixin
from transformers.models.jamba.modeling_jamba import JambaForCausalLM

from transformers_flexcache.modeling import FlexModelMixin


class FlexJambaForCausalLM(FlexModelMixin, JambaForCausalLM, GenerationMixin):
    """`JambaForCausalLM` whose generate accepts `cache_implementation="flexible_static"`."""


FLEX_MODEL_CLASSES = [FlexJambaForCausalLM]
