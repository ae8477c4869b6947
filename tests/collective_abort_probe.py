"""Stand-alone probe for XLA CPU collective aborts under different dispatch policies.

Not a pytest module (no ``test_`` prefix, no test functions). Run directly:

    python tests/collective_abort_probe.py --devices 4 --steps 3000 --sync async

It trains a tiny MLP data-parallel with ``jax.pmap(..., axis_name='i')`` and
``jax.lax.pmean`` of the grads on ``--devices`` fake CPU devices. ``--sync``
selects how the host waits on the device:

* ``async``:      never block inside the loop; fetch the loss only at the end.
* ``block_each``: ``jax.block_until_ready`` on every step's outputs.
* ``lag1``:       after dispatching step k, block on step k-1 (<= 2 in flight).
* ``lag2``:       after dispatching step k, block on step k-2 (<= 3 in flight).

``--lag N`` (diagnostic) overrides ``--sync``: block on step k-N after
dispatching step k, i.e. at most N+1 steps in flight.

On success it prints one ``RESULT`` line (steps/sec) and exits 0. A collective
abort inside XLA kills the process (non-zero exit code or signal).
"""

import argparse
import collections
import os
import sys
import time

_POLICIES = ("async", "block_each", "lag1", "lag2")
_LAG = {"async": None, "block_each": 0, "lag1": 1, "lag2": 2}


def _parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--steps", type=int, default=3000)
  parser.add_argument("--sync", choices=_POLICIES, default="async")
  parser.add_argument("--batch", type=int, default=32,
                      help="per-device batch size")
  parser.add_argument("--hidden", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--lag", type=int, default=None,
                      help="diagnostic: block on step k-LAG (overrides --sync)")
  parser.add_argument("--no-async-dispatch", action="store_true",
                      help="set jax_cpu_enable_async_dispatch=False")
  return parser.parse_args(argv)


def main(argv=None):
  args = _parse_args(argv)

  # Fake devices must be requested before JAX initialises its CPU backend.
  flags = os.environ.get("XLA_FLAGS", "")
  flags += f" --xla_force_host_platform_device_count={args.devices}"
  os.environ["XLA_FLAGS"] = flags.strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  if args.no_async_dispatch:
    jax.config.update("jax_cpu_enable_async_dispatch", False)

  n_dev = jax.local_device_count()
  if n_dev != args.devices:
    sys.exit(f"asked for {args.devices} devices, JAX sees {n_dev}")

  in_dim, out_dim, hidden = 16, 1, args.hidden
  lr = 1e-2

  def init(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (in_dim, hidden)) / jnp.sqrt(in_dim),
        "b1": jnp.zeros((hidden,)),
        "w2": jax.random.normal(k2, (hidden, out_dim)) / jnp.sqrt(hidden),
        "b2": jnp.zeros((out_dim,)),
    }

  def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    pred = h @ params["w2"] + params["b2"]
    return jnp.mean((pred - y) ** 2)

  def step(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    grads = jax.lax.pmean(grads, axis_name="i")
    loss = jax.lax.pmean(loss, axis_name="i")
    params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    return params, loss

  p_step = jax.pmap(step, axis_name="i", donate_argnums=(0,))

  key = jax.random.PRNGKey(args.seed)
  k_init, k_x, k_w = jax.random.split(key, 3)
  params = init(k_init)
  # Stack along a leading device axis and let an identity pmap place each
  # slice on its device (device_put_replicated/sharded are deprecated).
  to_devices = jax.pmap(lambda a: a)
  params = to_devices(jax.tree.map(
      lambda a: jnp.broadcast_to(a, (n_dev,) + a.shape), params))
  # A fixed on-device batch per device: the probe is about dispatch and
  # collectives, not input pipelines.
  x = jax.random.normal(k_x, (n_dev, args.batch, in_dim))
  true_w = jax.random.normal(k_w, (in_dim, out_dim))
  y = jnp.sin(x @ true_w)
  x, y = to_devices(x), to_devices(y)

  # Compile and run one step outside the timed region.
  params, loss = p_step(params, x, y)
  jax.block_until_ready((params, loss))

  lag = _LAG[args.sync] if args.lag is None else args.lag
  policy = args.sync if args.lag is None else f"lag{args.lag}"
  in_flight = collections.deque()
  start = time.perf_counter()
  for _ in range(args.steps):
    params, loss = p_step(params, x, y)
    if lag is None:
      continue
    if lag == 0:
      jax.block_until_ready((params, loss))
      continue
    # Block on a non-donated output (the loss) of an earlier step; the
    # params of that step have already been donated to a later one.
    in_flight.append(loss)
    while len(in_flight) > lag:
      jax.block_until_ready(in_flight.popleft())
  final_loss = float(loss[0])
  elapsed = time.perf_counter() - start

  print(f"RESULT sync={policy} devices={n_dev} steps={args.steps} "
        f"steps_per_sec={args.steps / elapsed:.1f} final_loss={final_loss:.4f}",
        flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
