"""The queue servers of `bench-serve` (`_QueueServer`): a failure becomes the failed requests' rows, or, where the
server thread itself stops, an error that `run_stream` raises at once with its cause (not a wait for its timeout)."""

from __future__ import annotations

import pytest
import torch

from transformers_flexcache.bench.serve import run_stream
from transformers_flexcache.bench.serve_strategies import LoadRequest, _QueueServer

# far longer than either stream takes: reaching it (a TimeoutError) is the failure these tests guard against
TIMEOUT_S = 60.0


def _stream(n: int) -> list[LoadRequest]:
    return [LoadRequest(index=i, arrival=0.0, input_ids=torch.tensor([[i + 1]]), max_new_tokens=1) for i in range(n)]


class _Echo(_QueueServer):
    """Answers each request with its own input ids; the requests named in `malformed` get a result that does not
    unpack as `(tokens, scores)` (the fault that once stopped the thread after `run_batch` had returned)."""

    name = "echo"

    def __init__(self, *, malformed: frozenset[int] = frozenset()):
        self.malformed = malformed
        super().__init__()

    def run_batch(self, batch):
        (request,) = batch
        tokens = request.input_ids[0].tolist()
        return 0.0, [tokens if request.index in self.malformed else (tokens, None)]


class _BrokenQueue(_Echo):
    """Its server fails outside any batch, when it takes the request `broken_at` from its queue."""

    def __init__(self, *, broken_at: int):
        self.broken_at, self.taken = broken_at, 0
        super().__init__()

    def _next_batch(self):
        batch = super()._next_batch()
        if batch is not None:
            self.taken += 1
            if self.taken == self.broken_at:
                raise ValueError("the queue broke")
        return batch


def test_a_batch_whose_results_do_not_unpack_fails_its_requests_and_the_server_goes_on():
    strategy = _Echo(malformed=frozenset({1}))
    try:
        run_stream(strategy, _stream(3), rate=1.0, timeout=TIMEOUT_S)
        outcomes = strategy.outcomes
        assert outcomes[1].error is not None and "ValueError" in outcomes[1].error and outcomes[1].tokens is None
        assert [outcomes[i].tokens for i in (0, 2)] == [[1], [3]]  # served before and after the failed one
        assert outcomes[0].error is None and outcomes[2].error is None
        assert strategy.failure is None
    finally:
        strategy.close()


def test_a_server_thread_that_stops_outside_a_batch_makes_run_stream_raise_its_cause_at_once():
    strategy = _BrokenQueue(broken_at=2)
    try:
        with pytest.raises(RuntimeError, match="its server stopped with ValueError") as raised:
            run_stream(strategy, _stream(3), rate=1.0, timeout=TIMEOUT_S)  # not a TimeoutError
        assert isinstance(raised.value.__cause__, ValueError) and str(raised.value.__cause__) == "the queue broke"
        assert strategy.outcomes[0].error is None and strategy.outcomes[0].tokens == [1]
        unserved = [outcome for index, outcome in strategy.outcomes.items() if index != 0]  # 1, and 2 if submitted
        assert unserved and all("the server thread stopped with ValueError" in outcome.error for outcome in unserved)
        # the next stream on the stopped server raises before it submits anything
        with pytest.raises(RuntimeError, match="its server stopped"):
            run_stream(strategy, _stream(1), rate=1.0, timeout=TIMEOUT_S)
    finally:
        strategy.close()
