"""The catalogue of override classes: which model types have one, and the classes themselves.

Two kinds of override:
- written by hand: one module of `model_overrides/` per type of `SUPPORTED_MODEL_TYPES`, named after its
  `model_type`, listing its classes in `FLEX_MODEL_CLASSES`;
- generated (`generic.py`) for the decoder-only types of `GENERIC_MODEL_TYPES`, whose upstream code needs no module
  change (judged from their source). `convert` also takes any other eligible decoder-only model.

This module only lists. `models/registry.py` maps the classes into transformers' AutoModel classes, `saved.py` finds one by
name for a saved folder, and `generic.py` builds the generated ones; none of them is imported back from here but
`generic.py`.
"""

from __future__ import annotations

import importlib

import transformers
from transformers.models.auto import modeling_auto

from .generic import flex_class_for

# model_type -> module under model_overrides/ that defines its override classes (`FLEX_MODEL_CLASSES`).
SUPPORTED_MODEL_TYPES = (
    "llama",
    "t5",
    "bart",
    "whisper",
    "jamba",
    "pix2struct",
    "marian",
    "m2m_100",
    "mbart",
    "pegasus",
)
# Decoder-only model types whose `AutoModelForCausalLM` class needs no module change: `generic.py` builds their
# override classes (after reading their source), and `register()` maps them like the hand-written ones.
GENERIC_MODEL_TYPES = ("qwen2", "qwen3", "mistral", "phi3", "gpt2", "gemma3_text")


def flex_model_classes() -> list[type]:
    """Every override model class: those of the modules in `model_overrides/`, then the generated ones of
    `GENERIC_MODEL_TYPES`."""
    return written_model_classes() + generic_model_classes()


def written_model_classes() -> list[type]:
    """The override model classes of the modules in `model_overrides/` (one module per `SUPPORTED_MODEL_TYPES`)."""
    classes = []
    for model_type in SUPPORTED_MODEL_TYPES:
        module = importlib.import_module(f"model_overrides.{model_type}")
        classes.extend(module.FLEX_MODEL_CLASSES)
    return classes


def generic_model_classes() -> list[type]:
    """The generated override classes of `GENERIC_MODEL_TYPES`, one per type (its `AutoModelForCausalLM` class)."""
    names = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return [flex_class_for(getattr(transformers, names[model_type])) for model_type in GENERIC_MODEL_TYPES]
