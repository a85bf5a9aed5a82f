"""The CPU compile stack: every use of torch's private names in the runtime package lives here.

- `config.py`: `compile_config_for_cpu()`, inductor options, `compile_settings`; `warmup.py`: `warmup()`;
  `hooks.py`: the compile answers to `generate.hooks.GenerateHooks` (settings around a compiled call, the compiled
  encoder, the first decoder step in the decode graph, guards checked at a call's first step, static addresses);
  `encoder.py`: the compiled encoder and cross-attention projections; `decode_attention.py`, `linear_kernels.py`:
  inductor graph passes; `packing.py`: a padded encoder call on its real tokens; `quantization.py`:
  `quantize(model, "int8")`; `gc_heap.py`: the collector around compiles; `cpu.py`: what the CPU can do.

`utils/torch_drift.py` lists every private torch name used here, with what it is for.
"""
