"""Linear-attention (Mamba) storage of one layer: conv and recurrent states in `[B_max, ...]`, allocated once.

Shape legend: `B` live batch, `B_max` rows of storage, `C` conv channels, `K` conv kernel size, `N` recurrent (SSM)
state size, `S` new tokens.

Design decisions:
- The conv state `[B_max, C, K]` and the recurrent state `[B_max, C, N]` are allocated when the cache is built, with
  shapes read from the config as the model reads them (`linear_attention_shapes`): upstream's `LinearAttentionLayer`
  takes them from the first update, at the call's batch, which cannot be planned up front.
- `get_conv_state`/`get_recurrent_state` hand out views `[:B]`: the model updates them in place while decoding
  (Jamba's `causal_conv1d_update` and `selective_state_update` call `copy_` on the tensors they are given), so its
  writes land in the storage.
- `reset` only clears `has_previous_state`: the next prefill overwrites rows `[:B]` whole before anything reads them.
- In padded mode (`FlexiblePaddedLinearAttentionLayer`) they are compileable: every call has the same batch, and the
  states have no length axis.
- Models reach the states through the cache's accessors (`LinearAttentionStates`, a base of `FlexibleStaticCache`),
  named as upstream's `Cache` names them: `get_conv_state`, `update_conv_state`, `get_recurrent_state`,
  `update_recurrent_state`.
- The length lives in the attention layers, on every supported transformers (5.24 and 5.25). transformers 5.25 gave
  linear-attention layers a token count of their own (`cumulative_length_linear`, advanced by `update_conv_state` and
  by `increase_count`, which its Jamba mixer calls at every decode step) and made `Cache.get_seq_length()` read layer
  0 whatever its kind; 5.24's mixer never reports a decode step, and its `Cache.get_seq_length` answered a
  linear-attention layer from the first attention layer. Our caches keep 5.24's answer (`length_layer_idx`), which is
  what 5.25's count holds in every call we serve (no past recording, no crop), as an int or a 0-d tensor as the
  policy's attention layers keep it: so `increase_count` has nothing to do, and a linear-attention layer has no
  `get_seq_length` of its own (it refuses, naming the cache's).
- `update_recurrent_state` also takes a list of states (transformers 5.25 passes the last steps' states when the
  past is recorded): the last one is the state. Past recording is refused, so no history is kept.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin
from transformers.configuration_utils import PreTrainedConfig

from .layers import LayerSpec

# Config attributes that size a linear-attention layer's states, named as Jamba names them.
LINEAR_ATTENTION_CONFIG_NAMES = ("hidden_size", "mamba_expand", "mamba_d_conv", "mamba_d_state")


def linear_attention_shapes(config: PreTrainedConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """Per-row shapes `((C, K), (C, N))` of a linear-attention layer's conv state and recurrent state.

    Read as `JambaMambaMixer.__init__` reads them (transformers==5.24.0 and 5.25.0): `C = mamba_expand * hidden_size`,
    `K = mamba_d_conv`, `N = mamba_d_state`. A config that names them otherwise is refused rather than guessed; every
    update also checks the shapes it receives against the storage.

    Raises:
        ValueError: the config lacks one of `LINEAR_ATTENTION_CONFIG_NAMES`.
    """
    text_config = config.get_text_config(decoder=True)
    missing = [name for name in LINEAR_ATTENTION_CONFIG_NAMES if getattr(text_config, name, None) is None]
    if missing:
        raise ValueError(
            f"FlexibleStaticCache cannot size the linear-attention states of {type(config).__name__}: it reads "
            f"{list(LINEAR_ATTENTION_CONFIG_NAMES)} (as Jamba's Mamba mixer does), and {missing} are missing"
        )
    num_channels = text_config.mamba_expand * text_config.hidden_size
    return (num_channels, text_config.mamba_d_conv), (num_channels, text_config.mamba_d_state)


def recurrent_dtype(dtype: torch.dtype) -> torch.dtype:
    # Upstream's Mamba scan multiplies by float32 `A`, so the recurrent state it caches has the promoted dtype
    # (float32 for a bfloat16 model). Storing it in the model's dtype would round it and change the outputs.
    return torch.promote_types(dtype, torch.float32)


def is_linear_attention_layer(layer) -> bool:
    """Whether `layer` holds linear-attention states and no keys and values (upstream's `Cache.is_linear`)."""
    return isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, CacheLayerMixin)


def length_layer_idx(layers: list, layer_idx: int) -> int:
    """The layer whose length answers `get_seq_length(layer_idx)`: `layer_idx`, or the first attention layer when
    `layer_idx` is a linear-attention one (as upstream's `Cache.get_mask_sizes` finds it, and its `get_seq_length` did
    up to transformers 5.24). Our caches always hold an attention layer (they refuse a config without one)."""
    if not 0 <= layer_idx < len(layers) or not is_linear_attention_layer(layers[layer_idx]):
        return layer_idx
    return next(idx for idx, layer in enumerate(layers) if not is_linear_attention_layer(layer))


def refuse_layer_seq_length(layer) -> None:
    # A linear-attention layer of ours keeps no token count: the cache answers from its attention layers.
    raise ValueError(
        f"{type(layer).__name__} has no length axis and keeps no token count; ask the cache: "
        "cache.get_seq_length(layer_idx) answers a linear-attention layer from the first attention layer"
    )


def last_recurrent_state(recurrent_states: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """The state to keep: `recurrent_states` itself, or the last of a list of the last steps' states (what
    transformers 5.25's `update_recurrent_state` may be given; without past recording the others are not kept)."""
    # recurrent_states: [B, C, N] or a list of them -> [B, C, N]
    if isinstance(recurrent_states, torch.Tensor):
        return recurrent_states
    return recurrent_states[-1]


class FlexibleLinearAttentionLayer(LinearAttentionCacheLayerMixin):
    """Conv and recurrent (SSM) states of one linear-attention (Mamba) layer in `[B_max, ...]` storage.

    Built by `FlexibleStaticCache`; models use the cache's `get_conv_state`, `update_conv_state`,
    `get_recurrent_state` and `update_recurrent_state`, not this class.
    """

    is_compileable = False  # the live batch is a Python int, as for the attention layers
    is_croppable = False  # a recurrent state cannot be rolled back
    is_sliding = False

    def __init__(self, *, spec: LayerSpec, max_batch_size: int, max_cache_len: int | None = None):
        # LinearAttentionCacheLayerMixin.__init__ would set `conv_states`/`recurrent_states` dicts filled lazily at
        # the call's batch; here they are read-only live views of storage allocated now. `max_cache_len` is accepted
        # so that every layer is built alike; these states have no length axis.
        self.max_batch_size = max_batch_size
        self.device = torch.device(spec.device)
        self._conv_storage = torch.zeros(  # [B_max, C, K]
            max_batch_size, *spec.conv_shape, dtype=spec.dtype, device=spec.device
        )
        self._recurrent_storage = torch.zeros(  # [B_max, C, N]
            max_batch_size, *spec.recurrent_shape, dtype=spec.recurrent_dtype or spec.dtype, device=spec.device
        )
        self.number_of_states = 1
        self.conv_kernel_size = {0: spec.conv_shape[-1]}
        self.has_previous_state = {0: False}  # read by upstream's `Cache.has_previous_state`
        self.record_past = False  # read by upstream's `Cache.is_recording_past`
        self.batch_size = 0  # live batch: rows written by the current call

    def renewed(self) -> FlexibleLinearAttentionLayer:
        """A new layer object over the same storage, with counters of its own (set back by `reset`)."""
        layer = copy.copy(self)
        layer.has_previous_state = dict(self.has_previous_state)
        return layer

    def storages(self) -> list[torch.Tensor]:
        return [self._conv_storage, self._recurrent_storage]

    # Read-only live views, for upstream code that reads `layer.conv_states[0]` / `layer.recurrent_states[0]`.
    @property
    def conv_states(self) -> dict[int, torch.Tensor]:  # {0: [B, C, K]}
        return {0: self._conv_storage[: self.batch_size]}

    @property
    def recurrent_states(self) -> dict[int, torch.Tensor]:  # {0: [B, C, N]}
        return {0: self._recurrent_storage[: self.batch_size]}

    @property
    def dtype(self) -> torch.dtype:
        return self._conv_storage.dtype

    @property
    def conv_shape(self) -> tuple[int, ...]:
        return tuple(self._conv_storage.shape[1:])

    @property
    def recurrent_shape(self) -> tuple[int, ...]:
        return tuple(self._recurrent_storage.shape[1:])

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0, **kwargs) -> None:
        # Storage is allocated in __init__; nothing is left to initialize lazily.
        return None

    def get_seq_length(self) -> int:
        refuse_layer_seq_length(self)

    def increase_count(self, state_idx: int = 0) -> None:
        # transformers 5.25's mixer reports each decode step here; the attention layers count it (module docstring).
        return None

    def get_conv_state(self) -> torch.Tensor | None:  # -> [B, C, K], or None before this call's prefill
        return self._conv_storage[: self.batch_size] if self.has_previous_state[0] else None

    def get_recurrent_state(self) -> torch.Tensor | None:  # -> [B, C, N], or None before this call's prefill
        return self._recurrent_storage[: self.batch_size] if self.has_previous_state[0] else None

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        # conv_states: [B, C, S] -> [B, C, max(S, K)] on the prefill, [B, C, K + S] after it
        batch_size, kernel_size = conv_states.shape[0], self.conv_kernel_size[0]
        if not self.has_previous_state[0]:
            # Prefill, as upstream's LinearAttentionLayer: left-pad to the kernel. The K-window written below covers
            # rows [:B] whole, and the recurrent rows are cleared, so nothing of an earlier call stays reachable.
            full_conv_states = conv_states
            if conv_states.shape[-1] < kernel_size:
                full_conv_states = torch.nn.functional.pad(conv_states, (kernel_size - conv_states.shape[-1], 0))
            self._recurrent_storage[:batch_size].zero_()
            self.batch_size = batch_size
            self.has_previous_state[0] = True
        else:
            full_conv_states = torch.cat([self._conv_storage[:batch_size], conv_states], dim=-1)
        self._conv_storage[:batch_size].copy_(full_conv_states[..., -kernel_size:])
        return full_conv_states

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        # recurrent_states: [B, C, N] -> [B, C, N] view of the storage
        batch_size = recurrent_states.shape[0]
        live = self._recurrent_storage[:batch_size]
        live.copy_(recurrent_states)
        self.batch_size = batch_size
        return live

    def reset(self) -> None:
        # No zeroing: the next prefill overwrites rows [:B] whole before get_*_state can return them.
        self.batch_size = 0
        self.has_previous_state[0] = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.batch_size == 0:
            return
        beam_idx = beam_idx.to(self.device)
        for storage in (self._conv_storage, self._recurrent_storage):
            live = storage[: self.batch_size]
            # index_select makes a new tensor first, so copying it back over its own source is safe.
            live.copy_(live.index_select(0, beam_idx))

    def activate_past_recording(self, **kwargs):
        # kwargs: transformers 5.25 passes `recurrent_states_to_keep`.
        raise NotImplementedError(
            "past recording (assisted generation, rollback) is not supported by FlexibleStaticCache's linear-attention "
            "layers: their states have a fixed size"
        )

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("linear-attention states cannot be cropped: a recurrent state cannot be rolled back")

    def offload(self):
        raise NotImplementedError("offloading is not supported by FlexibleStaticCache")

    def prefetch(self):
        raise NotImplementedError("offloading is not supported by FlexibleStaticCache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("batch_repeat_interleave is only defined for DynamicCache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("batch_select_indices is only defined for DynamicCache")

    def grow(self, *, max_batch_size: int, max_cache_len: int | None = None) -> None:
        """Reallocate to `max_batch_size` rows (at least the current), keeping the live rows."""
        new_conv = self._conv_storage.new_zeros(max_batch_size, *self.conv_shape)
        new_recurrent = self._recurrent_storage.new_zeros(max_batch_size, *self.recurrent_shape)
        new_conv[: self.batch_size].copy_(self._conv_storage[: self.batch_size])
        new_recurrent[: self.batch_size].copy_(self._recurrent_storage[: self.batch_size])
        self._conv_storage, self._recurrent_storage = new_conv, new_recurrent
        self.max_batch_size = max_batch_size


class FlexiblePaddedLinearAttentionLayer(FlexibleLinearAttentionLayer):
    """The fixed-shape ("padded") mode of `FlexibleLinearAttentionLayer`, for `torch.compile` and CUDA graphs.

    In padded mode `generate` runs every call at the same batch, so the live batch (a Python int) is the same at every
    step of every call and a compiled decode step guards on a constant, as upstream's `LinearAttentionLayer`
    (compileable, static addresses) does. Being compileable also matters in eager: upstream drops a decode step's
    causal mask under SDPA unless the cache is compileable (`create_causal_mask`, transformers==5.24.0 and 5.25.0),
    and the padded attention layers of a hybrid model need that mask to hide the positions not written yet.
    """

    is_compileable = True

    def static_tensors(self) -> list[torch.Tensor]:
        """The conv and recurrent storage, which a compiled step writes in place (see `FlexibleStaticLayer.
        static_tensors`)."""
        return [self._conv_storage, self._recurrent_storage]


# The linear-attention layer class of each `shape_policy`.
# Bucketed mode runs each call at a bucket of rows, fixed within the call: the padded layer serves it (a compiled step
# guards on the live batch, one graph per rows bucket), and the states have no length axis to bucket.
LINEAR_ATTENTION_LAYER_CLASSES = {
    "exact": FlexibleLinearAttentionLayer,
    "padded": FlexiblePaddedLinearAttentionLayer,
    "bucketed": FlexiblePaddedLinearAttentionLayer,
}


class LinearAttentionStates:
    """The linear-attention (Mamba) state accessors of a cache that holds `FlexibleLinearAttentionLayer`s.

    A base of `FlexibleStaticCache`, which provides what these methods rely on: `_check_live()` (a stale cache
    raises), `_checked_layer(layer_idx, layer_class)` (the layer, checked to exist and be of that class) and
    `ensure_capacity(batch_size=..., length=...)` (room for the rows, per `on_overflow`).
    """

    def _linear_layer(self, layer_idx: int, state_idx: int) -> FlexibleLinearAttentionLayer:
        self._check_live()
        layer = self._checked_layer(layer_idx, FlexibleLinearAttentionLayer)
        if state_idx != 0:
            raise ValueError(f"state_idx={state_idx} is out of range: linear-attention layers hold one state (0)")
        return layer

    def _check_state_batch(self, layer: FlexibleLinearAttentionLayer, layer_idx: int, batch_size: int) -> None:
        if layer.batch_size > 0 and batch_size != layer.batch_size:
            raise ValueError(
                f"batch_size={batch_size} differs from batch_size={layer.batch_size} already cached in layer "
                f"{layer_idx}; call cache.reset() before a call with another batch"
            )

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """Conv state of linear-attention layer `layer_idx` for the live batch.

        Args:
            layer_idx (`int`): a linear-attention decoder layer.
            state_idx (`int`, *optional*, defaults to 0): which state; these layers hold one.

        Returns:
            `torch.Tensor | None`: a view `[B, C, K]` into the storage (no copy), so that the model's in-place decode
            update (`conv_state.copy_(...)`) lands in the cache; None from `reset()` until this call's first
            `update_conv_state`, as upstream.

        Raises:
            ValueError: `layer_idx` is out of range or not a linear-attention layer, or `state_idx` is not 0.
        """
        return self._linear_layer(layer_idx, state_idx).get_conv_state()

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Write the conv state of linear-attention layer `layer_idx`: the last `K` positions of what is returned.

        Args:
            conv_states (`torch.Tensor`): `[B, C, S]` new conv inputs.
            layer_idx (`int`): a linear-attention decoder layer.
            state_idx (`int`, *optional*, defaults to 0): which state; these layers hold one.
            conv_kernel_size (`int`, *optional*): the model's kernel size, checked against the storage's `K`.

        Returns:
            `torch.Tensor`: as upstream's `LinearAttentionLayer.update_conv_state`: on the first update since
            `reset()` (the prefill) `conv_states` left-padded to at least `K` positions, `[B, C, max(S, K)]`;
            afterwards the cached state followed by `conv_states`, `[B, C, K + S]`.

        Raises:
            ValueError: as for `get_conv_state`; `C` or `K` differs from the storage; the batch differs from the one
                written since the last `reset()`; or `B` exceeds `max_batch_size` with `on_overflow="error"`.
                Nothing is written in any of these cases.
        """
        layer = self._linear_layer(layer_idx, state_idx)
        kernel_size = layer.conv_kernel_size[0]
        if conv_kernel_size is not None and conv_kernel_size != kernel_size:
            raise ValueError(
                f"conv_kernel_size={conv_kernel_size} differs from the kernel size {kernel_size} that layer "
                f"{layer_idx} was allocated with (the config's `mamba_d_conv`)"
            )
        if tuple(conv_states.shape[1:-1]) != layer.conv_shape[:-1]:
            raise ValueError(
                f"conv_states of shape {tuple(conv_states.shape)} do not fit layer {layer_idx}, allocated for "
                f"[batch, {layer.conv_shape[0]}, length] from the config"
            )
        self._check_state_batch(layer, layer_idx, conv_states.shape[0])
        self.ensure_capacity(batch_size=conv_states.shape[0], length=0)
        return layer.update_conv_state(conv_states)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """Recurrent (SSM) state of linear-attention layer `layer_idx` for the live batch.

        Args:
            layer_idx (`int`): a linear-attention decoder layer.
            state_idx (`int`, *optional*, defaults to 0): which state; these layers hold one.

        Returns:
            `torch.Tensor | None`: a view `[B, C, N]` into the storage (no copy), so that the model's in-place decode
            update (`state.copy_(...)`) lands in the cache; None from `reset()` until this call's first
            `update_conv_state`, as upstream.

        Raises:
            ValueError: `layer_idx` is out of range or not a linear-attention layer, or `state_idx` is not 0.
        """
        return self._linear_layer(layer_idx, state_idx).get_recurrent_state()

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        """Write the recurrent (SSM) state of linear-attention layer `layer_idx`.

        Args:
            recurrent_states (`torch.Tensor` or `list[torch.Tensor]`): `[B, C, N]` the state after this call's tokens,
                or a list of the last steps' states, of which the last is kept (`last_recurrent_state`).
            layer_idx (`int`): a linear-attention decoder layer.
            state_idx (`int`, *optional*, defaults to 0): which state; these layers hold one.

        Returns:
            `torch.Tensor`: a view `[B, C, N]` into the storage, holding `recurrent_states`.

        Raises:
            ValueError: as for `get_recurrent_state`; `(C, N)` differs from the storage; the batch differs from the
                one written since the last `reset()`; or `B` exceeds `max_batch_size` with `on_overflow="error"`.
                Nothing is written in any of these cases.
        """
        layer = self._linear_layer(layer_idx, state_idx)
        recurrent_states = last_recurrent_state(recurrent_states)
        if tuple(recurrent_states.shape[1:]) != layer.recurrent_shape:
            raise ValueError(
                f"recurrent_states of shape {tuple(recurrent_states.shape)} do not fit layer {layer_idx}, allocated "
                f"for [batch, {', '.join(map(str, layer.recurrent_shape))}] from the config"
            )
        self._check_state_batch(layer, layer_idx, recurrent_states.shape[0])
        self.ensure_capacity(batch_size=recurrent_states.shape[0], length=0)
        return layer.update_recurrent_state(recurrent_states)
