# Copyright 2026 The HuggingFace Team. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Tests for the static cache patch series (upstream/series), one class per patch, in upstream's style.

In a pull request each class would go into the test file named in its docstring; the 5.25.0 source distribution has
no such files, so `upstream/check.sh` copies this one into the patched tree and runs it there.
"""

import importlib
import inspect
import unittest

from transformers import is_torch_available
from transformers.testing_utils import require_torch

if is_torch_available():
    import torch
    from transformers import (
        DynamicCache,
        EncoderDecoderCache,
        GenerationConfig,
        JambaConfig,
        JambaForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        StaticCache,
        T5Config,
        T5ForConditionalGeneration,
        WhisperConfig,
        WhisperForConditionalGeneration,
    )
    from transformers.cache_utils import LinearAttentionLayer, StaticLayer
    from transformers.masking_utils import create_bidirectional_mask


def _t5(attn="eager"):
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, tie_word_embeddings=False, attn_implementation=attn,
    )  # fmt: skip
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    return model


def _static_cross_cache(config, max_cache_len=200, max_encoder_len=30, max_batch_size=4):
    return EncoderDecoderCache(
        StaticCache(config, max_cache_len=max_cache_len, max_batch_size=max_batch_size),
        StaticCache(config, max_cache_len=max_encoder_len, max_batch_size=max_batch_size),
    )


def _inputs(batch_size, length, seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, 99, (batch_size, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, length // 2 :] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@require_torch
class CrossAttentionMaskTest(unittest.TestCase):
    """Patch 1 (tests/utils/test_masking_utils.py, tests/models/t5/test_modeling_t5.py)."""

    def test_mask_spans_a_static_cross_attention_cache(self):
        config = T5Config(d_model=32, num_layers=2, num_heads=4, d_kv=8, attn_implementation="eager")
        cross_cache = StaticCache(config, max_cache_len=12)
        decoder_embeds, encoder_states = torch.zeros(2, 1, 32), torch.zeros(2, 5, 32)
        mask = create_bidirectional_mask(
            config, decoder_embeds, torch.ones(2, 5, dtype=torch.long), encoder_states, cache=cross_cache
        )
        self.assertEqual(mask.shape[-1], 12)
        self.assertTrue((mask[..., 5:] == torch.finfo(mask.dtype).min).all())
        self.assertTrue((mask[..., :5] == 0).all())

    def test_mask_is_unchanged_with_a_dynamic_cross_attention_cache(self):
        config = T5Config(d_model=32, num_layers=2, num_heads=4, d_kv=8, attn_implementation="sdpa")
        decoder_embeds, encoder_states = torch.zeros(2, 1, 32), torch.zeros(2, 5, 32)
        mask = create_bidirectional_mask(config, decoder_embeds, None, encoder_states, cache=DynamicCache())
        self.assertIsNone(mask)

    def test_cross_attention_cache_longer_than_encoder_matches_dynamic_cache(self):
        for attn in ("eager", "sdpa"):
            for with_padding in (True, False):
                with self.subTest(attn=attn, with_padding=with_padding):
                    model = _t5(attn)
                    inputs = _inputs(2, 7)
                    if not with_padding:
                        inputs.pop("attention_mask")
                    expected = model.generate(**inputs, max_new_tokens=5, do_sample=False)
                    cache = _static_cross_cache(model.config, max_batch_size=2)
                    out = model.generate(**inputs, max_new_tokens=5, do_sample=False, cache=cache)
                    self.assertListEqual(out.tolist(), expected.tolist())


@require_torch
class GetKvTest(unittest.TestCase):
    """Patch 2 (tests/utils/test_cache_utils.py)."""

    def test_get_kv_returns_views_of_the_cached_states(self):
        config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
        for cache in (DynamicCache(config=config), StaticCache(config, max_cache_len=6)):
            with self.subTest(cache=type(cache).__name__):
                keys = torch.randn(3, 2, 4, 8)
                cache.update(keys, keys.clone(), 0)
                cached_keys, cached_values = cache.get_kv(0, batch_size=2)
                self.assertEqual(cached_keys.shape[0], 2)
                torch.testing.assert_close(cached_keys[:, :, :4], keys[:2])
                cached_keys.zero_()  # a view: the write lands in the cache
                self.assertEqual(cache.get_kv(0)[0][:2].abs().sum().item(), 0.0)

    def test_encoder_decoder_cache_early_initialization(self):
        config = T5Config(d_model=32, num_layers=2, num_heads=4, d_kv=8)
        cache = _static_cross_cache(config)
        self.assertFalse(cache.is_initialized)
        cache.early_initialization(batch_size=2, num_heads=4, head_dim=8, dtype=torch.float32, device="cpu")
        self.assertTrue(cache.is_initialized)
        self.assertEqual(cache.cross_attention_cache.get_kv(0)[0].shape, (4, 4, 30, 8))


@require_torch
class CrossAttentionThroughCacheTest(unittest.TestCase):
    """Patch 3 (tests/test_modeling_common.py)."""

    def test_attention_reads_cached_cross_attention_states_through_get_kv(self):
        attention_classes = [
            ("t5", "T5Attention"), ("mt5", "MT5Attention"), ("longt5", "LongT5Attention"),
            ("pop2piano", "Pop2PianoAttention"), ("udop", "UdopAttention"),
            ("switch_transformers", "SwitchTransformersAttention"), ("bart", "BartAttention"),
            ("marian", "MarianAttention"), ("m2m_100", "M2M100Attention"), ("mbart", "MBartAttention"),
            ("pegasus", "PegasusAttention"), ("pegasus_x", "PegasusXAttention"), ("blenderbot", "BlenderbotAttention"),
            ("blenderbot_small", "BlenderbotSmallAttention"), ("bigbird_pegasus", "BigBirdPegasusDecoderAttention"),
            ("time_series_transformer", "TimeSeriesTransformerAttention"), ("biogpt", "BioGptAttention"),
            ("informer", "InformerAttention"), ("whisper", "WhisperAttention"),
            ("audioflamingo3", "AudioFlamingo3Attention"), ("pix2struct", "Pix2StructTextAttention"),
        ]  # fmt: skip
        for model_type, class_name in attention_classes:
            with self.subTest(class_name):
                module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
                source = inspect.getsource(getattr(module, class_name).forward)
                self.assertNotIn(".layers[self.layer_idx].keys", source)
                self.assertIn(".get_kv(self.layer_idx", source)


@require_torch
class StaticCacheBatchTest(unittest.TestCase):
    """Patch 4 (tests/utils/test_cache_utils.py, tests/models/jamba/test_modeling_jamba.py)."""

    def test_static_layer_serves_smaller_batches_from_its_rows(self):
        layer = StaticLayer(max_cache_len=8, max_batch_size=4)
        states = torch.randn(2, 2, 3, 8)
        keys, _ = layer.update(states, states)
        self.assertEqual(keys.shape, (2, 2, 8, 8))
        self.assertEqual(layer.keys.shape, (4, 2, 8, 8))
        self.assertEqual(keys.data_ptr(), layer.keys.data_ptr())

    def test_static_layer_refuses_a_larger_batch_before_writing(self):
        layer = StaticLayer(max_cache_len=8, max_batch_size=2)
        layer.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
        with self.assertRaisesRegex(ValueError, "max_batch_size=3"):
            layer.update(torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8))
        self.assertEqual(int(layer.get_seq_length()), 1)

    def test_linear_attention_states_are_views_of_preallocated_rows(self):
        layer = LinearAttentionLayer(max_batch_size=4)
        conv = layer.update_conv_state(torch.randn(3, 6, 4))
        self.assertEqual(conv.shape[0], 3)
        self.assertEqual(layer.conv_states[0].shape[0], 3)
        self.assertEqual(layer.conv_states[0].data_ptr(), layer._conv_storage[0].data_ptr())

    def test_one_static_cache_serves_batches_up_to_its_rows(self):
        torch.manual_seed(0)
        models = {
            "llama": LlamaForCausalLM(
                LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
            ),
            "jamba": JambaForCausalLM(
                JambaConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
                            num_experts=2, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8,
                            mamba_dt_rank=4, use_mamba_kernels=False, pad_token_id=0)
            ),
        }  # fmt: skip
        for name, model in models.items():
            model.eval()
            cache = StaticCache(model.config, max_cache_len=32, max_batch_size=4)
            for batch_size in (2, 4, 1, 3):
                with self.subTest(model=name, batch_size=batch_size):
                    input_ids = torch.randint(1, 99, (batch_size, 5), generator=torch.Generator().manual_seed(1))
                    expected = model.generate(input_ids, max_new_tokens=4, do_sample=False)
                    cache.reset()
                    out = model.generate(input_ids, max_new_tokens=4, do_sample=False, cache=cache)
                    self.assertListEqual(out.tolist(), expected.tolist())


@require_torch
class MaxEncoderLenTest(unittest.TestCase):
    """Patch 5 (tests/generation/test_utils.py, tests/generation/test_configuration_utils.py)."""

    def test_max_encoder_len_and_max_batch_size_size_the_static_cache(self):
        model = _t5()
        inputs = _inputs(2, 7)
        expected = model.generate(**inputs, max_new_tokens=5, do_sample=False)
        out = model.generate(
            **inputs, max_new_tokens=5, do_sample=False, cache_implementation="static", max_encoder_len=20,
            max_batch_size=3, return_dict_in_generate=True,
        )  # fmt: skip
        self.assertListEqual(out.sequences.tolist(), expected.tolist())
        self_attention, cross_attention = out.cache.self_attention_cache, out.cache.cross_attention_cache
        self.assertEqual(cross_attention.get_max_length(), 20)
        self.assertEqual(self_attention.layers[0].keys.shape[0], 3)

    def test_max_encoder_len_is_a_generation_option(self):
        config = GenerationConfig(cache_implementation="static", max_encoder_len=64, max_batch_size=8)
        self.assertEqual((config.max_encoder_len, config.max_batch_size), (64, 8))


@require_torch
class EarlyInitializationTest(unittest.TestCase):
    """Patch 6 (tests/generation/test_utils.py)."""

    def test_encoder_decoder_static_cache_is_initialized_before_decoding(self):
        model = _t5()
        generation_config = GenerationConfig(cache_implementation="static", num_beams=1, num_return_sequences=1)
        model_kwargs = {"encoder_outputs": model.get_encoder()(**_inputs(2, 7))}
        model._prepare_cache_for_generation(generation_config, model_kwargs, None, 2, 10)
        cache = model_kwargs["cache"]
        self.assertTrue(cache.self_attention_cache.is_initialized)
        self.assertTrue(cache.cross_attention_cache.is_initialized)


@require_torch
class UserCacheTest(unittest.TestCase):
    """Patch 7 (tests/generation/test_utils.py)."""

    def test_one_user_cache_serves_calls_of_smaller_batch_and_encoder_length(self):
        model = _t5()
        cache = _static_cross_cache(model.config)
        pointer = None
        for seed, (batch_size, length) in enumerate([(2, 19), (4, 30), (1, 5), (3, 12)]):
            with self.subTest(batch_size=batch_size, length=length):
                inputs = _inputs(batch_size, length, seed)
                expected = model.generate(**inputs, max_new_tokens=5, do_sample=False)
                cache.reset()
                out = model.generate(**inputs, max_new_tokens=5, do_sample=False, cache=cache)
                self.assertListEqual(out.tolist(), expected.tolist())
                keys = cache.cross_attention_cache.layers[0].keys
                pointer = pointer or keys.data_ptr()
                self.assertEqual(keys.data_ptr(), pointer)

    def test_a_call_that_does_not_fit_a_user_cache_is_refused_up_front(self):
        model = _t5()
        cache = _static_cross_cache(model.config, max_encoder_len=10, max_batch_size=2)
        with self.assertRaisesRegex(ValueError, "max_batch_size=3"):
            model.generate(**_inputs(3, 7), max_new_tokens=3, cache=cache)
        with self.assertRaisesRegex(ValueError, "max_cache_len=12"):
            model.generate(**_inputs(2, 12), max_new_tokens=3, cache=cache)
        self.assertFalse(cache.self_attention_cache.is_initialized)


@require_torch
class PerModelTest(unittest.TestCase):
    """Patch 8 (tests/models/whisper/test_modeling_whisper.py, tests/generation/test_utils.py)."""

    def test_whisper_masks_a_cross_attention_cache_longer_than_the_encoder(self):
        torch.manual_seed(0)
        config = WhisperConfig(
            vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, num_mel_bins=8,
            max_source_positions=16, max_target_positions=64, decoder_start_token_id=3, pad_token_id=1,
            eos_token_id=2, suppress_tokens=None, begin_suppress_tokens=None,
        )  # fmt: skip
        model = WhisperForConditionalGeneration(config).eval()
        features = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
        expected = model.generate(features, max_new_tokens=4, do_sample=False)
        cache = _static_cross_cache(config, max_cache_len=16, max_encoder_len=40, max_batch_size=2)
        out = model.generate(features, max_new_tokens=4, do_sample=False, cache=cache)
        self.assertListEqual(out.tolist(), expected.tolist())

    def test_a_cache_passed_to_generate_is_used_even_if_the_config_disables_caching(self):
        model = _t5()
        model.generation_config.use_cache = False
        inputs = _inputs(2, 7)
        expected = model.generate(**inputs, max_new_tokens=5, do_sample=False)
        cache = _static_cross_cache(model.config)
        out = model.generate(**inputs, max_new_tokens=5, do_sample=False, cache=cache)
        self.assertListEqual(out.tolist(), expected.tolist())
        self.assertEqual(int(cache.get_seq_length()), 5)


class _JambaSubclass(JambaForCausalLM if is_torch_available() else object):
    """A library model plus a method, defined outside `transformers.models`."""

    def describe(self):
        return "subclass"


@require_torch
class SubclassKernelChecksTest(unittest.TestCase):
    """Patch 9 (tests/utils/test_modeling_utils.py)."""

    def test_subclass_of_a_library_model_can_set_its_experts_implementation(self):
        self.assertTrue(JambaForCausalLM._can_set_experts_implementation())
        self.assertTrue(_JambaSubclass._can_set_experts_implementation())

    def test_cached_answer_is_per_class(self):
        _JambaSubclass._can_set_experts_implementation()
        self.assertIn("_can_set_experts_implementation_cached_value", _JambaSubclass.__dict__)
