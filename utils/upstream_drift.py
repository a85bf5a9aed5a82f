"""What this package takes from upstream transformers, pinned by a fingerprint of each upstream object's source.

Our code copies upstream methods and changes a few lines (`Derived from`), replaces them (`Overrides`), calls them
with something around (`Wraps`) or reimplements their behaviour (`Mirrors`); other code of ours relies on upstream
internals without copying any of them. Each upstream object involved is an entry of `UPSTREAM`, with the fingerprint
of its source at each of `SUPPORTED_TRANSFORMERS_VERSIONS`. `tests/test_upstream_drift.py` fails when the installed
transformers has different code for one of them than that version had, and the message says which code of ours to
re-check, and what in it; it fails loudly on a transformers version the table does not know.

It lives outside the runtime package, as transformers keeps `utils/check_copies.py`: only the drift test uses it, and
an installed package never reads it. `python -m utils.upstream_drift` prints the installed version's fingerprints
against the table (what to paste when a version is added).

Design decisions:
- A fingerprint hashes the object's source parsed with `ast`, with docstrings dropped and without positions, so
  comments, formatting and documentation never count, only code. Fields that are empty or None are left out of the
  dump, so that the hash does not depend on the Python version (3.12 added `type_params` to every function node).
- Fingerprints are kept per supported version, because we support a window of transformers releases (setup.cfg)
  and each venv can only read its own: an entry whose source is the same at every supported version holds one
  fingerprint, an entry whose source differs holds `{version: fingerprint}` for each of them (checked by the
  tests), so that a change between two supported versions stays visible in the table. The last supported version
  is the staging target, `PINNED_TRANSFORMERS_VERSION`: the version that override docstrings name and that
  `upstream/` proposes patches against.
- The source read is the upstream model's own, behind the wrappers of `kernels` (a hard dependency of transformers
  from 5.25, which wraps the classes and functions transformers decorates: `JambaMambaMixer.__init__` is a function
  of `kernels` there), deliberately: `models.source_check.original_code` finds it, as the generic route's source check does.
  A change of `kernels`' wrapper is not a change of upstream's model code; what it changes for us is tested where it
  matters (`tests/models/test_source_check.py`, `tests/export/test_programs.py`).
- Our side of each derivation is found, never listed: a docstring in the package sources in which one of the phrases
  of `REFERENCE_VERBS` (Derived from, Overrides, Wraps, Mirrors) is followed by a dotted name in backticks refers to
  that upstream object (`find_references` reads the source files of `PACKAGES`, so a moved, split or new file needs
  no change here). The name may be the full one or a dotted suffix of it
  (`GenerationMixin._prepare_cache_for_generation`); it must match exactly one entry (`entry_for`), which the drift
  test checks for every docstring, so that a new override cannot skip this table.
- Code that relies on upstream without copying it has no such docstring: its entry names our objects in `users`, by
  qualified name (`FlexibleEncoderDecoderCache.__init__`), looked up in the sources at test time, never by file.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from transformers_flexcache.models.source_check import original_code

# The transformers releases whose upstream code our code was checked against, oldest first (setup.cfg's window).
SUPPORTED_TRANSFORMERS_VERSIONS = ("5.24.0", "5.25.0")
# The staging target: the newest supported release.
PINNED_TRANSFORMERS_VERSION = SUPPORTED_TRANSFORMERS_VERSIONS[-1]
# The fingerprint of an object that a supported version does not have (new in a later one).
ABSENT = "absent"

# The top-level packages whose docstrings are scanned for references to upstream objects.
PACKAGES = ("transformers_flexcache", "model_overrides")

# What a docstring phrase says our object does with the upstream one, as the drift message puts it.
REFERENCE_VERBS = {
    "Derived from": "is derived from it",
    "Overrides": "overrides it",
    "Wraps": "wraps it",
    "Mirrors": "mirrors it",
}
RELIES_ON = "relies on it"
_REFERENCE = re.compile(r"\b(" + "|".join(REFERENCE_VERBS) + r")\s+`([A-Za-z_][\w.]*)`")


@dataclass(frozen=True)
class Upstream:
    """One upstream object we depend on.

    Args:
        fingerprint (`str` or `Mapping[str, str]`): `fingerprint()` of its source: one string when it is the same at
            every one of `SUPPORTED_TRANSFORMERS_VERSIONS`, else one per version (`{"5.24.0": ..., "5.25.0": ...}`).
        recheck (`str`): what to compare in our code when its source changes.
        users (`tuple[str, ...]`): qualified names of our objects that rely on it without a docstring reference.
    """

    fingerprint: str | Mapping[str, str]
    recheck: str
    users: tuple[str, ...] = ()

    def fingerprint_at(self, version: str) -> str | None:
        """Its fingerprint at transformers `version`, or None when the entry holds none for it."""
        if isinstance(self.fingerprint, str):
            return self.fingerprint if version in SUPPORTED_TRANSFORMERS_VERSIONS else None
        return self.fingerprint.get(version)

    def versions_with(self, fingerprint: str) -> list[str]:
        """The supported versions at which its source had `fingerprint`."""
        return [version for version in SUPPORTED_TRANSFORMERS_VERSIONS if self.fingerprint_at(version) == fingerprint]


@dataclass(frozen=True)
class Reference:
    """A docstring of ours that names an upstream object (`upstream`, as written) with one of `REFERENCE_VERBS`."""

    upstream: str
    verb: str
    user: str  # qualified name of the documented object, or the module path for a module docstring
    path: str  # source file, relative to the folder that holds the package (e.g. "model_overrides/t5.py")


# --- fingerprints -------------------------------------------------------------------------------------------------


def resolve(name: str):
    """The object at dotted `name`: the longest importable module prefix, then attributes.

    Class attributes are read statically, so a property, classmethod or staticmethod gives its function.

    Raises:
        ImportError: no prefix of `name` is an importable module.
        AttributeError: an attribute after the module is missing.
    """
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            obj = _attribute(obj, attribute)
        return obj
    raise ImportError(f"no module of {name!r} can be imported")


def _attribute(obj, attribute: str):
    if not inspect.isclass(obj):
        return getattr(obj, attribute)
    value = inspect.getattr_static(obj, attribute)
    if isinstance(value, property):
        return value.fget
    if isinstance(value, (classmethod, staticmethod)):
        return value.__func__
    return value


def _source(obj) -> str:
    """The source of `obj`, moved left so that its first line starts at column 0 (methods are indented)."""
    lines, _ = inspect.getsourcelines(obj)
    indent = len(lines[0]) - len(lines[0].lstrip())
    # A line of a multi-line string may be indented less than the block: it is only moved left as far as it can go.
    return "".join(
        line[indent:] if len(line) > indent and not line[:indent].strip(" \t") else line.lstrip(" \t")
        for line in lines
    )


def _drop_docstrings(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    node.body = node.body[1:]


def _dump(node) -> str:
    if isinstance(node, ast.AST):
        fields = [
            f"{name}={_dump(value)}" for name, value in ast.iter_fields(node) if value is not None and value != []
        ]
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return f"[{', '.join(_dump(item) for item in node)}]"
    return repr(node)


def fingerprint(obj) -> str:
    """A short hash of the code of `obj` (a function, method or class): docstrings, comments and layout ignored.

    Raises:
        TypeError, OSError: `inspect` cannot find the source of `obj`.
    """
    tree = ast.parse(_source(obj))
    _drop_docstrings(tree)
    return hashlib.sha256(_dump(tree).encode()).hexdigest()[:16]


def current_fingerprint(name: str) -> str:
    """`fingerprint` of the upstream object `name` in the installed transformers: of upstream's own code, behind the
    wrappers of `kernels` if any (module docstring)."""
    return fingerprint(original_code(resolve(name)))


def found_fingerprint(name: str) -> str:
    """`current_fingerprint(name)`, `ABSENT` when the installed transformers has no such object, or why its source
    cannot be read."""
    try:
        return current_fingerprint(name)
    except (ImportError, AttributeError):
        return ABSENT
    except (OSError, TypeError) as error:
        return f"unreadable: {type(error).__name__}: {error}"


def installed_version() -> str:
    import transformers

    return transformers.__version__


def checked_version(installed: str | None = None) -> str:
    """The version whose fingerprints the installed transformers is compared with: itself when supported, else the
    staging target (so that an unknown version's drift messages say what differs from the newest we know)."""
    installed = installed_version() if installed is None else installed
    return installed if installed in SUPPORTED_TRANSFORMERS_VERSIONS else PINNED_TRANSFORMERS_VERSION


def unknown_version_message(installed: str) -> str:
    """Why an unsupported transformers fails the drift test, and what to do."""
    supported = ", ".join(SUPPORTED_TRANSFORMERS_VERSIONS)
    return (
        f"transformers=={installed} is not one of the versions whose upstream code this package was checked against "
        f"({supported}; SUPPORTED_TRANSFORMERS_VERSIONS in utils/upstream_drift.py): install one of them, or support "
        f"{installed}: the other drift tests compare it with {PINNED_TRANSFORMERS_VERSION}'s fingerprints and name "
        "what to re-check for each object that changed; re-check our code against each, print its fingerprints with "
        "`python -m utils.upstream_drift`, add the version to SUPPORTED_TRANSFORMERS_VERSIONS with a fingerprint for "
        "it in every entry, and widen setup.cfg's window"
    )


# --- our side: docstring references and definitions ---------------------------------------------------------------


def package_roots() -> list[str]:
    """The source folders of `PACKAGES`, found without importing them."""
    roots = []
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            roots.extend(spec.submodule_search_locations)
    return roots


def _source_files(roots: list[str]):
    """`(relative path, parsed module)` for every `.py` file under `roots`."""
    for root in roots:
        base = os.path.dirname(os.path.abspath(root))
        for folder, subfolders, files in os.walk(root):
            subfolders[:] = sorted(name for name in subfolders if name != "__pycache__")
            for file in sorted(files):
                if file.endswith(".py"):
                    path = os.path.join(folder, file)
                    with open(path, encoding="utf-8") as source:
                        tree = ast.parse(source.read(), filename=path)
                    yield os.path.relpath(path, base).replace(os.sep, "/"), tree


def _documented(tree: ast.Module):
    """`(qualified name or None for the module, node)` for the module and every class and function in it."""
    yield None, tree
    stack = [("", node) for node in reversed(tree.body)]
    while stack:
        prefix, node = stack.pop()
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            qualname = prefix + node.name
            yield qualname, node
            stack.extend((qualname + ".", child) for child in reversed(node.body))


def find_references(roots: list[str] | None = None) -> list[Reference]:
    """Every docstring reference to an upstream object in the source files under `roots` (default: `PACKAGES`)."""
    references = []
    for path, tree in _source_files(package_roots() if roots is None else roots):
        for qualname, node in _documented(tree):
            docstring = ast.get_docstring(node, clean=False) or ""
            for match in _REFERENCE.finditer(docstring):
                references.append(Reference(match.group(2), match.group(1), qualname or path, path))
    return references


def find_definitions(roots: list[str] | None = None) -> dict[str, list[str]]:
    """Qualified name of every class and function under `roots` (default: `PACKAGES`) -> the files defining it."""
    definitions: dict[str, list[str]] = {}
    for path, tree in _source_files(package_roots() if roots is None else roots):
        for qualname, _ in _documented(tree):
            if qualname is not None:
                definitions.setdefault(qualname, []).append(path)
    return definitions


def entry_for(name: str, table: dict[str, Upstream] | None = None) -> list[str]:
    """The entries of `table` (default: `UPSTREAM`) that `name` denotes: itself, or those it is a dotted suffix of."""
    table = UPSTREAM if table is None else table
    if name in table:
        return [name]
    return [key for key in table if key.endswith("." + name)]


def drift_message(
    name: str, found: str, users: list[tuple[str, str, str]], recheck: str, version: str | None = None
) -> str:
    """The failure text for upstream object `name`, whose source now fingerprints as `found` (or could not be read),
    where transformers==`version` (default: `PINNED_TRANSFORMERS_VERSION`) had another.

    Args:
        users: `(our qualified name, its file, what it does with the upstream object)` for each user.
    """
    version = PINNED_TRANSFORMERS_VERSION if version is None else version
    entry = UPSTREAM[name]
    ours = " and ".join(f"{user} ({path}), which {verb}" for user, path, verb in users) or "nothing (a stale entry)"
    same_as = entry.versions_with(found)
    known = f", which is transformers=={' and =='.join(same_as)}'s" if same_as else ""
    return (
        f"{name} changed since transformers=={version} (fingerprint {entry.fingerprint_at(version)} -> "
        f"{found}{known}); re-check {ours}: {recheck}; then record its fingerprint for transformers=={version} in "
        "UPSTREAM (utils/upstream_drift.py)"
    )


# --- the table ----------------------------------------------------------------------------------------------------

_GEN = "transformers.generation.utils.GenerationMixin"
_CACHE = "transformers.cache_utils"
_MASKS = "transformers.masking_utils"
_MODELING = "transformers.modeling_utils.PreTrainedModel"
_AUTO = "transformers.models.auto.auto_factory"
_T5 = "transformers.models.t5.modeling_t5"
_BART = "transformers.models.bart.modeling_bart"
_P2S = "transformers.models.pix2struct.modeling_pix2struct"
_WHISPER = "transformers.models.whisper.modeling_whisper"
_WHISPER_GEN = "transformers.models.whisper.generation_whisper.WhisperGenerationMixin"
_JAMBA = "transformers.models.jamba.modeling_jamba"
_LLAMA = "transformers.models.llama.modeling_llama"

UPSTREAM: dict[str, Upstream] = {
    # Model code that an override copies (`Derived from`): compare the branch our copy changes.
    f"{_T5}.T5Attention.forward": Upstream(
        "99b52aa7293bdb4e",
        "compare the cross-attention branch (projection, `is_updated`, the cross cache's `.layers[i].keys`) and the "
        "arguments passed to the attention interface",
    ),
    f"{_BART}.BartAttention.forward": Upstream(
        "c50c793d077274b7",
        "compare the cross-attention branch (projection, `is_updated`, `.layers[i].keys`) and the attention call",
    ),
    # The translation family: upstream's copies of BartAttention.forward (the same fingerprint), whose change our
    # FlexBartAttentionMixin makes once.
    **{
        f"transformers.models.{module}.{name}.forward": Upstream(
            "c50c793d077274b7",
            "it is a copy of BartAttention.forward upstream, and FlexBartAttentionMixin replaces its cross-attention "
            "branch: if it no longer equals BartAttention.forward, give this model an override of its own",
        )
        for module, name in (
            ("marian.modeling_marian", "MarianAttention"),
            ("m2m_100.modeling_m2m_100", "M2M100Attention"),
            ("mbart.modeling_mbart", "MBartAttention"),
            ("pegasus.modeling_pegasus", "PegasusAttention"),
        )
    },
    # The packed encoders (`transformers_flexcache/models/packing.py`): copies of the encoders' forward on packed tokens.
    f"{_BART}.BartEncoder.forward": Upstream(
        "af7e8ef423479a4e",
        "FlexBartForConditionalGeneration._flex_encode_packed repeats its embeddings, positions, embedding norm, mask "
        "and layer loop on packed tokens: carry changes over",
    ),
    "transformers.models.marian.modeling_marian.MarianEncoder.forward": Upstream(
        "56b4ea6ff0f2fbd9",
        "FlexMarianMTModel._flex_encode_packed repeats its embeddings, positions, mask and layer loop on packed "
        "tokens: carry changes over",
    ),
    # The layers a packed encoder runs as they are, on packed tokens: every module but self-attention must work token
    # by token, and `**kwargs` (our `packed_rows`) must reach the self-attention.
    **{
        f"transformers.models.{module}.{name}.forward": Upstream(
            fingerprint_at_pin,
            "a packed encoder runs it on packed tokens `[1, N, d]`: anything it adds that mixes positions (other than "
            "the self-attention call) or that stops passing `**kwargs` to the self-attention breaks packing",
            users=(user,),
        )
        for module, name, fingerprint_at_pin, user in (
            ("bart.modeling_bart", "BartEncoderLayer", "a594983eea1cd6f4", "FlexBartForConditionalGeneration"),
            ("marian.modeling_marian", "MarianEncoderLayer", "a594983eea1cd6f4", "FlexMarianMTModel"),
            ("t5.modeling_t5", "T5Block", "7bf918ef7eb55298", "FlexT5ForConditionalGeneration"),
            ("t5.modeling_t5", "T5LayerSelfAttention", "5cd4c44ee7804689", "FlexT5ForConditionalGeneration"),
            ("t5.modeling_t5", "T5LayerFF", "4df8c688cb75876f", "FlexT5ForConditionalGeneration"),
        )
    },
    # Per-row positions of the serving engine's decode step (`[B, 1]` lengths from its seat cache).
    f"{_T5}.T5Attention.compute_bias": Upstream(
        "5695d9f791671aa8",
        "per_row_relative_bias repeats its positions, bucket call and embedding for per-row lengths: carry changes "
        "over (the bucket arguments, the permutation)",
    ),
    f"{_P2S}.Pix2StructTextAttention.compute_bias": Upstream(
        "26f8a01d0be55a6f",
        "it is T5's with unidirectional buckets; our per-row path calls T5's per_row_relative_bias",
    ),
    f"{_BART}.BartLearnedPositionalEmbedding.forward": Upstream(
        "1f69ea205098467b",
        "our per-row path looks `[B, S]` position ids up with the offset, as upstream's `[S]` path does",
    ),
    "transformers.models.mbart.modeling_mbart.MBartLearnedPositionalEmbedding.forward": Upstream(
        "1f69ea205098467b",
        "a copy of BART's upstream; FlexLearnedPositionsMixin serves both: if they part, give mBART its own",
    ),
    "transformers.models.m2m_100.modeling_m2m_100.M2M100SinusoidalPositionalEmbedding.forward": Upstream(
        "6acaa009b434fb15",
        "our per-row path repeats the position ids, the table growth check (on the longest row) and the lookup",
    ),
    f"{_P2S}.Pix2StructTextAttention.forward": Upstream(
        "8b4bc316ec9a5d4c",
        "compare the cross-attention branch, the zero position bias added to it and the mask slicing",
    ),
    f"{_WHISPER}.WhisperAttention.forward": Upstream(
        "e70f8716cc2842c6",
        "compare the cross-attention branch: the query scaling before the product (`scaling=1.0`), the projection "
        "and the `.contiguous()` calls",
    ),
    f"{_WHISPER}.WhisperDecoder.forward": Upstream(
        "4ceeb4b9910b0ab6",
        "our copy differs only by `encoder_attention_mask` (the cross mask it builds and passes to the layers): "
        "carry every other change over, including the decorators",
    ),
    # generate internals that we override or wrap.
    f"{_GEN}._prepare_text_encoder_decoder_kwargs_for_generation": Upstream(
        "5f7b075a3b1f56e9",
        "our copy (serving engine requests) builds the same encoder kwargs and hands them to the engine instead of "
        "calling the encoder: carry over changes to the prefixes, the signature filter and the added flags",
    ),
    f"{_GEN}._prepare_cache_for_generation": Upstream(
        {"5.24.0": "67c6cfc6d1aa80bf", "5.25.0": "27ef826895912ee2"},
        "our flexible branch repeats its escape routes (a user cache with `cache_implementation`, `use_cache=False`) "
        "and its sizing (`max_cache_len` floor, batch x max(num_beams, num_return_sequences), `is_assistant`: 5.25 "
        "passes `recurrent_states_to_keep` to `activate_past_recording`, which only linear-attention layers read and "
        "ours refuse, so ours passes none); the refusing wrapper passes every other call through",
        users=("_refusing",),
    ),
    f"{_GEN}._prepare_generation_config": Upstream(
        "6d54ff1d8211c4db",
        "Pix2Struct sets `use_cache` before it merges the call's kwargs, and padded mode calls it to resolve the "
        "call's settings before upstream's generate does: check its signature, return value and copying of the "
        "given config",
    ),
    f"{_GEN}._prefill": Upstream(
        {"5.24.0": "bb93f29bb4aa1f2e", "5.25.0": "b799e46c28919b01"},
        "our wrapper runs an encoder-decoder call's first decoder step as a decode step instead (its cross-attention "
        "keys projected first): check that the unchunked prefill is still one `prepare_inputs_for_generation` and one "
        "forward, and carry over any new argument or branch (they make `first_step_compiles` say no); since 5.25 it "
        "asks `cache.get_seq_length()` of every cache, layer 0 a Mamba layer in Jamba's (ours answer from the first "
        "attention layer)",
        users=("first_step_compiled", "length_layer_idx"),
    ),
    f"{_GEN}._sample": Upstream(
        "7925bc68d8c6e2e7",
        "`first_step_compiles` assumes that greedy and sampled decoding call `_prefill` first and then run every later "
        "step in `get_compiled_call(compile_config)` when `_valid_auto_compile_criteria` holds, and that beam search "
        "compiles none: re-check which decoding methods compile their steps",
        users=("first_step_compiles", "first_step_compiled"),
    ),
    f"{_GEN}._validate_model_kwargs": Upstream(
        "b2e1c5ca398b0113",
        "Whisper hides `encoder_attention_mask` from it because the check reads only signatures; drop the wrapper if "
        "upstream starts accepting keys that reach the decoder through `**kwargs`",
    ),
    f"{_MODELING}.register_for_auto_class": Upstream(
        "a72aa1f74046eef7",
        "ours records the auto class instead of setting `_auto_class` (which would make `save_pretrained` copy "
        "model_overrides/<model_type>.py); check what upstream still derives from `_auto_class`",
    ),
    f"{_MODELING}.is_custom_code": Upstream(
        "a092d52b2d2ce7a1",
        "ours answers as the upstream class (custom only as remote code); check what else upstream now counts as "
        "custom code",
    ),
    f"{_MODELING}._can_set_experts_implementation": Upstream(
        "1d2259851aced09d",
        "ours asks the upstream class, because upstream inspects the source of the class's own module",
    ),
    f"{_MODELING}._can_set_attn_implementation": Upstream(
        "1b55581ad3661dc1",
        "ours asks the upstream class, because upstream inspects the source of the class's own module",
    ),
    # Upstream code that ours relies on without copying it.
    f"{_GEN}._prepare_static_cache": Upstream(
        "1a73044a4d7e2d6a",
        "the static cache that `flexible_static` replaces: self length from `_previous_max_cache_length`, cross "
        "length exactly the encoder's, a new cache per call; keep docs/upstream.md's PR plan and our sizing in step",
        users=("CallPlan.need_of", "CachePool.lease"),
    ),
    f"{_GEN}.generate": Upstream(
        "4a0fc811a6cdaffc",
        "padded mode binds its signature (first parameter the main input, one `**kwargs`) and passes "
        "`stopping_criteria`; the cache is prepared by `_prepare_cache_for_generation` after the encoder ran, with "
        "`max_length - 1` positions (plus the embeddings' length for `inputs_embeds`); `has_default_max_length` is "
        "read before the config is resolved (a call's plan states its need from the same steps)",
        users=("PaddedPolicy.generate", "FlexCacheInnerGenerateMixin.generate", "_has_default_max_length"),
    ),
    f"{_GEN}._prepare_model_inputs": Upstream(
        "a6e24c11df8579c8",
        "padded mode calls it for the main input's tensor, name and batch before upstream's generate runs",
        users=("PaddedPolicy._pad_call",),
    ),
    f"{_GEN}._maybe_initialize_input_ids_for_generation": Upstream(
        "8abe592e597f94c2",
        "padded mode drops the placeholder inputs it makes from `encoder_outputs` (-100s of shape [B, L_enc])",
        users=("PaddedPolicy._pad_call",),
    ),
    f"{_GEN}._expand_inputs_for_generation": Upstream(
        "2fc2ca833caea8fb",
        "padded mode takes every model input whose first axis is the batch as batch-major, as this expansion does",
        users=("pad_rows",),
    ),
    f"{_GEN}._prepare_generated_length": Upstream(
        "dca0803e630e9098",
        "padded mode turns `max_length`/`min_length` into new-token counts, which must keep taking precedence here; "
        "a call's plan mirrors how `max_length` is set, to state the decoder positions before generate runs",
        users=("lengths_as_new_tokens",),
    ),
    f"{_GEN}._prepare_decoder_input_ids_for_generation": Upstream(
        "795bf731d93e9d18",
        "a call's plan mirrors the length of the decoder inputs: those given, with the start token put first unless "
        "every row starts with it (not for Whisper or Donut); the start token alone when none is given",
    ),
    f"{_GEN}.prepare_inputs_for_generation": Upstream(
        "b767bffb7cdd3388",
        "it must still call the model's `create_masks_for_generate` hook for compileable caches, with the keyword "
        "arguments ours reads (`config`, `inputs_embeds`, `attention_mask`, `cache`, `position_ids`)",
        users=("FixedShapeMasksMixin.create_masks_for_generate",),
    ),
    "transformers.generation.configuration_utils.GenerationConfig.validate": Upstream(
        "12f9a79aed88e1ae",
        "`flexible_static` is accepted by appending it to the module-level `ALL_CACHE_IMPLEMENTATIONS`, which "
        "`validate` must keep reading at call time",
        users=("_accept_name",),
    ),
    f"{_MASKS}.create_masks_for_generate": Upstream(
        {"5.24.0": "c4590fdbf37ae534", "5.25.0": "f92423a2b0c58809"},
        "ours calls it and replaces a dropped full-attention mask (`None`, or `masks['full_attention'] is None`), or "
        "a dropped sliding-window one with `create_sliding_window_causal_mask` (what 5.25 maps `hybrid_sliding` to)",
    ),
    f"{_MASKS}.create_causal_mask": Upstream(
        {"5.24.0": "97b1fd3b4a4ac010", "5.25.0": "ff9d54e5b614812a"},
        "padded mode needs `allow_is_causal_skip=False`, and the mask sized by `get_mask_sizes`; SDPA must keep "
        "dropping a decode mask only for caches that are not compileable (5.25 changed only its decorator: "
        "`past_key_values` shown in its signature)",
        users=("FlexiblePaddedLinearAttentionLayer",),
    ),
    f"{_MASKS}.create_bidirectional_mask": Upstream(
        {"5.24.0": "e199d91ca7f804e3", "5.25.0": "85642f2f29be289f"},
        "the cross mask of T5, BART and Pix2Struct (and our Whisper decoder's) comes from it, sized by "
        "`encoder_hidden_states` of the call, which is the length `get_kv` returns; check that it still ignores the "
        "cache and still returns None for an all-ones mask under SDPA (5.25 added `position_ids`, for packed "
        "sequences: our callers pass none, as upstream's T5, BART, Pix2Struct and Whisper decoders)",
        users=("FlexWhisperDecoder.forward", "FlexibleEncoderDecoderCache.cross_attention_kv"),
    ),
    # Cache internals.
    f"{_CACHE}.Cache.__init__": Upstream(
        "58c8a2efac688f7e",
        "FlexibleStaticCache passes its own layers (`layers=`); check the other attributes it sets",
        users=("FlexibleStaticCache.__init__",),
    ),
    f"{_CACHE}.Cache.get_seq_length": Upstream(
        {"5.24.0": "a0a8a6ad3daac15e", "5.25.0": "cb9f6ea239b1a78d"},
        "ours answers a linear-attention layer index from the first attention layer (`length_layer_idx`) and passes "
        "upstream an attention layer's index: check what upstream now reads from a layer for its length (5.25 reads "
        "any layer's own, a linear-attention layer's token count included)",
    ),
    f"{_CACHE}.Cache.increase_count": Upstream(
        {"5.24.0": ABSENT, "5.25.0": "b5f1023f029b4f5c"},
        "5.25's Jamba mixer reports each decode step through it to the layer's `increase_count`, which ours ignore "
        "(the length is the attention layers'): check that it still only reaches the layer",
        users=("FlexibleLinearAttentionLayer.increase_count", "FlexibleSeatLinearAttentionLayer.increase_count"),
    ),
    f"{_CACHE}.Cache.get_recurrent_states_to_keep": Upstream(
        {"5.24.0": ABSENT, "5.25.0": "3bfad0ceb59468ce"},
        "5.25's Jamba mixer asks it how many intermediate recurrent states to hand `update_recurrent_state`; it must "
        "answer 0 for layers whose `record_past` is False (ours, which refuse past recording), so that they get one "
        "state, or a list of which ours keep the last",
        users=("last_recurrent_state", "FlexibleLinearAttentionLayer.activate_past_recording"),
    ),
    f"{_CACHE}.Cache.early_initialization": Upstream(
        "015e1b2f23a910f3",
        "ours only makes room for the batch (storage exists from construction); keep its signature",
        users=("FlexibleLayerCache.early_initialization", "FlexibleEncoderDecoderCache.early_initialization"),
    ),
    f"{_CACHE}.Cache.has_previous_state": Upstream(
        "beb6560988872269",
        "it reads `layer.has_previous_state[state_idx]` from our linear-attention layers",
        users=("FlexibleLinearAttentionLayer.__init__", "FlexibleLinearAttentionLayer.reset"),
    ),
    f"{_CACHE}.Cache.is_recording_past": Upstream(
        "7f5d1323e7361e75",
        "it reads `layer.record_past` from our linear-attention layers",
        users=("FlexibleLinearAttentionLayer.activate_past_recording",),
    ),
    f"{_CACHE}.CacheLayerMixin": Upstream(
        "a27bb2cc580e0b97",
        "FlexibleStaticLayer subclasses it without calling its `__init__` and exposes `keys`/`values` as live "
        "views: check new abstract methods and attributes that upstream code reads from layers",
        users=("FlexibleStaticLayer",),
    ),
    f"{_CACHE}.LinearAttentionCacheLayerMixin": Upstream(
        {"5.24.0": "98e3de5f80302045", "5.25.0": "4543513d2311fb38"},
        "our linear-attention layers subclass it without calling its `__init__`: check new abstract methods, state "
        "its `__init__` sets and methods that read it (5.25: `cumulative_length_linear`, read by `get_seq_length`, "
        "`increase_count`, `reset` and `crop`, all of which ours define), and attributes read from layers",
        users=("FlexibleLinearAttentionLayer", "FlexibleSeatLinearAttentionLayer"),
    ),
    f"{_CACHE}.StaticLayer": Upstream(
        "6ee2f5577d958b67",
        "the padded layers reproduce its compile contract (static addresses, a 0-d `cumulative_length`, "
        "`get_mask_sizes` at capacity, zeroing on reset) at any batch; the exact layer's `crop` refusal follows it",
        users=("FlexiblePaddedLayer", "FlexibleStaticLayer.crop"),
    ),
    f"{_CACHE}.LinearAttentionLayer": Upstream(
        {"5.24.0": "af5c93646e818516", "5.25.0": "c9f194859357540f"},
        "`update_conv_state` reproduces its prefill left-padding to the kernel and its decode concatenation; "
        "`update_recurrent_state` takes a state or (5.25) a list of the last states, of which it keeps the last",
        users=("FlexibleLinearAttentionLayer.update_conv_state", "FlexiblePaddedLinearAttentionLayer"),
    ),
    f"{_CACHE}.StaticCache.__init__": Upstream(
        "2ed96253da7d4536",
        "our layers are sized from the config as it sizes its layers (`get_layer_types_and_kwargs`, "
        "`get_head_shapes`)",
        users=("layer_specs_from_config",),
    ),
    f"{_CACHE}.get_layer_types_and_kwargs": Upstream(
        "86ccd1e062c43c81",
        "our layer types come from it; a new layer type must be refused or supported",
        users=("layer_specs_from_config",),
    ),
    "transformers.configuration_utils.get_head_shapes": Upstream(
        "691a9c3ac158fad2",
        "our kv heads and head dims come from it",
        users=("layer_specs_from_config",),
    ),
    f"{_CACHE}.EncoderDecoderCache.__init__": Upstream(
        "a52be3230380d188",
        "FlexibleEncoderDecoderCache passes two caches and relies on it setting only `self_attention_cache`, "
        "`cross_attention_cache` and `is_updated` (it never calls `Cache.__init__`)",
        users=("FlexibleEncoderDecoderCache.__init__",),
    ),
    f"{_CACHE}.EncoderDecoderCache.crop": Upstream(
        "69fcbd39d76548dc",
        "ours crops the self-attention half, where upstream refuses caches that are not DynamicCaches; check what "
        "else upstream's crop now does (e.g. to the cross-attention half)",
    ),
    f"{_CACHE}.EncoderDecoderCache.reset": Upstream(
        "cdaa59dd4c34ed9f",
        "inherited: `generate` resets our cache through it (both caches, then `is_updated`)",
        users=("FlexibleEncoderDecoderCache._renew_from",),
    ),
    # Model code that our "no change needed" claims rest on (module docstrings of model_overrides/*.py).
    f"{_T5}.T5Stack.forward": Upstream(
        "63ded9a56b4564c7",
        "it must keep building the cross mask from the encoder mask and `encoder_hidden_states` only, and taking "
        "positions from `get_seq_length`",
        users=("FlexT5ForConditionalGeneration",),
    ),
    f"{_BART}.BartDecoder.forward": Upstream(
        "603f3159d38cc539",
        "learned positions from `get_seq_length()`, the causal mask from `get_mask_sizes`, the cross mask from the "
        "encoder mask and `encoder_hidden_states`",
        users=("FlexBartForConditionalGeneration",),
    ),
    f"{_P2S}.Pix2StructTextModel.forward": Upstream(
        "23af4396d10876a9",
        "the cross mask from the patch mask and `encoder_hidden_states`, positions from `get_seq_length`",
        users=("FlexPix2StructForConditionalGeneration",),
    ),
    f"{_P2S}.Pix2StructTextBlock.forward": Upstream(
        "63634b5957605933",
        "it passes `cache` and `layer_idx` to attention but not `**kwargs`; ours needs only the cache",
        users=("FlexPix2StructTextAttention.forward",),
    ),
    "transformers.models.pix2struct.configuration_pix2struct.Pix2StructTextConfig": Upstream(
        "c2a0400bf00c31de",
        "`use_cache` defaults to False, which is why our generate turns it on for `flexible_static`",
        users=("FlexPix2StructForConditionalGeneration._prepare_generation_config",),
    ),
    f"{_WHISPER}.WhisperModel.forward": Upstream(
        "26e83f3823a80f1c",
        "`encoder_attention_mask` must keep reaching the decoder through `**kwargs`",
        users=("FlexWhisperForConditionalGeneration",),
    ),
    f"{_WHISPER_GEN}.generate": Upstream(
        "45371c52fb7cf6ff",
        "its segments and fallbacks call upstream's generate through `super()`, which reaches "
        "FlexCacheInnerGenerateMixin (just before GenerationMixin among the bases); check the batch it passes per call",
        users=("FlexCacheInnerGenerateMixin.generate", "FlexWhisperForConditionalGeneration"),
    ),
    f"{_WHISPER_GEN}.generate_with_fallback": Upstream(
        "132d84628170b535",
        "the per-segment `super().generate(...)` call that padded mode pads",
        users=("FlexCacheInnerGenerateMixin.generate",),
    ),
    f"{_WHISPER_GEN}._postprocess_outputs": Upstream(
        "a77212fbddec66a7",
        "ours keeps the flexible cache out of its per-row split (no CPU copy); it still splits every other output, "
        "and, for a fallback, rows are copied as it copies them (from `.layers[i].keys/.values`)",
        users=("FlexibleStaticLayer.keys", "FlexibleStaticLayer.values"),
    ),
    f"{_WHISPER_GEN}._retrieve_segment": Upstream(
        "a732e1c1b49a5b9d",
        "ours passes its segments to the call's `segment_listener` (the serving routes stream them): check it is still "
        "called with keywords, once per window and row, with `prev_idx` and `time_offset`",
    ),
    f"{_WHISPER_GEN}._stack_split_outputs": Upstream(
        "9feb632b85fb5f01",
        "it stacks per-row caches back from each layer's `keys`/`values`",
        users=("FlexibleStaticLayer.keys", "FlexibleStaticLayer.values"),
    ),
    f"{_JAMBA}.JambaMambaMixer.__init__": Upstream(
        "67988ea2e73f7d4b",
        "our conv and recurrent state shapes are read from the config as it reads them (in 5.25 `kernels` replaces "
        "it with a wrapper; its own code, read behind it, is 5.24's)",
        users=("linear_attention_shapes",),
    ),
    f"{_JAMBA}.JambaMambaMixer.forward": Upstream(
        {"5.24.0": "2d05f7bf3c832ffc", "5.25.0": "778f9a6f6a5a3ca5"},
        "while decoding it writes the conv state that `get_conv_state` returns in place, which is why ours return "
        "views of the storage; the recurrent state is written in place too (5.24) or updated on a copy handed back "
        "through `update_recurrent_state` (5.25, after `increase_count`), which the serving engine's seats must take "
        "in a decode step",
        users=(
            "LinearAttentionStates.get_conv_state",
            "LinearAttentionStates.get_recurrent_state",
            "FlexibleSeatLinearAttentionLayer.update_recurrent_state",
        ),
    ),
    f"{_JAMBA}.JambaAttention.forward": Upstream(
        "53c3cae9ae3f5f07",
        "it reaches the cache only through `update`",
        users=("FlexJambaForCausalLM",),
    ),
    f"{_JAMBA}.JambaModel.forward": Upstream(
        "070fffd7b5cd1d7c",
        "positions from `get_seq_length()`, the causal mask from `get_mask_sizes` (first attention layer)",
        users=("FlexJambaForCausalLM",),
    ),
    "transformers.integrations.moe.use_experts_implementation": Upstream(
        "689a7aee51835bc3",
        "the experts kernels dispatch on `config._experts_implementation`, which our classes let upstream set",
        users=("FlexModelMixin._can_set_experts_implementation",),
    ),
    f"{_LLAMA}.LlamaAttention.forward": Upstream(
        "1aac73b13aa4485d",
        "it reaches the cache only through `update`",
        users=("FlexLlamaForCausalLM",),
    ),
    f"{_LLAMA}.LlamaModel.forward": Upstream(
        "bc2850726d4cb3e6",
        "positions from `get_seq_length()`, the causal mask from `get_mask_sizes`",
        users=("FlexLlamaForCausalLM",),
    ),
    # Model loading and registration.
    f"{_MODELING}.__init__": Upstream(
        "4e500dda2b392c6b",
        "a class swap never runs it; `swap_module_classes` repeats its `_CAN_RECORD_REGISTRY` registration",
        users=("swap_module_classes",),
    ),
    f"{_MODELING}.save_pretrained": Upstream(
        "6a24bddc0b2fd277",
        "ours sets `config.auto_map` only while it runs, refuses `push_to_hub=True` (upstream uploads inside it) "
        "and writes modeling_flexcache.py after it",
        users=("FlexModelMixin.save_pretrained",),
    ),
    f"{_MODELING}.can_generate": Upstream(
        "7ebb8db309a0a03a",
        "it looks for `GenerationMixin` among the direct bases, which is why every override lists it",
        users=("FlexModelMixin",),
    ),
    f"{_AUTO}._BaseAutoModelClass.from_pretrained": Upstream(
        {"5.24.0": "ed9092026e36ecf6", "5.25.0": "d98ecb17b72c8431"},
        "with `trust_remote_code` it registers the class and calls its `register_for_auto_class` (5.25 takes the hub "
        "arguments by name and passes `_from_auto` with them: the remote-code branch is unchanged)",
        users=("FlexModelMixin.register_for_auto_class", "write_remote_code_module"),
    ),
    f"{_AUTO}._LazyAutoMapping.__getitem__": Upstream(
        "7a8281aa8c44f44e",
        "`register()` writes `_extra_content` and reads `_model_mapping`, which it must keep consulting in this order",
        users=("register", "unregister", "mapped_class_names"),
    ),
    f"{_AUTO}._LazyAutoMapping.register": Upstream(
        "0c65df6ac2e90083",
        "`register()` edits `_extra_content` directly instead of calling it (to restore it exactly)",
        users=("register", "unregister"),
    ),
}


def main() -> int:
    """Print the installed transformers' fingerprint of every entry against the table; returns 1 if any differs."""
    installed = installed_version()
    version = checked_version(installed)
    if installed != version:
        print(unknown_version_message(installed), file=sys.stderr)
    differs = 0
    for name, entry in UPSTREAM.items():
        found = found_fingerprint(name)
        expected = entry.fingerprint_at(version)
        differs += found != expected
        print(f"{name}: {found}" + ("" if found == expected else f"  (transformers=={version}: {expected})"))
    return 1 if differs or installed != version else 0


if __name__ == "__main__":
    sys.exit(main())
