"""Every code block of README.md runs as pasted, except those marked `<!-- readme-test: skip (why) -->`.

The Python blocks run in order as one script (later blocks use what earlier ones defined), in an empty folder, in a
fresh process; then the shell blocks run in order in that folder (they use the folders the Python blocks saved).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- readme-test: skip \((?P<why>[^)]*)\) -->\n)?```(?P<lang>\w+)\n(?P<code>.*?)```", re.DOTALL)


def readme_blocks() -> list[tuple[str, str, str | None]]:
    """(language, code, reason it is skipped or None) of every fenced block of README.md, in order."""
    text = (REPO_ROOT / "README.md").read_text()
    return [(match["lang"], match["code"], match["why"]) for match in BLOCK.finditer(text)]


def test_every_readme_block_is_python_or_bash_and_every_skip_says_why():
    blocks = readme_blocks()
    assert blocks and {lang for lang, _, _ in blocks} <= {"python", "bash"}
    assert all(why is None or why.strip() for _, _, why in blocks)
    assert sum(why is None for _, _, why in blocks) >= 5  # the examples themselves run


def test_readme_code_blocks_run_as_pasted(tmp_path):
    blocks = readme_blocks()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "hf_modules"),
        "OMP_NUM_THREADS": "1",
    }
    script = tmp_path / "readme.py"
    script.write_text("\n".join(code for lang, code, why in blocks if lang == "python" and why is None))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "FlexT5ForConditionalGeneration" in result.stdout
    assert "[(2, 16), (2, 64), (8, 16), (8, 64)]" in result.stdout.splitlines()  # the bucketed shapes, as printed
    outputs = []
    for lang, code, why in blocks:
        if lang == "bash" and why is None:
            shell = subprocess.run(
                ["bash", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
            )
            assert shell.returncode == 0, shell.stderr[-4000:]
            outputs.append(shell.stdout)
    assert any("wrote tiny-t5.pte" in output for output in outputs)  # the export command ran
    assert any("same tokens as generate" in output.splitlines() for output in outputs)  # the .pte in ExecuTorch
