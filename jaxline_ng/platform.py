"""The command-line entry point: flags, config, mode dispatch.

    def main(argv):
      ...
    if __name__ == "__main__":
      flags.mark_flag_as_required("config")
      app.run(functools.partial(platform.main, Experiment))

Flags: `--config=file.py[:arg]` with `--config.key=value` overrides,
`--jaxline_mode=train|eval|eval_<name>|train_eval_multithreaded`,
`--jaxline_disable_pmap_jit` (alias `--disable_pmap_jit`), `--jaxline_post_mortem`.
"""

import contextlib
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence

import jax
import ml_collections
from absl import flags, logging
from ml_collections import config_flags

from jaxline_ng import (
  agreement,
  base_config,
  checkpointing,
  config_loading,
  debugging,
  distributed,
  errors,
  launch,
  persistent_cache,
  preemption,
  run_lock,
  run_record,
  train,
  writers,
  xla_cpu,
)

FLAGS = flags.FLAGS

_CONFIG = config_flags.DEFINE_config_file(
    "config", help_string="Experiment config file (`path.py` or `path.py:arg`).")
config_loading.report_errors_in_one_line(FLAGS["config"])
_MODE = flags.DEFINE_string(
    "jaxline_mode", "train",
    "train, eval, eval_<name> or train_eval_multithreaded.")

# jaxline's TPU flags, so launch scripts that pass them keep working.
_TPU_DRIVER = flags.DEFINE_string(
    "jaxline_tpu_driver", "", "jaxline's remote TPU driver address; JAX no longer has one.")
_ENSURE_TPU = flags.DEFINE_bool(
    "jaxline_ensure_tpu", False, "Fail unless JAX's default backend is a TPU.")

TRAIN_EVAL_MULTITHREADED = "train_eval_multithreaded"


def check_tpu_flags() -> None:
  """Raises ConfigError for jaxline's TPU flags where they cannot be honoured."""
  if _TPU_DRIVER.value:
    raise base_config.ConfigError(
        f"--jaxline_tpu_driver={_TPU_DRIVER.value!r}: JAX removed the TPU driver backend; "
        "drop the flag (JAX finds local TPUs itself)")
  if _ENSURE_TPU.value and jax.default_backend() != "tpu":
    raise base_config.ConfigError(
        f"--jaxline_ensure_tpu: JAX's default backend is {jax.default_backend()!r}, not a TPU")


def check_mode(mode: str) -> None:
  """Raises ConfigError unless `mode` is one the platform runs."""
  # An eval job's name is a directory name (its logs, its `best` series): one
  # with a path in it would write elsewhere, even into training's series.
  if mode in ("train", "eval", TRAIN_EVAL_MULTITHREADED) or _EVAL_NAME.fullmatch(mode):
    return
  raise base_config.ConfigError(
      f"--jaxline_mode={mode!r} is not a mode; expected train, eval, eval_<name> (letters, "
      f"digits, '_', '-', '.') or {TRAIN_EVAL_MULTITHREADED}")


_EVAL_NAME = re.compile(r"eval_(?!\.)[\w.-]+")


def create_checkpointer(config, mode: str) -> checkpointing.Checkpointer:
  """The checkpointer `config.checkpointer` names: "memory" or "disk"."""
  if config.get("checkpointer") == "disk":  # A config of jaxline's keys alone has none.
    from jaxline_ng import disk_checkpointing  # Deferred: orbax is slow to import.
    return disk_checkpointing.DiskCheckpointer(config, mode)
  return checkpointing.InMemoryCheckpointer(config, mode)


class TensorBoardLogger(writers.TensorBoardWriter):
  """jaxline's writer class, for code that builds or subclasses it: TensorBoard events in
  `<checkpoint_dir>/<mode>`, each write on disk when it returns (it may never be closed)."""

  def __init__(self, config, mode: str):
    super().__init__(os.path.join(config.checkpoint_dir, mode))
    self._open()

  def write_scalars(self, global_step: int, scalars) -> None:
    super().write_scalars(global_step, scalars)
    self.flush()

  def write_images(self, global_step: int, images) -> None:
    super().write_images(global_step, images)
    self.flush()


def create_writer(config, mode: str):
  """A TensorBoard + JSONL writer for `<checkpoint_dir>/<mode>`, or None.

  Only the chief writes unless `config.log_all_hosts`; other processes then
  write to `<checkpoint_dir>/<mode>/process_<i>`.
  """
  if not (distributed.is_chief() or config.log_all_hosts):
    return None
  logdir = os.path.join(config.checkpoint_dir, mode)
  if not distributed.is_chief():
    logdir = os.path.join(logdir, f"process_{jax.process_index()}")
  writer = writers.make_writer(logdir, use_async=config.log_async,
                               tensorboard=config.tensorboard)
  if distributed.is_multiprocess():
    agreement.at_peer_failure(writer.flush)
  return writer


def _parse_flags_if_needed(argv: Sequence[str]) -> Sequence[str]:
  """Parses flags and starts absl logging when `main` is called without `app.run`
  (`argv` with or without the program name; once parsed, jaxline ignored it)."""
  if FLAGS.is_parsed():
    return sys.argv[:1] if argv and list(argv) == sys.argv[1:] else argv
  if argv and list(argv) == sys.argv:
    argv = argv[1:]
  # ml_collections takes `--config.key=value` overrides from `sys.argv` itself.
  sys.argv = [sys.argv[0], *argv]
  try:
    argv = FLAGS(sys.argv)
  except flags.Error as e:
    raise SystemExit(f"jaxline_ng: error: {e}") from None
  logging.use_absl_handler()
  if FLAGS["verbosity"].using_default_value:
    FLAGS.verbosity = 0
  return argv


def _writer_and_record(config, mode: str):
  """The writer for `<checkpoint_dir>/<mode>`, after the chief's `run.json` there (which
  finds a bad `checkpoint_dir` in one line, not later on a thread)."""
  if distributed.is_chief():
    logdir = os.path.join(config.checkpoint_dir, mode)
    try:
      path = run_record.write(config, mode, logdir)
    except OSError as e:
      raise base_config.ConfigError(
          f"config.checkpoint_dir={config.checkpoint_dir!r}: cannot write {logdir}: "
          f"{e.strerror or e}") from None
    logging.info("[jaxline_ng] Run record: %s", path)
  return create_writer(config, mode)


def _close(writer) -> None:
  if writer is not None:
    writers.adapt(writer).close()


def _run(experiment_class, config, mode: str, checkpointer_factory) -> None:
  with contextlib.ExitStack() as locks:
    # Taken before anything is written, so a refused run changes nothing.
    if distributed.is_chief():
      try:
        locks.enter_context(run_lock.held(config.checkpoint_dir, mode))
      except OSError as e:
        raise base_config.ConfigError(
            f"config.checkpoint_dir={config.checkpoint_dir!r}: cannot write a lock file"
            f"{f' at {e.filename}' if e.filename else ''}: {e.strerror or e}") from None
    if config.checkpointer == "disk":
      _check_checkpoint_dir_is_shared(config.checkpoint_dir, mode)
      # Process 0 keeps its lock until every process has looked: a failure of
      # its own just after would release it, and a slower process would then
      # report a directory it does not share rather than that failure.
      agreement.rendezvous("checkpoint_dir_checked")
    _run_locked(experiment_class, config, mode, checkpointer_factory)


def _check_checkpoint_dir_is_shared(checkpoint_dir: str, mode: str) -> None:
  """Raises MultihostError unless every process sees the chief's lock there: else mesh
  saves wait for each other until orbax's barrier times out minutes later."""
  agreement.check_same_as_chief(
      "sees config.checkpoint_dir",
      lambda: {"its lock": run_lock.holder(checkpoint_dir, run_lock.roles(mode)[0])},
      f"config.checkpoint_dir={checkpoint_dir!r} must be one directory that every process shares")


def _warn_of_unread_snapshots(checkpointer) -> None:
  """Warns of in-memory snapshots in `utils.GLOBAL_CHECKPOINT_DICT` (code written for
  jaxline may put them there to resume) that `checkpointer` does not read."""
  if isinstance(checkpointer, checkpointing.InMemoryCheckpointer):
    return
  waiting = []
  for name, series in sorted(checkpointing.GLOBAL_CHECKPOINT_DICT.items()):
    if getattr(series, "history", None):
      nest = getattr(series.history[-1], "pickle_nest", None)  # A ConfigDict is no Mapping.
      step = nest.get("global_step", "?") if isinstance(
          nest, (Mapping, ml_collections.ConfigDict)) else "?"
      waiting.append(f"{name} at step {step}")
  if waiting:
    logging.warning("[jaxline_ng] utils.GLOBAL_CHECKPOINT_DICT holds in-memory snapshots (%s) "
                    "that this run does not restore: its checkpointer, %s, does not read them "
                    "(--config.checkpointer=memory does).", ", ".join(waiting),
                    checkpointer.class_name)


def _unused_disk_steps(config, checkpointer) -> str | None:
  """Where a run with in-memory checkpoints leaves disk checkpoints of this
  `checkpoint_dir` unread (a resume without --config.checkpointer=disk), or None."""
  if not isinstance(checkpointer, checkpointing.InMemoryCheckpointer):
    return None
  series_dir = os.path.join(config.checkpoint_dir, "checkpoints", "latest")
  steps = sorted(int(name) for name in (os.listdir(series_dir) if os.path.isdir(series_dir)
                                        else ()) if name.isdigit())
  if not steps:
    return None
  return (f"{series_dir} holds disk checkpoints (newest: step {steps[-1]}), which "
          "in-memory checkpoints (config.checkpointer='memory') do not read: add "
          "--config.checkpointer=disk to resume from them")


def _run_locked(experiment_class, config, mode: str, checkpointer_factory) -> None:
  # As jaxline: train_eval_multithreaded's trainer's is made for "train", its evaluator's "eval".
  checkpointer = checkpointing.adapt(checkpointer_factory(
      config, "train" if mode == TRAIN_EVAL_MULTITHREADED else mode))
  if checkpointer_factory is not create_checkpointer and config.checkpointer != "memory":
    logging.warning("[jaxline_ng] config.checkpointer=%r has no effect: the experiment passes "
                    "its own checkpointer_factory (%s).", config.checkpointer,
                    checkpointer.class_name)
  _warn_of_unread_snapshots(checkpointer)
  # A stopped run whose checkpoints die with the process must not exit asking for a rerun.
  preemption.set_resumable(mode not in ("train", TRAIN_EVAL_MULTITHREADED)
                           or not checkpointer.in_memory_only)
  unused_disk_steps = _unused_disk_steps(config, checkpointer)
  if unused_disk_steps and mode in ("train", TRAIN_EVAL_MULTITHREADED):
    logging.warning("[jaxline_ng] Training starts afresh: %s.", unused_disk_steps)
  eval_checkpointer = (checkpointing.adapt(checkpointer_factory(config, "eval"))
                       if mode == TRAIN_EVAL_MULTITHREADED else checkpointer)
  if distributed.is_multiprocess():  # Saves made before a peer failed still land.
    agreement.at_peer_failure(checkpointer.wait_for_checkpointing_to_finish)
    if eval_checkpointer is not checkpointer:
      agreement.at_peer_failure(eval_checkpointer.wait_for_checkpointing_to_finish)
  if mode == "train":
    writer = _writer_and_record(config, "train")
    try:
      train.train(experiment_class, config, checkpointer, writer)
    finally:
      _close(writer)
  elif mode == TRAIN_EVAL_MULTITHREADED:
    writer, eval_writer = _writer_and_record(config, "train"), _writer_and_record(config, "eval")
    try:
      train.train_eval_multithreaded(experiment_class, config, checkpointer, writer,
                                     eval_writer=eval_writer, eval_checkpointer=eval_checkpointer)
    finally:
      _close(writer)
      _close(eval_writer)
  else:  # In-memory checkpoints come from training in this process alone: none will come.
    in_memory = checkpointer.in_memory_only
    if in_memory and not checkpointer.can_be_restored("latest") and \
        not config.eval_initial_weights:
      raise base_config.ConfigError(
          f"--jaxline_mode={mode} would wait forever: in-memory checkpoints "
          f"({checkpointer.class_name}) live in the training process. Use "
          f"--jaxline_mode={TRAIN_EVAL_MULTITHREADED}, or "
          "--config.eval_initial_weights to evaluate initial weights"
          + (f"; {unused_disk_steps}" if unused_disk_steps else ""))
    writer = _writer_and_record(config, mode)
    try:
      train.evaluate(experiment_class, config, checkpointer, writer, jaxline_mode=mode,
                     poll_interval_secs=config.eval_poll_interval_secs,
                     stop_waiting=(lambda: True) if in_memory else None)
    finally:
      _close(writer)


def main(experiment_class, argv: Sequence[str],
         checkpointer_factory: Callable = create_checkpointer) -> None:
  """Runs `experiment_class` in the mode `--jaxline_mode` names.

  Bad input (config, mode) exits with a one-line error naming the culprit.
  SIGTERM/SIGINT stop training after the current step, save and flush, and
  exit with `preemption.EXIT_PREEMPTED` (75), or `EXIT_STOPPED_UNSAVED` (143)
  where the checkpoints are in memory and a rerun starts afresh.
  """
  argv = _parse_flags_if_needed(argv)
  if len(argv) > 1:
    raise SystemExit(f"jaxline_ng: error: unexpected positional arguments {list(argv[1:])}: "
                     "pass flags only (platform.main takes sys.argv[1:], as under app.run)")
  config = _CONFIG.value
  if config is None:
    raise SystemExit("jaxline_ng: error: --config is required (a config file: path.py[:arg])")
  mode = _MODE.value
  launch.watch_the_launcher()
  try:
    xla_cpu.check_pool()
    config = config_loading.as_config_dict(config, FLAGS["config"])
    if distributed.initialize_if_requested():
      agreement.exit_when_a_peer_fails()
    # JAX's preemption service, which the runtime gives SIGTERM, is consulted by training alone.
    sigterm_to_jax = distributed.is_multiprocess() and mode in ("train", TRAIN_EVAL_MULTITHREADED)
    with preemption.stop_on_signals(sigterm_to_jax), debugging.eager_if_requested():
      _check_and_run(experiment_class, config, mode, checkpointer_factory)
      if preemption.signalled():  # As the work ended: still the exit code the log promised.
        logging.warning("[jaxline_ng] %s came as the run ended: exiting with code %d.",
                        preemption.stop_reason(), preemption.exit_code())
        raise SystemExit(preemption.exit_code())
  except preemption.Preempted:
    raise SystemExit(preemption.exit_code()) from None
  except Exception as e:  # pylint: disable=broad-except
    one_line = isinstance(e, errors.OneLineError)  # Else it keeps its traceback.
    if distributed.is_multiprocess():
      # Published first, so every other process exits at once with the same code.
      if one_line:
        print(f"jaxline_ng: error: {e}", file=sys.stderr)
      else:
        logging.exception("[jaxline_ng] Process %d failed; exiting without waiting for the "
                          "others.", jax.process_index())
      agreement.publish_failure(f"{type(e).__name__}: {e}".splitlines()[0], 1)
      agreement.exit_after_failure(1)
    if one_line:
      raise SystemExit(f"jaxline_ng: error: {e}") from None
    raise


def _check_and_run(experiment_class, config, mode: str, checkpointer_factory) -> None:
  """Checks the config and the launch (agreed across processes), then runs the mode."""
  agreement.begin_run()
  base_config.validate_config(config)
  config_loading.make_paths_absolute(config)
  if config.get("checkpointer") == "disk":  # Before the run's lock and cache go there.
    from jaxline_ng import disk_checkpointing  # Deferred: orbax is slow to import.
    disk_checkpointing.check_checkpoint_dir(config.checkpoint_dir)
  check_mode(mode)
  if distributed.is_multiprocess() and debugging.pmap_jit_disabled():
    raise base_config.ConfigError(
        "--jaxline_disable_pmap_jit runs pmap as a vmap over this process's devices alone, "
        "so several processes would train apart: debug with one process")
  # Else they would wait on each other until a runtime timeout naming nothing.
  agreement.check_same_as_chief("was launched", lambda: {
      "--jaxline_mode": mode, "--jaxline_num_processes": FLAGS.jaxline_num_processes,
      "local devices": jax.local_device_count(),  # A pmap over uneven counts fails unnamed.
      # Collectives over other dtypes abort; other keys make replicas differ.
      "jax_enable_x64": jax.config.jax_enable_x64,
      "jax_default_prng_impl": jax.config.jax_default_prng_impl,
      # One checkpoint_dir may be mounted at different paths: its lock is compared instead.
      **{f"config.{key}": value for key, value in run_record.flat_config(config).items()
         if key != "checkpoint_dir"}},
      "every process of a run takes the same mode and config")
  check_tpu_flags()
  persistent_cache.enable_compilation_cache(config)
  config_loading.warn_if_eval_dir_differs(config)
  logging.info("[jaxline_ng] mode=%s checkpoint_dir=%s", mode, config.checkpoint_dir)
  debugging.debugger_fallback(_run)(experiment_class, config, mode, checkpointer_factory)
