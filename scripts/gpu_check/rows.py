"""Result rows of scripts/gpu-check.sh: the line protocol between workers and the orchestrator,
the PASS/FAIL/SKIP logic, and the markdown results table. Standard library only, so CI can
unit-test it without pip (scripts/gpu_check/test_pure.py)."""

from dataclasses import dataclass

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
STATUSES = (PASS, FAIL, SKIP)
PREFIX = "RESULT\t"


@dataclass
class Row:
    check: str
    status: str
    figure: str


def result_line(check, status, figure):
    """The one line a worker prints per check; tabs and newlines in the text would break it."""
    clean = lambda s: " ".join(str(s).replace("\t", " ").split())
    return f"{PREFIX}{clean(check)}\t{status}\t{clean(figure)}"


def parse_rows(text):
    """Rows from a worker's output: every `RESULT\\t<check>\\t<status>\\t<figure>` line; other
    lines are the worker's log. A malformed RESULT line is itself a FAIL, never silently lost."""
    rows = []
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue
        parts = line[len(PREFIX):].split("\t", 2)
        if len(parts) == 3 and parts[1] in STATUSES and parts[0]:
            rows.append(Row(parts[0], parts[1], parts[2]))
        else:
            rows.append(Row("worker output", FAIL, f"unparseable result line: {line[:120]!r}"))
    return rows


def parse_metrics(text):
    """`METRIC\\t<name>\\t<float>` lines (the speed worker's steps/s)."""
    out = {}
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[0] == "METRIC":
            try:
                out[parts[1]] = float(parts[2])
            except ValueError:
                pass
    return out


def fill_missing(expected, rows, rc, why=None):
    """Every expected check gets a row: one the worker never reported (it crashed, timed out or
    was not run) is a FAIL that says why, so a crash can never look like a pass."""
    seen = {r.check for r in rows}
    reason = why or (f"not reported: worker exited with {describe_rc(rc)}" if rc != 0 else "not reported by the worker")
    return list(rows) + [Row(c, FAIL, reason) for c in expected if c not in seen]


def describe_rc(rc):
    if rc is None:
        return "a timeout (killed)"
    if rc < 0:
        return f"signal {-rc}"
    return f"code {rc}"


def prefixed(prefix, rows):
    return [Row(f"{prefix}{r.check}", r.status, r.figure) for r in rows]


def exit_code(rows):
    """Non-zero when any check failed, or when nothing was checked at all."""
    if not rows or any(r.status == FAIL for r in rows):
        return 1
    return 0


def counts(rows):
    return {s: sum(1 for r in rows if r.status == s) for s in STATUSES}


def render_table(rows, meta=()):
    """The markdown results file: a header of (key, value) facts, the table, and the totals."""
    esc = lambda s: str(s).replace("|", "\\|")
    out = ["# vramcap GPU check", ""]
    out += [f"- {k}: {esc(v)}" for k, v in meta]
    out += ["", "| check | result | figure |", "|---|---|---|"]
    out += [f"| {esc(r.check)} | {r.status} | {esc(r.figure)} |" for r in rows]
    c = counts(rows)
    out += ["", f"Totals: PASS {c[PASS]} / FAIL {c[FAIL]} / SKIP {c[SKIP]}; "
            f"overall {'FAIL' if exit_code(rows) else 'PASS'}", ""]
    return "\n".join(out)


def render_plain(rows):
    """The same table for a terminal: aligned columns."""
    w = max([len("check")] + [len(r.check) for r in rows])
    lines = [f"{'check':<{w}}  result  figure", f"{'-' * w}  ------  ------"]
    lines += [f"{r.check:<{w}}  {r.status:<6}  {r.figure}" for r in rows]
    return "\n".join(lines)


def gib(n):
    return f"{n / (1 << 30):.2f} GiB"
