"""`python -m jax_moe.bench <suite> [options]`: each suite is a module of this package with a `main(argv)`."""
from __future__ import annotations

import importlib
import sys

SUITES = {
    "moe": "jax_moe.bench.moe",
    "fabric": "jax_moe.bench.fabric",
    "pump": "jax_moe.bench.pump",
    "model": "jax_moe.bench.model",
    "overlap": "jax_moe.bench.overlap",
    "ab": "jax_moe.bench.ab",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUITES:
        print(f"usage: python -m jax_moe.bench {{{','.join(SUITES)}}} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(SUITES[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
