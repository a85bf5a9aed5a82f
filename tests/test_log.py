"""Our warnings follow transformers' verbosity, as transformers' own do."""

from __future__ import annotations

import enum
import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch
from transformers.utils import logging as hf_logging

from tests.helpers import REPO_ROOT
from transformers_flexcache import FlexibleStaticCache
from transformers_flexcache.log import quiet_dependencies
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


# --- the dependencies' noise that the commands drop (issue 58) -----------------------------------------------------
KERNEL_LIBRARY = "Failed to load /venv/site-packages/torchao/_C_cutlass_90a.abi3.so: Could not load this library"


class KernelPreference(enum.Enum):  # stands for torchao's enums
    AUTO = "auto"


KernelPreference.__module__ = "torchao.quantization.quantize_.common.kernel_preference"


class OtherEnum(enum.Enum):
    A = "a"


def _register_constant_warning(cls) -> None:
    # torch.utils._pytree's own words (torch 2.13-2.15)
    logging.getLogger("torch.utils._pytree").warning(
        "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. Calling "
        "register_constant() on Enum subclasses is deprecated and will be an error in a future release.",
        cls,
    )


def test_commands_drop_torchao_kernel_libraries_and_its_enums_deprecation_and_nothing_else(caplog):
    caplog.set_level(logging.WARNING)
    filters_before = list(logging.getLogger("torchao").filters)  # the test session's own (tests/conftest.py)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # as `python -W default` shows deprecations
        with quiet_dependencies():
            logging.getLogger("torchao").warning(KERNEL_LIBRARY)
            _register_constant_warning(KernelPreference)
            logging.getLogger("torchao").warning("Failed to load the quantized weights")  # not a kernel library
            _register_constant_warning(OtherEnum)  # not torchao's
            warnings.warn("`torch.jit.script_method` is deprecated. Please switch", DeprecationWarning, stacklevel=1)
            warnings.warn("`torch.jit.script` is deprecated. Please switch", DeprecationWarning, stacklevel=1)
    assert [str(warning.message) for warning in caught] == ["`torch.jit.script` is deprecated. Please switch"]
    shown = [record.getMessage() for record in caplog.records]
    if not torch.cuda.is_available():
        assert KERNEL_LIBRARY not in shown
    assert "Failed to load the quantized weights" in shown
    assert [message.split(" is an Enum")[0] for message in shown if "Enum subclass" in message] == [str(OtherEnum)]
    assert logging.getLogger("torchao").filters == filters_before  # undone after the context


NOISE = ("Failed to load", "register_constant()", "script_method")


def test_the_test_command_shows_no_torchscript_deprecation_that_inductor_s_imports_raise(tmp_path):
    # The README's test command printed `torch.jit.script_method is deprecated` for every compiling test: inductor's
    # graph passes import torch.utils.mkldnn. pyproject.toml's filterwarnings drops it, by message and category.
    # tests/conftest.py drops torchao's import-time lines, which torch's log handler writes past pytest's capture.
    # torchao imported by a conftest.py of a path given: pytest loads it before any pytest_configure (tests/export's
    # conftest.py imports the package's commands); torch 2.15 logs pytree's deprecation for its enums there
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n\nif importlib.util.find_spec('torchao'):\n    import torchao  # noqa: F401\n"
    )
    (tmp_path / "test_imports.py").write_text(
        "import importlib.util\nimport warnings\n\n\ndef test_inductor_imports():\n"
        "    import torch.utils.mkldnn  # noqa: F401  (what inductor's pre-grad passes import)\n\n\n"
        "def test_torchao_imports():\n"
        "    if importlib.util.find_spec('torchao'):\n"
        "        import torchao  # noqa: F401\n\n\n"
        "def test_another_deprecation_is_still_shown():\n"
        "    warnings.warn('something else is deprecated', DeprecationWarning, stacklevel=1)\n"
    )
    command = [sys.executable, "-m", "pytest", "-c", str(REPO_ROOT / "pyproject.toml"), "--rootdir", str(tmp_path)]
    command += ["-q", "-n", "0", "-p", "no:cacheprovider", "-p", "tests.conftest", str(tmp_path / "test_imports.py")]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "something else is deprecated" in result.stdout  # the check sees warnings
    output = result.stdout + result.stderr
    assert not [word for word in NOISE if word in output], output[-3000:]


def test_bench_quick_prints_its_header_first_and_no_line_of_its_dependencies():
    command = [sys.executable, "-m", "transformers_flexcache", "bench", "--quick", "--models", "llama"]
    command += ["--strategies", "flexible_static-exact", "--calls", "1", "--new-tokens", "2", "--threads", "1"]
    command += ["--no-progress", "--no-ctranslate2", "--compile-cache", "none"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("transformers-flexcache bench: quick"), result.stdout[:500]
    assert not [line for line in result.stderr.splitlines() if any(noise in line for noise in NOISE)], result.stderr
