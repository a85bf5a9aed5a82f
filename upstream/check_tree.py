"""The checks a transformers maintainer's CI runs on a PR series, on a reference tree of transformers v5.25.0.

`upstream/check.sh --tree DIR` calls this after its code-only checks; it can also run alone:

    python upstream/check_tree.py --tree /work/upstream/v5.25.0 [--upstream-tests] [--jobs 2] [--keep]

DIR is a git repository whose HEAD is transformers v5.25.0 as a maintainer sees it: `src/`, `setup.py`, `pyproject.toml`
and `tests/`, `docs/`, `utils/` (see /work/upstream/PROVENANCE.md for how it was built). The interpreter running this
needs the tree's test and quality tools (pytest, pytest-xdist, pytest-timeout, parameterized, libcst, rich, GitPython
and ruff at the version the tree's setup.py pins); the tree's `src` is put first on PYTHONPATH for every step, so the
transformers installed beside them does not matter. The series (`upstream/series`, `git format-patch` files) is
applied with `git am` to a clone: branch `main` is the tree, branch `series` one commit per patch. Then:

  (a) upstream's source checks on the patched clone: `utils/check_copies.py`; `utils/check_docstrings.py --check_all`;
      the modular converter (`modular_findings.py`) on every modular file of a model the series touches and of its
      direct dependents. Each runs on the unpatched clone too, and only what the series adds fails the step (the
      reference tree's tools are the nearest versions that could be had and some already flag 5.25.0 itself);
  (b) ruff check and ruff format --check (the tree's pyproject.toml, the pinned version) on the Python files the
      series touches, and no added line in a Python file longer than 119 characters;
  (c) per patch k: the tests it adds or changes (the test functions its diff of tests/ touches; a test of a mixin
      such as GenerationTesterMixin runs through the test files of the models the series touches, or of the models
      --mixin-models names) must fail on patches 1..k-1 plus patch k's tests/ hunks only, and pass with patch k whole.
      A mixin test runs for every model: it must pass (or skip) on each with the patch and fail on at least one
      without it (where the bug does not apply it passes both ways). A patch that touches no test fails this step;
  (d) with --upstream-tests: upstream's test files of every model the series touches, of cache_utils, masking_utils
      and generation, on the unpatched and the patched clone (`-n JOBS`), compared with compare_junit.py; a test that
      passes unpatched and fails (or vanishes) patched fails the step. For a run that fits the time at hand,
      `--models m1,m2` limits its model test files to those models (each must be a model the series touches;
      `--models none`: no model test file, cache_utils', masking_utils' and generation's files alone),
      `--upstream-tests-k EXPR` selects tests by pytest's `-k EXPR` on both sides (e.g. the generation and cache tests:
      `-k "generate or cache or past or beam or static or compile or export"`), and `--no-core-tests` leaves out
      cache_utils', masking_utils' and generation's own files; the JUnit files and logs are in the work folder
      (`upstream-unpatched.xml`, `upstream-patched.xml`). `--patched-first` halves the time of whole files: the
      patched side runs whole, then the unpatched side runs only what did not pass patched (failed, error, skipped)
      and what the patched run lacks, by node id (those the unpatched tree collects: the series' new tests are
      `absent` there); a test that passed patched is not rerun and cannot be a regression (compare_junit.py
      --rerun counts them). `--test-timeout S` sets pytest-timeout's limit per test (default 900 s).

Times measured here (2 CPU cores shared with other engineers' runs, load average 17 to 22): the clone and `git am`
of nine patches about 10 s; (a) check_copies 74 s for both sides, check_docstrings --check_all about 11 minutes a
side, the converter over the current series' 22 models and their dependents not finished within the session (the
August converter's full --check_all ran over 50 minutes); (b) 4 s; (c) a few seconds for a patch without tests,
about 5 minutes for a patch with one test in tests/utils/test_cache_utils.py (two pytest runs); (d) on the core files
alone (`--models none`, `--jobs 2`) 8 minutes for both sides on a quieter machine (load 2 to 4); (d) on whole
model test files with --patched-first, --jobs 1 on one core of an AMD EPYC Zen 5 (load 2 to 4.5): 10 files of the
family in 9 to 10 minutes for both sides, 16 with SeamlessM4T's two (xfail training tests of 100 to 155 s each, run on
both sides) in 58 minutes; check_docstrings --check_all there under a minute a side; with --upstream-tests-k "(past or static or use_cache or left_padding or cache) and not compil and not quant
and not flash" and --no-core-tests, 10 to 13 models' files took 9 to 35 minutes for both sides (--jobs 1, load 13 to
20; the `torch.compile` tests, which that expression leaves out, take minutes each). Use
--skip source for a quick run of (b) and (c) (under a minute for the current series); (a)'s parts are skipped one by one
with --skip copies, docstrings or modular, so that `--skip copies,modular,style,patches` runs check_docstrings alone. Exits 1 if any step fails,
after running them all; prints one line per step.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_LINE = 119
UPSTREAM_CORE_TESTS = ["tests/utils/test_cache_utils.py", "tests/utils/test_masking_utils.py", "tests/generation"]
# Needs a module 5.25 no longer has (continuous batching's old cache manager); collection fails on both sides.
UPSTREAM_IGNORE = ["tests/generation/test_continuous_batching.py"]
GIT_ID = ["-c", "user.name=flexcache", "-c", "user.email=dev@flexcache.invalid"]


def run(cmd: list[str], cwd: Path, log: Path | None = None, env: dict | None = None, timeout: int = 3600):
    """Run `cmd`; stdout and stderr go to `log` if given. Returns the CompletedProcess (output captured if no log)."""
    if log is None:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with open(log, "w") as handle:
        return subprocess.run(
            cmd, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )


def git(tree: Path, *args: str) -> str:
    result = run(["git", *GIT_ID, *args], tree)
    if result.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {tree}: {result.stderr.strip()}")
    return result.stdout


class Tree:
    """A clone of the reference tree with the series applied, and worktrees at chosen commits."""

    def __init__(self, source: Path, work: Path, patches: list[Path]):
        self.work = work
        self.clone = work / "clone"
        run(["git", "clone", "-q", str(source), str(self.clone)], work).check_returncode()
        git(self.clone, "checkout", "-q", "-B", "main")
        git(self.clone, "checkout", "-q", "-b", "series")
        self.patches = patches
        self.commits = [git(self.clone, "rev-parse", "HEAD").strip()]  # commits[k]: patches 1..k applied
        for patch in patches:
            result = run(["git", *GIT_ID, "am", "-q", str(patch)], self.clone)
            if result.returncode != 0:
                run(["git", "am", "--abort"], self.clone)
                raise SystemExit(
                    f"{patch.name} does not apply with git am on the tree:\n{result.stdout}{result.stderr}"
                )
            self.commits.append(git(self.clone, "rev-parse", "HEAD").strip())
        self.worktrees: dict[str, Path] = {}

    def at(self, name: str, commit: str) -> Path:
        """A worktree called `name` checked out at `commit` (created once, then moved), clean."""
        path = self.worktrees.get(name)
        if path is None:
            path = self.work / name
            git(self.clone, "worktree", "add", "-q", "--detach", str(path), commit)
            self.worktrees[name] = path
        else:
            git(path, "reset", "-q", "--hard")
            git(path, "clean", "-qfdx", "-e", ".venv*")
            git(path, "checkout", "-q", "--detach", commit)
        return path

    def changed_files(self, start: str, end: str, *pathspec: str) -> list[str]:
        return git(self.clone, "diff", "--name-only", "--diff-filter=d", start, end, "--", *pathspec).split()

    def touched_models(self) -> list[str]:
        """Model types whose src/ or tests/ folder the series touches."""
        models = set()
        for path in self.changed_files(self.commits[0], self.commits[-1]):
            match = re.match(r"(?:src/transformers|tests)/models/([^/]+)/", path)
            if match:
                models.add(match.group(1))
        return sorted(models)


def env_for(tree: Path) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree}",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "COLUMNS": "200",
        # upstream's tools call `ruff` by name: the one beside this interpreter, at the tree's pinned version
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def report(name: str, ok: bool, detail: str, started: float) -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {name:<34} {time.time() - started:6.0f} s  {detail}", flush=True)
    return ok


# (a) upstream's source checks ------------------------------------------------------------------------------------


def findings_of_script(tree: Path, script: list[str], log: Path) -> tuple[int, set[str]]:
    """Exit code and the lines that name a problem ('- ...' items and error lines) of one of upstream's checks."""
    result = run([sys.executable, *script], tree, log, env_for(tree))
    lines = set()
    for line in log.read_text(errors="replace").splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", line).rstrip()
        if re.match(r"^\s*- \S", line) or "Error" in line or "does not match" in line:
            lines.add(re.sub(r" at line \d+", "", line.strip()))
    return result.returncode, lines


def check_script(tree: Tree, base: Path, tip: Path, name: str, script: list[str]) -> bool:
    started = time.time()
    code_base, base_lines = findings_of_script(base, script, tree.work / f"{name}-unpatched.log")
    code_tip, tip_lines = findings_of_script(tip, script, tree.work / f"{name}-patched.log")
    new = sorted(tip_lines - base_lines)
    if code_tip == 0 or (code_base != 0 and not new):
        detail = "passes" if code_tip == 0 else f"fails as on the unpatched tree ({len(base_lines)} finding(s))"
        return report(name, True, detail, started)
    for line in new[:40]:
        print(f"       {line}")
    return report(name, False, f"{len(new)} new finding(s); log: {tree.work / (name + '-patched.log')}", started)


def check_modular(tree: Tree, base: Path, tip: Path, jobs: int) -> bool:
    started = time.time()
    touched = set(tree.touched_models())
    modular = sorted(str(p.relative_to(tip)) for p in tip.glob("src/transformers/models/*/modular_*.py"))
    sys.path.insert(0, str(tip / "utils"))
    from create_dependency_mapping import find_priority_list  # the tree's own dependency mapping

    cwd = os.getcwd()
    os.chdir(tip)
    try:
        _, dependencies = find_priority_list(modular)
    finally:
        os.chdir(cwd)
        sys.path.pop(0)
    wanted = [
        path
        for path in modular
        if path.split("/")[-2] in touched or {dep.split(".")[-2] for dep in dependencies[path]} & touched
    ]
    if not wanted:
        return report("modular conversion", True, "the series touches no modular model", started)
    sides = {}
    for side, root in (("unpatched", base), ("patched", tip)):
        out = tree.work / f"modular-{side}.json"
        result = run(
            [sys.executable, str(HERE / "modular_findings.py"), "--jobs", str(jobs), *wanted],
            root,
            env=env_for(root),
        )
        if result.returncode != 0:
            print(result.stderr[-3000:])
            return report("modular conversion", False, f"the converter did not run on the {side} tree", started)
        out.write_text(result.stdout)
        sides[side] = json.loads(result.stdout)["findings"]
    new = []
    for path, hunks in sides["patched"].items():
        before = [json.dumps(h) for h in sides["unpatched"].get(path, [])]
        for hunk in hunks:
            if json.dumps(hunk) in before:
                before.remove(json.dumps(hunk))
            else:
                new.append((path, hunk))
    for path, hunk in new[:20]:
        print(f"       {path}: generated file differs from its modular source:")
        for line in hunk[:12]:
            print(f"         {line[:150]}")
    pre = sum(len(h) for h in sides["unpatched"].values())
    detail = f"{len(wanted)} modular files; {len(new)} new hunk(s), {pre} on the unpatched tree"
    return report("modular conversion", not new, detail, started)


# (b) style ------------------------------------------------------------------------------------------------------


def ruff_findings(root: Path, files: list[str]) -> tuple[set[str], set[str]]:
    """(`ruff check` findings without their line and column, files `ruff format --check` would change) under root."""
    present = [f for f in files if (root / f).exists()]
    if not present:
        return set(), set()
    lint = run(
        [sys.executable, "-m", "ruff", "check", "--output-format", "concise", *present], root, env=env_for(root)
    )
    findings = set()
    for line in lint.stdout.splitlines():
        match = re.match(r"^(\S+?):\d+:\d+: (.*)$", line)
        if match:
            findings.add(f"{match.group(1)}: {match.group(2)}")
    fmt = run([sys.executable, "-m", "ruff", "format", "--check", *present], root, env=env_for(root))
    # ruff 0.14 (the tree's pin) prints "Would reformat: PATH"; later versions a diagnostic with "--> PATH:LINE:COL"
    pattern = r"^(?:Would reformat: (\S+)|\s*--> (\S+?):\d+:\d+)$"
    unformatted = {a or b for a, b in re.findall(pattern, fmt.stdout + fmt.stderr, re.M)}
    return findings, unformatted


def check_style(tree: Tree, base: Path, tip: Path) -> bool:
    """ruff on the touched Python files: what the series adds fails (findings of the unpatched tree are its baseline:
    the reference tree's test files come from a fork and some already fail the pinned ruff); added lines <= 119."""
    started = time.time()
    files = [f for f in tree.changed_files(tree.commits[0], tree.commits[-1], "*.py")]
    base_lint, base_format = ruff_findings(base, files)
    tip_lint, tip_format = ruff_findings(tip, files)
    new_lint, new_format = sorted(tip_lint - base_lint), sorted(tip_format - base_format)
    for entry in new_lint[:40] + [f"{f}: not formatted as ruff format would" for f in new_format]:
        print(f"       {entry}")
    ok = not new_lint and not new_format
    baseline = len(tip_lint & base_lint) + len(tip_format & base_format)
    long_lines = []
    diff = git(tree.clone, "diff", "-U0", tree.commits[0], tree.commits[-1], "--", "*.py")
    path, line_no = None, 0
    for line in diff.splitlines():
        if line.startswith("+++ "):
            path = line[6:]
        elif line.startswith("@@"):
            line_no = int(re.search(r"\+(\d+)", line).group(1))
        elif line.startswith("+"):
            if len(line) - 1 > MAX_LINE:
                long_lines.append(f"{path}:{line_no}: {len(line) - 1} characters")
            line_no += 1
    for entry in long_lines:
        print(f"       {entry}")
    detail = (
        f"{len(files)} Python files; ruff {'clean' if ok else 'NOT clean'}"
        + (f" ({baseline} finding(s) of the unpatched tree left aside)" if baseline else "")
        + f"; {len(long_lines)} added line(s) > {MAX_LINE}"
    )
    return report("ruff and line length", ok and not long_lines, detail, started)


# (c) per-patch tests --------------------------------------------------------------------------------------------


def added_lines(patch_text: str) -> dict[str, set[int]]:
    """tests/*.py file -> new-side line numbers a patch adds or next to which it removes lines. Only lines inside a
    hunk count (by the hunk header's line counts): the `-- ` that opens `git format-patch`'s signature is not a
    removed line."""
    result: dict[str, set[int]] = {}
    path, line_no, old_left, new_left = None, 0, 0, 0
    for line in patch_text.splitlines():
        if old_left <= 0 and new_left <= 0:  # between hunks
            if line.startswith("+++ "):
                path = line[6:] if line.startswith("+++ b/") else None
                if path and not (path.startswith("tests/") and path.endswith(".py")):
                    path = None
            elif line.startswith("@@"):
                match = re.match(r"@@ -\d+(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", line)
                old_left = int(match.group(1) or 1)
                line_no, new_left = int(match.group(2)), int(match.group(3) or 1)
            continue
        if line.startswith("+"):
            if path:
                result.setdefault(path, set()).add(line_no)
            line_no, new_left = line_no + 1, new_left - 1
        elif line.startswith("-"):
            if path:
                result.setdefault(path, set()).add(line_no)
            old_left -= 1
        elif line.startswith("\\"):  # "\ No newline at end of file"
            continue
        else:  # context (a blank context line may have lost its space)
            line_no, old_left, new_left = line_no + 1, old_left - 1, new_left - 1
    return result


def tests_touched(tree_at_k: Path, lines: dict[str, set[int]]) -> tuple[list[str], list[str], list[str]]:
    """(test ids of test classes, names of mixin tests, other things touched) for the touched lines."""
    ids, mixin_tests, others = [], [], []
    for path, numbers in lines.items():
        source = (tree_at_k / path).read_text()
        module = ast.parse(source)
        hit_any = set()
        for node in module.body:
            classes = [node] if isinstance(node, ast.ClassDef) else []
            functions = [(None, node)] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
            for cls in classes:
                functions += [(cls, f) for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
            for cls, func in functions:
                start = min([func.lineno] + [d.lineno for d in func.decorator_list])
                hit = {n for n in numbers if start <= n <= func.end_lineno}
                if not hit:
                    continue
                hit_any |= hit
                if not func.name.startswith("test"):
                    others.append(f"{path}:{cls.name + '.' if cls else ''}{func.name}")
                elif cls is None:
                    ids.append(f"{path}::{func.name}")
                elif any("TestCase" in ast.unparse(base) for base in cls.bases) or cls.name.startswith("Test"):
                    ids.append(f"{path}::{cls.name}::{func.name}")
                else:
                    mixin_tests.append(func.name)
        source_lines = source.splitlines()
        outside = {n for n in numbers - hit_any if n <= len(source_lines) and source_lines[n - 1].strip()}
        if outside:
            others.append(f"{path}: {len(outside)} line(s) outside functions")
    return sorted(set(ids)), sorted(set(mixin_tests)), sorted(set(others))


def junit_outcomes(path: Path) -> dict[str, str]:
    """Test name -> 'passed' / 'failed' / 'skipped' from a JUnit file (a failed subtest fails the test)."""
    outcomes: dict[str, str] = {}
    if not path.exists():
        return outcomes
    for case in ET.parse(path).getroot().iter("testcase"):
        key = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        if outcomes.get(key) != "failed":
            outcomes[key] = outcome
    return outcomes


def pytest(
    tree_dir: Path,
    targets: list[str],
    junit: Path,
    log: Path,
    extra: list[str] = (),
    jobs: int = 0,
    test_timeout: int = 900,
):
    """Run pytest on `targets` (paths or node ids; many node ids go through an @-file of arguments)."""
    if len(targets) > 50:
        args_file = junit.with_suffix(".args")
        args_file.write_text("".join(f"{target}\n" for target in targets))
        targets = [f"@{args_file}"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", f"--timeout={test_timeout}",
           f"--junitxml={junit}", "-n", str(jobs if jobs > 1 else 0), *extra, *targets]  # fmt: skip
    return run(cmd, tree_dir, log, env_for(tree_dir), timeout=8 * 3600)


def junit_key(node_id: str) -> str:
    """The `classname::name` a pytest node id has in a JUnit file, as `junit_outcomes` keys it (pytest's
    `mangle_test_address`: the path becomes a dotted module, a parameter id in brackets stays as it is). A test file
    that fails collection is reported as classname "" and the module as name: its node id is the file's path."""
    path, bracket, params = node_id.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return f"{'.'.join(names[:-1])}::{names[-1]}"


def collected_ids(tree_dir: Path, targets: list[str], extra: list[str]) -> list[str]:
    """The node ids pytest collects from `targets` with the options `extra` (-k, --ignore) in `tree_dir`."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           *extra, *targets]  # fmt: skip
    lines = run(cmd, tree_dir, env=env_for(tree_dir), timeout=3600).stdout.splitlines()
    return [line for line in lines if line.startswith("tests/") and "::" in line]


def rerun_targets(patched: dict[str, str], collected: list[str], unpatched_root: Path) -> list[str]:
    """What to run on the unpatched tree after a whole patched run (--patched-first): of the tests the unpatched tree
    has (`collected`, its node ids), every one that did not pass patched (failed, error, skipped) or that the patched
    run lacks; and a test file that failed collection patched and collects nothing unpatched either, whole, so that
    its error shows on both sides. A test that passed patched is not rerun: it cannot be a regression. A test that
    failed patched and that the unpatched tree lacks (the series' new tests) cannot be run there."""
    wanted = [node for node in collected if patched.get(junit_key(node)) != "passed"]
    for key, outcome in sorted(patched.items()):
        classname, name = key.split("::", 1)
        if classname or outcome == "passed":
            continue
        path = name.replace(".", "/") + ".py"
        if (unpatched_root / path).is_file() and not any(node.startswith(f"{path}::") for node in collected):
            wanted.append(path)
    return wanted


def expand_parameterized(tree_dir: Path, ids: list[str]) -> list[str]:
    """The node ids a test function's id stands for: `parameterized.expand` turns `test_x` into methods
    `test_x_0_llama`, `test_x_1_gemma2`..., which pytest cannot select by `test_x`. Ids with no such methods are
    kept as they are (pytest's own parametrization is selected by the function's id)."""
    files = sorted({test_id.split("::")[0] for test_id in ids})
    collect = [
        sys.executable,
        "-m",
        "pytest",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        *files,
    ]
    collected = run(collect, tree_dir, env=env_for(tree_dir), timeout=1800).stdout.splitlines()
    expanded = []
    for test_id in ids:
        pattern = re.compile(re.escape(test_id) + r"_\d+(?:_\w*)?$")
        expanded += [node for node in collected if pattern.match(node)] or [test_id]
    return sorted(set(expanded))


def check_patch_tests(tree: Tree, k: int, model_test_files: list[str]) -> bool:
    started = time.time()
    patch = tree.patches[k - 1]
    name = f"patch {k} tests"
    at_k = tree.at("at-patch", tree.commits[k])
    ids, mixin_tests, others = tests_touched(at_k, added_lines(patch.read_text()))
    if not ids and not mixin_tests:
        return report(name, False, f"{patch.name[:40]}... adds or changes no test under tests/", started)
    # The test ids run as they are, the mixin tests by name (-k) through the model test files: two pytest runs,
    # so that -k does not deselect the ids.
    runs = {}
    if ids:
        runs["ids"] = (None, [])
    if mixin_tests:
        runs["mixin"] = (model_test_files, ["-k", " or ".join(mixin_tests)])
    outcomes = {}
    for side, commit in (("before", tree.commits[k - 1]), ("after", tree.commits[k])):
        checkout = tree.at("per-patch", commit)
        if side == "before":
            applied = run(["git", "apply", "--include=tests/*", str(patch)], checkout)
            if applied.returncode != 0:
                return report(name, False, f"its tests/ hunks do not apply alone: {applied.stderr.strip()}", started)
            if ids:  # the tests/ hunks are in place: collect what each test function became
                runs["ids"] = (expand_parameterized(checkout, ids), [])
        for kind, (targets, extra) in runs.items():
            junit = tree.work / f"patch{k}-{side}-{kind}.xml"
            pytest(checkout, targets, junit, tree.work / f"patch{k}-{side}-{kind}.log", extra)
            outcomes[side, kind] = junit_outcomes(junit)
    bad, counts = [], {"fail then pass": 0, "skipped on both": 0, "mixin, pass on both": 0}
    fixed_mixin = set()
    for kind in runs:
        before_side, after_side = outcomes["before", kind], outcomes["after", kind]
        for test in sorted(set(before_side) | set(after_side)):
            before, after = before_side.get(test, "absent"), after_side.get(test, "absent")
            if before == "failed" and after == "passed":
                counts["fail then pass"] += 1
                fixed_mixin.add(test.rsplit("::", 1)[-1])
            elif before == after == "skipped":
                counts["skipped on both"] += 1
            elif kind == "mixin" and before == after == "passed":
                # a mixin test runs for every model: where the bug does not apply, it passes both ways
                counts["mixin, pass on both"] += 1
            else:
                bad.append(f"{test}: {before} without the fix, {after} with it")
    # ...but each mixin test must fail without the fix on some model
    bad += [f"{test} (mixin): fails on no model without the fix" for test in mixin_tests if test not in fixed_mixin]
    for line in bad[:30]:
        print(f"       {line}")
    for line in others[:10]:
        print(f"       (also touches {line})")
    detail = f"{len(ids)} test id(s), {len(mixin_tests)} mixin test(s); " + ", ".join(
        f"{v} {k}" for k, v in counts.items() if v or k != "mixin, pass on both"
    )
    if not counts["fail then pass"]:
        bad.append("no test ran")
        detail += "; no test ran both ways"
    return report(name, not bad, detail + (f"; {len(bad)} wrong" if bad else ""), started)


# (d) upstream's own tests ---------------------------------------------------------------------------------------


def check_upstream_tests(
    tree: Tree,
    base: Path,
    tip: Path,
    model_test_files: list[str],
    jobs: int,
    k: str = "",
    core: bool = True,
    patched_first: bool = False,
    test_timeout: int = 900,
) -> bool:
    started = time.time()
    targets = [t for t in UPSTREAM_CORE_TESTS if core and (tip / t).exists()] + model_test_files
    # a test file the tree cannot import (the fork's testers against 5.25's testing_utils) must not stop the others
    extra = [f"--ignore={path}" for path in UPSTREAM_IGNORE] + ["--continue-on-collection-errors"]
    extra += ["-k", k] if k else []
    sides = (("patched", tip), ("unpatched", base)) if patched_first else (("unpatched", base), ("patched", tip))
    for side, root in sides:
        side_started = time.time()
        junit, log = tree.work / f"upstream-{side}.xml", tree.work / f"upstream-{side}.log"
        side_targets = [t for t in targets if (root / t).exists()]
        if patched_first and side == "unpatched":
            collected = collected_ids(root, side_targets, extra)
            side_targets = rerun_targets(junit_outcomes(tree.work / "upstream-patched.xml"), collected, root)
            print(f"       unpatched: rerunning {len(side_targets)} of {len(collected)} collected tests "
                  "(those that did not pass patched or that it lacks)")  # fmt: skip
            if not side_targets:  # pytest without targets would run the whole folder
                junit.write_text("<testsuites></testsuites>")
                log.write_text("nothing to rerun\n")
                continue
        result = pytest(root, side_targets, junit, log, extra, jobs, test_timeout)
        last = log.read_text(errors="replace").strip().splitlines()[-1:]
        print(f"       {side}: {last[0] if last else result.returncode} ({time.time() - side_started:.0f} s)")
    compare = run(
        [sys.executable, str(HERE / "compare_junit.py"), *(["--rerun"] if patched_first else []),
         str(tree.work / "upstream-unpatched.xml"), str(tree.work / "upstream-patched.xml")], tree.work,
    )  # fmt: skip
    print("\n".join("       " + line for line in compare.stdout.splitlines()))
    detail = f"{len(targets)} test files or folders" + (f", -k {k!r}" if k else "")
    detail += ", patched first, unpatched rerun" if patched_first else ""
    return report("upstream tests", compare.returncode == 0, detail, started)


def model_test_files(tree: Tree, tip: Path) -> list[str]:
    files = []
    for model in tree.touched_models():
        files += sorted(str(p.relative_to(tip)) for p in (tip / "tests" / "models" / model).glob("test_modeling_*.py"))
    return files


def models_chosen(tests: list[str], touched: list[str], models: str) -> list[str]:
    """The model test files of (d) for --models: all of `tests` when empty, none for `none`, else those of the
    comma-separated models, each of which must be one the series touches."""
    if not models:
        return tests
    chosen = [] if models == "none" else list(filter(None, models.split(",")))
    unknown = sorted(set(chosen) - set(touched))
    if unknown:
        raise SystemExit(f"--models: the series touches no model {', '.join(unknown)}")
    prefixes = tuple(f"tests/models/{model}/" for model in chosen)
    return [path for path in tests if path.startswith(prefixes)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", required=True, type=Path, help="the reference tree (a git repository)")
    parser.add_argument("--series", type=Path, default=HERE / "series")
    parser.add_argument("--work", type=Path, help="a folder for the clone and logs (default: a temporary one)")
    parser.add_argument("--upstream-tests", action="store_true", help="(d): upstream's tests, unpatched and patched")
    parser.add_argument("--jobs", type=int, default=2, help="pytest-xdist workers and converter processes")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated steps to skip: source (or one of its parts: copies, docstrings, modular), style, patches",
    )
    parser.add_argument(
        "--mixin-models",
        default="",
        help="comma-separated model types: run the mixin tests of (c) through these models' test files only (a quick "
        "run; default: every model the series touches)",
    )
    parser.add_argument(
        "--models",
        default="",
        help="comma-separated model types: (d) runs only these models' test files (default: every model the series "
        "touches); each must be one the series touches; `none`: no model test file (the core files only)",
    )
    parser.add_argument("--upstream-tests-k", default="", metavar="EXPR", help="(d) selects tests by pytest's -k EXPR")
    parser.add_argument(
        "--no-core-tests",
        action="store_true",
        help="(d) leaves out cache_utils', masking_utils' and generation's test files (the model test files only)",
    )
    parser.add_argument(
        "--patched-first",
        action="store_true",
        help="(d) runs the patched side whole, then the unpatched side only on the tests that did not pass patched "
        "(or that the patched run lacks): a regression is a test that passes there; the others are not rerun",
    )
    parser.add_argument(
        "--test-timeout", type=int, default=900, metavar="S", help="(d): pytest-timeout's limit per test"
    )
    args = parser.parse_args(argv)
    selects = args.models or args.upstream_tests_k or args.no_core_tests or args.patched_first
    if selects and not args.upstream_tests:
        parser.error(
            "--models, --upstream-tests-k, --no-core-tests and --patched-first select what --upstream-tests runs: "
            "add it"
        )
    if not (args.tree / ".git").exists() or not (args.tree / "utils" / "check_copies.py").exists():
        parser.error(f"--tree {args.tree} is not a reference tree (a git repository with utils/check_copies.py)")
    patches = [args.series.parent / name for name in args.series.read_text().split()]
    work = args.work or Path(tempfile.mkdtemp(prefix="flexcache-tree."))
    work.mkdir(parents=True, exist_ok=True)
    print(f"reference tree {args.tree.resolve()} at {git(args.tree, 'rev-parse', '--short', 'HEAD').strip()}; "
          f"work folder {work}")  # fmt: skip
    skip = set(filter(None, args.skip.split(",")))
    try:
        tree = Tree(args.tree.resolve(), work, patches)
        base, tip = tree.at("unpatched", tree.commits[0]), tree.at("patched", tree.commits[-1])
        print(
            f"{len(patches)} patches applied with git am; models touched: {', '.join(tree.touched_models()) or 'none'}"
        )
        tests = model_test_files(tree, tip)
        results = []
        if not {"source", "copies"} & skip:
            results.append(check_script(tree, base, tip, "check_copies", ["utils/check_copies.py"]))
        if not {"source", "docstrings"} & skip:
            results.append(
                check_script(tree, base, tip, "check_docstrings", ["utils/check_docstrings.py", "--check_all"])
            )
        if not {"source", "modular"} & skip:
            results.append(check_modular(tree, base, tip, args.jobs))
        if "style" not in skip:
            results.append(check_style(tree, base, tip))
        if "patches" not in skip:
            mixin_files = tests
            if args.mixin_models:
                chosen = {f"tests/models/{model}/" for model in args.mixin_models.split(",")}
                mixin_files = [path for path in tests if any(path.startswith(prefix) for prefix in chosen)]
                print(f"mixin tests through {len(mixin_files)} of {len(tests)} model test files (--mixin-models)")
            results += [check_patch_tests(tree, k, mixin_files) for k in range(1, len(patches) + 1)]
        if args.upstream_tests:
            upstream_files = models_chosen(tests, tree.touched_models(), args.models)
            if args.models:
                print(f"(d) through {len(upstream_files)} of {len(tests)} model test files (--models)")
            results.append(
                check_upstream_tests(
                    tree,
                    base,
                    tip,
                    upstream_files,
                    args.jobs,
                    args.upstream_tests_k,
                    not args.no_core_tests,
                    args.patched_first,
                    args.test_timeout,
                )
            )
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"tree checks: {sum(results)} of {len(results)} passed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
