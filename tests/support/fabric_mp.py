"""Helpers for the multi-process fabric tests: start N workers on localhost, never hang."""
import json
import os
import subprocess
import sys
import time

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fabric_worker.py")


def _providers():
    """Providers this build can open here (an engine is opened and closed for each)."""
    try:
        from jax_moe import fabric
    except (ImportError, AttributeError):
        return set()
    found = set()
    for name in ("tcp", "shm"):
        try:
            fabric.TransferEngine(name).close()
            found.add(name)
        except Exception:  # noqa: BLE001 - unavailable provider
            pass
    return found


AVAILABLE = _providers()


def needs(provider):
    return pytest.mark.skipif(provider not in AVAILABLE, reason=f"libfabric provider {provider} not built in")


def run_world(tmp_path, n, provider, scenario, num_nics=1, rounds=0, timeout=90.0):
    """Runs `n` workers; returns their JSON results. Kills every child on failure or timeout."""
    d = str(tmp_path)
    env = dict(os.environ)
    env.setdefault("FI_LOG_LEVEL", "warn")
    env["PYTHONUNBUFFERED"] = "1"
    procs, logs = [], []
    try:
        for rank in range(n):
            log = open(os.path.join(d, f"log.{rank}"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, WORKER, d, str(rank), str(n), provider, str(num_nics), scenario, str(rounds)],
                stdout=log, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise AssertionError(f"workers still running after {timeout}s")
            if any(p.poll() not in (None, 0, -9) for p in procs):
                break  # one failed: do not wait for the others to time out
            time.sleep(0.02)
        failed = [r for r, p in enumerate(procs) if p.poll() not in (0, -9)]
        if failed:
            raise AssertionError(f"workers {failed} failed")
    except AssertionError as e:
        msgs = []
        for r, log in enumerate(logs):
            log.flush()
            log.seek(0)
            msgs.append(f"--- rank {r} (rc={procs[r].poll() if r < len(procs) else None}) ---\n{log.read()[-4000:]}")
        raise AssertionError(f"{e}\n" + "\n".join(msgs)) from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for log in logs:
            log.close()
    results = {}
    for rank in range(n):
        path = os.path.join(d, f"result.{rank}")
        if os.path.exists(path):
            with open(path) as f:
                results[rank] = json.load(f)
    return results
