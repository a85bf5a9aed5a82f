"""Exports shared by the tests of tests/export/: one CLI export per model type for the whole session."""

from __future__ import annotations

import contextlib
import importlib.util
import io

import pytest

from tests.export.helpers import ONE_LAYER
from transformers_flexcache.__main__ import main

needs_executorch = pytest.mark.skipif(
    importlib.util.find_spec("executorch") is None, reason='needs pip install ".[executorch]"'
)
CAPACITY = ["--max-batch-size", "3", "--max-cache-len", "8"]
LLAMA_MAX_CACHE_LEN = 16  # decoder-only models: a prompt of up to 9 tokens and 8 new ones
# Whisper takes its max_source_positions; decoder-only models none.
ENCODER_LEN = {name: 10 for name in ("t5", "bart", "pix2struct", "marian", "m2m_100", "mbart", "pegasus")}


def run_command(*argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -m transformers_flexcache ...`, run in this process (so that the
    package under test is this checkout's)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()


class CliExports:
    """model type -> (upstream model, .pte path, the command's stdout), exported on first use: the one-layer model
    saved with `save_pretrained`, then exported by the CLI with portable kernels (one-layer models lower fastest so)."""

    def __init__(self, tmp_path_factory):
        self._tmp_path_factory = tmp_path_factory
        self._done = {}

    def __getitem__(self, name: str):
        if name not in self._done:
            folder = self._tmp_path_factory.mktemp(name)
            upstream, _ = ONE_LAYER[name].build(seed=1)
            upstream.save_pretrained(folder / "checkpoint")
            out = str(folder / "model.pte")
            extra = ["--max-encoder-len", str(ENCODER_LEN[name])] if name in ENCODER_LEN else []
            decoder_only = not upstream.config.is_encoder_decoder
            capacity = [*CAPACITY[:3], str(LLAMA_MAX_CACHE_LEN)] if decoder_only else CAPACITY
            status, stdout, stderr = run_command(
                "export", str(folder / "checkpoint"), "--out", out, *capacity, *extra, "--backend", "portable"
            )
            assert status == 0, stderr
            self._done[name] = (upstream, out, stdout)
        return self._done[name]


@pytest.fixture(scope="session")
def cli_exports(tmp_path_factory) -> CliExports:
    return CliExports(tmp_path_factory)
