"""Steps/s of a 2-process run: what agreeing on stops costs the training loop.

    python -m benchmarks.two_process --runs=3

Launches the toy experiment (tests/experiments/toy.py) as 2 processes x 2
fake CPU devices through `jaxline_ng.launch`, `--steps` steps with progress
logged every `--window` steps (1,000) and no checkpoints, `--runs` times;
prints the steps/s of each window after the first (compilation and warm-up)
and their median. Run it on two trees (e.g. a `git worktree` of the commit before) to
compare.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = os.path.join("tests", "experiments", "toy.py")


def one_run(steps: int, window: int) -> list[float]:
  """Process 0's steps/s over each `window` steps after the first (whose rate,
  measured from the loop's start, is mostly compilation)."""
  with tempfile.TemporaryDirectory() as checkpoint_dir:
    result = subprocess.run(
        [sys.executable, "-m", "jaxline_ng.launch", "--num_processes=2", "--devices_per_process=2",
         "--", sys.executable, TOY, f"--config={TOY}", f"--config.checkpoint_dir={checkpoint_dir}",
         "--config.checkpointer=memory", f"--config.training_steps={steps}",
         f"--config.log_tensors_interval={window}",
         f"--config.log_train_data_interval={window}",
         f"--config.save_checkpoint_interval={10 * steps}"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True, text=True, timeout=600, check=True)
  rates = [float(m.group(2)) for m in re.finditer(
      r"^\[p0\] .*step (\d+)/\d+ .*?, ([\d.]+) steps/s", result.stdout, re.MULTILINE)]
  return rates[1:]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--steps", type=int, default=4000)
  parser.add_argument("--window", type=int, default=1000, help="steps per measured window")
  args = parser.parse_args(argv)
  windows = []
  for run in range(args.runs):
    rates = one_run(args.steps, args.window)
    print(f"run {run + 1}: " + " ".join(f"{rate:.0f}" for rate in rates), flush=True)
    windows.extend(rates)
  print(f"median steps/s over {len(windows)} windows: {statistics.median(windows):.0f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
