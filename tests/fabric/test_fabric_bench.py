"""`python -m jax_moe.bench fabric` runs end to end (a few rounds; its numbers are recorded in docs/benchmarks.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from support.fabric_mp import needs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@needs("tcp")
def test_fabric_bench_tcp(tmp_path):
    out = tmp_path / "fabric.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "jax_moe.bench", "fabric", "--providers", "tcp", "--peers", "2",
                        "--sizes", "4096", "--warmup", "2", "--iters", "5", "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (row,) = json.loads(out.read_text())["tcp"]
    assert row["size"] == 4096 and row["rounds"] == 5 and 0 < row["p50_us"] <= row["p99_us"]
    ref = json.loads(out.read_text())["tcp_fi_pingpong_us"]  # libfabric's own figure, same run
    assert ref is None or ref > 0


@needs("tcp")
def test_pump_bench_tcp(tmp_path):
    """`python -m jax_moe.bench pump`: the proxy round trip and its steps, with fi_pingpong's beside it when installed."""
    out = tmp_path / "pump.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "jax_moe.bench", "pump", "--providers", "tcp", "--warmup", "2",
                        "--iters", "20", "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    row = json.loads(out.read_text())["tcp"]
    assert row["size"] == 64 and row["rounds"] == 20 and 0 < row["p50_us"] <= row["p99_us"]
    ref = row["fi_pingpong_round_trip_us"]
    assert ref is None or ref == 2 * row["fi_pingpong_us_per_xfer"] > 0
    # the steps of a one-way trip, from the pumps' and devices' stamps on one host clock: causal, so never negative
    steps = row["steps_p50_us"]
    assert set(steps) == {"bell_to_proxy", "proxy_post", "post_to_remote_flag", "flag_to_device", "device_turnaround"}
    assert all(0 <= v <= row["p99_us"] for v in steps.values()), steps


@needs("tcp")
def test_fabric_bench_exchange_tcp(tmp_path):
    """--exchange: two ranks write to each other at once; one row per size, the intervals between rank 0's arrivals."""
    out = tmp_path / "exchange.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "jax_moe.bench", "fabric", "--providers", "tcp", "--exchange",
                        "--sizes", "0,64K", "--warmup", "2", "--iters", "6", "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "exchange" in p.stdout
    rows = json.loads(out.read_text())["tcp"]
    assert [(r["size"], r["rounds"], r["pattern"]) for r in rows] == [(0, 6, "exchange"), (65536, 6, "exchange")]
    assert all(0 < r["p50_us"] <= r["p99_us"] for r in rows), rows
