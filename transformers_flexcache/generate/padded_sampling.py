"""A sampled call padded to more rows draws the random numbers that the unpadded call draws (CPU).

Design decisions:
- Why: upstream samples a token with `torch.multinomial` over every row of the batch (`_sample`; beam sampling in
  `_get_top_k_continuations`, transformers==5.24.0), which on the CPU fills a tensor of the scores' size with
  exponential draws from the default generator, row after row (the "exponential race": the largest `p / q` wins).
  Padding rows come after the real rows, so the real rows get the very draws of the unpadded call at the first
  step, but the generator then stands further on than it would have, and every later step (and every later call)
  samples other tokens than upstream's DynamicCache at the same seed (same distribution, other tokens).
- How: a logits processor, last of the caller's (`RealRowsSampling.processor`), keeps the generator's state and the
  size of the real rows' scores just before upstream samples; a stopping criterion (`RealRowsSampling.criterion`),
  which upstream calls right after the token is chosen, puts that state back and draws what sampling the real rows
  alone draws: an exponential race over as many numbers, of the scores' dtype (what `torch.multinomial` draws for
  one sample or several without replacement; `tests/generate/test_padding.py` checks the tokens against DynamicCache's). The
  padding rows' own draws are thrown away. It costs one more race over the real rows' scores a step (about 1 ms for
  one row of a 32k vocabulary, one thread of an AMD EPYC Zen 3, where the padded call's own sampling already pays
  for every row).
- Only on the CPU: there the draws are sequential, so the real rows' draws do not depend on the padding behind
  them (checked, torch==2.13.0). On CUDA which draw an element gets follows the kernel's launch, which follows the
  tensor's size, so the padding may move the real rows' draws from the first step; not measured (no GPU here), so
  nothing is replayed there (docs/compile.md).
- Only where there are padding rows and upstream samples (`do_sample`); greedy and beam search draw nothing.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteria


class RealRowsSampling:
    """Snapshot and replay of the default CPU generator around upstream's sampling of a padded call.

    Args:
        batch_size (`int`): inputs of the call (the real rows come first).
        padded_batch_size (`int`): inputs after padding.
    """

    def __init__(self, *, batch_size: int, padded_batch_size: int):
        self.batch_size = batch_size
        self.padded_batch_size = padded_batch_size
        self.pending = None  # (generator state, draws of the real rows, dtype) between a processor and a criterion
        self.processor = _Snapshot(self)
        self.criterion = _Replay(self)

    def snapshot(self, scores: torch.Tensor) -> None:
        # scores: [B_pad * rows_per_input, V]; beam search and several returned sequences have more rows per input
        if scores.device.type != "cpu":
            return
        real_rows = scores.shape[0] // self.padded_batch_size * self.batch_size
        self.pending = (torch.get_rng_state(), real_rows * scores.shape[1], scores.dtype)

    def replay(self) -> None:
        if self.pending is None:
            return
        state, draws, dtype = self.pending
        self.pending = None
        torch.set_rng_state(state)
        torch.empty(draws, dtype=dtype).exponential_()


class _Snapshot(LogitsProcessor):
    def __init__(self, sampling: RealRowsSampling):
        self.sampling = sampling

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.sampling.snapshot(scores)
        return scores


class _Replay(StoppingCriteria):
    def __init__(self, sampling: RealRowsSampling):
        self.sampling = sampling

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.sampling.replay()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def with_processor(given: LogitsProcessorList | None, processor: LogitsProcessor) -> LogitsProcessorList:
    """The caller's logits processors, then `processor` (upstream runs its own before the caller's)."""
    return LogitsProcessorList([*(given or []), processor])
