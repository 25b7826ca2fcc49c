"""examples/train_moe.py and decode_moe.py end to end, tiny sizes, in subprocesses (their own CPU devices): one process
with 4 devices, and 2 processes x 2 devices through examples/launch.py (backend "cpu", libfabric tcp between them)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
STEPS = 10
TINY = ["--batch", "4", "--seq", "16", "--hidden", "32", "--layers", "1", "--heads", "2", "--ffn", "32",
        "--shared-ffn", "16", "--data-mb", "0.05"]
OUTPUTS = ("params.npz", "meta.json", "loss.png", "metrics.json")


def env() -> dict[str, str]:
    # The CPU path even on a machine with GPUs. Compiling dominates these tiny runs: without XLA's LLVM optimisations
    # it takes half the time (XLA_FLAGS also drops the session's own device count flags, if any).
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")


def run(*argv: str, timeout_s: float = 240) -> str:
    proc = subprocess.run([sys.executable, *argv], env=env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, f"{argv[0]} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def launch(n: int, script: str, *args: str) -> str:
    """n processes of an example through the launcher (it kills them all after 200 s or at the first failure)."""
    return run(os.path.join(EXAMPLES, "launch.py"), "-n", str(n), "--timeout", "200", "--",
               os.path.join(EXAMPLES, script), *args, timeout_s=240)


def train_args(out: str, backend: str) -> list[str]:
    return ["--steps", str(STEPS), "--lr", "1e-2", "--log-every", "5", *TINY, "--backend", backend, "--out", out]


def check_outputs(out: str) -> dict:
    for name in OUTPUTS:
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)
    loss = metrics["train_loss"]
    assert len(loss) == STEPS and all(math.isfinite(v) and v > 0 for v in loss), loss
    assert loss[-1] < loss[0] - 0.1, f"the loss did not decrease: {loss}"
    return metrics


@pytest.mark.parametrize("backend,remat", [("auto", "full"), ("xla", "none")])
def test_train_then_decode(tmp_path, backend: str, remat: str) -> None:
    """The native backend with its blocks scanned and remat'ed (as MaxText runs them), XLA's plain."""
    out = str(tmp_path / "run")
    scan = ["--scan-layers"] if remat != "none" else []
    log = run(os.path.join(EXAMPLES, "train_moe.py"), *train_args(out, backend), "--remat", remat, *scan)
    native = "cpu" if backend == "auto" else backend  # what `make demo` gets on CPU
    assert f"devices: 4 x cpu, jax_moe backend '{native}'" in log, log[-2000:]
    assert (f"remat {remat}, scanned layers" in log) == (remat != "none"), log[-2000:]
    check_outputs(out)

    text = run(os.path.join(EXAMPLES, "decode_moe.py"), "--checkpoint", out, "--max_new_tokens", "5",
               "--prompts", "def ", "x = ", "--backend", backend)
    assert "--- prompt 'def '" in text and "--- prompt 'x = '" in text
    assert "batch 4 over EP=4" in text  # 2 prompts padded to the EP size


@pytest.mark.multiprocess
def test_two_processes_train_then_decode(tmp_path) -> None:
    out = str(tmp_path / "run")
    log = launch(2, "train_moe.py", *train_args(out, "cpu"), "--fabric-provider", "tcp", "--local-devices", "2")
    assert "[0] devices: 4 x cpu in 2 processes, jax_moe backend 'cpu'" in log, log[-3000:]
    # Process 0 logs and writes; process 1 only says it is done.
    assert "[0] loss " in log and f"checkpoint and loss.png in {out}" in log, log[-3000:]
    assert "[1] process 1/2 done; process 0 wrote the outputs" in log, log[-3000:]
    assert not any(line.startswith("[1]") and ("step " in line or "loss " in line) for line in log.splitlines())
    assert sorted(os.listdir(out)) == sorted(OUTPUTS)
    assert check_outputs(out)["processes"] == 2

    text = launch(2, "decode_moe.py", "--checkpoint", out, "--max_new_tokens", "5", "--prompts", "def ", "x = ",
                  "--backend", "cpu", "--fabric-provider", "tcp")
    assert "[0] --- prompt 'def '" in text and "[0] --- prompt 'x = '" in text, text[-3000:]
    assert "[0] 2 prompts (batch 4 over EP=4, jax_moe backend 'cpu')" in text, text[-3000:]
    assert "[1] process 1/2 done" in text and "[1] --- prompt" not in text, text[-3000:]


def test_launch_shows_a_progress_bar_as_one_line(tmp_path) -> None:
    """examples/launch.py relays a child's tqdm bar (redrawn after carriage returns) as one line when its output is
    not a terminal, however often it refreshed, with the log lines tqdm.write printed around it."""
    child = tmp_path / "bar.py"
    child.write_text("import time\nfrom tqdm import tqdm\nfor i in tqdm(range(40), mininterval=0, desc='train'):\n"
                     "    time.sleep(0.002)\n    if i == 20:\n        tqdm.write('step 20 logged')\nprint('done')\n")
    code = ("import subprocess, sys, threading\nsys.path.insert(0, sys.argv[1])\nimport launch\n"
            "p = subprocess.Popen([sys.executable, sys.argv[2]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)\n"
            "launch.relay(p.stdout, '[0]', threading.Lock())\np.wait()\n")
    out = subprocess.run([sys.executable, "-c", code, EXAMPLES, str(child)], capture_output=True, text=True,
                         timeout=60).stdout
    lines = out.splitlines()
    assert [ln for ln in lines if "train:" in ln] == [ln for ln in lines if "40/40" in ln], out
    assert len([ln for ln in lines if "train:" in ln]) == 1, out
    assert lines[0] == "[0] step 20 logged" and lines[-1] == "[0] done", out
