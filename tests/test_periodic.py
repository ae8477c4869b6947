"""PeriodicAction and make_async: jaxline's contract, and how errors surface."""

import threading
import time

import pytest

from jaxline_ng import periodic


class Calls:
  """An action function with jaxline's signature, `fn(step, scalars)`."""

  def __init__(self):
    self.steps = []

  def __call__(self, step, scalars):
    self.steps.append((step, scalars))


def drive(action, steps, times=None):
  for i, step in enumerate(steps):
    action(times[i] if times else float(step), step, {"s": step})
  action.wait_to_finish()


def acted_steps(calls):
  return [step for step, _ in calls.steps]


def test_steps_interval_acts_at_multiples():
  calls = Calls()
  drive(periodic.PeriodicAction(calls, "steps", 3, run_async=False), range(1, 11))
  assert acted_steps(calls) == [3, 6, 9]


def test_steps_interval_acts_at_multiples_after_a_resume_at_another_step():
  calls = Calls()
  drive(periodic.PeriodicAction(calls, "steps", 5, start_step=12, run_async=False),
        range(13, 24))
  assert acted_steps(calls) == [15, 20]


def test_secs_interval_uses_given_times():
  calls = Calls()
  action = periodic.PeriodicAction(calls, "secs", 10.0, start_time=100.0, run_async=False)
  drive(action, range(1, 7), times=[101, 105, 110, 115, 119, 120.5])
  assert acted_steps(calls) == [3, 6]


def test_update_time_restarts_the_secs_interval_and_steps_per_sec():
  calls = Calls()
  action = periodic.PeriodicAction(calls, "secs", 10.0, run_async=False)
  action.update_time(1000.0, 40)
  drive(action, range(41, 46), times=[1001, 1005, 1009, 1010, 1011])
  assert acted_steps(calls) == [44]
  assert calls.steps[0][1]["steps_per_sec"] == pytest.approx(4 / 10)


def test_fn_gets_steps_per_sec_since_the_last_action():
  calls = Calls()
  drive(periodic.PeriodicAction(calls, "steps", 2, start_time=0.0, run_async=False),
        range(1, 5), times=[1.0, 2.0, 3.0, 6.0])
  assert calls.steps == [(2, {"s": 2, "steps_per_sec": pytest.approx(1.0)}),
                         (4, {"s": 4, "steps_per_sec": pytest.approx(0.5)})]


@pytest.mark.parametrize("ratios, steps, expected", [
    ((1, 2, 5), range(1, 1010), [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]),
    ((1, 2, 5, 10), range(1, 1010), [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]),
    # At every scale, not only early: 4e5 is 4 * 10**5.
    ((1, 2, 3, 4, 5), range(399_901, 400_101), [400_000]),
    ((2, 5), range(1, 120), [2, 5, 20, 50]),
])
def test_growth_ratios_act_where_jaxline_does(ratios, steps, expected):
  calls = Calls()
  action = periodic.PeriodicAction(calls, "steps", 1_000_000, run_async=False,
                                   logging_growth_ratios=ratios)
  drive(action, steps)
  assert acted_steps(calls) == expected


def test_growth_ratios_need_a_steps_interval():
  with pytest.raises(ValueError, match="steps"):
    periodic.PeriodicAction(Calls(), "secs", 10.0, logging_growth_ratios=(1, 2, 5))


def test_end_step_to_action_always_acts_at_that_step():
  calls = Calls()
  action = periodic.PeriodicAction(calls, "steps", 200, end_step_to_action=1010)
  drive(action, range(1, 1011))
  assert acted_steps(calls) == [200, 400, 600, 800, 1000, 1010]


def test_log_all_data_passes_every_step_in_order():
  calls = Calls()
  action = periodic.PeriodicAction(calls, "steps", 4, log_all_data=True)
  drive(action, range(1, 10))
  action.finish()
  assert acted_steps(calls) == list(range(1, 10))
  assert [v["s"] for _, v in calls.steps] == list(range(1, 10))


def test_finish_acts_on_an_unacted_final_step():
  calls = Calls()
  action = periodic.PeriodicAction(calls, "steps", 4, run_async=False)
  drive(action, range(1, 7))
  assert acted_steps(calls) == [4]
  action.finish()
  assert acted_steps(calls) == [4, 6]


def test_async_action_runs_off_the_calling_thread_in_order():
  threads, steps = set(), []

  def record(step, scalars):
    del scalars
    time.sleep(0.001)
    threads.add(threading.current_thread().name)
    steps.append(step)

  action = periodic.PeriodicAction(record, "steps", 1)
  drive(action, range(1, 51))
  assert steps == list(range(1, 51))
  assert threading.current_thread().name not in threads


def _lags_behind(steps: int, action_secs: float, step_secs: float = 0.0,
                 **action_kwargs) -> list[int]:
  """How many steps behind the loop each call of a slow async action ran."""
  called_up_to, behind = [0], []

  def slow(step, scalars):
    del scalars
    behind.append(called_up_to[0] - step)
    time.sleep(action_secs)

  action = periodic.PeriodicAction(slow, **({"interval_type": "steps", "interval": 1}
                                            | action_kwargs))
  for step in range(1, steps + 1):
    called_up_to[0] = step
    action(float(step), step, {})
    time.sleep(step_secs)
  action.finish()
  assert len(behind) == steps
  return behind


def test_a_slow_async_action_holds_the_loop_back_rather_than_fall_behind(monkeypatch):
  # A writer slower than training: its backlog grew without bound (memory, and
  # the flush before a stop's save took minutes).
  monkeypatch.setattr(periodic, "_MOST_BEHIND", 20)
  behind = _lags_behind(300, action_secs=0.002)
  # One call in progress and at most the allowed backlog behind it.
  assert max(behind) <= 20 + 1, max(behind)


def test_a_slow_writer_of_every_steps_data_holds_the_loop_back_between_due_steps(monkeypatch):
  # log_all_train_data with an interval of seconds: every step's row was held
  # until the next due step, so a slow writer's backlog grew without bound, and
  # a SIGTERM's save waited minutes for it (a scheduler kills the run first).
  monkeypatch.setattr(periodic, "_MOST_BEHIND", 20)
  behind = _lags_behind(300, action_secs=0.002, interval_type="secs", interval=3600.0,
                        log_all_data=True)
  assert max(behind[1:]) <= 3 * 20 + 1, max(behind)


def test_async_due_steps_are_acted_on_without_a_later_call():
  """As jaxline's: a loop that stops calling (it ended, or waits on a slow step)
  still gets its due steps acted on. They used to wait for the next call."""
  calls = Calls()
  action = periodic.PeriodicAction(calls, "steps", 1)
  for step in range(1, 4):
    action(float(step), step, {})
  deadline = time.monotonic() + 10
  while len(calls.steps) < 3 and time.monotonic() < deadline:
    time.sleep(0.01)
  assert acted_steps(calls) == [1, 2, 3]


def test_jaxlines_subclass_hooks_decide_and_act():
  """jaxline's PeriodicAction calls `_apply_condition` and `_apply_fn`; lab code overrides them."""
  acted = []

  class EveryThird(periodic.PeriodicAction):

    def _apply_condition(self, t, step):
      return step % 3 == 0

    def _apply_fn(self, step, steps_per_sec, scalars):
      acted.append((step, scalars["s"], steps_per_sec))

  drive(EveryThird(Calls(), "steps", 100, run_async=False), range(1, 10))
  assert acted == [(3, 3, 1.0), (6, 6, 1.0), (9, 9, 1.0)]  # drive's clock: 1 s a step
  action = periodic.PeriodicAction(Calls(), "steps", 4)
  action.log_all_data = True  # jaxline's public attribute
  assert action.log_all_data


def test_async_error_is_raised_by_a_later_call_or_wait():

  def fail(step, scalars):
    raise RuntimeError(f"failed at {step}")

  action = periodic.PeriodicAction(fail, "steps", 1)
  action(0.0, 1, {})
  with pytest.raises(RuntimeError, match="failed at 1"):
    action.wait_to_finish()
  with pytest.raises(RuntimeError, match="failed at 1"):
    action(1.0, 2, {})


def test_make_async_returns_futures_and_runs_in_call_order():
  order = []

  @periodic.make_async()
  def record(x):
    time.sleep(0.01 * (3 - x))
    order.append(x)
    return 2 * x

  futures = [record(x) for x in range(3)]
  assert [f.result() for f in futures] == [0, 2, 4]
  assert order == [0, 1, 2]


def test_make_async_never_runs_again_after_an_error():
  runs = []

  @periodic.make_async()
  def fails_once_run():
    runs.append(None)
    raise ValueError("first failure")

  future = fails_once_run()
  assert isinstance(future.exception(), ValueError)
  for _ in range(3):
    with pytest.raises(ValueError, match="first failure"):
      fails_once_run()
  with pytest.raises(ValueError, match="first failure"):
    fails_once_run.wait()
  assert runs == [None]


def test_make_async_skips_calls_queued_before_the_error_was_seen():
  runs = []
  release = threading.Event()

  @periodic.make_async()
  def work(x):
    release.wait()
    runs.append(x)
    if x == 0:
      raise ValueError("boom")

  first, second = work(0), work(1)  # Both queued before the first fails.
  release.set()
  assert isinstance(first.exception(), ValueError)
  second.result()
  assert runs == [0]


def test_no_start_time_acts_at_once_without_a_made_up_rate():
  calls = Calls()
  action = periodic.PeriodicAction(calls, "secs", 60.0, start_time=None, start_step=40,
                                   run_async=False)
  drive(action, [41, 42, 43], times=[1000.0, 1030.0, 1061.0])
  assert calls.steps == [(41, {"s": 41}), (43, {"s": 43, "steps_per_sec": pytest.approx(2 / 61)})]
