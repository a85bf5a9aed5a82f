"""Override models and their registration: `modeling.py` (`FlexModelMixin`, the base of every override, which plugs
the compile wing's hooks into generate), `generic.py` (override classes built for decoder-only models that need no
module change), `catalogue.py` (which override classes exist), `registry.py` (`register`, `unregister`, `convert`),
`auto_classes.py` (AutoModel mappings and saved folders' `auto_map`), `source_check.py` (reading upstream's model code
for cache internals). The written overrides are `model_overrides/<model_type>.py`, beside the package.
"""
