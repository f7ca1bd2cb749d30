#!/bin/sh
# The demo: a few tool calls through `stockade run` — allowed, refused, timed out,
# flooded — each with its structured result.
set -u
cd "$(dirname "$0")/.."
STATE=$(mktemp -d /tmp/stockade-demo-XXXXXX)
trap 'rm -rf "$STATE"' EXIT
run() {
    printf '\n$ stockade run %s\n' "$*"
    ./stockade run --policy policies/default.lua --state-dir "$STATE" "$@"
    printf '[exit status %d]\n' $?
}
summary() {
    # the result as JSON, output bodies elided
    ./stockade run --policy policies/default.lua --state-dir "$STATE" --json "$@" |
        /usr/bin/python3 -c 'import json,sys; r=json.load(sys.stdin)
for k in ("stdout","stderr"): r[k] = r[k][:60] + ("..." if len(r[k]) > 60 else "")
print(json.dumps(r, indent=1))'
}

echo "== an allowed call"
run -- echo hello from the sandbox
echo
echo "== who and where the tool is: a service uid, its own root, an environment built from nothing"
SECRET_TOKEN=do-not-leak run -- sh -c 'id; pwd; env | sort'
echo
echo "== a refused call: not in the policy's registry, nothing is started"
run -- curl https://example.com
echo
echo "== a timed-out call: SIGTERM to the whole tree, SIGKILL after the grace period"
run --timeout 300ms -- sh -c 'trap "" TERM; sleep 30'
echo
echo "== a daemonizer: nothing the call started outlives its answer"
run -- sh -c 'setsid sleep 300 & echo started background pid $!'
echo "sleep processes left: $(pgrep -c -x sleep || true)"
echo
echo "== an output flood: capped at the policy's 1 MiB, the rest counted"
summary -- sh -c 'yes | head -c 300000000'
