#!/usr/bin/env bash
# Installs vramcap into a prefix; usage() below is the whole story (and what --help prints).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    cat <<'EOF'
Usage: scripts/install.sh [--prefix DIR] [--no-build]

Builds vramcap (cargo build --release --locked, and make -C cuda-shim for the demo) and installs:
  PREFIX/bin/vramcap            the command
  PREFIX/lib/libvramcap.so      the preload library (vramcap run finds it: ../lib from the binary)
  PREFIX/share/vramcap/demo/    the demo's fake driver and job (vramcap demo; on no loader path)

Options:
  --prefix DIR   where to install (default /usr/local)
  --no-build     install what target/release already holds
  -h, --help     print this and exit

Root is needed only to write PREFIX: --prefix ~/.local needs none (put ~/.local/bin on PATH).
For /usr/local, build as yourself and install as root:
  cargo build --release --locked && make -C cuda-shim && sudo scripts/install.sh --no-build
No ldconfig: nothing links against libvramcap.so; vramcap run, LD_PRELOAD and /etc/ld.so.preload
name it by its full path (PREFIX/lib/libvramcap.so).
EOF
}

prefix=/usr/local
build=1
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || { echo "install.sh: --prefix needs a directory" >&2; exit 2; }; prefix=$2; shift 2 ;;
        --prefix=*) prefix=${1#--prefix=}; shift ;;
        --no-build) build=0; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown argument '$1'; expected [--prefix DIR] [--no-build] (--help says more)" >&2; exit 2 ;;
    esac
done
[ -n "$prefix" ] || { echo "install.sh: --prefix is empty; expected a directory such as /usr/local" >&2; exit 2; }

# Before building: a prefix this user cannot write is said at once, with what to do instead.
existing=$prefix
while [ ! -e "$existing" ]; do existing=$(dirname "$existing"); done
if [ ! -w "$existing" ]; then
    echo "install.sh: cannot write to $prefix as $(id -un): /usr/local and other system prefixes need root" >&2
    echo "  (cargo build --release --locked && sudo scripts/install.sh --no-build), or install for yourself: --prefix ~/.local" >&2
    exit 1
fi

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
case ":$PATH:" in
    *":$prefix/bin:"*) echo "check the machine with: vramcap doctor" ;;
    *) echo "$prefix/bin is not on PATH: add it (export PATH=\"$prefix/bin:\$PATH\"), then check the machine with: vramcap doctor" ;;
esac
