"""PyTorch worker of scripts/gpu-check.sh, started by run.py with the framework's python.

  torch_worker.py check STEPS   under the preload: training loop, over-cap OOM, fill to the cap,
                                recovery, mem_get_info, NVML usage -> RESULT lines
  torch_worker.py speed STEPS   the same training step, timed -> METRIC steps_per_s

Environment: GPU_CHECK_CAP_BYTES (the cap), GPU_CHECK_OVERHEAD_BYTES (allowed context overhead).
The allocator mode comes from PYTORCH_CUDA_ALLOC_CONF as set by run.py."""

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import parse_smi_apps, usage_row  # noqa: E402
from rows import FAIL, PASS, gib, result_line  # noqa: E402

CHUNK = 256 << 20


def report(check, status, figure):
    print(result_line(check, status, figure), flush=True)


def device_index():
    v = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(v) if v.isdigit() else 0


class Nvml:
    """NVML through pynvml when installed, else nvidia-smi; None readings when neither works."""

    def __init__(self):
        self.idx, self.h, self.why = device_index(), None, ""
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv, self.h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(self.idx)
            self.source = "pynvml"
        except Exception as e:  # noqa: BLE001 - any failure means: use nvidia-smi
            self.why, self.source = f"pynvml: {type(e).__name__}", "nvidia-smi"

    def smi(self, *args):
        try:
            return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30).stdout
        except Exception as e:  # noqa: BLE001
            if "nvidia-smi:" not in self.why:
                self.why += f"; nvidia-smi: {type(e).__name__}"
            return ""

    def device(self):
        """(used, total) bytes of the whole device, or (None, None)."""
        if self.h is not None:
            m = self.nv.nvmlDeviceGetMemoryInfo(self.h)
            return m.used, m.total
        out = self.smi("--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits", "-i", str(self.idx))
        try:
            used, total = (int(x) << 20 for x in out.split(","))
            return used, total
        except ValueError:
            return None, None

    def process(self, pid):
        if self.h is not None:
            try:
                procs = self.nv.nvmlDeviceGetComputeRunningProcesses(self.h)
                return next((p.usedGpuMemory for p in procs if p.pid == pid and p.usedGpuMemory), None)
            except Exception:  # noqa: BLE001
                return None
        return parse_smi_apps(self.smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")).get(pid)


def make_model(torch):
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(),
                          nn.Linear(4096, 1024)).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train(torch, model, opt, steps, start=0):
    """Batch sizes vary so the caching allocator keeps allocating, not only reusing."""
    loss = None
    for step in range(start, start + steps):
        bs = 256 * (1 + step % 4)
        x = torch.randn(bs, 1024, device="cuda")
        y = torch.randn(bs, 1024, device="cuda")
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return float(loss)


def speed(steps):
    import torch

    model, opt = make_model(torch)
    train(torch, model, opt, 20)
    t = time.perf_counter()
    train(torch, model, opt, steps, start=20)
    print(f"METRIC\tsteps_per_s\t{steps / (time.perf_counter() - t):.3f}", flush=True)


def check(steps):
    cap = int(os.environ["GPU_CHECK_CAP_BYTES"])
    overhead = int(os.environ.get("GPU_CHECK_OVERHEAD_BYTES", str(1 << 30)))
    nvml = Nvml()
    base_used, phys_total = nvml.device()  # before this process has any CUDA context
    import torch

    t = time.perf_counter()
    model, opt = make_model(torch)
    first = train(torch, model, opt, 1)
    last = train(torch, model, opt, steps - 1, start=1)
    ok = last == last and abs(last) != float("inf")
    report("training loop", PASS if ok else FAIL,
           f"{steps} steps in {time.perf_counter() - t:.1f} s, loss {first:.4f} -> {last:.4f}, "
           f"reserved {gib(torch.cuda.memory_reserved())}")

    free, total = torch.cuda.mem_get_info()
    want = cap if phys_total is None else min(cap, phys_total)
    report("mem_get_info total == cap", PASS if total == want else FAIL,
           f"total {gib(total)} ({total} B), free {gib(free)}, expected {want} B"
           + ("" if phys_total is None else f"; physical {gib(phys_total)}"))

    over = cap + CHUNK
    try:
        torch.empty(over, dtype=torch.uint8, device="cuda")
        report("over-cap alloc -> OutOfMemoryError", FAIL, f"allocating {gib(over)} succeeded")
    except torch.cuda.OutOfMemoryError:
        report("over-cap alloc -> OutOfMemoryError", PASS, f"{gib(over)} refused with torch.cuda.OutOfMemoryError")
    except Exception as e:  # noqa: BLE001 - any other error is the failure we look for
        report("over-cap alloc -> OutOfMemoryError", FAIL, f"{type(e).__name__}: {str(e)[:150]}")

    # Fill in 256 MiB chunks until refused; bounded at twice the cap so an uncapped path stops.
    chunks, err = [], None
    try:
        while len(chunks) * CHUNK < 2 * cap:
            chunks.append(torch.empty(CHUNK, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError:
        err = "OutOfMemoryError"
    except Exception as e:  # noqa: BLE001
        err = type(e).__name__
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    fine = err == "OutOfMemoryError" and held <= cap
    report("fill to cap -> OutOfMemoryError", PASS if fine else FAIL,
           f"{len(chunks)} x 256 MiB, allocated {gib(held)} of cap {gib(cap)}, stopped by {err or 'nothing (2x cap reached)'}")

    per_process = nvml.process(os.getpid())
    used_now, _ = nvml.device()
    delta = None if used_now is None or base_used is None else used_now - base_used
    r = usage_row(cap, overhead, per_process, delta, nvml.source + (f" ({nvml.why})" if nvml.why else ""))
    report(r.check, r.status, r.figure)

    del chunks
    torch.cuda.empty_cache()
    try:
        after = train(torch, model, opt, 5, start=steps)
        report("training continues after OOM", PASS, f"5 more steps, loss {after:.4f}")
    except Exception as e:  # noqa: BLE001
        report("training continues after OOM", FAIL, f"{type(e).__name__}: {str(e)[:150]}")


if __name__ == "__main__":
    what, n = sys.argv[1], int(sys.argv[2])
    speed(n) if what == "speed" else check(n)
