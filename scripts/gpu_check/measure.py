"""Pure judgements of scripts/gpu-check.sh: a trace's peak, NVML/nvidia-smi parsing, the
memory-bound and speed verdicts. Standard library only (tested in CI by test_pure.py)."""

import json
import statistics

from rows import FAIL, PASS, SKIP, Row, gib


def trace_peak(lines):
    """Per-device peak charge of one trace (docs/trace-format.md, version 1).

    The summary's `peak` is authoritative when present; a trace cut short (SIGKILL, timeout) has
    no summary, so the peak is then the highest `used` of its events. Unknown line types and a
    truncated last line are skipped, as the format requires of readers.
    Returns (peaks: {dev: bytes}, source: "summary" | "events", events: int)."""
    from_events, summary, events = {}, None, 0
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        kind = rec.get("type")
        if kind == "event":
            events += 1
            dev, used = rec.get("dev"), rec.get("used")
            if isinstance(dev, int) and dev >= 0 and isinstance(used, int):
                from_events[dev] = max(from_events.get(dev, 0), used)
        elif kind == "summary" and isinstance(rec.get("peak"), dict):
            summary = {int(k): int(v) for k, v in rec["peak"].items()}
    if summary is not None:
        return summary, "summary", events
    return from_events, "events", events


def traces_peak_row(paths, cap):
    """One row for all trace files of a run (one per process): max peak over them ≤ cap, and the
    trace must have seen allocations at all (an empty trace proves nothing)."""
    if not paths:
        return Row("trace peak <= cap", FAIL, "no trace file was written")
    peak, events, sources = 0, 0, set()
    for p in paths:
        with open(p, encoding="utf-8", errors="replace") as f:
            peaks, source, n = trace_peak(f)
        peak = max([peak] + list(peaks.values()))
        events += n
        sources.add(source)
    fig = f"peak {gib(peak)} (cap {gib(cap)}), {events} events, from {'/'.join(sorted(sources))}"
    if peak == 0:
        return Row("trace peak <= cap", FAIL, f"trace recorded no allocation: {fig}")
    return Row("trace peak <= cap", PASS if peak <= cap else FAIL, fig)


def parse_smi_apps(csv_text):
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` →
    {pid: bytes}. Tolerates a header line, units and `[N/A]` values."""
    out = {}
    for line in csv_text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2 or not parts[0].isdigit():
            continue
        mib = parts[1].split()[0] if parts[1] else ""
        if mib.isdigit():
            out[int(parts[0])] = out.get(int(parts[0]), 0) + int(mib) * (1 << 20)
    return out


def usage_row(cap, overhead, per_process=None, device_delta=None, source=""):
    """NVML's view of the process at its fullest must stay within cap + context overhead (the
    CUDA context, kernels and library handles are memory vramcap does not charge).
    per_process wins; a device-level delta (used now − used before CUDA started) stands in when
    the per-process list does not show us (a container's PID namespace)."""
    name = "NVML usage <= cap + overhead"
    bound = cap + overhead
    if per_process is not None:
        used, how = per_process, f"per-process ({source})"
    elif device_delta is not None:
        used, how = device_delta, f"device used delta ({source}; per-process not visible)"
    else:
        return Row(name, SKIP, f"no NVML reading: {source or 'pynvml and nvidia-smi unavailable'}")
    fig = f"{gib(used)} {how}; bound {gib(cap)} cap + {gib(overhead)} overhead"
    return Row(name, PASS if used <= bound else FAIL, fig)


def median(xs):
    return statistics.median(xs) if xs else None


def speed_row(bare, preload, min_ratio):
    """steps/s under the preload ÷ without it, medians of interleaved runs."""
    name = "steps/s preload/bare"
    mb, mp = median(bare), median(preload)
    if not mb or not mp:
        return Row(name, FAIL, f"missing measurements (bare {bare}, preload {preload})")
    ratio = mp / mb
    fig = (f"ratio {ratio:.3f} (preload {mp:.1f} vs bare {mb:.1f} steps/s, medians of "
           f"{len(preload)}+{len(bare)} interleaved runs; pass >= {min_ratio})")
    return Row(name, PASS if ratio >= min_ratio else FAIL, fig)


def parse_size_output(text):
    """`vramcap size SPEC` prints bytes, or `N% of the device` / `0 (no limit)`: only a plain
    byte count is a usable cap for the check."""
    t = text.strip()
    return int(t) if t.isdigit() and int(t) > 0 else None
