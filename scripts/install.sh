#!/usr/bin/env bash
# Installs vramcap: PREFIX/bin/vramcap, PREFIX/lib/libvramcap.so (the preload library; `vramcap
# run` finds it there, ../lib from the binary) and, for `vramcap demo`, the fake driver and its
# job in PREFIX/share/vramcap/demo (not on any loader path: only the demo uses them).
#
#   scripts/install.sh [--prefix DIR] [--no-build]     (default prefix: /usr/local)
set -euo pipefail
cd "$(dirname "$0")/.."

prefix=/usr/local
build=1
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || { echo "install.sh: --prefix needs a directory" >&2; exit 2; }; prefix=$2; shift 2 ;;
        --prefix=*) prefix=${1#--prefix=}; shift ;;
        --no-build) build=0; shift ;;
        -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install.sh: unknown argument '$1'; expected [--prefix DIR] [--no-build]" >&2; exit 2 ;;
    esac
done
[ -n "$prefix" ] || { echo "install.sh: --prefix is empty; expected a directory such as /usr/local" >&2; exit 2; }

if [ "$build" = 1 ]; then
    cargo build --release --locked
    if command -v make >/dev/null && command -v cc >/dev/null; then
        make -s -C cuda-shim
    else
        echo "install.sh: no make/cc: skipping the demo's fake driver (vramcap demo will not work)" >&2
    fi
fi
for f in target/release/vramcap target/release/libvramcap.so; do
    [ -f "$f" ] || { echo "install.sh: $f missing: run without --no-build (or cargo build --release)" >&2; exit 1; }
done

install -d "$prefix/bin" "$prefix/lib"
install -m 0755 target/release/vramcap "$prefix/bin/vramcap"
install -m 0755 target/release/libvramcap.so "$prefix/lib/libvramcap.so"
echo "installed $prefix/bin/vramcap and $prefix/lib/libvramcap.so"
if [ -f target/cuda-shim/libcuda.so.1 ] && [ -f target/cuda-shim/demo_train ]; then
    install -d "$prefix/share/vramcap/demo"
    install -m 0755 target/cuda-shim/libcuda.so.1 target/cuda-shim/demo_train "$prefix/share/vramcap/demo/"
    echo "installed the demo's fake driver in $prefix/share/vramcap/demo"
fi
echo "check the machine with: $prefix/bin/vramcap doctor"
