"""A damaged newest checkpoint, end to end with real processes: training and an eval job."""

import json
import os

from helpers import run, toy_command

from jaxline_ng import disk_checkpointing


def toy(checkpoint_dir, *extra, timeout=120):
  return run(toy_command(checkpoint_dir, "--config.training_steps=20", *extra), timeout=timeout)


def truncate_every_file(step_dir):
  for dirpath, _, names in os.walk(step_dir):
    for name in names:
      with open(os.path.join(dirpath, name), "r+b") as f:
        f.truncate(min(3, os.path.getsize(f.name)))


def test_truncated_final_checkpoint_is_redone_and_the_eval_job_reaches_the_end(tmp_path):
  assert toy(tmp_path).returncode == 0
  series = tmp_path / "checkpoints" / "latest"
  truncate_every_file(series / "20")

  rerun = toy(tmp_path)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert f"Checkpoint {series / '20'} could not be loaded" in rerun.stderr
  assert f"Restored checkpoint {series / '10'}" in rerun.stderr
  assert f"Moved the unusable checkpoint {series / '20'} to " in rerun.stderr
  assert disk_checkpointing.read(str(tmp_path))[0] == 20  # redone, not silently skipped
  assert len(os.listdir(disk_checkpointing.unusable_dir(str(series)))) == 1

  evaluator = toy(tmp_path, "--jaxline_mode=eval", "--config.eval_poll_interval_secs=0.2",
                  timeout=60)
  assert evaluator.returncode == 0, evaluator.stderr[-3000:]
  with open(tmp_path / "eval" / "metrics.jsonl") as f:
    assert json.loads(f.readlines()[-1])["step"] == 20


def test_an_eval_job_ends_naming_a_damaged_final_checkpoint_no_training_run_will_redo(tmp_path):
  # It evaluated the step before, then waited forever for the damaged one.
  assert toy(tmp_path).returncode == 0
  series = tmp_path / "checkpoints" / "latest"
  truncate_every_file(series / "20")

  evaluator = toy(tmp_path, "--jaxline_mode=eval", "--config.eval_poll_interval_secs=0.2",
                  timeout=60)
  assert evaluator.returncode == 1, evaluator.stderr[-3000:]
  assert evaluator.stderr.strip().splitlines()[-1].endswith(
      f"checkpoint {series / '20'} could not be loaded (step 10 was evaluated instead) and no "
      f"training run holds {tmp_path} to save past it: resume the training run, then evaluate "
      "again")
  with open(tmp_path / "eval" / "metrics.jsonl") as f:
    assert [json.loads(line)["step"] for line in f] == [10]
