"""The engine's batched model work: encoders of newly admitted requests, their prefills, and the decode step.

Shape legend: `A` rows admitted together, `P` their (right-padded) decoder prompt length, `E` their encoder length,
`B` the decode step's span of seats, `W` its attended decoder columns, `E_W` its attended encoder positions, `V`
vocabulary, `d` hidden size.

Each function takes the pending calls of several workers and returns, per worker, `(result, error)`: a request whose
own inputs make the model raise fails alone (its batch is run again without it), the others go on.

Design decisions:
- Encoders and prefills run eagerly, at the admitted requests' own shapes (right-padded to the longest, with masks):
  they run once per request. Only the decode step has fixed shapes (and may be compiled). An encoder-decoder request
  whose decoder prompt is its start token alone needs no prefill: its cross-attention keys are written into its
  seats (`run_joins`) and its first token is decoded in the decode step, with everyone else's.
- A prefill runs on the seat cache in admission mode: the model builds its masks and positions from the 2D masks, as
  in `generate`; the keys land in the requests' seats. Models with linear-attention (Mamba) layers are admitted in
  groups of equal prompt length: a recurrent state cannot skip right padding.
- The decode step passes 4D masks built from each seat's validity (`cache.self_attention_mask`), one per kind of
  layer (a dict by layer type when full and sliding-window layers are mixed), in the attention implementation's
  format (boolean for sdpa, additive for eager). Encoder-decoder models get their encoder states as a zero-strided
  dummy: cross-attention reads the stored keys (`cross_attention_kv`), never the states.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithPast, Seq2SeqLMOutput

from .worker import RequestWorker


def _pad_right(tensor: torch.Tensor, length: int, value) -> torch.Tensor:
    # tensor: [R, n, ...] -> [R, length, ...]
    missing = length - tensor.shape[1]
    if missing <= 0:
        return tensor
    filler = tensor.new_full((tensor.shape[0], missing, *tensor.shape[2:]), value)
    return torch.cat([tensor, filler], dim=1)


def _isolating(run, items: list, *, stateless: bool) -> list[tuple]:
    """`run(items)` -> one result per item; if it raises and the work is `stateless` (writes nothing that a second
    run would not overwrite), each item is run alone so that only the items that raise fail."""
    try:
        return [(result, None) for result in run(items)]
    except Exception as error:  # noqa: BLE001 - a model error fails its requests, not the engine
        if len(items) == 1 or not stateless:
            return [(None, error)] * len(items)
    outcomes = []
    for item in items:
        try:
            outcomes.append((run([item])[0], None))
        except Exception as error:  # noqa: BLE001
            outcomes.append((None, error))
    return outcomes


def _run_in_groups(workers: list, groups: dict, run) -> list[tuple]:
    """`run` on each group of `workers` (`groups`: lists of indices into `workers`), isolating a failing worker as
    `_isolating` does (a group's call can run again without it); the outcomes in the order of `workers`."""
    outcomes: list = [None] * len(workers)
    for indices in groups.values():
        group = [workers[index] for index in indices]
        for index, outcome in zip(indices, _isolating(run, group, stateless=True), strict=True):
            outcomes[index] = outcome
    return outcomes


# --- encoders ---------------------------------------------------------------------------------------------------
def _encoder_signature(kwargs: dict) -> tuple:
    """What must be equal for two requests' encoder calls to share a batch: token inputs may differ in length."""
    token_len = kwargs["input_ids"].shape[1] if isinstance(kwargs.get("input_ids"), torch.Tensor) else None
    signature = []
    for key in sorted(kwargs):
        value = kwargs[key]
        if isinstance(value, torch.Tensor):
            shape = tuple(value.shape)
            if token_len is not None and value.dim() >= 2 and shape[1] == token_len:
                shape = (shape[0], None, *shape[2:])  # padded to the longest in the batch
            signature.append((key, value.dtype, value.device, shape))
        else:
            signature.append((key, repr(value)))
    return tuple(signature)


def run_encoders(engine, workers: list[RequestWorker]) -> list[tuple]:
    """Encoder outputs `[R, L_enc, d]` for each worker's pending `"encode"` call (`R` its rows, usually 1), batched
    where shapes allow."""
    groups = defaultdict(list)
    for index, worker in enumerate(workers):
        payload = worker.pending.payload
        if isinstance(payload.get("input_ids"), torch.Tensor) and payload.get("attention_mask") is None:
            if engine.encoder_takes_mask:
                # A mask of ones changes nothing for the request alone, and lets it share a right-padded batch.
                payload["attention_mask"] = torch.ones_like(payload["input_ids"])
            else:  # without a mask, padding would be attended to: batch only equal lengths
                payload["_length"] = payload["input_ids"].shape[1]
        groups[_encoder_signature(payload)].append(index)
    return _run_in_groups(workers, groups, lambda ws: _encode(engine, ws))


def _encode(engine, workers: list[RequestWorker]) -> list:
    payloads = [worker.pending.payload for worker in workers]
    lengths = [p["input_ids"].shape[1] if isinstance(p.get("input_ids"), torch.Tensor) else None for p in payloads]
    longest = max((length for length in lengths if length is not None), default=None)
    batch = {}
    for key, value in payloads[0].items():
        if key == "_length":
            continue
        if not isinstance(value, torch.Tensor):
            batch[key] = value
            continue
        values = [p[key] for p in payloads]
        if longest is not None and value.dim() >= 2 and value.shape[1] == lengths[0]:
            fill = engine.pad_token_id if key == "input_ids" else 0
            values = [_pad_right(v, longest, fill) for v in values]
        batch[key] = torch.cat(values, dim=0)
    outputs = _encoder_for(engine, batch)(**batch)
    hidden = outputs[0]  # [A, L_enc, d]
    results, start = [], 0
    for payload, length in zip(payloads, lengths, strict=True):
        # A request's call may hold several rows (Whisper repeats its input per returned sequence first).
        count = next(value.shape[0] for value in payload.values() if isinstance(value, torch.Tensor))
        states = hidden[start : start + count]
        states = states if length is None else states[:, :length]
        results.append(BaseModelOutput(last_hidden_state=states.clone()))
        start += count
    return results


def _encoder_for(engine, batch: dict):
    """The compiled encoder (`compiled_encoder.py`) for token batches of two positions or more, else the eager one."""
    ids = batch.get("input_ids")
    compiled = (
        engine.compiled_encoder is not None
        and isinstance(ids, torch.Tensor)
        and ids.shape[-1] > 1
        and not batch.get("output_attentions")
        and not batch.get("output_hidden_states")
    )
    if not compiled:
        return engine.model.get_encoder()

    def run(**kwargs):
        with engine.compile_settings():
            return engine.compiled_encoder(**kwargs)

    return run


def run_dummy_encoder(engine, rows: int, positions: int) -> None:
    """The compiled encoder on `rows` rows of `positions` pad tokens (`warmup`), with the arguments a request's
    encoder call passes (generate's, `generation.py`), then the compiled cross-attention projections on its outputs:
    compiles their graphs for such calls (`compiled_encoder.encoder_graph`)."""
    ids = torch.full((rows, positions), engine.pad_token_id, dtype=torch.long, device=engine.model_device)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "output_attentions": False,
        "output_hidden_states": False,
        "return_dict": True,
    }
    states = _encoder_for(engine, batch)(**batch).last_hidden_state
    if engine.project_cross_attention is not None:
        with engine.compile_settings():
            engine.project_cross_attention(states)


# --- prefills ---------------------------------------------------------------------------------------------------
def run_prefills(engine, workers: list[RequestWorker]) -> list[tuple]:
    """The first model call of each worker's `generate` (its prompt, or its decoder prompt over its encoder
    outputs), batched, writing the requests' seats; returns each its outputs (logits `[R, 1, V]`)."""
    groups = defaultdict(list)
    for index, worker in enumerate(workers):
        _, model_inputs = worker.pending.payload
        # Mamba states cannot skip right padding: such models batch prompts of one length only.
        key = model_inputs[engine.input_ids_key].shape[1] if engine.has_linear_layers else None
        groups[key].append(index)
    # Admission writes only the admitted seats, from column 0: running it again rewrites the same values.
    return _run_in_groups(workers, groups, lambda ws: _prefill(engine, ws))


def _prefill(engine, workers: list[RequestWorker]) -> list:
    items = [worker.pending.payload for worker in workers]  # (seats, model_inputs)
    ids_key = engine.input_ids_key
    prompts = [inputs[ids_key] for _, inputs in items]  # [R_i, P_i]
    prompt_lens = [prompt.shape[1] for prompt in prompts]
    longest = max(prompt_lens)
    own_mask_key = "decoder_attention_mask" if engine.is_encoder_decoder else "attention_mask"

    def padded(key: str, fill, default=None) -> torch.Tensor | None:
        values = [inputs.get(key) for _, inputs in items]
        if all(value is None for value in values):
            return None
        values = [default(i) if value is None else value for i, value in enumerate(values)]
        return torch.cat([_pad_right(value, longest, fill) for value in values], dim=0)

    def ones(i: int) -> torch.Tensor:
        return torch.ones(prompts[i].shape, dtype=torch.long, device=prompts[i].device)

    kwargs = {
        ids_key: torch.cat([_pad_right(prompt, longest, engine.pad_token_id) for prompt in prompts], dim=0),
        "cache": engine.cache,
        "use_cache": True,
        "return_dict": True,
    }
    own_mask = padded(own_mask_key, 0, ones)
    if own_mask is None and any(length != longest for length in prompt_lens):
        own_mask = torch.cat([_pad_right(ones(i), longest, 0) for i in range(len(items))], dim=0)
    if own_mask is not None:
        kwargs[own_mask_key] = own_mask
    for key in ("position_ids", "decoder_position_ids"):
        value = padded(key, 0)
        if value is not None:
            kwargs[key] = value
    if all(length == longest for length in prompt_lens):
        keep = {inputs.get("logits_to_keep") for _, inputs in items}
        if keep == {1}:
            kwargs["logits_to_keep"] = 1
    encoder_valid = None
    if engine.is_encoder_decoder:
        encoder_valid = _add_encoder_inputs(engine, items, kwargs)
    rows = torch.cat([seats.rows for seats, _ in items])
    valid = (own_mask if own_mask is not None else torch.ones(kwargs[ids_key].shape, dtype=torch.long)).bool()
    engine.cache.begin_admission(rows.to(engine.cache.device))
    try:
        outputs = engine.model(**kwargs)
    finally:
        engine.cache.end_step()
    lengths = torch.tensor(
        [length for (seats, _), length in zip(items, prompt_lens, strict=True) for _ in range(len(seats.rows))]
    )
    if engine.is_encoder_decoder:
        engine.cache.admit(rows, valid, lengths, encoder_valid)
    else:
        engine.cache.admit(rows, valid, lengths)
    logits = outputs.logits  # [A, P or 1, V]
    if logits.shape[1] > 1:
        logits = logits[torch.arange(logits.shape[0]), (lengths - 1).to(logits.device)]  # each row's last token
    else:
        logits = logits[:, -1]
    results, start = [], 0
    for (seats, _), length in zip(items, prompt_lens, strict=True):
        count = len(seats.rows)
        seats.length = length
        seats.admitted = True
        engine.note_admitted(seats)
        results.append(engine.output_type(logits=logits[start : start + count, None], cache=seats))
        start += count
    return results


def run_joins(engine, workers: list[RequestWorker]) -> list[tuple]:
    """Encoder-decoder requests whose decoder prompt is one token (the start token) skip the prefill: their
    cross-attention keys and values are projected by the model's own cross-attention modules and written into their
    seats, and their first token is decoded in the next decode step with everyone else's (column 0). Returns
    `(None, error)` per worker: None when it joined (it is answered by the decode step)."""
    return _isolating(lambda ws: _join(engine, ws), workers, stateless=True)


def _join(engine, workers: list[RequestWorker]) -> list:
    items = [worker.pending.payload for worker in workers]  # (seats, model_inputs)
    kwargs: dict = {}
    encoder_valid = _add_encoder_inputs(engine, items, kwargs)  # batched, right-padded encoder states and masks
    states = kwargs["encoder_outputs"][0]  # [A, E, d]
    rows = torch.cat([seats.rows for seats, _ in items])
    with engine.compile_settings():  # each override's projection, as in its forward
        projected = engine.project_cross_attention(states)
    for layer_idx, (key_states, value_states) in enumerate(projected):
        engine.cache.write_cross_attention(layer_idx, rows, key_states, value_states)
    no_columns = torch.zeros((len(rows), 0), dtype=torch.bool)
    engine.cache.admit(rows, no_columns, torch.zeros(len(rows), dtype=torch.long), encoder_valid)
    for seats, _ in items:
        seats.admitted = True  # its pending call (the first model call) is answered by the decode step
        engine.note_admitted(seats)
    return [None] * len(items)


def _add_encoder_inputs(engine, items: list, kwargs: dict) -> torch.Tensor:
    """Batch the requests' encoder outputs `[R_i, E_i, d]` (right-padded) and their masks into `kwargs`; returns the
    encoder positions each row may attend to, `[A, E]`."""
    states = [inputs["encoder_outputs"][0] for _, inputs in items]
    encoder_lens = [value.shape[1] for value in states]
    longest = max(encoder_lens)
    masks = []
    for (_, inputs), value in zip(items, states, strict=True):
        mask = inputs.get(engine.encoder_mask_key)
        if mask is None:
            mask = torch.ones(value.shape[:2], dtype=torch.long, device=value.device)
        masks.append(_pad_right(mask, longest, 0))
    kwargs["encoder_outputs"] = BaseModelOutput(
        last_hidden_state=torch.cat([_pad_right(value, longest, 0.0) for value in states], dim=0)
    )
    encoder_mask = torch.cat(masks, dim=0)  # [A, E]
    if any(length != longest for length in encoder_lens) or any(
        inputs.get(engine.encoder_mask_key) is not None for _, inputs in items
    ):
        kwargs[engine.encoder_mask_key] = encoder_mask
    return encoder_mask.bool()


# --- the decode step --------------------------------------------------------------------------------------------
def run_decode(engine, workers: list[RequestWorker]) -> list[tuple]:
    """One new token for every running request, in one forward over the seats' span; returns each its outputs
    (logits `[R, 1, V]`). It advances Mamba states in place, so it is not run again for isolation: an error fails
    every request of the step."""
    return _isolating(lambda ws: _decode(engine, ws), workers, stateless=False)


def decode_inputs(engine, *, span: int, window: int, cross_window: int | None, rows, tokens, positions) -> dict:
    """The forward kwargs of a decode step over seats `[:span]`: `tokens`/`positions` `[R]` for seats `rows`, pad
    tokens at position 0 for the free seats. The seat cache must be in its decode step (`begin_decode`)."""
    cache = engine.cache
    device = cache.device
    input_ids = torch.full((span, 1), engine.pad_token_id, dtype=torch.long, device=device)
    input_ids[rows, 0] = tokens
    kwargs = {"cache": cache, "use_cache": True, "return_dict": True}
    masks = {
        layer_type: engine.format_mask(cache.self_attention_mask(span, window, sliding_window))
        for layer_type, sliding_window in engine.mask_kinds.items()
    }
    own_mask = next(iter(masks.values())) if len(masks) == 1 else masks
    if positions is not None:
        position_ids = torch.zeros((span, 1), dtype=torch.long, device=device)
        position_ids[rows, 0] = positions
        kwargs[engine.position_ids_key] = position_ids
    if engine.is_encoder_decoder:
        kwargs["decoder_input_ids"] = input_ids
        kwargs["decoder_attention_mask"] = own_mask
        kwargs["encoder_outputs"] = BaseModelOutput(
            last_hidden_state=engine.encoder_dummy.expand(span, cross_window, -1)
        )
        kwargs[engine.encoder_mask_key] = engine.format_mask(cache.cross_attention_mask(span, cross_window))
    else:
        kwargs["input_ids"] = input_ids
        kwargs["attention_mask"] = own_mask
    return kwargs


def _decode(engine, workers: list[RequestWorker]) -> list:
    items = [worker.pending.payload for worker in workers]  # (seats, model_inputs)
    rows = torch.cat([seats.rows for seats, _ in items])
    tokens = torch.cat([inputs[engine.input_ids_key][:, -1] for _, inputs in items])
    positions = None
    if engine.position_ids_key is not None:
        per_request = []
        for seats, inputs in items:
            given = inputs.get(engine.position_ids_key)
            per_request.append(given[:, -1] if given is not None else torch.full((len(seats.rows),), seats.length))
        positions = torch.cat(per_request)
    span, window, cross_window = decode_shape(engine, items)
    device = engine.cache.device
    rows_on_device = rows.to(device)
    if engine.is_encoder_decoder:
        engine.cache.begin_decode(span=span, window=window, cross_window=cross_window)
    else:
        engine.cache.begin_decode(span=span, window=window)
    try:
        engine.cache.mark_written(span)
        kwargs = decode_inputs(
            engine,
            span=span,
            window=window,
            cross_window=cross_window,
            rows=rows_on_device,
            tokens=tokens.to(device),
            positions=positions.to(device) if positions is not None else None,
        )
        with engine.compile_settings():
            outputs = engine.decode_forward(**kwargs)
    finally:
        engine.cache.end_step()
    engine.cache.advance(rows_on_device)
    logits = outputs.logits[:, -1]  # [B, V]
    results, start = [], 0
    for seats, _ in items:
        count = len(seats.rows)
        seats.length += 1
        results.append(engine.output_type(logits=logits[rows_on_device[start : start + count]][:, None], cache=seats))
        start += count
    return results


OUTPUT_TYPES = {True: Seq2SeqLMOutput, False: CausalLMOutputWithPast}


# --- the shapes of decode steps (the one place that reads the engine's shape policy) ---------------------------
def has_fixed_shapes(config) -> bool:
    """Whether decode steps run at a known set of shapes (`"padded"`, `"bucketed"`), which compiling needs."""
    return config.shape_policy != "exact"


def policy_sizes(config, name: str, capacity: int) -> tuple[int, ...]:
    """Every size of shape `name` a decode step can take under a fixed-shape policy."""
    return (capacity,) if config.shape_policy == "padded" else config.buckets_of(name, capacity)


def _bucket(config, name: str, value: int, capacity: int) -> int:
    if config.shape_policy == "padded":
        return capacity
    if config.shape_policy == "bucketed":
        return min(config.bucket_for(name, value, capacity=capacity), capacity)
    return value


def decode_shape(engine, items: list) -> tuple[int, int, int | None]:
    """`(B, W, E_W)` of a decode step over `items` (`(seats, model_inputs)`): the seats' span, the longest decoder
    length plus the new token, the longest encoder length, each rounded up as the shape policy says."""
    config = engine.config
    span = 1 + max(seats.last_seat for seats, _ in items)
    window = 1 + max(seats.length for seats, _ in items)
    encoder = max((seats.encoder_len or 1) for seats, _ in items) if engine.is_encoder_decoder else None
    return (
        _bucket(config, "max_batch_size", span, engine.max_batch_size),
        _bucket(config, "max_cache_len", window, engine.max_cache_len),
        _bucket(config, "max_encoder_len", encoder, engine.max_encoder_len) if encoder is not None else None,
    )


def run_dummy_decode(engine, span: int, window: int, cross_window: int | None) -> None:
    """A decode step at `(B, W, E_W)` with every seat free (`warmup`): each attends to its column 0 and writes
    there, so nothing of a request is touched."""
    cache = engine.cache
    if engine.is_encoder_decoder:
        cache.begin_decode(span=span, window=window, cross_window=cross_window)
    else:
        cache.begin_decode(span=span, window=window)
    try:
        cache.mark_written(span)
        empty = torch.zeros(0, dtype=torch.long, device=cache.device)
        kwargs = decode_inputs(
            engine,
            span=span,
            window=window,
            cross_window=cross_window,
            rows=empty,
            tokens=empty,
            positions=empty if engine.position_ids_key is not None else None,
        )
        with engine.compile_settings():
            engine.decode_forward(**kwargs)
    finally:
        cache.end_step()
