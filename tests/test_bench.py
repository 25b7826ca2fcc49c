"""The moe benchmark runs end to end (a few iterations; the numbers themselves are recorded in docs/benchmarks.md).
tests/fabric/test_fabric_bench.py does the same for the fabric benchmark."""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpu_comm():
    """The "cpu" backend over every device, a small config, and inputs for it: (mesh, comm, inputs, the CPU stamp)."""
    import jax
    import jax_moe
    from jax_moe.backends import cpu as cpu_backend
    from jax_moe.bench import programs
    devices = jax.devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), ("ep",), devices=devices)
    comm = jax_moe.Communicator(jax_moe.MoEConfig(4 * n, 2, 128, 8), mesh, "ep", backend="cpu")
    inputs = programs.make_inputs(np.random.default_rng(), n, 8, 128, 4 * n, 2, False)
    return mesh, comm, inputs, cpu_backend.timestamp


def _copies_of_x(hlo: str) -> int:
    """The copies of a bf16 [8, 128] buffer (x of _cpu_comm's inputs, per rank) in a compiled program's entry."""
    entry = hlo[hlo.find("\nENTRY"):]
    return len(re.findall(r"= bf16\[8,128\]\S* copy\(", entry))


def test_moe_bench_cpu_and_xla(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "jax_moe.bench", "moe", "--backend", "cpu,xla", "--shape", "small",
                        "--iters", "3", "--warmup", "1", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert sorted(r["backend"] for r in rows) == ["cpu", "xla"]
    for r in rows:
        for half in ("dispatch_send", "dispatch_recv", "dispatch", "combine_send", "combine_recv", "combine"):
            s = r["stats"][half]
            assert 0 < s["p50"] <= s["p99"], (r["backend"], half, s)
    assert (tmp_path / "moe.png").stat().st_size > 0


def test_model_bench_reproduces_pplx_and_scales_with_the_bytes(tmp_path):
    """`python -m jax_moe.bench model` (docs/scale.md): fed pplx-garden's design, it reproduces their published decode
    table within 25 %; jax_moe's off-node bytes and latency grow with EP, one node is NVLink only, and a combine with
    sender-side reduction never costs more than one row per (token, k)."""
    out = tmp_path / "model.json"
    p = subprocess.run([sys.executable, "-m", "jax_moe.bench", "model", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    fabrics = json.loads(out.read_text())["fabrics"]
    assert sorted(fabrics) == ["cx7", "efa"]
    for name, fab in fabrics.items():
        rows = fab["rows"]
        assert [r["ep"] for r in rows] == [8, 16, 32, 64, 128]
        checked = [r for r in rows if r["published"] is not None]
        assert len(checked) == (4 if name == "efa" else 3)
        for r in checked:
            for i, op in enumerate(("dispatch", "combine")):
                assert abs(r["pplx"][op]["total_us"] / r["published"][i] - 1) <= 0.25, (name, r["ep"], op)
        assert fab["max_error"] <= 0.25
        ours = [r["jax_moe"] for r in rows]
        assert ours[0]["dispatch"]["bytes_off_node"] == 0 and ours[0]["dispatch"]["bytes_on_node"] > 0
        for a, b in zip(ours, ours[1:]):
            assert b["dispatch"]["bytes_off_node"] > a["dispatch"]["bytes_off_node"]
            assert b["dispatch"]["total_us"] > a["dispatch"]["total_us"]
        for r in rows:
            assert r["jax_moe_reduced"]["total_us"] <= r["jax_moe"]["combine"]["total_us"]
            # each token once per rank: never more dispatch bytes than pplx-garden's one row per (token, expert)
            assert r["jax_moe"]["dispatch"]["bytes_off_node"] <= r["pplx"]["dispatch"]["bytes_off_node"]
            # the areas' memory: GPU memory costs the wire alone, staging adds copies, host memory PCIe reads; one
            # node never touches them
            by = r["jax_moe_by_memory"]
            for op in ("dispatch", "combine"):
                d, st, h = (by[m][op]["total_us"] for m in ("device", "staged", "host"))
                assert d == r["jax_moe_reduced"]["total_us"] if op == "combine" else d == r["jax_moe"][op]["total_us"]
                assert (d == st == h) if r["ep"] == 8 else (d < st < h), (name, r["ep"], op, d, st, h)
        # one exact figure: at EP16 the staged dispatch adds its off-node bytes at 29 GB/s out and 25 GB/s in (µs)
        r16 = next(r for r in rows if r["ep"] == 16)["jax_moe_by_memory"]
        b_off = r16["staged"]["dispatch"]["bytes_off_node"]
        assert b_off > 0
        assert r16["staged"]["dispatch"]["staging_us"] == pytest.approx(b_off / 29e3 + b_off / 25e3)
        assert r16["device"]["dispatch"]["staging_us"] == 0


@pytest.mark.multiprocess
def test_overlap_bench_across_processes(tmp_path):
    """`bench overlap --processes 2` (issue 25: overlap across nodes): every rank of another process goes through the
    proxy; the stamps of all ranks are gathered, and process 0 alone writes the results."""
    out = tmp_path / "overlap.json"
    p = subprocess.run([sys.executable, "-m", "jax_moe.bench", "overlap", "--backend", "cpu", "--iters", "2",
                        "--warmup", "1", "--processes", "2", "--cpu-devices", "1", "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [(r["op"], r["ranks"]) for r in rows] == [("dispatch", 2), ("combine", 2)], rows
    assert all(r["comm_us"] > 0 and r["overlap_us"] > 0 and r["min_step_us"] >= 0 for r in rows)
    assert all(0 <= r["sends_apart_us"] < 60e6 for r in rows), rows  # one host's clock: both processes stamp it


def test_sends_apart_is_the_spread_of_the_ranks_first_stamps():
    """`bench overlap`'s "ranks' sends apart": per iteration, the latest rank's first stamp minus the earliest's
    (ns in, us out), p50 over iterations; later stamps do not enter it."""
    from jax_moe.bench.overlap import sends_apart_us
    rng = np.random.default_rng()
    n, iters = int(rng.integers(2, 6)), int(rng.integers(3, 40)) | 1
    base = rng.integers(0, 10**12, size=(1, iters, 1))
    ns = base + rng.integers(0, 10**6, size=(n, iters, 4))  # [n, iters, stamps]
    first = ns[..., 0]
    want = np.sort(first.max(axis=0) - first.min(axis=0))[iters // 2] / 1e3
    assert sends_apart_us(ns) == pytest.approx(want)
    ns[..., 1:] += rng.integers(0, 10**9, size=(n, iters, 3))
    assert sends_apart_us(ns) == pytest.approx(want)
    assert sends_apart_us(np.repeat(ns[:1], n, axis=0)) == 0.0


def test_overlap_prints_a_missing_fraction_as_a_dash():
    """`bench overlap`'s percent cells (hidden, hidden as run, gemm slowed): "-" where a fraction is None (no
    communication or GEMM time), the cell's width either way."""
    from jax_moe.bench.overlap import _percent
    assert _percent(None, 8) == "       -" and _percent(0.834, 8) == "     83%"
    assert _percent(-0.07, 12) == " " * 9 + "-7%"


def test_overlap_rounds_run_one_after_another_in_one_program():
    """`bench overlap --unroll`: a program runs `unroll` rounds, each starting after the one before has ended (its
    first stamp after the previous round's last), every round's stamps come back in order, and the iteration count
    is rounded up to whole programs."""
    import jax
    import jax.numpy as jnp
    from jax_moe.backends import cpu as cpu_backend
    from jax_moe.bench.overlap import _run
    from jax_moe.bench.programs import make_inputs
    rng = np.random.default_rng()
    devices = jax.devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), ("ep",), devices=devices)
    inputs = make_inputs(rng, n, 8, 64, 4 * n, 2, False)
    unroll, iters = int(rng.integers(2, 5)), int(rng.integers(3, 9))

    def body(x, xs, idx, w):
        x, t0 = cpu_backend.timestamp(x, idx)
        y = jnp.tanh(x.astype(jnp.float32) @ x.astype(jnp.float32).T)  # some work between the stamps
        y, t1 = cpu_backend.timestamp(y, t0)  # not (y, y): see programs.py on stamps
        return jnp.stack([t0, t1])[None], x

    steps, ns = _run(body, mesh, inputs, iters, 1, False, stamps=True, unroll=unroll)
    programs = -(-iters // min(unroll, iters))
    assert ns.shape == (n, programs * min(unroll, iters), 2), ns.shape
    assert steps.shape == (ns.shape[1], 1), steps.shape
    flat = ns.reshape(n, -1)  # per rank: t0, t1 of round 0, t0, t1 of round 1, ...
    assert (np.diff(flat, axis=1) >= 0).all(), flat
    assert (steps >= 0).all()


def test_window_copies_finds_a_copy_inside_a_timed_window():
    """A stamp whose dep is its own passed-through operand makes XLA copy that buffer between the work and the stamp
    (it cannot write in place what the same call reads): window_copies names it; stamping with an earlier stamp's
    time as dep leaves none."""
    import jax
    import jax.numpy as jnp
    from jax_moe.backends import cpu as cpu_backend
    from jax_moe.bench.programs import make_inputs, program, window_copies
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("ep",), devices=devices)
    inputs = make_inputs(np.random.default_rng(), len(devices), 8, 64, 4 * len(devices), 2, False)

    def body(same):
        def f(x, xs, idx, w):
            x, t0 = cpu_backend.timestamp(x, idx)
            y = jnp.tanh(x.astype(jnp.float32))
            y, t1 = cpu_backend.timestamp(y, y if same else t0)
            return jnp.stack([t0, t1])[None]
        return f

    bad = window_copies(program(body(True), mesh, inputs)[0].as_text())
    assert len(bad) == 1 and "copy" in bad[0], bad
    assert bad[0].endswith(" (window 1)"), bad  # between the first kept stamp and the second
    assert window_copies(program(body(False), mesh, inputs)[0].as_text()) == []


def test_benchmark_programs_have_no_copy_inside_a_timed_window():
    """`bench moe`'s iterations, `bench overlap`'s three programs per operation and its micro-batch programs, compiled
    for the "cpu" backend (XLA's copy insertion is the same pass on GPU): no copy inside a timed window."""
    import jax
    from jax_moe.bench import micro_batches, overlap, programs
    mesh, comm, inputs, stamp = _cpu_comm()

    def moe(split):
        def f(x, xs, idx, w):  # gpu_run's loop
            return jax.numpy.stack(programs.iterations("cpu", comm, 0, 0, "ep", stamp, x, xs, idx, w, idx, 2,
                                                       split))[None]
        return f

    bodies = {"moe": moe(True), "moe, no split": moe(False)}
    names = ("comm", "sequential", "two micro-batches", "both open")
    for name, body in zip(names, micro_batches.bodies(comm, stamp, 256)):
        bodies[f"micro-batches {name}"] = overlap.stamps_only(body)
        bodies[f"micro-batches {name}, rounds"] = overlap.rounds(body, 2, False, stamp)
    for op in ("dispatch", "combine"):
        for name, body in zip(("comm", "gemm", "overlap"), overlap._programs(comm, op, stamp, 256)):
            bodies[f"{op} {name}"] = overlap.rounds(body, 2, False, stamp)
    for name, body in bodies.items():
        assert programs.window_copies(programs.program(body, mesh, inputs)[0].as_text()) == [], name


def test_moe_iterations_copy_x_at_most_once():
    """An iteration's start stamp passes x on in place, so XLA copies x for every iteration that gets the program's
    own x while a later one still reads it; where XLA puts those copies is its scheduler's choice (on the H200 it put
    them between iterations, in the window from one iteration's last stamp to the next one's start: flagged by
    window_copies, though no operation's time includes it). gpu_run's loop (programs.iterations, compiled here with the
    CPU stamp) gives each iteration the x the previous start stamp passed on, so the program copies x once at most
    (the parameter, before the first stamp), however many iterations it has."""
    import jax
    from jax_moe.bench import programs
    mesh, comm, inputs, stamp = _cpu_comm()

    def own_x(x, xs, idx, w):  # the pattern this guards against: each iteration stamps the program's own x
        out, stamps = x, []
        for _ in range(4):
            out, s, _ = programs._api_iteration(comm, stamp, x, xs, idx, w, out)
            stamps.append(s)
        return jax.numpy.stack(stamps)[None]

    def loop(split):
        def f(x, xs, idx, w):
            return jax.numpy.stack(programs.iterations("cpu", comm, 0, 0, "ep", stamp, x, xs, idx, w, x, 4,
                                                       split))[None]
        return f

    assert _copies_of_x(programs.program(own_x, mesh, inputs)[0].as_text()) >= 3  # the count sees the pattern
    for split in (True, False):
        assert _copies_of_x(programs.program(loop(split), mesh, inputs)[0].as_text()) <= 1, split


def test_overlap_rounds_copy_x_at_most_once():
    """`bench overlap`'s rounds (and its micro-batch rounds) pass x on from round to round as `bench moe`'s
    iterations do: one copy of x at most per program, where stamping the program's own x every round cost one a
    round."""
    from jax_moe.bench import micro_batches, overlap, programs
    mesh, comm, inputs, stamp = _cpu_comm()
    bodies = {f"micro-batches {i}": b for i, b in enumerate(micro_batches.bodies(comm, stamp, 256))}
    for op in ("dispatch", "combine"):
        bodies.update({f"{op} {i}": b for i, b in enumerate(overlap._programs(comm, op, stamp, 256))})
    for name, body in bodies.items():
        hlo = programs.program(overlap.rounds(body, 4, False, stamp), mesh, inputs)[0].as_text()
        assert _copies_of_x(hlo) <= 1, name


@pytest.mark.multiprocess
def test_moe_bench_across_processes_on_cpu(tmp_path):
    """`bench moe --processes 2` on CPU: the "cpu" backend's ranks of the other process go through the proxy, XLA's
    through jax.distributed's CPU collectives; every rank's stamps are gathered (no array of another process is
    read), and process 0 writes both backends' rows."""
    p = subprocess.run([sys.executable, "-m", "jax_moe.bench", "moe", "--backend", "cpu,xla", "--shape", "small",
                        "--iters", "2", "--warmup", "1", "--processes", "2", "--cpu-devices", "1", "--provider", "tcp",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["meta"]["processes"] == 2 and doc["meta"]["ranks"] == 2, doc["meta"]
    rows = doc["results"]
    assert sorted(r["backend"] for r in rows) == ["cpu", "xla"], p.stdout[-3000:]
    for r in rows:
        assert all(0 < r["stats"][h]["p50"] <= r["stats"][h]["p99"] for h in ("dispatch", "combine")), r


def test_overlap_bench_runs_end_to_end_on_cpu(tmp_path):
    """`python -m jax_moe.bench overlap` (issue 14) on the "cpu" backend: dispatch and combine, each alone, the GEMM
    alone, and the GEMM pinned between the halves by barriers: its stamps come in program order (send, GEMM, recv)."""
    out = tmp_path / "overlap.json"
    p = subprocess.run([sys.executable, "-m", "jax_moe.bench", "overlap", "--backend", "cpu", "--iters", "3",
                        "--warmup", "1", "--micro-batches", "--json", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [r["op"] for r in rows] == ["two micro-batches", "dispatch", "combine"], rows
    assert all(r["backend"] == "cpu" for r in rows)
    # Two micro-batches in one layer (B's dispatch in flight while A's experts run): runs with one buffer per
    # direction, and the hidden fraction is what its three timings say.
    mb = rows.pop(0)
    assert mb["comm_us"] > 0 and mb["sequential_us"] > 0 and mb["two_us"] > 0 and mb["expert_width"] % 128 == 0
    assert mb["hidden_fraction"] == pytest.approx((mb["sequential_us"] - mb["two_us"]) / (mb["comm_us"] / 2))
    # "cpu" holds two rounds per direction: the schedule with both micro-batches' rounds open ran too
    assert mb["both_open_us"] > 0
    assert mb["both_open_hidden_fraction"] == pytest.approx((mb["sequential_us"] - mb["both_open_us"]) /
                                                            (mb["comm_us"] / 2))
    for r in rows:
        assert r["comm_us"] > 0 and r["gemm_us"] > 0 and r["gemm_f"] % 128 == 0
        assert r["min_step_us"] >= 0 and 0 < r["gemm_in_overlap_us"] and r["overlap_us"] > 0
        assert r["hidden_fraction"] == pytest.approx((r["comm_us"] + r["gemm_us"] - r["overlap_us"]) / r["comm_us"])
        assert r["sends_apart_us"] >= 0  # one process, one clock


def _fake_processes(monkeypatch) -> list:
    """The launcher's processes replaced by ones that exit at once: the list fills with each one's environment."""
    from jax_moe.bench import processes

    envs = []

    class Done:
        returncode = 0

        def __init__(self, cmd, env, **_):
            envs.append(env)

        def wait(self):
            return 0

        def communicate(self):
            return "", None

    monkeypatch.setattr(processes.subprocess, "Popen", Done)
    monkeypatch.setattr(processes, "gpu_count", lambda: 1)
    return envs


def test_the_launcher_loads_cuda_modules_eagerly_unless_told(monkeypatch):
    """`--processes N` starts fresh processes, so it sets CUDA_MODULE_LOADING=EAGER before they use CUDA (then
    fabric_memory "auto" stages the areas of remote ranks through HBM); a value the user set is kept."""
    from jax_moe.bench import processes

    envs = _fake_processes(monkeypatch)
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    assert processes.launch(["--iters", "1"], 2) == 0
    assert [e["CUDA_MODULE_LOADING"] for e in envs] == ["EAGER", "EAGER"]
    assert [e[processes.PROC_ENV].split(",")[:2] for e in envs] == [["0", "2"], ["1", "2"]]
    envs.clear()
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    processes.launch(["--iters", "1"], 2)
    assert [e["CUDA_MODULE_LOADING"] for e in envs] == ["LAZY", "LAZY"]


def test_profiled_writes_a_trace_only_when_asked(tmp_path, monkeypatch):
    """JAX_MOE_BENCH_PROFILE=DIR: the timed runs are traced by jax.profiler into DIR/p<process>; unset, nothing."""
    import jax.numpy as jnp
    from jax_moe.bench import diagnostics

    monkeypatch.delenv("JAX_MOE_BENCH_PROFILE", raising=False)
    with diagnostics.profiled(0):
        jnp.ones(4).block_until_ready()
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv("JAX_MOE_BENCH_PROFILE", str(tmp_path))
    with diagnostics.profiled(1):
        jnp.ones(4).block_until_ready()
    assert list(tmp_path.glob("p1/**/perfetto_trace.json.gz")), list(tmp_path.rglob("*"))


def test_profiled_reports_only_its_own_run(tmp_path, monkeypatch, capsys):
    """A profile folder used before (another shape, an earlier call) keeps its traces; the table after a run counts
    only the trace that run wrote."""
    import gzip

    from jax_moe.bench import diagnostics

    def trace(where, runs):
        where.mkdir(parents=True)
        events = [{"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}}]
        events += [{"ph": "X", "pid": 7, "tid": 3, "ts": 10.0 * i, "dur": 2.0, "name": "OldKernel"} for i in range(runs)]
        with gzip.open(where / "perfetto_trace.json.gz", "wt") as f:
            json.dump({"traceEvents": events}, f)

    runs = int(np.random.default_rng().integers(2, 9))
    trace(tmp_path / "p0" / "earlier", runs)  # a previous run's trace in the same folder
    monkeypatch.setenv("JAX_MOE_BENCH_PROFILE", str(tmp_path))
    monkeypatch.setattr(diagnostics.jax.profiler, "trace", lambda folder, **_: _writes(trace, tmp_path / "p0" / "now"))
    with diagnostics.profiled(0):
        pass
    out = capsys.readouterr().out
    assert "no GPU activity" in out and "OldKernel" not in out  # this run's trace has no kernel
    assert f"OldKernel {runs}" in " ".join(diagnostics.kernel_table(str(tmp_path / "p0")).split())


@contextlib.contextmanager
def _writes(trace, where):
    """jax.profiler.trace's stand-in: the run's trace (no kernels) appears when the block ends."""
    yield
    trace(where, 0)


def test_kernel_table_reads_the_gpu_rows_of_a_perfetto_trace(tmp_path):
    """kernel_table: the GPU process's complete events by short name (namespaces, templates, parameters dropped),
    p50 / p99 duration, the p50 gap after the activity before on the same stream, the host's events left out."""
    import gzip
    import json

    from jax_moe.bench import diagnostics

    rng = np.random.default_rng()
    pack = rng.uniform(10, 30, 9)
    events = [{"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 1, "name": "PjitFunction(body)", "dur": 999.0}]
    # one stream (tid 3): each pack kernel `gaps[i]` after the one before it ends; the copy on a stream of its own
    gaps = rng.uniform(1, 9, pack.size)
    starts = np.cumsum(gaps) + np.concatenate([[0.0], np.cumsum(pack[:-1])])
    events += [{"ph": "X", "pid": 7, "tid": 3, "ts": float(t), "dur": float(d), "name": "void jax_moe::cuda::"
                "(anonymous namespace)::DispatchPackKernel(jax_moe::cuda::KernelArgs, int)"} for t, d in zip(starts, pack)]
    events += [{"ph": "X", "pid": 7, "tid": 4, "ts": 50, "dur": 2.0, "name": "MemcpyDtoH"}]
    (tmp_path / "p0" / "x").mkdir(parents=True)
    with gzip.open(tmp_path / "p0" / "x" / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": [events[i] for i in rng.permutation(len(events))]}, f)  # any order in the file
    table = diagnostics.kernel_table(str(tmp_path / "p0")).splitlines()
    assert len(table) == 3 and "Pjit" not in "".join(table)
    name, count, p50, _, gap = table[1].split()
    assert (name, int(count)) == ("DispatchPackKernel", 9) and abs(float(p50) - np.percentile(pack, 50)) < 0.06
    assert abs(float(gap) - np.percentile(gaps[1:], 50)) < 0.06  # the first kernel has none before it on its stream
    assert table[2].split()[:2] == ["MemcpyDtoH", "1"] and table[2].split()[-1] == "-"
    assert len(diagnostics.kernel_table(str(tmp_path / "p0"), rows=1).splitlines()) == 2
    assert "no GPU activity" in diagnostics.kernel_table(str(tmp_path / "empty"))
    (tmp_path / "cpu").mkdir()
    with gzip.open(tmp_path / "cpu" / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events[1:3]}, f)  # a host-only trace
    assert "no GPU activity" in diagnostics.kernel_table(str(tmp_path / "cpu"))


def test_trace_summary_names_each_recorded_point_and_drops_the_unrecorded(monkeypatch):
    """The device trace's medians per half and point, relative to the first op's send start, in us; a point a half
    never records (0: the send halves' fabric phases without ranks on other nodes, or kernels with 4 points) is left
    out rather than printed as a huge negative time."""
    import types

    from jax_moe.bench import diagnostics
    rng = np.random.default_rng()
    ring, halves = 64, 6
    for points in (4, 8):
        tr = np.zeros((ring, halves, points), np.uint64)
        used = rng.choice(ring, size=20, replace=False)
        base = rng.integers(1 << 40, 1 << 41, size=20).astype(np.uint64)
        offsets = {}  # (half, point) -> ns after dispatch_send's start, the same in every round
        for h in range(4):
            for p in range(points):
                if p >= 4 and h != 0:  # only dispatch_send records the fabric phases here
                    continue
                offsets[h, p] = 0 if (h, p) == (0, 0) else int(rng.integers(1, 900_000))
                tr[used, h, p] = base + np.uint64(offsets[h, p])
        backend = types.SimpleNamespace(read_trace=lambda tr=tr: {3: tr})
        monkeypatch.setenv("JAX_MOE_CUDA_TRACE", "1")
        out = diagnostics.trace_summary(types.SimpleNamespace(backend=backend))
        names = diagnostics._TRACE_HALVES
        want = {f"{names[h]}.{diagnostics._TRACE_POINTS[p]}": v / 1e3 for (h, p), v in offsets.items()}
        assert set(out[3]) == set(want), (points, sorted(set(out[3]) ^ set(want)))
        for k, v in want.items():
            assert abs(out[3][k] - v) < 1e-6, (k, out[3][k], v)


def test_stamp_gaps_split_each_window_around_the_traced_kernel(monkeypatch):
    """stamp_gaps: per local GPU and half, the p50 from the stamp before to the kernel's traced start, the kernel, and
    from its end to the stamp after, matching each stamp window with the trace round that starts inside it (the ring
    in any order, holding fewer rounds than the run had); a rank that is not this process's is left out."""
    import types

    from jax_moe.backends.bootstrap import RankEntry
    from jax_moe.bench import diagnostics
    rng = np.random.default_rng()
    iters, ring, ordinal, rank = 100, 64, 2, 1
    stamps = np.zeros((3, iters, 6), np.int64)  # three ranks; this process holds rank 1 on GPU 2
    tr = np.zeros((ring, 6, 8), np.uint64)
    want = {}
    t = int(rng.integers(1 << 40, 1 << 41))
    parts = {h: [rng.uniform(1, 20, iters), rng.uniform(5, 60, iters), rng.uniform(1, 20, iters)]
             for h, _, _ in diagnostics._STAMP_WINDOWS}
    slot = rng.permutation(ring)  # which ring slot each of the last `ring` iterations lands in
    for i in range(iters):
        stamps[rank, i, 0] = t
        for h, k, half in diagnostics._STAMP_WINDOWS:
            if k == 3:  # the expert stand-in between the halves
                t += 7_000
                stamps[rank, i, 3] = t
            before, kernel, after = (int(p[i] * 1e3) for p in parts[h])
            if i >= iters - ring:
                tr[slot[i - (iters - ring)], half, 0] = t + before
                tr[slot[i - (iters - ring)], half, 3] = t + before + kernel
            t += before + kernel + after
            stamps[rank, i, k + 1] = t
        t += 3_000
    for h in parts:  # the rounds the ring still holds, ns -> us as the stamps were made
        want[h] = [np.median(np.floor(p[iters - ring:] * 1e3)) / 1e3 for p in parts[h]]
    table = types.SimpleNamespace(local=lambda process: [RankEntry(5, 0, ordinal, 0, rank)])
    backend = types.SimpleNamespace(read_trace=lambda: {ordinal: tr, 7: tr}, table=table)
    monkeypatch.setenv("JAX_MOE_CUDA_TRACE", "1")
    out = diagnostics.stamp_gaps(types.SimpleNamespace(backend=backend), stamps)
    assert set(out) == {ordinal}, out.keys()
    for h, (before, kernel, after) in want.items():
        got = out[ordinal][h]
        assert got["rounds"] == ring, (h, got)
        assert max(abs(got["before"] - before), abs(got["kernel"] - kernel), abs(got["after"] - after)) < 1e-6, (h, got)
    monkeypatch.setenv("JAX_MOE_CUDA_TRACE", "0")
    assert diagnostics.stamp_gaps(types.SimpleNamespace(backend=backend), stamps) is None


def test_the_launcher_gives_each_process_its_own_settings(monkeypatch, capsys):
    """JAX_MOE_BENCH_ENV_<i>="KEY=VALUE ...": process i alone gets KEY (to tell a sender's side from a receiver's on one
    GPU); a malformed setting, or one for a process that does not exist, stops the launch before any process starts."""
    from jax_moe.bench import processes

    envs = _fake_processes(monkeypatch)
    for k in [k for k in os.environ if k.startswith(processes.RANK_ENV)]:
        monkeypatch.delenv(k)
    value = str(np.random.default_rng().integers(1, 1 << 30))  # fresh each run: nothing else can have set it
    monkeypatch.setenv("JAX_MOE_BENCH_ENV_1", f"JAX_MOE_TEST_ONE={value}  JAX_MOE_TEST_TWO=a=b")
    assert processes.launch(["--iters", "1"], 3) == 0
    assert [e.get("JAX_MOE_TEST_ONE") for e in envs] == [None, value, None]
    assert [e.get("JAX_MOE_TEST_TWO") for e in envs] == [None, "a=b", None]  # the first "=" splits
    assert [e[processes.PROC_ENV].split(",")[0] for e in envs] == ["0", "1", "2"]
    assert processes.process_settings() == {"JAX_MOE_BENCH_ENV_1": f"JAX_MOE_TEST_ONE={value}  JAX_MOE_TEST_TWO=a=b"}

    for bad, words in [("JAX_MOE_TEST_ONE", "not KEY=VALUE"), ("=1", "not KEY=VALUE"), ("1X=2", "not KEY=VALUE"),
                       ("A=1 A=2", "A is set twice")]:
        envs.clear()
        monkeypatch.setenv("JAX_MOE_BENCH_ENV_1", bad)
        assert processes.launch(["--iters", "1"], 2) == 2 and envs == [], bad
        err = capsys.readouterr().err
        assert "JAX_MOE_BENCH_ENV_1" in err and words in err, err
    monkeypatch.setenv("JAX_MOE_BENCH_ENV_1", "A=1")
    monkeypatch.setenv("JAX_MOE_BENCH_ENV_2", "A=1")
    assert processes.launch(["--iters", "1"], 2) == 2 and envs == []
    err = capsys.readouterr().err
    assert "JAX_MOE_BENCH_ENV_2" in err and "no such process" in err and "ENV_1" not in err, err
