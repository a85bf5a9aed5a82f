#!/usr/bin/env bash
# Apply upstream/series to the transformers 5.25.0 source distribution and check the result, without this package.
#
# Usage: upstream/check.sh [--tests DIR] [--keep]
#
#   1. downloads the sdist (`pip download --no-deps --no-binary :all: transformers==5.25.0`, or $TRANSFORMERS_SDIST),
#      applies each patch of upstream/series with `patch -p1` (a dry run first) and prints the table: patch, files,
#      lines added/removed, and the new tests of that patch (upstream/tests/, run on the patched tree);
#   2. runs upstream/check_request.py (the original request, six models, eager/sdpa/compiled) on the patched tree;
#   3. with --tests DIR (a checkout of upstream's repository: DIR/tests and DIR/utils), runs upstream's
#      tests/utils/test_cache_utils.py, tests/generation/ and the model tests of T5, BART, Whisper, Pix2Struct,
#      Llama and Jamba on the unpatched and on the patched tree, and compares them test by test. It points
#      DIR/src/transformers (read by test_pipeline_mixin.py) at each tree in turn.
#
# Environment: PYTHON (default python3) must have torch; the temporary venv sees its packages
# (a .pth file) and pip installs there what transformers 5.25 needs and they lack. CHECK_ARGS: extra
# arguments for check_request.py (e.g. "--no-compile"). Exits non-zero if a patch does not apply or a check fails.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}
VERSION=5.25.0
TESTS_DIR="" KEEP=""
while [ $# -gt 0 ]; do
  case $1 in
    --tests) TESTS_DIR=$(cd "$2" && pwd); shift 2 ;;
    --keep) KEEP=1; shift ;;
    *) echo "unknown argument $1; usage: upstream/check.sh [--tests DIR] [--keep]" >&2; exit 2 ;;
  esac
done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/flexcache-upstream.XXXXXX")
if [ -z "$KEEP" ]; then trap 'rm -rf "$WORK"' EXIT; else echo "work folder: $WORK"; fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
start=$(date +%s)

# 1. The sdist, unpatched and patched
if [ -n "${TRANSFORMERS_SDIST:-}" ]; then cp "$TRANSFORMERS_SDIST" "$WORK/"; else
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: "transformers==$VERSION" -d "$WORK"
fi
for tree in unpatched patched; do
  mkdir "$WORK/$tree" && tar -xzf "$WORK/transformers-$VERSION.tar.gz" -C "$WORK/$tree" --strip-components 1
done
echo "patch                                                                files  added  removed"
while read -r name; do
  patch -p1 --dry-run -s -d "$WORK/patched" < "$HERE/$name" || { echo "$name does not apply" >&2; exit 1; }
  patch -p1 -s -d "$WORK/patched" < "$HERE/$name"
  (cd "$WORK" && git apply --numstat "$HERE/$name") | awk -v n="$name" '{f++; a+=$1; r+=$2} END {printf "%-68s %5d %6d %8d\n", n, f, a, r}'
done < "$HERE/series"

# A venv that sees the caller's packages (torch) after its own: a .pth file lists the caller's site folders (their own
# .pth files, such as an editable install of this package, are not read). The patched transformers is installed in
# it, with what it needs and the caller lacks.
"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$PYTHON" -c "import site, sys; print('\n'.join(p for p in sys.path if p.endswith('-packages')))" \
  > "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/caller-site.pth"
"$VPY" -c "import torch" || { echo "PYTHON=$PYTHON has no torch; install torch==2.13.0 there first" >&2; exit 1; }
"$VPY" -m pip install -q "$WORK/patched"
"$VPY" -m pip install -q pytest parameterized
echo "patched transformers installed in $(( $(date +%s) - start )) s"

# The new tests, one class per patch
mkdir "$WORK/series-tests" && cp "$HERE/tests/test_static_cache_series.py" "$WORK/series-tests/"
(cd "$WORK/series-tests" && "$VPY" -m pytest -q -c /dev/null -p no:cacheprovider -p no:xdist \
  --junitxml="$WORK/series-tests.xml" test_static_cache_series.py > "$WORK/series-tests.log" 2>&1) || series_failed=1
"$VPY" - "$WORK/series-tests.xml" "$HERE/series" <<'PY'
import sys, xml.etree.ElementTree as ET
patch_of = {"CrossAttentionMaskTest": 1, "GetKvTest": 2, "CrossAttentionThroughCacheTest": 3, "StaticCacheBatchTest": 4,
            "MaxEncoderLenTest": 5, "EarlyInitializationTest": 6, "UserCacheTest": 7, "PerModelTest": 8,
            "SubclassKernelChecksTest": 9}
runs, passes = {}, {}
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    n = patch_of.get(case.get("classname", "").split(".")[-1])
    runs[n] = runs.get(n, 0) + 1
    passes[n] = passes.get(n, 0) + all(case.find(tag) is None for tag in ("failure", "error", "skipped"))
print("\npatch                                                                new tests run/passed")
for i, name in enumerate(open(sys.argv[2]).read().split(), 1):
    print(f"{name:<68} {runs.get(i, 0):>5}/{passes.get(i, 0)}")
PY
if [ -n "${series_failed:-}" ]; then tail -30 "$WORK/series-tests.log"; echo "new tests failed" >&2; exit 1; fi

# 2. The original request on the patched tree
echo
"$VPY" "$HERE/check_request.py" ${CHECK_ARGS:-}
echo "sdist, patches, install, new tests and the request's check: $(( $(date +%s) - start )) s"

# 3. Upstream's own tests, unpatched against patched
if [ -n "$TESTS_DIR" ]; then
  "$VPY" -m pip install -q timeout-decorator pytest-rerunfailures pytest-order pytest-timeout sentencepiece httpx \
    requests
  mkdir -p "$TESTS_DIR/src"
  for tree in unpatched patched; do
    ln -sfn "$WORK/$tree/src/transformers" "$TESTS_DIR/src/transformers"
    (cd "$TESTS_DIR" && PYTHONPATH="$WORK/$tree/src:$TESTS_DIR/utils" "$VPY" -m pytest -q -p no:cacheprovider \
      -p no:xdist -o addopts="" --timeout=900 --junitxml="$WORK/upstream-$tree.xml" \
      tests/models/{t5,bart,whisper,pix2struct,llama,jamba}/test_modeling_*.py tests/utils/test_cache_utils.py \
      tests/generation --ignore=tests/generation/test_continuous_batching.py > "$WORK/upstream-$tree.log" 2>&1) || true
    echo "upstream tests on the $tree tree: $(tail -1 "$WORK/upstream-$tree.log")"
  done
  "$VPY" "$HERE/compare_junit.py" "$WORK/upstream-unpatched.xml" "$WORK/upstream-patched.xml"
fi
echo "total: $(( $(date +%s) - start )) s"
