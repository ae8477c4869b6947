"""Faults at the edges of what a run promises, run as a user would: real processes.

A `sys.exit()` inside `step`, an old step directory that is a symbolic link,
a `checkpoint_dir` too long for its checkpoints, a bad return among metric
rows in flight, step counts beyond int32, and a stop that nothing durable
survives. Each run goes on correctly, or stops within seconds with one line
naming the culprit and an exit code that says what a rerun will do.
"""

import os
import sys

from test_user_faults import ROOT, one_line_error, read_jsonl, run, signal_after, toy

from jaxline_ng import disk_checkpointing, preemption, rng, train


def test_sys_exit_inside_step_is_a_failure_that_keeps_the_last_checkpoint(tmp_path):
  # Before: exit 0 at step 25 of 40, as if the run had finished.
  result = run(toy(f"--config.checkpoint_dir={tmp_path}", "--config.checkpointer=disk",
                   "--config.training_steps=40", "--config.save_checkpoint_interval=10",
                   "--config.experiment_kwargs.config.exit_at_step=25"))
  assert result.returncode == 1, result.stderr[-3000:]
  one_line_error(result, "step raised SystemExit(0) at step 25")
  assert disk_checkpointing.read(str(tmp_path))[0] == 20


def test_an_old_step_directory_that_is_a_symlink_is_unlinked_when_rotated_out(tmp_path):
  # Before: every run failed at the save rotating it out, naming the wrong step.
  run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"

  def train_to(steps):
    result = run(toy(f"--config.checkpoint_dir={run_dir}", "--config.checkpointer=disk",
                     f"--config.training_steps={steps}", "--config.save_checkpoint_interval=5",
                     "--config.max_checkpoints_to_keep=2"))
    assert result.returncode == 0, result.stderr[-3000:]
    return result

  train_to(10)
  series = run_dir / "checkpoints" / "latest"
  os.rename(series / "5", elsewhere)
  os.symlink(elsewhere, series / "5")
  files = sorted(str(path.relative_to(elsewhere)) for path in elsewhere.rglob("*"))
  result = train_to(20)  # Saving 15 rotates 5 out.
  assert sorted(os.listdir(series)) == ["15", "20"]
  assert sorted(str(path.relative_to(elsewhere)) for path in elsewhere.rglob("*")) == files
  assert f"removed the symbolic link {series / '5'}" in result.stderr


def test_a_checkpoint_dir_too_long_for_its_step_directories_is_refused_at_start(tmp_path):
  # Before: refused only at the first save, a save interval later, in orbax tracebacks.
  path_max = os.pathconf(tmp_path, "PC_PATH_MAX")
  long_dir = str(tmp_path)
  while len(long_dir) < path_max - 86:  # Room for the lock file, none for a step directory.
    long_dir += "/" + "d" * max(1, min(200, path_max - 87 - len(long_dir)))
  result = run(toy(f"--config.checkpoint_dir={long_dir}", "--config.checkpointer=disk"),
               timeout=60)
  one_line_error(result, f"beyond this filesystem's limit of {path_max} (PC_PATH_MAX)")
  assert "training loop" not in result.stderr


def test_a_bad_return_keeps_every_valid_metric_row_written_with_it(tmp_path):
  # Rows 21..30 go to the writer together; before, step 29's None lost 21..28.
  result = run(toy(f"--config.checkpoint_dir={tmp_path}", "--config.training_steps=40",
                   "--config.log_train_data_interval=10", "--config.log_all_train_data=True",
                   "--config.experiment_kwargs.config.none_at_step=28"))
  one_line_error(result, "step() returned NoneType None")
  rows = read_jsonl(tmp_path / "train" / "metrics.jsonl")
  assert [row["step"] for row in rows] == list(range(1, 29))


def test_step_counts_beyond_int32_are_refused_in_one_line(tmp_path):
  # Before: training_steps=3e9 was accepted, and a checkpoint of step 2**40
  # restored, then failed on an OverflowError in every rerun.
  result = run(toy(f"--config.checkpoint_dir={tmp_path}", "--config.training_steps=3000000000"),
               timeout=60)
  one_line_error(result, f"config.training_steps=3000000000 is beyond {rng.MAX_STEP}")

  sys.path.insert(0, os.path.join(ROOT, "tests", "experiments"))
  import toy as toy_experiment  # pylint: disable=import-outside-toplevel
  config = toy_experiment.get_config()
  config.checkpoint_dir, config.checkpointer, config.training_steps = str(tmp_path), "disk", 2
  checkpointer = disk_checkpointing.DiskCheckpointer(config, "train")
  train.train(toy_experiment.Experiment, config, checkpointer, None)
  checkpointer.get_experiment_state("latest").global_step = 2**40
  checkpointer.save("latest")
  checkpointer.wait_for_checkpointing_to_finish()
  result = run(toy(f"--config.checkpoint_dir={tmp_path}", "--config.checkpointer=disk"),
               timeout=60)
  one_line_error(result, f"latest/{2**40} is at step {2**40}, beyond {rng.MAX_STEP}")


def test_a_stop_with_in_memory_checkpoints_exits_143_naming_disk_checkpoints(tmp_path):
  # Before: 75, "rerun resumes", and a requeued run started from step 0 again.
  code, stderr, _ = signal_after(
      toy(f"--config.checkpoint_dir={tmp_path}", "--config.training_steps=1000000"),
      ["step 10/"])
  assert code == preemption.EXIT_STOPPED_UNSAVED == 143, stderr[-3000:]
  assert "exiting with code 143" in stderr
  assert "a rerun starts afresh, so the exit code is 143, not 75 (--config.checkpointer=disk" \
      in stderr
