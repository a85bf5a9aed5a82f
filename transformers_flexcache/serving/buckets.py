"""The buckets a compiled engine is given when its user names none (`transformers-flexcache serve --compile`, and the
load benchmark's compiled engine).

Design decisions:
- One seat and half the seats; half of each length capacity (the capacities are the last buckets): 3 x 2 x 2 = 12
  decode graphs for an encoder-decoder model, 6 for a decoder-only one or Whisper (one encoder length). The bucketed
  policy's own default, powers of two, is 4 x 6 x 6 = 144 graphs at the server's default capacities (8 seats, 512
  positions): about twenty minutes of compiling on a CPU before the first request.
- A batch of one gets a bucket of its own: it is what a light load runs, and on an Intel Xeon (MKL's linears, one
  thread) a compiled step of opus-mt-sized Marian took 15.0 ms in a bucket of one row against 21.1 ms in a bucket of
  4. A row's attention over up to twice its length costs little beside the linears of a decode step.
"""

from __future__ import annotations


def default_buckets(capacities: dict) -> dict[str, list[int]]:
    """`cache_config["buckets"]` for these capacities (`max_batch_size`, and `max_cache_len` / `max_encoder_len`
    where present): one seat and half the seats, half of each length."""
    buckets = {"max_batch_size": row_buckets(capacities["max_batch_size"])}
    for name in ("max_cache_len", "max_encoder_len"):
        if name in capacities:
            capacity = capacities[name]
            buckets[name] = sorted({(capacity + 1) // 2} - {capacity}) or [capacity]
    return buckets


def row_buckets(capacity: int, parts: int = 2) -> list[int]:
    """One row and each `k / parts` of the capacity of rows (`k` = 1 .. parts - 1, rounded up), below the capacity
    (which is always the last bucket): `[1, 4]` for 8 rows in halves, `[1, 2, 4, 6]` in quarters; the capacity itself
    when it is 1 (a bucket list is never empty)."""
    fractions = {-(-capacity * k // parts) for k in range(1, parts)}
    return sorted({1, *fractions} - {capacity}) or [capacity]
