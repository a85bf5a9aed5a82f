"""Upstream drift: every upstream object that our code copies, wraps, mirrors or relies on still has the source we read.

The table is `utils.upstream_drift.UPSTREAM`; our side of each entry is found at test time, from the
docstrings of the package sources (`Derived from`, `Overrides`, `Wraps`, `Mirrors`) and from the entries' `users`.
Each venv checks the fingerprints of the transformers it has installed (`SUPPORTED_TRANSFORMERS_VERSIONS`); an
unknown version fails, and its drift tests compare it with the newest supported version's fingerprints.
"""

from __future__ import annotations

import textwrap

import pytest

from utils import upstream_drift as upstream
from utils.upstream_drift import ABSENT, SUPPORTED_TRANSFORMERS_VERSIONS, UPSTREAM, Upstream

REFERENCES = upstream.find_references()
DEFINITIONS = upstream.find_definitions()
INSTALLED = upstream.installed_version()
CHECKED = upstream.checked_version(INSTALLED)  # the installed version, or the newest supported one if unknown


def _users_of(name: str) -> list[tuple[str, str, str]]:
    """`(our qualified name, its file, what it does)` for everything of ours that depends on upstream `name`."""
    users = [
        (reference.user, reference.path, upstream.REFERENCE_VERBS[reference.verb])
        for reference in REFERENCES
        if upstream.entry_for(reference.upstream) == [name]
    ]
    for user in UPSTREAM[name].users:
        paths = DEFINITIONS.get(user, ["not found"])
        users.append((user, ", ".join(paths), upstream.RELIES_ON))
    return users


def test_the_installed_transformers_is_a_version_whose_upstream_code_our_code_was_checked_against():
    if INSTALLED not in SUPPORTED_TRANSFORMERS_VERSIONS:
        pytest.fail(upstream.unknown_version_message(INSTALLED), pytrace=False)


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_upstream_source_is_the_one_our_code_was_checked_against(name):
    found, entry = upstream.found_fingerprint(name), UPSTREAM[name]
    if found != entry.fingerprint_at(CHECKED):
        pytest.fail(upstream.drift_message(name, found, _users_of(name), entry.recheck, CHECKED), pytrace=False)


def test_every_entry_holds_one_fingerprint_or_one_for_each_supported_version():
    wrong = [
        f"{name}: {sorted(entry.fingerprint)}"
        for name, entry in UPSTREAM.items()
        if not isinstance(entry.fingerprint, str)
        and sorted(entry.fingerprint) != sorted(SUPPORTED_TRANSFORMERS_VERSIONS)
    ]
    assert not wrong, f"per-version fingerprints must name exactly {SUPPORTED_TRANSFORMERS_VERSIONS}: {wrong}"
    same = [
        name
        for name, entry in UPSTREAM.items()
        if not isinstance(entry.fingerprint, str) and len(set(entry.fingerprint.values())) == 1
    ]
    assert not same, f"entries whose source is the same at every supported version hold one fingerprint: {same}"
    assert all(isinstance(entry.fingerprint, dict) for entry in UPSTREAM.values() if ABSENT in str(entry.fingerprint))


def test_the_staging_target_is_the_newest_supported_version():
    assert upstream.PINNED_TRANSFORMERS_VERSION == SUPPORTED_TRANSFORMERS_VERSIONS[-1] == "5.25.0"
    assert SUPPORTED_TRANSFORMERS_VERSIONS[0] == "5.24.0"


def test_an_unknown_transformers_version_is_checked_against_the_staging_target_and_named_with_what_to_do():
    assert upstream.checked_version("9.9.0") == upstream.PINNED_TRANSFORMERS_VERSION
    assert upstream.checked_version("5.24.0") == "5.24.0"
    message = upstream.unknown_version_message("9.9.0")
    assert "transformers==9.9.0 is not one of the versions" in message
    assert "5.24.0, 5.25.0" in message
    assert "python -m utils.upstream_drift" in message and "SUPPORTED_TRANSFORMERS_VERSIONS" in message


def test_every_docstring_that_names_an_upstream_object_has_exactly_one_fingerprint():
    unmatched = [
        f"{reference.user} ({reference.path}): {reference.verb} `{reference.upstream}` matches "
        f"{upstream.entry_for(reference.upstream) or 'no entry'}"
        for reference in REFERENCES
        if len(upstream.entry_for(reference.upstream)) != 1
    ]
    assert not unmatched, "add one entry per upstream object to UPSTREAM (utils/upstream_drift.py):\n" + (
        "\n".join(unmatched)
    )


def test_the_package_docstrings_name_the_upstream_methods_our_overrides_derive_from():
    # A floor, so that a broken scanner (which would find nothing, and so never fail) is noticed.
    found = {(reference.user, upstream.entry_for(reference.upstream)[0]) for reference in REFERENCES}
    assert ("FlexT5Attention.forward", "transformers.models.t5.modeling_t5.T5Attention.forward") in found
    assert (
        "FlexCacheGenerationMixin._prepare_cache_for_generation",
        "transformers.generation.utils.GenerationMixin._prepare_cache_for_generation",
    ) in found


def test_every_fingerprinted_upstream_object_is_used_by_something_of_ours():
    unused = [name for name in UPSTREAM if not _users_of(name)]
    assert not unused, f"stale entries of UPSTREAM (nothing of ours names them): {unused}"


def test_every_user_named_in_the_table_is_defined_in_the_package():
    missing = sorted({user for entry in UPSTREAM.values() for user in entry.users if user not in DEFINITIONS})
    assert not missing, f"UPSTREAM names users that no longer exist (renamed or removed?): {missing}"


def test_fingerprint_ignores_docstrings_comments_and_layout(tmp_path, monkeypatch):
    first = '''
        def forward(self, x):
            """Docstring."""
            # a comment
            return self.proj(x) + 1
    '''
    second = """
        def forward(self, x):  # another comment
            return self.proj(
                x
            ) + 1
    """
    assert _fingerprint_of(tmp_path, monkeypatch, "a", first) == _fingerprint_of(tmp_path, monkeypatch, "b", second)


def test_fingerprint_changes_when_the_code_changes(tmp_path, monkeypatch):
    before = "def forward(self, x):\n    return self.proj(x) + 1\n"
    after = "def forward(self, x):\n    return self.proj(x) + 2\n"
    assert _fingerprint_of(tmp_path, monkeypatch, "c", before) != _fingerprint_of(tmp_path, monkeypatch, "d", after)


def test_fingerprint_of_a_method_does_not_depend_on_its_indentation(tmp_path, monkeypatch):
    method = "class Attention:\n    def forward(self, x):\n        return x\n"
    function = "def forward(self, x):\n    return x\n"
    module_e = _module(tmp_path, monkeypatch, "e", method)
    module_f = _module(tmp_path, monkeypatch, "f", function)
    assert upstream.fingerprint(module_e.Attention.forward) == upstream.fingerprint(module_f.forward)


def test_a_new_override_docstring_is_found_and_refused_until_it_has_an_entry(tmp_path):
    package = tmp_path / "some_overrides"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "new_model.py").write_text(
        textwrap.dedent('''
            class FlexNewAttention:
                def forward(self):
                    """Derived from `transformers.models.new.modeling_new.NewAttention.forward` (transformers==X)."""
        ''')
    )
    references = upstream.find_references([str(package)])
    assert [(r.user, r.path, r.verb) for r in references] == [
        ("FlexNewAttention.forward", "some_overrides/new_model.py", "Derived from")
    ]
    assert upstream.entry_for(references[0].upstream) == []
    table = {"transformers.models.new.modeling_new.NewAttention.forward": Upstream("0" * 16, "compare")}
    assert upstream.entry_for("NewAttention.forward", table) == list(table)


def test_drift_message_names_the_upstream_object_our_method_and_what_to_recheck():
    name = "transformers.models.t5.modeling_t5.T5Attention.forward"
    message = upstream.drift_message(name, "ffff", _users_of(name), UPSTREAM[name].recheck, "5.24.0")
    assert message.startswith(f"{name} changed since transformers==5.24.0 (fingerprint {UPSTREAM[name].fingerprint}")
    assert "re-check FlexT5Attention.forward (model_overrides/t5.py), which is derived from it" in message
    assert "cross-attention branch" in message
    assert "record its fingerprint for transformers==5.24.0" in message


def test_drift_message_says_which_supported_version_a_changed_source_is():
    # A 5.24 source found where 5.25's was expected (a partial upgrade, a wrong venv): the message says so.
    name = "transformers.generation.utils.GenerationMixin._prefill"
    before, after = (UPSTREAM[name].fingerprint_at(version) for version in SUPPORTED_TRANSFORMERS_VERSIONS)
    message = upstream.drift_message(name, before, _users_of(name), UPSTREAM[name].recheck, "5.25.0")
    assert f"(fingerprint {after} -> {before}, which is transformers==5.24.0's)" in message
    assert "FlexCacheGenerationMixin._prefill (transformers_flexcache/generate/mixin.py), which wraps it" in message


def test_an_object_new_in_a_later_version_is_absent_from_the_earlier_one():
    name = "transformers.cache_utils.Cache.increase_count"
    expected = UPSTREAM[name].fingerprint_at(CHECKED)
    assert (upstream.found_fingerprint(name) == ABSENT) == (expected == ABSENT)


def _module(tmp_path, monkeypatch, name: str, source: str):
    (tmp_path / f"drift_probe_{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return __import__(f"drift_probe_{name}")


def _fingerprint_of(tmp_path, monkeypatch, name: str, source: str) -> str:
    return upstream.fingerprint(_module(tmp_path, monkeypatch, name, source).forward)
