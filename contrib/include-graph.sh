#!/bin/sh
# The core's module graph, from its #include "…" lines: one edge "a b" per line (module a
# uses module b), and a check that it has no cycle. A module is a header and the files
# that implement it: x.h, x.c, x_linux.c (a platform's backend), cli_*.c (the commands
# behind cli.h). Usage: contrib/include-graph.sh [--print] [DIR]  (DIR: core)
set -eu
print=false
[ "${1:-}" = --print ] && { print=true; shift; }
dir=${1:-core}

module() {
    m=$(basename "$1"); m=${m%.[ch]}; m=${m%_linux}
    case $m in cli_*) m=cli ;; esac
    echo "$m"
}

edges=$(for f in "$dir"/*.c "$dir"/*.h; do
    from=$(module "$f")
    sed -n 's/^#include "\([^"]*\)".*/\1/p' "$f" | while read -r h; do
        to=$(module "$h")
        if [ "$from" != "$to" ]; then echo "$from $to"; fi
    done
done | sort -u)

$print && echo "$edges"
# tsort names a cycle on stderr and exits non-zero when the graph has one.
if ! echo "$edges" | tsort >/dev/null 2>/tmp/include-graph.$$; then
    echo "include-graph: the core's modules have a cycle:" >&2
    cat /tmp/include-graph.$$ >&2
    rm -f /tmp/include-graph.$$
    exit 1
fi
rm -f /tmp/include-graph.$$
echo "include-graph: $(echo "$edges" | wc -l) edges among the core's modules, no cycle"
