"""One run at a time per checkpoint directory: locks held for a run's lifetime.

Two runs writing one `checkpoint_dir` would delete each other's temporary saves
and interleave metrics, so a run's chief locks `<checkpoint_dir>/<role>/run.lock`
per role it writes (`train`; `eval` or `eval_<name>`): an eval job runs beside
its training run, a second of either is refused naming the holder. The lock is
`flock`, released by the kernel however the holder dies; a name left in the
file means it ended without releasing, and the next run takes over with a warning.
"""

import contextlib
import datetime
import fcntl
import json
import os
import socket
from collections.abc import Iterator

from absl import logging

from jaxline_ng import errors


class RunLockError(RuntimeError, errors.OneLineError):
  """Another live run holds the lock; the message names it."""


def roles(mode: str) -> tuple[str, ...]:
  """The roles a run in `mode` locks (see the module docstring)."""
  if mode == "train":
    return ("train",)
  if mode == "train_eval_multithreaded":
    return ("train", "eval")
  return (mode,)


def _holder(fd: int) -> dict:
  """What the lock file says about its holder; {} if nothing readable."""
  try:
    data = os.pread(fd, 4096, 0)
    return json.loads(data) if data.strip() else {}
  except (OSError, ValueError):
    return {"unreadable": True}


def _describe(holder: dict) -> str:
  if not holder.get("pid"):
    return "an unknown process"
  return (f"process {holder['pid']} on host {holder.get('host', '?')} "
          f"(mode {holder.get('mode', '?')}, since {holder.get('since', '?')})")


def _acquire(path: str, role: str, mode: str) -> int:
  """Locks `path` and writes this process into it; returns the open descriptor."""
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    holder = _holder(fd)
    os.close(fd)
    raise RunLockError(
        f"config.checkpoint_dir={os.path.dirname(os.path.dirname(path))!r} is in use: "
        f"its {role} lock "
        f"({path}) is held by {_describe(holder)}; wait for that run to end, or use "
        "another checkpoint_dir") from None
  except BaseException:
    os.close(fd)
    raise
  previous = _holder(fd)
  if previous:
    logging.warning("[jaxline_ng] Taking over the %s lock %s from %s, which ended without "
                    "releasing it.", role, path, _describe(previous))
  me = {"host": socket.gethostname(), "pid": os.getpid(), "mode": mode,
        "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
  os.ftruncate(fd, 0)
  os.pwrite(fd, json.dumps(me).encode(), 0)
  return fd


def _release(fd: int) -> None:
  # Emptied before unlocking: a name left in the file means "died holding it".
  # The file itself stays: deleting it would let a run waiting on the old
  # file and one creating a new file both hold "the" lock.
  try:
    os.ftruncate(fd, 0)
  finally:
    os.close(fd)  # Closing the last descriptor releases the flock.


def holder(checkpoint_dir: str, role: str) -> str | None:
  """Who holds (or died holding) `role`'s lock on `checkpoint_dir`, or None; read only."""
  try:
    fd = os.open(os.path.join(checkpoint_dir, role, "run.lock"), os.O_RDONLY)
  except FileNotFoundError:
    return None
  try:
    facts = _holder(fd)
  finally:
    os.close(fd)
  return _describe(facts) if facts else None


@contextlib.contextmanager
def held(checkpoint_dir: str, mode: str) -> Iterator[None]:
  """Holds the locks a run in `mode` takes on `checkpoint_dir` within the block.

  Raises RunLockError naming the holder if another live process has one.
  """
  fds = []
  try:
    for role in roles(mode):
      os.makedirs(os.path.join(checkpoint_dir, role), exist_ok=True)
      fds.append(_acquire(os.path.join(checkpoint_dir, role, "run.lock"), role, mode))
    yield
  finally:
    for fd in reversed(fds):
      _release(fd)
