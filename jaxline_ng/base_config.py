"""The base configuration every jaxline_ng experiment config starts from.

Keys and defaults are jaxline's; experiment configs add their own keys freely.
"""

import math

import ml_collections
from absl import logging
from ml_collections import config_dict

from jaxline_ng import errors

INTERVAL_TYPES = ("secs", "steps")
CHECKPOINTERS = ("memory", "disk")


def get_base_config() -> ml_collections.ConfigDict:
  """Returns a config with every key the platform reads, set to its default."""
  config = ml_collections.ConfigDict()

  config.random_seed = 42
  # None means "until `should_run_step` says stop" (e.g. epoch-based runs).
  config.training_steps = 10_000
  config.experiment_kwargs = ml_collections.ConfigDict()

  # Periodic actions. `interval_type` applies to every interval unless the
  # specific `*_interval_type` key overrides it.
  config.interval_type = "secs"
  config.save_checkpoint_interval = 300
  config.log_tensors_interval = 60
  # Writing train scalars to TensorBoard/JSONL; None turns it off.
  config.log_train_data_interval = 120.0
  # Typed (still None by default), so that the command line can set them.
  config.logging_interval_type = config_dict.placeholder(str)
  config.checkpoint_interval_type = config_dict.placeholder(str)
  # e.g. (1, 2, 5): also act at steps 1, 2, 5, 10, 20, 50, 100, ... (typed, as above)
  config.periodic_action_growth_ratios = config_dict.placeholder(tuple)
  config.log_all_train_data = False

  # Writers.
  config.log_async = True
  # TensorBoard event files beside metrics.jsonl. False skips importing
  # TensorFlow: seconds of CPU and hundreds of MB in every process.
  config.tensorboard = True
  config.log_all_hosts = False

  # Checkpointing.
  config.checkpoint_dir = "/tmp/jaxline_ng"
  # "memory": jaxline's in-process snapshots; "disk": durable orbax checkpoints.
  config.checkpointer = "memory"
  config.max_checkpoints_to_keep = 5
  config.save_initial_train_checkpoint = False
  config.train_checkpoint_all_hosts = False
  config.best_checkpoint_all_hosts = False
  # A checkpoint directory to start a fresh run from ("" for none).
  config.restore_path = ""
  # JAX's persistent compilation cache: None is JAX's own if set, else
  # <checkpoint_dir>/compilation_cache off CPU; "" turns it off.
  config.compilation_cache_dir = config_dict.placeholder(str)

  # Evaluation.
  config.eval_initial_weights = False
  # How often an evaluator looks for a new checkpoint (jaxline: 10 s).
  config.eval_poll_interval_secs = 10.0
  config.one_off_evaluate = False
  config.eval_specific_checkpoint_dir = ""
  config.best_model_eval_metric = ""
  config.best_model_eval_metric_higher_is_better = True

  # Run safety and insight.
  # What a NaN/Inf training scalar does: "halt", "warn" or "off".
  config.non_finite_policy = "halt"
  # Stop training gracefully (saved, exit code 75) after this many seconds.
  config.wall_clock_budget_secs = config_dict.placeholder(float)
  # End a run no step of which has finished for this long, logging every
  # thread's stack (exit 1): None is 20 x the slowest step, at least 600 s; 0 is off.
  config.step_timeout_secs = config_dict.placeholder(float)
  # (first, stop): record a profiler trace of the steps first..stop-1.
  config.profile_steps = ()
  # Refuse to resume from a checkpoint made with a different config.
  config.strict_resume_config = False
  # Resume without checkpoint entries the experiment no longer has; else refused.
  config.drop_extra_checkpoint_entries = False

  # Where state lives: "pmap" (jaxline's per-device copies) or "mesh" (global
  # arrays on a jax.sharding.Mesh of `mesh_shape`: "name:size,...", -1 = rest).
  config.placement = "pmap"
  config.mesh_shape = "data:-1"

  # Randomness.
  config.random_mode_train = "unique_host_unique_device"
  config.random_mode_eval = "same_host_same_device"
  config.legacy_random_seed_behavior = False

  return config


# Keys jaxline 0.0.8's base config did not have. A config written for jaxline
# without `get_base_config()` lacks them; `validate_config` gives them their defaults.
KEYS_BEYOND_JAXLINE = (
    "tensorboard", "checkpoint_dir", "checkpointer", "restore_path", "compilation_cache_dir",
    "eval_poll_interval_secs", "eval_specific_checkpoint_dir", "non_finite_policy",
    "wall_clock_budget_secs", "step_timeout_secs", "profile_steps", "strict_resume_config",
    "drop_extra_checkpoint_entries", "placement", "mesh_shape")


# The base keys that switch something on or off.
BOOL_KEYS = (
    "log_async", "log_all_hosts", "save_initial_train_checkpoint", "train_checkpoint_all_hosts",
    "best_checkpoint_all_hosts", "log_all_train_data", "eval_initial_weights", "one_off_evaluate",
    "legacy_random_seed_behavior", "best_model_eval_metric_higher_is_better", "tensorboard",
    "strict_resume_config", "drop_extra_checkpoint_entries")


class ConfigError(ValueError, errors.OneLineError):
  """A config that cannot run; the message names the key and the value."""


def validate_keys(base_cfg: ml_collections.ConfigDict, config: ml_collections.ConfigDict,
                  base_filename: str = "base_config.py") -> None:
  """Raises ConfigError if `config` lacks a key of `base_cfg`, nested ones too
  (jaxline's function).

  Args:
    base_cfg: the config whose keys `config` must have.
    config: the config to check.
    base_filename: where `base_cfg` is defined, named in the error.

  Raises:
    ConfigError: naming the first missing key.
  """
  for key in base_cfg.keys():
    if key not in config:
      raise ConfigError(f"config is missing the key {key!r} of its base config ({base_filename})")
    if isinstance(base_cfg[key], config_dict.ConfigDict) and config[key] is not None:
      validate_keys(base_cfg[key], config[key], base_filename)


def check_constraints(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError where jaxline refused a combination of keys (jaxline's
  function; the platform runs `validate_config`).

  Raises:
    ConfigError: naming the keys.
  """
  checkpoint_type = config.checkpoint_interval_type or config.interval_type
  if config.train_checkpoint_all_hosts and checkpoint_type != "steps":
    raise ConfigError(
        f"config.train_checkpoint_all_hosts=True with checkpoints every {checkpoint_type!r}: "
        "every host would save another step; set config.checkpoint_interval_type='steps'")
  if config.periodic_action_growth_ratios is not None and config.interval_type != "steps":
    raise ConfigError(
        f"config.periodic_action_growth_ratios is set with config.interval_type="
        f"{config.interval_type!r}: growth ratios need config.interval_type='steps'")


def add_keys_beyond_jaxline(config: ml_collections.ConfigDict) -> None:
  """Adds the base keys jaxline did not have (`KEYS_BEYOND_JAXLINE`) that
  `config` lacks, with their defaults: a config written for jaxline runs."""
  added = [key for key in KEYS_BEYOND_JAXLINE if key not in config]
  if not added:
    return
  defaults = get_base_config()
  with config.unlocked():
    for key in added:
      config[key] = defaults.get_ref(key)
  logging.info("[jaxline_ng] The config has no %s (keys jaxline did not have): "
               "using their defaults.", ", ".join(added))


def _is_int(value) -> bool:
  """An int, not a bool (which is an int to Python)."""
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
  """An int or float, not a bool."""
  return _is_int(value) or isinstance(value, float)


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError naming the first missing or malformed base key; adds
  `KEYS_BEYOND_JAXLINE` a config written for jaxline lacks."""
  # Deferred: these import JAX, which config files should not.
  from jaxline_ng import guards, mesh, rng

  defaults = get_base_config()
  for key in defaults.keys():
    if key not in config and key not in KEYS_BEYOND_JAXLINE:
      raise ConfigError(
          f"config is missing the base key {key!r}: build configs on "
          "jaxline_ng.base_config.get_base_config()")
  add_keys_beyond_jaxline(config)

  for key in BOOL_KEYS:
    # A config of plain types (a dict) takes a string here, and "no" is truthy.
    if config[key] not in (True, False, None):
      raise ConfigError(f"config.{key}={config[key]!r} must be True or False")
  metric = config.best_model_eval_metric
  if metric is not None and not isinstance(metric, str):
    raise ConfigError(f"config.best_model_eval_metric={metric!r} must be the name of a scalar "
                      "evaluate returns, or \"\" for no best series")

  for key in ("interval_type", "logging_interval_type", "checkpoint_interval_type"):
    value = config[key]
    if value is None and key != "interval_type":
      continue
    if value is None and config.logging_interval_type and config.checkpoint_interval_type:
      continue  # Both keys that override it are set, so nothing reads it (as in jaxline).
    if value not in INTERVAL_TYPES:
      raise ConfigError(
          f"config.{key}={value!r} is not an interval type; expected one of "
          f"{', '.join(INTERVAL_TYPES)}")

  for key in ("random_mode_train", "random_mode_eval"):
    try:
      rng.check_random_mode(config[key], key)
    except ValueError as e:
      raise ConfigError(str(e)) from None

  if config.placement not in mesh.PLACEMENTS:
    raise ConfigError(f"config.placement={config.placement!r} is not a placement; expected "
                      f"one of {', '.join(mesh.PLACEMENTS)}")
  if config.placement == "mesh":
    try:
      mesh.mesh_axes(config.mesh_shape)
      for key in ("random_mode_train", "random_mode_eval"):
        rng.check_mesh_random_mode(config[key], key)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  elif config.mesh_shape != defaults.mesh_shape:
    logging.warning("[jaxline_ng] config.mesh_shape=%r is not used: config.placement=%r (set "
                    "config.placement='mesh' to run on a mesh).", config.mesh_shape,
                    config.placement)

  if config.checkpointer not in CHECKPOINTERS:
    raise ConfigError(
        f"config.checkpointer={config.checkpointer!r} is not a checkpointer; "
        f"expected one of {', '.join(CHECKPOINTERS)}")

  if config.non_finite_policy not in guards.POLICIES:
    raise ConfigError(
        f"config.non_finite_policy={config.non_finite_policy!r} is not a policy; expected "
        f"one of {', '.join(guards.POLICIES)}")

  growth = config.periodic_action_growth_ratios
  logging_type = config.logging_interval_type or config.interval_type
  if growth and logging_type != "steps":
    raise ConfigError(
        f"config.periodic_action_growth_ratios={tuple(growth)!r} applies to step intervals, "
        f"but logging is every {logging_type!r}: set config.logging_interval_type='steps'")

  budget = config.wall_clock_budget_secs
  if budget is not None and (not _is_number(budget) or not budget > 0):
    raise ConfigError(f"config.wall_clock_budget_secs={budget!r} must be positive or None")
  step_timeout = config.step_timeout_secs
  if step_timeout is not None and (not _is_number(step_timeout)
                                   or not 0 <= step_timeout < math.inf):
    raise ConfigError(f"config.step_timeout_secs={step_timeout!r} must be >= 0 (0: no "
                      "watchdog) or None (automatic)")

  window = tuple(config.profile_steps or ())
  if window and (len(window) != 2 or not all(isinstance(s, int) for s in window)
                 or not 0 <= window[0] < window[1]):
    raise ConfigError(
        f"config.profile_steps={config.profile_steps!r} must be () or (first, stop) with "
        "0 <= first < stop")

  seed = config.random_seed
  if not _is_int(seed) or not -2**63 <= seed < 2**63:
    raise ConfigError(f"config.random_seed={seed!r} must be an int that fits in 64 bits")

  steps = config.training_steps
  if steps is not None and (not _is_int(steps) or steps < 0):
    raise ConfigError(f"config.training_steps={steps!r} must be a non-negative int or None")
  if steps is not None and steps > rng.MAX_STEP:
    raise ConfigError(f"config.training_steps={steps!r} is beyond {rng.MAX_STEP}, the most steps "
                      "a step's int32 global_step counts (as in jaxline)")

  # A negative logging interval is a typo; a negative save interval means no
  # periodic saves in jaxline (published configs use -1): kept, but said.
  for key, none_allowed in (("log_tensors_interval", True), ("log_train_data_interval", True),
                            ("save_checkpoint_interval", False),
                            ("eval_poll_interval_secs", False)):
    value = config[key]
    if value is None and none_allowed:
      continue
    positive = key == "eval_poll_interval_secs"  # A waiting evaluator at 0 would spin a core.
    if (not _is_number(value) or math.isnan(value)
        or (value <= 0 if positive else value < 0 and key != "save_checkpoint_interval")):
      raise ConfigError(f"config.{key}={value!r} must be a number {'> 0' if positive else '>= 0'}"
                        + (" or None" if none_allowed else ""))
    if value < 0:
      logging.warning("[jaxline_ng] config.%s=%r: no periodic saves (as 0, as in jaxline); "
                      "latest is saved at the end and on a stop only.", key, value)
    # 0 seconds logs every step; a multiple of 0 steps never comes (jaxline divided by it).
    if value == 0 and key.startswith("log_") and logging_type == "steps":
      raise ConfigError(f"config.{key}=0 with step intervals: 1 logs every step, None never")

  if config.restore_path and config.checkpointer != "disk":
    logging.warning("[jaxline_ng] config.restore_path=%r is read by the disk checkpointer only; "
                    "with config.checkpointer=%r jaxline_ng leaves it to the experiment.",
                    config.restore_path, config.checkpointer)

  cache_dir = config.compilation_cache_dir
  if cache_dir == "None":  # What `--config.compilation_cache_dir=None` gives: not a None.
    raise ConfigError("config.compilation_cache_dir='None' is the string 'None': for the "
                      "default (JAX's own cache if set, else <checkpoint_dir>/compilation_cache "
                      "off CPU) leave it unset; '' turns the cache off")
  if cache_dir is not None and not isinstance(cache_dir, str):
    raise ConfigError(f"config.compilation_cache_dir={cache_dir!r} must be a directory, \"\" "
                      "(off) or None (the default)")

  keep = config.max_checkpoints_to_keep
  if not _is_int(keep) or keep < 1:
    raise ConfigError(
        f"config.max_checkpoints_to_keep={keep!r} must be an int >= 1")

  # 10 is allowed: jaxline's own example is (1, 2, 5, 10).
  ratios = config.periodic_action_growth_ratios
  if ratios is not None and (not ratios or any(
      not _is_number(r) or not 1 <= r <= 10
      for r in ratios)):
    raise ConfigError(
        f"config.periodic_action_growth_ratios={ratios!r} must be None or a "
        "non-empty sequence of numbers in [1, 10]")
