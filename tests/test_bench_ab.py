"""`bench ab`: variants parsed strictly, run in alternating order, compared round by round; end to end on CPU."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import numpy as np
import pytest

from jax_moe.bench import ab
from jax_moe.bench.report import PHASES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_variants_are_parsed_or_refused_naming_the_problem():
    assert ab.parse_variant("whole:JAX_MOE_STAGE_PIECES=1") == ("whole", {"JAX_MOE_STAGE_PIECES": "1"})
    assert ab.parse_variant("base:") == ("base", {})
    assert ab.parse_variant("x:A=1,B=a=b,C=") == ("x", {"A": "1", "B": "a=b", "C": ""})
    for bad, says in [("nocolon", "NAME:KEY=VALUE"), ("a b:X=1", "NAME:KEY=VALUE"), ("v:X", "KEY=VALUE"),
                      ("v:1X=2", "environment variable"), ("v:X=1,X=2", "set twice")]:
        with pytest.raises(ValueError, match=says):
            ab.parse_variant(bad)


@pytest.mark.parametrize("count,rounds", [(2, 1), (2, 4), (3, 3)])
def test_each_round_runs_every_variant_once_in_the_order_opposite_to_the_round_before(count, rounds):
    names = [f"v{i}" for i in range(count)]
    order = ab.schedule(names, rounds)
    assert len(order) == count * rounds
    for r in range(rounds):
        got = [n for rr, n in order if rr == r]
        assert got == (names if r % 2 == 0 else names[::-1])
    assert [rr for rr, _ in order] == sorted(rr for rr, _ in order)  # rounds one after another


def _doc(rng, values: dict[tuple, float]) -> dict:
    """A results.json of bench moe with the given p50 per (shape, tokens, backend, phase); p99 random above it."""
    recs: dict[tuple, dict] = {}
    for (shape, tokens, backend, phase), v in values.items():
        rec = recs.setdefault((shape, tokens, backend), {"shape": shape, "tokens": tokens, "backend": backend,
                                                         "stats": {}})
        rec["stats"][phase] = {"p50": v, "p99": v * (1 + rng.random())}
    return {"meta": {}, "results": list(recs.values())}


def test_compare_takes_medians_ratios_and_wins_per_round_against_the_baseline():
    rng = np.random.default_rng()
    rounds = int(rng.integers(2, 6))
    keys = [("decode", 128, "cuda", p) for p in PHASES] + [("prefill", 4096, "cuda", "dispatch")]
    names = ["a", "b", "c"]
    truth = {n: {k: [float(rng.uniform(10, 1000)) for _ in range(rounds)] for k in keys} for n in names}
    runs = {n: [_doc(rng, {k: truth[n][k][r] for k in keys}) for r in range(rounds)] for n in names}
    lost = int(rng.integers(rounds))
    runs["c"][lost] = None  # a failed run: missing from c's medians and from its pairs
    rows = ab.compare(runs, names)
    assert {(r["shape"], r["tokens"], r["backend"], r["phase"]) for r in rows} == set(keys)
    for row in rows:
        k = (row["shape"], row["tokens"], row["backend"], row["phase"])
        base = statistics.median(truth["a"][k])
        for n in names:
            got = row["variants"][n]
            vals = [v for r, v in enumerate(truth[n][k]) if not (n == "c" and r == lost)]
            assert got["median"] == pytest.approx(statistics.median(vals))
            assert got["ratio"] == pytest.approx(statistics.median(vals) / base)
            wins = [truth[n][k][r] < truth["a"][k][r] for r in range(rounds) if not (n == "c" and r == lost)]
            assert (got["faster"], got["pairs"]) == (sum(wins), len(wins))
        assert row["variants"]["c"]["p50s"][lost] is None
    lines = ab.table(rows, names)
    assert len(lines) == 2 + len(rows) and all("decode" in l or "prefill" in l for l in lines[2:])


def test_a_row_the_variant_lacks_compares_as_missing_not_as_zero():
    rng = np.random.default_rng()
    runs = {"a": [_doc(rng, {("small", 64, "cpu", "dispatch"): 5.0})],
            "b": [_doc(rng, {("small", 64, "xla", "dispatch"): 1.0})]}
    rows = ab.compare(runs, ["a", "b"])
    assert [r["backend"] for r in rows] == ["cpu", "xla"]  # the rows of every variant, the baseline's or not
    cpu, xla = rows
    assert cpu["variants"]["b"] == {"p50s": [None], "median": None, "ratio": None, "faster": 0, "pairs": 0}
    assert xla["variants"]["a"]["median"] is None and xla["variants"]["b"]["median"] == 1.0
    assert xla["variants"]["b"]["ratio"] is None and xla["variants"]["b"]["pairs"] == 0
    assert " - " in ab.table([cpu], ["a", "b"])[-1] + " "


def _bench(args, tmp_path, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "jax_moe.bench", "ab", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,says", [
    (["--variant", "a:X=1"], "at least two"),
    (["--variant", "a:X=1", "--variant", "a:X=2"], "must differ"),
    (["--variant", "a:X", "--variant", "b:"], "KEY=VALUE"),
    (["--variant", "a:", "--variant", "b:", "--", "--out", "x"], "--out"),
    (["--variant", "a:", "--variant", "b:", "--rounds", "0"], "at least 1"),
    (["--variant", "a:", "--variant", "b:", "--timeout", "0"], "above 0"),
])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, args, says):
    p = _bench(args, tmp_path, timeout=60)
    assert p.returncode == 2 and says in p.stderr, p.stderr[-2000:]


_SMALL = ["--backend", "xla", "--shape", "small", "--iters", "2", "--warmup", "1"]


def test_ab_runs_bench_moe_per_variant_and_round_on_cpu(tmp_path):
    """Two variants, two rounds: four runs of bench moe on CPU in the order A B B A, each with its own results,
    compared in ab.json."""
    out = tmp_path / "ab"
    p = _bench(["--variant", "base:", "--variant", "marked:JAX_MOE_BENCH_AB_PROBE=1", "--rounds", "2",
                "--out", str(out), "--", *_SMALL], tmp_path, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((out / "ab.json").read_text())
    assert [tuple(o) for o in doc["order"]] == [(0, "base"), (0, "marked"), (1, "marked"), (1, "base")]
    assert doc["failures"] == []
    assert {r["phase"] for r in doc["rows"]} == set(PHASES)
    for row in doc["rows"]:
        for n in ("base", "marked"):
            v = row["variants"][n]
            assert all(x is not None and x > 0 for x in v["p50s"]) and v["pairs"] == 2
    for n in ("base_0", "base_1", "marked_0", "marked_1"):
        assert json.loads((out / "runs" / n / "results.json").read_text())["results"]
    ran = [line.split(":")[0] for line in p.stdout.splitlines() if line.startswith("[ab] round ")]
    assert ran == ["[ab] round 0, base", "[ab] round 0, marked", "[ab] round 1, marked", "[ab] round 1, base"]
    assert "[ab] round 1, marked: JAX_MOE_BENCH_AB_PROBE=1" in p.stdout


def test_a_variant_whose_runs_fail_is_reported_and_the_others_still_compared(tmp_path):
    """The variant's setting reaches its run (a platform that does not exist makes bench moe fail): ab exits 1, names
    the failed run, and still writes the baseline's numbers."""
    out = tmp_path / "ab"
    p = _bench(["--variant", "base:", "--variant", "broken:JAX_PLATFORMS=no_such_platform", "--rounds", "1",
                "--out", str(out), "--", *_SMALL], tmp_path, timeout=600)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "round 0, broken: " in p.stderr
    doc = json.loads((out / "ab.json").read_text())
    assert len(doc["failures"]) == 1 and doc["failures"][0].startswith("round 0, broken: ")
    for row in doc["rows"]:
        assert row["variants"]["base"]["p50s"][0] > 0
        assert row["variants"]["broken"] == {"p50s": [None], "median": None, "ratio": None, "faster": 0, "pairs": 0}
