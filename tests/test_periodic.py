"""PeriodicAction: when actions run, and how their errors surface."""

import threading
import time

import jax
import numpy as np
import pytest

from jaxline_ng import devices, periodic


class Calls:

  def __init__(self):
    self.steps = []

  def __call__(self, t, step, scalars):
    self.steps.append((step, scalars))


def drive(action, steps, times=None):
  for i, step in enumerate(steps):
    action(times[i] if times else 0.0, step, {"s": step})
  action.wait_to_finish()


def test_steps_interval():
  calls = Calls()
  drive(periodic.PeriodicAction(calls, "steps", 3, run_async=False), range(1, 11))
  assert [s for s, _ in calls.steps] == [3, 6, 9]


def test_secs_interval_uses_given_times():
  calls = Calls()
  action = periodic.PeriodicAction(calls, "secs", 10.0, start_time=100.0, run_async=False)
  drive(action, range(1, 7), times=[101, 105, 110, 115, 119, 120.5])
  assert [s for s, _ in calls.steps] == [3, 6]


def test_start_step_continues_interval_after_resume():
  calls = Calls()
  drive(periodic.PeriodicAction(calls, "steps", 5, start_step=12, run_async=False),
        range(13, 24))
  assert [s for s, _ in calls.steps] == [17, 22]


def test_growth_ratios_add_early_steps():
  calls = Calls()
  action = periodic.PeriodicAction(calls, "steps", 100, run_async=False,
                                   logging_growth_ratios=(1, 2, 5))
  drive(action, range(1, 251))
  assert [s for s, _ in calls.steps] == [1, 2, 5, 10, 20, 50, 100, 200]


def test_log_all_data_passes_every_step_in_order():
  calls = Calls()
  action = periodic.PeriodicAction(calls, "steps", 4, log_all_data=True)
  drive(action, range(1, 10))
  action.finish()
  assert [s for s, _ in calls.steps] == list(range(1, 10))
  assert [v["s"] for _, v in calls.steps] == list(range(1, 10))


def test_finish_acts_on_unacted_final_step_only_when_asked():
  calls = Calls()
  action = periodic.PeriodicAction(calls, "steps", 4, run_async=False)
  drive(action, range(1, 7))
  action.finish()
  assert [s for s, _ in calls.steps] == [4, 6]
  calls = Calls()
  action = periodic.PeriodicAction(calls, "steps", 4, run_async=False, run_on_final_step=False)
  drive(action, range(1, 7))
  action.finish()
  assert [s for s, _ in calls.steps] == [4]


def test_async_action_runs_off_the_calling_thread_in_order():
  threads, steps = set(), []

  def record(t, step, scalars):
    time.sleep(0.001)
    threads.add(threading.current_thread().name)
    steps.append(step)

  action = periodic.PeriodicAction(record, "steps", 1)
  drive(action, range(1, 51))
  assert steps == list(range(1, 51))
  assert threading.current_thread().name not in threads


def test_async_error_is_raised_on_the_next_call_or_wait():

  def fail(t, step, scalars):
    raise RuntimeError(f"failed at {step}")

  action = periodic.PeriodicAction(fail, "steps", 1)
  action(0.0, 1, {})
  with pytest.raises(RuntimeError, match="failed at 1"):
    action.wait_to_finish()
  # Loop times a second apart: batches are handed over at most every 0.1 s.
  action(1.0, 2, {})
  time.sleep(0.2)
  with pytest.raises(RuntimeError, match="failed at 2"):
    action(2.0, 3, {})


def test_make_async_returns_futures():
  @periodic.make_async()
  def double(x):
    return 2 * x

  assert double(21).result() == 42


def test_async_steps_due_within_a_batch_interval_run_together():
  """Acting every step wakes the background thread once per `_BATCH_SECONDS`, not per step."""
  batches = []
  action = periodic.PeriodicAction(lambda t, step, scalars: None, "steps", 1)
  original = action._run_items  # pylint: disable=protected-access

  def record(items, read):
    batches.append([step for _, step, _ in items])
    original(items, read)

  action._run_items = record  # pylint: disable=protected-access
  for step in range(1, 51):
    action(1.0 + step * 0.001, step, {})  # 50 steps within 0.05 s of loop time.
  action(1.2, 51, {})
  action.wait_to_finish()
  assert batches[0] == [1]
  assert batches[1] == list(range(2, 52))
  assert [step for batch in batches for step in batch] == list(range(1, 52))


def test_batched_reads_dispatch_on_the_loops_thread_only(monkeypatch):
  """The logging thread only transfers: a dispatch there could take the XLA
  CPU pool threads an unbounded training loop's collective needs."""
  stacking_threads = []
  real_stack = devices._stack_columns  # pylint: disable=protected-access

  def stack(columns):
    stacking_threads.append(threading.current_thread())
    return real_stack(columns)

  monkeypatch.setattr(devices, "_stack_columns", stack)
  monkeypatch.setattr(periodic, "_BATCH_SECONDS", 60.0)
  logged = []
  action = periodic.PeriodicAction(lambda t, step, scalars: logged.append((step, scalars)),
                                   "steps", 1, first_device_only=True)
  per_device = devices.put_per_device(np.arange(jax.local_device_count(), dtype=np.float32))
  for step in range(1, 21):  # Step 1 goes alone; 2..20 (16 + 3) wait for the batch interval.
    action(float(step), step, {"loss": per_device + step})
  action.wait_to_finish()
  assert stacking_threads == [threading.current_thread()] * 2
  assert [(step, float(scalars["loss"][0])) for step, scalars in logged] == [
      (step, float(step)) for step in range(1, 21)]
