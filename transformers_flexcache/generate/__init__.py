"""The flexible_static generate path: one plan per call, a cache leased from the model's pool, the shape policies.

- `request.py`: how a call asks for the flexible cache; `plan.py`: `CallPlan`, one generate call, one object;
  `mixin.py`: `FlexCacheGenerationMixin`, the generate door and upstream's hooks; `pool.py`: the caches a model
  holds, its one capacity question, leases, `release`; `policies.py`: the shape policies (exact, padded, bucketed)
  and their one sizing, which the serving engine uses too; `padded_call.py`, `padded_sampling.py`: what padding does
  to one call; `signatures.py`; `hooks.py`: the one seam through which a call asks its plug-ins.

It holds no private torch code and knows nothing of serving: the compile wing (`compile/hooks.py`) and the serving
engine (`serving/request_seats.py`) answer `hooks.GenerateHooks`, whose defaults are upstream's behaviour.
"""
