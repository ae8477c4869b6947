"""`python -m jaxline_ng.verify_resume`: real runs of experiments whose resumes are, or are
not, exact, from the command line as a user runs it."""

import os
import subprocess
import sys

from jaxline_ng import disk_checkpointing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT)
SHUFFLED = ["tests/experiments/shuffled.py", "--config=tests/experiments/shuffled.py"]
TOY = ["tests/experiments/toy.py", "--config=tests/experiments/toy.py"]


def verify(workdir, steps, interrupt_at, *command):
  return subprocess.run(
      [sys.executable, "-m", "jaxline_ng.verify_resume", f"--steps={steps}",
       f"--interrupt_at={interrupt_at}", f"--workdir={workdir}", "--", *command],
      cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def test_a_checkpointed_grain_iterator_resumes_exactly(tmp_path):
  result = verify(tmp_path, 6, 3, sys.executable, *SHUFFLED)
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.splitlines()[-1] == "exact"
  step, nest = disk_checkpointing.read(str(tmp_path / "interrupted"))
  assert step == 6
  # 6 batches read, 3 of them by the resumed run: it went on where the first stopped.
  assert nest["experiment_module"]["train_iterator"].states == {0: {"next_index": 6}}


def test_an_iterator_left_out_of_the_checkpoint_is_caught_naming_a_parameter(tmp_path):
  result = verify(tmp_path, 6, 3, sys.executable, *SHUFFLED,
                  "--config.experiment_kwargs.config.checkpoint_iterator=False")
  assert result.returncode == 1, result.stdout + result.stderr
  assert "differs: experiment_module/params: " in result.stdout
  assert "first differing metrics: step 4: loss " in result.stdout


def test_an_experiment_whose_data_is_a_function_of_the_step_resumes_exactly(tmp_path):
  result = verify(tmp_path, 6, 2, sys.executable, *TOY)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "exact" in result.stdout


def test_a_run_that_fails_exits_2_with_its_error(tmp_path):
  result = verify(tmp_path, 6, 2, sys.executable, "tests/experiments/toy.py",
                  "--config=tests/experiments/toy.py:fail_at_step")
  assert result.returncode == 2, result.stdout + result.stderr
  assert "the uninterrupted run exited 1, expected exit 0" in result.stderr
  assert "toy experiment fails at step 3" in result.stderr


def test_bad_arguments_exit_2_in_one_line(tmp_path):
  result = verify(tmp_path, 6, 6, sys.executable, *TOY)
  assert result.returncode == 2
  assert "--interrupt_at=6: must be from 1 to --steps - 1 (5)" in result.stderr


def test_a_two_process_run_saves_each_process_position_and_resumes_exactly(tmp_path):
  result = verify(tmp_path, 6, 3, sys.executable, "-m", "jaxline_ng.launch", "--num_processes=2",
                  "--devices_per_process=2", "--", sys.executable, *SHUFFLED)
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.splitlines()[-1] == "exact"
  _, nest = disk_checkpointing.read(str(tmp_path / "interrupted"))
  assert sorted(nest["experiment_module"]["train_iterator"].states) == [0, 1]


def test_the_digits_example_resumes_exactly_in_the_middle_of_an_epoch(tmp_path):
  # 1437 training digits, 64 a step: the second epoch starts in step 23, the
  # run stops after it and resumes in the middle of that epoch.
  result = verify(tmp_path, 25, 23, sys.executable, "examples/digits/experiment.py",
                  "--config=examples/digits/experiment.py:smoke", "--config.tensorboard=False")
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.splitlines()[-1] == "exact"
  _, nest = disk_checkpointing.read(str(tmp_path / "interrupted"))
  assert nest["experiment_module"]["train_iterator"].states == {0: {"next_index": 25}}
