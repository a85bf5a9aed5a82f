"""Compare two JUnit XML reports of the same tests (unpatched and patched transformers), per test file.

Usage: python upstream/compare_junit.py [--rerun] UNPATCHED.xml PATCHED.xml

Prints, per test file, the tests run and their outcomes on each side, then every test whose outcome differs. A test
with subtests counts as failed if any subtest failed. Exits 1 if a test that passes unpatched fails, is skipped or is
missing patched (a regression); other differences are printed for the reader to judge.

With --rerun the unpatched report holds only the tests that were run again unpatched after a whole patched run
(`check_tree.py --patched-first`): those that did not pass patched, and those patched did not run. A test that passed
patched and is not in the unpatched report was not rerun: it cannot have regressed, and is counted, not listed. A test
that did not pass patched and is not in the unpatched report is one the unpatched tree does not have (the series' own
new tests): listed as `absent -> ...`, not a regression.
"""

import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict


def outcomes(path: str) -> dict[str, str]:
    """Test id -> 'passed', 'failed' or 'skipped'."""
    result: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        if result.get(test_id) != "failed":  # subtests repeat the id: one failure fails the test
            result[test_id] = outcome
    return result


def test_file(test_id: str) -> str:
    module, name = test_id.split("::", 1)
    if not module:  # a file that failed collection: classname "", the module as name
        return name.replace(".", "/") + ".py"
    return "/".join(module.split(".")[:-1]) + ".py" if "." in module else module


def main(argv: list[str]) -> int:
    rerun = "--rerun" in argv
    argv = [arg for arg in argv if arg != "--rerun"]
    before, after = outcomes(argv[0]), outcomes(argv[1])
    not_rerun = {t for t in after if rerun and t not in before and after[t] == "passed"}
    counts: dict[str, dict[str, Counter]] = defaultdict(lambda: {"before": Counter(), "after": Counter()})
    for side, results in (("before", before), ("after", after)):
        for test_id, outcome in results.items():
            counts[test_file(test_id)][side][outcome] += 1
    unpatched = "unpatched rerun p/f/s" if rerun else "unpatched pass/fail/skip"
    print(f"{'test file':<52} {unpatched:>26} {'patched pass/fail/skip':>24}")
    for name in sorted(counts):
        b, a = counts[name]["before"], counts[name]["after"]
        print(
            f"{name:<52} {b['passed']:>14}/{b['failed']}/{b['skipped']:<8} {a['passed']:>12}/{a['failed']}/{a['skipped']}"
        )
    total_b, total_a = Counter(before.values()), Counter(after.values())
    print(
        f"{'total':<52} {total_b['passed']:>14}/{total_b['failed']}/{total_b['skipped']:<8} "
        f"{total_a['passed']:>12}/{total_a['failed']}/{total_a['skipped']}"
    )
    if rerun:
        print(f"\n{len(not_rerun)} test(s) passed patched and were not rerun unpatched (not regressions)")
    changed = sorted(t for t in set(before) | set(after) if before.get(t) != after.get(t) and t not in not_rerun)
    print(f"\n{len(changed)} test(s) with a different outcome:")
    for test_id in changed:
        print(f"  {before.get(test_id, 'absent')} -> {after.get(test_id, 'absent')}  {test_id}")
    regressions = [t for t in changed if before.get(t) == "passed" and after.get(t) in ("failed", "skipped", None)]
    if regressions:
        print(f"{len(regressions)} regression(s): passed unpatched, failed, skipped or missing patched")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
