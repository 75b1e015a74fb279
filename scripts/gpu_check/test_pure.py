"""Unit tests of the GPU check's pure parts (no GPU, no pip): run by tests/cli/gpu_check_script.rs as
`python3 -m unittest discover -s scripts/gpu_check -p 'test_*.py'`."""

import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import measure  # noqa: E402
import rows  # noqa: E402
from rows import FAIL, PASS, SKIP, Row  # noqa: E402

GIB = 1 << 30


class RowProtocol(unittest.TestCase):
    def test_round_trip_and_log_lines_ignored(self):
        text = "\n".join(["loading torch...", rows.result_line("training loop", PASS, "300 steps\tin 2 s"),
                          "vramcap: denied cuMemAlloc_v2 of 4563402752 bytes",
                          rows.result_line("over-cap", FAIL, "allocating\n5 GiB succeeded")])
        got = rows.parse_rows(text)
        self.assertEqual(got, [Row("training loop", PASS, "300 steps in 2 s"),
                               Row("over-cap", FAIL, "allocating 5 GiB succeeded")])

    def test_malformed_result_line_is_a_failure(self):
        got = rows.parse_rows("RESULT\tonly-two\tfields\nRESULT\tx\tMAYBE\tfig")
        self.assertEqual([r.status for r in got], [FAIL, FAIL])
        self.assertIn("unparseable", got[0].figure)

    def test_metrics(self):
        self.assertEqual(rows.parse_metrics("METRIC\tsteps_per_s\t812.5\nMETRIC\tx\tnan?\nnoise"),
                         {"steps_per_s": 812.5})

    def test_missing_checks_fail_with_the_reason(self):
        got = rows.fill_missing(["a", "b", "c"], [Row("a", PASS, "ok")], -11)
        self.assertEqual([(r.check, r.status) for r in got], [("a", PASS), ("b", FAIL), ("c", FAIL)])
        self.assertIn("signal 11", got[1].figure)
        self.assertIn("timeout", rows.fill_missing(["a"], [], None)[0].figure)
        self.assertIn("code 3", rows.fill_missing(["a"], [], 3)[0].figure)
        self.assertEqual(rows.fill_missing(["a"], [], 0, "not run: budget")[0].figure, "not run: budget")

    def test_exit_code(self):
        self.assertEqual(rows.exit_code([Row("a", PASS, ""), Row("b", SKIP, "")]), 0)
        self.assertEqual(rows.exit_code([Row("a", PASS, ""), Row("b", FAIL, "")]), 1)
        self.assertEqual(rows.exit_code([]), 1, "a run that checked nothing must not pass")

    def test_table(self):
        t = rows.render_table([Row("torch[default]: a|b", PASS, "1 | 2"), Row("tf", SKIP, "--no-tf"),
                               Row("c", FAIL, "x")], [("GPU (name, driver, memory)", "NVIDIA H200, 580")])
        lines = t.splitlines()
        self.assertIn("- GPU (name, driver, memory): NVIDIA H200, 580", lines)
        self.assertIn("| check | result | figure |", lines)
        self.assertIn("| torch[default]: a\\|b | PASS | 1 \\| 2 |", lines)
        self.assertIn("Totals: PASS 1 / FAIL 1 / SKIP 1; overall FAIL", t)
        for l in lines:
            if l.startswith("| "):
                self.assertEqual(l.replace("\\|", "").count("|"), 4, l)
        self.assertIn("overall PASS", rows.render_table([Row("a", PASS, "")]))
        plain = rows.render_plain([Row("a", PASS, "f1"), Row("longer name", FAIL, "f2")]).splitlines()
        self.assertEqual(plain[2].index("PASS"), plain[3].index("FAIL"))


def trace(events, summary=None, cut=False):
    lines = [json.dumps({"type": "header", "version": 1, "devices": [{"index": 0, "total": 80 * GIB, "limit": 4 * GIB}]})]
    for i, (op, dev, used) in enumerate(events):
        lines.append(json.dumps({"type": "event", "seq": i, "op": op, "dev": dev, "size": 1, "used": used}))
    lines.append(json.dumps({"type": "usage", "dev": 0, "used": 99 * GIB}))  # unknown to v1 readers here
    if summary is not None:
        lines.append(json.dumps({"type": "summary", "events": len(events), "dropped": 0, "peak": summary}))
    if cut:
        lines.append('{"type":"event","seq":99,"dev":0,"used":7')
    return lines


class TracePeak(unittest.TestCase):
    def test_summary_is_authoritative(self):
        peaks, src, n = measure.trace_peak(trace([("alloc", 0, GIB), ("free", 0, 0)], {"0": 3 * GIB, "1": 5}))
        self.assertEqual((peaks, src, n), ({0: 3 * GIB, 1: 5}, "summary", 2))

    def test_cut_trace_uses_events_and_skips_the_torn_line(self):
        peaks, src, n = measure.trace_peak(trace([("alloc", 0, GIB), ("alloc", 0, 2 * GIB), ("deny", 0, 2 * GIB),
                                                  ("free", 0, GIB), ("alloc", -1, 9 * GIB)], cut=True))
        self.assertEqual((peaks, src, n), ({0: 2 * GIB}, "events", 5))

    def rows_for(self, traces, cap=4 * GIB):
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for i, lines in enumerate(traces):
                paths.append(os.path.join(d, f"t{i}.jsonl"))
                with open(paths[-1], "w") as f:
                    f.write("\n".join(lines) + "\n")
            return measure.traces_peak_row(paths, cap)

    def test_peak_row_over_all_processes(self):
        ok = self.rows_for([trace([("alloc", 0, GIB)], {"0": GIB}), trace([("alloc", 0, 4 * GIB)], {"0": 4 * GIB})])
        self.assertEqual(ok.status, PASS)
        self.assertIn("peak 4.00 GiB", ok.figure)
        over = self.rows_for([trace([("alloc", 0, GIB)], {"0": GIB}), trace([], {"0": 4 * GIB + 1})])
        self.assertEqual(over.status, FAIL)

    def test_empty_or_absent_trace_fails(self):
        self.assertEqual(self.rows_for([trace([], {"0": 0})]).status, FAIL)
        self.assertEqual(measure.traces_peak_row([], GIB).status, FAIL)


class Nvml(unittest.TestCase):
    def test_smi_csv(self):
        text = "pid, used_gpu_memory [MiB]\n4242, 4608 MiB\n77, [N/A]\n4242, 512\n\n"
        self.assertEqual(measure.parse_smi_apps(text), {4242: 5120 << 20})

    def test_usage_bound(self):
        cap, over = 4 * GIB, GIB
        self.assertEqual(measure.usage_row(cap, over, per_process=5 * GIB, source="pynvml").status, PASS)
        self.assertEqual(measure.usage_row(cap, over, per_process=5 * GIB + 1).status, FAIL)
        delta = measure.usage_row(cap, over, device_delta=6 * GIB, source="nvidia-smi")
        self.assertEqual(delta.status, FAIL)
        self.assertIn("per-process not visible", delta.figure)
        self.assertEqual(measure.usage_row(cap, over, per_process=GIB, device_delta=9 * GIB).status, PASS)
        self.assertEqual(measure.usage_row(cap, over).status, SKIP)


class Speed(unittest.TestCase):
    def test_ratio_of_medians(self):
        r = measure.speed_row([100.0, 90.0, 110.0], [95.0, 97.0, 10.0], 0.9)
        self.assertEqual(r.status, PASS)
        self.assertIn("ratio 0.950", r.figure)
        self.assertEqual(measure.speed_row([100.0], [80.0], 0.9).status, FAIL)
        self.assertEqual(measure.speed_row([], [80.0], 0.9).status, FAIL)

    def test_size_output(self):
        self.assertEqual(measure.parse_size_output("4294967296\n"), 4 * GIB)
        self.assertIsNone(measure.parse_size_output("50% of the device"))
        self.assertIsNone(measure.parse_size_output("0 (no limit)"))


if __name__ == "__main__":
    unittest.main()
