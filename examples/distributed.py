"""The char transformer trained data parallel on N processes (jax.distributed).

Each process is a real ``jax.distributed`` process with its own devices; the
mesh spans all of them. The run is ZeRO-1 (the optimizer state split over
every device of every process) with gradients summed in fp32
(``reduce=float32``), bf16 params with an fp32 master. ``--processes 2
--devices-per-process 4`` spawns the processes on this machine (loopback,
CPU devices, gloo collectives), so it runs anywhere; on a GPU cluster start
one process per host with ``--coordinator``, ``--process-id`` and
``--processes`` instead.

  python examples/distributed.py --processes 2 --devices-per-process 4
  python examples/distributed.py --processes 1 --devices-per-process 8  # the same run
  python examples/distributed.py --poison-step 3 --poison-process 1    # inf on one process
  python examples/distributed.py --ckpt-dir /tmp/ckpt                  # 8 devices save...
  python examples/distributed.py --processes 1 --devices-per-process 4 \
      --restore /tmp/ckpt --steps 0                                    # ... 4 restore

Every process draws the same global batches and feeds the shards its devices
own, so the run does not depend on how devices are split into processes.
``--poison-step`` puts an inf into the loss of ``--poison-process``'s share
of one batch: every process must skip that step. Process 0 prints the losses
and writes ``--out`` (JSON: losses, skipped steps, a checksum of the params).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import time



def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--devices-per-process", type=int, default=4)
  parser.add_argument("--process-id", type=int, default=None,
                      help="set by the launcher (or by you, one per host)")
  parser.add_argument("--coordinator", default=None,
                      help="host:port of process 0 (default: a free local port)")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--global-batch", type=int, default=16)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--depth", type=int, default=2,
                      help="transformer blocks of the char transformer")
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--policy", default="p=bf16,c=bf16,o=f32,reduce=float32")
  parser.add_argument("--poison-step", type=int, default=-1)
  parser.add_argument("--poison-process", type=int, default=1)
  parser.add_argument("--out", default=None, help="process 0 writes JSON here")
  parser.add_argument("--ckpt-dir", default=None,
                      help="save the final state here (orbax, every process "
                           "writes its own shards)")
  parser.add_argument("--restore", default=None,
                      help="start from the state saved in this directory, "
                           "laid out on this run's mesh (any device count)")
  parser.add_argument("--timeout", type=float, default=600)
  args = parser.parse_args(argv)
  if args.steps < 0:
    parser.error(f"--steps must be >= 0, got {args.steps}")
  for name in ("processes", "devices_per_process", "global_batch", "depth"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got "
                   f"{getattr(args, name)}")
  devices = args.processes * args.devices_per_process
  if args.global_batch % devices:
    parser.error(f"--global-batch {args.global_batch} must split evenly over "
                 f"{devices} devices")
  return args


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(args, argv) -> int:
  """Spawns one process per ``--processes`` on this machine and waits."""
  coordinator = args.coordinator or f"127.0.0.1:{free_port()}"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                      f"device_count={args.devices_per_process}").strip()
  children = [subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), *argv,
       "--process-id", str(i), "--coordinator", coordinator], env=env)
      for i in range(args.processes)]
  deadline = time.monotonic() + args.timeout
  codes = []
  for child in children:
    try:
      codes.append(child.wait(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
      for other in children:
        other.kill()
      raise RuntimeError(f"a process ran past --timeout {args.timeout:g} s")
  if any(codes):
    raise RuntimeError(f"processes exited with {codes}")
  return 0


def train(args) -> dict:
  import jax
  jax.distributed.initialize(args.coordinator, num_processes=args.processes,
                             process_id=args.process_id)
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import orbax.checkpoint as ocp

  import jmp_lab
  from jmp_lab import linen as jl
  from jax.experimental import multihost_utils

  def state_digest(state) -> str:
    """sha256 of every array of the state, gathered whole (equal in every
    process, whatever the mesh)."""
    digest = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(state):
      whole = multihost_utils.process_allgather(leaf, tiled=True)
      digest.update(np.ascontiguousarray(whole).tobytes())
    return digest.hexdigest()

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import char_transformer as ct

  devices = np.array(jax.devices())
  mesh = Mesh(devices, ("data",))
  policy = jmp_lab.get_policy(args.policy)
  model = jl.with_policy(ct.CharTransformer(max_len=args.seq_len,
                                            depth=args.depth, dropout=0.0),
                         policy)
  params = model.init(jax.random.key(0),
                      jnp.zeros((1, args.seq_len), jnp.int32))["params"]
  tx = jmp_lab.mixed_precision(
      optax.adamw(args.lr, weight_decay=0.01), policy=policy,
      loss_scale=jmp_lab.DynamicLossScale(2.0**15, growth_interval=100))
  state = jmp_lab.TrainState.create(apply_fn=model.apply, params=params,
                                    tx=tx, policy=policy)
  layout = jmp_lab.sharding.state_shardings(state, mesh)
  state = jax.device_put(state, layout)
  batch_sharding = NamedSharding(mesh, P("data"))
  restored_digest = None
  if args.restore:
    # The saved arrays, laid out on *this* mesh: orbax reads each device's
    # part of every array, whatever mesh wrote it.
    target = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        state, layout)
    with ocp.StandardCheckpointer() as checkpointer:
      state = checkpointer.restore(os.path.abspath(args.restore), target)
    restored_digest = state_digest(state)

  def loss_fn(params, state, batch):
    logits = state.apply_fn({"params": params}, batch["tokens"][:, :-1])
    losses = jl.softmax_cross_entropy_with_integer_labels(
        logits, batch["tokens"][:, 1:]).mean(axis=-1)
    return jnp.mean(losses * batch["weight"])

  step = jmp_lab.make_train_step(loss_fn, state_sharding=layout,
                                 batch_sharding=batch_sharding)
  tokens = ct.load_tokens(None)
  window = args.seq_len + 1
  per_process = args.global_batch // args.processes
  rng = np.random.default_rng(0)  # the same global batches in every process
  losses = []
  for i in range(args.steps):
    starts = rng.integers(0, len(tokens) - window, args.global_batch)
    batch = {"tokens": np.stack([tokens[s:s + window] for s in starts]),
             "weight": np.ones(args.global_batch, np.float32)}
    if i == args.poison_step:
      lo = args.poison_process * per_process
      batch["weight"][lo:lo + per_process] = np.inf
    # Each process hands over only the rows its own devices hold.
    global_batch = {k: jax.make_array_from_callback(
        v.shape, batch_sharding, lambda index, v=v: v[index])
        for k, v in batch.items()}
    state, metrics = step(state, global_batch)
    losses.append(float(metrics["loss"]))
  if args.ckpt_dir:
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(os.path.abspath(args.ckpt_dir), state, force=True)
      checkpointer.wait_until_finished()
  params = jax.tree_util.tree_map(lambda x: np.asarray(x.addressable_data(0)),
                                  state.params)
  leaves = jax.tree_util.tree_leaves(params)
  digest = hashlib.sha256(b"".join(np.ascontiguousarray(x).tobytes()
                                   for x in leaves)).hexdigest()
  result = {"processes": args.processes,
            "devices": len(devices), "losses": losses,
            "skipped_steps": int(state.skipped_steps),
            "params_sha256": digest,
            "params_abs_sum": float(sum(np.abs(x.astype(np.float64)).sum()
                                        for x in leaves)),
            "opt_state_bytes_per_device": jmp_lab.sharding.bytes_per_device(
                state.opt_state),
            "state_sha256": state_digest(state),
            "restored_state_sha256": restored_digest}
  jax.distributed.shutdown()
  return result


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.process_id is None:
    return launch(args, argv)
  result = train(args)
  if args.process_id == 0:
    print(f"{result['processes']} processes x "
          f"{result['devices'] // result['processes']} devices: losses "
          + " ".join(f"{x:.3f}" for x in result["losses"])
          + f"; skipped {result['skipped_steps']}; optimizer state "
          f"{result['opt_state_bytes_per_device'] / 2**20:.2f} MiB/device")
    if args.out:
      with open(args.out, "w") as f:
        json.dump(result, f)
  return result


if __name__ == "__main__":
  main()
