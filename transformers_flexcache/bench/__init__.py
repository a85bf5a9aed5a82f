"""`transformers-flexcache bench`: the benchmark. Nothing outside this subpackage imports it.

Layout: `command.py` (the strategies, the stream, the command), `measure.py` (what a call costs), `report.py` (the
table, JSON and plot), `models.py` (which models it runs, from `transformers_flexcache.zoo`), `ctranslate2.py` (the
CTranslate2 peer row).
"""
