"""Generate text from a train_moe.py checkpoint: a batch of prompts, one token per sequence per decode step, through
a KV cache and the same expert-parallel dispatch/combine as training.

    python examples/decode_moe.py --checkpoint runs/demo --max_new_tokens 120

All sequences advance one position per step: while a prompt still has characters they are fed in (the prefill goes
through the decode step too), afterwards the sampled ones. The batch is padded to a multiple of the EP size.

Several processes: the same options as train_moe.py (--coordinator, --num-processes, --process-id, or
examples/launch.py); every process loads the checkpoint and places its own shards; process 0 prints the text.
"""
from __future__ import annotations

import argparse
import time

import _common  # noqa: I001  (puts the repository on sys.path)

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_moe.nn import MoELM, checkpoint

DEFAULT_PROMPTS = ["def ", "import ", "class ", "for "]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="directory written by train_moe.py --out")
    p.add_argument("--prompts", nargs="+", default=DEFAULT_PROMPTS)
    p.add_argument("--max_new_tokens", type=int, default=120)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--backend", default="auto", help="jax_moe backend: auto | xla | cpu | cuda")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel ranks (default: all devices)")
    p.add_argument("--seed", type=int, default=0)
    _common.add_process_args(p)
    return p.parse_args()


@nnx.jit
def step(model: MoELM, caches: list, tokens: jax.Array, forced: jax.Array, use_forced: jax.Array, pos: jax.Array,
         key: jax.Array, temperature: jax.Array) -> tuple[jax.Array, list]:
    """Feed tokens at pos; return the next tokens (the prompt's own where it continues, else sampled)."""
    logits, caches = model.decode_step(tokens, caches, pos)
    greedy = jnp.argmax(logits, axis=-1)
    sampled = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6), axis=-1)
    nxt = jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)
    return jnp.where(use_forced, forced, nxt), caches


def main() -> None:
    args = parse_args()
    mesh = _common.make_mesh(_common.init_devices(args), args.ep)
    model, meta = checkpoint.load(args.checkpoint, mesh, backend=args.backend)  # on every process
    vocab = meta.get("vocab", _common.VOCAB)
    prompts = [_common.encode(p, vocab) or [vocab.index("\n")] for p in args.prompts]
    generated, steps, wall = generate(model, mesh, prompts, args)
    ep, batch = int(mesh.shape["ep"]), generated.shape[0]
    backend = model.blocks[0].moe.comm_for(batch // ep).backend_name  # the decode steps' Communicator (cached)

    if _common.is_writer():
        print(f"{len(prompts)} prompts (batch {batch} over EP={ep}, jax_moe backend {backend!r}), "
              f"{steps} decode steps in {wall:.1f}s ({steps / wall:.1f} steps/s)")
        for b, p in enumerate(prompts):
            text = _common.decode(generated[b, :len(p) + args.max_new_tokens].tolist(), vocab)
            print(f"--- prompt {args.prompts[b]!r}\n{text}\n")
    else:
        print(f"process {jax.process_index()}/{jax.process_count()} done; process 0 prints the text")
    _common.finish()


def generate(model: MoELM, mesh: jax.sharding.Mesh, prompts: list[list[int]], args: argparse.Namespace
             ) -> tuple[np.ndarray, int, float]:
    """(token ids [batch, steps + 1] on every process, steps, seconds). Every process runs it."""
    ep = int(mesh.shape["ep"])
    batch = -(-len(prompts) // ep) * ep  # pad the batch to a multiple of the EP size with copies of prompt 0
    rows = prompts + [prompts[0]] * (batch - len(prompts))
    longest = max(len(p) for p in rows)
    total = longest + args.max_new_tokens - 1   # positions fed; the last step's output is the final new token
    ids = np.zeros((batch, total + 1), np.int32)
    given = np.zeros((batch, total + 1), bool)
    for b, p in enumerate(rows):
        ids[b, :len(p)], given[b, :len(p)] = p, True

    sharding = NamedSharding(mesh, P("ep"))
    # Every process knows all prompts and places only its own rows.
    put = lambda a: jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])  # noqa: E731
    caches = model.init_cache(batch, total)
    tokens = put(ids[:, 0])
    key = jax.random.key(args.seed)
    temperature = jnp.float32(args.temperature)
    out = [np.asarray(ids[:, 0])]
    start = time.time()
    for pos in range(total):
        key, sub = jax.random.split(key)
        tokens, caches = step(model, caches, tokens, put(ids[:, pos + 1]), put(given[:, pos + 1]),
                              jnp.int32(pos), sub, temperature)
        out.append(_common.to_host(tokens))  # collective: the rows of the other processes come too
    return np.stack(out, axis=1), total, time.time() - start


if __name__ == "__main__":
    main()
