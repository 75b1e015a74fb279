#!/bin/sh
# Quick smoke run of the fake driver and the C clients (no vramcap involved).
# Usage: sh tests/c/smoke.sh [REPO_ROOT]     (used by `make -C cuda-shim check`)
set -eu
ROOT=${1:-$(cd "$(dirname "$0")/../.." && pwd)}
CT=$ROOT/target/ctests
LD_LIBRARY_PATH=$ROOT/target/cuda-shim
export LD_LIBRARY_PATH
unset LD_PRELOAD || true

fail() { echo "smoke: FAIL: $*" >&2; exit 1; }

"$CT/selftest" >/dev/null || fail selftest

for c in linked dlsym procaddr; do
    out=$(FAKECUDA_MEM=1g "$CT/client_$c" init ctx 0 alloc 600m alloc 600m free 0 alloc 600m \
          alloc1 1m free1 3 freeptr 0x1000 info stats 0)
    expect() { printf '%s\n' "$out" | grep -q "$1" || fail "client_$c: no '$1' in:
$out"; }
    expect '^init rc=0$'
    expect '^ctx rc=0$'
    expect '^alloc rc=2 slot=1 ptr=0x0$'
    expect '^free rc=0$'
    expect '^alloc rc=0 slot=2 '
    expect '^alloc1 rc=0 slot=3 .* canary=ok$'
    expect '^free1 rc=0$'
    expect '^freeptr rc=1$'
    expect '^info rc=0 free=444596224 total=1073741824$'
    expect '^stats alloc_calls=4 free_calls=3 bytes_held=629145600 live_allocs=1 '
    "$CT/client_$c" init ctx 0 threads 4 2000 1m 1 | grep -q '^threads ok=[0-9]* oom=0 other=0$' \
        || fail "client_$c threads"
done

DATA=$ROOT/tests/data/lookups
for f in "$DATA"/cudart12.tsv "$DATA"/cudart13.tsv; do
    [ -f "$f" ] || continue
    rows=$(wc -l < "$f")
    out=$("$CT/replay" "$f")
    [ "$(printf '%s\n' "$out" | wc -l)" -eq $((rows + 1)) ] || fail "replay $f: row count"
    printf '%s\n' "$out" | awk -F'\t' '$4 != 0 { bad = 1 } END { exit bad }' || fail "replay $f: rc != 0"
    printf '%s\n' "$out" | grep -q "$(printf '^cuMemAlloc\t3020\t0\t0\t0\t1\t')" || fail "replay $f: cuMemAlloc"
done
echo "smoke ok"
