#!/usr/bin/env bash
# Does vramcap work on this GPU? Builds vramcap, prepares a Python with PyTorch (and TensorFlow),
# runs PyTorch under a 4 GiB cap in three allocator modes and TensorFlow with BFC and
# allow_growth, and prints one results table (also written to OUT/gpu-check-results.md).
# Exit status: 0 when no check failed, 1 otherwise, 2 on bad usage.
#
#   scripts/gpu-check.sh                          build, venv, pip install torch + tensorflow[and-cuda]
#   scripts/gpu-check.sh --no-install --no-tf     offline: the python3 that already has torch
#   scripts/gpu-check.sh --dry-run                print the plan, run nothing
#   scripts/gpu-check.sh --self-test              CI: the whole pipeline on the fake driver, with a
#                                                 stand-in torch (scripts/gpu_check/selftest/)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
usage() {
  cat <<EOF
usage: scripts/gpu-check.sh [options] [-- run.py options]
  --no-install     no venv, no pip: use --python as it is (default python3)
  --no-tf          skip TensorFlow (no install, SKIP row)
  --no-build       use target/release/libvramcap.so and target/release/vramcap as they are
  --python PATH    interpreter: the venv's base, or with --no-install the one that has torch
  --out DIR        where gpu-check-results.md and gpu-check-run/ (logs, traces) go (default: repo
                   root; with --self-test target/gpu-check-selftest, so CI leaves no file behind)
  --steps N        training steps per PyTorch check (default 300)
  --limit SIZE     the cap (default 4GiB)
  --deadline S     seconds for all checks after set-up (default 480)
  --lib PATH       the preload library (default target/release/libvramcap.so)
  --bin PATH       the vramcap CLI (default target/release/vramcap)
  --dry-run        print the plan of checks and exit 0
  --self-test      no GPU: run every check on cuda-shim's fake driver with a stand-in torch
                   (implies --no-install --no-build --no-tf, a 1GiB cap, 20 steps)
Options after -- go to scripts/gpu_check/run.py (--modes, --speed-rounds, --overhead, ...).
EOF
}
die() { echo "gpu-check: $*" >&2; exit 2; }
num() { [[ $2 =~ ^[0-9]+$ ]] || die "$1 expects a whole number, got '$2'"; }

INSTALL=1 TF=1 BUILD=1 DRY=0 SELF=0 PY=python3 OUT= STEPS= LIMIT= DEADLINE=480 EXTRA=()
LIB=$ROOT/target/release/libvramcap.so BIN=$ROOT/target/release/vramcap
while [ $# -gt 0 ]; do
  case $1 in
    --no-install) INSTALL=0 ;;
    --no-tf) TF=0 ;;
    --no-build) BUILD=0 ;;
    --dry-run) DRY=1 ;;
    --self-test) SELF=1 INSTALL=0 BUILD=0 TF=0 ;;
    --lib) [ $# -ge 2 ] || die "--lib needs a path"; LIB=$2; shift ;;
    --bin) [ $# -ge 2 ] || die "--bin needs a path"; BIN=$2; shift ;;
    --python) [ $# -ge 2 ] || die "--python needs a path"; PY=$2; shift ;;
    --out) [ $# -ge 2 ] || die "--out needs a directory"; OUT=$2; shift ;;
    --steps) [ $# -ge 2 ] || die "--steps needs a number"; num --steps "$2"; STEPS=$2; shift ;;
    --limit) [ $# -ge 2 ] || die "--limit needs a size such as 4GiB"; LIMIT=$2; shift ;;
    --deadline) [ $# -ge 2 ] || die "--deadline needs seconds"; num --deadline "$2"; DEADLINE=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) usage >&2; die "unknown option '$1'" ;;
  esac
  shift
done

# A real check's table belongs next to the checkout; a self-test's (CI) is a build product.
if [ -z "$OUT" ]; then
  if [ $SELF = 1 ]; then OUT=$ROOT/target/gpu-check-selftest; else OUT=$ROOT; fi
fi
mkdir -p "$OUT" || die "cannot create --out directory '$OUT'"
OUT=$(cd "$OUT" && pwd)
RUN=$OUT/gpu-check-run
RESULTS=$OUT/gpu-check-results.md
if [ $SELF = 1 ]; then
  # The fake driver (device memory = host memory) stands in for the GPU, a ctypes torch for PyTorch.
  make -s -C "$ROOT/cuda-shim" || die "make -C cuda-shim failed"
  export LD_LIBRARY_PATH=$ROOT/target/cuda-shim${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PYTHONPATH=$ROOT/scripts/gpu_check/selftest${PYTHONPATH:+:$PYTHONPATH}
  export FAKECUDA_MEM=16g
  : "${LIMIT:=1GiB}" "${STEPS:=20}"
  EXTRA=(--speed-steps 20 --min-speed-ratio 0 "${EXTRA[@]}")
fi
: "${LIMIT:=4GiB}" "${STEPS:=300}"
ORCH=(python3 "$ROOT/scripts/gpu_check/run.py" --lib "$LIB" --bin "$BIN" --out "$RUN" --results "$RESULTS"
      --limit "$LIMIT" --steps "$STEPS" --deadline "$DEADLINE")
[ $TF = 1 ] || ORCH+=(--no-tf)
command -v python3 >/dev/null || die "python3 is required (the orchestrator uses only its standard library)"

if [ $DRY = 1 ]; then
  exec "${ORCH[@]}" --python "$PY" --dry-run "${EXTRA[@]}"
fi

mkdir -p "$RUN/logs"
SETUP=$RUN/setup-rows.txt
: >"$SETUP"
row() { printf 'RESULT\t%s\t%s\t%s\n' "$1" "$2" "$3" >>"$SETUP"; echo "   $2 $1: $3"; }
# step NAME TIMEOUT CMD...: runs CMD with a timeout, log in RUN/logs/NAME.log; sets SECS and RC.
step() {
  local name=$1 limit=$2 t0=$SECONDS; shift 2
  echo "== $name (timeout ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$RUN/logs/$name.log" 2>&1
  RC=$? SECS=$((SECONDS - t0))
  echo "   $name: rc $RC after ${SECS}s"
}
has_torch() { "$1" -c 'import torch' >/dev/null 2>&1; }

# 1. vramcap itself
if [ $BUILD = 0 ]; then
  row "setup: build" SKIP "--no-build: using the existing target/release build"
elif command -v cargo >/dev/null; then
  step build 900 cargo build --release --locked --manifest-path "$ROOT/Cargo.toml"
  if [ $RC = 0 ]; then row "setup: build (cargo build --release)" PASS "${SECS} s"
  else row "setup: build (cargo build --release)" FAIL "rc $RC after ${SECS} s, see gpu-check-run/logs/build.log (offline? use --no-build with a copied target/release)"; fi
else
  row "setup: build" SKIP "cargo not found: using the existing target/release build"
fi
for f in "$LIB" "$BIN"; do
  [ -f "$f" ] || row "setup: $(basename "$f") present" FAIL "$f missing: build with cargo build --release"
done

# 2. the Python that runs the frameworks
FPY=$PY
if [ $INSTALL = 1 ]; then
  VENV=$ROOT/.venv-gpu-check
  step venv 120 "$PY" -m venv "$VENV"
  if [ $RC = 0 ]; then
    row "setup: venv" PASS "${SECS} s ($VENV)"
    PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --timeout 20 --retries 1)
    step pip-torch 1500 "${PIP[@]}" torch
    if [ $RC = 0 ] && has_torch "$VENV/bin/python"; then
      row "setup: pip install torch" PASS "${SECS} s"
      FPY=$VENV/bin/python
      if [ $TF = 1 ]; then
        step pip-tensorflow 1500 "${PIP[@]}" 'tensorflow[and-cuda]'
        if [ $RC = 0 ]; then row "setup: pip install tensorflow[and-cuda]" PASS "${SECS} s"
        else row "setup: pip install tensorflow[and-cuda]" SKIP "failed after ${SECS} s (offline?), see logs/pip-tensorflow.log"; fi
      fi
    else
      row "setup: pip install torch" SKIP "failed after ${SECS} s (offline?): falling back to $PY, see logs/pip-torch.log"
    fi
  else
    row "setup: venv" SKIP "'$PY -m venv' failed: falling back to $PY"
  fi
fi

# 3. the checks; the orchestrator rewrites RESULTS after every check
echo "== checks with $FPY (budget ${DEADLINE}s)"
T0=$SECONDS
"${ORCH[@]}" --python "$FPY" --setup-rows "$SETUP" "${EXTRA[@]}"
RC=$?
if [ $RC -gt 1 ] || [ ! -f "$RESULTS" ]; then
  # The orchestrator itself broke: still leave a results file that says so.
  { echo "# vramcap GPU check"; echo; echo "| check | result | figure |"; echo "|---|---|---|"
    cut -f2- "$SETUP" | sed 's/\t/ | /g; s/^/| /; s/$/ |/'
    echo "| orchestrator | FAIL | scripts/gpu_check/run.py exited $RC after $((SECONDS - T0)) s |"; } >"$RESULTS"
  echo "gpu-check: the orchestrator exited $RC; partial results in $RESULTS" >&2
  exit 1
fi
exit $RC
