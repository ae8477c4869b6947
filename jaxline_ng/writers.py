"""Metric writers: the protocols, fan-out, a background writer and an adapter.

A run logs through `make_writer`, which returns an `AsyncWriter` around the
TensorBoard and JSONL writers of `metric_files`. The training loop only
enqueues: converting device arrays to host memory, importing TensorFlow and
touching the disk all happen on one background thread, while a bounded
queue keeps a slow disk from growing memory without limit. Failures of that
thread surface on the training thread at its next call, and queued data is
written out at normal interpreter exit.

The loop flushes, closes and resumes its writers; jaxline's protocol asks
only for two writes. `adapt` turns any writer into a `RunWriter`, so the
loop calls those methods without asking whether they exist.
"""

import atexit
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from jaxline_ng import background, errors
from jaxline_ng.metric_files import (
    JsonlWriter,
    MetricsWriteError,
    TensorBoardWriter,
    WriteInputError,
    to_step,
)

__all__ = ["AsyncWriter", "JsonlWriter", "MetricsWriteError", "MultiWriter", "RunWriter",
           "TensorBoardWriter", "WriteInputError", "Writer", "WriterAdapter", "WriterError",
           "adapt", "make_writer"]

# Enough to absorb a slow flush without stalling training, while the device
# buffers referenced by queued writes stay negligible.
_DEFAULT_MAX_QUEUE_SIZE = 128

# AsyncWriter flushes its writer after this long without work, so what was
# written shows in TensorBoard and metrics.jsonl while the run goes on.
_IDLE_FLUSH_SECONDS = 0.5


class Writer(Protocol):
  """jaxline's writer protocol: sink for metrics, keyed by training step.

  Values may be Python numbers, NumPy arrays or scalars, or `jax.Array`s
  (possibly still being computed). Names may contain `/`, e.g. `score/eval`.
  jaxline_ng's writers also have `write_histograms(step, {name: array})` and
  `write_texts(step, {name: str})` (TensorBoard renders text as Markdown).
  """

  def write_scalars(self, global_step: int, scalars: Mapping[str, Any]) -> None:
    """Writes scalars: 0-d values or arrays of shape [1]."""

  def write_images(self, global_step: int, images: Mapping[str, Any]) -> None:
    """Writes images of shape [H, W], [H, W, C] or [B, H, W, C].

    Pixels are floats in [0, 1] or uint8; C is 1, 3 or 4.
    """


@runtime_checkable
class RunWriter(Writer, Protocol):
  """What the training loop needs of a writer: jaxline's two writes and these."""

  def flush(self) -> None:
    """Returns once everything written so far is on disk."""

  def close(self) -> None:
    """Flushes and releases resources; calling it again has no effect."""

  def resume(self, global_step: int, *, set_aside_past: int | None = None) -> None:
    """Drops what an interrupted run wrote past `global_step` (see `JsonlWriter.resume`)."""


class WriterAdapter:
  """A writer of jaxline's protocol as a `RunWriter`.

  Every write is passed on (a writer without `write_histograms` or
  `write_texts` raises AttributeError for them, as it would unwrapped), as
  are `flush`, `close` and `resume` where the writer has them; where it
  does not, they do nothing: a jaxline writer keeps what it wrote.
  """

  def __init__(self, writer: Writer):
    self.wrapped = writer
    self._flush = getattr(writer, "flush", None)
    self._close = getattr(writer, "close", None)
    self._resume = getattr(writer, "resume", None)

  def write_scalars(self, global_step: int, scalars: Mapping[str, Any]) -> None:
    self.wrapped.write_scalars(global_step, scalars)

  def write_images(self, global_step: int, images: Mapping[str, Any]) -> None:
    self.wrapped.write_images(global_step, images)

  def write_histograms(self, global_step: int, values: Mapping[str, Any]) -> None:
    self.wrapped.write_histograms(global_step, values)

  def write_texts(self, global_step: int, texts: Mapping[str, str]) -> None:
    self.wrapped.write_texts(global_step, texts)

  def flush(self) -> None:
    if self._flush is not None:
      self._flush()

  def close(self) -> None:
    if self._close is not None:
      self._close()

  def resume(self, global_step: int, **kwargs: Any) -> None:
    if self._resume is not None:
      self._resume(global_step, **kwargs)


def adapt(writer: Writer | None) -> RunWriter | None:
  """`writer` as a `RunWriter`: itself if it is one, else in a `WriterAdapter`.

  Args:
    writer: a writer of jaxline's protocol or more, or None (a process that
      writes nothing).

  Returns:
    A writer with `flush`, `close` and `resume`, or None for None.
  """
  if writer is None or isinstance(writer, RunWriter):
    return writer
  return WriterAdapter(writer)


class WriterError(RuntimeError):
  """A background write failed; `__cause__` is the original exception."""


class WriterErrorInOneLine(WriterError, errors.OneLineError):
  """A background write failed with an error whose message says it all (naming the file)."""


def _background_failure(error: BaseException) -> WriterError:
  """What the caller's thread raises for `error` of a background write: one
  line (naming the file) when `error` says all there is to say."""
  if isinstance(error, errors.OneLineError):
    return WriterErrorInOneLine(f"metric writing failed: {error}")
  return WriterError(f"Background metric writing failed: {error!r}")


class MultiWriter:
  """Forwards every call to each of several writers (`adapt`ed), in order.

  Every writer is called even if an earlier one raises, so one broken sink
  neither starves the others nor keeps them open; the first exception is
  then re-raised, with the others attached as notes.
  """

  def __init__(self, writers: Sequence[Writer]):
    self._writers = tuple(adapt(writer) for writer in writers)

  def _call_all(self, method: str, *args: Any, **kwargs: Any) -> None:
    errors = []
    for writer in self._writers:
      try:
        getattr(writer, method)(*args, **kwargs)
      except Exception as e:
        errors.append(e)
    if errors:
      for other in errors[1:]:
        errors[0].add_note(f"Another writer also failed: {other!r}")
      raise errors[0]

  def write_scalars(self, global_step: int, scalars: Mapping[str, Any]) -> None:
    self._call_all("write_scalars", global_step, scalars)

  def write_images(self, global_step: int, images: Mapping[str, Any]) -> None:
    self._call_all("write_images", global_step, images)

  def write_histograms(self, global_step: int, values: Mapping[str, Any]) -> None:
    self._call_all("write_histograms", global_step, values)

  def write_texts(self, global_step: int, texts: Mapping[str, str]) -> None:
    self._call_all("write_texts", global_step, texts)

  def flush(self) -> None:
    self._call_all("flush")

  def resume(self, global_step: int, **kwargs: Any) -> None:
    self._call_all("resume", global_step, **kwargs)

  def close(self) -> None:
    self._call_all("close")


# Values of these types are on the host already: the writer thread passes
# them on without `jax.device_get`, which walks the row (logging every step
# writes a row a step).
_HOST_TYPES = (int, float, str, np.ndarray, np.generic)


class AsyncWriter:
  """Runs a synchronous writer (`adapt`ed) on a `background.Worker`'s thread.

  The calling thread only enqueues (a shallow copy of the mapping: NumPy
  arrays passed in must not be mutated afterwards). The worker's thread
  moves device values to host memory with `jax.device_get` and calls the
  wrapped writer, so writes land in call order. Once `max_queue_size` calls are
  pending, writing blocks until the worker catches up.

  If the wrapped writer raises, this writer is failed for good: later writes
  are dropped, and every later `write_*`, `flush` and `close` raises a
  `WriterError` whose `__cause__` is the original exception.

  Queued writes reach disk at normal interpreter exit: `close` is registered
  with `atexit`, so it runs once all non-daemon threads are done writing.
  Before that, as the main thread ends, the worker writes out everything
  queued so far, because the first write may import TensorFlow, and
  libraries it loads (h5py) crash the interpreter if imported during `atexit`.

  `close` may run in a signal handler that interrupted the training thread
  mid-write (see `background`). A write racing with `close` may be dropped.

  Args:
    writer: the writer to run in the background.
    max_queue_size: how many calls may be pending before writing blocks.
    prepare: called first on the worker's thread, so that slow set-up
      (TensorFlow's import) happens while the run starts, not at its first write.
  """

  def __init__(self, writer: Writer, *, max_queue_size: int = _DEFAULT_MAX_QUEUE_SIZE,
               prepare: Callable[[], None] | None = None):
    self._writer = adapt(writer)
    self._closed = False
    self._worker = background.Worker(
        "jaxline_ng-writer", max_pending=max_queue_size,
        on_idle=(_IDLE_FLUSH_SECONDS, self._writer.flush),
        raise_as=_background_failure)
    if prepare is not None:
      self._worker.submit(prepare)
    atexit.register(self.close)

  def _submit(self, fn: Callable[..., None], *args: Any) -> None:
    if self._closed:
      raise ValueError("Cannot write to a closed AsyncWriter.")
    self._worker.submit(fn, *args)

  def write_scalars(self, global_step: int, scalars: Mapping[str, Any]) -> None:
    self._submit(_write, self._writer.write_scalars, global_step, dict(scalars))

  def write_images(self, global_step: int, images: Mapping[str, Any]) -> None:
    self._submit(_write, self._writer.write_images, global_step, dict(images))

  def write_histograms(self, global_step: int, values: Mapping[str, Any]) -> None:
    self._submit(_write, self._writer.write_histograms, global_step, dict(values))

  def write_texts(self, global_step: int, texts: Mapping[str, str]) -> None:
    self._submit(_write, self._writer.write_texts, global_step, dict(texts))

  def resume(self, global_step: int, **kwargs: Any) -> None:
    """Has the wrapped writer drop what an interrupted run wrote past
    `global_step` (see `JsonlWriter.resume`, `TensorBoardWriter.resume`).

    Queued, not waited for: it runs before every later write, and the
    run's start does not wait for TensorFlow's import, which precedes it.
    """
    self._submit(functools.partial(self._writer.resume, **kwargs), global_step)

  def flush(self) -> None:
    """Blocks until every earlier write is on disk.

    Once closed, everything is on disk already, so this only re-raises a
    failure.
    """
    if not self._closed:
      self._worker.submit(self._writer.flush)
    self._worker.wait()

  def close(self) -> None:
    """Writes out everything queued, stops the worker, then closes the wrapped writer.

    The wrapped writer is closed on this thread (the worker's has ended),
    even after a failure, to release its files.
    """
    if self._closed:
      self._worker.close()  # Only re-raises a failure.
      return
    self._closed = True
    atexit.unregister(self.close)
    try:
      self._worker.close()
    finally:
      self._writer.close()


def _write(write: Callable[[int, Any], None], global_step: Any, values: dict[str, Any]) -> None:
  """On the worker's thread: copies device values to the host, then calls `write`."""
  if not all(isinstance(value, _HOST_TYPES) for value in values.values()):
    global_step, values = jax.device_get((global_step, values))
  write(to_step(global_step), values)


def make_writer(logdir: str, *, use_async: bool = True, tensorboard: bool = True) -> RunWriter:
  """The writer a run logs through: TensorBoard plus `metrics.jsonl`.

  Both go to `logdir`. With `use_async`, they run behind an `AsyncWriter`.
  Construction does no I/O and does not import TensorFlow; a bad `logdir`
  is reported by the first write (or, asynchronously, the call after it).

  Args:
    logdir: the directory both write to.
    use_async: write on a background thread.
    tensorboard: write TensorBoard event files; False writes `metrics.jsonl`
      alone and never imports TensorFlow.

  Returns:
    The writer.
  """
  sinks = [JsonlWriter(os.path.join(logdir, "metrics.jsonl"))]
  if tensorboard:
    sinks.insert(0, TensorBoardWriter(logdir))
  writer = MultiWriter(sinks)
  if not use_async:
    return writer
  return AsyncWriter(writer, prepare=sinks[0].prepare if tensorboard else None)
