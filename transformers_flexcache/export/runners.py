"""Running exported programs: checks against the capacities, torch or ExecuTorch execution, greedy decoding.

Shapes and program signatures as in `transformers_flexcache.export`.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.export import ExportedProgram

METHOD_NAMES = ("prefill", "decode")
# What an encoder-decoder `prefill` takes first: token ids, Whisper's log-mel frames, or the encoder's output.
ENCODER_INPUTS = ("input_ids", "input_features", "encoder_hidden_states")
FLOAT_INPUTS = ("input_features", "encoder_hidden_states")
_DECODER_ONLY_INPUTS = ("input_ids", "attention_mask", "position_ids", "cache_position")


def input_names(is_encoder_decoder: bool, encoder_input: str | None, method_name: str) -> tuple[str, ...]:
    """The names of the tensors that `method_name` of such a program takes, in order."""
    if not is_encoder_decoder:
        return _DECODER_ONLY_INPUTS
    if method_name == "prefill":
        return (encoder_input, "attention_mask", "decoder_input_ids", "cache_position")
    return ("decoder_input_ids", "cache_position", "encoder_attention_mask")


class ProgramRunner:
    """Checks each call against the capacities, then runs `prefill` or `decode`. Subclasses say how to run.

    Attributes:
        is_encoder_decoder (`bool`): which signature `prefill` and `decode` have (see the module docstring).
        capacities (`dict[str, int]`): `max_batch_size`, `max_cache_len` and, for encoder-decoder, `max_encoder_len`.
        encoder_input (`str` or `None`): what an encoder-decoder `prefill` takes first, one of `ENCODER_INPUTS`.
    """

    def __init__(self, *, is_encoder_decoder: bool, capacities: dict[str, int], encoder_input: str | None = None):
        self.is_encoder_decoder = is_encoder_decoder
        self.capacities = dict(capacities)
        self.encoder_input = encoder_input if is_encoder_decoder else None
        self._started = None  # (batch, encoder length, next position) of the sequence that prefill started

    def _run(self, method_name: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        raise NotImplementedError

    def _fail(self, value_name: str, value: int, limit_name: str) -> None:
        limit = self.capacities[limit_name]
        if value > limit:
            raise ValueError(
                f"{value_name}={value} exceeds {limit_name}={limit} of this exported program; export it again with "
                f"{limit_name}={value} or more"
            )

    def _check(self, method_name: str, batch_size: int, num_new: int, cache_position, encoder_len) -> None:
        if batch_size < 1 or num_new < 1:
            raise ValueError(f"{method_name} needs at least one row and one token, got batch {batch_size}, {num_new}")
        self._fail("batch_size", batch_size, "max_batch_size")
        if encoder_len is not None:
            self._fail("encoder_len", encoder_len, "max_encoder_len")
        start = int(cache_position[0]) if cache_position.numel() else 0
        if not torch.equal(cache_position, torch.arange(start, start + num_new)):
            raise ValueError(
                f"cache_position={cache_position.tolist()} must be arange({start}, {start + num_new}): one position "
                "per new token, consecutive"
            )
        self._fail("decoder_len", start + num_new, "max_cache_len")
        if method_name == "prefill":
            return
        if self._started is None:
            raise ValueError("decode was called before prefill; call prefill to start a sequence")
        started_batch, started_encoder_len, next_position = self._started
        if (batch_size, encoder_len) != (started_batch, started_encoder_len):
            raise ValueError(
                f"decode got batch {batch_size} and encoder length {encoder_len}, but prefill started batch "
                f"{started_batch} with encoder length {started_encoder_len}; call prefill to start another sequence"
            )
        if start > next_position:
            raise ValueError(
                f"cache_position starts at {start}, but positions from {next_position} were never written; "
                f"continue from {next_position}"
            )

    def _inputs(self, method_name: str, inputs: tuple) -> tuple[torch.Tensor, ...]:
        names = input_names(self.is_encoder_decoder, self.encoder_input, method_name)
        if len(inputs) != len(names):
            raise TypeError(f"{method_name} takes {len(names)} tensors ({', '.join(names)}), got {len(inputs)}")
        # The programs were traced with int64 ids, masks and positions; ExecuTorch refuses any other dtype.
        return tuple(
            torch.as_tensor(x).contiguous() if name in FLOAT_INPUTS else torch.as_tensor(x).long().contiguous()
            for name, x in zip(names, inputs, strict=True)
        )

    def prefill(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Start a sequence (see the module docstring for the inputs of each kind); returns logits `[B, S, V]`.

        Raises:
            TypeError: not the inputs of this program.
            ValueError: a batch, encoder length or position beyond the capacities, or malformed `cache_position`.
        """
        inputs = self._inputs("prefill", inputs)
        if self.is_encoder_decoder:
            encoder_input, attention_mask, decoder_input_ids, cache_position = inputs
            self._check_encoder_inputs(encoder_input, attention_mask, decoder_input_ids)
            batch_size, encoder_len = attention_mask.shape
        else:
            decoder_input_ids, attention_mask, _, cache_position = inputs
            self._check_decoder_only_mask(decoder_input_ids, attention_mask)
            batch_size, encoder_len = decoder_input_ids.shape[0], None
        num_new = decoder_input_ids.shape[1]
        self._check("prefill", batch_size, num_new, cache_position, encoder_len)
        logits = self._run("prefill", inputs)
        self._started = (batch_size, encoder_len, int(cache_position[-1]) + 1)
        return logits

    def decode(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Continue the sequence that `prefill` started; returns logits `[B, S, V]`.

        Raises:
            TypeError: not the inputs of this program.
            ValueError: as `prefill`, or a batch or encoder length other than the prefill's, or a gap in positions.
        """
        inputs = self._inputs("decode", inputs)
        if self.is_encoder_decoder:
            decoder_input_ids, cache_position, encoder_attention_mask = inputs
            batch_size, encoder_len = encoder_attention_mask.shape
            if decoder_input_ids.shape[0] != batch_size:
                raise ValueError(
                    f"decoder_input_ids {tuple(decoder_input_ids.shape)} and encoder_attention_mask "
                    f"{tuple(encoder_attention_mask.shape)} must have the same batch"
                )
        else:
            decoder_input_ids, attention_mask, _, cache_position = inputs
            self._check_decoder_only_mask(decoder_input_ids, attention_mask)
            batch_size, encoder_len = decoder_input_ids.shape[0], None
        self._check("decode", batch_size, decoder_input_ids.shape[1], cache_position, encoder_len)
        logits = self._run("decode", inputs)
        self._started = (*self._started[:2], max(self._started[2], int(cache_position[-1]) + 1))
        return logits

    def _check_encoder_inputs(
        self, encoder_input: torch.Tensor, attention_mask: torch.Tensor, decoder_input_ids: torch.Tensor
    ) -> None:
        # encoder_input: [B, L_enc] ids, [B, L_enc, d_model] states or [B, num_mel_bins, 2 * L_enc] frames;
        # attention_mask: [B, L_enc]; decoder_input_ids: [B, S]
        batch_size = decoder_input_ids.shape[0]
        if self.encoder_input == "input_ids":
            fits = encoder_input.dim() == 2 and attention_mask.shape == encoder_input.shape
            rule = "attention_mask of the shape of input_ids"
        elif self.encoder_input == "encoder_hidden_states":
            fits = encoder_input.dim() == 3 and attention_mask.shape == encoder_input.shape[:2]
            rule = "attention_mask [batch, encoder length] of encoder_hidden_states [batch, encoder length, d_model]"
        else:  # input_features: the encoder's output length is fixed, 2 frames per position
            encoder_len = self.capacities["max_encoder_len"]
            fits = (
                encoder_input.dim() == 3
                and encoder_input.shape[-1] == 2 * encoder_len
                and attention_mask.shape == (encoder_input.shape[0], encoder_len)
            )
            rule = f"input_features [batch, num_mel_bins, {2 * encoder_len}] and attention_mask [batch, {encoder_len}]"
        if not fits or attention_mask.shape[0] != batch_size:
            raise ValueError(
                f"{self.encoder_input} {tuple(encoder_input.shape)}, attention_mask {tuple(attention_mask.shape)} and "
                f"decoder_input_ids {tuple(decoder_input_ids.shape)} do not fit: prefill needs {rule}, all of one batch"
            )

    def _check_decoder_only_mask(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        want = (input_ids.shape[0], self.capacities["max_cache_len"])
        if tuple(attention_mask.shape) != want:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}; it must cover every cache position: "
                f"{want} (batch, max_cache_len)"
            )


class ExportedPrograms(ProgramRunner):
    """The exported `prefill` and `decode` programs of one wrapper, run with `torch` (they share its buffers).

    Attributes:
        programs (`dict[str, ExportedProgram]`): `prefill` and `decode`.
        wrapper: the `ExportableEncoderDecoder` / `ExportableDecoderOnly` that owns the buffers.
    """

    def __init__(self, wrapper: nn.Module, programs: dict[str, ExportedProgram]):
        super().__init__(
            is_encoder_decoder=wrapper.is_encoder_decoder,
            capacities=wrapper.capacities(),
            encoder_input=getattr(wrapper, "encoder_input", None),
        )
        self.wrapper = wrapper
        self.programs = programs
        # `ExportedProgram.module()` keeps the state tensors it is given, so both modules mutate the wrapper's buffers.
        self._modules = {name: program.module() for name, program in programs.items()}

    def _run(self, method_name: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        with torch.no_grad():
            return self._modules[method_name](*inputs)

    def to_executorch(self, path: str | os.PathLike, *, backend: str | None = "xnnpack") -> str:
        """Lower both programs into one ExecuTorch `.pte` at `path`, their cache buffers shared; returns the path.

        Args:
            path: where to write the `.pte`.
            backend (`str` or `None`, *optional*, defaults to `"xnnpack"`): `"xnnpack"` delegates what XNNPACK can
                run (linear layers and more); `None` keeps ExecuTorch's portable kernels only (lowers faster).

        Raises:
            ImportError: executorch is not installed (`pip install "transformers-flexcache[executorch]"`).
            ValueError: an unknown `backend`.
        """
        try:
            from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
            from executorch.exir.passes import MemoryPlanningPass
        except ImportError as error:
            raise ImportError(
                'to_executorch needs executorch: pip install "transformers-flexcache[executorch]"'
            ) from error
        if backend == "xnnpack":
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

            partitioner = [XnnpackPartitioner()]
        elif backend is None:
            partitioner = []
        else:
            raise ValueError(f"backend={backend!r} is not one of ('xnnpack', None)")
        metadata = {**self.capacities, "is_encoder_decoder": int(self.is_encoder_decoder)}
        if self.is_encoder_decoder:
            metadata["encoder_input"] = ENCODER_INPUTS.index(self.encoder_input)
        edge = to_edge_transform_and_lower(self.programs, partitioner=partitioner, constant_methods=metadata)
        program = edge.to_executorch(
            ExecutorchBackendConfig(
                # One allocation of every cache buffer, shared by prefill and decode (matched by buffer name).
                memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True),
                emit_mutable_buffer_names=True,
            )
        )
        with open(path, "wb") as file:
            program.write_to_file(file)
        return os.fspath(path)


class ExecuTorchPrograms(ProgramRunner):
    """`prefill` and `decode` of a `.pte` written by `ExportedPrograms.to_executorch`, run in ExecuTorch's runtime.

    The capacities are read from the `.pte` itself. Its cache buffers persist between calls and are shared by the
    two methods, as in the exported programs.

    Args:
        path: the `.pte` file.

    Raises:
        ImportError: executorch is not installed.
        ValueError: the file has no `prefill` / `decode` methods or capacities (not written by `to_executorch`).
    """

    def __init__(self, path: str | os.PathLike):
        try:
            from executorch.runtime import Runtime
        except ImportError as error:
            raise ImportError(
                'ExecuTorchPrograms needs executorch: pip install "transformers-flexcache[executorch]"'
            ) from error
        self.program = Runtime.get().load_program(os.fspath(path))
        names = self.program.method_names
        wanted = {"prefill", "decode", "is_encoder_decoder", "max_batch_size", "max_cache_len"}
        if not wanted <= names:
            raise ValueError(f"{path} has methods {sorted(names)}, not {sorted(wanted)}; write it with to_executorch")
        constant = {name: self.program.load_method(name).execute([])[0] for name in names - {"prefill", "decode"}}
        is_encoder_decoder = bool(constant.pop("is_encoder_decoder"))
        encoder_input = ENCODER_INPUTS[int(constant.pop("encoder_input", 0))] if is_encoder_decoder else None
        super().__init__(
            is_encoder_decoder=is_encoder_decoder,
            capacities={k: int(v) for k, v in constant.items()},
            encoder_input=encoder_input,
        )
        self._methods = {name: self.program.load_method(name) for name in METHOD_NAMES}

    def _run(self, method_name: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self._methods[method_name].execute(list(inputs))[0]


def greedy_generate(
    runner: ProgramRunner,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    input_features: torch.Tensor | None = None,
    encoder_hidden_states: torch.Tensor | None = None,
    max_new_tokens: int,
    decoder_start_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    forced_eos_token_id: int | None = None,
    output_logits: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Greedy decoding with exported programs, as `model.generate(do_sample=False, num_beams=1)` decodes.

    Args:
        runner: `ExportedPrograms` or `ExecuTorchPrograms`.
        input_ids (`torch.LongTensor`, *optional*): `[B, L_enc]` encoder tokens, or `[B, P]` a left-padded prompt
            (decoder-only).
        attention_mask (`torch.LongTensor`, *optional*): `[B, L_enc]` (encoder-decoder) or `[B, P]`; all ones if not
            given.
        input_features (`torch.FloatTensor`, *optional*): `[B, num_mel_bins, 2 * L_enc]`, instead of `input_ids`
            for a program exported with `encoder_input="input_features"` (Whisper).
        encoder_hidden_states (`torch.FloatTensor`, *optional*): `[B, L_enc, d_model]` encoder outputs, instead of
            `input_ids` for a program exported with `encoder_input="encoder_hidden_states"`.
        max_new_tokens (`int`): tokens to generate at most.
        decoder_start_token_id (`int`): first decoder token (encoder-decoder only).
        eos_token_id (`int`, *optional*): a row that produced it is finished and gets `pad_token_id` afterwards;
            decoding stops when every row is finished.
        pad_token_id (`int`, *optional*): defaults to `eos_token_id`.
        forced_eos_token_id (`int`, *optional*): the last token allowed by `max_new_tokens` is this one for every
            unfinished row, as generate's `ForcedEOSTokenLogitsProcessor` does (BART checkpoints set it). No other
            logits processor is applied.
        output_logits (`bool`, *optional*, defaults to `False`): also return each step's logits, as `generate`'s
            `output_logits=True` does.

    Returns:
        `torch.LongTensor`: `[B, 1 + N]` decoder tokens (start token first), or `[B, P + N]` prompt and new tokens,
        `N <= max_new_tokens`: what `generate` returns. With `output_logits=True`, also a tuple of N `[B, V]` logits.

    Raises:
        ValueError: the generation would need more positions than `max_cache_len`, inputs exceed a capacity, or not
            exactly the encoder input that the program takes.
    """
    # input_ids: [B, L] -> [B, 1 + N] (encoder-decoder) or [B, P + N] (decoder-only)
    given = {"input_ids": input_ids, "input_features": input_features, "encoder_hidden_states": encoder_hidden_states}
    given = {name: value for name, value in given.items() if value is not None}
    wanted = runner.encoder_input if runner.is_encoder_decoder else "input_ids"
    if list(given) != [wanted]:
        raise ValueError(f"this program takes {wanted}, got {sorted(given) or 'no input'}; pass {wanted}")
    encoder_input = given[wanted]
    batch_size, input_len = encoder_input.shape[:2]
    if wanted == "input_features":  # the encoder's output length is fixed
        input_len = runner.capacities["max_encoder_len"]
    if attention_mask is None:
        attention_mask = torch.ones(batch_size, input_len, dtype=torch.long)
    if runner.is_encoder_decoder:
        if decoder_start_token_id is None:
            raise ValueError("decoder_start_token_id is required for an encoder-decoder program")
        sequences = torch.full((batch_size, 1), decoder_start_token_id, dtype=torch.long)
    else:
        sequences = input_ids
    num_prefix = sequences.shape[1]
    # The last new token is returned, never fed back: positions used = prefix + new tokens - 1.
    needed = num_prefix + max_new_tokens - 1
    if needed > runner.capacities["max_cache_len"]:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} after {num_prefix} prefix tokens needs max_cache_len={needed}, but the "
            f"program has max_cache_len={runner.capacities['max_cache_len']}; export it again with "
            f"max_cache_len={needed} or more"
        )
    pad_token_id = eos_token_id if pad_token_id is None else pad_token_id

    if runner.is_encoder_decoder:
        logits = runner.prefill(encoder_input, attention_mask, sequences, torch.arange(num_prefix))
    else:
        full_mask = torch.zeros(batch_size, runner.capacities["max_cache_len"], dtype=torch.long)
        full_mask[:, :input_len] = attention_mask
        # As generate: positions count the real tokens of each row; padding gets position 0.
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        logits = runner.prefill(input_ids, full_mask, position_ids, torch.arange(num_prefix))

    finished = torch.zeros(batch_size, dtype=torch.bool)
    step_logits = []
    for step in range(max_new_tokens):
        step_logits.append(logits[:, -1])  # [B, V]
        next_tokens = step_logits[-1].argmax(-1)  # [B]
        if forced_eos_token_id is not None and step == max_new_tokens - 1:
            next_tokens = torch.full_like(next_tokens, forced_eos_token_id)
        if eos_token_id is not None:
            next_tokens = next_tokens.masked_fill(finished, pad_token_id)
            finished |= next_tokens == eos_token_id
        sequences = torch.cat([sequences, next_tokens[:, None]], dim=-1)
        if step == max_new_tokens - 1 or bool(finished.all()):
            break
        position = sequences.shape[1] - 1
        cache_position = torch.tensor([position])
        if runner.is_encoder_decoder:
            logits = runner.decode(next_tokens[:, None], cache_position, attention_mask)
        else:
            full_mask[:, position] = 1
            position_ids = position_ids[:, -1:] + 1
            logits = runner.decode(next_tokens[:, None], full_mask, position_ids, cache_position)
    return (sequences, tuple(step_logits)) if output_logits else sequences
