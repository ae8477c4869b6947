"""The examples, and an experiment in published jaxline style, run end to end.

Each run is a subprocess started as a user would (`python <file>
--config=<file>:smoke ...`), and its checks read the metrics files the
framework's writer left in `<checkpoint_dir>/{train,eval}/metrics.jsonl`.
Every subprocess spends most of its time importing JAX and TensorFlow and
compiling, largely on one core, so all runs start together when the first
test asks for them and overlap on a 2-core machine; each test then waits for
its own run. The in-process tests at the end check the examples' data
contracts and cost no compilation.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from helpers import ENV, ROOT

from jaxline_ng import base_config

REPO = pathlib.Path(ROOT)
DIGITS = "examples/digits/experiment.py"
CHAR_LM = "examples/char_lm/experiment.py"
PUBLISHED = "tests/experiments/published_style.py"
# Generous: several runs share 2 cores, and a loaded CI machine is slower.
TIMEOUT_SECS = 300

# Runs whose TensorBoard files no test reads write metrics.jsonl alone:
# importing TensorFlow costs each seconds of CPU on a 2-core machine.
NO_TENSORBOARD = "--config.tensorboard=False"

# name: (script, config argument, --jaxline_mode, steps the run trains for,
#        further flags). char_lm checkpoints to disk: a second run resumes
# from it in train_eval_multithreaded (see test_char_lm_resumes_...).
RUNS = {
    "digits_train_eval": (DIGITS, ":smoke", "train_eval_multithreaded", 10, ()),
    "char_lm_train": (CHAR_LM, ":smoke", "train", 10,
                      ("--config.checkpointer=disk", NO_TENSORBOARD)),
    "char_lm_mesh": (CHAR_LM, ":smoke", "train", 10,
                     ("--config.placement=mesh", "--config.mesh_shape=data:-1,model:2",
                      NO_TENSORBOARD)),
    "published_style": (PUBLISHED, "", "train_eval_multithreaded", 20, (NO_TENSORBOARD,)),
}


def load_module(path):
  """Imports an example file by path (examples/ is not a package)."""
  spec = importlib.util.spec_from_file_location(pathlib.Path(path).parent.name, REPO / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


class Run:
  """One subprocess run: its command, checkpoint directory and log file."""

  def __init__(self, script, config_arg, mode, steps, flags, tmp_dir, checkpoint_dir=None):
    self.steps = steps
    self.checkpoint_dir = checkpoint_dir or tmp_dir / "checkpoints"
    self.log_path = tmp_dir / "log.txt"
    command = [sys.executable, script, f"--config={script}{config_arg}",
               f"--jaxline_mode={mode}", f"--config.checkpoint_dir={self.checkpoint_dir}",
               *flags]
    # A file, not a pipe: a pipe nobody reads yet could fill and stall the run.
    with open(self.log_path, "w") as log:
      self._process = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=log,
                                       stderr=subprocess.STDOUT)

  def wait(self):
    try:
      returncode = self._process.wait(timeout=TIMEOUT_SECS)
    except subprocess.TimeoutExpired:
      self._process.kill()
      pytest.fail(f"timed out after {TIMEOUT_SECS}s; log tail:\n{self.log_tail()}")
    assert returncode == 0, f"exit code {returncode}; log tail:\n{self.log_tail()}"
    return self

  def kill(self):
    if self._process.poll() is None:
      self._process.kill()
      self._process.wait()

  def log_tail(self, lines=40):
    return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

  def metrics(self, writer):
    """The JSON lines the framework's writer wrote for `writer` ("train"/"eval")."""
    path = self.checkpoint_dir / writer / "metrics.jsonl"
    assert path.is_file(), f"{path} was not written; log tail:\n{self.log_tail()}"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert rows and all("step" in row for row in rows), rows
    return rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Starts every run at once; tests wait for the ones they check."""
  started = {name: Run(*RUNS[name], tmp_path_factory.mktemp(name)) for name in RUNS}
  yield started
  for run in started.values():
    run.kill()


def check_training_written(run):
  train = run.metrics("train")
  assert train[-1]["step"] == run.steps
  return train


def check_evaluations_written(run, metric):
  # Rows with `metric` are the framework's; evaluate may write others itself.
  evals = [row for row in run.metrics("eval") if metric in row]
  # The evaluator always evaluates the final checkpoint.
  assert evals and evals[-1]["step"] == run.steps
  assert all(np.isfinite(row[metric]) for row in evals)
  return evals


# --- digits ------------------------------------------------------------------


def test_digits_smoke_train_eval_multithreaded(runs):
  run = runs["digits_train_eval"].wait()
  train = check_training_written(run)
  assert all(np.isfinite(row["train_loss"]) for row in train)
  evals = check_evaluations_written(run, "eval_accuracy")
  assert all(0.0 <= row["eval_accuracy"] <= 1.0 for row in evals)
  # The per-class accuracies evaluate() writes itself, through `writer`.
  assert any("eval_accuracy_per_class/0" in row for row in run.metrics("eval"))
  # TensorBoard event files hold the scalars and the misclassified-digits image.
  assert list((run.checkpoint_dir / "eval").glob("events.out.tfevents.*"))
  # Every run logs the size of what it checkpoints and when init finished.
  log = run.log_path.read_text()
  assert "Checkpointed state: params: " in log and " bytes" in log
  assert "[jaxline] experiment init finished." in log


# --- char_lm -----------------------------------------------------------------


def test_char_lm_smoke_train(runs):
  run = runs["char_lm_train"].wait()
  train = check_training_written(run)
  assert not (run.checkpoint_dir / "eval").exists()  # Training alone evaluates nothing.
  # The host-side counter (NON_BROADCAST_CHECKPOINT_ATTRS) counts consumed examples.
  assert train[-1]["examples_seen"] == 10 * 32


def test_char_lm_smoke_in_mesh_mode_with_sharded_parameters(runs):
  run = runs["char_lm_mesh"].wait()
  train = check_training_written(run)
  assert np.isfinite(train[-1]["train_bits_per_char"])
  assert "run.json" in os.listdir(run.checkpoint_dir / "train")


def test_char_lm_resumes_and_evaluates(runs, tmp_path):
  """A second run restores the disk checkpoint, counter included, and evaluates."""
  first = runs["char_lm_train"].wait()
  run = Run(CHAR_LM, ":smoke", "train_eval_multithreaded", 15,
            ("--config.checkpointer=disk", "--config.training_steps=15", NO_TENSORBOARD),
            tmp_path, checkpoint_dir=first.checkpoint_dir).wait()
  assert "Restored" in run.log_path.read_text()
  last = run.metrics("train")[-1]
  # 10 steps before the restart and 5 after, 32 windows each; a counter that
  # restarted from 0 would read 5 * 32.
  assert (last["step"], last["examples_seen"]) == (15, 15 * 32)
  evals = check_evaluations_written(run, "eval_bits_per_char")
  # Better than uniform over bytes (8 bits) even after 15 steps.
  assert evals[-1]["eval_bits_per_char"] < 8.0


# --- published style -----------------------------------------------------------


def test_published_style_experiment(runs):
  """Code written for jaxline runs unchanged but for its import."""
  run = runs["published_style"].wait()
  check_training_written(run)
  evals = check_evaluations_written(run, "eval_accuracy")
  assert evals[-1]["eval_accuracy"] > 0.8


# --- data contracts, in process ----------------------------------------------


def test_digits_batches_are_reshuffled_every_epoch_and_resume_from_their_position():
  digits = load_module(DIGITS)
  num, batch, seed = 100, 20, 3
  data = {"labels": np.arange(num)}
  batches = digits.train_batches(data, batch, seed)
  stream = np.concatenate([next(batches)["labels"] for _ in range(12)])  # 2.4 epochs.
  # Every example once per epoch, in another order each epoch and for another seed.
  for epoch in range(2):
    assert sorted(stream[epoch * num:(epoch + 1) * num]) == list(range(num))
  assert not np.array_equal(stream[:num], stream[num:2 * num])
  other_seed = digits.train_batches(data, batch, seed + 1)
  assert not np.array_equal(stream[:batch], next(other_seed)["labels"])
  # A fresh iterator given the position after 7 batches (mid-epoch) reads on from there.
  position = digits.train_batches(data, batch, seed)
  for _ in range(7):
    next(position)
  resumed = digits.train_batches(data, batch, seed)
  resumed.set_state(position.get_state())
  np.testing.assert_array_equal(
      np.concatenate([next(resumed)["labels"] for _ in range(5)]), stream[7 * batch:])


def test_digits_held_out_split_is_fixed_and_disjoint():
  digits = load_module(DIGITS)
  (train_a, held_out_a), (_, held_out_b) = digits.load_split(), digits.load_split()
  np.testing.assert_array_equal(held_out_a["images"], held_out_b["images"])
  assert len(held_out_a["labels"]) == digits.NUM_HELD_OUT
  assert len(train_a["labels"]) + len(held_out_a["labels"]) == 1797
  flat = lambda images: {image.tobytes() for image in images}
  # sklearn's digits hold a few exact duplicates; the split itself must not copy.
  assert len(flat(train_a["images"]) & flat(held_out_a["images"])) < 10


def test_digits_misclassified_grid():
  digits = load_module(DIGITS)
  images = np.random.default_rng(0).uniform(size=(20, 8, 8, 1)).astype(np.float32)
  labels = np.arange(20) % 10
  assert digits.misclassified_grid(images, labels, labels) is None
  predictions = labels.copy()
  predictions[:11] += 1  # 11 wrong: two rows of 8 tiles of 10x10 pixels, 4x larger.
  grid = digits.misclassified_grid(images, labels, predictions)
  assert grid.shape == (2 * 10 * 4, 8 * 10 * 4, 1) and grid.dtype == np.float32
  assert 0.0 <= grid.min() and grid.max() <= 1.0


def test_digits_batch_size_must_divide_over_devices():
  digits = load_module(DIGITS)
  config = digits.get_config("smoke").experiment_kwargs.config.copy_and_resolve_references()
  config.unlock()
  config.global_batch_size = 30  # 4 devices in tests.
  # A ConfigError: the command line prints it as one line, not a traceback.
  with pytest.raises(base_config.ConfigError, match=r"^config\.experiment_kwargs\.config\."
                     "global_batch_size=30 is not divisible by the 4 devices"):
    digits.Experiment("train", init_rng=None, config=config)


def test_char_lm_examples_do_not_depend_on_the_batch_size():
  char_lm = load_module(CHAR_LM)
  whole = char_lm.window_starts(0, 64, 10_000, seed=0)
  halves = np.concatenate([char_lm.window_starts(0, 32, 10_000, seed=0),
                           char_lm.window_starts(32, 32, 10_000, seed=0)])
  np.testing.assert_array_equal(whole, halves)
  assert len(set(whole.tolist())) > 50


def test_char_lm_text_is_fixed_and_held_out_is_separate():
  char_lm = load_module(CHAR_LM)
  assert list(char_lm.SOURCE_FILES) == sorted(char_lm.SOURCE_FILES)
  (train, held_out), (_, held_out_again) = char_lm.load_split(), char_lm.load_split()
  np.testing.assert_array_equal(held_out, held_out_again)
  assert train.dtype == np.uint8 and len(train) > 300_000
  assert 0.08 < len(held_out) / (len(train) + len(held_out)) < 0.12
  # A held-out passage does not occur in the training text.
  assert held_out[1000:1200].tobytes() not in train.tobytes()


@pytest.mark.parametrize("path", [DIGITS, CHAR_LM])
def test_config_arguments(path):
  module = load_module(path)
  smoke = module.get_config("smoke")
  assert smoke.training_steps <= 20
  assert module.get_config("").training_steps > smoke.training_steps
  with pytest.raises(ValueError, match="unknown config argument"):
    module.get_config("nonsense")


def test_char_lm_mesh_mode_shards_weight_matrices_over_model():
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec  # pylint: disable=import-outside-toplevel

  from jaxline_ng import mesh  # pylint: disable=import-outside-toplevel
  char_lm = load_module(CHAR_LM)
  config = char_lm.get_config("smoke")
  config.placement, config.mesh_shape = "mesh", "data:-1,model:2"
  mesh.activate(config)
  try:
    lm = char_lm.Experiment("train", jax.random.PRNGKey(0), **config.experiment_kwargs)
    specs = {leaf.sharding.spec for leaf in jax.tree.leaves(lm._params)}
    moment_specs = {leaf.sharding.spec for leaf in jax.tree.leaves(lm._opt_state)
                    if getattr(leaf, "ndim", 0) == 2}
  finally:
    mesh._active[0] = mesh.PMAP  # pylint: disable=protected-access
  assert PartitionSpec(None, "model") in specs and PartitionSpec() in specs
  assert moment_specs == {PartitionSpec(None, "model")}
