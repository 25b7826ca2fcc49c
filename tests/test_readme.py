"""The README's Python examples run as written (each in a fresh process, since they configure the CPU device count),
and its shell commands use the project's environment."""
from __future__ import annotations

import os
import re
import subprocess
import sys


def test_readme_example_runs():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert blocks, "README has no python example"
    out = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "(128, 256)" in out.stdout
    assert len(blocks) >= 2, "README has no fp8 example"
    out = subprocess.run([sys.executable, "-c", blocks[1]], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "bfloat16 True" in out.stdout, out.stdout[-2000:]


def test_readme_commands_run_in_the_venv():
    """`python` exists only in an activated venv on a fresh Debian machine: the README says to activate it before its
    first `python` command, and names no placeholder a pasted command would fail on."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as f:
        text = f.read()
    shell = re.findall(r"```bash\n(.*?)```", text, re.S)
    commands = [ln.split("#")[0].strip() for block in shell for ln in block.splitlines() if ln.split("#")[0].strip()]
    first_python = next(i for i, c in enumerate(commands) if c.startswith("python"))
    assert "source .venv/bin/activate" in commands[:first_python], commands
    assert not [c for c in commands if re.search(r"<[a-z ]+>|\bprocess_id=i\b", c)], commands
