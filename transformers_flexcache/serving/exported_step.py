"""The engine's decode step at one shape as a module of tensors, for a compiled artifact (`compile/artifact.py`).

`ExportedStep(runner, shape)` is what `torch.export` takes: `forward(*inputs, *cache_tensors) -> logits`, where
`inputs` are the tensors of the step's kwargs (`StepRunner.decode_inputs`: token ids, masks, positions; in the
order of `step_input_names`) and `cache_tensors` every tensor of the seat cache (the cache wing's `tensor_slots`: the
layers' storages and the seats' step state, in its fixed order). For the call, the cache's attributes are swapped for
those inputs, so that export sees them as inputs that the step mutates in place (the new token's keys and values),
and the compiled graph then writes into whatever storage it is given: the engine's own, at every step.

Design decisions:
- The step is the engine's own code path (`model(**decode_inputs(...))` on the seat cache), run by export instead of
  dynamo: the same graph that `serve --compile` compiles, the same passes and freezing (`write_artifact` passes the
  engine's `compile_config`).
- Only the tensors change between steps; the shape is the graph's (one graph per bucket), and the step's Python state
  (`begin_decode`'s span and window) is set inside `forward` from the shape.
- Models whose layers take masks of several kinds (a dict of masks) are refused (`step_input_names`): not yet.
"""

from __future__ import annotations

import torch
from transformers.modeling_outputs import BaseModelOutput

from ..cache import tensor_slots


def slot_names(cache) -> list[str]:
    """A name for each slot (`tensor_slots`): the owner's class and the attribute, in order (an artifact's key holds
    them: a graph takes its tensors in this order)."""
    return [f"{type(owner).__name__}.{name}" for owner, name in tensor_slots(cache)]


def step_input_names(runner, kwargs: dict) -> list[str]:
    """The tensors of a decode step's kwargs (`StepRunner.decode_inputs`), by name in a fixed order.

    Raises:
        ValueError: the model's layers take masks of several kinds (a dict of masks): not for an artifact yet.
    """
    if len(runner.mask_kinds) != 1:
        raise ValueError(
            f"{type(runner.model).__name__} takes attention masks of several kinds ({sorted(runner.mask_kinds)}): "
            "compiled artifacts take models whose layers share one mask; serve it with --compile"
        )
    return sorted(name for name, value in kwargs.items() if isinstance(value, torch.Tensor))


class ExportedStep(torch.nn.Module):
    """The decode step at `shape` (`(B, W, E_W)`) of the engine whose `StepRunner` is `runner` (module docstring)."""

    def __init__(self, runner, shape, names: list[str]):
        super().__init__()
        self.model = runner.model
        self.shape = tuple(shape)
        self.names = list(names)
        self.runner = runner  # export traces the model's parameters through `self.model`
        self.slots = tensor_slots(runner.cache)

    def cache_tensors(self) -> list[torch.Tensor]:
        return [getattr(owner, name) for owner, name in self.slots]

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        runner, cache = self.runner, self.runner.cache
        span, window, cross_window = self.shape
        inputs, storages = tensors[: len(self.names)], tensors[len(self.names) :]
        saved = self.cache_tensors()
        try:
            for (owner, name), tensor in zip(self.slots, storages, strict=True):
                setattr(owner, name, tensor)
            if runner.is_encoder_decoder:
                cache.begin_decode(span=span, window=window, cross_window=cross_window)
            else:
                cache.begin_decode(span=span, window=window)
            kwargs = {
                "cache": cache,
                "use_cache": True,
                "return_dict": True,
                **dict(zip(self.names, inputs, strict=True)),
            }
            if runner.is_encoder_decoder:
                states = runner.encoder_dummy.expand(span, cross_window, -1)
                kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=states)
            return self.model(**kwargs).logits
        finally:
            cache.end_step()
            for (owner, name), tensor in zip(self.slots, saved, strict=True):
                setattr(owner, name, tensor)
