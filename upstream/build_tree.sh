#!/usr/bin/env bash
# Build the reference tree that `upstream/check.sh --tree DIR` and `upstream/check_tree.py` run on: transformers
# v5.25.0 as a maintainer's checkout has it (src/, tests/, docs/, utils/), and a venv with the tree's tools.
#
# Usage: upstream/build_tree.sh [DIR]   (default /work/upstream/v5.25.0; the venv goes to DIR/../venv)
#
# Where each part comes from (also written to DIR/PROVENANCE.md):
#   - src/, setup.py, pyproject.toml, setup.cfg and the top-level tests/*.py: the 5.25.0 sdist from PyPI
#     (`pip download --no-deps --no-binary :all: transformers==5.25.0`, or $TRANSFORMERS_SDIST);
#   - tests/ (models, utils, generation, ...), utils/, docs/, conftest.py, Makefile: a fork of transformers that
#     the code search tools can fetch (zucchini-nlp/transformers, main of 2026-08-19, 5.16.0.dev0, or $FORK_GIT_DIR, a
#     git directory), because huggingface/transformers itself is over the fetch limit and the v5.25.0 tag's files
#     cannot be had here. The sdist's files are laid over the fork's, so src/ is exactly 5.25.0.
# The tree is a git repository: one commit, tagged v5.25.0-base; check_tree.py clones it.
set -euo pipefail
DIR=${1:-/work/upstream/v5.25.0}
VENV=$(dirname "$DIR")/venv
FORK=${FORK_GIT_DIR:-/work/.mirror/zucchini-nlp+transformers/repo}
PYTHON=${PYTHON:-python3}
VERSION=5.25.0
[ -e "$DIR" ] && { echo "$DIR exists; remove it first" >&2; exit 2; }
[ -d "$FORK" ] || { echo "no fork at $FORK: fetch github:zucchini-nlp/transformers (or set FORK_GIT_DIR)" >&2; exit 2; }
mkdir -p "$DIR"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
if [ -n "${TRANSFORMERS_SDIST:-}" ]; then cp "$TRANSFORMERS_SDIST" "$TMP/"; else
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: "transformers==$VERSION" -d "$TMP"
fi
FORK_REV=$(git --git-dir "$FORK" rev-parse HEAD)
git --git-dir "$FORK" archive HEAD tests utils docs conftest.py Makefile | tar -x -C "$DIR"
tar -xzf "$TMP/transformers-$VERSION.tar.gz" -C "$DIR" --strip-components 1
cat >"$DIR/PROVENANCE.md" <<EOF
# Provenance of this tree (built by transformers-flexcache's upstream/build_tree.sh on $(date -u +%F))

- src/, setup.py, setup.cfg, pyproject.toml and the top-level tests/*.py: transformers $VERSION sdist from PyPI.
- everything else under tests/, and utils/, docs/, conftest.py, Makefile: $FORK at $FORK_REV
  ($(git --git-dir "$FORK" log -1 --format='%ci, %s' HEAD)), a fork of huggingface/transformers at 5.16.0.dev0.
  The v5.25.0 tag's own tests, docs and utils could not be had (the repository is over the fetch limit).
EOF
git -C "$DIR" init -q -b main
git -C "$DIR" add -A
git -C "$DIR" -c user.name=flexcache -c user.email=dev@flexcache.invalid commit -qm "transformers v$VERSION (sdist) with tests/, docs/, utils/ of the fork (PROVENANCE.md)"
git -C "$DIR" tag v5.25.0-base
# The tree's tools: torch as pinned by the project, the tree installed editable, its test and quality tools.
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  "$VENV/bin/python" -m pip install -q -e "$DIR" pytest pytest-xdist pytest-timeout pytest-rerunfailures \
    parameterized libcst rich GitPython ruff==0.14.10 httpx datasets timeout-decorator sentencepiece tokenizers \
    accelerate executorch==1.4.1
fi
echo "tree: $DIR (tag v5.25.0-base); venv: $VENV"
