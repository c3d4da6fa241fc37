# Doctests in jaxsync/ run with 8 fake CPU devices, like the tests.
import jax

jax.config.update("jax_num_cpu_devices", 8)
