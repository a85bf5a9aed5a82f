"""One module per supported `model_type`, each the smallest change to upstream's modules.

Each module lists its override model classes in `FLEX_MODEL_CLASSES`.
"""
