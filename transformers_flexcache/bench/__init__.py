"""`transformers-flexcache bench`: the benchmark. Nothing outside this subpackage imports it.

Layout, one job per file: `command.py` (the command line), `stream.py` (the calls, their capacities and buckets),
`strategies.py` (the ways to run them), `torch_runner.py` (one strategy through a torch model's `generate`),
`model_run.py` (one model's stream under every strategy, compared with DynamicCache), `measure.py` (what a call
costs), `report.py` (the table, JSON and plot), `models.py` (which models it runs, from `transformers_flexcache.zoo`),
`ctranslate2.py` (the CTranslate2 peer row), `executorch.py` (the ExecuTorch rows), `serve.py` and
`serve_strategies.py` (the load benchmark), `serve_audio.py` (its transcription stream).
"""
