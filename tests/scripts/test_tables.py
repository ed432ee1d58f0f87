#!/usr/bin/env python3
"""The device check's table scripts on small inputs written here (no GPU needed): what they read
from Nsight Compute's raw CSV (scripts/ncu-table) and bench_kernels' JSON (scripts/kernel-table).

    python3 tests/scripts/test_tables.py
"""
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")


def load(name):
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_"), os.path.join(SCRIPTS, name))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


ncu_table = load("ncu-table")
HEADER = ["ID", "Kernel Name", "Block Size"] + ncu_table.METRICS


def ncu_rows(unit, launches):
    units = ["", "", ""] + [unit, "%", "%", "%", "register/thread", "", ""]
    return [["==PROF== Connected to process 1"], HEADER, units] + [
        [str(i), name, "(256,1,1)"] + values for i, (name, values) in enumerate(launches)]


class NcuTable(unittest.TestCase):
    def test_medians_per_kernel_in_microseconds(self):
        ln = "void trainsim::cuda::(anonymous namespace)::layernorm_forward_cached_kernel<__nv_bfloat16>(T1 *, float *)"
        rows = ncu_rows("nsecond", [
            (ln, ["12,000", "60", "20", "40", "56", "1,024", "256"]),
            (ln, ["14,000", "62", "22", "42", "56", "1,024", "256"]),
            ("==PROF== a line of ncu's own", []),
            (ln, ["90,000", "10", "5", "41", "56", "1,024", "256"]),
            ("void trainsim::cuda::column_total_kernel(float *, float *)", ["3,500", "30", "8", "20", "32", "24", "256"]),
        ])
        kernels = ncu_table.table(rows)
        self.assertEqual([k[0] for k in kernels], ["layernorm_forward_cached_kernel<__nv_bfloat16>", "column_total_kernel"])
        name, n, m = kernels[0]
        self.assertEqual(n, 3)
        self.assertAlmostEqual(m[0], 14.0)  # the middle of 12, 14 and 90 us
        self.assertEqual(m[1:], [60.0, 20.0, 41.0, 56.0, 1024.0, 256.0])
        self.assertAlmostEqual(kernels[1][2][0], 3.5)

    def test_the_duration_unit_is_read_not_assumed(self):
        rows = ncu_rows("usecond", [("k()", ["7.5", "1", "1", "1", "1", "1", "1"])])
        self.assertAlmostEqual(ncu_table.table(rows)[0][2][0], 7.5)
        with self.assertRaisesRegex(ValueError, "unit"):
            ncu_table.table(ncu_rows("fortnight", [("k()", ["1"] * 7)]))

    def test_a_missing_metric_or_header_is_an_error(self):
        rows = ncu_rows("nsecond", [])
        rows[1] = rows[1][:-1]
        with self.assertRaisesRegex(ValueError, "launch__block_size"):
            ncu_table.table(rows)
        with self.assertRaisesRegex(ValueError, "Kernel Name"):
            ncu_table.table([["==PROF== nothing profiled"]])


class KernelTable(unittest.TestCase):
    def run_table(self, benchmarks):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"benchmarks": benchmarks}, f)
        try:
            return subprocess.run([sys.executable, os.path.join(SCRIPTS, "kernel-table"), f.name, "--shape", "gpt2"],
                                  capture_output=True, text=True, check=True).stdout
        finally:
            os.unlink(f.name)

    def test_rows_below_their_target_are_marked_and_counted(self):
        out = self.run_table([
            {"name": "BM_LayerNormForward/1/1/manual_time", "run_type": "iteration", "label": "gpt2 bf16",
             "bytes_per_s": 2.0e12, "fraction_of_copy": 0.66, "fraction_of_same_size_copy": 0.9},
            {"name": "BM_GeluForward/1/1/manual_time", "run_type": "iteration", "label": "gpt2 bf16",
             "bytes_per_s": 2.6e12, "fraction_of_copy": 0.87},
            {"name": "BM_LinearForward/1/3/0/manual_time", "run_type": "iteration", "label": "gpt2 bf16 qkv",
             "tflops": 497.0, "fraction_of_cublas": 0.69},
            {"name": "BM_LayerNormForward/0/1/manual_time", "run_type": "iteration", "label": "runtime bf16",
             "bytes_per_s": 1e11, "fraction_of_copy": 0.04},
        ])
        lines = out.splitlines()
        self.assertEqual(len(lines), 5)  # header, three gpt2 rows, the count
        self.assertIn("66.0% copy", lines[1])
        self.assertIn("90.0%", lines[1])  # the same-size copy column
        self.assertIn("< 80%", lines[1])
        self.assertNotIn("<", lines[2])
        self.assertIn("< 70%", lines[3])
        self.assertEqual(lines[4], "2 of 3 rows below their target")


if __name__ == "__main__":
    unittest.main()
