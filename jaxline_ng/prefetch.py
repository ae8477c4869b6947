"""Feeding batches to the devices ahead of the step that needs them."""

import atexit
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax

from jaxline_ng import devices

_END = object()
# How long the interpreter's exit waits for a producer to stop.
_STOP_AT_EXIT_SECS = 10.0
# The stop events and threads of producers still running.
_producers: set[tuple[threading.Event, threading.Thread]] = set()


@atexit.register
def _stop_producers() -> None:
  # A daemon thread inside native code at finalisation aborts the process
  # (exit 134): producers stop between items, so this waits for one item.
  for stop, _ in list(_producers):
    stop.set()
  for _, thread in list(_producers):
    thread.join(timeout=_STOP_AT_EXIT_SECS)


def py_prefetch(iterable_function: Callable[[], Iterable[Any]], buffer_size: int = 5, *,
                thread_name: str | None = None) -> Iterator[Any]:
  """Iterates `iterable_function()` on a background thread, `buffer_size` ahead.

  As in jaxline, `buffer_size` counts the element the consumer holds (at least
  2). The producer's exception is raised again by the consumer's `next()`.
  """
  if buffer_size <= 1:
    raise ValueError(f"py_prefetch: buffer_size={buffer_size} must be > 1 (it counts the "
                     "element in use, as in jaxline)")
  buffer: queue.Queue = queue.Queue(maxsize=buffer_size - 1)
  stop = threading.Event()

  def produce():
    try:
      for item in iterable_function():
        while not stop.is_set():
          try:
            buffer.put(item, timeout=0.1)
            break
          except queue.Full:
            continue
        if stop.is_set():
          return
      buffer.put(_END)
    except BaseException as e:  # pylint: disable=broad-except  (re-raised by the consumer)
      buffer.put(e)

  producer = (stop, threading.Thread(target=produce, name=thread_name or "py_prefetch",
                                     daemon=True))
  running = _producers  # Held here: a generator closed as the interpreter ends outlives globals.
  running.add(producer)
  producer[1].start()
  try:
    while True:
      item = buffer.get()
      if item is _END:
        return
      if isinstance(item, BaseException):
        raise item
      yield item
  finally:
    stop.set()
    running.discard(producer)


def double_buffer(ds: Iterable[Any]) -> Iterator[Any]:
  """Puts each batch (leading axis: the local devices) on the devices one step early."""
  batches = iter(ds)
  try:
    next_on_device = devices.put_per_device(next(batches))
  except StopIteration:
    return
  for batch in batches:
    on_device, next_on_device = next_on_device, devices.put_per_device(batch)
    yield on_device
  yield next_on_device


def double_buffer_on_gpu(ds: Iterable[Any]) -> Iterator[Any]:
  """`double_buffer` on GPU, where transfers are worth overlapping; `ds` itself elsewhere."""
  if jax.default_backend() == "gpu":
    return double_buffer(ds)
  return ds
