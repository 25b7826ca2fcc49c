"""The runs behind the floors (bench/floor.py): other benchmarks as subprocesses, bounded in time, their JSON read back
and kept in a cache folder keyed by their command, so that one sitting measures each input once."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from jax_moe.bench import processes


class Unavailable(Exception):
    """An input of the floors could not be measured; the message says why."""


def cached_json(cache: Optional[str], cmd: list[str], run: Callable[[], dict]) -> tuple[dict, bool]:
    """run() once per command in `cache` (a folder; None: always run): (its JSON, whether it came from the cache).
    The key is the command without its output paths, so the same measurement asked twice in one sitting (the EP1 run
    of several area memories, the engine's one-way of one provider) runs once."""
    if not cache:
        return run(), False
    outputs = {"--out", "--json"}
    key = [a for i, a in enumerate(cmd) if a not in outputs and (i == 0 or cmd[i - 1] not in outputs)]
    path = os.path.join(cache, hashlib.sha256(json.dumps(key[1:]).encode()).hexdigest()[:24] + ".json")
    try:
        with open(path) as f:
            return json.load(f), True
    except (OSError, ValueError):
        pass
    doc = run()
    os.makedirs(cache, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)
    return doc, False


def run_json(cmd: list[str], json_path: str, timeout: float, log_path: str, env: Optional[dict] = None) -> dict:
    """Runs `cmd` (its output into `log_path`) for at most `timeout` s and reads the JSON it wrote to `json_path`.
    Unavailable on a timeout, a failure or no JSON. The command runs in its own process group: its own children (the
    fabric workers) go with it."""
    name = " ".join(cmd[3:5]) if cmd[1:3] == ["-m", "jax_moe.bench"] else os.path.basename(cmd[0])
    if os.path.exists(json_path):
        os.remove(json_path)  # an earlier run's results must not pass for this one's
    with open(log_path, "w") as log:
        try:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as e:
            raise Unavailable(f"{name} did not start: {e}") from None
        try:
            rc = p.wait(timeout)
        except BaseException as e:  # a timeout, or ^C: never leave the run behind
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:  # the group is gone already
                pass
            p.wait()
            if isinstance(e, subprocess.TimeoutExpired):
                raise Unavailable(f"{name} ran past {timeout:g} s (log {log_path})") from None
            raise
    if rc:
        with open(log_path, errors="replace") as f:
            tail = [line.strip() for line in f.read()[-4000:].splitlines() if line.strip()][-1:]
        raise Unavailable(f"{name} exited with {rc}: {' '.join(tail)[-300:]} (log {log_path})")
    try:
        with open(json_path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise Unavailable(f"{name} wrote no results: {e}") from None


def cached_run(cache: Optional[str], cmd: list[str], json_path: str, timeout: float, log_path: str,
               env: Optional[dict] = None) -> tuple[dict, bool]:
    """run_json of `cmd`, once per command in `cache` (cached_json): (its JSON, whether it came from the cache)."""
    return cached_json(cache, cmd, lambda: run_json(cmd, json_path, timeout, log_path, env))


def ep1_command(args: argparse.Namespace, backends: list[str], shapes: list[str], out: str) -> list[str]:
    """The moe benchmark at EP1 with the multi-process run's shapes, iterations and seed."""
    cmd = [sys.executable, "-m", "jax_moe.bench", "moe", "--backend", ",".join(backends), "--shape", ",".join(shapes),
           "--ranks", "1", "--warmup", str(args.warmup), "--unroll", str(args.unroll), "--seed", str(args.seed),
           "--out", out]
    for flag, v in (("--iters", args.iters), ("--sweep-iters", args.sweep_iters)):
        if v:
            cmd += [flag, str(v)]
    return cmd


def cached_twin(cache: Optional[str], cmd: list[str], copies: int, work: str, timeout: float,
                env: Optional[dict] = None) -> tuple[list[dict], bool]:
    """`cmd` (the EP1 run, with its --out) run `copies` times at once, each into its own folder under `work`; their
    JSON, once per command and count in `cache` (cached_json), and whether it came from there."""
    def run() -> dict:
        cmds, paths = [], []
        at = cmd.index("--out") + 1
        for i in range(copies):
            out = os.path.join(work, f"floor_ep1_twin{i}")
            cmds.append([*cmd[:at], out, *cmd[at + 1:]])
            paths.append(os.path.join(out, "results.json"))
        with ThreadPoolExecutor(copies) as pool:  # started together: their timed loops overlap
            runs = [pool.submit(run_json, c, p, timeout, os.path.join(work, f"floor_ep1_twin{i}.log"), env)
                    for i, (c, p) in enumerate(zip(cmds, paths))]
            return {"runs": [r.result() for r in runs]}
    doc, reused = cached_json(cache, [*cmd, f"(x{copies} at once)"], run)
    return doc["runs"], reused


def ep1_env() -> dict:
    """This environment (the same SM share under MPS, the same trace switch) without what makes ranks remote."""
    return {k: v for k, v in os.environ.items() if k not in ("JAX_MOE_RANKS_PER_NODE", processes.PROC_ENV)}


def fabric_command(provider: str, memory: str, sizes: list[int], gpus: int, path: str,
                   exchange: bool = False) -> list[str]:
    return [sys.executable, "-m", "jax_moe.bench", "fabric", "--providers", provider, "--peers", "1",
            "--sizes", ",".join(map(str, sorted({0, *sizes}))), "--memory", memory, "--gpus", str(gpus),
            *(["--exchange"] if exchange else []), "--json", path]
