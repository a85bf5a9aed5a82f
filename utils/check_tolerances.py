"""Lists the float tolerances in the tests that are literals rather than derived on the running machine (issue 46).

A score tolerance tuned on one CPU fails on the next (Marian's 2e-5 from an Intel machine on an AMD EPYC, the int8
2% from AVX2 on a VNNI CPU). So every tolerance in the tests is either zero (bit for bit), or derived from upstream's
own movement on the same inputs on the running machine (`tests/helpers.py`: `float_noise`, `upstream_movement`;
`tests/compile/test_quantization.py`: `int8_atol`), or a stated multiple of such a movement. This script finds what is none
of those, in the test sources:

- a non-zero number literal given as `atol=`, `rtol=`, `tolerance=` or `limit=`, or assigned to a name that ends in
  `ATOL`, `RTOL`, `TOL` or `TOLERANCE`;
- a non-zero float literal that bounds a difference from above (`assert difference <= 1e-4`: the bounded side
  mentions `abs`, `diff`, `atol`, `tol` or `error`);
- `torch.testing.assert_close` or `numpy.testing.assert_allclose` without `atol=` and `rtol=`, whose defaults are
  tolerances too.

Literals that are not tolerances of model outputs (an audio resampler against an analytic signal, say) are allowed
by `ALLOWED` below, each with the reason. `python utils/check_tolerances.py` prints the findings (exit status 1 if
any); `tests/test_tolerances.py` runs it in the suite.
"""

from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
TOLERANCE_KEYWORDS = ("atol", "rtol", "tolerance", "limit")
TOLERANCE_SUFFIXES = ("ATOL", "RTOL", "TOL", "TOLERANCE")
CLOSE_CALLS = ("assert_close", "assert_allclose", "allclose", "isclose")
# what the bounded side of a comparison mentions when it measures a difference of outputs
DIFFERENCE_WORDS = ("abs", "diff", "atol", "tol", "error")

# (file relative to tests/, the source line's text stripped) -> why the literal is not a model-output tolerance
ALLOWED: dict[tuple[str, str], str] = {
    (
        "server/test_audio.py",
        "np.testing.assert_allclose(decoded, expected, atol=1e-7)",
    ): "PyAV's mean of two 16-bit channels against the same mean computed by numpy: float32 rounding, not model output",
    (
        "server/test_audio.py",
        "np.testing.assert_allclose(decoded[middle], expected[middle], atol=2e-3)",
    ): "libswresample against an analytic sine away from the edges: its filter's error, not model output",
    (
        "server/test_audio.py",
        "np.testing.assert_allclose(decoded[middle], expected[middle], atol=atol)",
    ): "a lossless codec (flac, float WAV) resampled, against an analytic sine: the resampler's error, not model output",
}


@dataclass(frozen=True)
class Finding:
    path: str  # relative to tests/
    line: int
    text: str
    what: str

    def __str__(self) -> str:
        return f"tests/{self.path}:{self.line}: {self.what}: {self.text}"


def _number(node: ast.AST) -> float | None:
    """The value of a number literal (also negated), else None."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _number(node.operand)
        return None if value is None else -value
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    return None


def _call_name(node: ast.Call) -> str:
    function = node.func
    return function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")


def scan_file(path: str, relative: str) -> list[Finding]:
    """The literal tolerances of one test file (see the module docstring)."""
    with open(path) as f:
        source = f.read()
    lines = source.splitlines()
    findings = []

    def add(node: ast.AST, what: str) -> None:
        text = lines[node.lineno - 1].strip()
        if (relative, text) not in ALLOWED:
            findings.append(Finding(relative, node.lineno, text, what))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            for keyword in node.keywords:
                value = _number(keyword.value) if keyword.arg in TOLERANCE_KEYWORDS else None
                if value:
                    add(node, f"literal {keyword.arg}={value:g}")
            if _call_name(node) in CLOSE_CALLS:
                given = {keyword.arg for keyword in node.keywords}
                if not {"atol", "rtol"} <= given:
                    add(node, f"{_call_name(node)} with its default tolerance")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = _number(node.value) if node.value is not None else None
            for target in targets:
                if isinstance(target, ast.Name) and target.id.upper().endswith(TOLERANCE_SUFFIXES) and value:
                    add(node, f"literal {target.id} = {value:g}")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for index, operator in enumerate(node.ops):
                left, right = sides[index], sides[index + 1]
                # an upper bound: `difference <= literal` or `literal >= difference`
                if isinstance(operator, (ast.Lt, ast.LtE)):
                    bound, measured = right, left
                elif isinstance(operator, (ast.Gt, ast.GtE)):
                    bound, measured = left, right
                else:
                    continue
                literal = isinstance(bound, ast.Constant) and isinstance(bound.value, float) and bound.value
                text = (ast.get_source_segment(source, measured) or "").lower()
                if literal and any(word in text for word in DIFFERENCE_WORDS):
                    add(node, f"a difference bounded by the float literal {bound.value:g}")
    return findings


def scan(tests: str = TESTS) -> list[Finding]:
    """The literal tolerances of every test file under `tests`."""
    findings = []
    for folder, _, names in sorted(os.walk(tests)):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                findings += scan_file(path, os.path.relpath(path, tests))
    return findings


def stale_allowances(tests: str = TESTS) -> list[tuple[str, str]]:
    """Entries of `ALLOWED` whose line is no longer in its file."""
    stale = []
    for relative, text in ALLOWED:
        try:
            with open(os.path.join(tests, relative)) as f:
                present = any(line.strip() == text for line in f)
        except OSError:
            present = False
        if not present:
            stale.append((relative, text))
    return stale


def main() -> int:
    findings = scan()
    for finding in findings:
        print(finding)
    for relative, text in stale_allowances():
        print(f"tests/{relative}: ALLOWED names a line that is gone: {text}")
    return 1 if findings or stale_allowances() else 0


if __name__ == "__main__":
    sys.exit(main())
