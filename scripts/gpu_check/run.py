"""Orchestrator of scripts/gpu-check.sh (standard library only; the frameworks run in worker
processes started with --python). Runs every check with its own timeout inside one overall time
budget, rewrites the results file after each check (a run cut short still leaves its table), and
exits non-zero when any check failed. `--dry-run` prints the plan without running anything."""

import argparse
import datetime
import glob
import os
import shlex
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from measure import parse_size_output, speed_row, traces_peak_row  # noqa: E402
from rows import FAIL, PASS, SKIP, Row, exit_code, fill_missing, parse_metrics, parse_rows, prefixed  # noqa: E402
from rows import render_plain, render_table  # noqa: E402

MODES = {  # name -> PYTORCH_CUDA_ALLOC_CONF (None: unset)
    "default": None,
    "expandable": "expandable_segments:True",
    "async": "backend:cudaMallocAsync",
}
TORCH_CHECKS = ["training loop", "mem_get_info total == cap", "over-cap alloc -> OutOfMemoryError",
                "fill to cap -> OutOfMemoryError", "NVML usage <= cap + overhead", "training continues after OOM"]
TF_MODES = {"bfc": None, "allow_growth": "true"}  # -> TF_FORCE_GPU_ALLOW_GROWTH
TF_CHECKS = ["memory limit <= cap", "training steps", "over-cap alloc -> ResourceExhaustedError"]


def args_parser():
    p = argparse.ArgumentParser(description=__doc__)
    a = p.add_argument
    a("--python", default="python3", help="interpreter that has torch (and tensorflow)")
    a("--lib", required=True, help="libvramcap.so")
    a("--bin", required=True, help="the vramcap CLI")
    a("--out", required=True, help="directory for logs, traces and gpu-check-results.md")
    a("--results", help="results file (default OUT/gpu-check-results.md)")
    a("--limit", default="4GiB")
    a("--overhead", type=int, default=1 << 30, help="bytes of CUDA context overhead allowed over the cap")
    a("--steps", type=int, default=300)
    a("--speed-steps", type=int, default=200)
    a("--speed-rounds", type=int, default=2)
    a("--min-speed-ratio", type=float, default=0.9)
    a("--modes", default=",".join(MODES))
    a("--no-tf", action="store_true")
    a("--setup-rows", help="file of RESULT lines from the set-up steps (build, install)")
    a("--meta", action="append", default=[], help="KEY=VALUE line for the results header")
    a("--step-timeout", type=int, default=240, help="seconds for one worker process")
    a("--deadline", type=int, default=480, help="seconds for all checks together")
    a("--dry-run", action="store_true")
    return p


class Runner:
    def __init__(self, o):
        self.o, self.t0, self.rows, self.meta = o, time.monotonic(), [], []
        self.logs = os.path.join(o.out, "logs")
        self.traces = os.path.join(o.out, "traces")
        self.results = o.results or os.path.join(o.out, "gpu-check-results.md")

    def env(self, preload, extra, trace=None):
        """Inherited environment without any vramcap setting, plus what this run states."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("VRAMCAP_") and k not in ("LD_PRELOAD", "PYTORCH_CUDA_ALLOC_CONF",
                                                             "TF_FORCE_GPU_ALLOW_GROWTH")}
        env["PYTHONUNBUFFERED"] = "1"
        if preload:
            env.update(LD_PRELOAD=os.path.abspath(self.o.lib), VRAMCAP_LIMIT=self.o.limit)
            if trace:
                env["VRAMCAP_TRACE"] = os.path.join(os.path.abspath(self.traces), trace)
        env.update({k: v for k, v in extra.items() if v is not None})
        return env

    def run(self, name, argv, env, timeout=None):
        """(rc or None on timeout/not run, output). Output also goes to logs/NAME.log."""
        left = self.o.deadline - (time.monotonic() - self.t0)
        if self.o.dry_run:
            shown = {k: env[k] for k in sorted(env) if k.startswith(("VRAMCAP_", "LD_PRELOAD", "PYTORCH_", "TF_", "GPU_CHECK_"))}
            print(f"PLAN {name}: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in shown.items()) + " " + shlex.join(argv))
            return 0, ""
        if left < 15:
            return None, f"not run: the {self.o.deadline} s budget for all checks was spent"
        limit = min(timeout or self.o.step_timeout, left)
        t = time.monotonic()
        p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             errors="replace", start_new_session=True)
        try:
            out, rc = p.communicate(timeout=limit)[0], p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, rc = p.communicate()[0] + f"\n[killed after {limit:.0f} s]\n", None
        with open(os.path.join(self.logs, f"{name}.log"), "w") as f:
            f.write(f"$ {shlex.join(argv)}\n{out}")
        print(f"  {name}: {'timeout' if rc is None else 'rc ' + str(rc)} in {time.monotonic() - t:.1f} s", flush=True)
        return rc, out

    def add(self, rows):
        self.rows += rows
        for r in rows:
            print(f"  {r.status}  {r.check}: {r.figure}", flush=True)
        self.write()

    def write(self):
        if self.o.dry_run:
            return
        with open(self.results, "w") as f:
            f.write(render_table(self.rows, self.meta))

    def worker(self, name, prefix, expected, argv, env):
        rc, out = self.run(name, argv, env)
        why = out.strip() if rc is None and out.startswith("not run") else None
        self.add(prefixed(prefix, fill_missing(expected, parse_rows(out), rc, why)))


def cap_bytes(r):
    try:
        out = subprocess.run([r.o.bin, "size", r.o.limit], capture_output=True, text=True, timeout=20)
    except OSError as e:
        return None, f"cannot run {r.o.bin}: {e}"
    cap = parse_size_output(out.stdout) if out.returncode == 0 else None
    return cap, f"`vramcap size {r.o.limit}` gave {(out.stdout + out.stderr).strip()!r}; need a byte size like 4GiB"


def facts(r):
    """Results header: date, GPU, driver, commit, command."""
    r.meta.append(("date", datetime.datetime.now().astimezone().isoformat(timespec="seconds")))
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        smi = f"nvidia-smi unavailable ({type(e).__name__})"
    r.meta.append(("GPU (name, driver, memory)", smi.replace("\n", "; ") or "nvidia-smi printed nothing"))
    try:
        commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    r.meta.append(("vramcap commit", commit or "unknown"))
    r.meta += [tuple(m.split("=", 1)) for m in r.o.meta if "=" in m]


def torch_checks(r, cap):
    py, worker = r.o.python, os.path.join(HERE, "torch_worker.py")
    probe = "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
    rc, out = r.run("torch-probe", [py, "-c", probe], r.env(False, {}), timeout=120)
    have = rc == 0
    last = out.strip().splitlines()[-1] if out.strip() else f"no output (rc {rc})"
    if not r.o.dry_run:
        r.add([Row("torch: imports and sees the GPU", PASS if have else FAIL, last[:200])])
    if have and not r.o.dry_run:
        r.meta.append(("framework", last))
    report_ok, report_why = report_available(r)
    gpu_env = {"GPU_CHECK_CAP_BYTES": str(cap), "GPU_CHECK_OVERHEAD_BYTES": str(r.o.overhead)}
    for mode in r.o.modes.split(","):
        conf = {"PYTORCH_CUDA_ALLOC_CONF": MODES[mode], **gpu_env}
        prefix = f"torch[{mode}]: "
        if not have:
            r.add(prefixed(prefix, fill_missing(TORCH_CHECKS + ["trace peak <= cap", "steps/s preload/bare"], [], 1,
                                                "not run: torch is not usable (see the torch row)")))
            continue
        for old in glob.glob(os.path.join(r.traces, f"{mode}-*.jsonl")):
            os.remove(old)
        r.worker(f"torch-{mode}-check", prefix, TORCH_CHECKS, [py, worker, "check", str(r.o.steps)],
                 r.env(True, conf, trace=f"{mode}-%p.jsonl"))
        traces = sorted(glob.glob(os.path.join(r.traces, f"{mode}-*.jsonl")))
        if not r.o.dry_run:
            r.add(prefixed(prefix, [traces_peak_row(traces, cap)]))
            r.add(prefixed(prefix, [report_row(r, mode, traces, report_ok, report_why)]))
        speeds = {True: [], False: []}
        for rnd in range(r.o.speed_rounds):
            for pre in ((False, True) if rnd % 2 == 0 else (True, False)):
                name = f"torch-{mode}-speed{rnd}-{'preload' if pre else 'bare'}"
                env = r.env(pre, conf, trace=f"speed-{mode}-%p.jsonl")
                _, out = r.run(name, [py, worker, "speed", str(r.o.speed_steps)], env)
                v = parse_metrics(out).get("steps_per_s")
                if v:
                    speeds[pre].append(v)
        if not r.o.dry_run:
            r.add(prefixed(prefix, [speed_row(speeds[False], speeds[True], r.o.min_speed_ratio)]))


def report_available(r):
    try:
        p = subprocess.run([r.o.bin, "report", "--help"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{type(e).__name__}"
    first = (p.stderr or p.stdout).strip().splitlines()[:1]
    return p.returncode == 0, f"`vramcap report --help` exited {p.returncode}: {first[0][:100] if first else ''}"


def report_row(r, mode, traces, ok, why):
    name = "vramcap report on the trace"
    if not ok:
        return Row(name, SKIP, f"report subcommand not available ({why}); peak computed in Python above")
    if not traces:
        return Row(name, FAIL, "no trace to report on")
    rc, out = r.run(f"torch-{mode}-report", [r.o.bin, "report", traces[0]], dict(os.environ), timeout=60)
    first = next((l for l in out.splitlines() if l.strip() and not l.startswith("$ ")), "")
    return Row(name, PASS if rc == 0 else FAIL, f"rc {rc}: {first[:120]}")


def tf_checks(r, cap):
    if r.o.no_tf:
        r.add([Row("tensorflow", SKIP, "--no-tf")])
        return
    rc, out = r.run("tf-probe", [r.o.python, "-c", "import tensorflow as tf; print('tensorflow', tf.__version__)"],
                    r.env(False, {}), timeout=120)
    if rc != 0:
        r.add([Row("tensorflow", SKIP, "tensorflow not installed (import failed: "
                   + (out.strip().splitlines() or ['no output'])[-1][:120] + ")")])
        return
    for mode, growth in TF_MODES.items():
        env = r.env(True, {"TF_FORCE_GPU_ALLOW_GROWTH": growth, "GPU_CHECK_CAP_BYTES": str(cap),
                           "TF_CPP_MIN_LOG_LEVEL": "2"}, trace=f"tf-{mode}-%p.jsonl")
        r.worker(f"tf-{mode}", f"tf[{mode}]: ", TF_CHECKS, [r.o.python, os.path.join(HERE, "tf_worker.py"), "20"], env)


def main(argv=None):
    o = args_parser().parse_args(argv)
    r = Runner(o)
    unknown = [m for m in o.modes.split(",") if m not in MODES]
    if unknown:
        sys.exit(f"gpu-check: unknown --modes entry {unknown}; expected a comma list of {', '.join(MODES)}")
    if not o.dry_run:
        os.makedirs(r.logs, exist_ok=True)
        os.makedirs(r.traces, exist_ok=True)
        facts(r)
    if o.setup_rows and os.path.exists(o.setup_rows):
        with open(o.setup_rows) as f:
            r.add(parse_rows(f.read()))
    cap, why = (4 << 30, "") if o.dry_run else cap_bytes(r)
    if cap is None:
        r.add([Row("cap size", FAIL, why)])
    else:
        r.meta.append(("cap", f"VRAMCAP_LIMIT={o.limit} = {cap} B; overhead allowed {o.overhead} B"))
        torch_checks(r, cap)
        tf_checks(r, cap)
    r.meta.append(("checks took", f"{time.monotonic() - r.t0:.0f} s"))
    r.write()
    if not o.dry_run:
        print("\n" + render_plain(r.rows) + f"\n\nresults: {r.results}")
    return 0 if o.dry_run else exit_code(r.rows)


if __name__ == "__main__":
    sys.exit(main())
