"""Running exported programs: checks against the capacities, then torch or ExecuTorch execution.

Shapes and method contracts as in `transformers_flexcache.export`. A runner checks every call in Python before a
program runs, so that a call beyond a capacity, or out of order, raises a `ValueError` that names the value, the
limit and the fix, instead of a kernel error or an out-of-bounds write in the runtime.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.export import ExportedProgram

from .modules import ENCODER_INPUTS, FLOAT_INPUTS

CAPACITY_NAMES = ("max_batch_size", "max_cache_len", "max_encoder_len")


def input_names(is_encoder_decoder: bool, encoder_input: str | None, method_name: str) -> tuple[str, ...]:
    """The names of the tensors that `method_name` of such a program takes, in order."""
    if not is_encoder_decoder:
        if method_name == "start":
            return ("attention_mask",)
        if method_name == "forward":
            return ("tokens", "cache_position")
        return ("input_ids", "attention_mask", "position_ids", "cache_position")  # the runners' prefill and decode
    masked = encoder_input != "input_features"
    if method_name == "encoder":
        return (encoder_input, "attention_mask") if masked else (encoder_input,)
    step = ("decoder_input_ids", "encoder_hidden_states", "cache_position")
    return (*step, "encoder_attention_mask") if masked else step


def counted_position_ids(sequence_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of every cache position, as `generate` counts them and a decoder-only `forward` does: each row's
    ones up to the position, minus one; 0 for padding."""
    # sequence_mask: [B, L_max] -> [B, L_max]
    return (sequence_mask.cumsum(-1) - 1).masked_fill(sequence_mask == 0, 0)


class ProgramRunner:
    """Checks each call against the capacities and the sequence started, then runs a method. Subclasses say how.

    Attributes:
        is_encoder_decoder (`bool`): which methods the program has (see the package docstring).
        capacities (`dict[str, int]`): `max_batch_size`, `max_cache_len` and, for encoder-decoder, `max_encoder_len`.
        encoder_input (`str` or `None`): what an encoder-decoder `encoder` takes, one of `ENCODER_INPUTS`.
    """

    def __init__(self, *, is_encoder_decoder: bool, capacities: dict[str, int], encoder_input: str | None = None):
        self.is_encoder_decoder = is_encoder_decoder
        self.capacities = dict(capacities)
        self.encoder_input = encoder_input if is_encoder_decoder else None
        # (method that started it, batch, encoder length, next position) of the sequence running, per row group
        self._started: dict[str, tuple[int, int | None, int]] = {}
        # [B, L_max]: the mask of the decoder-only sequence running, and its position ids (counted once)
        self._sequence_mask: torch.Tensor | None = None
        self._sequence_positions: torch.Tensor | None = None

    @property
    def method_names(self) -> tuple[str, ...]:
        return ("encoder", "text_decoder") if self.is_encoder_decoder else ("start", "forward")

    def _run(self, method_name: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        raise NotImplementedError

    # --- checks ------------------------------------------------------------------------------------------------
    def _fail_over(self, value_name: str, value: int, limit_name: str) -> None:
        limit = self.capacities[limit_name]
        if value > limit:
            raise ValueError(
                f"{value_name}={value} exceeds {limit_name}={limit} of this exported program; export it again with "
                f"{limit_name}={value} or more"
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

    def _check_positions(self, method_name: str, cache_position: torch.Tensor, num_new: int, *, step: bool) -> int:
        if cache_position.dim() != 1 or cache_position.numel() != num_new or num_new < 1:
            raise ValueError(
                f"{method_name} needs one cache_position per new token, got {tuple(cache_position.shape)} for {num_new}"
            )
        start = int(cache_position[0])
        if step and num_new != 1:
            raise ValueError(f"{method_name} takes one token per call, got {num_new}; call it once per token")
        if not torch.equal(cache_position, torch.arange(start, start + num_new)):
            raise ValueError(
                f"cache_position={cache_position.tolist()} must be arange({start}, {start + num_new}): one position "
                "per new token, consecutive"
            )
        self._fail_over("decoder_len", start + num_new, "max_cache_len")
        return start

    def _check_continues(self, key: str, method_name: str, batch_size: int, encoder_len, start: int, starter: str):
        started = self._started.get(key)
        if started is None:
            raise ValueError(f"{method_name} was called before {starter}; call {starter} to start a sequence")
        started_batch, started_encoder_len, next_position = started
        if (batch_size, encoder_len) != (started_batch, started_encoder_len):
            what = "batch" if encoder_len is None else "batch and encoder length"
            raise ValueError(
                f"{method_name} got {what} {(batch_size, encoder_len) if encoder_len is not None else batch_size}, but "
                f"{starter} started {(started_batch, started_encoder_len) if encoder_len is not None else started_batch}"
                f"; call {starter} to start another sequence"
            )
        if start > next_position:
            raise ValueError(
                f"cache_position starts at {start}, but positions from {next_position} were never written; "
                f"continue from {next_position}"
            )

    def _advance(self, key: str, last_position: int) -> None:
        batch_size, encoder_len, next_position = self._started[key]
        self._started[key] = (batch_size, encoder_len, max(next_position, last_position + 1))

    # --- encoder-decoder ---------------------------------------------------------------------------------------
    def encoder(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Start a sequence: `(encoder input [, attention_mask [B, L_enc]])` -> `encoder_hidden_states [B, L_enc, d]`.

        Raises:
            TypeError: not the inputs of this program.
            ValueError: a batch or encoder length beyond the capacities, or inputs of mismatched shapes.
        """
        self._require(True, "encoder")
        inputs = self._inputs("encoder", inputs)
        encoder_input = inputs[0]
        batch_size = encoder_input.shape[0]
        encoder_len = self._encoder_len(encoder_input)
        if len(inputs) == 2 and tuple(inputs[1].shape) != (batch_size, encoder_len):
            raise ValueError(
                f"attention_mask {tuple(inputs[1].shape)} does not fit {self.encoder_input} "
                f"{tuple(encoder_input.shape)}: encoder needs attention_mask [batch, encoder length] = "
                f"{(batch_size, encoder_len)}"
            )
        if batch_size < 1:
            raise ValueError("encoder needs at least one row")
        self._fail_over("batch_size", batch_size, "max_batch_size")
        self._fail_over("encoder_len", encoder_len, "max_encoder_len")
        encoder_hidden_states = self._run("encoder", inputs)
        self._started["text_decoder"] = (batch_size, encoder_len, 0)
        return encoder_hidden_states

    def _encoder_len(self, encoder_input: torch.Tensor) -> int:
        if self.encoder_input == "input_features":  # the encoder's output length is fixed, 2 frames per position
            encoder_len = self.capacities["max_encoder_len"]
            if encoder_input.dim() != 3 or encoder_input.shape[-1] != 2 * encoder_len:
                raise ValueError(
                    f"input_features {tuple(encoder_input.shape)}: encoder needs input_features "
                    f"[batch, num_mel_bins, {2 * encoder_len}]"
                )
            return encoder_len
        want_dim = 2 if self.encoder_input == "input_ids" else 3
        if encoder_input.dim() != want_dim:
            raise ValueError(f"{self.encoder_input} must have {want_dim} dims, got {tuple(encoder_input.shape)}")
        return encoder_input.shape[1]

    def text_decoder(self, *inputs: torch.Tensor) -> torch.Tensor:
        """One decoder token per row: `(decoder_input_ids [B, 1], encoder_hidden_states [B, L_enc, d],
        cache_position [1] [, encoder_attention_mask [B, L_enc]])` -> logits `[B, 1, V]`.

        Raises:
            TypeError: not the inputs of this program.
            ValueError: no `encoder` call started the sequence, another batch or encoder length than the `encoder`
                call's, more than one token, a position beyond `max_cache_len` or a gap in positions.
        """
        self._require(True, "text_decoder")
        inputs = self._inputs("text_decoder", inputs)
        decoder_input_ids, encoder_hidden_states, cache_position = inputs[:3]
        batch_size, encoder_len = encoder_hidden_states.shape[:2]
        shapes_fit = decoder_input_ids.dim() == 2 and decoder_input_ids.shape[0] == batch_size
        if len(inputs) == 4:
            shapes_fit = shapes_fit and tuple(inputs[3].shape) == (batch_size, encoder_len)
        if not shapes_fit:
            raise ValueError(
                f"text_decoder inputs of mismatched shapes {[tuple(x.shape) for x in inputs]}: it needs "
                "decoder_input_ids [B, 1], encoder_hidden_states [B, L_enc, d] and encoder_attention_mask [B, L_enc]"
            )
        start = self._check_positions("text_decoder", cache_position, decoder_input_ids.shape[1], step=True)
        self._check_continues("text_decoder", "text_decoder", batch_size, encoder_len, start, "encoder")
        logits = self._run("text_decoder", inputs)
        self._advance("text_decoder", start)
        return logits

    # --- decoder-only ------------------------------------------------------------------------------------------
    # The programs have `start` and `forward` (see the package docstring); `prefill` and `decode` are this runner's
    # own: checks, then those methods.
    def prefill(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Start a sequence: `(input_ids [B, S], attention_mask [B, L_max], position_ids [B, S], cache_position [S])`
        -> logits `[B, S, V]`. Runs `start` with the mask (ones from the position after the prompt: those slots are
        hidden by the causal mask until written), then `forward`.

        `position_ids` must be those that `generate` counts from the mask (each row's ones before a position, minus
        one; 0 for padding): the program counts them itself.

        Raises:
            TypeError: not the inputs of this program.
            ValueError: a batch or position beyond the capacities, a malformed mask or `cache_position`, or
                `position_ids` other than the mask's.
        """
        self._require(False, "prefill")
        inputs = self._inputs("prefill", inputs)
        input_ids, attention_mask, position_ids, cache_position = inputs
        self._check_decoder_only_inputs("prefill", inputs)
        if int(cache_position[0]) != 0:
            raise ValueError(
                f"prefill starts a sequence at position 0, got cache_position starting at {int(cache_position[0])}; "
                "continue a sequence with decode"
            )
        self._check_positions("prefill", cache_position, input_ids.shape[1], step=False)
        sequence_mask = attention_mask.clone()
        sequence_mask[:, input_ids.shape[1] :] = 1
        counted = counted_position_ids(sequence_mask)
        self._check_position_ids(counted, position_ids, cache_position)
        self._run("start", (sequence_mask,))
        logits = self._run("forward", (input_ids, cache_position))
        self._started["decode"] = (input_ids.shape[0], None, input_ids.shape[1])
        self._sequence_mask, self._sequence_positions = sequence_mask, counted
        return logits

    def decode(self, *inputs: torch.Tensor) -> torch.Tensor:
        """One token per row after `prefill`; the inputs of `prefill` with `S = 1`. Returns logits `[B, 1, V]`.

        The mask and position ids must continue those of `prefill`: ones at the positions written since (the
        program keeps the mask that `prefill` started).

        Raises:
            TypeError: not the inputs of this program.
            ValueError: as `prefill`, no `prefill` before, another batch than the `prefill`'s, a gap in positions, or
                a mask or position ids that do not continue the sequence's.
        """
        self._require(False, "decode")
        inputs = self._inputs("decode", inputs)
        input_ids, attention_mask, position_ids, cache_position = inputs
        self._check_decoder_only_inputs("decode", inputs)
        start = self._check_positions("decode", cache_position, input_ids.shape[1], step=True)
        self._check_continues("decode", "decode", input_ids.shape[0], None, start, "prefill")
        seen = self._sequence_mask[:, : start + 1]
        if not torch.equal(attention_mask[:, : start + 1], seen):
            raise ValueError(
                f"attention_mask[:, :{start + 1}] differs from the sequence's ({seen.tolist()}): prefill fixed the "
                "mask of the prompt, and every position written since is a token (1); call prefill to start another "
                "sequence"
            )
        self._check_position_ids(self._sequence_positions, position_ids, cache_position)
        logits = self._run("forward", (input_ids, cache_position))
        self._advance("decode", start)
        return logits

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """ExecuTorch's LLM-runner method on row 0: `(tokens [1, S], cache_position [S])` -> logits `[1, S, V]`; a
        call at position 0 starts a new sequence, unpadded (as ExecuTorch's LLM runner finds the program).

        Raises:
            TypeError: not the inputs of this program.
            ValueError: more than one row, a position beyond `max_cache_len`, or a gap in positions.
        """
        self._require(False, "forward")
        tokens, cache_position = self._inputs("forward", inputs)
        if tokens.dim() != 2 or tokens.shape[0] != 1:
            raise ValueError(
                f"forward takes tokens [1, S] (row 0 only), got {tuple(tokens.shape)}; use prefill/decode"
            )
        start = self._check_positions("forward", cache_position, tokens.shape[1], step=False)
        if start > 0:
            self._check_continues("forward", "forward", 1, None, start, "forward at position 0")
        else:
            # The mask of row 0 may be a padded prompt's (prefill): reset it to the ones the `.pte` starts with.
            self._run("start", (torch.ones(1, self.capacities["max_cache_len"], dtype=torch.long),))
            self._started["forward"] = (1, None, 0)
        # prefill/decode and forward share row 0: a forward sequence ends a prefill sequence, and the other way round
        self._started.pop("decode", None)
        logits = self._run("forward", (tokens, cache_position))
        self._advance("forward", int(cache_position[-1]))
        return logits

    def _require(self, encoder_decoder: bool, method_name: str) -> None:
        if self.is_encoder_decoder != encoder_decoder:
            raise TypeError(f"this program has methods {self.method_names}, not {method_name}")
        if method_name in ("prefill", "decode"):
            self._started.pop("forward", None)

    def _check_decoder_only_inputs(self, method_name: str, inputs: tuple[torch.Tensor, ...]) -> None:
        input_ids, attention_mask, position_ids, _ = inputs
        batch_size = input_ids.shape[0]
        if input_ids.dim() != 2 or batch_size < 1:
            raise ValueError(
                f"{method_name} needs input_ids [B, S] with at least one row, got {tuple(input_ids.shape)}"
            )
        self._fail_over("batch_size", batch_size, "max_batch_size")
        want = (batch_size, self.capacities["max_cache_len"])
        if tuple(attention_mask.shape) != want:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}; it must cover every cache position: "
                f"{want} (batch, max_cache_len)"
            )
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must have the shape of input_ids")

    @staticmethod
    def _check_position_ids(counted: torch.Tensor, position_ids: torch.Tensor, cache_position: torch.Tensor) -> None:
        want = counted[:, cache_position]
        if not torch.equal(position_ids, want):
            raise ValueError(
                f"position_ids={position_ids.tolist()} are not the mask's: the program counts each row's tokens "
                f"before a position, as generate does ({want.tolist()}); pass those"
            )


class ExportedPrograms(ProgramRunner):
    """The exported methods of one wrapper, run with `torch` (they share its buffers).

    Attributes:
        programs (`dict[str, ExportedProgram]`): one per method.
        wrapper: the `ExportableEncoderDecoder` / `ExportableDecoderOnly` that owns the buffers.
    """

    def __init__(self, wrapper: nn.Module, programs: dict[str, ExportedProgram]):
        super().__init__(
            is_encoder_decoder=wrapper.is_encoder_decoder,
            capacities=wrapper.capacities(),
            encoder_input=wrapper.encoder_input,
        )
        self.wrapper = wrapper
        self.programs = programs
        # `ExportedProgram.module()` keeps the state tensors it is given, so the modules mutate the wrapper's buffers.
        self._modules = {name: program.module() for name, program in programs.items()}

    def _run(self, method_name: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        with torch.no_grad():
            return self._modules[method_name](*inputs)

    def to_executorch(self, path: str | os.PathLike, **options) -> str:
        """Lower every method into one ExecuTorch `.pte` at `path`; returns the path. Options as in
        `transformers_flexcache.export.lowering.lower_to_executorch` (`backend`, ...)."""
        from .lowering import lower_to_executorch

        return lower_to_executorch(self, path, **options).path


class ExecuTorchPrograms(ProgramRunner):
    """The methods of a `.pte` written by `to_executorch`, run in ExecuTorch's runtime.

    The capacities are read from the `.pte` itself. Its cache buffers persist between calls and are shared by the
    methods, as in the exported programs. All methods are loaded here, before any runs: loading one later would not
    share the memory the others have written.

    Args:
        path: the `.pte` file.

    Raises:
        ImportError: executorch is not installed.
        ValueError: the file lacks the methods or capacities that `to_executorch` writes.
    """

    def __init__(self, path: str | os.PathLike):
        try:
            from executorch.runtime import Runtime
        except ImportError as error:
            raise ImportError(
                'ExecuTorchPrograms needs executorch: pip install "transformers-flexcache[executorch]"'
            ) from error
        self.path = os.fspath(path)
        self.program = Runtime.get().load_program(self.path)
        names = set(self.program.method_names)
        if "is_encoder_decoder" not in names or "max_batch_size" not in names:
            raise ValueError(f"{path} has methods {sorted(names)}; write it with to_executorch")
        self.metadata = {name: self._constant(name) for name in names if self._is_constant(name)}
        is_encoder_decoder = bool(self.metadata["is_encoder_decoder"])
        encoder_input = ENCODER_INPUTS[int(self.metadata["encoder_input"])] if is_encoder_decoder else None
        super().__init__(
            is_encoder_decoder=is_encoder_decoder,
            capacities={name: int(self.metadata[name]) for name in CAPACITY_NAMES if name in self.metadata},
            encoder_input=encoder_input,
        )
        present = [name for name in self.method_names if name in names]
        if set(present) != set(self.method_names):
            raise ValueError(f"{path} has methods {sorted(names)}; write it with to_executorch")
        self._methods = {name: self.program.load_method(name) for name in present}

    def _is_constant(self, name: str) -> bool:
        return self.program.metadata(name).num_inputs() == 0

    def _constant(self, name: str):
        values = self.program.load_method(name).execute([])
        return values[0] if len(values) == 1 else list(values)

    def _run(self, method_name: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self._methods[method_name].execute(list(inputs))[0]
