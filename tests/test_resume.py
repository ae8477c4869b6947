"""Durable runs across real processes: SIGTERM + resume, and a separate eval job."""

import os
import signal
import subprocess

import numpy as np
from helpers import ENV, ROOT, read_jsonl, run, toy_command

from jaxline_ng import disk_checkpointing


def toy_args(checkpoint_dir, *extra):
  return toy_command(checkpoint_dir, "--config.training_steps=60",
                     "--config.save_checkpoint_interval=10", "--config.log_train_data_interval=1",
                     *extra)


def final_arrays(checkpoint_dir):
  step, nest = disk_checkpointing.read(str(checkpoint_dir))
  return step, nest["experiment_module"]


def interrupt_after(args, marker, timeout=120):
  """Runs until a log line contains `marker`, sends SIGTERM, returns (code, stderr)."""
  process = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
  lines = []
  try:
    for line in process.stderr:
      lines.append(line)
      if marker in line:
        process.send_signal(signal.SIGTERM)
        break
    _, rest = process.communicate(timeout=timeout)
  finally:
    process.kill()
  return process.returncode, "".join(lines) + rest


def test_sigterm_then_rerun_matches_uninterrupted_run_bit_for_bit(tmp_path):
  straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
  # The reference run goes alongside the interrupted one: each is mostly one core's start-up.
  reference = subprocess.Popen(toy_args(straight), cwd=ROOT, env=ENV,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  code, stderr = interrupt_after(toy_args(interrupted), "step 25/60")
  assert reference.wait(timeout=120) == 0
  assert code == 75, stderr[-3000:]
  stopped_at = read_jsonl(interrupted / "train" / "metrics.jsonl")[-1]["step"]
  assert 25 <= stopped_at < 60
  assert f"stopped by SIGTERM after step {stopped_at}" in stderr

  resumed = run(toy_args(interrupted))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Restored checkpoint" in resumed.stderr

  def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "train" / "metrics.jsonl")}

  assert losses(interrupted) == losses(straight)
  assert sorted(losses(interrupted)) == list(range(1, 61))
  step_a, arrays_a = final_arrays(straight)
  step_b, arrays_b = final_arrays(interrupted)
  assert step_a == step_b == 60
  for key in arrays_a:
    np.testing.assert_array_equal(arrays_a[key], arrays_b[key])


def test_separate_eval_process_follows_training_to_the_end(tmp_path):
  trainer = subprocess.Popen(toy_args(tmp_path), cwd=ROOT, env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  evaluator = run(
      toy_args(tmp_path, "--jaxline_mode=eval", "--config.eval_poll_interval_secs=0.2"),
      timeout=180)
  assert trainer.wait(timeout=120) == 0
  assert evaluator.returncode == 0, evaluator.stderr[-3000:]
  evals = read_jsonl(tmp_path / "eval" / "metrics.jsonl")
  assert evals[-1]["step"] == 60
  assert [e["step"] for e in evals] == sorted({e["step"] for e in evals})  # each once
  assert os.listdir(tmp_path / "checkpoints" / "best")
