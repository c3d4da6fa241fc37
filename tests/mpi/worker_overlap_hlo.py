"""The compiled step of overlap=True and double_buffering=True: what XLA keeps.

One device per process, plain ``jit``, parameters and state donated (as the
README writes a step). For each case the worker compiles the step and records,
from XLA's optimised module: the parameters of the step that the entry
computation copies (and of the state), the custom-call targets it runs and the
step's results (two steps, so the pending gradients are applied once). XLA:CPU drops
``lax.optimization_barrier`` before it schedules, so with a barrier the
optimizer update ran before the backward: every parameter was copied (the
backward still read it) and the backward's temporaries reused the memory of a
sum still in flight, so the backward waited for the network.
"""

import re

from _worker import Results, init


def main():
    ns, jax, MPI = init()
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxsync

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    res = Results(ns.out, rank)
    width, layers = 64, 4
    params = [
        {"w": jnp.full((width, width), 0.01 * (i + 1)), "b": jnp.zeros((width,))}
        for i in range(layers)
    ]
    x = jnp.full((8, width), float(rank + 1))

    def loss(p, x):
        h = x
        for layer in p:
            h = jnp.tanh(h @ layer["w"] + layer["b"])
        return jnp.mean(h**2)

    cases = {
        "double": dict(double_buffering=True),
        "overlap": dict(overlap=True, overlap_bucket_bytes=width * width * 4),
    }
    for name, kw in cases.items():
        opt = optax.chain(jaxsync.hierarchical_mean(None, comm, **kw), optax.sgd(0.1))

        def step(p, s, x):
            g = jax.grad(loss)(p, x)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        fn = jax.jit(step, donate_argnums=(0, 1))
        p = jax.tree.map(jnp.copy, params)
        s = opt.init(p)
        text = fn.lower(p, s, x).compile().as_text()
        entry = text[text.index("\nENTRY ") :]
        # The entry's parameters that hold the model's parameters (argument 0)
        # and the optimizer state (argument 1: double buffering's pending
        # gradients), and those the entry copies.
        n, m = len(jax.tree.leaves(p)), len(jax.tree.leaves(s))
        names = dict(re.findall(r"%(\S+) = \S+ parameter\((\d+)\)", entry))
        model = {v for v, i in names.items() if int(i) < n}
        state = {v for v, i in names.items() if n <= int(i) < n + m}
        copied = set(re.findall(r"= \S+ copy\(%(\S+?)\)", entry))
        res.add(f"{name}:params", len(model))
        res.add(f"{name}:state", len(state))
        res.add(f"{name}:copied_params", sorted(copied & model))
        res.add(f"{name}:copied_state", sorted(copied & state))
        res.add(f"{name}:targets", sorted(set(re.findall(r'custom_call_target="(\w+)"', text))))
        for _ in range(2):
            p, s = fn(p, s, x)
        res.add(f"{name}:result", [np.asarray(a) for a in jax.tree.leaves(p)])
    res.write()


if __name__ == "__main__":
    main()
