"""The kind of a flexible cache: what distinguishes caches that cannot stand in for each other, and how to build one.

A model's pool keeps storage per kind: a call of another kind (another shape policy, or the model moved to another
device or dtype, which changes the placement of its layers) cannot use that storage. As upstream's
`StaticCache.__init__` dispatches on its layer types, `CacheKind.build` dispatches on the kind: a self-attention cache
for a decoder-only model, an encoder-decoder cache for the others, with the layer classes of the shape policy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .containers import FlexibleEncoderDecoderCache, FlexibleStaticCache
from .layers import LayerSpec
from .placement import layer_specs_for_model


@dataclass(frozen=True)
class CacheKind:
    """What a model's caches of one kind hold, whatever their capacities.

    Args:
        encoder_decoder (`bool`): a self-attention and a cross-attention cache (`FlexibleEncoderDecoderCache`), or a
            self-attention cache alone (`FlexibleStaticCache`).
        shape_policy (`str`): `"exact"`, `"padded"` or `"bucketed"` (`CacheConfig.shape_policy`): the layer classes.
        layer_specs (`tuple[LayerSpec, ...]`): each decoder layer's self-attention storage, placed where the model
            runs it (`placement.layer_specs_for_model`).
        cross_layer_specs (`tuple[LayerSpec, ...]`): each decoder layer's cross-attention storage (encoder-decoder).
    """

    encoder_decoder: bool
    shape_policy: str
    layer_specs: tuple[LayerSpec, ...]
    cross_layer_specs: tuple[LayerSpec, ...] = ()

    @classmethod
    def for_model(cls, model, *, shape_policy: str) -> CacheKind:
        """The kind of the caches that `model` needs for calls of `shape_policy`, placed as the model is now."""
        layer_specs, cross_layer_specs = layer_specs_for_model(model)
        return cls(
            encoder_decoder=bool(model.config.is_encoder_decoder),
            shape_policy=shape_policy,
            layer_specs=tuple(layer_specs),
            cross_layer_specs=tuple(cross_layer_specs or ()),
        )

    def build(
        self, capacities: Mapping[str, int], *, on_overflow: str
    ) -> FlexibleStaticCache | FlexibleEncoderDecoderCache:
        """A new cache of this kind, allocated at `capacities` (`max_batch_size`, `max_cache_len`, and
        `max_encoder_len` for an encoder-decoder kind)."""
        common = {
            "max_batch_size": capacities["max_batch_size"],
            "max_cache_len": capacities["max_cache_len"],
            "on_overflow": on_overflow,
            "shape_policy": self.shape_policy,
            "layer_specs": list(self.layer_specs),
        }
        if self.encoder_decoder:
            return FlexibleEncoderDecoderCache(
                max_encoder_len=capacities["max_encoder_len"], cross_layer_specs=list(self.cross_layer_specs), **common
            )
        return FlexibleStaticCache(**common)
