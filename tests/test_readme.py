"""Every code block of README.md runs as pasted, except those marked `<!-- readme-test: skip (why) -->`.

The Python blocks run in order as one script (later blocks use what earlier ones defined), in an empty folder, in a
fresh process; then the shell blocks run in order in that folder (they use the folders the Python blocks saved).
Shell blocks marked `<!-- readme-test: slow (why) -->` (the export command: a minute of lowering) run after the
others, in the same folder, only with `-m slow`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(
    r"(<!-- readme-test: (?P<mark>skip|slow) \((?P<why>[^)]*)\) -->\n)?```(?P<lang>\w+)\n(?P<code>.*?)```", re.DOTALL
)


def readme_blocks() -> list[tuple[str, str, str | None, str | None]]:
    """(language, code, mark, why) of every fenced block of README.md, in order; mark is "skip", "slow" or None."""
    text = (REPO_ROOT / "README.md").read_text()
    return [(match["lang"], match["code"], match["mark"], match["why"]) for match in BLOCK.finditer(text)]


def test_every_readme_block_is_python_or_bash_and_every_mark_says_why():
    blocks = readme_blocks()
    assert blocks and {lang for lang, _, _, _ in blocks} <= {"python", "bash"}
    assert all(mark is None or why.strip() for _, _, mark, why in blocks)
    assert all(lang == "bash" for lang, _, mark, _ in blocks if mark == "slow")  # Python blocks run as one script
    assert sum(mark is None for _, _, mark, _ in blocks) >= 5  # the examples themselves run


def _environment(tmp_path: Path) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "hf_modules"),
        "OMP_NUM_THREADS": "1",
    }


def _run_readme(tmp_path: Path, *, marks: tuple) -> list[str]:
    """Run the Python blocks as one script, then the shell blocks whose mark is in `marks`; their outputs."""
    blocks, env = readme_blocks(), _environment(tmp_path)
    script = tmp_path / "readme.py"
    script.write_text("\n".join(code for lang, code, mark, _ in blocks if lang == "python" and mark is None))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    outputs = [result.stdout]
    for lang, code, mark, _ in blocks:
        if lang == "bash" and mark in marks:
            shell = subprocess.run(
                ["bash", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
            )
            assert shell.returncode == 0, shell.stderr[-4000:]
            outputs.append(shell.stdout)
    return outputs


def test_readme_code_blocks_run_as_pasted(tmp_path):
    outputs = _run_readme(tmp_path, marks=(None,))
    assert "FlexT5ForConditionalGeneration" in outputs[0]
    assert "[(2, 16), (2, 64), (8, 16), (8, 64)]" in outputs[0].splitlines()  # the bucketed shapes, as printed
    served = next(output for output in outputs if '"object":"text_completion"' in output)  # the serve block's curl
    assert "streamed: " in served


@pytest.mark.slow
def test_readme_export_blocks_run_as_pasted(tmp_path):
    outputs = _run_readme(tmp_path, marks=(None, "slow"))
    assert any("wrote tiny-t5.pte" in output for output in outputs)  # the export command ran
    assert any("same tokens as generate" in output.splitlines() for output in outputs)  # the .pte in ExecuTorch
