"""Seat storage for the serving engine: `B_max` rows ("seats"), each with a length of its own.

Shape legend: `B_max` seats, `B` the step's span of seats (`[:B]`, live and free), `A` rows admitted in one step,
`H` kv heads, `S` new tokens, `P` the admission's (padded) prompt length, `L_max` decoder capacity, `W` the decode
step's attended decoder span, `E_max` encoder capacity, `E_W` its attended encoder span, `D` head dim.

Design decisions:
- The flexible caches of `containers.py` serve one `generate` call at a time: every row of a call has the same length.
  A seat cache serves requests that join and leave between two decoding steps, so each row keeps its own next write
  column (`columns`) and its own validity (`valid`: which columns its attention may read). Nothing is copied when rows
  come and go: a new request writes its own rows, a finished one only marks them free.
- The engine drives the cache one step at a time, in one of two modes:
  - admission (`begin_admission(rows, ...)`): a batch of new requests runs its prefill on rows `rows` (any seats).
    The cache then answers as an empty `DynamicCache` would (`get_seq_length` 0, mask sizes of the new tokens only,
    no linear-attention state yet), so the model builds its own masks and positions, exactly as for a `generate`
    call; `update` writes the new keys into the rows and returns them as they are.
  - decode (`begin_decode(span, ...)`): one new token for every seat in `[:B]`. `update` writes each row at its own
    column (one `index_put`), and returns views `[:B, :, :W]`; the engine passes the masks, built from `valid`
    (`self_attention_mask`, `cross_attention_mask`). `get_seq_length` returns each row's column as a `[B, 1]` tensor,
    so that models that count positions as `arange(S) + get_seq_length()` (the BART family, T5's relative bias with
    `FlexT5Attention.compute_bias`) count each row's own.
- Sliding-window layers keep all `L_max` columns: a window over per-row positions is a mask (`self_attention_mask`),
  not a ring buffer, so every row's window slides on its own.
- Free seats inside the span attend to their column 0 (always valid for them): a fully masked row would turn into NaN,
  and its outputs are thrown away anyway.
- Shapes, devices and dtypes are fixed at construction; `B`, `W` and `E_W` are the only shapes that change, so a
  compiled decode step sees one graph per (`B`, `W`, `E_W`), a bounded set under a bucketed or padded policy.

Models reach these caches only through `update`, `get_kv`, `cross_attention_kv`, `get_seq_length` and the
linear-attention accessors, as every flexible cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, EncoderDecoderCache, LinearAttentionCacheLayerMixin

from .layers import LayerSpec
from .linear_attention import last_recurrent_state, length_layer_idx, refuse_layer_seq_length

ADMISSION, DECODE = "admission", "decode"


class SeatSteps:
    """What the current step of a seat cache is: the mode, and the rows and spans it covers. Shared by the layers.

    Holds the per-seat state: `columns` `[B_max]` (the next column each row writes) and `valid` `[B_max, L]` (the
    columns each row attends to), on the device of the first layer.
    """

    def __init__(self, *, max_batch_size: int, max_len: int, device: torch.device):
        self.mode: str | None = None
        self.rows: torch.Tensor | None = None  # admission: [A] seat of each admitted row
        self.span = 0  # decode: B
        self.window = 0  # decode: W
        self.columns = torch.zeros(max_batch_size, dtype=torch.long, device=device)  # [B_max]
        self.valid = torch.zeros(max_batch_size, max_len, dtype=torch.bool, device=device)  # [B_max, L]
        self.valid[:, 0] = True  # free seats attend to column 0
        self.seat_index = torch.arange(max_batch_size, device=device)  # [B_max]
        self.devices = {torch.device(device)}  # of the layers (set by the cache)
        self._by_device: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`(rows, columns)` of this step on `device`: admission `([A], unused)`, decode `([B], [B])`."""
        return self._by_device[device]

    def start(self, mode: str, *, rows=None, span: int = 0, window: int = 0) -> None:
        # The index tensors of every layer's device are made here, before the forward: a compiled decode step then
        # only reads them.
        self.mode, self.rows, self.span, self.window = mode, rows, span, window
        if mode == ADMISSION:
            self._by_device = {device: (rows.to(device), self.columns) for device in self.devices}
        elif mode == DECODE:
            rows, columns = self.seat_index[:span], self.columns[:span]
            self._by_device = {device: (rows.to(device), columns.to(device)) for device in self.devices}
        else:
            self._by_device = {}

    def end(self) -> None:
        self.start(None)


def _not_in_a_step(what: str) -> ValueError:
    return ValueError(
        f"{what} is only answered during a step of the serving engine (a seat cache is driven by "
        "transformers_flexcache.serving.Engine); use FlexibleStaticCache for a generate call or a forward of your own"
    )


class _SeatLayerRefusals:
    """What a seat layer refuses, whatever its kind: rows move only between steps, through the engine."""

    def reorder_cache(self, beam_idx):
        raise _not_in_a_step("reorder_cache")

    def offload(self):
        raise NotImplementedError("offloading is not supported by a seat cache")

    def prefetch(self):
        raise NotImplementedError("offloading is not supported by a seat cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("batch_repeat_interleave is only defined for DynamicCache")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("batch_select_indices is only defined for DynamicCache")


class FlexibleSeatLayer(_SeatLayerRefusals, CacheLayerMixin):
    """Keys and values of one attention layer in `[B_max, H, L, D]` storage, each row with its own length."""

    is_compileable = True
    is_croppable = False
    supports_early_init = False

    def __init__(self, *, spec: LayerSpec, steps: SeatSteps, max_batch_size: int, max_len: int):
        # CacheLayerMixin.__init__ would set `keys`/`values` attributes; the storage is allocated here instead.
        self.steps = steps
        self.device = torch.device(spec.device)
        self.is_sliding = spec.sliding_window is not None  # read by upstream's `Cache.is_sliding`
        self.sliding_window = spec.sliding_window
        self.max_batch_size, self.max_cache_len = max_batch_size, max_len
        storage = {"dtype": spec.dtype, "device": spec.device}
        self._key_storage = torch.zeros(max_batch_size, spec.num_heads, max_len, spec.k_head_dim, **storage)
        self._value_storage = torch.zeros(max_batch_size, spec.num_heads, max_len, spec.v_head_dim, **storage)
        self.is_initialized = True

    def storages(self) -> list[torch.Tensor]:
        return [self._key_storage, self._value_storage]

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def get_kv(self, batch_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:  # -> 2 x [B, H, L, D]
        return self._key_storage[:batch_size, :, :length], self._value_storage[:batch_size, :, :length]

    def write_rows(self, rows: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # rows: [A], key_states: [A, H, S, D]: columns [0, S) of each row
        num_new = key_states.shape[-2]
        self._key_storage[rows, :, :num_new] = key_states
        self._value_storage[rows, :, :num_new] = value_states

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # admission: key_states [A, H, P, D] -> the same; decode: [B, H, 1, D] -> 2 x [B, H, W, D]
        steps = self.steps
        if steps.mode == ADMISSION:
            rows, _ = steps.on(self.device)
            self.write_rows(rows, key_states, value_states)
            return key_states, value_states
        if steps.mode != DECODE:
            raise _not_in_a_step("update")
        rows, columns = steps.on(self.device)
        # One index_put per tensor: row b writes its new token at its own column.
        self._key_storage[rows, :, columns] = key_states[:, :, 0]
        self._value_storage[rows, :, columns] = value_states[:, :, 0]
        return self.get_kv(steps.span, steps.window)

    def get_seq_length(self):
        steps = self.steps
        if steps.mode == DECODE:
            return steps.on(self.device)[1][:, None]  # [B, 1]: each row's own length before this step
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Admission: as an empty DynamicCache, the mask spans the new tokens. Decode: the engine passes the masks.
        return (self.steps.window if self.steps.mode == DECODE else query_length), 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        return None

    def copy_rows(self, destination: torch.Tensor, source: torch.Tensor, length: int) -> None:
        """Rows `destination` take the first `length` columns of rows `source` (beam reordering)."""
        destination, source = destination.to(self.device), source.to(self.device)
        for storage in self.storages():
            storage[destination, :, :length] = storage[source, :, :length]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a seat cache cannot be cropped")


class FlexibleSeatLinearAttentionLayer(_SeatLayerRefusals, LinearAttentionCacheLayerMixin):
    """Conv `[B_max, C, K]` and recurrent `[B_max, C, N]` states of one linear-attention (Mamba) layer, per seat."""

    is_compileable = True
    is_croppable = False
    is_sliding = False

    def __init__(self, *, spec: LayerSpec, steps: SeatSteps, max_batch_size: int):
        self.steps = steps
        self.device = torch.device(spec.device)
        self.max_batch_size = max_batch_size
        self._conv_storage = torch.zeros(max_batch_size, *spec.conv_shape, dtype=spec.dtype, device=spec.device)
        self._recurrent_storage = torch.zeros(
            max_batch_size, *spec.recurrent_shape, dtype=spec.recurrent_dtype or spec.dtype, device=spec.device
        )
        self.number_of_states = 1
        self.conv_kernel_size = {0: spec.conv_shape[-1]}
        self.record_past = False

    @property
    def has_previous_state(self) -> dict[int, bool]:  # read by upstream's `Cache.has_previous_state`
        return {0: self.steps.mode == DECODE}

    def storages(self) -> list[torch.Tensor]:
        return [self._conv_storage, self._recurrent_storage]

    def lazy_initialization(self, *args, **kwargs) -> None:
        return None

    # Read by upstream's `Cache.get_conv_state`/`get_recurrent_state` when `has_previous_state` (a decode step): views,
    # so that the model's in-place decode updates land in the seats.
    @property
    def conv_states(self) -> dict[int, torch.Tensor]:  # {0: [B, C, K]}
        return {0: self._conv_storage[: self.steps.span]}

    @property
    def recurrent_states(self) -> dict[int, torch.Tensor]:  # {0: [B, C, N]}
        return {0: self._recurrent_storage[: self.steps.span]}

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        # admission: conv_states [A, C, S] -> [A, C, max(S, K)], as upstream's first update (a prefill)
        if self.steps.mode != ADMISSION:
            raise _not_in_a_step("update_conv_state outside an admission")
        rows, _ = self.steps.on(self.device)
        kernel_size = self.conv_kernel_size[0]
        full = conv_states
        if conv_states.shape[-1] < kernel_size:
            full = torch.nn.functional.pad(conv_states, (kernel_size - conv_states.shape[-1], 0))
        self._conv_storage[rows] = full[..., -kernel_size:]
        self._recurrent_storage[rows] = 0  # a new request starts from a zero state, whatever the seat held
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        # admission: recurrent_states [A, C, N] -> the same; decode: [B, C, N] -> a view of seats [:B]
        recurrent_states = last_recurrent_state(recurrent_states)
        if self.steps.mode == ADMISSION:
            rows, _ = self.steps.on(self.device)
            self._recurrent_storage[rows] = recurrent_states
            return recurrent_states
        if self.steps.mode != DECODE:
            raise _not_in_a_step("update_recurrent_state")
        # transformers 5.25's mixer updates a copy of the state and hands it back here at every decode step (5.24's
        # updates the view of `recurrent_states` in place): copied into the seats, so that both land in the storage.
        live = self._recurrent_storage[: self.steps.span]
        live.copy_(recurrent_states)
        return live

    def get_seq_length(self) -> int:
        refuse_layer_seq_length(self)

    def increase_count(self, state_idx: int = 0) -> None:
        # transformers 5.25's mixer reports each decode step here; the engine counts each seat's columns.
        return None

    def copy_rows(self, destination: torch.Tensor, source: torch.Tensor, length: int) -> None:
        """Rows `destination` take the states of rows `source` (beam reordering)."""
        destination, source = destination.to(self.device), source.to(self.device)
        for storage in self.storages():
            storage[destination] = storage[source]

    def reset(self) -> None:
        return None

    def activate_past_recording(self, **kwargs):
        raise NotImplementedError("past recording is not supported by a seat cache")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("linear-attention states cannot be cropped")


class FlexibleSeatCache(Cache):
    """Self-attention (and Mamba) storage of `max_batch_size` seats, each with its own length: the serving engine's.

    Args:
        layer_specs (`list[LayerSpec]`): one per decoder layer (`layer_specs_for_model(model)`).
        max_batch_size (`int`): seats.
        max_cache_len (`int`): decoder positions per seat. Sliding-window layers hold all of them too (the window is
            a mask over each row's own positions).

    Raises:
        ValueError: no attention layer, or a layer type other than full, sliding-window and linear attention.
    """

    def __init__(self, *, layer_specs: list[LayerSpec], max_batch_size: int, max_cache_len: int):
        attention = [spec for spec in layer_specs if spec.layer_type != "linear_attention"]
        if not attention:
            raise ValueError("a seat cache needs at least one attention layer")
        unknown = sorted(
            {spec.layer_type for spec in layer_specs} - {"full_attention", "sliding_attention", "linear_attention"}
        )
        if unknown:
            raise ValueError(f"a seat cache holds full, sliding-window and linear attention layers, not {unknown}")
        self.steps = SeatSteps(max_batch_size=max_batch_size, max_len=max_cache_len, device=attention[0].device)
        self.layer_specs = list(layer_specs)
        layers = [
            FlexibleSeatLinearAttentionLayer(spec=spec, steps=self.steps, max_batch_size=max_batch_size)
            if spec.layer_type == "linear_attention"
            else FlexibleSeatLayer(spec=spec, steps=self.steps, max_batch_size=max_batch_size, max_len=max_cache_len)
            for spec in layer_specs
        ]
        super().__init__(layers=layers)
        self.steps.devices = {layer.device for layer in layers}
        self.max_batch_size, self.max_cache_len = max_batch_size, max_cache_len
        self.num_allocations = 1

    # --- sizes ------------------------------------------------------------------------------------------------
    @classmethod
    def nbytes_for(cls, *, layer_specs: list[LayerSpec], max_batch_size: int, max_cache_len: int) -> int:
        """Bytes a seat cache of these capacities allocates (storage plus per-seat state), without allocating."""
        specs = [
            spec if spec.sliding_window is None else LayerSpec(**{**vars(spec), "sliding_window": None})
            for spec in layer_specs
        ]
        storage = sum(spec.nbytes(max_batch_size=max_batch_size, max_cache_len=max_cache_len) for spec in specs)
        return storage + max_batch_size * (8 + max_cache_len)  # columns (int64) and validity (bool)

    def storages(self) -> list[torch.Tensor]:
        return [tensor for layer in self.layers for tensor in layer.storages()]

    @property
    def nbytes(self) -> int:
        tensors = [*self.storages(), self.steps.columns, self.steps.valid]
        return sum(tensor.untyped_storage().nbytes() for tensor in tensors)

    def data_ptrs(self) -> list[int]:
        """Data pointers of every storage tensor: equal across steps exactly when nothing was reallocated."""
        return [tensor.data_ptr() for tensor in self.storages()]

    def release(self) -> int:
        """Give every tensor back now (the cache is unusable afterwards); returns the bytes freed."""
        freed = self.nbytes
        for tensor in [*self.storages(), self.steps.columns, self.steps.valid]:
            tensor.untyped_storage().resize_(0)
        return freed

    @property
    def device(self) -> torch.device:
        return self.steps.columns.device

    # --- steps ------------------------------------------------------------------------------------------------
    def begin_admission(self, rows: torch.Tensor) -> None:
        """Next forward: a prefill of new requests on seats `rows` `[A]`."""
        self.steps.start(ADMISSION, rows=rows)

    def begin_decode(self, *, span: int, window: int) -> None:
        """Next forward: one new token for each seat of `[:span]`, attending over `[:window]` columns."""
        if not 0 < window <= self.max_cache_len or not 0 < span <= self.max_batch_size:
            raise ValueError(
                f"a decode step over span={span} seats and window={window} columns does not fit max_batch_size="
                f"{self.max_batch_size}, max_cache_len={self.max_cache_len}"
            )
        self.steps.start(DECODE, span=span, window=window)

    def end_step(self) -> None:
        self.steps.end()

    # --- per-seat state (the engine's, between steps) -------------------------------------------------------
    def admit(self, rows: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor) -> None:
        """Seats `rows` `[A]` now hold new requests: `valid` `[A, P]` marks the columns each may attend to, and
        `lengths` `[A]` is where each writes next."""
        steps = self.steps
        rows = rows.to(steps.valid.device)
        steps.valid[rows] = False
        steps.valid[rows, : valid.shape[1]] = valid.to(steps.valid.device)
        steps.columns[rows] = lengths.to(steps.columns.device)

    def mark_written(self, span: int) -> None:
        """The decode step writes each seat of `[:span]` at its column: that column becomes valid for it."""
        steps = self.steps
        steps.valid[steps.seat_index[:span], steps.columns[:span]] = True

    def advance(self, rows: torch.Tensor) -> None:
        """Seats `rows` wrote one token: their next column moves on."""
        self.steps.columns[rows.to(self.steps.columns.device)] += 1

    def free(self, rows: torch.Tensor) -> None:
        """Seats `rows` are free again: they attend to their column 0 only (finite, and thrown away)."""
        steps = self.steps
        rows = rows.to(steps.valid.device)
        steps.valid[rows] = False
        steps.valid[rows, 0] = True
        steps.columns[rows] = 0

    def copy_rows(self, destination: torch.Tensor, source: torch.Tensor, length: int) -> None:
        """Seats `destination` take what seats `source` hold up to column `length` (beam reordering within a
        request: the source rows are read whole before any is written)."""
        source_copy = source.clone()
        for layer in self.layers:
            layer.copy_rows(destination, source_copy, length)
        steps = self.steps
        destination, source_copy = destination.to(steps.valid.device), source_copy.to(steps.valid.device)
        steps.valid[destination] = steps.valid[source_copy]
        steps.columns[destination] = steps.columns[source_copy]

    def self_attention_mask(self, span: int, window: int, sliding_window: int | None = None) -> torch.Tensor:
        """`[B, W]` bool: the columns each seat attends to in this decode step (after `mark_written`), within its
        sliding window when one is given (the last `sliding_window` positions up to its own column)."""
        steps = self.steps
        # A copy, not a view of the [B_max, L] validity: its strides then never depend on the window (a compiled step
        # would guard on them).
        mask = steps.valid[:span, :window].contiguous()
        if sliding_window is not None:
            first = steps.columns[:span, None] - sliding_window  # columns at or before it fall out of the window
            mask = mask & (torch.arange(window, device=mask.device)[None, :] > first)
        return mask

    # --- the public accessor ----------------------------------------------------------------------------------
    def get_kv(self, layer_idx: int, batch_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer `layer_idx`, seats `[:batch_size]`, columns `[:length]` (views).

        Raises:
            ValueError: `layer_idx` is not an attention layer, or the sizes exceed the capacities.
        """
        layer = self.layers[layer_idx] if 0 <= layer_idx < len(self.layers) else None
        if not isinstance(layer, FlexibleSeatLayer):
            raise ValueError(f"layer_idx={layer_idx} is not an attention layer of this seat cache")
        if not (0 <= batch_size <= self.max_batch_size and 0 <= length <= self.max_cache_len):
            raise ValueError(
                f"batch_size={batch_size}, length={length} must be within max_batch_size={self.max_batch_size}, "
                f"max_cache_len={self.max_cache_len}"
            )
        return layer.get_kv(batch_size, length)

    def get_seq_length(self, layer_idx: int = 0):
        """Overrides `transformers.cache_utils.Cache.get_seq_length` (transformers==5.25.0).

        Differences: a linear-attention `layer_idx` is answered by the first attention layer (`length_layer_idx`), as
        transformers 5.24 answered it: each seat's length is in the engine's columns, not in a count of the Mamba
        layers.
        """
        return super().get_seq_length(length_layer_idx(self.layers, layer_idx))

    def is_recording_past(self, layer_idx: int) -> bool:
        return False


class FlexibleSeatEncoderDecoderCache(EncoderDecoderCache):
    """Self-attention plus cross-attention seat caches for encoder-decoder models (the serving engine's).

    The cross-attention half holds `max_encoder_len` encoder positions per seat; a request's cross keys and values
    are projected once, when it is admitted (`cross_attention_kv` in an admission step), and read back in every
    decode step over `[:B, :, :E_W]`, masked by `cross_attention_mask`.

    Args:
        layer_specs, cross_layer_specs (`list[LayerSpec]`): per-layer specs of both halves.
        max_batch_size (`int`): seats.
        max_cache_len (`int`): decoder positions per seat.
        max_encoder_len (`int`): encoder positions per seat.
    """

    def __init__(
        self,
        *,
        layer_specs: list[LayerSpec],
        cross_layer_specs: list[LayerSpec],
        max_batch_size: int,
        max_cache_len: int,
        max_encoder_len: int,
    ):
        self_cache = FlexibleSeatCache(
            layer_specs=layer_specs, max_batch_size=max_batch_size, max_cache_len=max_cache_len
        )
        cross_cache = FlexibleSeatCache(
            layer_specs=cross_layer_specs, max_batch_size=max_batch_size, max_cache_len=max_encoder_len
        )
        super().__init__(self_cache, cross_cache)
        self.max_batch_size, self.max_cache_len, self.max_encoder_len = max_batch_size, max_cache_len, max_encoder_len

    @classmethod
    def nbytes_for(
        cls,
        *,
        layer_specs: list[LayerSpec],
        cross_layer_specs: list[LayerSpec],
        max_batch_size: int,
        max_cache_len: int,
        max_encoder_len: int,
    ) -> int:
        """Bytes both halves allocate, without allocating."""
        own = FlexibleSeatCache.nbytes_for(
            layer_specs=layer_specs, max_batch_size=max_batch_size, max_cache_len=max_cache_len
        )
        cross = FlexibleSeatCache.nbytes_for(
            layer_specs=cross_layer_specs, max_batch_size=max_batch_size, max_cache_len=max_encoder_len
        )
        return own + cross

    # --- what both halves hold and do: forwarded over `_parts()`, as `FlexibleEncoderDecoderCache` does -----------
    def _parts(self) -> tuple[FlexibleSeatCache, FlexibleSeatCache]:
        return (self.self_attention_cache, self.cross_attention_cache)

    def storages(self) -> list[torch.Tensor]:
        return [tensor for part in self._parts() for tensor in part.storages()]

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self._parts())

    @property
    def num_allocations(self) -> int:
        return sum(part.num_allocations for part in self._parts())

    def data_ptrs(self) -> list[int]:
        return [pointer for part in self._parts() for pointer in part.data_ptrs()]

    def release(self) -> int:
        return sum(part.release() for part in self._parts())

    @property
    def device(self) -> torch.device:
        return self.self_attention_cache.device

    def begin_admission(self, rows: torch.Tensor) -> None:
        for part in self._parts():
            part.begin_admission(rows)

    def end_step(self) -> None:
        for part in self._parts():
            part.end_step()

    def begin_decode(self, *, span: int, window: int, cross_window: int) -> None:
        self.self_attention_cache.begin_decode(span=span, window=window)
        self.cross_attention_cache.begin_decode(span=span, window=cross_window)

    def admit(
        self, rows: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor, encoder_valid: torch.Tensor
    ) -> None:
        """See `FlexibleSeatCache.admit`; `encoder_valid` `[A, E]` marks each row's live encoder positions."""
        self.self_attention_cache.admit(rows, valid, lengths)
        encoder_lengths = torch.zeros(rows.shape[0], dtype=torch.long)
        self.cross_attention_cache.admit(rows, encoder_valid, encoder_lengths)

    def mark_written(self, span: int) -> None:
        self.self_attention_cache.mark_written(span)

    def advance(self, rows: torch.Tensor) -> None:
        self.self_attention_cache.advance(rows)

    def free(self, rows: torch.Tensor) -> None:
        for part in self._parts():
            part.free(rows)

    def copy_rows(self, destination: torch.Tensor, source: torch.Tensor, length: int) -> None:
        # Beams of one request share its encoder output: their cross-attention rows are already equal.
        self.self_attention_cache.copy_rows(destination, source, length)

    def self_attention_mask(self, span: int, window: int, sliding_window: int | None = None) -> torch.Tensor:
        return self.self_attention_cache.self_attention_mask(span, window, sliding_window)

    def cross_attention_mask(self, span: int, cross_window: int) -> torch.Tensor:
        """`[B, E_W]` bool: the encoder positions each seat attends to (a contiguous copy, see
        `FlexibleSeatCache.self_attention_mask`)."""
        return self.cross_attention_cache.steps.valid[:span, :cross_window].contiguous()

    # --- the accessors models use -----------------------------------------------------------------------------
    def cross_attention_kv(self, layer_idx: int, key_value_states: torch.Tensor, project) -> tuple[torch.Tensor, ...]:
        """Cross-attention keys and values of layer `layer_idx` for this step (see
        `FlexibleEncoderDecoderCache.cross_attention_kv`).

        In an admission step, `key_value_states` `[A, L_enc, d]` (the admitted requests' encoder outputs) is projected
        with `project` and written into their seats; in a decode step, the seats' stored keys and values
        `[B, H, E_W, D]` are returned and `key_value_states` is not read.
        """
        cross = self.cross_attention_cache
        layer = cross.layers[layer_idx]
        if cross.steps.mode == ADMISSION:
            key_states, value_states = project(key_value_states)
            rows, _ = cross.steps.on(layer.device)
            layer.write_rows(rows, key_states, value_states)
            return key_states, value_states
        if cross.steps.mode != DECODE:
            raise _not_in_a_step("cross_attention_kv")
        return layer.get_kv(cross.steps.span, cross.steps.window)

    def write_cross_attention(
        self, layer_idx: int, rows: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> None:
        """Write the cross-attention keys and values of new requests into seats `rows` (`[A]`) of layer `layer_idx`,
        outside a forward: `key_states` `[A, H, E, D]`, projected by the model's own cross-attention module."""
        layer = self.cross_attention_cache.layers[layer_idx]
        layer.write_rows(rows.to(layer.device), key_states, value_states)

    def get_kv(self, layer_idx: int, batch_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Self-attention keys and values (see `FlexibleSeatCache.get_kv`)."""
        return self.self_attention_cache.get_kv(layer_idx, batch_size, length)

    def get_encoder_length(self, layer_idx: int = 0) -> int:
        """The encoder span of the current decode step (`E_W`; each seat's own length is in its mask)."""
        return self.cross_attention_cache.steps.window

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.self_attention_cache.update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0):
        return self.self_attention_cache.get_seq_length(layer_idx)

    def reorder_cache(self, beam_idx) -> None:
        raise _not_in_a_step("reorder_cache")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a seat cache cannot be cropped")


def is_seat_cache(cache) -> bool:
    return isinstance(cache, (FlexibleSeatCache, FlexibleSeatEncoderDecoderCache))
