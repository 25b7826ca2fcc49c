"""Train a small expert-parallel MoE language model, character level, on the Python standard library's sources.

    python examples/train_moe.py --steps 150 --out runs/demo

Without GPUs it runs on 4 simulated CPU devices (EP=4); with GPUs it uses them (EP = their number, or --ep).
Writes DIR/params.npz + DIR/meta.json (the checkpoint decode_moe.py reads), DIR/loss.png and DIR/metrics.json.

Several processes (one machine or several hosts): every process runs this script with --coordinator HOST:PORT
--num-processes N --process-id I (examples/launch.py does it for N local processes; under SLURM / Open MPI plain
`srun` / `mpirun` suffice). Each process draws its own rows of every batch; process 0 logs and writes the outputs.
"""
from __future__ import annotations

import argparse
import json
import os
import sysconfig
import time
from typing import Callable

import _common  # noqa: I001  (puts the repository on sys.path)

import jax
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from jax_moe.nn import MoELM, MoELMConfig, checkpoint, lm_loss


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16, help="sequences per step, all processes together (a multiple "
                   "of --ep)")
    p.add_argument("--seq", type=int, default=128, help="characters per sequence")
    p.add_argument("--backend", default="auto", help="jax_moe backend: auto | xla | cpu | cuda")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel ranks (default: all devices)")
    p.add_argument("--out", default="runs/moe", help="output directory")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=256, help="per-expert FFN width")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--shared-ffn", type=int, default=128, help="shared expert width (0: none)")
    p.add_argument("--data-mb", type=float, default=2.0, help="megabytes of stdlib source to read")
    p.add_argument("--remat", default="none", choices=("none", "full", "dots", "moe"),
                   help="remat each block (nnx.remat) with this policy: full = recompute everything, dots = keep "
                        "matmul outputs, moe = keep what dispatch and combine returned; they run once either way")
    p.add_argument("--scan-layers", action="store_true",
                   help="run the blocks as one lax.scan over their stacked parameters (remat'ed inside with --remat)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    _common.add_process_args(p)
    return p.parse_args()


def stdlib_text(megabytes: float) -> str:
    """The first `megabytes` of the stdlib's .py files in sorted path order (deterministic on one Python)."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, size = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), encoding="utf-8", errors="replace") as f:
                chunks.append(f.read())
            size += len(chunks[-1])
            if size >= megabytes * 1e6:
                return "".join(chunks)
    return "".join(chunks)


def main() -> None:
    args = parse_args()
    devices = _common.init_devices(args)
    mesh = _common.make_mesh(devices, args.ep)
    ep = int(mesh.shape["ep"])
    if args.batch % ep:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the EP size {ep}")

    data = np.asarray(_common.encode(stdlib_text(args.data_mb)), np.int32)
    split = int(len(data) * 0.95)
    train, val = data[:split], data[split:]
    cfg = MoELMConfig(vocab_size=len(_common.VOCAB), hidden=args.hidden, num_layers=args.layers,
                      num_heads=args.heads, ffn=args.ffn, num_experts=args.experts, experts_per_token=args.topk,
                      shared_ffn=args.shared_ffn, remat=args.remat,
                      scan_layers=args.scan_layers)
    model = MoELM(cfg, mesh, backend=args.backend, rngs=nnx.Rngs(args.seed))
    n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    backend = model.blocks[0].moe.comm_for(args.batch * args.seq // ep).backend_name
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    remat = (f", remat {args.remat}" if args.remat != "none" else "") + (", scanned layers" if args.scan_layers else "")
    log(f"devices: {ep} x {devices[0].platform}{processes}, jax_moe backend {backend!r}, {n_params / 1e6:.2f}M "
        f"params, {len(train) / 1e6:.2f}M train / {len(val) / 1e6:.2f}M val characters{remat}")

    warmup = min(20, args.steps // 4)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, max(args.steps, warmup + 1), args.lr * 0.1)
    # Built on the mesh, the optimizer's state (its step counts too) has the layout every update returns: the train
    # step compiles once, not again at step 2.
    with jax.set_mesh(mesh):
        optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0),
                                                     optax.adamw(schedule, 0.9, 0.95, weight_decay=0.01)),
                                  wrt=nnx.Param)
    rng = np.random.default_rng([args.seed, jax.process_index()])  # every process draws its own sequences
    rows = _common.local_rows(mesh, args.batch)

    def batch_from(source: np.ndarray) -> jax.Array:
        """This process's rows of a global batch of random windows of source."""
        starts = rng.integers(0, len(source) - args.seq - 1, rows)
        return _common.batch_array(mesh, np.stack([source[s:s + args.seq + 1] for s in starts]), args.batch)

    history, val_points, wall = train_loop(args, model, optimizer, batch_from, train, val)

    checkpoint.save(args.out, model, vocab=_common.VOCAB, steps=args.steps, seq=args.seq)  # collective
    if _common.is_writer():
        metrics = {"train_loss": history, "val_loss": val_points, "wall_s": wall, "ep": ep, "backend": backend,
                   "processes": jax.process_count()}
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump(metrics, f)
        plot(history, val_points, os.path.join(args.out, "loss.png"))
        print(f"loss {history[0]:.3f} -> {history[-1]:.3f} in {args.steps} steps, {wall:.0f}s; "
              f"checkpoint and loss.png in {args.out}")
    else:
        print(f"process {jax.process_index()}/{jax.process_count()} done; process 0 wrote the outputs")
    _common.finish()


def log(message: str) -> None:
    if _common.is_writer():
        tqdm.write(message)


def scalar(x: jax.Array) -> float:
    return float(_common.to_host(x))


def train_loop(args: argparse.Namespace, model: MoELM, optimizer: nnx.Optimizer,
               batch_from: Callable[[np.ndarray], jax.Array], train: np.ndarray, val: np.ndarray
               ) -> tuple[list[float], list[tuple[int, float]], float]:
    """(train losses, (step, val loss) pairs, seconds). Every process runs it; process 0 logs."""
    @nnx.jit
    def train_step(model: MoELM, optimizer: nnx.Optimizer, tokens: jax.Array):
        (loss, parts), grads = nnx.value_and_grad(lm_loss, has_aux=True)(model, tokens)
        optimizer.update(model, grads)
        return loss, parts

    @nnx.jit
    def eval_step(model: MoELM, tokens: jax.Array) -> jax.Array:
        return lm_loss(model, tokens)[1]["ce"]

    history: list[float] = []
    val_points: list[tuple[int, float]] = []
    start = time.time()
    bar = tqdm(range(1, args.steps + 1), desc="train", unit="step", mininterval=2.0,
               disable=not _common.is_writer())
    for step in bar:
        loss, parts = train_step(model, optimizer, batch_from(train))
        history.append(scalar(parts["ce"]))  # the global batch's loss, replicated on every device
        aux = scalar(parts["aux"])
        bar.set_postfix(loss=f"{history[-1]:.3f}", aux=f"{aux:.3f}")
        if step % args.log_every == 0 or step in (1, args.steps):
            val_ce = float(np.mean([scalar(eval_step(model, batch_from(val))) for _ in range(2)]))
            val_points.append((step, val_ce))
            log(f"step {step:5d}  train loss {history[-1]:.3f}  val loss {val_ce:.3f}  aux {aux:.3f}  "
                f"({time.time() - start:.0f}s)")
    return history, val_points, time.time() - start


def plot(history: list[float], val_points: list[tuple[int, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(history) + 1), history, label="train", lw=1)
    if val_points:
        ax.plot(*zip(*val_points), "o-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/char)")
    ax.set_title("jax_moe MoE LM on stdlib sources")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
