"""xla_cpu: XLA's CPU thread pool is sized before JAX starts, with nothing set by the user."""

import os
import subprocess
import sys

import pytest
from helpers import ENV, TOY, run

from jaxline_ng import xla_cpu

_THREADS = ("import os, glob, jax, jax.numpy as jnp\n"
            "jax.pmap(lambda x: jax.lax.psum(x, 'i'), 'i')(jnp.ones(jax.local_device_count()))\n"
            "names = [open(f).read().strip() for f in glob.glob('/proc/self/task/*/comm')]\n"
            "print(os.environ.get('PJRT_NPROC'), names.count('tf_XLAEigen'))\n")


def run_python(code, **env):
  clean = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC", "XLA_FLAGS")}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**clean, "JAX_PLATFORMS": "cpu", **env}, check=True)
  return out.stdout.split()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_importing_jaxline_ng_gives_xlas_pool_room_for_collectives():
  flags = "--xla_force_host_platform_device_count=4"
  expected = str(max(os.cpu_count(), xla_cpu.THREADS_PER_DEVICE * 4))
  assert run_python("import jaxline_ng.utils\n" + _THREADS, XLA_FLAGS=flags) == \
      [expected, expected]
  # Without jaxline_ng, XLA sizes the pool by the CPUs or the devices: too small.
  assert run_python(_THREADS, XLA_FLAGS=flags) == ["None", str(max(os.cpu_count(), 4))]


def test_a_users_pjrt_nproc_is_kept():
  code = "import os, jaxline_ng; print(os.environ['PJRT_NPROC'])"
  assert run_python(code, XLA_FLAGS="--xla_force_host_platform_device_count=4",
                    PJRT_NPROC="5") == ["5"]


def test_one_device_leaves_the_pool_alone():
  assert run_python("import os, jaxline_ng; print(os.environ.get('PJRT_NPROC'))") == ["None"]


def test_devices_asked_for_in_code_after_import_are_counted_before_the_backend_starts():
  code = ("import os, jax, jaxline_ng\n"
          "jax.config.update('jax_num_cpu_devices', 6)\n"
          "from jaxline_ng import xla_cpu; xla_cpu.reserve_threads()\n"
          "print(os.environ['PJRT_NPROC'], jax.local_device_count())")
  assert run_python(code) == [str(max(os.cpu_count(), xla_cpu.THREADS_PER_DEVICE * 6)), "6"]


_LATE_IMPORT = """
import functools, sys
import jax, jax.numpy as jnp
jnp.ones(4).block_until_ready()  # The backend starts, as in a script that builds data at import.
sys.path.insert(0, "tests/experiments")
import toy
from absl import app
from jaxline_ng import platform
app.run(functools.partial(platform.main, toy.Experiment))
"""


@pytest.mark.parametrize("pjrt_nproc", [None, "24"])
def test_a_backend_started_before_jaxline_ng_is_refused_unless_its_pool_was_sized(
    tmp_path, pjrt_nproc):
  # Its pmap step ran on XLA's default pool, one thread per device, and
  # aborted in a collective after 40 s (exit 134), or hung.
  env = {k: v for k, v in ENV.items() if k not in ("PJRT_NPROC", "NPROC")}
  env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4",
             **({"PJRT_NPROC": pjrt_nproc} if pjrt_nproc else {}))
  result = run([sys.executable, "-c", _LATE_IMPORT, f"--config={TOY}",
                f"--config.checkpoint_dir={tmp_path}", "--config.training_steps=3"], env=env)
  if pjrt_nproc:
    assert result.returncode == 0, result.stderr[-4000:]
  else:
    assert result.returncode == 1, result.stderr[-4000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "jaxline_ng: error: JAX's CPU backend started before jaxline_ng was imported, with "
        "XLA's default thread pool, too small for collectives over 4 CPU devices (they can "
        "abort or hang): set PJRT_NPROC=24 in the environment, or import jaxline_ng before the "
        "program first uses JAX")
