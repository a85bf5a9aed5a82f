"""Our warnings follow transformers' verbosity, as transformers' own do."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers.utils import logging as hf_logging

from transformers_flexcache import FlexibleStaticCache
from transformers_flexcache.zoo import tiny_config


@pytest.fixture
def verbosity():
    before = hf_logging.get_verbosity()
    yield hf_logging.set_verbosity
    hf_logging.set_verbosity(before)


def _grow(cache):
    keys = torch.zeros(1, 2, 5, 8)
    cache.update(keys, keys, 0)  # 5 positions into a capacity of 4: grows, with a warning


@pytest.mark.parametrize(("level", "shown"), [(hf_logging.WARNING, True), (hf_logging.ERROR, False)])
def test_a_growth_warning_is_shown_or_silenced_with_transformers_verbosity(verbosity, caplog, level, shown):
    verbosity(level)
    cache = FlexibleStaticCache(config=tiny_config("llama"), max_batch_size=1, max_cache_len=4)
    with caplog.at_level(logging.WARNING, logger="transformers_flexcache"):
        _grow(cache)
    assert ("grows" in caplog.text) is shown
    assert cache.max_cache_len == 8  # silenced or not, the cache grew
