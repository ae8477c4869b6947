"""Every benchmark and stress tool runs in a few-step mode here, so none can rot."""

import json
import sys

from helpers import run


def run_module(module, *args, timeout=180):
  return run([sys.executable, "-m", module, *args], timeout=timeout)


def test_kill_during_save_smoke():
  result = run_module("benchmarks.kill_during_save", "--kills=1")
  assert result.returncode == 0, result.stdout + result.stderr[-3000:]
  assert "1/1 kills left a loadable checkpoint" in result.stdout


def test_benchmark_suite_smoke(tmp_path, capsys):
  from benchmarks import run  # pylint: disable=import-outside-toplevel
  out = tmp_path / "results.json"
  assert run.main(["--smoke", "--out", str(out)]) == 0
  table = capsys.readouterr().out
  for row in ("loop: framework / hand-written", "loop, mesh mode",
              "noise: hand-written loop",
              "logging every step",
              "in-memory checkpoint",
              "disk save stall", "framework start-up"):
    assert row in table
  results = json.loads(out.read_text())
  assert results["loop"]["ratio_median"] > 0 and results["startup"]["framework_s"] >= 0


def test_checkpoint_io_smoke(tmp_path):
  out = tmp_path / "checkpoint_io.json"
  # Without the char_lm restarts (four runs): test_compilation_cache checks warm restarts.
  result = run_module("benchmarks.checkpoint_io", "--gib=0.01", "--saves=1", "--restarts=0",
                      f"--out={out}", timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr[-3000:]
  results = json.loads(out.read_text())
  for key in ("save_vs_file_write", "restore_vs_file_read", "stall_vs_copy",
              "peak_host_memory_gib"):
    assert results[key] > 0, key


def test_two_process_benchmark_smoke():
  result = run_module("benchmarks.two_process", "--runs=1", "--steps=100", "--window=50",
                      timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr[-3000:]
  assert "median steps/s over 1 windows:" in result.stdout
