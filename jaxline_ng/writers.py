"""Metric writers: the protocols, fan-out, a background writer and an adapter.

A run logs through `make_writer`: an `AsyncWriter` around the TensorBoard and
JSONL writers of `metric_files`, so the loop only enqueues. `adapt` gives any
writer of jaxline's protocol the `flush`, `close` and `resume` the loop calls.
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

# Absorbs a slow flush; the device buffers queued writes hold stay negligible.
_DEFAULT_MAX_QUEUE_SIZE = 128
# AsyncWriter flushes after this long idle, so what was written shows while the run goes on.
_IDLE_FLUSH_SECONDS = 0.5


class Writer(Protocol):
  """jaxline's writer protocol: sink for metrics, keyed by training step.

  Values may be Python numbers, NumPy values or `jax.Array`s; names may contain
  `/`. jaxline_ng's writers also have `write_histograms` and `write_texts`.
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
  """A writer of jaxline's protocol as a `RunWriter`: every call is passed on; `flush`,
  `close` and `resume` do nothing where it lacks them (it keeps what it wrote)."""

  def __init__(self, writer: Writer):
    self.wrapped = writer
    self._flush = getattr(writer, "flush", lambda: None)
    self._close = getattr(writer, "close", lambda: None)
    self._resume = getattr(writer, "resume", lambda global_step, **kwargs: None)

  def write_scalars(self, global_step: int, scalars: Mapping[str, Any]) -> None:
    self.wrapped.write_scalars(global_step, scalars)

  def write_images(self, global_step: int, images: Mapping[str, Any]) -> None:
    self.wrapped.write_images(global_step, images)

  def write_histograms(self, global_step: int, values: Mapping[str, Any]) -> None:
    self.wrapped.write_histograms(global_step, values)

  def write_texts(self, global_step: int, texts: Mapping[str, str]) -> None:
    self.wrapped.write_texts(global_step, texts)

  def flush(self) -> None:
    self._flush()

  def close(self) -> None:
    self._close()

  def resume(self, global_step: int, **kwargs: Any) -> None:
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
  """What the caller's thread raises for `error` of a background write."""
  if isinstance(error, errors.OneLineError):
    return WriterErrorInOneLine(f"metric writing failed: {error}")
  return WriterError(f"Background metric writing failed: {error!r}")


class MultiWriter:
  """Forwards every call to each of several writers (`adapt`ed), in order: each is
  called even if an earlier one raises; the first error is raised, others as notes."""

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


# On the host already: passed on without `jax.device_get`, which walks the row.
_HOST_TYPES = (int, float, str, np.ndarray, np.generic)


class AsyncWriter:
  """Runs a synchronous writer (`adapt`ed) on a `background.Worker`'s thread.

  The caller only enqueues a shallow copy of each mapping (NumPy arrays passed
  must not be mutated after); the worker reads device values to the host and
  writes, in call order. Once `max_queue_size` calls are pending, writing
  blocks. A failed write fails the writer for good: every later call raises a
  `WriterError` whose `__cause__` is the error. `close` is registered with
  `atexit`, so queued writes reach disk at normal exit.

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
    """Queued, not waited for: it runs before every later write."""
    self._submit(functools.partial(self._writer.resume, **kwargs), global_step)

  def flush(self) -> None:
    """Blocks until every earlier write is on disk (once closed: re-raises a failure)."""
    if not self._closed:
      self._worker.submit(self._writer.flush)
    self._worker.wait()

  def close(self) -> None:
    """Writes out everything queued, stops the worker, then closes the wrapped writer
    (even after a failure, to release its files)."""
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
  """The writer a run logs through: TensorBoard plus `metrics.jsonl` in `logdir`.

  Construction does no I/O and does not import TensorFlow.

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
