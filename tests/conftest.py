"""Test set-up shared by every test module.

Two CPU devices, so that cross-device behaviour (shard_map, NamedSharding)
is exercised without a GPU. This must run before JAX initialises a backend.
"""

import chex
import hypothesis

chex.set_n_cpu_devices(2)

# Compilation makes the first example of a property test slow; deadlines would
# only measure XLA. Derandomize in CI so a failure is reproducible from the log.
hypothesis.settings.register_profile("default", deadline=None, max_examples=50)
hypothesis.settings.register_profile(
    "ci", deadline=None, max_examples=50, derandomize=True,
    print_blob=True)
import os  # noqa: E402

hypothesis.settings.load_profile("ci" if os.environ.get("CI") else "default")
