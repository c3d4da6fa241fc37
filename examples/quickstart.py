"""Quickstart: a jit-compiled data-parallel train step with jaxsync.

Runs as is on one machine with 8 fake CPU devices:

    python examples/quickstart.py

and unchanged across processes (comm="auto" picks MPI.COMM_WORLD):

    mpirun -n 2 python examples/quickstart.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # fake devices; drop this on GPUs

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync

mesh = Mesh(np.array(jax.local_devices()), ("local",))
tx = optax.chain(jaxsync.hierarchical_mean(axis_name="local"), optax.adam(5e-2))


def loss_fn(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def local_step(params, opt_state, x, y):
    # Runs once per device on its shard of the batch.
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)  # grads averaged here
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "local")


train_step = jax.jit(
    jax.shard_map(
        local_step,
        mesh=mesh,
        in_specs=(P(), P(), P("local"), P("local")),  # params replicated, batch split
        out_specs=(P(), P(), P()),
    )
)

params = {"w": jnp.zeros((4, 1)), "b": jnp.zeros(1)}
params = jaxsync.broadcast_params(params)  # every process starts from rank 0's values
params = jax.device_put(params, NamedSharding(mesh, P()))
opt_state = tx.init(params)

rng = np.random.default_rng(0)
true_w = np.array([[1.0], [-2.0], [3.0], [0.5]], np.float32)
for _step in range(200):
    x = rng.normal(size=(64, 4)).astype(np.float32)  # this process's part of the batch
    y = x @ true_w + 1.0
    params, opt_state, loss = train_step(params, opt_state, x, y)
    # Fake CPU devices only: keep one step in flight. XLA's in-process CPU
    # collectives can starve their thread pool with many steps queued on few
    # cores (plain lax.pmean hangs the same way). On GPUs drop this line.
    loss.block_until_ready()
print(f"loss {float(loss):.2e}, w {np.asarray(params['w']).ravel().round(2)}")
