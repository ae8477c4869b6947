"""The `best` checkpoint series: saved when `config.best_model_eval_metric` strictly
improves (from -inf/+inf, as jaxline), after the experiment's `on_new_best_model`."""

import math
from collections.abc import Mapping
from typing import Any

from absl import logging

from jaxline_ng import base_config, checkpointing


class BestTracker:
  """Saves the `best` series when the eval metric strictly improves."""

  def __init__(self, config, checkpointer: checkpointing.Checkpointer, experiment):
    self._metric = config.best_model_eval_metric
    self._higher_is_better = config.best_model_eval_metric_higher_is_better
    self._checkpointer = checkpointer
    self._state = checkpointer.get_experiment_state("best")
    # As jaxline, every entry is there before the restore (jaxline's restore those held);
    # jaxline_ng's skip the weights of a state holding no experiment.
    self._worst = -math.inf if self._higher_is_better else math.inf
    self._state.best_eval_metric_value = self._worst
    self._state.best_model_eval_metric = self._metric
    self._state.experiment_module = (None if checkpointer.restores_saved_entries
                                     else experiment)
    self._restored_step = None
    if checkpointer.can_be_restored("best"):
      checkpointer.restore("best")
      self._restored_step = getattr(self._state, "global_step", None)
    if getattr(self._state, "best_eval_metric_value", None) is None:
      self._state.best_eval_metric_value = self._worst
    saved_metric = self._state.best_model_eval_metric
    if saved_metric != self._metric:  # Its best value is another metric's.
      raise base_config.ConfigError(
          f"config.best_model_eval_metric={self._metric!r}, but the best checkpoints "
          f"(restore path {checkpointer.restore_path('best')}) are the best {saved_metric!r}: "
          "move them aside, or evaluate in another checkpoint_dir or --jaxline_mode=eval_<name>")
    self._state.experiment_module = experiment
    logging.info("[jaxline_ng] Best %s so far: %s", self._metric,
                 self._state.best_eval_metric_value)

  def start_at(self, step: int) -> None:
    """Before the first evaluation, of `step`: a best saved past it is an earlier run's,
    set aside where the checkpointer can (else kept, to be beaten)."""
    if self._restored_step is None or self._restored_step <= step:
      return
    past = (f"The best checkpoint ({self._metric}={self._state.best_eval_metric_value} at step "
            f"{self._restored_step}) is past step {step}, evaluated first")
    self._restored_step = None
    if not self._checkpointer.set_aside("best"):
      logging.warning("[jaxline_ng] %s: kept, so this run's best must beat it.", past)
      return
    logging.warning("[jaxline_ng] %s: an earlier run's, set aside. This run's best starts "
                    "afresh.", past)
    self._state.best_eval_metric_value = self._worst

  def update(self, evaluated, scalars: Mapping[str, Any]) -> None:
    """Saves `best` if `scalars` beat it; `evaluated` is the `latest` state evaluated."""
    global_step = evaluated.global_step
    value = float(scalars[self._metric])
    if not math.isfinite(value):
      logging.warning("[jaxline_ng] %s=%s at step %d is not finite: never the best.",
                      self._metric, value, global_step)
      return
    best = self._state.best_eval_metric_value
    # Strict comparisons: ties do not save, and NaN never does.
    improved = value > best if self._higher_is_better else value < best
    if not improved:
      return
    logging.info("[jaxline_ng] New best %s=%s at step %d (was %s).",
                 self._metric, value, global_step, best)
    self._state.best_eval_metric_value = value
    self._state.global_step = global_step
    if getattr(evaluated, "train_step_rng", None) is not None:  # As jaxline's best state.
      self._state.train_step_rng = evaluated.train_step_rng
    self._state.experiment_module.on_new_best_model(self._state)
    self._checkpointer.save("best")


def check_best_metric(config, scalars: Mapping[str, Any]) -> None:
  """Raises ConfigError if `best_model_eval_metric` is set and not among `scalars`."""
  name = config.best_model_eval_metric
  if name and name not in scalars:
    raise base_config.ConfigError(
        f"config.best_model_eval_metric={name!r} is not among the scalars evaluate returned: "
        f"{sorted(scalars) if scalars else 'none (None or an empty dict)'}")
