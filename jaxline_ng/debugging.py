"""Debugging switches: running pmap/jit eagerly, and post-mortem on failure.

Under `--jaxline_disable_pmap_jit` (alias `--disable_pmap_jit`) the loops run
inside chex's `fake_pmap_and_jit`, as in jaxline, and `jax.disable_jit()`: pmaps
and jits created then become a vmap and a plain call; those created earlier (at
import time) run op by op. jaxline_ng's own device helpers (`compiled`) stay
compiled: the switch is for the experiment's code.
"""

import contextlib
import functools
import pdb
import sys

import jax
from absl import flags, logging

_DISABLE_PMAP_JIT = flags.DEFINE_bool(
    "jaxline_disable_pmap_jit", False,
    "Run pmap and jit eagerly so breakpoints inside steps see concrete values.")
flags.DEFINE_alias("disable_pmap_jit", "jaxline_disable_pmap_jit")
_POST_MORTEM = flags.DEFINE_bool(
    "jaxline_post_mortem", False,
    "Enter pdb's post-mortem debugger when the run raises an exception.")


def pmap_jit_disabled() -> bool:
  # The flag's own value, parsed or set by `flagsaver` in a test that never
  # parses the command line (reading it through FLAGS would raise there).
  return flags.FLAGS[_DISABLE_PMAP_JIT.name].value


# Whether a body runs under the switch already (on any thread): chex's patch
# of `jax.pmap` is process-wide, and `train` under `platform.main` enters twice.
_entered: list[bool] = []


@contextlib.contextmanager
def eager_if_requested():
  """Runs the body eagerly (chex's fake pmap and jit, and `jax.disable_jit()`)
  when the flag asks for it; inside a body that already does, as it is."""
  if not pmap_jit_disabled():
    yield
    return
  if _entered:
    # chex's patch holds for the process, `disable_jit` for one thread: the
    # trainer thread of train_eval_multithreaded enters its own.
    with jax.disable_jit():
      yield
    return
  import chex  # pylint: disable=import-outside-toplevel  (only debugging runs pay its import)
  logging.warning(
      "[jaxline_ng] --jaxline_disable_pmap_jit: pmap and jit run eagerly (pmaps created "
      "before the run, e.g. at import time, op by op: slow). Functions compiled ahead of time "
      "with .lower().compile() still run compiled.")
  _entered.append(True)
  try:
    with chex.fake_pmap_and_jit(), jax.disable_jit():
      yield
  finally:
    _entered.pop()


def disable_pmap_jit(fn):
  """Decorator: runs `fn` eagerly when `--jaxline_disable_pmap_jit` is set."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with eager_if_requested():
      return fn(*args, **kwargs)

  return wrapped


def compiled(fn=None, /, **jit_kwargs):
  """`jax.jit(fn, **jit_kwargs)` that stays compiled under `--jaxline_disable_pmap_jit`,
  for jaxline_ng's own device helpers, which no user steps through."""
  if fn is None:
    return functools.partial(compiled, **jit_kwargs)
  jitted = jax.jit(fn, **jit_kwargs)

  @functools.wraps(fn)
  def call(*args, **kwargs):
    with jax.disable_jit(False):
      return jitted(*args, **kwargs)

  call.jitted = jitted  # For `lower`, and its compilation cache.
  return call


def debugger_fallback(f):
  """Decorator: on an exception, opens pdb post-mortem if `--jaxline_post_mortem`."""

  @functools.wraps(f)
  def wrapped(*args, **kwargs):
    try:
      return f(*args, **kwargs)
    except Exception:
      if flags.FLAGS.is_parsed() and _POST_MORTEM.value:
        pdb.post_mortem(sys.exc_info()[2])
      raise

  return wrapped
