"""Every benchmark and stress tool runs in a few-step mode here, so none can rot."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
           JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)


def run_module(module, *args, timeout=180):
  return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=ENV,
                        capture_output=True, text=True, timeout=timeout)


def test_kill_during_save_smoke():
  result = run_module("benchmarks.kill_during_save", "--kills=1")
  assert result.returncode == 0, result.stdout + result.stderr[-3000:]
  assert "1/1 kills left a loadable checkpoint" in result.stdout
