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

import contextlib
import inspect
import itertools
from collections import defaultdict

import torch
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithPast, Seq2SeqLMOutput

from ..cache.placement import KEY_PROJECTION_NAMES, attention_modules, cross_attention_projections
from ..compile import (
    compile_settings,
    compiled_encoder,
    cross_attention_projector,
    encoder_artifact_graphs,
    encoder_compiles,
    encoder_graph_names,
    loaded_encoder_side,
)
from ..generate.policies import POLICIES
from .requests import pad_token_id_of
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


OUTPUT_TYPES = {True: Seq2SeqLMOutput, False: CausalLMOutputWithPast}


class StepRunner:
    """The engine's batched model work, and the facts of the model it needs (module docstring).

    The engine schedules; this runs what it schedules. Each `run_*` method takes the workers whose pending calls
    (`worker.PendingCall`) it answers and returns, per worker, `(result, error)`.

    Args:
        model: the engine's override model.
        cache: the engine's seat cache (`FlexibleSeatCache` or `FlexibleSeatEncoderDecoderCache`).
        config (`CacheConfig`): the engine's, whose shape policy sizes the decode steps (`generate.policies`).
        compile_config (*optional*): compiles the decode step (and a token encoder, `compile.encoder`).
        on_admitted (`Callable[[RequestSeats], None]`): called when a request's prefill ran (or it joined).
    """

    def __init__(self, *, model, cache, config, compile_config=None, on_admitted):
        self.model, self.cache, self.config, self.compile_config = model, cache, config, compile_config
        self.policy = POLICIES[config.shape_policy]
        self.on_admitted = on_admitted
        self.is_encoder_decoder = bool(model.config.is_encoder_decoder)
        self.max_batch_size = config.max_batch_size
        self.max_cache_len = config.max_cache_len
        self.max_encoder_len = config.max_encoder_len if self.is_encoder_decoder else 0
        own = cache.self_attention_cache if self.is_encoder_decoder else cache
        self.has_linear_layers = any(own.is_linear)
        self.mask_kinds = self._mask_kinds(own)
        self.input_ids_key = "decoder_input_ids" if self.is_encoder_decoder else "input_ids"
        self.position_ids_key = self._position_ids_key()
        self.encoder_mask_key = getattr(model, "_flex_encoder_mask_key", "attention_mask")
        self.pad_token_id = pad_token_id_of(model)
        self.output_type = OUTPUT_TYPES[self.is_encoder_decoder]
        self.encoder_dummy = self._encoder_dummy() if self.is_encoder_decoder else None
        # Each layer's cross-attention projection (as the model's forward projects), or None: no request skips its
        # prefill then.
        self.cross_attention_projections = (
            cross_attention_projections(model, len(cache.cross_attention_cache.layers))
            if self.is_encoder_decoder
            else None
        )
        self.encoder_takes_mask = self.is_encoder_decoder and (
            "attention_mask" in inspect.signature(model.get_encoder().forward).parameters
        )
        self.decode_forward = model.get_compiled_call(compile_config) if compile_config is not None else model
        # A FlexCompileConfig (compile_config_for_cpu()) compiles the batched token encoder too, with dynamic shapes.
        self.compiled_encoder = (
            compiled_encoder(model, compile_config) if encoder_compiles(model, compile_config) else None
        )
        # The projections as a request joins: compiled for a quantized model (`cross_attention_projector`).
        self.project_cross_attention = (
            cross_attention_projector(model, compile_config, self.cross_attention_projections)
            if self.cross_attention_projections is not None
            else None
        )
        self._mask_fill = torch.finfo(model.dtype).min if model.config._attn_implementation == "eager" else None
        # a compiled artifact's decode graphs, by shape (`load_graphs`)
        self.loaded_graphs: dict = {}
        self.loaded_inputs: list[str] = []
        self.loaded_slots: list = []
        self.loaded_encoder_side = None  # its encoder side's graphs (`compile.encoder_artifact.LoadedEncoderSide`)

    # --- the model's facts --------------------------------------------------------------------------------------
    def _mask_kinds(self, own) -> dict:
        """`{layer_type: sliding_window or None}` of the attention masks a decode step passes."""
        kinds = {}
        for spec in own.layer_specs:
            if spec.layer_type != "linear_attention":
                kinds[spec.layer_type] = spec.sliding_window
        if len(set(kinds.values())) > 1:
            source = inspect.getsource(type(self.model.base_model).forward)
            if "isinstance(causal_mask_mapping := attention_mask, dict)" not in source:
                raise ValueError(
                    f"{type(self.model).__name__} mixes full and sliding-window layers but its forward takes one "
                    "attention mask for all of them: the engine cannot give each kind its own; serve it with "
                    "generate"
                )
        elif len(kinds) == 1:
            kinds = {"attention": next(iter(kinds.values()))}
        return kinds

    def _position_ids_key(self) -> str | None:
        names = inspect.signature(self.model.forward).parameters
        key = "decoder_position_ids" if self.is_encoder_decoder else "position_ids"
        return key if key in names else None

    def _encoder_dummy(self) -> torch.Tensor:
        """`[1, 1, d]` zeros: the encoder states a decode step passes (only their batch size is read)."""
        _, cross = attention_modules(self.model)
        module = next(iter(cross.values()))
        projection = next(getattr(module, name) for name in KEY_PROJECTION_NAMES if hasattr(module, name))
        return torch.zeros(1, 1, projection.in_features, dtype=self.model.dtype, device=self.cache.device)

    def format_mask(self, valid: torch.Tensor) -> torch.Tensor:
        """`[B, W]` bool -> the 4D mask `[B, 1, 1, W]` of the model's attention implementation."""
        mask = valid[:, None, None, :]
        if self._mask_fill is None:
            return mask
        return torch.zeros(mask.shape, dtype=self.model.dtype, device=mask.device).masked_fill(~mask, self._mask_fill)

    def compile_settings(self):
        return compile_settings(self.compile_config) if self.compile_config is not None else contextlib.nullcontext()

    def joins(self, call) -> bool:
        """Whether a request's first model call (`call`, a pending forward) can be its first decode step
        (`run_joins`)."""
        return (
            self.is_encoder_decoder
            and self.cross_attention_projections is not None
            and call.model_inputs[self.input_ids_key].shape[1] == 1
            and call.model_inputs.get("decoder_attention_mask") is None
        )

    # --- encoders -----------------------------------------------------------------------------------------------
    def run_encoders(self, workers: list[RequestWorker]) -> list[tuple]:
        """Encoder outputs `[R, L_enc, d]` for each worker's pending `"encode"` call (`R` its rows, usually 1), batched
        where shapes allow."""
        groups = defaultdict(list)
        for index, worker in enumerate(workers):
            payload = worker.pending.encoder_kwargs
            if isinstance(payload.get("input_ids"), torch.Tensor) and payload.get("attention_mask") is None:
                if self.encoder_takes_mask:
                    # A mask of ones changes nothing for the request alone, and lets it share a right-padded batch.
                    payload["attention_mask"] = torch.ones_like(payload["input_ids"])
                else:  # without a mask, padding would be attended to: batch only equal lengths
                    payload["_length"] = payload["input_ids"].shape[1]
            groups[_encoder_signature(payload)].append(index)
        return _run_in_groups(workers, groups, lambda ws: self._encode(ws))

    def _encode(self, workers: list[RequestWorker]) -> list:
        payloads = [worker.pending.encoder_kwargs for worker in workers]
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
                fill = self.pad_token_id if key == "input_ids" else 0
                values = [_pad_right(v, longest, fill) for v in values]
            batch[key] = torch.cat(values, dim=0)
        outputs = self._encoder_for(batch)(**batch)
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

    def _encoder_for(self, batch: dict):
        """The compiled encoder (`compile/encoder.py`) for token batches of two positions or more, else the eager one."""
        ids = batch.get("input_ids")
        compiled = (
            self.compiled_encoder is not None
            and isinstance(ids, torch.Tensor)
            and ids.shape[-1] > 1
            and not batch.get("output_attentions")
            and not batch.get("output_hidden_states")
        )
        if not compiled:
            return self.model.get_encoder()

        def run(**kwargs):
            with self.compile_settings():
                return self.compiled_encoder(**kwargs)

        return run

    def run_dummy_encoder(self, rows: int, positions: int) -> None:
        """The compiled encoder on `rows` rows of `positions` pad tokens (`warmup`), with the arguments a request's
        encoder call passes (generate's, `generate/mixin.py`), then the compiled cross-attention projections on its outputs:
        compiles their graphs for such calls (`compile.encoder.encoder_graph`)."""
        ids = torch.full((rows, positions), self.pad_token_id, dtype=torch.long, device=self.cache.device)
        batch = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "output_attentions": False,
            "output_hidden_states": False,
            "return_dict": True,
        }
        states = self._encoder_for(batch)(**batch).last_hidden_state
        if self.project_cross_attention is not None:
            with self.compile_settings():
                self.project_cross_attention(states)

    # --- prefills -----------------------------------------------------------------------------------------------
    def run_prefills(self, workers: list[RequestWorker]) -> list[tuple]:
        """The first model call of each worker's `generate` (its prompt, or its decoder prompt over its encoder
        outputs), batched, writing the requests' seats; returns each its outputs (logits `[R, 1, V]`)."""
        groups = defaultdict(list)
        for index, worker in enumerate(workers):
            model_inputs = worker.pending.model_inputs
            # Mamba states cannot skip right padding: such models batch prompts of one length only.
            key = model_inputs[self.input_ids_key].shape[1] if self.has_linear_layers else None
            groups[key].append(index)
        # Admission writes only the admitted seats, from column 0: running it again rewrites the same values.
        return _run_in_groups(workers, groups, lambda ws: self._prefill(ws))

    def _prefill(self, workers: list[RequestWorker]) -> list:
        items = [(worker.pending.seats, worker.pending.model_inputs) for worker in workers]
        ids_key = self.input_ids_key
        prompts = [inputs[ids_key] for _, inputs in items]  # [R_i, P_i]
        prompt_lens = [prompt.shape[1] for prompt in prompts]
        longest = max(prompt_lens)
        own_mask_key = "decoder_attention_mask" if self.is_encoder_decoder else "attention_mask"

        def padded(key: str, fill, default=None) -> torch.Tensor | None:
            values = [inputs.get(key) for _, inputs in items]
            if all(value is None for value in values):
                return None
            values = [default(i) if value is None else value for i, value in enumerate(values)]
            return torch.cat([_pad_right(value, longest, fill) for value in values], dim=0)

        def ones(i: int) -> torch.Tensor:
            return torch.ones(prompts[i].shape, dtype=torch.long, device=prompts[i].device)

        kwargs = {
            ids_key: torch.cat([_pad_right(prompt, longest, self.pad_token_id) for prompt in prompts], dim=0),
            "cache": self.cache,
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
        if self.is_encoder_decoder:
            encoder_valid = self._add_encoder_inputs(items, kwargs)
        rows = torch.cat([seats.rows for seats, _ in items])
        valid = (own_mask if own_mask is not None else torch.ones(kwargs[ids_key].shape, dtype=torch.long)).bool()
        self.cache.begin_admission(rows.to(self.cache.device))
        try:
            outputs = self.model(**kwargs)
        finally:
            self.cache.end_step()
        lengths = torch.tensor(
            [length for (seats, _), length in zip(items, prompt_lens, strict=True) for _ in range(len(seats.rows))]
        )
        if self.is_encoder_decoder:
            self.cache.admit(rows, valid, lengths, encoder_valid)
        else:
            self.cache.admit(rows, valid, lengths)
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
            self.on_admitted(seats)
            results.append(self.output_type(logits=logits[start : start + count, None], cache=seats))
            start += count
        return results

    def run_joins(self, workers: list[RequestWorker]) -> list[tuple]:
        """Encoder-decoder requests whose decoder prompt is one token (the start token) skip the prefill: their
        cross-attention keys and values are projected by the model's own cross-attention modules and written into their
        seats, and their first token is decoded in the next decode step with everyone else's (column 0). Returns
        `(None, error)` per worker: None when it joined (it is answered by the decode step)."""
        return _isolating(lambda ws: self._join(ws), workers, stateless=True)

    def _join(self, workers: list[RequestWorker]) -> list:
        items = [(worker.pending.seats, worker.pending.model_inputs) for worker in workers]
        kwargs: dict = {}
        encoder_valid = self._add_encoder_inputs(items, kwargs)  # batched, right-padded encoder states and masks
        states = kwargs["encoder_outputs"][0]  # [A, E, d]
        rows = torch.cat([seats.rows for seats, _ in items])
        with self.compile_settings():  # each override's projection, as in its forward
            projected = self.project_cross_attention(states)
        for layer_idx, (key_states, value_states) in enumerate(projected):
            self.cache.write_cross_attention(layer_idx, rows, key_states, value_states)
        no_columns = torch.zeros((len(rows), 0), dtype=torch.bool)
        self.cache.admit(rows, no_columns, torch.zeros(len(rows), dtype=torch.long), encoder_valid)
        for seats, _ in items:
            seats.admitted = True  # its pending call (the first model call) is answered by the decode step
            self.on_admitted(seats)
        return [None] * len(items)

    def _add_encoder_inputs(self, items: list, kwargs: dict) -> torch.Tensor:
        """Batch the requests' encoder outputs `[R_i, E_i, d]` (right-padded) and their masks into `kwargs`; returns the
        encoder positions each row may attend to, `[A, E]`."""
        states = [inputs["encoder_outputs"][0] for _, inputs in items]
        encoder_lens = [value.shape[1] for value in states]
        longest = max(encoder_lens)
        masks = []
        for (_, inputs), value in zip(items, states, strict=True):
            mask = inputs.get(self.encoder_mask_key)
            if mask is None:
                mask = torch.ones(value.shape[:2], dtype=torch.long, device=value.device)
            masks.append(_pad_right(mask, longest, 0))
        kwargs["encoder_outputs"] = BaseModelOutput(
            last_hidden_state=torch.cat([_pad_right(value, longest, 0.0) for value in states], dim=0)
        )
        encoder_mask = torch.cat(masks, dim=0)  # [A, E]
        if any(length != longest for length in encoder_lens) or any(
            inputs.get(self.encoder_mask_key) is not None for _, inputs in items
        ):
            kwargs[self.encoder_mask_key] = encoder_mask
        return encoder_mask.bool()

    # --- the decode step ----------------------------------------------------------------------------------------
    def run_decode(self, workers: list[RequestWorker]) -> list[tuple]:
        """One new token for every running request, in one forward over the seats' span; returns each its outputs
        (logits `[R, 1, V]`). It advances Mamba states in place, so it is not run again for isolation: an error fails
        every request of the step."""
        return _isolating(lambda ws: self._decode(ws), workers, stateless=False)

    def decode_inputs(self, *, span: int, window: int, cross_window: int | None, rows, tokens, positions) -> dict:
        """The forward kwargs of a decode step over seats `[:span]`: `tokens`/`positions` `[R]` for seats `rows`, pad
        tokens at position 0 for the free seats. The seat cache must be in its decode step (`begin_decode`)."""
        cache = self.cache
        device = cache.device
        input_ids = torch.full((span, 1), self.pad_token_id, dtype=torch.long, device=device)
        input_ids[rows, 0] = tokens
        kwargs = {"cache": cache, "use_cache": True, "return_dict": True}
        masks = {
            layer_type: self.format_mask(cache.self_attention_mask(span, window, sliding_window))
            for layer_type, sliding_window in self.mask_kinds.items()
        }
        own_mask = next(iter(masks.values())) if len(masks) == 1 else masks
        if positions is not None:
            position_ids = torch.zeros((span, 1), dtype=torch.long, device=device)
            position_ids[rows, 0] = positions
            kwargs[self.position_ids_key] = position_ids
        if self.is_encoder_decoder:
            kwargs["decoder_input_ids"] = input_ids
            kwargs["decoder_attention_mask"] = own_mask
            kwargs["encoder_outputs"] = BaseModelOutput(
                last_hidden_state=self.encoder_dummy.expand(span, cross_window, -1)
            )
            kwargs[self.encoder_mask_key] = self.format_mask(cache.cross_attention_mask(span, cross_window))
        else:
            kwargs["input_ids"] = input_ids
            kwargs["attention_mask"] = own_mask
        return kwargs

    def _decode(self, workers: list[RequestWorker]) -> list:
        items = [(worker.pending.seats, worker.pending.model_inputs) for worker in workers]
        rows = torch.cat([seats.rows for seats, _ in items])
        tokens = torch.cat([inputs[self.input_ids_key][:, -1] for _, inputs in items])
        positions = None
        if self.position_ids_key is not None:
            per_request = []
            for seats, inputs in items:
                given = inputs.get(self.position_ids_key)
                per_request.append(given[:, -1] if given is not None else torch.full((len(seats.rows),), seats.length))
            positions = torch.cat(per_request)
        span, window, cross_window = self.decode_shape(items)
        device = self.cache.device
        rows_on_device = rows.to(device)
        if self.is_encoder_decoder:
            self.cache.begin_decode(span=span, window=window, cross_window=cross_window)
        else:
            self.cache.begin_decode(span=span, window=window)
        try:
            self.cache.mark_written(span)
            kwargs = self.decode_inputs(
                span=span,
                window=window,
                cross_window=cross_window,
                rows=rows_on_device,
                tokens=tokens.to(device),
                positions=positions.to(device) if positions is not None else None,
            )
            outputs = self.forward_decode((span, window, cross_window), kwargs)
        finally:
            self.cache.end_step()
        self.cache.advance(rows_on_device)
        logits = outputs.logits[:, -1]  # [B, V]
        results, start = [], 0
        for seats, _ in items:
            count = len(seats.rows)
            seats.length += 1
            results.append(
                self.output_type(logits=logits[rows_on_device[start : start + count]][:, None], cache=seats)
            )
            start += count
        return results

    # --- the shapes of decode steps: the shape policy's sizing, as generate pads a call (`generate.policies`) ------
    def forward_decode(self, shape: tuple, kwargs: dict):
        """The decode step's forward at `shape` on `kwargs` (`decode_inputs`): the artifact's graph of that shape
        where one is loaded (`load_graphs`), else the compiled (or eager) forward."""
        graph = self.loaded_graphs.get(shape)
        run = graph.runner() if graph is not None else None  # loaded at its first use; None: damaged, compile
        if run is not None:
            inputs = [kwargs[name] for name in self.loaded_inputs]
            logits = run([*inputs, *(getattr(owner, name) for owner, name in self.loaded_slots)])[0]
            return self.output_type(logits=logits)
        with self.compile_settings():
            return self.decode_forward(**kwargs)

    def encoder_graph_names(self) -> list[str]:
        """The encoder side's graphs a compiled artifact holds (`compile.encoder_artifact`): `[]` where the encoder
        runs eagerly."""
        return encoder_graph_names(
            self.model, self.compile_config, self.cross_attention_projections, max_positions=self.max_encoder_len
        )

    def encoder_artifact_graphs(self) -> dict:
        """The encoder side's graphs for a compiled artifact (`compile.encoder_artifact.encoder_artifact_graphs`), with
        dynamic rows and positions up to the engine's capacities."""
        return encoder_artifact_graphs(
            self.model,
            self.compile_config,
            self.cross_attention_projections,
            max_rows=self.max_batch_size,
            max_positions=self.max_encoder_len,
        )

    def load_graphs(self, graphs: dict, input_names: list[str], slots: list, loaded=None) -> None:
        """Run the decode steps of the shapes of `graphs` (`{(B, W, E_W): PackageGraph}`, a compiled artifact's, each
        loaded at its first use where it is not yet; one whose file is damaged leaves its shape to the compiled step)
        with them: each takes the tensors of `input_names` of the step's kwargs, then the cache's tensors (`slots`, the
        cache wing's `tensor_slots`). The token encoder and an int8 model's projections run the encoder side's graphs
        of the artifact `loaded` (`compile.encoder_artifact.loaded_encoder_side`), or eagerly where it holds none:
        nothing is traced."""
        self.loaded_graphs, self.loaded_inputs, self.loaded_slots = dict(graphs), list(input_names), list(slots)
        side = None
        if loaded is not None:
            side = loaded_encoder_side(
                self.model,
                self.compile_config,
                self.cross_attention_projections,
                loaded,
                max_positions=self.max_encoder_len,
            )
        self.loaded_encoder_side = side
        self.compiled_encoder = side.encoder if side is not None else None
        if self.cross_attention_projections is not None:
            self.project_cross_attention = (
                side.project
                if side is not None and side.project is not None
                else cross_attention_projector(self.model, None, self.cross_attention_projections)
            )

    def _capacities(self) -> dict[str, int]:
        capacities = {"max_batch_size": self.max_batch_size, "max_cache_len": self.max_cache_len}
        if self.is_encoder_decoder:
            capacities["max_encoder_len"] = self.max_encoder_len
        return capacities

    def decode_shape(self, items: list) -> tuple[int, int, int | None]:
        """`(B, W, E_W)` of a decode step over `items` (`(seats, model_inputs)`): the seats' span, the longest decoder
        length plus the new token, the longest encoder length, each padded as the shape policy pads a call's shape
        (`padded_size`: the capacity under `"padded"`, the next bucket under `"bucketed"`, itself under `"exact"`)."""
        span = 1 + max(seats.last_seat for seats, _ in items)
        window = 1 + max(seats.length for seats, _ in items)
        encoder = max((seats.encoder_len or 1) for seats, _ in items) if self.is_encoder_decoder else None
        capacities, size = self._capacities(), self.policy.padded_size
        return (
            size(self.config, "max_batch_size", span, capacities),
            size(self.config, "max_cache_len", window, capacities),
            size(self.config, "max_encoder_len", encoder, capacities) if encoder is not None else None,
        )

    def decode_shapes(self) -> list[tuple]:
        """Every `(B, W, E_W)` a decode step can run at under a fixed-shape policy (E_W None without an encoder):
        each size the policy pads a shape to (`sizes`)."""
        if not self.policy.fixed_shapes:
            raise ValueError("the exact policy has no fixed set of decode shapes")
        sizes = {name: self.policy.sizes(self.config, name, capacity) for name, capacity in self._capacities().items()}
        return list(
            itertools.product(sizes["max_batch_size"], sizes["max_cache_len"], sizes.get("max_encoder_len", (None,)))
        )

    def run_dummy_decode(self, span: int, window: int, cross_window: int | None) -> None:
        """A decode step at `(B, W, E_W)` with every seat free (`warmup`): each attends to its column 0 and writes
        there, so nothing of a request is touched."""
        with self.dummy_decode((span, window, cross_window)) as kwargs:
            self.forward_decode((span, window, cross_window), kwargs)

    @contextlib.contextmanager
    def dummy_decode(self, shape: tuple):
        """Within this context the cache is in a decode step at `shape` (`(B, W, E_W)`) with every seat free (each
        attends to its column 0 and writes there); yields the step's kwargs (`decode_inputs`)."""
        span, window, cross_window = shape
        cache = self.cache
        if self.is_encoder_decoder:
            cache.begin_decode(span=span, window=window, cross_window=cross_window)
        else:
            cache.begin_decode(span=span, window=window)
        try:
            cache.mark_written(span)
            empty = torch.zeros(0, dtype=torch.long, device=cache.device)
            yield self.decode_inputs(
                span=span,
                window=window,
                cross_window=cross_window,
                rows=empty,
                tokens=empty,
                positions=empty if self.position_ids_key is not None else None,
            )
        finally:
            cache.end_step()
