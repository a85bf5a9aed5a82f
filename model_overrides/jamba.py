"""Jamba: no module changes; the override only adds `cache_implementation="flexible_static"` to generate.

Upstream's Jamba (transformers==5.24.0 and 5.25.0) reaches its cache only through public `Cache` methods:
- `JambaAttention` calls `cache.update(...)`; `JambaModel` takes positions from `cache.get_seq_length()` and builds
  the causal mask from `cache.get_mask_sizes(...)`. Layer 0 of a Jamba config may be a Mamba layer: 5.24's `Cache`
  answers both from the first attention layer (`cache.is_linear`); 5.25's `get_seq_length` asks layer 0 itself, and
  our caches answer it from the first attention layer too (`linear_attention.length_layer_idx`).
- `JambaMambaMixer` calls `cache.get_conv_state`, `get_recurrent_state`, `update_conv_state`,
  `update_recurrent_state` and `is_recording_past` (in 5.25 through the module-level `causal_conv1d_forward` and
  `mamba_scan_forward`, which also call `increase_count` and `get_recurrent_states_to_keep`). While decoding it writes
  the conv state in place (`causal_conv1d_update` calls `copy_` on the tensor it is given); the recurrent state is
  written in place too in 5.24 (`selective_state_update`), and in 5.25 updated on a copy that is handed back through
  `update_recurrent_state`.

`FlexibleStaticCache` answers all of these for the live batch, and its conv and recurrent getters return views of
`[max_batch_size, ...]` storage, so those in-place writes land in the cache. So `JambaMambaMixer`, `JambaAttention`
and `JambaModel` stay upstream's.
"""

from transformers import GenerationMixin
from transformers.models.jamba.modeling_jamba import JambaForCausalLM

from transformers_flexcache.models.modeling import FlexModelMixin


class FlexJambaForCausalLM(FlexModelMixin, JambaForCausalLM, GenerationMixin):
    """`JambaForCausalLM` whose generate accepts `cache_implementation="flexible_static"`."""


FLEX_MODEL_CLASSES = [FlexJambaForCausalLM]
