"""The training loop: what `step` sees, what is checkpointed, what is logged."""

import json
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from jaxline_ng import (
  base_config,
  best,
  checkpointing,
  debugging,
  errors,
  experiment,
  periodic,
  preemption,
  rng,
  scalars,
  train,
  utils,
  writers,
)


def make_config(**overrides):
  config = base_config.get_base_config()
  config.training_steps = 5
  config.interval_type = "steps"
  config.log_tensors_interval = 1000
  config.log_train_data_interval = None
  config.save_checkpoint_interval = 1000
  for key, value in overrides.items():
    config[key] = value
  return config


class Recorder:
  """An inner writer that keeps every scalar write."""

  def __init__(self):
    self.scalars = []

  def write_scalars(self, global_step, scalars):
    self.scalars.append((global_step, dict(scalars)))

  def flush(self):
    pass

  def close(self):
    pass


class Counting(experiment.AbstractExperiment):
  """Records what the loop hands to `step`; params count steps on device."""
  CHECKPOINT_ATTRS = {"_count": "count"}
  seen = []

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._count = utils.bcast_local_devices(jnp.zeros((), jnp.int32))
    self._add = jax.pmap(lambda c: c + 1, axis_name="i", donate_argnums=0)

  def step(self, global_step, rng, writer):
    Counting.seen.append((global_step, np.asarray(rng)))
    self._count = self._add(self._count)
    return {"count": utils.get_first(self._count)}

  def evaluate(self, global_step, rng, writer):
    return {"count": utils.get_first(self._count)}


def run_counting(config, writer=None, periodic_actions=()):
  Counting.seen = []
  checkpointer = checkpointing.InMemoryCheckpointer(config, "train")
  train.train(Counting, config, checkpointer, writer, periodic_actions)
  return checkpointer


@pytest.mark.parametrize("steps", [1, 5])
def test_step_sees_per_device_global_step_and_raw_keys(steps):
  run_counting(make_config(training_steps=steps))
  num_devices = jax.local_device_count()
  assert len(Counting.seen) == steps
  for expected_step, (global_step, key) in enumerate(Counting.seen):
    # A host array, as jaxline's first step had: reading it never gathers.
    assert isinstance(global_step, np.ndarray) and global_step.dtype == np.int32
    np.testing.assert_array_equal(global_step, np.full(num_devices, expected_step))
    assert key.shape == (num_devices, 2) and key.dtype == np.uint32
  keys = np.stack([key for _, key in Counting.seen])
  # unique_host_unique_device: no key repeats across steps or devices.
  assert len({tuple(k) for k in keys.reshape(-1, 2)}) == steps * num_devices


class StepsAhead(Counting):
  """Changes its `global_step` in place, as code written for jaxline 0.0.8 may
  (`+=` rebound its device array)."""
  incremented = []

  def step(self, global_step, rng, writer):
    global_step += 1
    StepsAhead.incremented.append(int(global_step[0]))
    return super().step(global_step=global_step, rng=rng, writer=writer)


def test_a_step_may_change_its_global_step_without_changing_the_loops_count():
  config = make_config(training_steps=3)
  StepsAhead.incremented = []
  checkpointer = checkpointing.InMemoryCheckpointer(config, "train")
  train.train(StepsAhead, config, checkpointer, None)
  assert StepsAhead.incremented == [1, 2, 3]
  assert checkpointer.get_experiment_state("latest").global_step == 3


def test_step_keys_are_same_across_devices_in_same_device_mode():
  run_counting(make_config(random_mode_train="same_host_same_device", training_steps=3))
  assert len(Counting.seen) == 3
  for _, key in Counting.seen:
    assert (key == key[0]).all()


def test_train_key_differs_from_init_key_unless_legacy():
  for legacy, should_match in ((False, False), (True, True)):
    chain, init_key = map(np.asarray, rng.seed_keys(42, legacy))
    assert (chain == init_key).all() == should_match


def test_final_checkpoint_holds_step_count_and_state():
  checkpointer = run_counting(make_config(training_steps=7))
  nest = utils.GLOBAL_CHECKPOINT_DICT["latest"].history[-1].pickle_nest
  assert nest["global_step"] == 7
  assert int(nest["experiment_module"]["count"]) == 7
  assert checkpointer.can_be_restored("latest")


def test_periodic_checkpoints_follow_interval_and_max_to_keep():
  run_counting(make_config(training_steps=10, save_checkpoint_interval=3,
                           max_checkpoints_to_keep=2))
  history = utils.GLOBAL_CHECKPOINT_DICT["latest"].history
  # Saved at 3, 6, 9 and the final 10; only the last two are kept.
  assert [s.pickle_nest["global_step"] for s in history] == [9, 10]
  assert [s.id for s in history] == [2, 3]


@pytest.mark.parametrize("interval", [0, -1])
def test_a_save_interval_of_0_or_below_saves_at_the_end_only_as_in_jaxline(interval):
  """Published configs (c3_neural_compression) set -1 for that; it was refused."""
  config = make_config(training_steps=5, save_checkpoint_interval=interval)
  base_config.validate_config(config)  # What platform.main runs first.
  run_counting(config)
  history = utils.GLOBAL_CHECKPOINT_DICT["latest"].history
  assert [s.pickle_nest["global_step"] for s in history] == [5]


def test_initial_checkpoint_saved_when_asked():
  run_counting(make_config(training_steps=2, save_initial_train_checkpoint=True,
                           max_checkpoints_to_keep=5))
  steps = [s.pickle_nest["global_step"]
           for s in utils.GLOBAL_CHECKPOINT_DICT["latest"].history]
  assert steps == [0, 2]


def test_initial_checkpoint_not_saved_again_by_a_run_resuming_it():
  # As jaxline: only when nothing can be restored.
  config = make_config(training_steps=0, save_initial_train_checkpoint=True,
                       max_checkpoints_to_keep=5)
  run_counting(config)
  config.training_steps = 2
  run_counting(config)
  steps = [s.pickle_nest["global_step"]
           for s in utils.GLOBAL_CHECKPOINT_DICT["latest"].history]
  assert steps == [0, 2]


def test_resume_continues_step_count_and_rng_chain():
  config = make_config(training_steps=6)
  run_counting(config)
  uninterrupted_keys = [key for _, key in Counting.seen]

  utils.GLOBAL_CHECKPOINT_DICT.clear()
  run_counting(make_config(training_steps=3))
  first_half = [key for _, key in Counting.seen]
  run_counting(config)  # Restores `latest` (step 3) and runs steps 3..5.
  second_half = [(int(gs[0]), key) for gs, key in Counting.seen]
  assert [s for s, _ in second_half] == [3, 4, 5]
  np.testing.assert_array_equal(first_half + [k for _, k in second_half], uninterrupted_keys)
  nest = utils.GLOBAL_CHECKPOINT_DICT["latest"].history[-1].pickle_nest
  assert int(nest["experiment_module"]["count"]) == 6


def test_no_checkpoints_from_non_chief_unless_all_hosts(monkeypatch):
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  run_counting(make_config(training_steps=2))
  no_series = checkpointing.CheckpointNT(None, [])
  assert not utils.GLOBAL_CHECKPOINT_DICT.get("latest", no_series).history
  run_counting(make_config(training_steps=2, train_checkpoint_all_hosts=True))
  assert utils.GLOBAL_CHECKPOINT_DICT["latest"].history


def test_writer_gets_scalars_at_interval_and_final_step():
  writer = Recorder()
  run_counting(make_config(training_steps=7, log_train_data_interval=3), writer)
  assert [step for step, _ in writer.scalars] == [3, 6, 7]
  assert [s["count"] for _, s in writer.scalars] == [3, 6, 7]
  # Every row, the first too, as in jaxline: writers written for it read the rate.
  assert all(s["steps_per_sec"] > 0 for _, s in writer.scalars)


class LogsOneValuePerDevice(Counting):
  """Values copied per device that are no pmap outputs: `global_step` itself
  and a schedule computed from it (on one device), as published steps return."""

  def step(self, global_step, rng, writer):
    super().step(global_step, rng, writer)
    return {"step": global_step, "lr": optax.cosine_decay_schedule(1.0, 10)(global_step),
            "nan": jnp.full(jax.local_device_count(), jnp.nan, jnp.bfloat16)}


def test_values_copied_per_device_are_logged_as_one(caplog):
  writer = Recorder()
  config = make_config(training_steps=2, log_train_data_interval=1, non_finite_policy="off")
  train.train(LogsOneValuePerDevice, config, checkpointing.InMemoryCheckpointer(config, "train"),
              writer)
  assert [(s["step"], s["lr"]) for _, s in writer.scalars] == [
      (0, 1.0), (1, pytest.approx(0.97552824))]


def test_eagerly_a_device_vector_may_be_per_device_but_a_host_one_is_still_read(monkeypatch):
  monkeypatch.setattr(debugging, "pmap_jit_disabled", lambda: True)
  assert scalars._scalar_problem("loss", jnp.arange(4.0)) is None  # chex's vmap of a pmap output
  assert "a vector" in scalars._scalar_problem("per_class", np.arange(4.0))


def test_a_non_chief_process_writes_to_the_writer_given_only_with_log_all_hosts(monkeypatch):
  """As jaxline's train: the write action is the chief's unless `log_all_hosts`."""
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  writer = Recorder()
  run_counting(make_config(training_steps=4, log_train_data_interval=2), writer)
  assert writer.scalars == []
  run_counting(make_config(training_steps=4, log_train_data_interval=2, log_all_hosts=True),
               writer)
  assert [step for step, _ in writer.scalars] == [2, 4]


def test_log_all_train_data_writes_every_step():
  writer = Recorder()
  run_counting(make_config(training_steps=7, log_train_data_interval=3,
                           log_all_train_data=True), writer)
  assert [step for step, _ in writer.scalars] == list(range(1, 8))
  assert [s["count"] for _, s in writer.scalars] == list(range(1, 8))


class Donating(experiment.AbstractExperiment):
  """Donates its params every step, and keeps running after a checkpoint."""
  CHECKPOINT_ATTRS = {"_params": "params"}

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._params = utils.bcast_local_devices({"w": jnp.zeros((4,))})
    self._update = jax.pmap(lambda p: jax.tree.map(lambda x: x + 1.0, p), donate_argnums=0)

  def step(self, **unused_kwargs):
    self._params = self._update(self._params)
    return {}

  def evaluate(self, **unused_kwargs):
    return {}


def test_snapshot_unaffected_by_donation_and_later_steps():
  config = make_config(training_steps=9, save_checkpoint_interval=4, max_checkpoints_to_keep=5)
  train.train(Donating, config, checkpointing.InMemoryCheckpointer(config, "train"), None)
  history = utils.GLOBAL_CHECKPOINT_DICT["latest"].history
  assert [snapshot.pickle_nest["global_step"] for snapshot in history] == [4, 8, 9]
  for snapshot in history:
    step = snapshot.pickle_nest["global_step"]
    np.testing.assert_array_equal(snapshot.pickle_nest["experiment_module"]["params"]["w"],
                                  np.full((4,), float(step)))


class KeywordVariants(experiment.AbstractExperiment):
  """Declares exactly the keywords, keyword-only, and evaluate with **unused."""
  calls = 0

  def step(self, *, global_step, rng, writer):
    KeywordVariants.calls += 1
    return {}

  def evaluate(self, global_step, **unused):
    return None  # Tolerated, with a warning.


class OnlyGlobalStep(KeywordVariants):

  def step(self, global_step):  # Declares only what it uses, no **kwargs.
    KeywordVariants.calls += 1
    return {}


@pytest.mark.parametrize("cls", [KeywordVariants, OnlyGlobalStep])
def test_step_signature_variants(cls):
  KeywordVariants.calls = 0
  config = make_config(training_steps=3)
  checkpointer = checkpointing.InMemoryCheckpointer(config, "train")
  train.train(cls, config, checkpointer, None)
  assert KeywordVariants.calls == 3
  train.evaluate(cls, config, checkpointer, None, jaxline_mode="eval")


class EpochBased(Counting):
  """Stops by its own rule, with `training_steps=None`."""

  def should_run_step(self, global_step, config):
    assert isinstance(global_step, int)
    return global_step < 4


def test_should_run_step_override_ends_training():
  Counting.seen = []
  config = make_config(training_steps=None)
  train.train(EpochBased, config, checkpointing.InMemoryCheckpointer(config, "train"), None)
  assert len(Counting.seen) == 4


def test_training_steps_none_without_an_override_is_one_line_naming_the_key():
  config = make_config(training_steps=None)
  with pytest.raises(base_config.ConfigError, match="config.training_steps=None, but Counting "
                     "does not override should_run_step") as raised:
    train.train(Counting, config, checkpointing.InMemoryCheckpointer(config, "train"), None)
  assert isinstance(raised.value, errors.OneLineError)


class TypoInAttrs(Counting):
  CHECKPOINT_ATTRS = {"_count": "count", "_cuont": "typo"}


class HostIntInAttrs(Counting):
  CHECKPOINT_ATTRS = {"_count": "count", "_epoch": "epoch"}
  _epoch = 0


class BuiltInStep(Counting):
  """A checkpointed attribute left None by __init__ and built by the first step."""
  CHECKPOINT_ATTRS = {"_count": "count", "_later": "later"}

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._later = None

  def step(self, global_step, rng, writer):
    self._later = jnp.copy(self._count)  # `step` donates `_count`.
    return super().step(global_step, rng, writer)


@pytest.mark.parametrize("experiment_class, culprit", [
    (TypoInAttrs, "TypoInAttrs.CHECKPOINT_ATTRS names '_cuont', which TypoInAttrs does not have"),
    (HostIntInAttrs, "HostIntInAttrs.CHECKPOINT_ATTRS entry '_epoch' holds int 0, which has "
                     "no device axis"),
])
def test_checkpoint_attrs_that_cannot_be_saved_stop_the_run_after_its_first_step(
    experiment_class, culprit):
  # The first save would come at step 1000, or at the end of the whole run.
  Counting.seen = []
  config = make_config(training_steps=50)
  with pytest.raises(experiment.CheckpointAttrsError, match=culprit) as raised:
    train.train(experiment_class, config, checkpointing.InMemoryCheckpointer(config, "train"),
                None)
  assert isinstance(raised.value, errors.OneLineError) and len(Counting.seen) == 1
  with pytest.raises(experiment.CheckpointAttrsError, match=culprit):
    experiment_class("train", jax.random.PRNGKey(0)).snapshot_state()  # Every save says so too.


class OneNameForTwoAttrs(Counting):
  CHECKPOINT_ATTRS = {"_count": "count"}
  NON_BROADCAST_CHECKPOINT_ATTRS = {"_total": "count"}
  _total = np.zeros(2)


def test_two_attributes_under_one_checkpoint_name_stop_the_run_after_its_first_step():
  """The snapshot kept one of them, and a restore gave both attributes its value."""
  Counting.seen = []
  config = make_config(training_steps=50)
  with pytest.raises(experiment.CheckpointAttrsError,
                     match="OneNameForTwoAttrs gives the checkpoint name 'count' to both "
                           "'_count' and '_total'") as raised:
    train.train(OneNameForTwoAttrs, config,
                checkpointing.InMemoryCheckpointer(config, "train"), None)
  assert isinstance(raised.value, errors.OneLineError) and len(Counting.seen) == 1


def test_a_resumed_run_describes_the_state_it_restored(caplog):
  config = make_config(training_steps=2)
  checkpointer = checkpointing.InMemoryCheckpointer(config, "train")
  train.train(BuiltInStep, config, checkpointer, None)
  caplog.set_level("INFO", logger="absl")  # Another test may have set absl's own level.
  config.training_steps = 3
  train.train(BuiltInStep, config, checkpointer, None)
  assert "Checkpointed state: count: 1 values, 4 bytes; later: 1 values, 4 bytes" in caplog.text
  assert "not built yet" not in caplog.text


def test_a_run_resumed_where_its_training_ends_says_there_is_no_step_to_train(caplog):
  config = make_config(training_steps=4)
  run_counting(config)
  config.training_steps = 2  # Lowered below the step saved: nothing to do.
  run_counting(config)
  assert Counting.seen == []
  assert ("Restored step 4, where this run's training ends (training_steps=2): no step to "
          "train.") in caplog.text


def test_a_best_metric_evaluate_never_returns_names_what_it_returned():
  with pytest.raises(base_config.ConfigError, match=r"returned: none \(None or an empty dict\)$"):
    best.check_best_metric(make_config(best_model_eval_metric="accuracy"), {})  # pylint: disable=protected-access


class OneDeviceInAttrs(Counting):
  """Rows that look per-device, never placed on the devices: saving the first
  device's copy would keep one row of four."""
  CHECKPOINT_ATTRS = {"_count": "count", "_stats": "stats"}

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._stats = jnp.arange(jax.local_device_count() * 3.0).reshape(-1, 3)


class OtherLeadingAxisInAttrs(OneDeviceInAttrs):

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._stats = np.zeros((jax.local_device_count() + 1, 3))


class CopiesOnOneDevice(Counting):
  """Equal rows kept on one device (`jnp.broadcast_to`): the first is all of
  them, as jaxline saved it."""
  CHECKPOINT_ATTRS = {"_count": "count", "_stats": "stats"}

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._stats = jnp.broadcast_to(jnp.arange(3.0), (jax.local_device_count(), 3))


def test_checkpoint_attrs_of_equal_rows_on_one_device_are_saved():
  config = make_config(training_steps=2)
  train.train(CopiesOnOneDevice, config, checkpointing.InMemoryCheckpointer(config, "train"),
              None)
  saved = utils.GLOBAL_CHECKPOINT_DICT["latest"].history[-1].pickle_nest["experiment_module"]
  np.testing.assert_array_equal(saved["stats"], np.arange(3.0))


class PerDeviceStatsInAttrs(Counting):
  """State that differs per device, laid out as a pmap output (BatchNorm
  statistics a published ResNet does not average over devices)."""
  CHECKPOINT_ATTRS = {"_count": "count", "_stats": "stats"}

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._stats = utils.bcast_local_devices(jnp.zeros(3))
    self._stats = jax.pmap(lambda x: x + jax.lax.axis_index("i"), axis_name="i")(self._stats)


def test_checkpoint_attrs_that_differ_per_device_save_the_first_devices_with_a_warning(caplog):
  # jaxline saved `get_first` of such state without a word (nfnets' ResNet
  # BatchNorm state), so a resumed run was silently not exact.
  config = make_config(training_steps=2)
  train.train(PerDeviceStatsInAttrs, config, checkpointing.InMemoryCheckpointer(config, "train"),
              None)
  saved = utils.GLOBAL_CHECKPOINT_DICT["latest"].history[-1].pickle_nest["experiment_module"]
  np.testing.assert_array_equal(saved["stats"], np.zeros(3))
  warnings = [r.getMessage() for r in caplog.records if "differs between devices" in r.getMessage()]
  assert warnings == ["[jaxline_ng] CHECKPOINT_ATTRS entry '_stats' differs between devices after "
                      "the first step: checkpoints keep device 0's copy (as jaxline's did), so a "
                      "resumed run is not exact. Average it over devices (haiku's BatchNorm: "
                      "cross_replica_axis) or list it in NON_BROADCAST_CHECKPOINT_ATTRS."]
  caplog.clear()
  utils.GLOBAL_CHECKPOINT_DICT.clear()
  train.train(CopiesOnOneDevice, config, checkpointing.InMemoryCheckpointer(config, "train"), None)
  assert "differs between devices" not in caplog.text


class StatsDifferFromTheSecondStep(Counting):
  """Per-device state the devices bring together every few steps, equal after
  the first (K-FAC's curvature estimates)."""
  CHECKPOINT_ATTRS = {"_count": "count", "_stats": "stats"}

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)
    self._stats = utils.bcast_local_devices(jnp.zeros(3))
    self._drift = jax.pmap(lambda x: x + jax.lax.axis_index("i"), axis_name="i")

  def step(self, global_step, rng, writer):
    if int(utils.get_first(global_step)) >= 1:
      self._stats = self._drift(self._stats)
    return super().step(global_step, rng, writer)


def test_checkpoint_attrs_that_differ_only_after_the_first_step_are_warned_of_at_the_first_save(
    caplog):
  config = make_config(training_steps=6, save_checkpoint_interval=2)
  train.train(StatsDifferFromTheSecondStep, config,
              checkpointing.InMemoryCheckpointer(config, "train"), None)
  warnings = [r.getMessage() for r in caplog.records if "differs between devices" in r.getMessage()]
  assert len(warnings) == 1, warnings  # Once, not at every save.
  assert warnings[0].startswith("[jaxline_ng] CHECKPOINT_ATTRS entry '_stats' differs between "
                                "devices at the first save (step 2): "), warnings


@pytest.mark.parametrize("experiment_class, shape", [
    (OneDeviceInAttrs, "(4, 3)"), (OtherLeadingAxisInAttrs, "(5, 3)")])
def test_checkpoint_attrs_not_one_copy_per_device_stop_the_run_after_its_first_step(
    experiment_class, shape):
  Counting.seen = []
  config = make_config(training_steps=50)
  with pytest.raises(experiment.CheckpointAttrsError,
                     match=rf"entry '_stats' holds an array of shape \{shape[:-1]}\) that is "
                           r"not one copy per local device \(4\)") as raised:
    train.train(experiment_class, config, checkpointing.InMemoryCheckpointer(config, "train"),
                None)
  assert isinstance(raised.value, errors.OneLineError) and len(Counting.seen) == 1


def test_a_checkpointed_attribute_built_by_the_first_step_is_saved():
  config = make_config(training_steps=2)
  checkpointer = checkpointing.InMemoryCheckpointer(config, "train")
  train.train(BuiltInStep, config, checkpointer, None)
  assert set(utils.GLOBAL_CHECKPOINT_DICT["latest"].history[-1].pickle_nest[
      "experiment_module"]) == {"count", "later"}


class Traced(experiment.AbstractExperiment):
  traces = 0

  def __init__(self, mode, init_rng):
    super().__init__(mode, init_rng)

    def update(x, global_step, key):
      Traced.traces += 1
      return x + global_step + jax.random.uniform(key)

    self._update = jax.pmap(update, axis_name="i")
    self._x = utils.bcast_local_devices(jnp.zeros(()))

  def step(self, global_step, rng, writer):
    self._x = self._update(self._x, global_step, rng)
    return {"x": utils.get_first(self._x)}

  def evaluate(self, **unused):
    return {}


def test_step_compiles_once_over_many_steps():
  Traced.traces = 0
  config = make_config(training_steps=40, log_tensors_interval=7, save_checkpoint_interval=9)
  train.train(Traced, config, checkpointing.InMemoryCheckpointer(config, "train"), None)
  compiled_advances = rng._split_step.jitted._cache_size()  # pylint: disable=protected-access
  Traced.traces = 0
  utils.GLOBAL_CHECKPOINT_DICT.clear()
  train.train(Traced, config, checkpointing.InMemoryCheckpointer(config, "train"), Recorder())
  assert Traced.traces == 1  # The user's step: once per experiment instance.
  assert rng._split_step.jitted._cache_size() == compiled_advances  # Ours: never again.


class Failing(Counting):

  def step(self, global_step, rng, writer):
    if int(utils.get_first(global_step)) == 2:
      raise RuntimeError("boom at step 2")
    return super().step(global_step, rng, writer)


def test_multithreaded_training_error_stops_evaluation_and_is_raised():
  config = make_config(training_steps=50, save_checkpoint_interval=1)
  checkpointer = checkpointing.InMemoryCheckpointer(config, "train")
  finished = threading.Event()
  errors = []

  def run():
    try:
      train.train_eval_multithreaded(Failing, config, checkpointer, None)
    except RuntimeError as e:
      errors.append(e)
    finally:
      finished.set()

  threading.Thread(target=run, daemon=True).start()
  assert finished.wait(timeout=60), "train_eval_multithreaded hung after a training error"
  assert errors and "boom at step 2" in str(errors[0])


class FailsDuringFirstEvaluation(Counting):
  """Training fails at step 5 while the first evaluation (minutes, in a real run) is running."""
  evaluated = []

  def step(self, global_step, rng, writer):
    step = int(utils.get_first(global_step))
    deadline = time.monotonic() + 30
    while step == 2 and not FailsDuringFirstEvaluation.evaluated and time.monotonic() < deadline:
      time.sleep(0.01)
    if step == 5:
      raise RuntimeError("boom at step 5")
    return super().step(global_step, rng, writer)

  def evaluate(self, global_step, rng, writer):
    FailsDuringFirstEvaluation.evaluated.append(int(utils.get_first(global_step)))
    deadline = time.monotonic() + 30
    while (any(t.name == "jaxline_ng_train" for t in threading.enumerate())
           and time.monotonic() < deadline):
      time.sleep(0.01)
    return super().evaluate(global_step, rng, writer)


def test_multithreaded_training_error_ends_evaluation_after_the_one_in_progress():
  FailsDuringFirstEvaluation.evaluated = []
  config = make_config(training_steps=50, save_checkpoint_interval=1)
  with pytest.raises(RuntimeError, match="boom at step 5"):
    train.train_eval_multithreaded(FailsDuringFirstEvaluation, config,
                                   checkpointing.InMemoryCheckpointer(config, "train"), None)
  # Not also the newer checkpoints saved before the failure: an evaluation
  # can take hours, and the run has failed.
  assert len(FailsDuringFirstEvaluation.evaluated) == 1, FailsDuringFirstEvaluation.evaluated
  assert not preemption.stop_requested()


class EndsInShouldRunStep(Counting):
  def should_run_step(self, global_step, config):
    return global_step < 3


@pytest.mark.parametrize("experiment_class, training_steps, progress, eta", [
    (Counting, 5, "step 5/5 (100.0%)", True),
    (EndsInShouldRunStep, 10000, "step 3,", False)])  # jaxline's default, never reached.
def test_progress_shows_a_total_only_where_training_steps_ends_the_run(
    experiment_class, training_steps, progress, eta, caplog):
  config = make_config(training_steps=training_steps, log_tensors_interval=1)
  with caplog.at_level("INFO", logger="absl"):
    train.train(experiment_class, config, checkpointing.InMemoryCheckpointer(config, "train"), None)
  last = [line for line in caplog.messages if line.startswith("[jaxline_ng] step ")][-1]
  assert last.startswith(f"[jaxline_ng] {progress}") and ("ETA" in last) == eta, last


def test_the_first_progress_line_gives_no_eta_from_a_rate_that_includes_compiling(caplog):
  config = make_config(training_steps=5, log_tensors_interval=1)
  with caplog.at_level("INFO", logger="absl"):
    train.train(Counting, config, checkpointing.InMemoryCheckpointer(config, "train"), None)
  lines = [line for line in caplog.messages if line.startswith("[jaxline_ng] step ")]
  assert "steps/s" in lines[0] and "ETA" not in lines[0], lines[0]
  assert len(lines) > 1 and all("ETA" in line for line in lines[1:]), lines


def test_an_action_failing_leaves_the_rows_of_the_steps_run_written_before_the_writer_closes(
    caplog):
  def fails(step, scalars):
    if step == 10:
      raise RuntimeError("a user's action fails at step 10")

  recorder = Recorder()
  writer = writers.AsyncWriter(recorder)
  config = make_config(training_steps=100000, log_train_data_interval=1)
  with pytest.raises(RuntimeError, match="fails at step 10"):
    run_counting(config, writer, [periodic.PeriodicAction(fails, "steps", 1)])
  writer.close()  # As the platform does next.
  steps = [step for step, _ in recorder.scalars]
  assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 10
  assert "closed AsyncWriter" not in caplog.text


class StopsAtFirstEvaluation(Counting):
  evaluated = []

  def evaluate(self, global_step, rng, writer):
    step = int(utils.get_first(global_step))
    StopsAtFirstEvaluation.evaluated.append(step)
    if len(StopsAtFirstEvaluation.evaluated) == 1:
      preemption.request_stop("a test")
      # An evaluation takes minutes: the trainer stops and saves meanwhile.
      deadline = time.monotonic() + 30
      latest = utils.GLOBAL_CHECKPOINT_DICT["latest"].history
      while latest[-1].pickle_nest.global_step <= step and time.monotonic() < deadline:
        time.sleep(0.01)
    return super().evaluate(global_step, rng, writer)


def test_multithreaded_evaluator_stops_after_the_evaluation_in_progress():
  StopsAtFirstEvaluation.evaluated = []
  config = make_config(training_steps=10**9, save_checkpoint_interval=5)
  with pytest.raises(preemption.Preempted):
    train.train_eval_multithreaded(StopsAtFirstEvaluation, config,
                                   checkpointing.InMemoryCheckpointer(config, "train"), None)
  # Not the checkpoint the stopped trainer saved next: it is for the rerun.
  assert len(StopsAtFirstEvaluation.evaluated) == 1
  assert not preemption.stop_requested()  # Served: a later run starts afresh.


class ModeRecording(Counting):
  modes = []

  def __init__(self, mode, init_rng):
    ModeRecording.modes.append(mode)
    super().__init__(mode, init_rng)


def test_multithreaded_constructs_eval_experiment_with_its_mode():
  ModeRecording.modes = []
  config = make_config(training_steps=4, save_checkpoint_interval=2)
  eval_writer = Recorder()
  train.train_eval_multithreaded(ModeRecording, config,
                                 checkpointing.InMemoryCheckpointer(config, "train"), None,
                                 eval_writer=eval_writer)
  assert sorted(ModeRecording.modes) == ["train", "train_eval_multithreaded"]
  # The evaluator ends on the final checkpoint.
  assert eval_writer.scalars[-1] == (4, {"count": 4})


def test_a_multithreaded_rerun_from_step_0_sets_both_writers_earlier_rows_aside(tmp_path):
  # A rerun whose checkpoints are gone (here: in memory, a new process).
  config = make_config(training_steps=4, save_checkpoint_interval=2, log_train_data_interval=1)
  logs = {mode: tmp_path / mode / "metrics.jsonl" for mode in ("train", "eval")}
  earlier = {mode: b'{"step": 4, "count": 4}\n' for mode in logs}
  for mode, path in logs.items():
    path.parent.mkdir()
    path.write_bytes(earlier[mode])
  writers_ = {mode: writers.JsonlWriter(str(path)) for mode, path in logs.items()}
  train.train_eval_multithreaded(ModeRecording, config,
                                 checkpointing.InMemoryCheckpointer(config, "train"),
                                 writers_["train"], eval_writer=writers_["eval"])
  for mode, path in logs.items():
    writers_[mode].close()
    aside = [p for p in path.parent.iterdir() if p.name.startswith("metrics.jsonl.")]
    assert [p.read_bytes() for p in aside] == [earlier[mode]], mode
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 4, (mode, steps)  # No duplicates.


class RacingCheckpointer:
  """Polls see checkpoints 1, 2, 3, but the save of 2 lands between the first
  poll and its `restore`, as a trainer in another process can make it: the
  restores load 2, 2, 3."""
  POLLED_STEPS = [1, 2, 3]
  RESTORED_STEPS = [2, 2, 3]

  def __init__(self):
    self._state = ml_collections.ConfigDict()
    self._polls = 0

  def get_experiment_state(self, ckpt_series):
    return self._state

  def restore_path(self, ckpt_series):
    self._polls += 1
    return f"step_{self.POLLED_STEPS[self._polls - 1]}"

  def can_be_restored(self, ckpt_series):
    return True

  def restore(self, ckpt_series):
    self._state.global_step = self.RESTORED_STEPS[self._polls - 1]

  def wait_for_checkpointing_to_finish(self):
    pass


def test_evaluator_evaluates_each_step_once_when_saves_race_its_polls():
  writer = Recorder()
  train.evaluate(Counting, make_config(training_steps=3), RacingCheckpointer(), writer,
                 jaxline_mode="eval", poll_interval_secs=0)
  assert [step for step, _ in writer.scalars] == [2, 3]


class LiveSnapshot(Donating):
  """Overrides snapshot_state to hand back the live (soon donated) arrays."""

  def snapshot_state(self):
    return {"params": self._params}

  def restore_from_snapshot(self, snapshot_state):
    self._params = snapshot_state["params"]


def test_overridden_snapshot_state_is_copied_before_donation():
  config = make_config(training_steps=9, save_checkpoint_interval=4, max_checkpoints_to_keep=5)
  train.train(LiveSnapshot, config, checkpointing.InMemoryCheckpointer(config, "train"), None)
  history = utils.GLOBAL_CHECKPOINT_DICT["latest"].history
  assert [snapshot.pickle_nest["global_step"] for snapshot in history] == [4, 8, 9]
  for snapshot in history:
    step = snapshot.pickle_nest["global_step"]
    np.testing.assert_array_equal(snapshot.pickle_nest["experiment_module"]["params"]["w"],
                                  np.full((jax.local_device_count(), 4), float(step)))


def test_describe_state_counts_one_copy_of_replicated_state():
  module = Donating("train", None)
  assert experiment.describe_state(module) == "params: 4 values, 16 bytes"
  module._params = None  # pylint: disable=protected-access  (built by the first step)
  assert experiment.describe_state(module) == "params: not built yet"
  module._params = 12  # pylint: disable=protected-access  (physics_inspired_models' step count)
  assert experiment.describe_state(module) == "params: 12"


class DonatingNonBroadcast(Donating):
  """`Donating` with its donated params in NON_BROADCAST_CHECKPOINT_ATTRS."""
  CHECKPOINT_ATTRS = {}
  NON_BROADCAST_CHECKPOINT_ATTRS = {"_params": "params"}


def test_non_broadcast_device_arrays_are_snapshotted_before_donation():
  module = DonatingNonBroadcast("train", None)
  module.step()
  snapshot = module.snapshot_state()
  module.step()  # Donates (deletes) the array the snapshot was taken from.
  np.testing.assert_array_equal(snapshot["params"]["w"], np.ones((jax.local_device_count(), 4)))
