"""Iterator positions in checkpoints, in process: what is saved, set back and refused."""

import grain
import numpy as np
import pytest

from jaxline_ng import (
  base_config,
  checkpoint_skeleton,
  disk_checkpointing,
  experiment,
  iterator_state,
  preemption,
)


def shuffled_batches(seed=3):
  dataset = grain.MapDataset.range(10).seed(seed).shuffle().repeat(None).batch(3)
  return iter(dataset.to_iter_dataset())


class WithIterator(experiment.AbstractExperiment):
  NON_BROADCAST_CHECKPOINT_ATTRS = {"_batches": "train_iterator", "_count": "count"}

  def __init__(self, mode="train", init_rng=None):
    super().__init__(mode=mode, init_rng=init_rng)
    self._batches = shuffled_batches()
    self._count = 0

  def step(self, *, global_step, rng, writer):
    self._count += 1
    return {"first": next(self._batches)[0]}

  def evaluate(self, *, global_step, rng, writer):
    return {}


def test_a_snapshot_holds_the_position_and_a_fresh_experiment_reads_on_from_it():
  trained = WithIterator()
  for _ in range(4):  # Into the second epoch.
    trained.step(global_step=None, rng=None, writer=None)
  snapshot = trained.snapshot_state()
  assert snapshot["train_iterator"] == iterator_state.Position("get_state", {0: {"next_index": 4}})
  expected = [next(trained._batches) for _ in range(3)]
  resumed = WithIterator()
  resumed.restore_from_snapshot(snapshot)
  assert resumed._count == 4
  for batch in expected:
    np.testing.assert_array_equal(next(resumed._batches), batch)


def test_a_disk_checkpoint_entry_round_trips_the_position():
  position = iterator_state.Position("get_state", {0: {"next_index": 4}, 1: {"next_index": 5}})
  _, entries, arrays = disk_checkpointing.encode(
      {"global_step": 4, "experiment_module": {"train_iterator": position}})
  assert not arrays
  entry = entries["experiment_module/train_iterator"]
  assert entry["skeleton"] == {"iterator": "get_state"}
  leaves = [leaf["value"] for leaf in entry["leaves"]]
  assert checkpoint_skeleton.rebuild(entry["skeleton"], leaves) == position


def test_states_of_other_types_than_json_round_trip():
  state = {"bytes": b"\x00\xff", "tuple": (1, "a"), "array": np.arange(6, dtype=np.uint32)
           .reshape(2, 3), "scalar": np.float32(1.5), "keys": {1: None, (2, 3): [True]}}
  decoded = iterator_state._decode(iterator_state._encode(state))
  np.testing.assert_array_equal(decoded.pop("array"), state.pop("array"))
  assert decoded == state and type(decoded["scalar"]) is np.float32


def test_numpy_random_state_is_saved_as_its_position():
  generator = np.random.RandomState(0)
  generator.rand(5)
  position = iterator_state.capture(generator, "experiment_module/generator")
  expected = generator.rand(3)
  fresh = np.random.RandomState(1)
  iterator_state.set_back(fresh, position, "experiment_module/generator")
  np.testing.assert_array_equal(fresh.rand(3), expected)


def test_a_tf_data_iterator_is_saved_through_tf_train_checkpoint():
  import tensorflow as tf  # A dependency of the package; imported here alone: seconds of CPU.
  make = lambda: iter(tf.data.Dataset.range(100).shuffle(100, seed=1).batch(4))
  iterator = make()
  for _ in range(3):
    next(iterator)
  position = iterator_state.capture(iterator, "experiment_module/train_iterator")
  assert position.kind == "tf.data"
  expected = [next(iterator).numpy() for _ in range(2)]
  fresh = make()
  iterator_state.set_back(fresh, position, "experiment_module/train_iterator")
  for batch in expected:
    np.testing.assert_array_equal(next(fresh).numpy(), batch)


def test_a_value_that_cannot_be_saved_says_how_to_make_it_saveable():
  with pytest.raises(disk_checkpointing.CheckpointFormatError,
                     match=r"cannot checkpoint experiment_module/loader: a Loader is neither an "
                     r"array nor a plain Python value .* give it get_state\(\) and "
                     r"set_state\(state\)"):
    disk_checkpointing.encode({"experiment_module": {"loader": type("Loader", (), {})()}})


def test_a_position_set_into_something_else_or_for_another_process_is_one_line():
  position = iterator_state.Position("get_state", {1: {"next_index": 4}})
  with pytest.raises(iterator_state.IteratorStateError, match="none for process 0"):
    iterator_state.set_back(shuffled_batches(), position, "experiment_module/train_iterator")
  with pytest.raises(iterator_state.IteratorStateError, match=r"holds no iterator \(list\)"):
    iterator_state.set_back([], position, "experiment_module/train_iterator")


def test_processes_that_save_positions_need_save_steps_they_all_know():
  config = base_config.get_base_config()
  with pytest.raises(base_config.ConfigError, match="train_iterator .* set "
                     "config.checkpoint_interval_type='steps' \\(it is 'secs'\\)"):
    iterator_state.PeerPositions(config, WithIterator())
  config.checkpoint_interval_type = "steps"
  assert iterator_state.PeerPositions(config, WithIterator()).names == ["train_iterator"]


def test_a_stop_step_that_is_no_step_is_refused(monkeypatch):
  monkeypatch.setenv(preemption.STOP_AFTER_STEP_ENV, "ten")
  with pytest.raises(base_config.ConfigError, match="JAXLINE_NG_STOP_AFTER_STEP='ten'"):
    preemption.StopCheck()
