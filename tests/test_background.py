"""Tests for jaxline_ng.background.Worker: order, failing for good, back-pressure, idling, exit."""

import gc
import sys
import textwrap
import threading
import time

import pytest
from helpers import run

from jaxline_ng import background


def test_calls_run_in_submission_order_on_the_worker_thread():
  worker = background.Worker("ordered")
  threads = []

  def record(x):
    time.sleep(0.01 * (3 - x))
    threads.append(threading.current_thread().name)
    return x

  futures = [worker.submit(record, x) for x in range(3)]
  worker.wait()
  assert [future.result(0) for future in futures] == [0, 1, 2]
  assert threads == ["ordered"] * 3
  worker.close()


def test_first_error_fails_for_good_and_is_raised_on_the_callers_thread(caplog):
  worker = background.Worker("failing", raise_as=lambda e: RuntimeError("wrapped"))
  release = threading.Event()
  runs = []

  def work(x):
    release.wait()
    runs.append(x)
    if x == 0:
      raise ValueError("boom")

  first, second = worker.submit(work, 0), worker.submit(work, 1)
  release.set()
  assert isinstance(first.exception(5), ValueError)
  assert second.result(5) is None  # Queued before the failure: skipped.
  for call in (lambda: worker.submit(work, 2), worker.wait, worker.close, worker.close):
    with pytest.raises(RuntimeError, match="wrapped") as raised:
      call()
    assert isinstance(raised.value.__cause__, ValueError)
  assert runs == [0]
  assert caplog.text.count("Error in background thread failing") == 1


def test_submit_blocks_while_max_pending_calls_are_unfinished():
  worker = background.Worker("bounded", max_pending=2)
  gate = threading.Event()
  accepted = []

  def produce():
    for x in range(5):
      worker.submit(gate.wait)
      accepted.append(x)

  producer = threading.Thread(target=produce)
  producer.start()
  time.sleep(0.3)
  try:
    assert accepted == [0, 1]
  finally:
    gate.set()
  producer.join(5)
  assert accepted == list(range(5))
  worker.close()


def test_idle_callback_runs_once_after_calls_then_not_again():
  idles = []
  worker = background.Worker("idling", on_idle=(0.05, lambda: idles.append(time.monotonic())))
  time.sleep(0.2)
  assert not idles  # Nothing ran yet: nothing to follow up.
  worker.submit(lambda: None)
  time.sleep(0.3)
  assert len(idles) == 1
  worker.close()


def test_a_worker_nobody_holds_ends_its_thread():
  worker = background.Worker("forgotten")
  # A call referring to its worker, the last one before the thread waits, must not keep it alive.
  worker.submit(id, worker).result(5)
  thread = worker._thread  # pylint: disable=protected-access
  del worker
  gc.collect()
  thread.join(5)
  assert not thread.is_alive()


def test_submitted_calls_run_when_the_main_thread_ends():
  code = textwrap.dedent("""
    import time
    from jaxline_ng import background

    worker = background.Worker("at_exit")
    worker.submit(time.sleep, 0.3)
    worker.submit(print, "ran")
    """)
  result = run([sys.executable, "-c", code], timeout=60)
  assert result.returncode == 0, result.stderr
  assert result.stdout == "ran\n"


def test_the_thread_starts_with_the_first_call_and_runs_it_at_once():
  before = {thread.name for thread in threading.enumerate()}
  worker = background.Worker("lazy")
  assert "lazy" not in {thread.name for thread in threading.enumerate()} - before
  ran = []
  worker.submit(ran.append, 1)
  # As a ThreadPoolExecutor's new thread does, it runs the call before the
  # caller goes on: jaxline's make_async tests rely on it.
  assert ran == [1]
  worker.close()
