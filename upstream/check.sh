#!/usr/bin/env bash
# Check upstream/series, the feature as transformers pull requests, the way a maintainer's CI would.
#
# Usage: upstream/check.sh [--tree DIR [--upstream-tests] [--tree-only]] [--keep]
#
# Without a tree, code only (about 4.5 minutes here):
#   1. downloads the 5.25.0 sdist (`pip download --no-deps --no-binary :all: transformers==5.25.0`, or
#      $TRANSFORMERS_SDIST), applies each patch's code with `git apply --exclude='tests/*' --exclude='docs/*'
#      --exclude='utils/*'` (the sdist has none of those folders; `--check` first) and prints per patch the files and
#      lines of its code and of its tests, docs and utils hunks;
#   2. installs the patched sdist in a temporary venv beside your torch and runs there, with this package refused at
#      import: upstream/check_request.py (the original request, six models) and upstream/check_family.py (every
#      encoder-decoder model type of 5.25.0). The series' own tests are in its patches (tests/ hunks): step 3.
# With --tree DIR (a reference tree of transformers v5.25.0 with tests/, docs/ and utils/: /work/upstream/v5.25.0 on
# the team's machines, built as its PROVENANCE.md says; --tests DIR is an old name for it), then
#   3. upstream/check_tree.py applies the whole patches to a clone of the tree with `git am` and runs upstream's
#      source checks (check_copies, check_docstrings, the modular converter), ruff and the 119-character limit, and
#      per patch its own tests (failing before the patch, passing after); --upstream-tests adds upstream's test files
#      of every touched model and of cache_utils, masking_utils and generation, unpatched against patched. Times are in
#      check_tree.py's header: 10 to 20 minutes without --upstream-tests here, an hour or more with them.
#   --tree-only skips 1-2's venv checks (the tree's checks only need the tree's tools: see check_tree.py).
#
# Environment: PYTHON (default python3) must have torch; the temporary venv sees its packages (a .pth file) and pip
# installs there what transformers 5.25 and the tree's tools need and they lack. CHECK_ARGS: extra arguments for
# check_request.py (e.g. "--no-compile"); FAMILY_ARGS: for check_family.py; JOBS (default 2): pytest-xdist workers.
# Exits non-zero if a patch does not apply or any check fails; prints "all checks passed" otherwise.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}
VERSION=5.25.0
TREE="" KEEP="" UPSTREAM_TESTS="" TREE_ONLY=""
usage="usage: upstream/check.sh [--tree DIR [--upstream-tests] [--tree-only]] [--keep]"
while [ $# -gt 0 ]; do
  case $1 in
    --tree | --tests) TREE=$(cd "$2" && pwd); shift 2 ;;
    --upstream-tests) UPSTREAM_TESTS=--upstream-tests; shift ;;
    --tree-only) TREE_ONLY=1; shift ;;
    --keep) KEEP=1; shift ;;
    *) echo "unknown argument $1; $usage" >&2; exit 2 ;;
  esac
done
if [ -z "$TREE" ] && [ -n "$UPSTREAM_TESTS$TREE_ONLY" ]; then echo "--upstream-tests and --tree-only need --tree DIR" >&2; exit 2; fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/flexcache-upstream.XXXXXX")
if [ -z "$KEEP" ]; then trap 'rm -rf "$WORK"' EXIT; else echo "work folder: $WORK"; fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
start=$(date +%s)
failed=""

# 1. The sdist, unpatched and patched (code hunks only)
if [ -n "${TRANSFORMERS_SDIST:-}" ]; then cp "$TRANSFORMERS_SDIST" "$WORK/"; else
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: "transformers==$VERSION" -d "$WORK"
fi
for tree in unpatched patched; do
  mkdir "$WORK/$tree" && tar -xzf "$WORK/transformers-$VERSION.tar.gz" -C "$WORK/$tree" --strip-components 1
done
git -C "$WORK/patched" init -q  # so that git apply reads paths from the tree's root, wherever WORK is
CODE_ONLY=(--exclude='tests/*' --exclude='docs/*' --exclude='utils/*')
printf "%-68s %17s %17s\n" "patch" "code files +/-" "tests/docs/utils"
while read -r name; do
  git -C "$WORK/patched" apply --check "${CODE_ONLY[@]}" "$HERE/$name" || { echo "$name does not apply" >&2; exit 1; }
  git -C "$WORK/patched" apply "${CODE_ONLY[@]}" "$HERE/$name"
  git -C "$WORK/patched" apply --numstat "$HERE/$name" | awk -v n="$name" '
    $3 ~ /^(tests|docs|utils)\// {o++; oa+=$1; or+=$2; next} {f++; a+=$1; r+=$2}
    END {printf "%-68s %5d %5d %5d %5d %5d %5d\n", n, f, a, r, o, oa, or}'
done < "$HERE/series"

if [ -z "$TREE_ONLY" ]; then
  # A venv that sees the caller's packages (torch) after its own: a .pth file lists the caller's site folders (their
  # own .pth files, such as an editable install of this package, are not read). The patched transformers is
  # installed in it, with what it needs and the caller lacks.
  "$PYTHON" -m venv "$WORK/venv"
  VPY="$WORK/venv/bin/python"
  "$PYTHON" -c "import site, sys; print('\n'.join(p for p in sys.path if p.endswith('-packages')))" \
    > "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/caller-site.pth"
  "$VPY" -c "import torch" || { echo "PYTHON=$PYTHON has no torch; install torch==2.13.0 there first" >&2; exit 1; }
  "$VPY" -m pip install -q "$WORK/patched"
  "$VPY" -m pip install -q pytest parameterized
  echo "patched transformers installed in $(( $(date +%s) - start )) s"

  # 2. The original request, the family (the series' own tests are in its patches: step 3 runs them)
  echo
  "$VPY" "$HERE/check_request.py" ${CHECK_ARGS:-} || failed=1
  if [ -f "$HERE/check_family.py" ]; then
    echo
    "$VPY" "$HERE/check_family.py" --json "$WORK/check_family.json" ${FAMILY_ARGS:-} || failed=1
  else
    echo "upstream/check_family.py: not there yet, skipped"
  fi
  echo "sdist, patches, install and the checks without a tree: $(( $(date +%s) - start )) s"
fi

# 3. The maintainer's CI on the reference tree
if [ -n "$TREE" ]; then
  TVENV="$WORK/tree-venv"
  "$PYTHON" -m venv "$TVENV"
  "$PYTHON" -c "import site, sys; print('\n'.join(p for p in sys.path if p.endswith('-packages')))" \
    > "$("$TVENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/caller-site.pth"
  # The tree's own pins for its tools (ruff, GitPython, pytest), read from its setup.py
  pins=$(grep -oE '"(ruff|GitPython|pytest|pytest-rerunfailures)[=<>][^"]*"' "$TREE/setup.py" | tr -d '"' | tr '\n' ' ')
  # shellcheck disable=SC2086
  "$TVENV/bin/python" -m pip install -q "$WORK/unpatched" $pins libcst rich pytest-xdist pytest-timeout pytest-order \
    pytest-env timeout-decorator parameterized sentencepiece httpx datasets
  echo "tree tools installed ($pins); $(( $(date +%s) - start )) s"
  keep_args=()
  if [ -n "$KEEP" ]; then keep_args=(--work "$WORK/tree-checks"); fi
  "$TVENV/bin/python" "$HERE/check_tree.py" --tree "$TREE" --jobs "${JOBS:-2}" $UPSTREAM_TESTS "${keep_args[@]}" \
    || failed=1
fi
echo "total: $(( $(date +%s) - start )) s"
if [ -n "$failed" ]; then echo "some checks failed" >&2; exit 1; fi
echo "all checks passed"
