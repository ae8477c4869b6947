"""stop_on_signals in one process, against what code run inside it does to signals."""

import asyncio
import os
import signal
import threading
import time

import pytest

from jaxline_ng import preemption


@pytest.fixture(autouse=True)
def no_stop_left_behind():
  yield
  preemption.consume_stop_request()


def test_a_forked_childs_sigterm_ends_the_child_and_leaves_the_run_alone():
  """multiprocessing forks (data loaders, pools): the child inherits the wake-up pipe."""
  with preemption.stop_on_signals():
    child = os.fork()
    if child == 0:  # As `Process.terminate()` does; exiting 3 means SIGTERM was ignored.
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(1.0)
      os._exit(3)  # pylint: disable=protected-access
    _, status = os.waitpid(child, 0)
    stopped = preemption.wait_for_stop(1.0)
  assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
  assert not stopped


def test_sigterm_stops_the_run_after_an_event_loop_took_the_wakeup_fd():
  """`add_signal_handler` sets the loop's wake-up fd, and -1 when the loop closes."""

  async def handle_sigusr1():
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: None)
    await asyncio.sleep(0)

  with preemption.stop_on_signals():
    asyncio.run(handle_sigusr1())
    os.kill(os.getpid(), signal.SIGTERM)
    assert preemption.wait_for_stop(5.0)
    assert preemption.stop_reason() == "SIGTERM"


def test_a_wait_longer_than_threads_allow_waits_for_the_stop():
  """An eval job's poll interval of 1e12 s raised OverflowError in the wait."""
  stopper = threading.Timer(0.05, preemption.request_stop, args=("a test",))
  stopper.start()
  try:
    assert preemption.wait_for_stop(1e12)
  finally:
    stopper.join()
    preemption.consume_stop_request()


def test_a_signal_repeated_soon_after_is_the_same_request_and_a_later_one_another(monkeypatch):
  """`timeout`'s second SIGTERM (to its process group) came 7 ms after the first on a
  loaded machine and exited the run without its final save (helper porting C3)."""
  acted = []
  monkeypatch.setattr(preemption, "_act_on_signal", acted.append)
  read_fd, write_fd = os.pipe()
  watcher = threading.Thread(target=preemption._watch_signals,  # pylint: disable=protected-access
                             args=(read_fd, frozenset({signal.SIGTERM}), -1))
  watcher.start()
  os.write(write_fd, bytes([signal.SIGTERM]))
  time.sleep(0.05)
  os.write(write_fd, bytes([signal.SIGTERM]))
  time.sleep(preemption._SAME_REQUEST_SECS + 0.5)  # pylint: disable=protected-access
  os.write(write_fd, bytes([signal.SIGTERM]))  # A person's second: exit at once.
  os.close(write_fd)
  watcher.join(5)
  os.close(read_fd)
  assert acted == [signal.SIGTERM, signal.SIGTERM]
