"""Graceful stops: SIGTERM/SIGINT or a time budget end training, saved.

The first signal asks the run to stop after the step in flight; `train` saves
`latest`, flushes, and the process exits `EXIT_PREEMPTED` (`EXIT_STOPPED_UNSAVED`
where a rerun cannot resume). A second signal, in any phase, exits at once with
the same code; signals arriving together count once. The loop learns of the
request through a periodic action (`StopCheck`), so overridden `train_loop`s
stop too. In a multi-process run every request is a preemption notice to JAX's
preemption service, and the processes stop after the step they agree on.
"""

import atexit
import contextlib
import os
import signal
import threading
import time

from absl import logging

from jaxline_ng import agreement, base_config, distributed, periodic

# EX_TEMPFAIL ("try again later"): a scheduler may requeue; the rerun resumes.
EXIT_PREEMPTED = 75
# A stop a rerun cannot resume (in-memory checkpoints): SIGTERM's own code, so
# a scheduler requeueing on 75 does not restart from step 0 again and again.
EXIT_STOPPED_UNSAVED = 143
_exit_code = [EXIT_PREEMPTED]

_stop_requested = threading.Event()
_reason = ["signal"]
# Whether SIGTERM is left to JAX's preemption service (`stop_on_signals`).
_notice_through_jax = [False]
# Set by the first signal and kept through the final save, so a second one is
# recognised in every phase.
_signalled = threading.Event()
# Signals arriving this soon after the one acted on are the same request (`_watch_signals`).
_SAME_REQUEST_SECS = 0.5
# A step after which training stops as if preempted (saved, exit 75), on every
# process at once: how `verify_resume` interrupts a run at an exact step.
STOP_AFTER_STEP_ENV = "JAXLINE_NG_STOP_AFTER_STEP"


class Preempted(Exception):
  """Raised out of the training loop after a stop was requested."""


def set_resumable(resumable: bool) -> None:
  """Whether a rerun would resume this run after a stop: the stop's exit code
  is then `EXIT_PREEMPTED`, else `EXIT_STOPPED_UNSAVED`."""
  _exit_code[0] = EXIT_PREEMPTED if resumable else EXIT_STOPPED_UNSAVED


def exit_code() -> int:
  """The exit code of a stop of this run (`set_resumable`)."""
  return _exit_code[0]


def request_stop(reason: str) -> None:
  """Asks the training loop to stop at the next step boundary.

  In a multi-process run, at the step every process agrees on.
  """
  _reason[0] = reason
  _stop_requested.set()
  if _notice_through_jax[0]:
    agreement.give_preemption_notice()


def stop_requested() -> bool:
  return _stop_requested.is_set()


def wait_for_stop(timeout: float) -> bool:
  """Waits up to `timeout` seconds for a stop request; returns whether one came."""
  # Beyond TIMEOUT_MAX the wait raises OverflowError; no run waits that long (292 years).
  return _stop_requested.wait(min(timeout, threading.TIMEOUT_MAX))


def signalled() -> bool:
  """Whether a signal asked this run to stop (kept once the request is served)."""
  return _signalled.is_set()


def stop_reason() -> str:
  """What asked for the stop, e.g. "SIGTERM"."""
  return _reason[0]


def consume_stop_request() -> None:
  """Marks the request served (the run it stopped has saved), so a later run in
  this process starts afresh."""
  _stop_requested.clear()


def _act_on_signal(signum: int) -> None:
  name = signal.Signals(signum).name
  if _signalled.is_set():
    # The save in progress is left incomplete, and ignored on restore.
    logging.warning("[jaxline_ng] Second %s: exiting now with code %d.", name, exit_code())
    logging.flush()
    if distributed.is_multiprocess():
      # Else the others would wait for it until JAX's heartbeat aborts them.
      agreement.publish_failure(f"a second {name} ended it at once", exit_code())
      agreement.exit_after_failure(exit_code())
    os._exit(exit_code())  # pylint: disable=protected-access
  _signalled.set()
  logging.warning("[jaxline_ng] %s received: stopping after the current step or evaluation "
                  "(training saves first), then exiting with code %d. Send it again to exit "
                  "at once.", name, exit_code())
  request_stop(name)


def _watch_signals(read_fd: int, handled: frozenset, forward_fd: int) -> None:
  """Acts on each handled signal as soon as it arrives; ends when `read_fd` closes.

  Python's handlers run on the main thread, which a blocking C call (a slow
  save, an eval job's wait) may hold for long; the wake-up fd hears of the
  signal at once, on any thread.
  """
  # Signals together are one request: `timeout` signals its child, then its
  # group, milliseconds apart; a second stop would exit without the final save.
  same_request_until = -1.0
  while data := os.read(read_fd, 64):
    if forward_fd != -1:  # Whoever set the wake-up fd before still hears of every signal.
      with contextlib.suppress(OSError):
        os.write(forward_fd, data)
    signum = next((signum for signum in data if signum in handled), None)
    if signum is None:
      continue
    now = time.monotonic()
    if now < same_request_until:
      logging.info("[jaxline_ng] %s again at once: the same request.", signal.Signals(signum).name)
      continue
    same_request_until = now + _SAME_REQUEST_SECS
    _act_on_signal(signum)


# While `stop_on_signals` holds the handlers: (the handlers it replaced, the
# wake-up fd it replaced, its pipe's read fd, its pipe's write fd).
_held: list = [None]


def _noted(signum, frame) -> None:
  """The Python-level handler: `_watch_signals` acts on the signal, unless code
  since took the wake-up fd (asyncio does); then it is acted on here."""
  del frame
  if _held[0] is None:
    return
  replaced, _, _, write_fd = _held[0]
  current = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  if current == write_fd:
    return
  if current != -1:
    signal.set_wakeup_fd(current)  # Its owner keeps it; signals keep coming here.
  if signum in replaced:
    _act_on_signal(signum)


def _exit_preempted(signum, frame) -> None:
  """A signal after the run was stopped by one: exit now, as a second signal does."""
  del signum, frame
  os._exit(exit_code())  # pylint: disable=protected-access


def _ignore_at_exit(signums: tuple[int, ...]) -> None:
  """At exit after a signalled stop: the interpreter resets handlers as it shuts
  down, and a late signal would replace the stop's exit code."""
  for signum in signums:
    signal.signal(signum, signal.SIG_IGN)


def _release_in_forked_child() -> None:
  """A forked child (a data loader) has no watcher but shares the pipe: it gets
  the handlers and wake-up fd of before the run back."""
  held, _held[0] = _held[0], None
  if held is None:
    return
  replaced, replaced_fd, read_fd, write_fd = held
  for signum, handler in replaced.items():
    signal.signal(signum, handler)
  signal.set_wakeup_fd(replaced_fd)
  for fd in (read_fd, write_fd):
    with contextlib.suppress(OSError):
      os.close(fd)


os.register_at_fork(after_in_child=_release_in_forked_child)


@contextlib.contextmanager
def stop_on_signals(sigterm_to_jax: bool = False):
  """Within the block, SIGTERM and SIGINT request a stop; handlers restored after.

  A signal the program handles itself keeps its handler; off the main thread
  nothing is installed. With `sigterm_to_jax` (multi-process training) SIGTERM
  stays with JAX's preemption service.
  """
  _stop_requested.clear()
  _signalled.clear()
  set_resumable(True)
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = {}
  for signum in (signal.SIGINT,) if sigterm_to_jax else (signal.SIGTERM, signal.SIGINT):
    handler = signal.getsignal(signum)
    if handler in (signal.SIG_DFL, signal.default_int_handler, _exit_preempted):
      previous[signum] = signal.signal(signum, _noted)
    else:  # The experiment handles (or ignores) this signal itself, as jaxline let it.
      logging.info("[jaxline_ng] %s keeps the handler installed before platform.main.",
                   signal.Signals(signum).name)
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)  # As `set_wakeup_fd` requires.
  previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  watcher = threading.Thread(target=_watch_signals, name="jaxline_ng_signals", daemon=True,
                             args=(read_fd, frozenset(previous), previous_fd))
  watcher.start()
  _held[0] = (previous, previous_fd, read_fd, write_fd)
  _notice_through_jax[0] = sigterm_to_jax
  try:
    yield
  finally:
    _notice_through_jax[0] = False
    _held[0] = None
    for signum, handler in previous.items():
      # After a signalled stop, one more signal must not change the exit code.
      signal.signal(signum, _exit_preempted if _signalled.is_set() else handler)
    if _signalled.is_set() and previous:
      atexit.register(_ignore_at_exit, tuple(previous))
    signal.set_wakeup_fd(previous_fd)
    os.close(write_fd)  # The watcher reads the end of the pipe and returns.
    watcher.join()
    os.close(read_fd)


class StopCheck(periodic.EveryStepAction):
  """A periodic action that raises `Preempted` once a stop was requested (in a
  multi-process run, at the agreed step, counted from `start_step`).

  With `budget_secs` it requests the stop itself once that much time has
  passed (`config.wall_clock_budget_secs`; the chief's clock decides).
  """

  def __init__(self, budget_secs: float | None = None, start_step: int = 0):
    self._budget_secs = budget_secs
    self._stop_after_step = _stop_after_step()
    self._agreed = distributed.is_multiprocess()
    if self._agreed:
      agreement.stop_agreed(start_step)
    if self._agreed and not distributed.is_chief():
      budget_secs = None
    self._deadline = None if budget_secs is None else time.monotonic() + budget_secs

  def __call__(self, t: float, step: int, scalars) -> None:
    if step == self._stop_after_step:
      # Every process stops here alone: they all know the step.
      raise Preempted(f"stopped after step {step} as {STOP_AFTER_STEP_ENV} asks")
    if self._deadline is not None and time.monotonic() >= self._deadline:
      self._deadline = None
      logging.warning("[jaxline_ng] The wall-clock budget of %gs is spent: stopping.",
                      self._budget_secs)
      if self._agreed:
        agreement.give_preemption_notice()
      else:
        request_stop(f"the wall-clock budget of {self._budget_secs:g}s")
    if self._agreed:
      if agreement.stop_agreed(step):
        raise Preempted(f"stopped after step {step}, the step every process agreed on "
                        "after a preemption notice")
    elif _stop_requested.is_set():
      raise Preempted(f"stopped by {_reason[0]} after step {step}")


def _stop_after_step() -> int | None:
  """The step `STOP_AFTER_STEP_ENV` names, or None; a value that is no step is refused."""
  text = os.environ.get(STOP_AFTER_STEP_ENV, "")
  if not text:
    return None
  if not text.isdigit() or int(text) < 1:
    raise base_config.ConfigError(
        f"{STOP_AFTER_STEP_ENV}={text!r}: expected a step number, 1 or more")
  return int(text)
