"""The README's API example runs as written (in a fresh process, since it configures the CPU device count)."""
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
