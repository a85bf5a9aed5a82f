"""Compiled artifacts: graphs compiled once, shipped as a folder, loaded by later processes without tracing
(`transformers-flexcache compile MODEL --out DIR`, `serve --compiled DIR`, `Engine.save_artifact(DIR)`,
`Engine.warmup(artifact=DIR)`).

Design decisions (the probe behind them: docs/performance.md, "Compiled artifacts"; `scripts/probe_compile_routes.py`):
- AOTInductor, not dynamo's `aot_compile`. Each graph is a module of tensors in and tensors out (the caller builds
  it: the serving engine's decode step at one shape, `serving/exported_step.py`), `torch.export`ed and compiled by
  `torch._inductor.aoti_compile_and_package` under the settings of the caller's `compile_config` (freezing and the
  package's graph passes, as a `torch.compile` of the same step gets them), into a `.pt2` that holds a shared library
  with its frozen (packed) weights. Loading it is a `dlopen` (`torch._C._aoti.AOTIModelPackageLoader`, not
  `aoti_load_package`, which probes the C++ compiler for seconds): no dynamo, no AOT autograd, no freezing, no C++
  build. Dynamo's `aot_compile` route needed freezing off (weights as graph inputs), its guards on objects dropped
  (they do not serialize), the modules its bytecode names given back by hand, and its C++ kernels built again in a
  process with an empty inductor cache (93 s for a tiny T5's one graph in the probe).
- A folder: `manifest.json` (written last) holds the key and every file with its size and SHA-256; `graphs/` one
  `.pt2` per graph. Written to a temporary folder beside `DIR` and renamed into place, so a folder is whole or absent.
- The key (`artifact_facts`): what a compiled graph depends on and the package cannot see in the graph itself: the
  CPU (vendor, family, model, instruction sets: the library's kernels are built for them), the versions of torch,
  transformers, this package and Python, torch's threads, the model's class, config, dtype and quantization, the
  compile settings, the shapes, the caller's facts (the order of the tensors a graph takes), and the weights' SHA-256
  (frozen into the graphs: other weights would give other tokens).
- Never a wrong token from the folder: `load_artifact` answers a `LoadedArtifact`, or None with a warning that says
  why, and the caller compiles as without it: a key that differs (the warning names each fact: "torch 2.12.0 in the
  artifact, 2.13.0 here", "CPU instruction sets: avx512f missing here", "weights differ"), a missing or unreadable
  manifest, a file missing or changed since it was written, a graph the loader refuses.
- A server loads its graphs lazily (`load_artifact(..., lazy=True)`): the key and the manifest are checked before it
  serves, each graph's file (its SHA-256, then torch's loader) when the engine is idle or at the graph's first use,
  whichever comes first. A bucket set's packages are 12 x 222 MB for a t5-small-sized T5, about a second each to
  hash and load: loading them all before the first answer was most of an artifact start. A file found damaged then
  is a warning and a compile of its shape only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from ..log import get_logger
from .builds import Builds, build_workers
from .caching import environment_facts, model_facts

logger = get_logger(__name__)

FORMAT = 2  # 2: a graph equal to an earlier one of the folder is its `same_as` (no file of its own)
MANIFEST = "manifest.json"
GRAPHS = "graphs"


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of `model`'s parameters and buffers: names, dtypes, shapes and bytes (the inner tensors of a tensor
    subclass, e.g. torchao's int8 weights)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict(keep_vars=False).items()):
        for part_name, part in _plain_parts(name, tensor):
            digest.update(f"{part_name}:{part.dtype}:{tuple(part.shape)}\n".encode())
            data = part.detach().contiguous().cpu()
            digest.update(data.view(torch.uint8).numpy() if data.numel() else b"")  # its buffer: no copy
    return digest.hexdigest()


def _plain_parts(name: str, tensor: torch.Tensor):
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None or type(tensor) in (torch.Tensor, torch.nn.Parameter):
        yield name, tensor
        return
    inner_names, context = tensor.__tensor_flatten__()
    for inner in inner_names:
        yield from _plain_parts(f"{name}.{inner}", getattr(tensor, inner))


def artifact_facts(model, compile_config, *, shapes: list, caller: dict) -> dict:
    """The key of an artifact: the environment, the model and its settings, the shapes, the caller's facts, the
    weights (see the module docstring)."""
    facts = {
        "format": FORMAT,
        **environment_facts(),
        "model": model_facts(model, compile_config),
        "weights": weights_digest(model),
        "shapes": [list(shape) for shape in shapes],
        "caller": caller,
    }
    return json.loads(json.dumps(facts, sort_keys=True, default=str))  # as the manifest holds it


def differences(found: dict, expected: dict) -> list[str]:
    """What differs between an artifact's key (`found`) and this process's (`expected`), one phrase per fact."""
    phrases = []
    for name in sorted(set(found) | set(expected)):
        there, here = found.get(name), expected.get(name)
        if there == here:
            continue
        if name == "cpu":
            phrases.append(_cpu_difference(there or {}, here or {}))
        elif name == "weights":
            phrases.append("weights differ (another checkpoint, or the model changed since it was compiled)")
        elif name == "model":
            keys = sorted(key for key in set(there or {}) | set(here or {}) if (there or {}).get(key) != here.get(key))
            phrases.append(f"model {', '.join(keys)} differ")
        elif isinstance(there, dict) and isinstance(here, dict):
            phrases.extend(_part_differences(name, there, here))
        elif isinstance(there, dict | list) or isinstance(here, dict | list):
            phrases.append(f"{name} differ")
        else:
            phrases.append(f"{name} {there} in the artifact, {here} here")
    return phrases


def _part_differences(name: str, there: dict, here: dict) -> list[str]:
    """The parts of a fact of several (the caller's) that differ; the encoder's graphs with the reason."""
    phrases = []
    for key in sorted(set(there) | set(here)):
        if there.get(key) == here.get(key):
            continue
        if key == "encoder" and "encoder" not in there:
            phrases.append(
                "the artifact holds no encoder graphs (written before encoders were exported): compile it again"
            )
        elif key == "encoder":
            phrases.append(f"encoder graphs {there.get(key)} in the artifact, {here.get(key)} here")
        else:
            phrases.append(f"{name} {key} differ")
    return phrases


def _cpu_difference(there: dict, here: dict) -> str:
    missing = sorted(set(there.get("flags", ())) - set(here.get("flags", ())))
    extra = sorted(set(here.get("flags", ())) - set(there.get("flags", ())))
    parts = []
    if missing:
        parts.append(f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} missing here")
    if extra:
        parts.append(f"{', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''} only here")
    for key in ("vendor", "family", "model", "capability"):
        if there.get(key) != here.get(key):
            parts.append(f"{key} {there.get(key)} in the artifact, {here.get(key)} here")
    return "CPU: " + "; ".join(parts or ["differs"])


def graph_name(shape) -> str:
    return "_".join(str(size) for size in shape)


@dataclasses.dataclass
class ArtifactGraph:
    """One graph of an artifact, to be exported (unless `module` is an `ExportedProgram` already) and compiled.

    Args:
        module: the module (or its `ExportedProgram`).
        inputs: its example inputs (a list of tensors).
        extra: JSON-able, kept in the manifest for the loader (`LoadedArtifact.extras`).
        dynamic_shapes: `torch.export`'s, for a graph of dynamic sizes (the encoder's); None: the inputs' shapes.
        compile_config: the settings it compiles under where they are not the artifact's (an int8 encoder's
            second compile, `compile/encoder_artifact.py`).
        export_hint: what to do where `torch.export` refuses the module (appended to the `ValueError`).
    """

    module: object
    inputs: list
    extra: object = None
    dynamic_shapes: object = None
    compile_config: object = None
    export_hint: str = ""


def write_artifact(directory, facts: dict, graphs: dict, compile_config, *, progress=None, workers=None) -> dict:
    """Export and compile each graph of `graphs` (`{shape: ArtifactGraph}`, or `{shape: (module or its
    ExportedProgram, example_inputs)}`, or `(module, example_inputs, extra)` with a JSON-able `extra` kept in the
    manifest for the loader, `LoadedArtifact.extras`) with AOTInductor under the settings of `compile_config` (or the
    graph's own), into the folder `directory` (replaced as a whole when it exists); returns the manifest. A shape is
    a tuple of sizes, or of names for a graph of dynamic sizes (`("encoder",)`); it names the graph's file.

    Each graph is exported here; the builds run `workers` at a time in forked processes (`compile/builds.py`; default
    `build_workers()`: the CPUs this process may run on), and one whose process failed is built again here.

    Raises:
        ValueError: `directory` exists and is not an artifact folder (no manifest): it is left alone; or
            `torch.export` refused a graph (nothing is written).
    """
    from .config import compile_settings

    target = Path(directory).expanduser().resolve()
    if target.exists() and not (target / MANIFEST).is_file():
        if any(target.iterdir()):
            raise ValueError(
                f"{target} exists and holds no {MANIFEST}: it is not a compiled artifact, and is left alone; pass "
                "an empty or new folder"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    files, seconds, built = {}, {}, {}  # built: program signature -> the file compiled for it
    written = {}  # file -> (weights, program signature): `_WRITTEN`'s key
    finished = []

    def done(name: str, build_seconds: float) -> None:  # a package written (or the same as one)
        seconds[name] = round(seconds.get(name, 0.0) + build_seconds, 2)
        finished.append(name)
        if progress is not None:
            progress(len(finished), len(graphs))

    try:
        (staging / GRAPHS).mkdir()
        if progress is not None:
            progress(0, len(graphs))
        with Builds(build_workers(workers), done=done) as builds:
            for shape, graph in graphs.items():
                graph = graph if isinstance(graph, ArtifactGraph) else ArtifactGraph(*graph)
                config = graph.compile_config if graph.compile_config is not None else compile_config
                options = dict(getattr(config, "options", None) or {})
                started = time.perf_counter()
                name = f"{GRAPHS}/{graph_name(shape)}.pt2"
                with torch.no_grad(), compile_settings(config):
                    program = graph.module
                    if not isinstance(program, torch.export.ExportedProgram):
                        try:
                            program = torch.export.export(
                                program, tuple(graph.inputs), dynamic_shapes=graph.dynamic_shapes, strict=False
                            )
                        except Exception as error:  # any refusal of torch.export: say which graph, and why
                            reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
                            raise ValueError(
                                f"{name}: torch.export refused it ({type(error).__name__}: {reason}){graph.export_hint}"
                            ) from error
                    signature = program_signature(program, options)
                files[name] = {"shape": list(shape), **({"extra": graph.extra} if graph.extra is not None else {})}
                seconds[name] = time.perf_counter() - started  # its export; its build's seconds are added
                if signature in built:  # the same graph as an earlier one (a first decode step and the later)
                    files[name]["same_as"] = built[signature]
                    done(name, 0.0)
                    continue
                built[signature] = name
                written[name] = (facts.get("weights"), signature)
                if _link_written(written[name], staging / name):  # this process built it for another folder
                    done(name, 0.0)
                    continue
                builds.submit(name, _package_build(program, staging / name, options, config))
            builds.finish()
        for name, entry in files.items():
            if "same_as" not in entry:
                path = staging / name
                entry.update(bytes=path.stat().st_size, sha256=_sha256(path))
        manifest = {"key": facts, "files": files, "compile_seconds": seconds}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True, default=str))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for name, key in written.items():
        _WRITTEN[key] = (target / name, files[name]["sha256"])
    logger.info("compiled artifact %s written: %d graphs", target, len(files))
    return manifest


# The packages this process wrote, by the weights' SHA-256 and the program's signature (`program_signature`: its
# parameters by their storage, so only this process's): a folder of another strategy of the same model (a padded
# strategy's encoder graphs and a bucketed one's) takes such a package as a hard link (or a copy) instead of a build.
_WRITTEN: dict[tuple, tuple[Path, str]] = {}


def _link_written(key: tuple, path: Path) -> bool:
    """Put at `path` the package this process wrote for `key`, as a hard link (a copy across file systems), where it
    is still there with the bytes it was written with (its SHA-256 checked); False where not (then it is built)."""
    earlier = _WRITTEN.get(key)
    if earlier is None or key[0] is None:
        return False
    source, sha256 = earlier
    try:
        if _sha256(source) != sha256:
            return False
        try:
            os.link(source, path)
        except OSError:
            shutil.copyfile(source, path)
    except OSError:  # removed, unreadable: built instead
        path.unlink(missing_ok=True)
        return False
    logger.info(
        "compiled artifact: %s is %s, built earlier by this process (linked, not built again)", path.name, source
    )
    return True


def _package_build(program, path: Path, options: dict, config):
    """The build of one package: `aoti_compile_and_package` under `config`'s settings (run by `Builds`, in a worker
    process or here)."""

    def build() -> None:
        from torch._inductor import aoti_compile_and_package

        from .config import compile_settings

        with torch.no_grad(), compile_settings(config):
            aoti_compile_and_package(program, package_path=str(path), inductor_configs=options)

    return build


def program_signature(program: torch.export.ExportedProgram, options: dict) -> str:
    """What an AOTInductor package of `program` under `options` depends on, as a SHA-256: its graph's code, its inputs'
    and outputs' roles, each input's shape, dtype and strides, its ranges of dynamic sizes, its constants (lifted
    tensors by their values, parameters and buffers by their storage: one model's) and the options. Two descriptions
    of generate calls can differ where their graphs do not (a first decode step's cache state and the later steps'):
    one package stands for both."""
    digest = hashlib.sha256()
    parts = [program.graph_module.code, str(program.graph_signature), str(program.range_constraints)]
    parts.append(_options_text(options))
    for node in program.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            parts.append(f"{node.name} {tuple(value.shape)} {value.dtype} {value.stride()}")
        else:
            parts.append(f"{node.name} {value!r}")
    for name, tensor in sorted(program.state_dict.items()):
        parts.append(f"{name} {tuple(tensor.shape)} {tensor.dtype} {_storage_identity(tensor)}")
    for name, value in sorted(program.constants.items()):
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            parts.append(f"{name} {tuple(value.shape)} {value.dtype} {hashlib.sha256(data).hexdigest()}")
        else:
            parts.append(f"{name} {type(value).__name__} {id(value)}")  # an object: never taken as equal
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _options_text(value) -> str:
    """`value` (inductor options) as text in which a graph pass is its class and `uuid()` (what inductor's own cache
    keys a custom pass on: equal passes of two compile configs are one text, where `repr` names each object's address).
    """
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {_options_text(item)}" for key, item in sorted(value.items())) + "}"
    if isinstance(value, list | tuple):
        return "(" + ", ".join(_options_text(item) for item in value) + ")"
    uuid = getattr(value, "uuid", None)
    if callable(uuid):
        return f"{type(value).__module__}.{type(value).__qualname__}:{uuid()}"
    return repr(value)


def _storage_identity(tensor: torch.Tensor) -> str:
    """Where `tensor`'s values live: its storage's address, or for a tensor subclass without one (torchao's int8
    weights) the object itself."""
    try:
        return f"storage {tensor.untyped_storage().data_ptr()}"
    except (RuntimeError, NotImplementedError):
        return f"object {id(tensor)}"


class ArtifactRefused(Exception):
    """Why an artifact folder (or one graph of it) was not used (the message); the caller compiles instead."""


class PackageGraph:
    """One graph of an artifact folder, loaded at most once: `runner()` checks the file against the manifest (its
    size and SHA-256: torch's loader checks nothing, a flipped byte of the frozen weights would load) and loads it
    with `AOTIModelPackageLoader`. A file that fails is not used again: `error` says why, and `runner()` answers None
    (the caller compiles that shape), with a warning once."""

    def __init__(self, root: Path, name: str, entry: dict):
        self.root, self.name, self.entry = root, name, entry
        self.error: str | None = None
        self._run = None

    @property
    def loaded(self) -> bool:
        return self._run is not None

    @property
    def pending(self) -> bool:
        return self._run is None and self.error is None

    def load(self) -> None:
        """Check and load the file now. Raises ArtifactRefused: changed since it was written, or refused by torch."""
        # the package's own ops that compiled graphs call (`transformers_flexcache::int8_fbgemm_mm`, ...) are registered
        # when the passes' modules are imported: a fresh process (`serve --compiled` of an int8 model) has not yet
        from . import passes  # noqa: F401

        path = self.root / self.name
        if not path.is_file():
            raise ArtifactRefused(f"{self.root}: {self.name} is missing")
        if path.stat().st_size != self.entry["bytes"] or _sha256(path) != self.entry["sha256"]:
            raise ArtifactRefused(f"{self.root}: {self.name} changed since it was written")
        try:
            loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        except Exception as error:  # any refusal of torch's loader: the file is not used
            raise ArtifactRefused(
                f"{self.root}: {self.name} did not load ({type(error).__name__}: {error})"
            ) from error
        self._run = loader.run

    def runner(self):
        """The loaded graph's callable (tensors in a list -> outputs in a list), loaded now where it is not yet; None
        where the file is damaged or refused (`error`)."""
        if self.pending:
            try:
                self.load()
            except ArtifactRefused as error:
                self.error = str(error)
                logger.warning("compiled artifact graph not used, compiling its shape instead: %s", error)
        return self._run

    def __call__(self, tensors: list) -> list:
        run = self.runner()
        if run is None:
            raise ArtifactRefused(self.error)
        return run(tensors)


@dataclasses.dataclass
class LoadedArtifact:
    """The graphs of an artifact folder whose key was checked.

    Args:
        directory: the folder.
        graphs: `{shape: PackageGraph}`: each takes the graph's tensors (a list, in the caller's order) and returns
            its outputs (a list); loaded already, or at its first use (`load_artifact(..., lazy=True)`), or by
            `load_next()`. Shapes whose graphs were equal share one (`packages`: each once).
        seconds: the load's (the key's and the manifest's checks, and the graphs loaded then).
        extras: `{shape: extra}` of the graphs written with one (`write_artifact`).
    """

    directory: str
    graphs: dict
    seconds: float
    extras: dict = dataclasses.field(default_factory=dict)

    @property
    def packages(self) -> list:
        """The folder's packages (`PackageGraph`), each once: several shapes may share one (`same_as`)."""
        return list({id(graph): graph for graph in self.graphs.values()}.values())

    @property
    def pending(self) -> int:
        """Packages not loaded yet (nor refused)."""
        return sum(graph.pending for graph in self.packages)

    def load_next(self) -> bool:
        """Load one package not loaded yet (False: none was left); a damaged one is refused as at its first use."""
        graph = next((graph for graph in self.packages if graph.pending), None)
        if graph is None:
            return False
        graph.runner()
        return True

    def describe(self) -> str:
        packages = self.packages
        loaded = sum(graph.loaded for graph in packages)
        return f"compiled artifact {self.directory}: {loaded} of {len(packages)} graphs loaded in {self.seconds:.1f} s"


def load_artifact(directory, facts: dict, *, lazy: bool = False) -> LoadedArtifact:
    """The graphs of the artifact folder `directory` whose key equals `facts`.

    Args:
        lazy: check the manifest and the key only; each graph's file is checked and loaded at its first use (or by
            `LoadedArtifact.load_next`), and one that is damaged then is a warning and a compile of its shape
            (`PackageGraph.runner`). A server then answers before it has loaded every bucket's graph
            (docs/compile.md, "Compiled artifacts").

    Raises:
        ArtifactRefused: the folder is missing, its manifest unreadable, compiled for another key, a file missing or
            of another size, or (not `lazy`) a file changed since it was written or refused by torch's loader; the
            message says which.
    """
    started = time.perf_counter()
    root = Path(directory).expanduser().resolve()
    try:
        manifest = json.loads((root / MANIFEST).read_text())
        found, files = manifest["key"], manifest["files"]
    except FileNotFoundError as error:
        raise ArtifactRefused(f"{root} holds no {MANIFEST} (not an artifact, or one not fully written)") from error
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ArtifactRefused(f"{root}/{MANIFEST} is unreadable ({error})") from error
    if found != facts:
        raise ArtifactRefused(f"{root} was compiled for another setting: {'; '.join(differences(found, facts))}")
    graphs, extras, packages = {}, {}, {}
    for name, entry in sorted(files.items(), key=lambda item: "same_as" in item[1]):  # each file before its aliases
        if "same_as" in entry:
            if entry["same_as"] not in packages:
                raise ArtifactRefused(f"{root}: {name} is the same as {entry['same_as']}, which it does not hold")
            package = packages[entry["same_as"]]  # one loaded library for both
        else:
            path = root / name
            if not path.is_file():
                raise ArtifactRefused(f"{root}: {name} is missing")
            if path.stat().st_size != entry["bytes"]:
                raise ArtifactRefused(f"{root}: {name} changed since it was written")
            package = packages[name] = PackageGraph(root, name, entry)
        graphs[tuple(entry["shape"])] = package
        if "extra" in entry:
            extras[tuple(entry["shape"])] = entry["extra"]
    if not lazy:
        for graph in packages.values():
            graph.load()
    return LoadedArtifact(str(root), graphs, time.perf_counter() - started, extras)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
