"""upstream/check_tree.py finds the tests each patch adds or changes, and compare_junit.py fails on a regression.

No reference tree is needed: a tiny git repository stands in for transformers' tests/ folder.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UPSTREAM = Path(__file__).resolve().parents[1] / "upstream"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the `git` program")

BEFORE = """import unittest


class CacheTesterMixin:
    def _helper(self):
        return 1

    def test_in_mixin(self):
        self.assertEqual(self._helper(), 1)


class CacheTest(CacheTesterMixin, unittest.TestCase):
    def test_kept(self):
        self.assertTrue(True)

    def test_changed(self):
        self.assertEqual(1, 1)
"""

AFTER = """import unittest


class CacheTesterMixin:
    def _helper(self):
        return 2

    def test_in_mixin(self):
        self.assertEqual(self._helper(), 2)


class CacheTest(CacheTesterMixin, unittest.TestCase):
    def test_kept(self):
        self.assertTrue(True)

    def test_changed(self):
        self.assertEqual(2, 2)

    def test_added(self):
        self.assertIsNone(None)


def test_module_level():
    assert True
"""


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, UPSTREAM / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def patch_and_tree(tmp_path) -> tuple[str, Path]:
    tree = tmp_path / "tree"
    (tree / "tests" / "utils").mkdir(parents=True)
    (tree / "src").mkdir()
    test_file = tree / "tests" / "utils" / "test_cache.py"
    test_file.write_text(BEFORE)
    (tree / "src" / "cache.py").write_text("X = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid"]
    subprocess.run(["git", "init", "-q"], cwd=tree, check=True)
    subprocess.run([*git, "add", "-A"], cwd=tree, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=tree, check=True)
    test_file.write_text(AFTER)
    (tree / "src" / "cache.py").write_text("X = 2\n")
    diff = subprocess.run(["git", "diff"], cwd=tree, check=True, capture_output=True, text=True).stdout
    return diff, tree


def test_the_tests_a_patch_touches_are_found_by_test_class_and_by_mixin(patch_and_tree):
    check_tree = load("check_tree")
    diff, tree = patch_and_tree
    lines = check_tree.added_lines(diff)
    assert list(lines) == ["tests/utils/test_cache.py"], "only files under tests/ count"
    ids, mixin_tests, others = check_tree.tests_touched(tree, lines)
    assert ids == [
        "tests/utils/test_cache.py::CacheTest::test_added",
        "tests/utils/test_cache.py::CacheTest::test_changed",
        "tests/utils/test_cache.py::test_module_level",
    ]
    assert mixin_tests == ["test_in_mixin"]
    assert others == ["tests/utils/test_cache.py:CacheTesterMixin._helper"]


def junit(path: Path, outcomes: dict[str, str]) -> Path:
    cases = []
    for name, outcome in outcomes.items():
        inner = {"passed": "", "failed": "<failure message='x'/>", "skipped": "<skipped message='x'/>"}[outcome]
        cases.append(f'<testcase classname="tests.utils.test_cache.CacheTest" name="{name}">{inner}</testcase>')
    path.write_text(f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>")
    return path


@pytest.mark.parametrize(
    ("after", "exit_code"),
    [
        ({"test_a": "passed", "test_b": "failed"}, 0),  # same outcomes
        ({"test_a": "failed", "test_b": "failed"}, 1),  # test_a regressed
        ({"test_b": "passed"}, 1),  # test_a vanished
        ({"test_a": "passed", "test_b": "passed"}, 0),  # a fix is not a regression
    ],
)
def test_compare_junit_exits_1_when_a_test_that_passed_unpatched_fails_or_vanishes(tmp_path, after, exit_code):
    before = junit(tmp_path / "before.xml", {"test_a": "passed", "test_b": "failed"})
    result = subprocess.run(
        [sys.executable, str(UPSTREAM / "compare_junit.py"), str(before), str(junit(tmp_path / "after.xml", after))],
        capture_output=True,
        text=True,
    )
    assert result.returncode == exit_code, result.stdout


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="needs ruff in this interpreter")
def test_ruff_findings_of_the_unpatched_tree_are_its_baseline(tmp_path):
    check_tree = load("check_tree")
    base, tip = tmp_path / "base", tmp_path / "tip"
    for root, source in ((base, "import os\n"), (tip, "import os\nimport sys\nx = (1,\n)\n")):
        (root / "src").mkdir(parents=True)
        (root / "pyproject.toml").write_text('[tool.ruff]\nline-length = 119\n[tool.ruff.lint]\nselect = ["F"]\n')
        (root / "src" / "mod.py").write_text(source)
    base_lint, base_format = check_tree.ruff_findings(base, ["src/mod.py", "src/absent.py"])
    tip_lint, tip_format = check_tree.ruff_findings(tip, ["src/mod.py", "src/absent.py"])
    assert len(base_lint) == 1 and not base_format, "the unused `os` import, without its line number"
    new = tip_lint - base_lint
    assert len(new) == 1 and "`sys`" in next(iter(new)), "only the finding the change adds is new"
    assert tip_format == {"src/mod.py"}


def test_the_signature_of_a_format_patch_file_is_not_a_removed_line(patch_and_tree):
    check_tree = load("check_tree")
    diff, _ = patch_and_tree
    signed = diff + "-- \n2.39.5\n\n"  # how `git format-patch` ends a patch
    assert check_tree.added_lines(signed) == check_tree.added_lines(diff)


def test_a_parameterized_test_function_stands_for_its_generated_methods(tmp_path):
    check_tree = load("check_tree")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_p.py").write_text(
        "import unittest\n\n\nclass PTest(unittest.TestCase):\n"
        "    def test_x_0_llama(self):\n        pass\n\n    def test_x_1_gemma2(self):\n        pass\n\n"
        "    def test_x_other(self):\n        pass\n\n    def test_y(self):\n        pass\n"
    )  # what parameterized.expand makes of `test_x` with ["llama", "gemma2"]
    ids = ["tests/test_p.py::PTest::test_x", "tests/test_p.py::PTest::test_y"]
    assert check_tree.expand_parameterized(tmp_path, ids) == [
        "tests/test_p.py::PTest::test_x_0_llama",
        "tests/test_p.py::PTest::test_x_1_gemma2",
        "tests/test_p.py::PTest::test_y",
    ]


@pytest.mark.parametrize(("k", "core"), [("", True), ("generate or cache", False)])
def test_upstream_tests_select_by_k_and_leave_out_the_core_files_when_asked(tmp_path, monkeypatch, k, core):
    check_tree = load("check_tree")
    base, tip = tmp_path / "base", tmp_path / "tip"
    for root in (base, tip):
        for folder in ("tests/utils", "tests/generation", "tests/models/t5"):
            (root / folder).mkdir(parents=True)
        (root / "tests/utils/test_cache_utils.py").write_text("")
    calls = []

    def fake_pytest(tree_dir, targets, junit_path, log, extra=(), jobs=0, test_timeout=900):
        calls.append((list(targets), list(extra)))
        junit(junit_path, {"test_a": "passed"})
        log.write_text("1 passed\n")

    monkeypatch.setattr(check_tree, "pytest", fake_pytest)
    tree = type("FakeTree", (), {"work": tmp_path})()
    model_files = ["tests/models/t5/test_modeling_t5.py"]
    for root in (base, tip):
        (root / model_files[0]).write_text("")
    assert check_tree.check_upstream_tests(tree, base, tip, model_files, 2, k, core)
    assert len(calls) == 2, "one run a side"
    for targets, extra in calls:
        core_files = ["tests/utils/test_cache_utils.py", "tests/generation"] if core else []
        assert targets == core_files + model_files
        assert (extra[-2:] == ["-k", k]) if k else ("-k" not in extra)


def test_models_none_leaves_every_model_test_file_out_and_an_untouched_model_is_refused():
    check_tree = load("check_tree")
    tests = ["tests/models/t5/test_modeling_t5.py", "tests/models/bart/test_modeling_bart.py"]
    touched = ["bart", "t5"]
    assert check_tree.models_chosen(tests, touched, "") == tests
    assert check_tree.models_chosen(tests, touched, "none") == []
    assert check_tree.models_chosen(tests, touched, "bart") == ["tests/models/bart/test_modeling_bart.py"]
    with pytest.raises(SystemExit, match="touches no model whisper"):
        check_tree.models_chosen(tests, touched, "t5,whisper")


PYTEST_FILE = """import unittest

import pytest


class ATest(unittest.TestCase):
    def test_x(self):
        pass

    def test_s(self):
        self.skipTest("no")


@pytest.mark.parametrize("p", ["a b", "c::d", "e/f"])
def test_p(p):
    assert p != "e/f"
"""


def test_junit_key_of_a_node_id_is_the_key_pytest_writes_to_junit(tmp_path):
    check_tree = load("check_tree")
    (tmp_path / "tests" / "sub").mkdir(parents=True)
    (tmp_path / "tests" / "sub" / "test_a.py").write_text(PYTEST_FILE)
    (tmp_path / "tests" / "sub" / "test_bad.py").write_text("import a_module_that_is_not_there\n")
    pytest_args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    subprocess.run(
        [*pytest_args, "--junitxml=j.xml", "--continue-on-collection-errors", "tests"],
        cwd=tmp_path,
        capture_output=True,
    )
    written = check_tree.junit_outcomes(tmp_path / "j.xml")
    collected = subprocess.run(
        [*pytest_args, "--collect-only", "tests/sub/test_a.py"], cwd=tmp_path, capture_output=True, text=True
    ).stdout.splitlines()
    node_ids = [line for line in collected if "::" in line]
    assert len(node_ids) == 5
    assert {check_tree.junit_key(node): written[check_tree.junit_key(node)] for node in node_ids} == {
        "tests.sub.test_a.ATest::test_x": "passed",
        "tests.sub.test_a.ATest::test_s": "skipped",
        "tests.sub.test_a::test_p[a b]": "passed",
        "tests.sub.test_a::test_p[c::d]": "passed",
        "tests.sub.test_a::test_p[e/f]": "failed",
    }
    assert written[check_tree.junit_key("tests/sub/test_bad.py")] == "failed", "a collection error, by file"


def test_rerun_targets_are_the_tests_that_did_not_pass_patched_and_those_it_lacks(tmp_path):
    check_tree = load("check_tree")
    (tmp_path / "tests" / "m").mkdir(parents=True)
    for name in ("test_a.py", "test_broken.py", "test_fixed.py"):
        (tmp_path / "tests" / "m" / name).write_text("")
    patched = {
        "tests.m.test_a.ATest::test_passed": "passed",
        "tests.m.test_a.ATest::test_failed": "failed",
        "tests.m.test_a.ATest::test_skipped": "skipped",
        "tests.m.test_a::test_p[x-1]": "failed",
        "tests.m.test_a.ATest::test_new_in_the_series": "failed",  # the unpatched tree does not have it
        "::tests.m.test_broken": "failed",  # collection fails patched, and unpatched (nothing collected there)
        "::tests.m.test_fixed": "failed",  # collection fails patched only: its tests are collected unpatched
        "::tests.m.test_gone": "failed",  # a file the unpatched tree lacks
    }
    collected = [
        "tests/m/test_a.py::ATest::test_passed",
        "tests/m/test_a.py::ATest::test_failed",
        "tests/m/test_a.py::ATest::test_skipped",
        "tests/m/test_a.py::ATest::test_vanished",  # the patched run lacks it
        "tests/m/test_a.py::test_p[x-1]",
        "tests/m/test_fixed.py::test_f",
    ]
    assert check_tree.rerun_targets(patched, collected, tmp_path) == [
        "tests/m/test_a.py::ATest::test_failed",
        "tests/m/test_a.py::ATest::test_skipped",
        "tests/m/test_a.py::ATest::test_vanished",
        "tests/m/test_a.py::test_p[x-1]",
        "tests/m/test_fixed.py::test_f",
        "tests/m/test_broken.py",
    ]


@pytest.mark.parametrize(
    ("before", "exit_code", "expected"),
    [
        ({"test_b": "failed", "test_c": "skipped"}, 0, "0 test(s) with a different outcome"),
        ({"test_b": "passed", "test_c": "skipped"}, 1, "passed -> failed"),  # failed patched, passes unpatched
        ({"test_b": "failed", "test_c": "passed"}, 1, "passed -> skipped"),  # skipped patched, passes unpatched
        ({"test_b": "failed", "test_c": "skipped", "test_d": "passed"}, 1, "passed -> absent"),  # vanished patched
        ({"test_c": "skipped"}, 0, "absent -> failed"),  # test_b is the series' own: not on the unpatched tree
    ],
)
def test_compare_junit_rerun_counts_the_tests_not_rerun_and_finds_regressions_among_the_rerun(
    tmp_path, before, exit_code, expected
):
    after = junit(tmp_path / "after.xml", {"test_a": "passed", "test_b": "failed", "test_c": "skipped"})
    result = subprocess.run(
        [sys.executable, str(UPSTREAM / "compare_junit.py"), "--rerun", str(junit(tmp_path / "before.xml", before)),
         str(after)],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert result.returncode == exit_code, result.stdout
    assert "1 test(s) passed patched and were not rerun unpatched" in result.stdout, result.stdout
    assert expected in result.stdout, result.stdout
    assert "test_a" not in result.stdout.split("different outcome")[1], "a test not rerun is not a difference"


def test_without_rerun_a_test_absent_unpatched_that_passes_patched_is_listed(tmp_path):
    before = junit(tmp_path / "before.xml", {"test_b": "failed"})
    after = junit(tmp_path / "after.xml", {"test_a": "passed", "test_b": "failed"})
    result = subprocess.run(
        [sys.executable, str(UPSTREAM / "compare_junit.py"), str(before), str(after)], capture_output=True, text=True
    )
    assert result.returncode == 0
    assert "absent -> passed" in result.stdout and "not rerun" not in result.stdout


@pytest.mark.parametrize("rerun", [["tests/models/t5/test_modeling_t5.py::T5Test::test_b"], []])
def test_patched_first_runs_patched_whole_then_unpatched_on_the_rerun_targets(tmp_path, monkeypatch, rerun):
    check_tree = load("check_tree")
    base, tip = tmp_path / "base", tmp_path / "tip"
    model_files = ["tests/models/t5/test_modeling_t5.py"]
    for root in (base, tip):
        (root / "tests/models/t5").mkdir(parents=True)
        (root / model_files[0]).write_text("")
    calls, collects = [], []

    def fake_pytest(tree_dir, targets, junit_path, log, extra=(), jobs=0, test_timeout=900):
        calls.append((tree_dir, list(targets), test_timeout))
        outcomes = {"test_a": "passed", "test_b": "failed"} if tree_dir == tip else {"test_b": "failed"}
        junit(junit_path, outcomes)
        log.write_text("done\n")

    def fake_collected(tree_dir, targets, extra):
        collects.append((tree_dir, list(targets)))
        return rerun

    monkeypatch.setattr(check_tree, "pytest", fake_pytest)
    monkeypatch.setattr(check_tree, "collected_ids", fake_collected)
    monkeypatch.setattr(check_tree, "rerun_targets", lambda patched, collected, root: collected)
    tree = type("FakeTree", (), {"work": tmp_path})()
    assert check_tree.check_upstream_tests(tree, base, tip, model_files, 1, "", False, True, 300)
    assert calls[0] == (tip, model_files, 300), "the patched side first, whole"
    assert collects == [(base, model_files)]
    if rerun:
        assert calls[1:] == [(base, rerun, 300)], "then the unpatched side on the rerun targets only"
    else:
        assert len(calls) == 1, "nothing to rerun: no pytest run, which would run the whole folder"
        assert check_tree.junit_outcomes(tmp_path / "upstream-unpatched.xml") == {}


def test_compare_junit_names_a_file_that_failed_collection_by_its_path(tmp_path):
    for name in ("before.xml", "after.xml"):
        (tmp_path / name).write_text(
            '<testsuites><testsuite><testcase classname="" name="tests.models.gpt2.test_modeling_gpt2">'
            '<error message="collection failure"/></testcase></testsuite></testsuites>'
        )
    result = subprocess.run(
        [
            sys.executable,
            str(UPSTREAM / "compare_junit.py"),
            str(tmp_path / "before.xml"),
            str(tmp_path / "after.xml"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0
    assert "tests/models/gpt2/test_modeling_gpt2.py" in result.stdout, result.stdout
