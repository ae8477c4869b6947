"""The command line: modes, flags, and one-line errors for bad input.

These run real processes, as users do: `python experiment.py --config=...`.
"""

import os
import signal
import subprocess
import sys
import threading
from unittest import mock

import helpers
import ml_collections
import pytest
from absl import flags
from absl.testing import flagsaver
from helpers import ENV, EXPERIMENTS, ROOT, TOY, read_jsonl, toy_command, toy_experiment

from jaxline_ng import base_config, disk_checkpointing, errors, platform, utils


def run(*args, script=TOY, timeout=120, unset=()):
  env = {name: value for name, value in ENV.items() if name not in unset}
  return helpers.run([sys.executable, script, *args], timeout=timeout, env=env)


def test_train_writes_metrics_and_logs_progress(tmp_path):
  # Published configs set eval_specific_checkpoint_dir (a key of later jaxline
  # versions); evaluation reads checkpoint_dir, so another directory is named.
  result = run(f"--config={TOY}", f"--config.checkpoint_dir={tmp_path}",
               "--config.eval_specific_checkpoint_dir=/elsewhere")
  assert result.returncode == 0, result.stderr
  assert ("config.eval_specific_checkpoint_dir='/elsewhere' is not read: evaluation reads "
          f"config.checkpoint_dir='{tmp_path}'") in result.stderr
  records = read_jsonl(tmp_path / "train" / "metrics.jsonl")
  assert [r["step"] for r in records] == [5, 10, 15, 20]
  assert all("loss" in r for r in records)
  assert "step 20/20 (100.0%)" in result.stderr


def test_train_eval_multithreaded_evaluates_final_checkpoint(tmp_path):
  result = run(f"--config={TOY}", f"--config.checkpoint_dir={tmp_path}",
               "--jaxline_mode=train_eval_multithreaded",
               "--config.experiment_kwargs.config.learning_rate=0.3")
  assert result.returncode == 0, result.stderr
  evals = read_jsonl(tmp_path / "eval" / "metrics.jsonl")
  assert evals[-1]["step"] == 20
  assert evals[-1]["neg_distance"] > -0.1  # learning_rate override took effect
  assert "New best neg_distance" in result.stderr


def test_training_crash_in_multithreaded_mode_exits_nonzero(tmp_path):
  result = run(f"--config={TOY}:fail_at_step", f"--config.checkpoint_dir={tmp_path}",
               "--jaxline_mode=train_eval_multithreaded", timeout=90)
  assert result.returncode != 0
  assert "toy experiment fails at step 3" in result.stderr


@pytest.mark.parametrize("args,culprit", [
    (["--config=missing.py"], "config file 'missing.py' does not exist"),
    (["--config=examples"], "config file 'examples' is a directory"),
    (["--config=examples/digits/experiment.py:bogus"],
     "loading 'examples/digits/experiment.py:bogus' failed: ValueError: unknown config argument "
     "'bogus'"),
    ([f"--config={TOY}", "--config.no_such_key=3"], "--config.no_such_key"),
    ([f"--config={TOY}", "--config.training_steps=many"], "--config.training_steps=many"),
    ([f"--config={TOY}", "--jaxline_mode=fly"], "--jaxline_mode='fly'"),
    ([f"--config={TOY}", "--config.random_mode_eval=unique_everything"],
     "config.random_mode_eval='unique_everything'"),
    ([f"--config={TOY}", "--jaxline_mode=train_eval_multithreaded",
      "--config.best_model_eval_metric=accuracy", "--config.training_steps=2"],
     "config.best_model_eval_metric='accuracy' is not among the scalars evaluate returned: "
     "['neg_distance', 'params/mean']"),
    ([f"--config={TOY}", "--config.checkpoint_dir=/proc/no_such_dir"],
     "config.checkpoint_dir='/proc/no_such_dir': cannot write"),
    ([f"--config={TOY}", "--config.compilation_cache_dir=/proc/no_such_dir"],
     "config.compilation_cache_dir='/proc/no_such_dir': cannot write /proc/no_such_dir"),
    ([f"--config={TOY}", "--config.checkpoint_dir=gs://bucket/run"],
     "config.checkpoint_dir='gs://bucket/run': jaxline_ng keeps runs on a local or mounted "
     "filesystem, not at a URL"),
    ([], "--config"),
    ([f"--config={TOY}", "trian"], "unexpected positional arguments ['trian']: pass flags only"),
    ([f"--config={TOY}", "--jaxline_ensure_tpu"], "--jaxline_ensure_tpu: JAX's default backend"),
    ([f"--config={TOY}", "--jaxline_tpu_driver=grpc://10.0.0.2:8470"],
     "--jaxline_tpu_driver='grpc://10.0.0.2:8470': JAX removed"),
])
def test_bad_input_fails_fast_with_one_line_naming_the_culprit(tmp_path, args, culprit):
  if args and not any(a.startswith("--config.checkpoint_dir") for a in args):
    args = [*args, f"--config.checkpoint_dir={tmp_path}"]
  result = run(*args, timeout=60)
  assert result.returncode != 0
  assert "Traceback" not in result.stderr
  error_lines = [line for line in result.stderr.splitlines() if culprit in line]
  assert error_lines, result.stderr[-2000:]


@pytest.mark.parametrize("name", ["a_file", "run[1]"])
def test_unusable_checkpoint_dir_is_named_as_the_culprit(tmp_path, name):
  """A checkpoint_dir under a file, or one orbax would save unreadable arrays
  in (brackets, which it globs), is named, not the compilation cache placed
  in it (the user's JAX cache is unset here, so the cache goes there)."""
  (tmp_path / "a_file").write_text("not a directory")
  checkpoint_dir = tmp_path / name
  result = run(f"--config={TOY}", "--config.checkpointer=disk",
               f"--config.checkpoint_dir={checkpoint_dir}", unset=["JAX_COMPILATION_CACHE_DIR"],
               timeout=60)
  assert result.returncode != 0
  assert "Traceback" not in result.stderr
  assert f"error: config.checkpoint_dir='{checkpoint_dir}': " in result.stderr, result.stderr
  assert not (tmp_path / "run[1]").exists()  # A refused run leaves nothing (no lock, no cache).


def test_a_checkpoint_dir_with_a_backslash_is_refused_before_saves_go_elsewhere(tmp_path):
  """TensorStore took the backslash for a '/': the arrays of `run\\x` went to
  `run/x`, the run exited 0, and its rerun found no usable checkpoint."""
  checkpoint_dir = tmp_path / "run\\x"
  result = run(f"--config={TOY}", "--config.checkpointer=disk",
               f"--config.checkpoint_dir={checkpoint_dir}", "--config.training_steps=2",
               timeout=60)
  assert result.returncode == 1
  assert "Traceback" not in result.stderr
  assert (f"error: config.checkpoint_dir={str(checkpoint_dir)!r}: orbax cannot save under a "
          "path holding a backslash") in result.stderr, result.stderr[-2000:]
  assert not (tmp_path / "run").exists()


def test_syntax_error_in_config_file_is_one_line(tmp_path):
  bad = tmp_path / "bad_config.py"
  bad.write_text("def get_config(:\n")
  result = run(f"--config={bad}", timeout=60)
  assert result.returncode != 0
  assert "Traceback" not in result.stderr
  assert f"config file '{bad}' line 1: SyntaxError" in result.stderr


@pytest.mark.parametrize("body,culprit", [
    ("x = 1\n", "config file '{}' defines no get_config()"),
    # ml_collections said only "Flag --config must have a value other than None".
    ("def get_config():\n  return None\n", "get_config() in '{}' returned None"),
])
@pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")  # ml_collections'
def test_a_config_file_without_a_config_is_named(tmp_path, body, culprit):
  config_file = tmp_path / "config.py"
  config_file.write_text(body)
  with pytest.raises(flags.IllegalFlagValueError) as raised:
    flags.FLAGS["config"]._parse(str(config_file))  # pylint: disable=protected-access
  assert str(raised.value) == culprit.format(config_file)


@pytest.mark.parametrize("call", [
    "platform.main(toy.Experiment, sys.argv[1:])",
    # tapnet: app.run's main passes the command line on, already parsed.
    "app.run(lambda argv: platform.main(toy.Experiment, sys.argv[1:]))",
    # The whole command line, program name included, as a newcomer passes it.
    "platform.main(toy.Experiment, sys.argv)",
], ids=["bare", "under_app_run", "bare_with_the_program_name"])
def test_main_given_the_command_line_as_published_code_calls_it(tmp_path, call):
  """Published code calls platform.main(Exp, sys.argv[1:]), with or without app.run."""
  script = tmp_path / "published_main.py"
  script.write_text(
      "import sys\n"
      f"sys.path.insert(0, {EXPERIMENTS!r})\n"
      "import toy\n"
      "from absl import app\n"
      "from jaxline_ng import platform\n"
      f"{call}\n")
  result = run("--config", os.path.join(ROOT, TOY), f"--config.checkpoint_dir={tmp_path}",
               "--config.training_steps=3", script=str(script))
  assert result.returncode == 0, result.stderr
  assert read_jsonl(tmp_path / "train" / "metrics.jsonl")[-1]["step"] == 3
  assert "[jaxline_ng] step 3/3" in result.stderr  # Progress is logged, as under app.run.


def test_flagsaver_then_main_with_empty_argv(tmp_path, monkeypatch):
  """How published tests drive the platform in-process."""
  toy = toy_experiment()
  monkeypatch.setattr(utils, "GLOBAL_CHECKPOINT_DICT", {})
  config = toy.get_config()
  config.checkpoint_dir = str(tmp_path)
  config.training_steps = 4
  with flagsaver.flagsaver(config=config, jaxline_mode="train"):
    platform.main(toy.Experiment, [])
  assert utils.GLOBAL_CHECKPOINT_DICT["latest"].history[-1].pickle_nest["global_step"] == 4
  assert read_jsonl(tmp_path / "train" / "metrics.jsonl")[-1]["step"] == 4


def test_sigterm_stops_after_a_step_flushes_and_exits_75(tmp_path):
  """The last step's scalars and checkpoint reach disk and the process exits with
  EXIT_PREEMPTED (a rerun resumes)."""
  process = subprocess.Popen(
      toy_command(tmp_path, "--config.training_steps=1000000",
                  "--config.log_train_data_interval=1000"),
      cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  stderr_lines = []
  try:
    for line in process.stderr:  # Wait until training is under way.
      stderr_lines.append(line)
      if "step 10/" in line:
        break
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
  finally:
    process.kill()
  stderr = "".join(stderr_lines) + stderr
  metrics = tmp_path / "train" / "metrics.jsonl"
  assert process.returncode == 75, stderr[-3000:]
  last = read_jsonl(metrics)[-1]
  assert f"stopped by SIGTERM after step {last['step']}" in stderr
  assert disk_checkpointing.read(str(tmp_path))[0] == last["step"]


def test_an_experiments_own_checkpointer_is_named_when_the_config_asks_for_another(
    tmp_path, monkeypatch):
  """eigengame passes its own InMemoryCheckpointer subclass: --config.checkpointer=disk then
  cannot take effect, and a refused eval job must name what it was given, not the key."""
  toy = toy_experiment()

  class OwnCheckpointer(utils.InMemoryCheckpointer):
    pass

  config = toy.get_config()
  config.checkpoint_dir = str(tmp_path)
  config.checkpointer = "disk"
  config.training_steps = 2
  with mock.patch("absl.logging.warning") as warning:
    with flagsaver.flagsaver(config=config, jaxline_mode="train"):
      platform.main(toy.Experiment, [], checkpointer_factory=OwnCheckpointer)
  assert any("has no effect" in str(call) and "OwnCheckpointer" in str(call)
             for call in warning.call_args_list)
  monkeypatch.setattr(utils, "GLOBAL_CHECKPOINT_DICT", {})
  with flagsaver.flagsaver(config=config, jaxline_mode="eval"):
    with pytest.raises(SystemExit, match=r"would wait forever: in-memory checkpoints \(Own"):
      platform.main(toy.Experiment, [], checkpointer_factory=OwnCheckpointer)


def test_in_memory_runs_name_the_disk_checkpoints_they_leave_unread(tmp_path, monkeypatch):
  """A resume without --config.checkpointer=disk started afresh, and an eval
  job on the run pointed at everything but that flag."""
  toy = toy_experiment()
  config = toy.get_config()
  config.checkpoint_dir = str(tmp_path)
  config.training_steps = 2
  os.makedirs(tmp_path / "checkpoints" / "latest" / "20")
  with mock.patch("absl.logging.warning") as warning:
    with flagsaver.flagsaver(config=config, jaxline_mode="train"):
      platform.main(toy.Experiment, [])
  assert any("starts afresh" in str(call) and "--config.checkpointer=disk" in str(call)
             for call in warning.call_args_list)
  monkeypatch.setattr(utils, "GLOBAL_CHECKPOINT_DICT", {})
  with flagsaver.flagsaver(config=config, jaxline_mode="eval"):
    with pytest.raises(SystemExit, match=r"newest: step 20.*--config.checkpointer=disk"):
      platform.main(toy.Experiment, [])


def test_train_eval_multithreaded_makes_a_train_and_an_eval_checkpointer(tmp_path):
  """As jaxline: the factory is called with "train", then "eval"; a user's factory that
  knows only those two modes works."""
  toy = toy_experiment()
  modes = []

  def factory(config, mode):
    modes.append(mode)
    return {"train": utils.InMemoryCheckpointer, "eval": utils.InMemoryCheckpointer}[mode](
        config, mode)

  config = toy.get_config()
  config.checkpoint_dir = str(tmp_path)
  config.training_steps = 40
  config.save_checkpoint_interval = 10
  with flagsaver.flagsaver(config=config, jaxline_mode="train_eval_multithreaded"):
    platform.main(toy.Experiment, [], checkpointer_factory=factory)
  assert modes == ["train", "eval"]
  assert read_jsonl(tmp_path / "eval" / "metrics.jsonl")[-1]["step"] == 40


def test_main_without_app_run_takes_config_overrides_from_its_argv(tmp_path):
  """jaxline-era code calls `platform.main(Experiment, argv)` with an argv of its
  own; ml_collections read the overrides from `sys.argv` instead."""
  config_file = tmp_path / "config.py"
  config_file.write_text("from jaxline_ng import base_config\n"
                         "def get_config():\n  return base_config.get_base_config()\n")
  code = ("import sys\nfrom absl import flags\nfrom jaxline_ng import platform\n"
          "sys.argv = sys.argv[:1]\n"
          "try:\n"
          f"  platform.main(None, ['--config={config_file}', '--config.training_steps=7',\n"
          "                      '--jaxline_mode=bogus'])\n"
          "finally:\n"
          "  print('training_steps', flags.FLAGS.config.training_steps)\n")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
  assert "training_steps 7" in result.stdout, result.stderr[-2000:]
  assert "--jaxline_mode='bogus'" in result.stderr


def test_an_eval_job_follows_an_in_memory_subclass_that_finds_checkpoints_elsewhere(
    tmp_path, monkeypatch):
  """A user's InMemoryCheckpointer whose `restore_path` picks up what another job
  saves (here: a snapshot more at every other poll) is followed as jaxline follows
  any checkpointer, to the checkpoint that ends training."""
  toy = toy_experiment()
  config = toy.get_config()
  config.checkpoint_dir = str(tmp_path)
  config.training_steps = 3
  config.save_checkpoint_interval = 1
  config.eval_poll_interval_secs = 0.01
  monkeypatch.setattr(utils, "GLOBAL_CHECKPOINT_DICT", {})
  with flagsaver.flagsaver(config=config, jaxline_mode="train"):
    platform.main(toy.Experiment, [])
  snapshots = list(utils.GLOBAL_CHECKPOINT_DICT["latest"].history)
  to_come = snapshots[1:]
  monkeypatch.setattr(utils, "GLOBAL_CHECKPOINT_DICT",
                      {"latest": utils.CheckpointNT(threading.local(), snapshots[:1])})
  polls = []

  class FindsMoreLater(utils.InMemoryCheckpointer):

    def restore_path(self, ckpt_series):
      polls.append(ckpt_series)
      if to_come and len(polls) % 2 == 0:
        utils.GLOBAL_CHECKPOINT_DICT[ckpt_series].history.append(to_come.pop(0))
      return super().restore_path(ckpt_series)

  with flagsaver.flagsaver(config=config, jaxline_mode="eval"):
    platform.main(toy.Experiment, [], checkpointer_factory=FindsMoreLater)
  assert [row["step"] for row in read_jsonl(tmp_path / "eval" / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.parametrize("nest_type", [dict, ml_collections.ConfigDict])
def test_a_disk_run_says_it_does_not_restore_snapshots_seeded_in_memory(tmp_path, monkeypatch,
                                                                        caplog, nest_type):
  """deeprte resumes by putting a snapshot it saved itself in
  `utils.GLOBAL_CHECKPOINT_DICT` before `platform.main`; only the in-memory
  checkpointer reads it, so a disk run starts from step 0 and must say so.
  A save's `ConfigDict` nest gave its step as "?" (helper porting deeprte)."""
  toy = toy_experiment()
  seeded = utils.SnapshotNT(0, nest_type({"global_step": 30}))
  monkeypatch.setattr(utils, "GLOBAL_CHECKPOINT_DICT",
                      {"latest": utils.CheckpointNT(threading.local(), [seeded])})
  config = toy.get_config()
  config.checkpoint_dir = str(tmp_path)
  config.checkpointer = "disk"
  config.training_steps = 2
  with flagsaver.flagsaver(config=config, jaxline_mode="train"):
    platform.main(toy.Experiment, [])
  assert ("utils.GLOBAL_CHECKPOINT_DICT holds in-memory snapshots (latest at step 30) that this "
          "run does not restore: its checkpointer, DiskCheckpointer") in caplog.text


@pytest.mark.parametrize("mode, runs", [("train", True), ("eval", True), ("eval_holdout", True),
                                        ("train_eval_multithreaded", True), ("eval_", False),
                                        ("evaluate", False), ("eval_test-2.v1", True),
                                        # Its logs and `best` series would land elsewhere.
                                        ("eval_x/../../outside", False), ("eval_..", False)])
def test_check_mode_takes_the_modes_and_an_eval_job_with_a_name(mode, runs):
  if runs:
    platform.check_mode(mode)
  else:
    with pytest.raises(ValueError, match=f"--jaxline_mode={mode!r} is not a mode"):
      platform.check_mode(mode)


def test_an_error_deriving_from_one_line_error_is_reported_in_one_line(tmp_path, capsys):
  """The platform reports in one line what derives from errors.OneLineError, an
  experiment's own error too; any other error keeps its traceback."""
  toy = toy_experiment()

  class MissingDataError(errors.OneLineError):
    pass

  class RaisesInInit(toy.Experiment):
    def __init__(self, mode, init_rng, config):
      raise MissingDataError("config.experiment_kwargs.config.data='/nowhere' holds no data")

  config = toy.get_config()
  config.checkpoint_dir = str(tmp_path)
  with flagsaver.flagsaver(config=config, jaxline_mode="train"):
    with pytest.raises(SystemExit) as exited:
      platform.main(RaisesInInit, [])
  assert str(exited.value.code) == (
      "jaxline_ng: error: config.experiment_kwargs.config.data='/nowhere' holds no data")


def test_a_config_error_is_still_a_value_error():
  """Code written for jaxline catches bad config as ValueError."""
  config = base_config.get_base_config()
  config.interval_type = "hours"
  try:
    base_config.validate_config(config)
  except ValueError as e:
    assert isinstance(e, errors.OneLineError)
  else:
    raise AssertionError("a bad config was not refused")


def test_a_jaxline_style_checkpointer_factory_runs_train_and_eval(tmp_path):
  """A checkpointer class written for jaxline (its methods, no base class) goes
  through the platform as in jaxline: its own methods are called, its state is
  what `step`'s loop sets, and the eval job evaluates what it restores."""
  toy = toy_experiment()
  saves = []

  class KeepsTheLastSave:
    def __init__(self, config, mode):
      del config, mode
      self._states = {}

    def get_experiment_state(self, series):
      return self._states.setdefault(series, ml_collections.ConfigDict())

    def save(self, series):
      saves.append((series, self._states[series].global_step))

    def can_be_restored(self, series):
      return bool(saves) and series == "latest"

    def restore(self, series):
      self._states[series].global_step = saves[-1][1]

    def restore_path(self, series):
      return len(saves) if self.can_be_restored(series) else None

    def wait_for_checkpointing_to_finish(self):
      pass

  config = toy.get_config()
  config.checkpoint_dir = str(tmp_path)
  config.training_steps = 4
  config.save_checkpoint_interval = 2
  config.checkpoint_interval_type = "steps"
  with flagsaver.flagsaver(config=config, jaxline_mode="train"):
    platform.main(toy.Experiment, [], checkpointer_factory=KeepsTheLastSave)
  assert saves == [("latest", 2), ("latest", 4)]
  config.one_off_evaluate = True
  with flagsaver.flagsaver(config=config, jaxline_mode="eval"):
    platform.main(toy.Experiment, [], checkpointer_factory=KeepsTheLastSave)
  assert [row["step"] for row in read_jsonl(tmp_path / "eval" / "metrics.jsonl")] == [4]
