"""`bench moe`'s results: p50 / p99 per phase, the table, results.json and the plot."""
from __future__ import annotations

import json
import os

import numpy as np

PHASES = ("dispatch_send", "dispatch_recv", "dispatch", "combine_send", "combine_recv", "combine")


def summary(samples):
    out = {}
    for k in PHASES + ("dispatch_split", "combine_split"):
        if k not in samples:
            continue
        v = samples[k]
        ok = v[np.isfinite(v)]
        out[k] = {"p50": float(np.percentile(ok, 50)) if ok.size else None,
                  "p99": float(np.percentile(ok, 99)) if ok.size else None}
    out["iters"] = int(samples["dispatch"].size)
    if "per_rank_p50" in samples:
        out["per_rank_p50"] = samples["per_rank_p50"]
    return out


def fmt(v):
    return "-" if v is None else (f"{v:9.1f}" if v < 1e5 else f"{v:9.2e}")


def write(out, meta, results):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    sweep = [r for r in results if r["shape"].startswith("sweep")]
    rows = sweep or results
    for ax, phase in zip(axes, ("dispatch", "combine")):
        for backend in sorted({r["backend"] for r in rows}):
            pts = sorted((r["tokens"], r["stats"][phase]["p50"]) for r in rows
                         if r["backend"] == backend and r["stats"][phase]["p50"] is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel(f"{phase} p50 (us)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("jax_moe dispatch / combine latency")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
