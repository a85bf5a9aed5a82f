"""Upstream drift: every upstream object that our code copies, wraps, mirrors or relies on still has the source we read.

The table is `utils.upstream_drift.UPSTREAM`; our side of each entry is found at test time, from the
docstrings of the package sources (`Derived from`, `Overrides`, `Wraps`, `Mirrors`) and from the entries' `users`.
"""

from __future__ import annotations

import textwrap

import pytest

from utils import upstream_drift as upstream
from utils.upstream_drift import UPSTREAM, Upstream

REFERENCES = upstream.find_references()
DEFINITIONS = upstream.find_definitions()


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


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_upstream_source_is_the_one_our_code_was_checked_against(name):
    try:
        found = upstream.current_fingerprint(name)
    except (ImportError, AttributeError, OSError, TypeError) as error:
        found = f"unreadable: {type(error).__name__}: {error}"
    if found != UPSTREAM[name].fingerprint:
        pytest.fail(upstream.drift_message(name, found, _users_of(name), UPSTREAM[name].recheck), pytrace=False)


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
    message = upstream.drift_message(name, "ffff", _users_of(name), UPSTREAM[name].recheck)
    assert message.startswith(f"{name} changed since transformers=={upstream.PINNED_TRANSFORMERS_VERSION}")
    assert "re-check FlexT5Attention.forward (model_overrides/t5.py), which is derived from it" in message
    assert "cross-attention branch" in message
    assert "update its fingerprint" in message


def _module(tmp_path, monkeypatch, name: str, source: str):
    (tmp_path / f"drift_probe_{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return __import__(f"drift_probe_{name}")


def _fingerprint_of(tmp_path, monkeypatch, name: str, source: str) -> str:
    return upstream.fingerprint(_module(tmp_path, monkeypatch, name, source).forward)
