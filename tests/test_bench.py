"""The benchmarks run end to end (a few iterations; the numbers themselves are recorded in docs/benchmarks.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "jax_moe.bench", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_moe_bench_cpu_and_xla(tmp_path):
    p = _run(["moe", "--backend", "cpu,xla", "--shape", "small", "--iters", "3", "--warmup", "1",
              "--out", str(tmp_path)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert sorted(r["backend"] for r in rows) == ["cpu", "xla"]
    for r in rows:
        for half in ("dispatch_send", "dispatch_recv", "dispatch", "combine_send", "combine_recv", "combine"):
            s = r["stats"][half]
            assert 0 < s["p50"] <= s["p99"], (r["backend"], half, s)
    assert (tmp_path / "moe.png").stat().st_size > 0


def _has_tcp() -> bool:
    try:
        from jax_moe import fabric

        fabric.TransferEngine("tcp").close()
        return True
    except Exception:  # noqa: BLE001 - no fabric binding or no tcp provider
        return False


@pytest.mark.skipif(not _has_tcp(), reason="libfabric tcp provider not available")
def test_fabric_bench_tcp(tmp_path):
    out = tmp_path / "fabric.json"
    p = _run(["fabric", "--providers", "tcp", "--peers", "2", "--sizes", "4096", "--warmup", "2", "--iters", "5",
              "--json", str(out)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (row,) = json.loads(out.read_text())["tcp"]
    assert row["size"] == 4096 and row["rounds"] == 5 and 0 < row["p50_us"] <= row["p99_us"]
