"""`python -m jax_moe.bench ab`: an A/B of environment settings on `bench moe`, in one sitting.

One run of each variant says little on a shared machine: between two runs of the same build, the floors moved by up
to 30 % (docs/benchmarks.md, 2026-12-06). So the variants run in turns, round after round, each round in the order
opposite to the one before (A B, B A, A B, ...), so that a drift in the sitting favours none of them. The summary
compares each variant with the first (the baseline): the median of its p50s over the rounds, and in how many rounds
it was faster than the baseline of the same round. Each variant's floors are measured once and reused by its later
rounds (a floor cache per variant; `--share-floors`: one for all, where the variants cannot change the EP1 run).

    python -m jax_moe.bench ab --rounds 3 --variant whole:JAX_MOE_STAGE_PIECES=1 --variant pieces:JAX_MOE_STAGE_PIECES=4 \\
        --out ab_out -- --backend cuda --shape decode --processes 2 --ranks-per-node 1 --provider shm

Everything after `--` is `bench moe`'s arguments, less `--out` (each run gets its own). Writes ab.json to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
from typing import Any, Optional

from jax_moe.bench import floor_runs
from jax_moe.bench.processes import ENV_KEY
from jax_moe.bench.report import PHASES

_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """"name:KEY=VALUE,KEY=VALUE" (or "name:" for the environment as it is) -> (name, the settings)."""
    name, sep, rest = text.partition(":")
    if not sep or not _NAME.fullmatch(name):
        raise ValueError(f"--variant {text!r}: write it as NAME:KEY=VALUE[,KEY=VALUE...] (NAME of letters, digits, "
                         "'_', '.', '-'), or NAME: for the environment unchanged")
    settings: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not ENV_KEY.fullmatch(key):
            raise ValueError(f"--variant {text!r}: {item!r} is not KEY=VALUE with KEY an environment variable's name")
        if key in settings:
            raise ValueError(f"--variant {text!r}: {key} is set twice")
        settings[key] = value
    return name, settings


def schedule(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, variant) in the order they run: each round the variants in turn, every other round reversed."""
    return [(r, n) for r in range(rounds) for n in (names if r % 2 == 0 else names[::-1])]


def _key(rec: dict) -> tuple:
    return (rec["shape"], rec["tokens"], rec["backend"])


def compare(runs: dict[str, list[Optional[dict]]], names: list[str]) -> list[dict[str, Any]]:
    """Per (shape, tokens, backend, phase) of any variant's results: each variant's p50 per round (None where its run
    failed or lacks the row), their median, that median over the baseline's, and the rounds it beat the baseline."""
    def p50s(name: str) -> dict[tuple, list[Optional[float]]]:
        out: dict[tuple, list[Optional[float]]] = {}
        for r, doc in enumerate(runs[name]):
            for rec in (doc or {}).get("results", []):
                for phase, stat in rec.get("stats", {}).items():
                    if phase in PHASES and (stat or {}).get("p50") is not None:
                        out.setdefault(_key(rec) + (phase,), [None] * len(runs[name]))[r] = stat["p50"]
        return out

    table = {n: p50s(n) for n in names}
    base = table[names[0]]
    keys = {k for t in table.values() for k in t}  # a row the baseline lacks (its run failed) is shown all the same
    rows = []
    for key in sorted(keys, key=lambda k: (k[:3], PHASES.index(k[3]))):
        row: dict[str, Any] = {"shape": key[0], "tokens": key[1], "backend": key[2], "phase": key[3], "variants": {}}
        base_vals = base.get(key, [None] * len(runs[names[0]]))
        base_median = _median(base_vals)
        for n in names:
            vals = table[n].get(key, [None] * len(runs[n]))
            med = _median(vals)
            pairs = [(v, b) for v, b in zip(vals, base_vals) if v is not None and b is not None]
            row["variants"][n] = {
                "p50s": vals, "median": med,
                "ratio": None if med is None or not base_median else med / base_median,
                "faster": sum(v < b for v, b in pairs), "pairs": len(pairs)}
        rows.append(row)
    return rows


def _median(vals: list[Optional[float]]) -> Optional[float]:
    ok = [v for v in vals if v is not None]
    return statistics.median(ok) if ok else None


def table(rows: list[dict[str, Any]], names: list[str]) -> list[str]:
    """The summary: per row, each variant's median p50 (µs), its ratio to the baseline's and its rounds faster."""
    head = f"{'shape':8s} {'T':>5s} {'backend':8s} {'op':14s} " + " ".join(
        f"{n[:24]:>24s}" for n in names)
    lines = [f"[ab] p50 us: median over rounds; x: over {names[0]}'s; faster: rounds it beat {names[0]} "
             "in the same round", head]
    for row in rows:
        cells = []
        for i, n in enumerate(names):
            v = row["variants"][n]
            med = "-" if v["median"] is None else f"{v['median']:.1f}"
            if i == 0:
                cells.append(f"{med:>24s}")
            else:
                ratio = "-" if v["ratio"] is None else f"x{v['ratio']:.3f}"
                cells.append(f"{med + ' ' + ratio + ' ' + str(v['faster']) + '/' + str(v['pairs']):>24s}")
        lines.append(f"{row['shape']:8s} {row['tokens']:>5d} {row['backend']:8s} {row['phase']:14s} " + " ".join(cells))
    return lines


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        own, moe = argv[:i], argv[i + 1:]
    else:
        own, moe = argv, []
    p = argparse.ArgumentParser(prog="python -m jax_moe.bench ab", description=__doc__.split("\n")[0],
                                epilog="after --: bench moe's arguments, less --out")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,...]",
                   help="a variant (at least two; the first is the baseline); NAME: alone runs the environment as is")
    p.add_argument("--rounds", type=int, default=3, help="runs of each variant (default 3)")
    p.add_argument("--out", default="ab_out", help="folder for each run's results and ab.json")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed to each run (default 600)")
    p.add_argument("--share-floors", action="store_true",
                   help="one floor cache for every variant (only where no variant changes the EP1 kernels)")
    args = p.parse_args(own)
    try:
        variants = [parse_variant(v) for v in args.variant]
    except ValueError as e:
        p.error(str(e))
    names = [n for n, _ in variants]
    if len(variants) < 2:
        p.error("give at least two --variant (the first is the baseline)")
    if len(set(names)) != len(names):
        p.error(f"variant names must differ: {names}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.timeout <= 0:
        p.error("--timeout must be above 0 s")
    if any(a == "--out" or a.startswith("--out=") for a in moe):
        p.error("bench moe's --out is set per run by bench ab: leave it out after --")
    args.variants = dict(variants)
    return args, moe


def _write(args: argparse.Namespace, moe: list[str], runs: dict, failures: list[str]) -> list[dict[str, Any]]:
    """ab.json as it stands (after every run, so that a sitting cut short keeps the rounds it finished)."""
    names = list(args.variants)
    rows = compare(runs, names)
    with open(os.path.join(args.out, "ab.json.tmp"), "w") as f:
        json.dump({"variants": args.variants, "rounds": args.rounds, "order": schedule(names, args.rounds),
                   "moe_args": moe, "failures": failures, "rows": rows}, f, indent=1)
    os.replace(os.path.join(args.out, "ab.json.tmp"), os.path.join(args.out, "ab.json"))
    return rows


def main(argv: list[str]) -> int:
    args, moe = _parse(list(argv))
    # SIGTERM (a stage's `timeout`) as an exception: run_json then kills the running bench's process group
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    names = list(args.variants)
    os.makedirs(args.out, exist_ok=True)
    runs: dict[str, list[Optional[dict]]] = {n: [None] * args.rounds for n in names}
    failures: list[str] = []
    for r, name in schedule(names, args.rounds):
        out = os.path.join(args.out, "runs", f"{name}_{r}")
        cache = os.path.join(args.out, "floors", "all" if args.share_floors else f"of_{name}")
        cmd = [sys.executable, "-m", "jax_moe.bench", "moe", *moe, "--out", out]
        if not any(a == "--floor-cache" or a.startswith("--floor-cache=") for a in moe):
            cmd += ["--floor-cache", cache]
        env = dict(os.environ, **args.variants[name])
        print(f"[ab] round {r}, {name}: {' '.join(f'{k}={v}' for k, v in args.variants[name].items()) or '(as is)'}",
              flush=True)
        os.makedirs(out, exist_ok=True)
        log = os.path.join(args.out, "runs", f"{name}_{r}.log")
        try:
            doc = floor_runs.run_json(cmd, os.path.join(out, "results.json"), args.timeout, log, env)
            if not doc.get("results"):  # bench moe exits 0 when every backend failed, and says why in its log
                raise floor_runs.Unavailable(f"bench moe measured nothing (log {log})")
            runs[name][r] = doc
        except floor_runs.Unavailable as e:
            failures.append(f"round {r}, {name}: {e}")
            print(f"[ab] {failures[-1]}", file=sys.stderr, flush=True)
        rows = _write(args, moe, runs, failures)
    print("\n".join(table(rows, names)))
    print(f"[ab] wrote {args.out}/ab.json" + (f"; {len(failures)} run(s) failed" if failures else ""))
    return 1 if failures else 0
