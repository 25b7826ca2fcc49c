"""examples/train_moe.py and decode_moe.py end to end, tiny sizes, in subprocesses (their own 4 CPU devices)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str, *args: str) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # the CPU path, even on a machine with GPUs
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_train_then_decode(tmp_path) -> None:
    out = str(tmp_path / "run")
    log = run("train_moe.py", "--steps", "4", "--batch", "4", "--seq", "16", "--hidden", "32", "--layers", "1",
              "--heads", "2", "--ffn", "32", "--shared-ffn", "16", "--data-mb", "0.05", "--log-every", "2",
              "--backend", "xla", "--out", out)
    assert "devices: 4 x cpu" in log
    for name in ("params.npz", "meta.json", "loss.png", "metrics.json"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)
    assert len(metrics["train_loss"]) == 4 and all(l > 0 for l in metrics["train_loss"])

    text = run("decode_moe.py", "--checkpoint", out, "--max_new_tokens", "5", "--prompts", "def ", "x = ",
               "--backend", "xla")
    assert "--- prompt 'def '" in text and "--- prompt 'x = '" in text
    assert "batch 4 over EP=4" in text  # 2 prompts padded to the EP size
