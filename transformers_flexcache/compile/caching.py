"""Warm starts: the graphs one process compiled, loaded by the next (`serve --compile-cache DIR`, `bench
--compile-cache DIR`, `warmup(..., cache_dir=DIR)`, `Engine.warmup(cache_dir=DIR)`).

Design decisions:
- torch's own caches, kept in a folder of ours: while a warm-up compiles, inductor's on-disk cache
  (`TORCHINDUCTOR_CACHE_DIR`: its FX graph cache, AOT autograd's where freezing allows it, the C++ kernels it builds)
  is `DIR/<key>/inductor`, and afterwards the artifacts torch recorded of those compiles
  (`torch.compiler.save_cache_artifacts`: graphs compiled and graphs loaded) are written beside it, to be loaded
  first by the next process (`load_cache_artifacts`). A folder can be copied to another machine with the same key
  (a replica); the artifacts alone then save the graphs' compiles, the folder whole also the C++ builds.
- The key: what makes a compiled graph valid here and what torch's own keys leave out. Inductor keys a graph by its
  code, its inputs' sizes, its settings and torch's version, not by the CPU, whose instruction sets its C++ kernels
  are built for (AVX-512 kernels on an AVX2-only CPU would crash), nor by our passes' behaviour on it. So the key
  holds the CPU (vendor, family, model, instruction sets, torch's vector width), the versions of torch, transformers,
  this package and Python, torch's threads, and what the caller passes: the model's class and config, its dtype and
  quantization, the shapes and the compile settings. Weights are not in it: a frozen graph's weights are taken from
  the model at hand at a hit (`compile/fx_cache.py`), so a fine-tuned checkpoint of the same architecture loads the
  same graphs, and its own tokens come out (tested).
- Never a crash or a wrong output from the folder: after a warm-up the entry's files are listed with their SHA-256
  (`manifest.json`, written last); at the next start every listed file is checked and anything else inductor left
  there is removed (a kernel whose build a killed process left half-written would be loaded as it is: inductor
  builds straight to the final path). A missing manifest (a warm-up that did not finish), a changed or missing file,
  or artifacts that torch cannot load: a warning naming the reason, the entry emptied, and a compile from nothing.
  Only one process warms up an entry at a time (a file lock; the others wait, then load what it compiled).
- The default folder is the user's cache directory (`$XDG_CACHE_HOME` or `~/.cache`, then
  `transformers-flexcache/compile`), as vLLM keeps its compile cache under `~/.cache/vllm`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ..log import get_logger
from .cpu import cpu_facts

logger = get_logger(__name__)

ARTIFACTS = "artifacts.bin"
MANIFEST = "manifest.json"
FACTS = "key.json"
INDUCTOR = "inductor"
MAGIC = b"transformers-flexcache compile artifacts 1\n"
LOCK_TIMEOUT_S = 3600  # another process warming up the same entry: wait this long at most


def default_cache_dir() -> Path:
    """The compile cache's default folder: `$XDG_CACHE_HOME/transformers-flexcache/compile` (`~/.cache/...`)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "transformers-flexcache" / "compile"


def environment_facts() -> dict:
    """What any compiled graph of this process depends on beside its own code: the CPU, the versions, the threads."""
    import transformers

    from .._version import __version__

    facts = cpu_facts()
    return {
        "cpu": {
            "vendor": facts.vendor,
            "family": facts.family,
            "model": facts.model,
            "flags": sorted(facts.flags),
            "capability": facts.capability,
        },
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "transformers_flexcache": __version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "threads": torch.get_num_threads(),
    }


def model_facts(model, compile_config) -> dict:
    """The model's part of a key: class, config, dtype, quantization, and the compile settings (passes by their
    cache keys)."""
    from .quantization import quantization_of

    config = model.config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "_commit_hash"):
        config.pop(volatile, None)
    return {
        "class": type(model).__name__,
        "config": config,
        "dtype": str(next(model.parameters()).dtype),
        "quantization": quantization_of(model),
        "compile": _settings(compile_config),
    }


def _settings(compile_config) -> dict | None:
    if compile_config is None:
        return None
    settings = {}
    for name, value in sorted(compile_config.to_dict().items()):
        if name == "options":
            value = {key: _option(option) for key, option in sorted((value or {}).items())}
        settings[name] = _option(value)
    return settings


def _option(value):
    if isinstance(value, (tuple, list)):
        return [_option(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _option(item) for key, item in value.items()}
    uuid = getattr(value, "uuid", None)
    if callable(uuid):  # a graph pass: inductor's own key of it
        return f"{type(value).__name__}:{uuid()}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def cache_key(facts: dict) -> str:
    """The entry's name: a hash of `facts` (JSON, keys sorted)."""
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:24]


@dataclasses.dataclass
class WarmStart:
    """What a warm-up found in the compile cache and what it compiled (the server's `/health` and the CLI say it).

    Args:
        directory: the entry's folder.
        found: `"warm"` (a complete entry, loaded), `"cold"` (none yet) or `"discarded"` (an entry that did not check
            out: `reason` says why; compiled from nothing).
        reason: why an entry was discarded.
        loaded: graphs' artifacts loaded from the entry before compiling.
        traced: graphs dynamo traced during the warm-up (it traces each graph in every process: its own work is not
            cached with frozen weights, see docs/performance.md).
        hits, misses, bypasses: inductor's FX graph cache lookups during the warm-up: graphs loaded, compiled, and
            compiled without the cache (inductor said why in its log).
        aot_hits, aot_bypasses: AOT autograd's cache: graphs loaded, and traced without it (with freezing, all).
        saved: artifacts written after the warm-up (0 where none were recorded).
    """

    directory: str
    found: str
    reason: str | None = None
    loaded: int = 0
    traced: int = 0
    hits: int = 0
    misses: int = 0
    bypasses: int = 0
    aot_hits: int = 0
    aot_bypasses: int = 0
    saved: int = 0

    def describe(self) -> str:
        what = {"warm": "warm", "cold": "empty", "discarded": f"discarded ({self.reason})"}[self.found]
        return f"compile cache {self.directory}: {what}; {self.hits} graphs loaded, {self.misses} compiled" + (
            f", {self.bypasses} not cacheable" if self.bypasses else ""
        )


def _counts() -> tuple[int, ...]:
    """Dynamo's graphs traced so far, inductor's FX graph cache hits, misses and bypasses, AOT autograd's cache hits
    and bypasses."""
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return (
        counters["stats"]["unique_graphs"],
        inductor["fxgraph_cache_hit"],
        inductor["fxgraph_cache_miss"],
        inductor["fxgraph_cache_bypass"],
        aot["autograd_cache_hit"],
        aot["autograd_cache_bypass"],
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(entry: Path) -> list[Path]:
    """The entry's files that the manifest lists: all but itself, the lock and inductor's lock files."""
    return sorted(
        path
        for path in entry.rglob("*")
        if path.is_file() and path.name not in (MANIFEST, ".lock") and path.suffix != ".lock"
    )


def _check(entry: Path) -> str | None:
    """None if `entry` holds a complete, unchanged warm-up; else why not. Removes what inductor wrote there that
    the manifest does not list (see the module docstring)."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        listed = manifest["files"]
    except FileNotFoundError:
        return "no manifest: the warm-up that wrote it did not finish"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"unreadable manifest ({error})"
    for name, expected in listed.items():
        path = entry / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"] or _sha256(path) != expected["sha256"]:
            return f"{name} changed since it was written"
    for path in _files(entry):
        if str(path.relative_to(entry)) not in listed:
            path.unlink(missing_ok=True)
    return None


def _read_artifacts(path: Path) -> bytes:
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError(f"{path} is not a compile artifacts file of this package")
    header, _, payload = data[len(MAGIC) :].partition(b"\n")
    if hashlib.sha256(payload).hexdigest().encode() != header:
        raise ValueError(f"{path}: its checksum does not match its contents")
    return payload


def _write_atomic(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def _empty(entry: Path) -> None:
    for path in entry.iterdir():
        if path.name == ".lock":
            continue
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


@contextlib.contextmanager
def compile_cache(directory: str | os.PathLike, facts: dict) -> Iterator[WarmStart]:
    """Within this context torch compiles into, and loads from, the entry of `facts` in `directory` (see the module
    docstring); yields the `WarmStart`, whose counts are complete when the context exits. Written back only when the
    body finishes without an exception.

    Args:
        directory: the compile cache's folder (created if missing).
        facts (`dict`): what the graphs depend on besides the environment (`model_facts`, the shapes); the key is
            their hash with `environment_facts()`.

    Raises:
        OSError: `directory` cannot be created or written.
    """
    from filelock import FileLock
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    from torch.compiler._cache import CacheArtifactManager

    facts = {**environment_facts(), **facts}
    entry = Path(directory).expanduser().resolve() / cache_key(facts)
    entry.mkdir(parents=True, exist_ok=True)
    with FileLock(str(entry / ".lock"), timeout=LOCK_TIMEOUT_S):
        state = _open(entry)
        before = _counts()
        # the artifacts of this entry's compiles alone, not those of the process so far
        with temporary_cache_dir(str(entry / INDUCTOR)), CacheArtifactManager.with_fresh_cache():
            if state.found == "warm":
                state.loaded = _load(entry, state)
            yield state
            counts = (now - then for now, then in zip(_counts(), before, strict=True))
            state.traced, state.hits, state.misses, state.bypasses, state.aot_hits, state.aot_bypasses = counts
            _save(entry, facts, state)


def _open(entry: Path) -> WarmStart:
    present = any(path.name != ".lock" for path in entry.iterdir())
    if not present:
        return WarmStart(str(entry), "cold")
    reason = _check(entry)
    if reason is None:
        return WarmStart(str(entry), "warm")
    logger.warning("compile cache %s discarded, compiling from nothing: %s", entry, reason)
    _empty(entry)
    return WarmStart(str(entry), "discarded", reason=reason)


def _load(entry: Path, state: WarmStart) -> int:
    path = entry / ARTIFACTS
    if not path.exists():
        return 0
    try:
        info = torch.compiler.load_cache_artifacts(_read_artifacts(path))
        if info is None:  # torch's loader logs what it could not read and returns None
            raise ValueError("torch could not read them")
    except Exception as error:  # any failure of torch's loader: the entry is not used
        logger.warning(
            "compile cache %s discarded, compiling from nothing: its artifacts did not load (%s)", entry, error
        )
        _empty(entry)
        state.found, state.reason = "discarded", f"artifacts did not load ({type(error).__name__})"
        return 0
    return sum(len(names) for names in info.artifacts.values())


def _save(entry: Path, facts: dict, state: WarmStart) -> None:
    started = time.perf_counter()
    saved = torch.compiler.save_cache_artifacts()
    if saved is not None:
        payload, info = saved
        _write_atomic(entry / ARTIFACTS, MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
        state.saved = sum(len(names) for names in info.artifacts.values())
    _write_atomic(entry / FACTS, json.dumps(facts, indent=1, sort_keys=True, default=str).encode())
    listed = {
        str(path.relative_to(entry)): {"bytes": path.stat().st_size, "sha256": _sha256(path)} for path in _files(entry)
    }
    _write_atomic(entry / MANIFEST, json.dumps({"files": listed}, indent=1, sort_keys=True).encode())
    logger.info("compile cache %s written in %.1f s (%d files)", entry, time.perf_counter() - started, len(listed))
