"""What upstream's modular converter says about a tree, as data: for each modular file, the hunks by which the
generated files differ from the files on disk.

`utils/check_modular_conversion.py` prints the same differences in colour and fails on any. The reference tree's
converter is the nearest version that could be had of upstream's v5.25.0 one (see /work/upstream/PROVENANCE.md), and it
already disagrees with some of 5.25.0's own generated files; so `check_tree.py` runs this on the unpatched and on the
patched tree and fails only on hunks the series adds. Run from the tree's root, with the tree's `src` importable:

    python modular_findings.py [--jobs N] [--all | MODULAR_FILE ...] > findings.json

Like the upstream check, the files are converted level by level in dependency order, and a generated file replaces the
one on disk until the end of the run (so that a dependent sees its parent as the converter would write it); every file
is restored before exit. Prints a JSON object: `checked` (the modular files converted) and `findings`: generated file
(or a modular file the converter failed on) -> list of hunks, each hunk a list of its changed lines ('-' generated,
'+' on disk), line numbers left out so that hunks compare across trees.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import json
import multiprocessing
import os
import shutil
import sys

sys.path.insert(0, os.path.abspath("utils"))

BACKUP = ".findings_backup"


def target_path(modular_path: str, file_type: str) -> str:
    """The file that `file_type` of the converter's output is written to (upstream's `process_file` naming)."""
    prefix = file_type.split(".*")[0]
    suffix = file_type.split(".*")[-1] if ".*" in file_type else ""
    return modular_path.replace("modular_", f"{prefix}_").replace(".py", f"{suffix}.py")


def hunks(generated: str, on_disk: str) -> list[list[str]]:
    """The changed lines of each hunk of the unified diff generated -> on disk, without positions."""
    result: list[list[str]] = []
    for line in difflib.unified_diff(generated.splitlines(), on_disk.splitlines(), lineterm="", n=0):
        if line.startswith("@@"):
            result.append([])
        elif result and line[:1] in "+-" and not line.startswith(("+++", "---")):
            result[-1].append(line)
    return result


def convert(modular_path: str) -> tuple[str, dict[str, str]]:
    from check_modular_conversion import convert_and_run_ruff

    try:
        return modular_path, convert_and_run_ruff(modular_path)
    except Exception as error:  # the converter's own failure is a finding too
        return modular_path, {"error": f"{type(error).__name__}: {error}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="modular files (default: --all)")
    parser.add_argument("--all", action="store_true", help="every src/transformers/models/*/modular_*.py")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    from create_dependency_mapping import find_priority_list

    everything = sorted(glob.glob("src/transformers/models/**/modular_*.py", recursive=True))
    wanted = set(everything if args.all or not args.files else args.files)
    levels, _ = find_priority_list(everything)
    findings: dict[str, list[list[str]]] = {}
    replaced: list[str] = []
    try:
        with multiprocessing.Pool(args.jobs) as pool:
            for level in levels:
                todo = [path for path in level if path in wanted]
                for modular_path, generated in pool.map(convert, todo):
                    if "error" in generated:
                        findings[modular_path] = [[f"! converter failed: {generated['error']}"]]
                        continue
                    for file_type, content in generated.items():
                        path = target_path(modular_path, file_type)
                        with open(path, encoding="utf-8") as handle:
                            on_disk = handle.read()
                        found = hunks(content, on_disk)
                        if found:
                            findings[path] = found
                            shutil.copy(path, path + BACKUP)
                            replaced.append(path)
                            with open(path, "w", encoding="utf-8", newline="\n") as handle:
                                handle.write(content)
    finally:
        for path in replaced:
            shutil.move(path + BACKUP, path)
    json.dump({"checked": sorted(wanted), "findings": findings}, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
