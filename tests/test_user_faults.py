"""The faults and mistakes a real user makes, run as the user would: real processes.

Each case ends one of two ways: the run goes on correctly, or it stops
within seconds with one line naming the culprit.
"""

import json
import os
import signal
import subprocess
import sys
import time

import helpers
import numpy as np
import pytest
from helpers import ENV, EXPERIMENTS, ROOT, read_jsonl, run, toy_experiment

from jaxline_ng import disk_checkpointing, scalars

# Absolute: some runs start in another directory.
TOY = os.path.join(ROOT, helpers.TOY)


def toy(*args, config=TOY, script=TOY):
  return [sys.executable, script, f"--config={config}", *args]


def test_relative_checkpoint_dir_with_disk_checkpoints(tmp_path):
  result = run(toy("--config.checkpoint_dir=runs/x", "--config.checkpointer=disk",
                   "--config.training_steps=10", "--config.save_checkpoint_interval=5"),
               cwd=tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  run_dir = tmp_path / "runs" / "x"
  assert sorted(os.listdir(run_dir / "checkpoints" / "latest")) == ["10", "5"]
  assert read_jsonl(run_dir / "train" / "metrics.jsonl")[-1]["step"] == 10
  with open(run_dir / "train" / "run.json") as f:
    assert json.load(f)["config"]["checkpoint_dir"] == str(run_dir)


@pytest.mark.parametrize("key, given, resolved", [
    ("checkpoint_dir", "", "."), ("checkpoint_dir", "~/runs/x", "home/runs/x"),
    ("checkpoint_dir", "~", "home"), ("checkpoint_dir", "/abs/x", "/abs/x"),
    ("restore_path", "~/runs/y", "home/runs/y"), ("restore_path", "", None),
    ("compilation_cache_dir", "cache", "cache"), ("compilation_cache_dir", "", None)])
def test_paths_in_the_config_are_made_absolute_once(tmp_path, monkeypatch, key, given, resolved):
  # An empty checkpoint_dir crashed in orbax at the first disk save; "~/x" made
  # a directory named "~". Empty restore_path and cache directory mean none.
  from jaxline_ng import base_config, config_loading  # pylint: disable=import-outside-toplevel
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  config = base_config.get_base_config()
  config[key] = given
  config_loading.make_paths_absolute(config)
  assert config[key] == (given if resolved is None else os.path.normpath(tmp_path / resolved))


def dict_config_with(tmp_path, checkpoint_dir):
  """A config file returning toy's config as a plain dict (whose values
  ml_collections does not type-check) with `checkpoint_dir` set to the
  Python expression given."""
  config_file = tmp_path / "config.py"
  config_file.write_text("import pathlib\n"
                         "import toy\n"
                         "def get_config():\n"
                         "  config = toy.get_config().to_dict()\n"
                         f"  config.update(checkpoint_dir={checkpoint_dir}, training_steps=4)\n"
                         "  return config\n")
  return toy(config=str(config_file))


@pytest.mark.parametrize("value,culprit", [
    ("None", "config.checkpoint_dir=None is a NoneType; give a directory path (a string"),
    ("7", "config.checkpoint_dir=7 is a int; give a directory path (a string"),
])
def test_a_checkpoint_dir_that_is_not_a_path_is_one_line(tmp_path, value, culprit):
  """It was a TypeError traceback from `re.match` as the paths were resolved."""
  result = run(dict_config_with(tmp_path, value), timeout=60,
               env=dict(ENV, PYTHONPATH=os.pathsep.join([ROOT, EXPERIMENTS])))
  assert result.returncode == 1
  assert "Traceback" not in result.stderr, result.stderr[-2000:]
  assert f"jaxline_ng: error: {culprit}" in result.stderr


def test_a_pathlib_checkpoint_dir_runs(tmp_path):
  """A pathlib.Path (in a plain dict config; a ConfigDict built on the base
  config refuses one) was a TypeError traceback."""
  result = run(dict_config_with(tmp_path, f"pathlib.Path({str(tmp_path)!r}) / 'run'"),
               timeout=60, env=dict(ENV, PYTHONPATH=os.pathsep.join([ROOT, EXPERIMENTS])))
  assert result.returncode == 0, result.stderr[-2000:]
  assert read_jsonl(tmp_path / "run" / "train" / "metrics.jsonl")[-1]["step"] == 4


@pytest.mark.parametrize("override,key,close", [
    ("--config.training_step", "training_step", "training_steps"),
    ("--config.experiment_kwargs.configg.learning_rate", "configg", "config"),
])
def test_override_one_letter_off_a_key_is_one_line_with_a_hint(tmp_path, override, key, close):
  result = run(toy(f"--config.checkpoint_dir={tmp_path}", f"{override}=5"), timeout=60)
  assert result.returncode != 0
  assert "Traceback" not in result.stderr
  lines = [line for line in result.stderr.splitlines() if f"{override}:" in line]
  assert len(lines) == 1, result.stderr[-2000:]
  assert f"has no key {key!r} there (did you mean {close!r}?)" in lines[0]
  assert "Did you mean" not in result.stderr


def test_get_config_returning_a_plain_dict_is_accepted(tmp_path):
  config_file = tmp_path / "dict_config.py"
  config_file.write_text(
      "from jaxline_ng import base_config\n"
      "def get_config():\n"
      "  config = base_config.get_base_config().to_dict()\n"
      "  config.update(training_steps=4, interval_type='steps', log_train_data_interval=2,\n"
      "                tensorboard=False,\n"
      "                experiment_kwargs={'config': {'learning_rate': 0.1, 'dim': 3,\n"
      "                                              'fail_at_step': -1, 'fail_on_process': -1,\n"
      "                                              'record_keys_dir': '',\n"
      "                                              'step_sleep_secs': 0.0,\n"
      "                                              'nan_from_step': -1, 'nan_on_process': -1}})\n"
      "  return config\n")
  result = run(toy(f"--config.checkpoint_dir={tmp_path}", "--config.training_steps=6",
                   config=str(config_file)))
  assert result.returncode == 0, result.stderr[-3000:]
  assert [r["step"] for r in read_jsonl(tmp_path / "train" / "metrics.jsonl")] == [2, 4, 6]


def test_a_config_written_for_jaxline_without_its_base_config_runs(tmp_path):
  """Only jaxline 0.0.8's keys, written out by hand: jaxline_ng's own keys take defaults."""
  config_file = tmp_path / "jaxline_config.py"
  config_file.write_text(
      "from ml_collections import config_dict\n"
      "import toy\n"
      "def get_config():\n"
      "  return config_dict.ConfigDict(dict(\n"
      "      training_steps=6, interval_type='steps', save_checkpoint_interval=3,\n"
      "      log_tensors_interval=3, log_train_data_interval=3.0,\n"
      "      periodic_action_growth_ratios=None, log_async=True, log_all_hosts=False,\n"
      "      logging_interval_type=None, checkpoint_interval_type=None,\n"
      "      save_initial_train_checkpoint=False, train_checkpoint_all_hosts=False,\n"
      "      best_checkpoint_all_hosts=False, log_all_train_data=False,\n"
      "      eval_initial_weights=False, one_off_evaluate=False, max_checkpoints_to_keep=5,\n"
      "      random_seed=42, random_mode_train='unique_host_unique_device',\n"
      "      random_mode_eval='same_host_same_device', legacy_random_seed_behavior=False,\n"
      "      best_model_eval_metric='', best_model_eval_metric_higher_is_better=True,\n"
      f"      checkpoint_dir={str(tmp_path)!r},\n"
      "      experiment_kwargs=toy.get_config().experiment_kwargs))\n")
  result = run(toy(config=str(config_file)),
               env=dict(ENV, PYTHONPATH=os.pathsep.join([ROOT, EXPERIMENTS])))
  assert result.returncode == 0, result.stderr[-3000:]
  assert [r["step"] for r in read_jsonl(tmp_path / "train" / "metrics.jsonl")] == [3, 6]
  assert "The config has no tensorboard, checkpointer," in result.stderr


def test_get_config_returning_something_else_names_the_config_file(tmp_path):
  config_file = tmp_path / "list_config.py"
  config_file.write_text("def get_config():\n  return [1, 2]\n")
  result = run(toy(config=str(config_file)), timeout=60)
  assert result.returncode != 0
  assert "Traceback" not in result.stderr
  assert f"config file '{config_file}': get_config() returned a list" in result.stderr


def signal_after(args, markers, timeout=60, cwd=ROOT):
  """Runs `args`; sends SIGTERM after each log line containing the next of `markers`.

  Returns (exit code, stderr, seconds from the last signal to the exit).
  """
  process = subprocess.Popen(args, cwd=cwd, env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
  lines, pending = [], list(markers)
  signalled = time.monotonic()
  try:
    while pending and (line := process.stderr.readline()):
      lines.append(line)
      if pending[0] in line:
        pending.pop(0)
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
    try:
      _, rest = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      pytest.fail(f"no exit {timeout}s after the last signal:\n" + "".join(lines)[-3000:])
  finally:
    process.kill()
  assert not pending, "".join(lines)[-3000:]
  return process.returncode, "".join(lines) + rest, time.monotonic() - signalled


# A process-directed signal reaches one thread of the OS's choosing, not always
# the main one; this sends SIGTERM to a thread that is not main, after `secs`.
SIGTERM_TO_ANOTHER_THREAD = (
    "import signal, threading, time\n"
    "def sigterm_to_another_thread(secs):\n"
    "  def send():\n"
    "    time.sleep(secs)\n"
    "    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)\n"
    "  threading.Thread(target=send, daemon=True).start()\n")


def experiment_script(tmp_path, body):
  """A script running a subclass of the toy experiment with `body` as its class body."""
  script = tmp_path / "variant.py"
  script.write_text(
      "import functools, sys\n"
      f"sys.path.insert(0, {EXPERIMENTS!r})\n"
      "import jax, jax.numpy as jnp\n"
      "import toy\n"
      "from absl import app\n"
      "from jaxline_ng import platform\n"
      + SIGTERM_TO_ANOTHER_THREAD +
      "class Variant(toy.Experiment):\n"
      + "".join(f"  {line}\n" for line in body.splitlines()) +
      "app.run(functools.partial(platform.main, Variant))\n")
  return str(script)


@pytest.mark.parametrize("mode", ["eval", "eval_holdout"])
@pytest.mark.parametrize("to_thread", [False, True], ids=["to_process", "to_another_thread"])
def test_sigterm_to_an_eval_job_waiting_for_checkpoints_exits_75_at_once(tmp_path, mode,
                                                                         to_thread):
  script = experiment_script(tmp_path, (
      "def __init__(self, mode, init_rng, **kwargs):\n"
      "  super().__init__(mode, init_rng, **kwargs)\n"
      f"  if {to_thread}:\n"
      "    sigterm_to_another_thread(2)\n"))
  args = toy(f"--config.checkpoint_dir={tmp_path}", "--config.checkpointer=disk",
             f"--jaxline_mode={mode}", "--config.eval_poll_interval_secs=300", script=script)
  code, stderr, secs = signal_after(args, [] if to_thread else ["experiment init finished"],
                                    timeout=120)
  assert code == 75, stderr[-3000:]
  assert secs < 60  # Not the poll interval: the wait ends at the signal.
  assert "Evaluation stopped by SIGTERM" in stderr


def test_sigterm_to_train_eval_multithreaded_exits_75(tmp_path):
  code, stderr, _ = signal_after(
      toy(f"--config.checkpoint_dir={tmp_path}", "--jaxline_mode=train_eval_multithreaded",
          "--config.checkpointer=disk", "--config.training_steps=1000000"),
      ["step 10/"])
  assert code == 75, stderr[-3000:]


def test_one_sigterm_delivered_twice_at_once_still_saves(tmp_path):
  # Signalled, coreutils' `timeout` sends the signal to its child and then to
  # its process group, the child included, microseconds apart: one request.
  script = experiment_script(tmp_path, (
      "def step(self, global_step, rng, writer):\n"
      "  if int(global_step[0]) == 10:\n"
      "    import os, signal\n"
      "    os.kill(os.getpid(), signal.SIGTERM)\n"
      "    os.kill(os.getpid(), signal.SIGTERM)\n"
      "  return super().step(global_step=global_step, rng=rng, writer=writer)\n"))
  result = run(toy(f"--config.checkpoint_dir={tmp_path}", "--config.checkpointer=disk",
                   "--config.training_steps=1000", "--config.save_checkpoint_interval=1000",
                   script=script))
  assert result.returncode == 75, result.stderr[-3000:]
  assert "Second SIGTERM" not in result.stderr
  stopped_at = int(result.stderr.split("stopped by SIGTERM after step ")[1].split()[0].strip(":"))
  assert stopped_at >= 11 and disk_checkpointing.read(str(tmp_path))[0] == stopped_at


def test_sigterm_and_sigint_together_are_one_request_and_a_later_one_still_exits_75(tmp_path):
  script = experiment_script(tmp_path, (
      "def __init__(self, mode, init_rng, **kwargs):\n"
      "  super().__init__(mode, init_rng, **kwargs)\n"
      "  import atexit, sys, time\n"  # Holds the exit open after the run, for the last signal.
      "  atexit.register(lambda: (print('at exit now', file=sys.stderr, flush=True),\n"
      "                           time.sleep(2)))\n"
      "def step(self, global_step, rng, writer):\n"
      "  if int(global_step[0]) == 10:\n"
      "    import os, signal\n"
      "    os.kill(os.getpid(), signal.SIGTERM)\n"
      "    os.kill(os.getpid(), signal.SIGINT)\n"
      "  return super().step(global_step=global_step, rng=rng, writer=writer)\n"))
  code, stderr, _ = signal_after(
      toy(f"--config.checkpoint_dir={tmp_path}", "--config.checkpointer=disk",
          "--config.training_steps=1000", "--config.save_checkpoint_interval=1000",
          script=script),
      ["at exit now"])  # Its SIGTERM then reaches the process as it exits, after the run.
  assert code == 75, stderr[-3000:]
  assert "Second SIG" not in stderr
  assert disk_checkpointing.read(str(tmp_path))[0] >= 11


def test_a_sigterm_while_the_interpreter_shuts_down_after_a_stop_still_exits_75(tmp_path):
  # The interpreter resets signal handlers before it tears down modules (and
  # JAX and TensorFlow after them, a fraction of a second): a SIGTERM then
  # ended the stopped run with 143, which a scheduler does not requeue.
  script = experiment_script(tmp_path, (
      "def step(self, global_step, rng, writer):\n"
      "  if int(global_step[0]) == 10:\n"
      "    import os, signal\n"
      "    class SigtermAtTeardown:\n"  # Its module's globals are gone by then.
      "      sigterm = functools.partial(os.kill, os.getpid(), signal.SIGTERM)\n"
      "      def __del__(self):\n"
      "        self.sigterm()\n"
      "    sys.modules['__main__'].at_teardown = SigtermAtTeardown()\n"
      "    os.kill(os.getpid(), signal.SIGTERM)\n"
      "  return super().step(global_step=global_step, rng=rng, writer=writer)\n"))
  result = run(toy(f"--config.checkpoint_dir={tmp_path}", "--config.training_steps=1000",
                   "--config.checkpointer=disk", script=script))
  assert result.returncode == 75, result.stderr[-3000:]
  assert disk_checkpointing.read(str(tmp_path))[0] >= 11  # The stop saved its step.


SIGTERM_THEN = (
    "  import os, signal, time\n"
    "  os.kill(os.getpid(), signal.SIGTERM)\n"
    "  time.sleep(0.2)\n")


@pytest.mark.parametrize("body, mode_args", [
    ("def evaluate(self, global_step, rng, writer):\n" + SIGTERM_THEN +
     "  return super().evaluate(global_step=global_step, rng=rng, writer=writer)\n",
     ("--jaxline_mode=eval", "--config.one_off_evaluate=True",
      "--config.eval_initial_weights=True")),
    ("def snapshot_state(self):\n" + SIGTERM_THEN +  # Only the final save: training_steps=3.
     "  return super().snapshot_state()\n",
     ("--config.training_steps=3", "--config.checkpointer=disk"))],
    ids=["during_a_one_off_evaluation", "during_the_final_save"])
def test_a_sigterm_as_the_run_ends_still_exits_75(tmp_path, body, mode_args):
  # The work ends normally, but the log said "exiting with code 75": exit 0
  # left a program's code after platform.main running after its SIGTERM (an
  # emergent_in_context_learning main calls platform.main again).
  script = experiment_script(tmp_path, body)
  result = run(toy(f"--config.checkpoint_dir={tmp_path}", *mode_args, script=script))
  assert result.returncode == 75, result.stderr[-3000:]
  assert "SIGTERM came as the run ended: exiting with code 75" in result.stderr
  assert "Second SIGTERM" not in result.stderr


@pytest.mark.parametrize("to_thread", [False, True], ids=["to_process", "to_another_thread"])
def test_second_sigterm_during_the_final_save_exits_75_at_once(tmp_path, to_thread):
  # Only the final save snapshots: periodic saves are off. The second signal
  # comes a second after the first: sooner, it would be the same request.
  script = experiment_script(tmp_path, (
      "def snapshot_state(self):\n"
      f"  if {to_thread}:\n"
      "    sigterm_to_another_thread(1)\n"
      "  time.sleep(1)\n"
      "  print('saving now', file=sys.stderr, flush=True)\n"
      "  time.sleep(300)\n"
      "  return super().snapshot_state()\n"))
  code, stderr, secs = signal_after(
      toy(f"--config.checkpoint_dir={tmp_path}", "--config.training_steps=1000000",
          "--config.checkpointer=disk", "--config.save_checkpoint_interval=1000000000",
          script=script),
      ["step 10/"] if to_thread else ["step 10/", "saving now"], timeout=120)
  assert code == 75, stderr[-3000:]
  assert secs < 60  # Not the final save's 300 s.
  assert "Second SIGTERM: exiting now with code 75" in stderr


def test_eval_job_with_in_memory_checkpoints_evaluates_initial_weights_and_ends(tmp_path):
  result = run(toy(f"--config.checkpoint_dir={tmp_path}", "--jaxline_mode=eval",
                   "--config.eval_initial_weights=True"), timeout=60)
  assert result.returncode == 0, result.stderr[-3000:]
  assert [r["step"] for r in read_jsonl(tmp_path / "eval" / "metrics.jsonl")] == [0]


def one_line_error(result, culprit):
  assert result.returncode not in (0, 75), result.stderr[-3000:]
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  lines = [line for line in result.stderr.splitlines() if line.startswith("jaxline_ng: error:")]
  assert len(lines) == 1 and culprit in lines[0], result.stderr[-3000:]
  return lines[0]


@pytest.mark.parametrize("blocker", ["train", "train/run.lock/"])
def test_a_lock_path_that_cannot_be_written_is_named(tmp_path, blocker):
  # A file where the mode's directory goes, or a directory where its lock goes.
  if blocker.endswith("/"):
    os.makedirs(tmp_path / blocker)
  else:
    (tmp_path / blocker).write_text("")
  result = run(toy(f"--config.checkpoint_dir={tmp_path}"), timeout=60)
  one_line_error(result, f"cannot write a lock file at {tmp_path / blocker.rstrip('/')}: ")


def test_step_returning_a_per_device_vector_is_one_line_with_its_real_shape(tmp_path):
  script = experiment_script(tmp_path, (
      "def step(self, **kwargs):\n"
      "  loss = super().step(**kwargs)['loss']\n"
      "  return {'loss': loss, 'per_dim': jnp.zeros((jax.local_device_count(), 3))}\n"))
  result = run(toy(f"--config.checkpoint_dir={tmp_path}", script=script), timeout=90)
  one_line_error(result, "step() returned scalar 'per_dim' that has shape (4, 3)")


def toy_variant(**methods):
  toy = toy_experiment()
  config = toy.get_config()
  config.training_steps = 3
  config.eval_initial_weights = True
  return type("Variant", (toy.Experiment,), methods), config


@pytest.mark.parametrize("returned,culprit", [
    (None, "step() returned NoneType None: return a dict of scalars"),
    ([1.0], "step() returned list [1.0]: return a dict of scalars"),
    # TensorBoard and JSON take real numbers: the writer's thread used to die on these.
    ({"loss": 1.0, "phase": np.complex64(1j)},
     "step() returned scalar 'phase' that has dtype complex64"),
    ({"loss": 1.0, 0: 2.0}, "step() returned scalar 0 that has a name of type int, not a string"),
    # Per-class values whose count happens to equal the devices' (4) are no per-device values.
    ({"loss": 1.0, "per_class": np.arange(4.0)},
     "step() returned scalar 'per_class' that is a vector of 4 differing values, not one per "
     "device (its first alone would be logged): return numbers"),
])
def test_step_returning_what_cannot_be_logged_stops_at_that_step_naming_it(returned, culprit):
  from jaxline_ng import checkpointing, train  # pylint: disable=import-outside-toplevel
  steps = []

  def step(self, global_step, rng, writer):
    steps.append(global_step)
    return returned

  cls, config = toy_variant(step=step)
  with pytest.raises(scalars.ScalarsError) as raised:
    train.train(cls, config, checkpointing.InMemoryCheckpointer(config, "train"), None)
  assert str(raised.value).startswith(culprit)
  assert len(steps) == 1  # Raised on the loop's thread, at the step that returned it.


def test_a_later_step_returning_what_cannot_be_logged_stops_when_it_is_logged():
  """After the first step, outputs are checked where logging reads them, naming the key;
  the run stops then, not an interval later at the next logged step (port14)."""
  from jaxline_ng import checkpointing, train  # pylint: disable=import-outside-toplevel
  steps = []

  def step(self, global_step, rng, writer):
    steps.append(int(global_step[0]))
    time.sleep(0.001)
    return {"loss": 1.0, **({"phase": np.complex64(1j)} if len(steps) >= 3 else {})}

  cls, config = toy_variant(step=step)
  config.training_steps = 10_000
  config.interval_type = "steps"
  config.log_tensors_interval = 1000
  with pytest.raises(scalars.ScalarsError) as raised:
    train.train(cls, config, checkpointing.InMemoryCheckpointer(config, "train"), None)
  assert str(raised.value).startswith("step() returned scalar 'phase' that has dtype complex64")
  assert 1000 <= len(steps) < 1500


def evaluate_variant(tmp_path, evaluate):
  from jaxline_ng import checkpointing, train, writers  # pylint: disable=import-outside-toplevel
  cls, config = toy_variant(evaluate=evaluate)
  writer = writers.make_writer(str(tmp_path))
  try:
    with pytest.raises(scalars.ScalarsError) as raised:
      train.evaluate(cls, config, checkpointing.InMemoryCheckpointer(config, "eval"), writer,
                     jaxline_mode="eval", stop_waiting=lambda: True)
  finally:
    writer.close()
  return str(raised.value)


def test_evaluate_returning_a_list_names_it(tmp_path):
  error = evaluate_variant(tmp_path, lambda self, **unused: [1.0, 2.0])
  assert error.startswith("evaluate() returned list [1.0, 2.0]: return a dict of scalars")


@pytest.mark.parametrize("name,value,culprit", [
    ("verdict", "good", "scalar 'verdict' that is a str ('good')"),
    ("phase", np.complex64(1j), "scalar 'phase' that has dtype complex64"),
    (("a", "b"), 1.0, "scalar ('a', 'b') that has a name of type tuple, not a string"),
])
def test_evaluate_returning_an_unloggable_scalar_writes_the_row_and_names_the_key(
    tmp_path, name, value, culprit):
  toy = toy_experiment()

  def evaluate(self, **kwargs):
    return {**toy.Experiment.evaluate(self, **kwargs), name: value}

  error = evaluate_variant(tmp_path, evaluate)
  assert error.startswith(f"evaluate() returned {culprit}")
  [row] = read_jsonl(tmp_path / "metrics.jsonl")
  assert row["step"] == 0 and set(row) == {"step", "neg_distance", "params/mean"}


def test_second_run_on_the_same_checkpoint_dir_is_refused_naming_the_first(tmp_path):
  first = subprocess.Popen(
      toy(f"--config.checkpoint_dir={tmp_path}", "--config.checkpointer=disk",
          "--config.training_steps=1000000", "--config.save_checkpoint_interval=10",
          # Paced, saving every half second: it only has to have saved and to
          # outlive the runs below, which need the CPU (a disk save is CPU-bound).
          "--config.experiment_kwargs.config.step_sleep_secs=0.05"),
      cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    for line in first.stderr:
      if "Saved checkpoint latest" in line:
        break
    started = time.monotonic()
    second = run(toy(f"--config.checkpoint_dir={tmp_path}", "--config.checkpointer=disk",
                     "--config.training_steps=1000000"), timeout=60)
    refused_in = time.monotonic() - started
    # A multi-process run is refused as a whole: its chief holds the locks,
    # and the others end with it rather than wait for it at a collective.
    launched = run([sys.executable, "-m", "jaxline_ng.launch", "--",
                    *toy(f"--config.checkpoint_dir={tmp_path}", "--config.checkpointer=disk")],
                   timeout=60)
    assert first.poll() is None  # The first run is untouched and goes on.
    # An eval job only reads what training writes: it runs beside it.
    evaluator = run(toy(f"--config.checkpoint_dir={tmp_path}", "--config.checkpointer=disk",
                        "--jaxline_mode=eval", "--config.one_off_evaluate=True"), timeout=90)
    assert evaluator.returncode == 0, evaluator.stderr[-3000:]
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 75
  finally:
    first.kill()
  line = one_line_error(second, f"config.checkpoint_dir={str(tmp_path)!r} is in use")
  assert f"held by process {first.pid} on host " in line
  assert refused_in < 30
  assert launched.returncode == 1, launched.stdout[-3000:]
  assert "[launch] exit codes: process 0: 1, process 1: 1" in launched.stdout
  assert "[p1] " in launched.stdout and "Process 0 failed (RunLockError: " in launched.stdout
  assert read_jsonl(tmp_path / "eval" / "metrics.jsonl")


def kill_at(args, marker):
  """Runs `args` and SIGKILLs it as soon as its log shows `marker`; returns the process."""
  process = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
  try:
    for line in process.stderr:
      if marker in line:
        process.kill()
        break
    process.wait(timeout=30)
  finally:
    process.kill()
  return process


def test_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path):
  args = toy(f"--config.checkpoint_dir={tmp_path}", "--config.checkpointer=disk",
             "--config.training_steps=40", "--config.save_checkpoint_interval=5")
  killed = kill_at(args, "Saved checkpoint latest")
  result = run(args)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"Taking over the train lock {tmp_path / 'train' / 'run.lock'} from process {killed.pid}" \
      in result.stderr
  assert read_jsonl(tmp_path / "train" / "metrics.jsonl")[-1]["step"] == 40


def test_sigkill_after_a_checkpoint_keeps_every_metric_row_it_covers(tmp_path):
  kill_at(toy(f"--config.checkpoint_dir={tmp_path}", "--config.checkpointer=disk",
              "--config.training_steps=1000000", "--config.save_checkpoint_interval=10",
              "--config.log_train_data_interval=1"), "Saved checkpoint latest/30 ")
  newest = max(int(name) for name in os.listdir(tmp_path / "checkpoints" / "latest")
               if name.isdigit())
  assert newest >= 30
  steps = {row["step"] for row in read_jsonl(tmp_path / "train" / "metrics.jsonl")}
  assert set(range(1, newest + 1)) <= steps


def tensorboard_steps(logdir, tag):
  """The steps of `tag`'s points as the TensorBoard server loads them."""
  from tensorboard.backend.event_processing import plugin_event_accumulator  # pylint: disable=import-outside-toplevel
  accumulator = plugin_event_accumulator.EventAccumulator(
      str(logdir), tensor_size_guidance={"scalars": 0})  # 0: keep every point.
  accumulator.Reload()
  return [event.step for event in accumulator.Tensors(tag)]


def test_resumed_run_has_no_duplicated_or_orphaned_metric_rows(tmp_path):
  args = toy(f"--config.checkpoint_dir={tmp_path}", "--config.checkpointer=disk",
             "--config.training_steps=30", "--config.save_checkpoint_interval=10",
             "--config.log_train_data_interval=1", "--config.tensorboard=True")
  first = run(args)
  assert first.returncode == 0, first.stderr[-3000:]
  # As if killed after writing the rows of steps 21..30 but before checkpoint 30 was
  # committed: the rerun resumes from step 20 and writes those steps again.
  os.rename(tmp_path / "checkpoints" / "latest" / "30", tmp_path / "lost_30")
  with open(tmp_path / "train" / "metrics.jsonl", "ab") as f:
    f.write(b'{"step": 31, "lo')  # And died mid-row.
  time.sleep(1)  # The rerun's event files sort after the first run's.
  second = run(args)
  assert second.returncode == 0, second.stderr[-3000:]
  assert "Restored checkpoint" in second.stderr
  rows = read_jsonl(tmp_path / "train" / "metrics.jsonl")
  assert [row["step"] for row in rows] == list(range(1, 31))
  assert tensorboard_steps(tmp_path / "train", "loss") == list(range(1, 31))
