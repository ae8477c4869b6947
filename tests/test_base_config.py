"""The base config: jaxline's keys and defaults, and what validation rejects."""

import pytest
from absl import flags
from ml_collections import config_dict, config_flags

from jaxline_ng import base_config

JAXLINE_KEYS = (
    "training_steps", "interval_type", "save_checkpoint_interval", "log_tensors_interval",
    "log_train_data_interval", "periodic_action_growth_ratios", "log_async", "log_all_hosts",
    "logging_interval_type", "checkpoint_interval_type", "save_initial_train_checkpoint",
    "train_checkpoint_all_hosts", "best_checkpoint_all_hosts", "log_all_train_data",
    "eval_initial_weights", "one_off_evaluate", "max_checkpoints_to_keep", "random_seed",
    "random_mode_train", "random_mode_eval", "legacy_random_seed_behavior",
    "best_model_eval_metric", "best_model_eval_metric_higher_is_better", "experiment_kwargs",
    "checkpoint_dir")


def test_has_every_jaxline_key():
  config = base_config.get_base_config()
  for key in JAXLINE_KEYS:
    assert key in config, key
  base_config.validate_config(config)


def test_extra_keys_field_references_and_lock_are_fine():
  config = base_config.get_base_config()
  steps = config_dict.FieldReference(100)
  config.training_steps = steps
  config.my_own_key = "anything"
  config.experiment_kwargs = config_dict.ConfigDict({"config": {"total": steps}})
  config.lock()
  base_config.validate_config(config)
  steps.set(7)
  assert config.training_steps == 7 and config.experiment_kwargs.config.total == 7


def test_a_config_with_only_jaxlines_keys_takes_the_defaults_of_the_others():
  """A config written for jaxline 0.0.8 without its get_base_config(), locked as some are."""
  base = base_config.get_base_config()
  config = config_dict.ConfigDict({key: base[key] for key in base
                                   if key not in base_config.KEYS_BEYOND_JAXLINE})
  config.lock()
  base_config.validate_config(config)
  assert config.to_dict() == base.to_dict()
  config.compilation_cache_dir = "/cache"  # Still a typed placeholder.
  with pytest.raises(TypeError):
    config.compilation_cache_dir = 3


def test_keys_that_default_to_none_are_settable_from_the_command_line(monkeypatch):
  argv = ["prog", "--config.checkpoint_interval_type=secs", "--config.logging_interval_type=steps",
          "--config.periodic_action_growth_ratios=(1, 2, 5)"]
  monkeypatch.setattr("sys.argv", argv)  # ml_collections reads the overrides from sys.argv.
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_dict("config", base_config.get_base_config(),
                                  flag_values=flag_values)
  flag_values(argv)
  config = flag_values.config
  assert (config.checkpoint_interval_type, config.logging_interval_type) == ("secs", "steps")
  assert config.periodic_action_growth_ratios == (1, 2, 5)
  base_config.validate_config(config)


def test_interval_type_may_be_none_when_both_overrides_are_set():
  """kfac-jax's configs: jaxline used `specific or interval_type`, so None is unused there."""
  config = base_config.get_base_config()
  config.interval_type = None
  config.logging_interval_type = "steps"
  config.checkpoint_interval_type = "steps"
  base_config.validate_config(config)
  config.checkpoint_interval_type = None
  with pytest.raises(base_config.ConfigError, match="config.interval_type=None"):
    base_config.validate_config(config)


def test_missing_base_key_is_named():
  config = base_config.get_base_config()
  del config["random_mode_eval"]
  with pytest.raises(base_config.ConfigError, match="'random_mode_eval'"):
    base_config.validate_config(config)


@pytest.mark.parametrize("key,value,culprit", [
    ("random_mode_train", "unique_world", "random_mode_train"),
    ("interval_type", "hours", "interval_type"),
    ("checkpoint_interval_type", "epochs", "checkpoint_interval_type"),
    ("training_steps", -1, "training_steps"),
    ("max_checkpoints_to_keep", 0, "max_checkpoints_to_keep"),
    ("checkpointer", "cloud", "checkpointer"),
    ("save_checkpoint_interval", None, "save_checkpoint_interval"),
    ("log_tensors_interval", -1, "log_tensors_interval"),
    ("log_train_data_interval", -0.5, "log_train_data_interval"),
    ("eval_poll_interval_secs", -1, "eval_poll_interval_secs"),  # A waiting job would spin.
    ("eval_poll_interval_secs", 0, "eval_poll_interval_secs"),
    ("random_seed", 10**20, "random_seed"),  # jax.random.PRNGKey overflowed.
    ("random_seed", None, "random_seed"),
    # What `--config.<key>=None` gives these keys: not a None.
    ("periodic_action_growth_ratios", (None,), "periodic_action_growth_ratios"),
    ("compilation_cache_dir", "None", "compilation_cache_dir"),
])
def test_malformed_values_name_the_key(key, value, culprit):
  config = base_config.get_base_config()
  config[key] = value
  with pytest.raises(base_config.ConfigError, match=f"config.{culprit}="):
    base_config.validate_config(config)


@pytest.mark.parametrize("key,value", [
    # Strings are truthy: "no" turned these on, and higher_is_better="no" kept the worst.
    ("one_off_evaluate", "no"), ("best_model_eval_metric_higher_is_better", "False"),
    ("tensorboard", "False"), ("save_initial_train_checkpoint", "no"), ("log_async", 2),
    ("best_model_eval_metric", 5),  # Matched no scalar name: no best series, unsaid.
    ("training_steps", True),  # Trained one step.
    # TypeErrors with a traceback, the last at the first save after training.
    ("max_checkpoints_to_keep", "5"), ("max_checkpoints_to_keep", 2.5),
    ("wall_clock_budget_secs", "100"), ("step_timeout_secs", "100"),
])
def test_values_of_the_wrong_type_in_an_untyped_config_name_the_key(key, value):
  """A plain dict config (or a ConfigDict built by hand) takes any type."""
  config = config_dict.ConfigDict({**base_config.get_base_config().to_dict(), key: value})
  with pytest.raises(base_config.ConfigError, match=f"config.{key}={value!r} "):
    base_config.validate_config(config)


@pytest.mark.parametrize("key,value", [
    ("log_async", 0), ("one_off_evaluate", None), ("tensorboard", 1),
    ("best_model_eval_metric", None), ("wall_clock_budget_secs", 60),
    ("step_timeout_secs", 0), ("max_checkpoints_to_keep", 3)])
def test_values_whose_meaning_is_plain_are_accepted_as_jaxline_took_them(key, value):
  config = config_dict.ConfigDict({**base_config.get_base_config().to_dict(), key: value})
  base_config.validate_config(config)


def test_zero_and_none_intervals_keep_their_jaxline_meaning():
  config = base_config.get_base_config()
  config.save_checkpoint_interval = 0  # Only the final save.
  config.log_train_data_interval = None  # No writing.
  config.log_tensors_interval = None
  base_config.validate_config(config)


def test_a_zero_logging_interval_is_every_step_in_seconds_and_refused_in_steps():
  config = base_config.get_base_config()
  config.log_train_data_interval = 0
  base_config.validate_config(config)
  config.logging_interval_type = "steps"
  with pytest.raises(base_config.ConfigError,
                     match="config.log_train_data_interval=0 with step intervals: 1 logs every "
                           "step, None never"):
    base_config.validate_config(config)


@pytest.mark.parametrize("ratios,accepted", [
    ((1, 2, 5, 10), True),  # jaxline's base_config gives this example.
    ((1, 2, 5), True),
    ((0.5, 2), False),  # Never acts: each decade scales ratios from [1, 10).
    ((20,), False),
    ((), False),
])
def test_growth_ratios_accept_jaxlines_example_and_refuse_ones_that_never_act(ratios, accepted):
  config = base_config.get_base_config()
  config.interval_type = "steps"
  config.periodic_action_growth_ratios = ratios
  if accepted:
    base_config.validate_config(config)
  else:
    with pytest.raises(base_config.ConfigError, match="config.periodic_action_growth_ratios="):
      base_config.validate_config(config)


def test_restore_path_with_in_memory_checkpoints_is_left_to_the_experiment():
  """Published experiments define restore_path for restores of their own."""
  config = base_config.get_base_config()
  config.restore_path = "/runs/previous"
  base_config.validate_config(config)  # No error: jaxline_ng reads it only from disk.


def test_jaxlines_validate_keys_names_the_missing_key_at_any_depth():
  base = base_config.get_base_config()
  config = base_config.get_base_config()
  base_config.validate_keys(base, config)
  base.experiment_kwargs = config_dict.ConfigDict({"config": {"lr": 0.1}})
  config.experiment_kwargs = config_dict.ConfigDict({"config": {"lr": 0.1, "extra": 1}})
  base_config.validate_keys(base, config)  # Keys beyond the base are fine.
  del config.experiment_kwargs.config["lr"]
  with pytest.raises(ValueError, match="missing the key 'lr'.*my_base.py"):
    base_config.validate_keys(base, config, base_filename="my_base.py")
  config.experiment_kwargs.config.lr = 0.1
  del config["random_seed"]
  with pytest.raises(ValueError, match="missing the key 'random_seed'"):
    base_config.validate_keys(base, config)


@pytest.mark.parametrize("changes, culprit", [
    (dict(train_checkpoint_all_hosts=True), "train_checkpoint_all_hosts"),
    (dict(train_checkpoint_all_hosts=True, interval_type="steps",
          checkpoint_interval_type="secs"), "train_checkpoint_all_hosts"),
    (dict(periodic_action_growth_ratios=(1, 2, 5)), "periodic_action_growth_ratios"),
])
def test_jaxlines_check_constraints_refuses_what_jaxline_refused(changes, culprit):
  config = base_config.get_base_config()
  base_config.check_constraints(config)  # The defaults pass.
  config.update(changes)
  with pytest.raises(ValueError, match=culprit):
    base_config.check_constraints(config)
  config.update(interval_type="steps", checkpoint_interval_type=None)
  base_config.check_constraints(config)


def test_a_mesh_shape_without_mesh_placement_is_warned_of(caplog):
  # It was ignored without a word: the run went on in pmap mode.
  config = base_config.get_base_config()
  base_config.validate_config(config)
  assert "mesh_shape" not in caplog.text
  config.mesh_shape = "data:2"
  base_config.validate_config(config)
  assert ("config.mesh_shape='data:2' is not used: config.placement='pmap' (set "
          "config.placement='mesh' to run on a mesh)") in caplog.text
