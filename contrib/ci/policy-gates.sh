#!/bin/sh
# The stockade policy gates, as one script a CI job (or a person) runs at the root of a
# policy repository. The same steps as contrib/ci/github-actions.yml:
#
#   1. stockade check    every policy: paths, owners, schemas, timeouts, env, mounts, secrets
#   2. stockade diff     each policy against the base branch (git show BASE:path): what it
#                        widens; fails when an added tool lacks schema, owner or timeout
#                        (and on any widening with FAIL_ON_WIDEN=1)
#   3. stockade dry-run  each tool's probe in a throwaway session: nothing written outside
#                        its root (run as root, so that every session gets its own uid)
#   4. stockade budget   the timeout budget: the fuse below idle_shutdown
#   5. stockade test     the policy's LuaUnit tests
#
# Every step runs even when an earlier one failed; the exit status is 1 if any failed.
# Settings (environment):
#   STOCKADE       the binary (default: stockade on PATH). Run from a build tree or an
#                  install that has lua/schema.lua and plugins/secrets.lua beside it or in
#                  /usr/share/stockade, so that check can validate schemas and secrets.
#   BASE           the git revision to diff against (default: origin/$GITHUB_BASE_REF when
#                  set, else origin/main); no diff step when it does not resolve
#   POLICIES       the policy files (default: policies/*.lua)
#   POLICY_TESTS   the LuaUnit files (default: policies/tests/*.lua)
#   FAIL_ON_WIDEN  1: a widening fails the diff step (default 0: reported, for review)
#   SKIP_DRY_RUN   1: skip step 3 (e.g. a runner without root)
#   OUT            where the JSON reports go (default: gates-out)
set -u

STOCKADE=${STOCKADE:-stockade}
if [ -n "${GITHUB_BASE_REF:-}" ]; then BASE=${BASE:-origin/$GITHUB_BASE_REF}; fi
BASE=${BASE:-origin/main}
POLICIES=${POLICIES:-policies/*.lua}
POLICY_TESTS=${POLICY_TESTS:-policies/tests/*.lua}
FAIL_ON_WIDEN=${FAIL_ON_WIDEN:-0}
SKIP_DRY_RUN=${SKIP_DRY_RUN:-0}
OUT=${OUT:-gates-out}

failed=""
mkdir -p "$OUT"
work=$(mktemp -d "${TMPDIR:-/tmp}/policy-gates.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT INT TERM

step() { printf '\n== %s\n' "$*"; }
fail() { failed="$failed $1"; printf '!! %s failed\n' "$1"; }
slug() { printf '%s' "$1" | tr '/.' '__'; }

# shellcheck disable=SC2086  # the globs are meant to expand
set -- $POLICIES
if [ "$#" -eq 0 ] || [ ! -e "$1" ]; then
    echo "policy-gates: no policy matches '$POLICIES'" >&2
    exit 1
fi

step "check"
"$STOCKADE" check "$@" || fail check

step "diff against $BASE"
if git rev-parse --verify --quiet "$BASE^{commit}" >/dev/null 2>&1; then
    base="$work/base"
    mkdir -p "$base"
    # the base's plugins too: the old policy must load with the plugins it was written for
    if git cat-file -e "$BASE:plugins" 2>/dev/null; then
        git archive "$BASE" plugins | tar -x -C "$base"
    fi
    flags=""
    [ "$FAIL_ON_WIDEN" = 1 ] && flags="--fail-on-widen"
    for p in "$@"; do
        old="$base/$p"
        mkdir -p "$(dirname "$old")"
        if ! git show "$BASE:$p" > "$old" 2>/dev/null; then
            # a new policy file: every tool in it is added
            echo 'return require("stockade").policy { name = "(none)" }' > "$old"
        fi
        # shellcheck disable=SC2086
        "$STOCKADE" diff "$old" "$p" $flags || fail "diff $p"
        # shellcheck disable=SC2086
        "$STOCKADE" diff "$old" "$p" --json $flags > "$OUT/diff-$(slug "$p").json" || true
    done
else
    echo "policy-gates: base revision '$BASE' not found: no diff (fetch it, or set BASE)"
fi

step "dry-run"
if [ "$SKIP_DRY_RUN" = 1 ]; then
    echo "skipped (SKIP_DRY_RUN=1)"
else
    [ "$(id -u)" = 0 ] || echo "note: not root: the probes run under your own uid"
    for p in "$@"; do
        "$STOCKADE" dry-run "$p" || fail "dry-run $p"
    done
fi

step "budget"
for p in "$@"; do
    "$STOCKADE" budget "$p" || fail "budget $p"
    "$STOCKADE" budget "$p" --json > "$OUT/budget-$(slug "$p").json" || true
done

step "test"
# shellcheck disable=SC2086
set -- $POLICY_TESTS
if [ "$#" -gt 0 ] && [ -e "$1" ]; then
    "$STOCKADE" test "$@" || fail test
else
    echo "no policy tests match '$POLICY_TESTS'"
fi

echo
if [ -n "$failed" ]; then
    echo "policy gates FAILED:$failed"
    exit 1
fi
echo "policy gates passed"
