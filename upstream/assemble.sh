#!/usr/bin/env bash
# Assemble the upstream series (issue 54, v2) from the three authors' branches. A tool for whoever assembles the
# series on the team's machines; no test and no CI step needs it (they read the patches this folder holds).
#
# Usage: upstream/assemble.sh [--install] [--check] [--tree-checks]
#
#   1. clones the reference tree ($TREE, tag $BASE) to $ASM once, then on every run resets its branch `series` to
#      $BASE, fetches each author's branch into refs/authors/<name> and cherry-picks, in order:
#        cache    ($CACHE_REPO, branch series-cache): every commit since $BASE;
#        models   ($MODELS_REPO, branch series-models): its commits that the series does not hold yet;
#        generate ($GENERATE_REPO, branch series-generate): likewise.
#      A commit is left out when its subject starts with STANDIN (a placeholder for another author's PR), when its
#      patch-id equals that of a commit already picked, or when its subject equals one already picked (the author
#      carries an older copy of another author's PR: reported, so that the author rebases).
#      Conflicts: git rerere is on in $ASM, so a resolution made once by hand is replayed on later runs. If a
#      conflict touches only docs/source/en/kv_cache.md and rerere does not settle it, the script stops with the
#      cherry-pick in progress: resolve it by hand in $ASM, `git add` it, `git cherry-pick --continue`, then rerun
#      (rerere then remembers it). Any other conflict is a real one: the cherry-pick is aborted, the rest of that
#      author's commits are left out, and the conflict is appended to $NOTES for the authors to rebase.
#   2. writes `git format-patch --zero-commit` of $BASE..series to $OUT (its old patches removed) and $OUT/series.
#   --install: copies them into this folder in place of its numbered patches and rewrites upstream/series.
#   --check: runs check_request.py and check_family.py ($PY, PYTHONPATH=$ASM/src; logs and family.json in $OUT).
#   --tree-checks: runs check_tree.py --tree $TREE --series $OUT/series --skip source (ruff, 119 characters, each
#      patch's tests failing before and passing after); CHECK_TREE_ARGS replaces `--skip source`.
# Exit status: 0 when every author's commits were picked (and the checks asked for passed), 1 otherwise.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
TREE=${TREE:-/work/upstream/v5.25.0}
BASE=${BASE:-v5.25.0-base}
ASM=${ASM:-/work/upstream/wt-assembled}
OUT=${OUT:-/work/upstream/out-assembled}
NOTES=${NOTES:-/work/notes/assembly.md}
PY=${PY:-/work/upstream/venv/bin/python}
CACHE_REPO=${CACHE_REPO:-/work/upstream/wt-cache}
MODELS_REPO=${MODELS_REPO:-/work/upstream/wt-models}
GENERATE_REPO=${GENERATE_REPO:-/work/upstream/wt-generate}
INSTALL="" CHECK="" TREE_CHECKS=""
for arg in "$@"; do
  case $arg in
    --install) INSTALL=1 ;;
    --check) CHECK=1 ;;
    --tree-checks) TREE_CHECKS=1 ;;
    *) echo "unknown argument $arg; usage: upstream/assemble.sh [--install] [--check] [--tree-checks]" >&2; exit 2 ;;
  esac
done
GIT=(git -C "$ASM" -c user.name=flexcache -c user.email=dev@flexcache.invalid)

if [ ! -d "$ASM/.git" ]; then
  git clone -q "$TREE" "$ASM"
  git -C "$ASM" config rerere.enabled true
  git -C "$ASM" config rerere.autoupdate true
fi
if [ -f "$ASM/.git/CHERRY_PICK_HEAD" ]; then
  echo "a cherry-pick is in progress in $ASM: finish it (git cherry-pick --continue) or abort it, then rerun" >&2
  exit 2
fi
git -C "$ASM" fetch -q -f --tags "$TREE"
"${GIT[@]}" checkout -q -B series "$BASE"
"${GIT[@]}" reset -q --hard "$BASE"

declare -A picked_ids=() picked_subjects=()
partial=""
note() {  # a line for the authors, in $NOTES under today's heading
  if ! grep -qF "## $(date -u +%F)" "$NOTES" 2>/dev/null; then printf '\n## %s\n\n' "$(date -u +%F)" >> "$NOTES"; fi
  printf -- '- %s %s\n' "$(date -u +%H:%M)" "$1" >> "$NOTES"
}
for spec in "cache:$CACHE_REPO:series-cache" "models:$MODELS_REPO:series-models" "generate:$GENERATE_REPO:series-generate"; do
  IFS=: read -r name repo branch <<< "$spec"
  git -C "$ASM" fetch -q "$repo" "+refs/heads/$branch:refs/authors/$name"
  tip=$(git -C "$ASM" rev-parse --short "refs/authors/$name")
  echo "== $name: $branch at $tip"
  for commit in $(git -C "$ASM" rev-list --reverse --no-merges "$BASE..refs/authors/$name"); do
    subject=$(git -C "$ASM" log -1 --format=%s "$commit")
    short=$(git -C "$ASM" rev-parse --short "$commit")
    id=$(git -C "$ASM" show "$commit" | git patch-id --stable | cut -d' ' -f1)
    if [[ ${subject^^} == STANDIN* ]]; then echo "   skip $short (stand-in): $subject"; continue; fi
    if [ -n "${picked_ids[$id]:-}" ]; then echo "   skip $short (already picked): $subject"; continue; fi
    if [ -n "${picked_subjects[$subject]:-}" ]; then
      echo "   skip $short (an older copy of a picked PR; the author should rebase): $subject"
      continue
    fi
    if "${GIT[@]}" cherry-pick --allow-empty "$commit" > /dev/null 2>&1; then
      echo "   pick $short: $subject"
    else
      conflicted=$(git -C "$ASM" diff --name-only --diff-filter=U)
      if [ -z "$conflicted" ]; then  # rerere replayed a recorded resolution
        GIT_EDITOR=true "${GIT[@]}" cherry-pick --continue > /dev/null
        echo "   pick $short (conflict resolved as recorded by rerere): $subject"
      elif [ "$conflicted" = "docs/source/en/kv_cache.md" ]; then
        echo "   STOP at $short: $subject" >&2
        echo "   docs/source/en/kv_cache.md conflicts: resolve it in $ASM, git add it, git cherry-pick --continue," \
          "then rerun (rerere remembers the resolution)" >&2
        exit 3
      else
        "${GIT[@]}" cherry-pick --abort
        echo "   CONFLICT at $short ($name): $subject; in $(echo "$conflicted" | tr '\n' ' ')" >&2
        note "real conflict: $name's $short \"$subject\" does not apply on top of the series before it (files:
  $(echo "$conflicted" | tr '\n' ' ')); the rest of $name's commits were left out. $name: rebase on refs/authors/* of
  $ASM (or on the other authors' branches) and resolve."
        partial=1
        break
      fi
    fi
    picked_ids[$id]=1
    picked_subjects[$subject]=1
  done
done

mkdir -p "$OUT"
rm -f "$OUT"/[0-9][0-9][0-9][0-9]-*.patch
git -C "$ASM" format-patch -q --zero-commit -o "$OUT" "$BASE..series"
(cd "$OUT" && ls [0-9][0-9][0-9][0-9]-*.patch) > "$OUT/series"
echo "$(wc -l < "$OUT/series") patches in $OUT (series: $(git -C "$ASM" rev-parse --short series))"
if [ -n "$partial" ]; then echo "PARTIAL: some commits were left out (see $NOTES)" >&2; fi

if [ -n "$INSTALL" ]; then
  rm -f "$HERE"/[0-9][0-9][0-9][0-9]-*.patch
  cp "$OUT"/[0-9][0-9][0-9][0-9]-*.patch "$HERE/"
  cp "$OUT/series" "$HERE/series"
  echo "installed into $HERE"
fi

failed=$partial
if [ -n "$CHECK" ]; then
  export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  for script in check_request check_family; do
    args=()
    if [ "$script" = check_family ]; then args=(--json "$OUT/family.json"); fi
    if (cd "$OUT" && PYTHONPATH="$ASM/src" "$PY" "$HERE/$script.py" "${args[@]}" > "$OUT/$script.log" 2>&1); then
      echo "$script: passed ($OUT/$script.log)"
    else
      echo "$script: FAILED ($OUT/$script.log)"; failed=1
    fi
  done
fi
if [ -n "$TREE_CHECKS" ]; then
  # shellcheck disable=SC2086
  if "$PY" "$HERE/check_tree.py" --tree "$TREE" --series "$OUT/series" ${CHECK_TREE_ARGS:---skip source} \
    > "$OUT/check_tree.log" 2>&1; then
    echo "check_tree: passed ($OUT/check_tree.log)"
  else
    echo "check_tree: FAILED ($OUT/check_tree.log)"; failed=1
  fi
  grep -E "^(ok  |FAIL|tree checks)" "$OUT/check_tree.log" || true
fi
[ -z "$failed" ]
