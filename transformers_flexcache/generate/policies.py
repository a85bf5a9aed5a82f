"""Shape policies: what a call gets around upstream's `generate` so that a compiled step sees fixed shapes.

`POLICIES[shape_policy]` is the one place that maps `CacheConfig.shape_policy` to behaviour (a call's plan picks its
policy there, `generate.plan.CallPlan.at_door`):
- `"exact"` (`ExactPolicy`): nothing is added; each call runs at its own shapes.
- `"padded"` (`PaddedPolicy`): every call is padded to the capacities, for `torch.compile` and CUDA graphs.
- `"bucketed"` (`BucketedPolicy`): every shape is padded to the next of a few buckets (`CacheConfig.buckets_of`), so
  that a call's cost follows its size while the number of graphs stays bounded and known in advance.

What padding does to a call's inputs and outputs (`PaddedCall` and its helpers) is in `generate/padded_call.py`; a sampled
call's random draws, in `generate/padded_sampling.py`.

Shape legend: `B` the call's batch, `B_pad` the padded batch (`max_batch_size // max(num_beams,
num_return_sequences)`), `P` prompt length, `P_pad` = `max_prompt_len`, `L_enc` encoder length, `L_enc_max` =
`max_encoder_len`.

Design decisions (padded):
- Padding happens around upstream's `generate`, not inside the model: everything upstream does (special tokens,
  beam expansion, logits processors, the cache, masks) then sees one batch and one prompt length, and a compiled
  forward sees the same shapes on every call. The model code is not touched. (Whisper's generate calls upstream's
  once per segment and fallback: each of those calls is padded, see `FlexCacheInnerGenerateMixin`.)
- The sizes padded to are the answer to the call's one capacity question, asked before anything is padded (the
  call's plan, `generate.plan.CallPlan.ask`): what the model's caches of that kind hold, what the call's `cache_config` sets
  and what the call needs (rows, prompt, encoder and decoder positions), padded as the policy pads each shape
  (`padded_size`). A call over a limit with `on_overflow="error"` is refused before anything is padded.
- Padding rows repeat the call's first input (finite values, a real mask: no row is fully masked, nothing can turn
  into NaN), and a stopping criterion marks them finished from the first step, so they never keep generation going:
  `generate` stops when the real rows stop, exactly as for the unpadded call. Rows never mix in attention, so the
  real rows' tokens and scores are those of the unpadded call (up to float summation order).
- Decoder-only prompts are left-padded to `max_prompt_len` with masked pad tokens, so that the prefill has one shape
  too. A call without an `attention_mask` gets the one upstream would infer (`input_ids != pad_token_id` where that
  can be inferred) before padding, so pad tokens in the prompt stay masked. Positions come from the mask (`cumsum`),
  so real tokens keep theirs. Lengths given as `max_length` / `min_length` become new-token counts of the real prompt.
- An encoder-decoder call is encoded at its own rows, then its encoder outputs are padded with the other inputs
  (upstream's generate takes them as `encoder_outputs`): the encoder never runs the padding rows.
- Encoder outputs and their mask are right-padded to `max_encoder_len` with mask zeros (when the cache is prepared,
  after the encoder ran at the call's own length), and a mask of ones is made when the call has none: a padded
  cross-attention cache without a mask would attend to the padding, which is the silent error upstream has with long
  caches. The mask is the model input that the model's decoder reads for cross-attention (`attention_mask`;
  Whisper's `encoder_attention_mask`).
- Outputs are cut back: every batch-major tensor to its real rows, `sequences` also to the real prompt's columns.
  Attention weights and hidden states keep the padded lengths, and the returned cache holds the padded rows.
- Candidate decoding (an assistant model, prompt lookup) is padded in its decoder-only prompt only: upstream runs it
  at batch 1, its shapes change at every step, and an encoder-decoder assistant re-encodes the inputs at their own
  length, so that padded rows or encoder outputs would only break it.
- A continuation (generate given a padded cache as `cache`/`past_key_values`) runs at the shapes that cache was
  filled at: its rows (the real rows first, then the padding rows, which repeat the first real row as before), the
  same left padding of the prompt (`num_prompt_pad` of the cache) and encoder outputs padded to its
  `max_encoder_len`. Otherwise its positions would not line up with what the cache holds.
"""

from __future__ import annotations

import torch
from transformers import masking_utils
from transformers.generation.configuration_utils import GenerationMode

from ..cache import CacheConfig, is_flexible_cache
from ..log import get_logger
from .hooks import hooks_of
from .padded_call import (
    CallShape,
    PaddedCall,
    infer_attention_mask,
    left_pad_prompt,
    lengths_as_new_tokens,
    pad_encoder_outputs,
    pad_rows,
    pad_token_id,
)
from .padded_sampling import RealRowsSampling, with_processor
from .signatures import signature_of

logger = get_logger(__name__)


# Main inputs that upstream's generate encodes itself (`_prepare_text_encoder_decoder_kwargs_for_generation`; for
# Whisper, each call its generate makes to upstream's).
ENCODED_INPUTS = ("input_ids", "inputs_embeds", "flattened_patches", "input_features")


def _encodes_real_rows(model, call: PaddedCall, model_inputs: dict, input_name: str) -> bool:
    """Whether a padded encoder-decoder call is encoded before its rows are padded (see `PaddedPolicy._pad_call`):
    when it has padding rows and a main input that upstream's generate would encode (token ids, embeddings,
    Pix2Struct's patches, Whisper's log-mel features), not encoder outputs already, nor candidate decoding (whose
    assistant encodes the inputs again)."""
    return (
        model.config.is_encoder_decoder
        and call.padded_batch_size > call.batch_size
        and not call.candidates
        and input_name in ENCODED_INPUTS
        and model_inputs.get(input_name) is not None
        and model_inputs.get("encoder_outputs") is None
    )


class ExactPolicy:
    """`shape_policy="exact"`: each call runs at its own shapes; nothing is added around `generate`."""

    name = "exact"
    fixed_shapes = False  # whether a call's shapes are padded to fixed sizes (and its masks always built)

    def generate(self, plan, upstream_generate, args: tuple, kwargs: dict):
        return upstream_generate(*args, **kwargs)

    def padded_size(self, config: CacheConfig, name: str, value: int, planned: dict) -> int:
        """What a shape `name` of `value` (rows, prompt or encoder length) is padded to: itself."""
        return value

    def encoder_size(self, plan):
        """How a call's encoder length is padded when its cache is prepared (`capacity.PaddedSize`), or None: not."""
        return None

    def pad_encoder(self, plan, model_kwargs: dict) -> int | None:
        """Pad a call's encoder outputs (and their mask) in `model_kwargs` before its cache is leased; returns the
        encoder length the call then runs at (None: no encoder outputs)."""
        encoder_outputs = model_kwargs.get("encoder_outputs")
        return encoder_outputs[0].shape[1] if encoder_outputs is not None else None


class PaddedPolicy:
    """`shape_policy="padded"`: each call is padded to the capacities, and its outputs cut back (module docstring)."""

    name = "padded"
    fixed_shapes = True

    def padded_size(self, config: CacheConfig, name: str, value: int, planned: dict) -> int:
        """What a shape `name` of `value` (rows, prompt or encoder length) is padded to: the planned capacity."""
        return planned[name]

    def sizes(self, config: CacheConfig, name: str, capacity: int) -> tuple[int, ...]:
        """Every size that shape `name` is padded to under `capacity`: the capacity alone."""
        return (capacity,)

    def call_shapes(self, model, config: CacheConfig, *, max_new_tokens: int, expand: int = 1) -> list[CallShape]:
        """Every shape that calls of up to `max_new_tokens` new tokens run at under `config`, as `warmup` runs them.

        Args:
            model: the model (whether it is an encoder-decoder decides which length is padded).
            config (`CacheConfig`): must set `max_batch_size`, `max_cache_len`, and `max_encoder_len`
                (encoder-decoder) or `max_prompt_len` (decoder-only): the shapes derive from them.
            max_new_tokens (`int`): the most new tokens a call asks for.
            expand (`int`, *optional*, defaults to 1): rows per input, `max(num_beams, num_return_sequences)`.

        Raises:
            ValueError: a capacity is not set, or `max_new_tokens` does not fit `max_cache_len`.
        """
        shape_name = "max_encoder_len" if model.config.is_encoder_decoder else "max_prompt_len"
        names = ("max_batch_size", "max_cache_len", shape_name)
        missing = [name for name in names if config.limit(name) is None]
        if missing:
            example = ", ".join(f'"{name}": ...' for name in missing)
            raise ValueError(
                f"the shapes of {self.name!r} calls derive from the capacities: set {missing} in "
                f"cache_config={{{example}}}"
            )
        capacities = {name: config.limit(name) for name in names}
        # A decoder-only call writes its (padded) prompt and `new - 1` generated tokens; an encoder-decoder call its
        # decoder start token and `new - 1` generated tokens (upstream's `max_length - 1`).
        first = capacities["max_prompt_len"] if shape_name == "max_prompt_len" else 1
        if first + max_new_tokens - 1 > capacities["max_cache_len"]:
            raise ValueError(
                f"max_new_tokens={max_new_tokens} after a prompt of {first} needs max_cache_len="
                f"{first + max_new_tokens - 1}, above max_cache_len={capacities['max_cache_len']}; pass "
                f'cache_config={{"max_cache_len": {first + max_new_tokens - 1}}} or fewer new tokens'
            )
        if expand > capacities["max_batch_size"]:
            raise ValueError(f"{expand} rows per input exceed max_batch_size={capacities['max_batch_size']}")
        rows_sizes = sorted(
            {
                self.padded_size(config, "max_batch_size", batch_size * expand, capacities)
                for batch_size in range(1, capacities["max_batch_size"] // expand + 1)
            }
        )
        shapes = []
        for rows in rows_sizes:
            for length in self.sizes(config, shape_name, capacities[shape_name]):
                offset = length - 1 if shape_name == "max_prompt_len" else 0
                windows = {}  # decoder length bucket -> the most new tokens that stay in it
                for new_tokens in range(1, max_new_tokens + 1):
                    windows[self.padded_size(config, "max_cache_len", offset + new_tokens, capacities)] = new_tokens
                shapes += [CallShape(rows // expand, length, new, window) for window, new in windows.items()]
        return shapes

    def generate(self, plan, upstream_generate, args: tuple, kwargs: dict):
        """`upstream_generate(*args, **kwargs)`, padded to fixed shapes and cut back."""
        model = plan.model
        signature = signature_of(upstream_generate)
        arguments = signature.bind(*args, **kwargs).arguments
        var_keyword = next(p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD)
        extra = dict(arguments.pop(var_keyword, {}))
        generation_config = arguments.get("generation_config")
        # Read before upstream resolves the config (which fills in every length): upstream's flag of that name.
        has_default_max_length = (
            extra.get("max_length") is None
            and (generation_config is None or generation_config.max_length is None)
            and model.generation_config.max_length is None
        )
        plan.keep_resolved = True  # upstream's generate takes it, not resolved twice (`CallPlan.take_resolved`)
        resolved, model_kwargs = model._prepare_generation_config(generation_config, **extra)
        plan.generation_config = resolved
        given = plan.given
        if given is not None and not (is_flexible_cache(given) and given.shape_policy == self.name):
            return upstream_generate(*args, **kwargs)  # another cache given: run as asked
        main_param = next(iter(signature.parameters))  # `inputs` (GenerationMixin) or e.g. `input_features`
        # The plug-ins' context around the call (the compile wing: a refusal of int8 weights this CPU would saturate,
        # before anything is padded; the inductor settings that a compile_config cannot pass on by itself).
        with hooks_of(model).call_context(model, resolved):
            call = self._pad_call(
                plan,
                arguments,
                extra,
                model_kwargs,
                main_param=main_param,
                has_default_max_length=has_default_max_length,
            )
            samples = resolved.do_sample and call.padded_batch_size > call.batch_size
            if samples and {"stopping_criteria", "logits_processor"} <= signature.parameters.keys():
                call.sampling = RealRowsSampling(batch_size=call.batch_size, padded_batch_size=call.padded_batch_size)
                arguments["logits_processor"] = with_processor(
                    arguments.get("logits_processor"), call.sampling.processor
                )
            if "stopping_criteria" in signature.parameters:
                arguments["stopping_criteria"] = call.stopping_criteria(arguments.get("stopping_criteria"))
            output = upstream_generate(**arguments, **extra)
        return call.cut(output)

    def _door_sizes(self, plan, *, candidates: bool):
        """The size each shape of a call is padded to at the door (`capacity.PaddedSize`): a continuation runs at
        the shapes its cache was filled at; candidate decoding pads only its decoder-only prompt."""
        config, given = plan.config, plan.given

        def padded_size(name: str, value: int, planned) -> int:
            if given is not None and name == "max_batch_size":
                return given.batch_size
            if given is not None and name == "max_prompt_len":
                return value + given.num_prompt_pad
            if candidates and name != "max_prompt_len":
                return value
            return self.padded_size(config, name, value, planned)

        return padded_size

    def encoder_size(self, plan):
        if plan.padding is not None and plan.padding.candidates:
            return None
        config = plan.config

        def padded_size(name: str, value: int, planned) -> int:
            return self.padded_size(config, name, value, planned) if name == "max_encoder_len" else value

        return padded_size

    def _pad_call(
        self, plan, arguments: dict, extra: dict, model_kwargs: dict, *, main_param, has_default_max_length: bool
    ):
        """Pad the batch (and decoder-only prompts) of a generate call in `arguments`/`extra`, in place, to the sizes
        of the call's reservation (asked here, before anything is padded); a continuation of a given cache to the rows
        and left padding that cache holds."""
        model, resolved, given = plan.model, plan.generation_config, plan.given
        inputs = arguments.pop(main_param, None)
        inputs_tensor, input_name, prepared_kwargs = model._prepare_model_inputs(
            inputs, resolved.bos_token_id, dict(model_kwargs)
        )
        batch_size, prompt_len = inputs_tensor.shape[0], inputs_tensor.shape[1]
        expand = max(resolved.num_beams or 1, resolved.num_return_sequences or 1)
        # Upstream's candidate decoding (assistant, prompt lookup) runs a batch of one, and its candidates change the
        # shapes at every step anyway: padding rows would make it refuse the call, and an encoder-decoder assistant
        # encodes the inputs again, at their own length, but would get the padded encoder mask.
        candidates = (
            resolved.get_generation_mode(arguments.get("assistant_model")) == GenerationMode.ASSISTED_GENERATION
        )
        decoder_only = not model.config.is_encoder_decoder
        need = plan.state_need(
            resolved,
            inputs_tensor,
            input_name,
            prepared_kwargs,
            has_default_max_length=has_default_max_length,
            prompt_pad=given.num_prompt_pad if given is not None and decoder_only else 0,
            padded_prompt=decoder_only and given is None,
        )
        reservation = plan.ask(need, padded_size=self._door_sizes(plan, candidates=candidates))
        padded_batch_size = reservation.shapes["max_batch_size"] // expand
        if given is not None:
            num_prompt_pad = given.num_prompt_pad if decoder_only else 0
        else:
            num_prompt_pad = reservation.shapes.get("max_prompt_len", prompt_len) - prompt_len
        call = plan.padding = PaddedCall(
            batch_size=batch_size,
            padded_batch_size=max(batch_size, padded_batch_size),
            num_prompt_pad=num_prompt_pad,
            padded_prompt_len=prompt_len + num_prompt_pad,
            continuation=given is not None,
            candidates=candidates,
        )
        hooks_of(model).call_padded(model, plan, resolved)

        model_inputs = {key: extra[key] for key in model_kwargs if key in extra}
        # Without a main input, upstream makes placeholders from `encoder_outputs` (-100s of shape [B, L_enc]) only to
        # count the batch; passed on, they would reach e.g. Whisper's generate as `input_features`.
        if inputs is not None or extra.get(input_name) is not None or "encoder_outputs" not in model_inputs:
            model_inputs[input_name] = inputs_tensor
        if num_prompt_pad and model_inputs.get("attention_mask") is None and input_name == "input_ids":
            model_inputs["attention_mask"] = infer_attention_mask(model, resolved, inputs_tensor, model_kwargs)
        # The encoder runs at the call's own rows and its outputs are padded, as a continuation's are: encoding the
        # padding rows (copies of row 0) multiplied its work by up to max_batch_size (t5-small-sized T5, one row of 40
        # tokens padded to 4 rows: first token 282 ms against DynamicCache's 143 ms). A plug-in may encode it (the
        # compile wing: a compiled encoder, with dynamic shapes).
        with torch.no_grad():  # as upstream's generate encodes (outputs that need no grad: one decode graph)
            encoded = hooks_of(model).encode_padded_call(
                model, resolved, input_name, model_inputs, candidates=candidates
            )
            if encoded is None and _encodes_real_rows(model, call, model_inputs, input_name):
                encoder_kwargs = {key: value for key, value in model_inputs.items() if key != input_name}
                encoded = model._prepare_text_encoder_decoder_kwargs_for_generation(
                    model_inputs[input_name], encoder_kwargs, input_name, resolved
                )
        if encoded is not None:
            extra.pop(input_name, None)
            model_inputs = encoded
        model_inputs = {
            key: pad_rows(value, batch_size, call.padded_batch_size) for key, value in model_inputs.items()
        }
        for name in ("negative_prompt_ids", "negative_prompt_attention_mask"):
            if arguments.get(name) is not None:
                arguments[name] = pad_rows(arguments[name], batch_size, call.padded_batch_size)
        ids = model_inputs.get("input_ids")
        if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == prompt_len):
            call.num_prompt_pad = 0  # `sequences` then holds only new tokens: nothing to cut from it
        if num_prompt_pad:
            model_inputs = left_pad_prompt(
                model_inputs, prompt_len=prompt_len, num_pad=num_prompt_pad, pad_token_id=pad_token_id(resolved)
            )
            sources = (extra, arguments.get("generation_config"), model.generation_config)
            extra.update(lengths_as_new_tokens(resolved, sources, prompt_len=prompt_len))
        extra.update(model_inputs)
        return call

    def pad_encoder(self, plan, model_kwargs: dict) -> int | None:
        """Right-pad encoder outputs and their mask to the call's encoder length (encoder-decoder models, not for
        candidate decoding); returns the length the call runs at."""
        encoder_outputs = model_kwargs.get("encoder_outputs")
        if encoder_outputs is None or not plan.model.config.is_encoder_decoder:
            return None
        encoder_len = encoder_outputs[0].shape[1]
        if plan.padding is not None and plan.padding.candidates:
            return encoder_len
        padded_len = plan.reservation.shapes.get("max_encoder_len", encoder_len)
        if plan.padding is not None:
            plan.padding.encoder_len = encoder_len
        pad_encoder_outputs(model_kwargs, padded_len, mask_key=plan.model._flex_encoder_mask_key)
        return padded_len


class BucketedPolicy(PaddedPolicy):
    """`shape_policy="bucketed"`: as `"padded"`, but each shape is padded only up to its next bucket.

    Rows (`batch x max(num_beams, num_return_sequences)`), decoder-only prompt lengths and encoder lengths are padded
    to the smallest bucket that holds them (`CacheConfig.bucket_for`; powers of two up to each capacity unless
    `cache_config["buckets"]` lists them), and the cache's attention spans the bucket of the call's decoder length
    (`FlexibleBucketedLayer`). A call of batch 1 then costs what batch 1 costs, not `max_batch_size`, and a compiled
    decode step has one graph per combination of buckets (`bucket_shapes`), all known before the first call.
    """

    name = "bucketed"

    def padded_size(self, config: CacheConfig, name: str, value: int, planned: dict) -> int:
        return config.bucket_for(name, value, capacity=planned[name])

    def sizes(self, config: CacheConfig, name: str, capacity: int) -> tuple[int, ...]:
        return config.buckets_of(name, capacity)


POLICIES = {policy.name: policy for policy in (ExactPolicy(), PaddedPolicy(), BucketedPolicy())}


class FixedShapeMasksMixin:
    """Builds the masks of fixed-shape calls the same way at every call (a base of `FlexCacheGenerationMixin`)."""

    def create_masks_for_generate(self, **mask_kwargs):
        """Wraps `transformers.masking_utils.create_masks_for_generate` (transformers==5.25.0): the hook
        `GenerationMixin.prepare_inputs_for_generation` calls for compileable caches.

        Differences from upstream's (the model's own, else `masking_utils.create_masks_for_generate`): with a padded
        or bucketed flexible cache, a full-attention or sliding-window mask that SDPA would drop in favour of
        `is_causal` (a prompt without padding) is built anyway. Otherwise whether a prefill gets a mask would depend on
        the values of the call's attention mask, and a compiled prefill would compile once with a mask and once without.
        """
        upstream = getattr(super(), "create_masks_for_generate", masking_utils.create_masks_for_generate)
        masks = upstream(**mask_kwargs)
        cache = mask_kwargs.get("cache")
        policy = POLICIES.get(getattr(cache, "shape_policy", None))
        if policy is None or not policy.fixed_shapes:
            return masks
        if masks is not None and not (isinstance(masks, dict) and None in masks.values()):
            # Every mask built (a decode step's, a padded prompt's): nothing to add.
            return masks
        full_kwargs = {
            key: mask_kwargs.get(key) for key in ("inputs_embeds", "attention_mask", "cache", "position_ids")
        }
        config = full_kwargs["config"] = mask_kwargs["config"].get_text_config()
        builders = {
            "full_attention": masking_utils.create_causal_mask,
            "sliding_attention": masking_utils.create_sliding_window_causal_mask,
        }
        if masks is None:
            # Without `layer_types`, upstream builds one mask: a sliding-window one when the config has a window.
            all_sliding = not hasattr(config, "layer_types") and getattr(config, "sliding_window", None) is not None
            builder = builders["sliding_attention" if all_sliding else "full_attention"]
            return builder(**full_kwargs, allow_is_causal_skip=False)
        if isinstance(masks, dict):
            for layer_type, builder in builders.items():
                if layer_type in masks and masks[layer_type] is None:
                    masks[layer_type] = builder(**full_kwargs, allow_is_causal_skip=False)
        return masks
