"""The floors of the moe benchmark between nodes (jax_moe/bench/floor.py): the arithmetic, the target, the table with
n/a, the runs' JSON, the bounded subprocesses, and the whole chain on CPU (an EP1 run of the "cpu" backend and
`bench fabric` on tcp standing in for the cuda run's)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest
from support.fabric_mp import needs

from jax_moe.bench import fabric as fabric_bench
from jax_moe.bench import floor, floor_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rec(**over):
    stats = {op: {"p50": 100.0 + i, "p99": 200.0 + i} for i, op in enumerate(floor.OPS)}
    rec = {"shape": "decode", "tokens": 128, "backend": "cuda", "stats": stats, "remote_dispatch_bytes": 900.0,
           "remote_combine_bytes": 2000.0, "remote_dispatch_bytes_sent": 500.4, "remote_combine_bytes_sent": 1000.0,
           "fabric": {"0": {"provider": "tcp", "on_gpu": False, "memory": "host"}}}
    rec.update(over)
    return rec


def _args(**over):
    a = dict(processes=2, ranks_per_node=1, backend="cuda", floor_timeout=60.0, out="bench_out", warmup=1,
             unroll=25, seed=0, iters=None, sweep_iters=None)
    a.update(over)
    return argparse.Namespace(**a)


# --- arithmetic ------------------------------------------------------------------------------------------------------
def test_one_way_is_the_round_less_half_an_empty_round():
    assert floor.one_way_us(100.0, 40.0) == 80.0
    assert floor.one_way_us(40.0, 40.0) == 20.0  # an empty write one way
    assert floor.one_way_us(10.0, 40.0) == 0.0   # noise at tiny sizes never makes a negative time


def test_floor_is_ep1_plus_one_way_and_the_target_is_one_and_a_half_times_plus_10us():
    f = floor.op_floor(85.0, 30.0, (1000, 20.0))
    assert f["floor_us"] == 50.0 and f["ep1_p50_us"] == 30.0 and f["wire_one_way_us"] == 20.0
    assert f["wire_bytes"] == 1000 and f["target_us"] == 85.0
    assert f["ratio"] == pytest.approx(1.7) and f["meets_target"] is True  # on the bound still holds
    assert floor.op_floor(85.01, 30.0, (1000, 20.0))["meets_target"] is False
    send = floor.op_floor(10.0, 30.0, None)  # a send half waits for no bytes
    assert send["floor_us"] == 30.0 and send["wire_one_way_us"] == 0.0
    missing = floor.op_floor(None, 30.0, (1000, 20.0))
    assert missing["floor_us"] == 50.0 and "ratio" not in missing and "meets_target" not in missing


def test_a_missing_input_makes_the_floor_n_a_with_the_reason():
    assert floor.op_floor(85.0, "EP1 run: timed out", (1, 2.0)) == {"n/a": "EP1 run: timed out"}
    assert floor.op_floor(85.0, 30.0, "bench fabric: failed") == {"n/a": "bench fabric: failed"}


def test_record_floors_use_the_bytes_sent_and_put_the_wire_into_receive_halves_and_totals():
    rec = _rec()
    ep1 = {("decode", 128, "cuda"): {op: 10.0 for op in floor.OPS}}
    wire = {500: 7.0, 1000: 9.0}
    out = floor.rec_floors(rec, ep1, wire)
    assert [out[op]["floor_us"] for op in floor.OPS] == [10.0, 17.0, 17.0, 10.0, 19.0, 19.0]
    assert out["dispatch"]["wire_bytes"] == 500 and out["combine"]["wire_bytes"] == 1000
    assert out["dispatch"]["p50_us"] == rec["stats"]["dispatch"]["p50"]
    # without a summed combine the rows per (t, k) travel
    del rec["remote_combine_bytes_sent"]
    assert floor.rec_floors(rec, ep1, {500: 7.0, 2000: 11.0})["combine"]["floor_us"] == 21.0
    assert "no 2000 B round" in floor.rec_floors(rec, ep1, wire)["combine"]["n/a"]
    assert "no decode T=128 cuda" in floor.rec_floors(rec, {}, wire)["dispatch"]["n/a"]
    ep1[("decode", 128, "cuda")]["combine_recv"] = None
    assert "did not time combine_recv" in floor.rec_floors(_rec(), ep1, wire)["combine_recv"]["n/a"]
    assert floor.rec_floors(_rec(), "EP1 run: gone", wire)["dispatch_send"] == {"n/a": "EP1 run: gone"}
    assert floor.rec_floors(_rec(), ep1, "fabric: gone")["dispatch_send"]["floor_us"] == 10.0  # needs no wire
    assert floor.rec_floors(_rec(), ep1, "fabric: gone")["dispatch"] == {"n/a": "fabric: gone"}


# --- JSON and table --------------------------------------------------------------------------------------------------
def test_parse_the_runs_json():
    ep1 = floor.parse_ep1({"meta": {}, "results": [
        {"shape": "decode", "tokens": 128, "backend": "cuda",
         "stats": {"dispatch": {"p50": 20.0, "p99": 30.0}, "combine": {"p50": None, "p99": None}}}]})
    assert ep1[("decode", 128, "cuda")]["dispatch"] == 20.0
    assert ep1[("decode", 128, "cuda")]["combine"] is None and ep1[("decode", 128, "cuda")]["dispatch_send"] is None
    doc = {"shm": [{"size": 0, "p50_us": 30.0}, {"size": 4096, "p50_us": 40.0}], "shm_registration": "dmabuf",
           "shm_fi_pingpong_us": 3.0}
    one_way, how = floor.parse_fabric(doc, "shm")
    assert one_way == {0: 15.0, 4096: 25.0} and how == "dmabuf"
    with pytest.raises(floor.Unavailable, match="no rows for tcp"):
        floor.parse_fabric(doc, "tcp")
    with pytest.raises(floor.Unavailable, match="empty round"):
        floor.parse_fabric({"shm": [{"size": 4096, "p50_us": 40.0}]}, "shm")


def test_table_shows_each_floor_its_ratio_and_target_or_why_not():
    rec = _rec()
    ep1 = {("decode", 128, "cuda"): {op: 10.0 for op in floor.OPS}}
    rec["floor"] = floor.rec_floors(rec, ep1, "bench fabric (tcp, host memory): ran past 5 s")
    rec["floor"]["dispatch_send"] = floor.op_floor(1000.0, 10.0, None)
    meta = {"provider": "tcp", "fabric": {"memory": "host", "error": "x"}}
    lines = floor.table([rec, _rec(backend="xla")], meta)
    assert "FLOOR" in lines[0] and "tcp" in lines[0] and floor.TARGET in lines[0]
    rows = {line.split()[3]: line for line in lines[2:]}
    assert set(rows) == set(floor.OPS)  # the record without floors prints nothing
    assert rows["dispatch"].rstrip().endswith("n/a (bench fabric (tcp, host memory): ran past 5 s)")
    cells = rows["dispatch_send"].split()
    assert cells[6:8] == ["10.0", "10.0"] and cells[10] == "100.00" and cells[11] == "NO"  # 1000 > 1.5 * 10 + 10
    assert "(<= 25.0)" in rows["dispatch_send"]
    assert "both ways" in lines[0] and lines[1].split()[-10:] == ["both", "ways", "x", "both", "x", "+copies", "EP1",
                                                                   "twin", "x", "twin"]
    # both ways: beside the floor of an operation that waits for bytes, not in it; "-" where not measured or a send
    both = floor.rec_floors(rec, ep1, {500: 40.0, 1000: 70.0}, {500: 55.0})
    assert both["dispatch"]["wire_both_ways_us"] == 55.0 and both["dispatch"]["floor_us"] == 50.0
    assert both["dispatch"]["ratio_both_ways"] == pytest.approx(_rec()["stats"]["dispatch"]["p50"] / (10.0 + 55.0))
    assert "wire_both_ways_us" not in both["combine"] and "wire_both_ways_us" not in both["dispatch_send"]
    rec["floor"] = both
    rows = {line.split()[3]: line for line in floor.table([rec], meta)[2:]}
    want = f'{_rec()["stats"]["dispatch"]["p50"] / 65.0:.2f}'
    assert rows["dispatch"].split()[-5:] == ["55.0", want, "-", "-", "-"]
    assert rows["combine"].split()[-5:] == ["-"] * 5


def test_a_staged_run_shows_its_floor_with_the_two_copies_beside_it():
    """fabric_memory="staged" adds two copies per round (out of HBM, into it) that the floor's wire does not have:
    beside the floor, not in it, x +copies = p50 / (floor + 2 * bytes at the copy rate); none for a send half. The
    rate is small enough here (0.05 GB/s: 20 us for 500 B) that x +copies and x floor differ in the table."""
    rec = _rec()
    ep1 = {("decode", 128, "cuda"): {op: 10.0 for op in floor.OPS}}
    rate = 0.05
    got = floor.rec_floors(rec, ep1, {500: 40.0, 1000: 70.0}, {}, copy_gbps=rate)
    nbytes = got["dispatch"]["wire_bytes"]
    assert got["dispatch"]["staging_us"] == pytest.approx(2 * nbytes / (rate * 1e3))  # bytes / (GB/s) in us
    assert got["dispatch"]["floor_us"] == 10.0 + got["dispatch"]["wire_one_way_us"]  # the floor itself is unchanged
    p50 = rec["stats"]["dispatch"]["p50"]
    with_copies = got["dispatch"]["floor_us"] + 2 * nbytes / (rate * 1e3)
    assert got["dispatch"]["ratio_with_copies"] == pytest.approx(p50 / with_copies)
    assert "staging_us" not in got["dispatch_send"] and "staging_us" not in got["combine_send"]
    assert "staging_us" not in floor.rec_floors(rec, ep1, {500: 40.0, 1000: 70.0})["dispatch"]  # not staged
    rec["floor"] = got
    meta = {"provider": "shm", "fabric": {"memory": "host"}, "staged": True, "staging_copy_GBps": rate}
    lines = floor.table([rec], meta)
    assert "x +copies" in lines[0] and "0.05 GB/s" in lines[0]
    rows = {line.split()[3]: line for line in lines[2:]}
    for op in ("dispatch", "dispatch_recv", "combine", "combine_recv"):
        cells = rows[op].split()
        assert cells[-3] == f"{got[op]['ratio_with_copies']:.2f}", op
        assert cells[-3] != cells[10] == f"{got[op]['ratio']:.2f}", op  # x +copies beside x floor, not equal to it
    assert rows["dispatch_send"].split()[-3] == "-"


def test_a_staged_run_without_a_copy_rate_says_so():
    """A staged run whose copy rate was not measured: x +copies reads "n/a" where it would have a value, and the
    table's first line says why, once; the floor and its other columns are as without staging."""
    rec = _rec()
    ep1 = {("decode", 128, "cuda"): {op: 10.0 for op in floor.OPS}}
    wire = {500: 40.0, 1000: 70.0}
    got = floor.rec_floors(rec, ep1, wire, {}, copy_gbps=floor.NO_COPY_RATE)
    plain = floor.rec_floors(rec, ep1, wire, {})
    for op in floor.OPS:
        assert {k: v for k, v in got[op].items() if k != "staging_n/a"} == plain[op], op
        assert ("staging_n/a" in got[op]) == (floor.WIRE[op] is not None), op
    assert got["dispatch"]["staging_n/a"] == "no copy rate measured"
    assert floor.op_floor(100.0, 10.0, (500, 40.0), copy_gbps=0.0)["staging_n/a"] == floor.NO_COPY_RATE
    rec["floor"] = got
    lines = floor.table([rec], {"provider": "shm", "fabric": {"memory": "host"}, "staged": True,
                                "staging_copy_GBps": None})
    assert lines[0].endswith("; x +copies: n/a (no copy rate measured)")
    rows = {line.split()[3]: line for line in lines[2:]}
    assert rows["dispatch"].split()[-3] == "n/a" and rows["combine"].split()[-3] == "n/a"
    assert rows["dispatch_send"].split()[-3] == "-"
    assert "x +copies:" not in floor.table([rec], {"provider": "shm", "fabric": {"memory": "host"}})[0]  # not staged


def test_processes_sharing_a_gpu_get_the_ep1_run_made_at_once_beside_the_floor():
    """EP1 twin: the EP1 run as the processes sharing a GPU all at once, the mean of their p50s per operation; beside
    the floor (x twin = p50 / (EP1 twin + one-way)), never in it; "-" where not measured."""
    a = {"meta": {}, "results": [{"shape": "decode", "tokens": 128, "backend": "cuda",
                                  "stats": {op: {"p50": 10.0} for op in floor.OPS}}]}
    b = json.loads(json.dumps(a))
    for op in floor.OPS:
        b["results"][0]["stats"][op]["p50"] = 14.0
    b["results"][0]["stats"]["combine"] = {}
    twin = floor.parse_twin([a, b])
    assert twin[("decode", 128, "cuda")]["dispatch"] == 12.0
    assert twin[("decode", 128, "cuda")]["combine"] is None  # one of them did not time it
    lost = json.loads(json.dumps(b))
    lost["results"] = []  # a run that failed its shape (the bench goes on without a record)
    with pytest.raises(floor.Unavailable, match=r"run 1 of 2 measured no decode T=128 cuda \(floor_ep1_twin1.log\)"):
        floor.parse_twin([a, lost])
    rec = _rec()
    ep1 = {("decode", 128, "cuda"): {op: 10.0 for op in floor.OPS}}
    got = floor.rec_floors(rec, ep1, {500: 40.0, 1000: 70.0}, {}, twin=twin)
    plain = floor.rec_floors(rec, ep1, {500: 40.0, 1000: 70.0}, {})
    assert got["dispatch"]["floor_us"] == plain["dispatch"]["floor_us"] == 50.0  # the floor itself is unchanged
    p50 = rec["stats"]["dispatch"]["p50"]
    assert got["dispatch"]["ratio_twin"] == pytest.approx(p50 / (12.0 + 40.0))
    assert got["dispatch_send"]["ratio_twin"] == pytest.approx(rec["stats"]["dispatch_send"]["p50"] / 12.0)
    assert "ep1_twin_p50_us" not in got["combine"] and "ep1_twin_p50_us" not in plain["dispatch"]
    rec["floor"] = got
    meta = {"provider": "shm", "fabric": {"memory": "host"}, "ep1_twin": {"copies": 2, "overlap": 0.8}}
    lines = floor.table([rec], meta)
    assert "EP1 run as 2 processes at once" in lines[0] and "which ran 80 % of the time together" in lines[0]
    rows = {line.split()[3]: line for line in lines[2:]}
    assert rows["dispatch"].split()[-2:] == ["12.0", f"{p50 / 52.0:.2f}"] and rows["combine"].split()[-2:] == ["-", "-"]
    assert "EP1 twin: n/a (EP1 run, 2 at once: gone)" in floor.table(
        [rec], dict(meta, ep1_twin={"copies": 2, "error": "EP1 run, 2 at once: gone"}))[0]


def test_the_twin_runs_overlap_is_the_time_all_ran_over_the_longest_run():
    def doc(*walls):
        return {"results": [{"shape": "decode", "tokens": 128, "backend": "cuda", "wall": list(w)} for w in walls]}
    assert floor.twin_overlap([doc((0.0, 10.0)), doc((2.0, 12.0))]) == pytest.approx(0.8)
    assert floor.twin_overlap([doc((0.0, 10.0)), doc((11.0, 12.0))]) == 0.0  # one after the other
    assert floor.twin_overlap([doc((0.0, 10.0)), {"results": [{"shape": "decode", "tokens": 128,
                                                               "backend": "cuda"}]}]) is None  # an older bench


def test_the_twin_runs_start_together_each_into_its_own_folder(tmp_path):
    """cached_twin runs the EP1 command as many times at once, each writing its own --out; a cache keeps the pair."""
    script = tmp_path / "fake_ep1.py"
    script.write_text("import json, os, sys, time\n"
                      "out = sys.argv[sys.argv.index('--out') + 1]\n"
                      "os.makedirs(out, exist_ok=True)\n"
                      "t0 = time.time(); time.sleep(1.0)\n"
                      "json.dump({'start': t0, 'end': time.time(), 'out': out}, open(os.path.join(out, 'results.json'), 'w'))\n")
    cmd = [sys.executable, str(script), "--out", str(tmp_path / "floor_ep1"), "--iters", "5"]
    docs, reused = floor_runs.cached_twin(str(tmp_path / "cache"), cmd, 2, str(tmp_path), 30.0)
    assert not reused and len({d["out"] for d in docs}) == 2
    assert max(d["start"] for d in docs) < min(d["end"] for d in docs)  # they ran at the same time
    again, reused = floor_runs.cached_twin(str(tmp_path / "cache"), cmd, 2, str(tmp_path), 30.0)
    assert reused and again == docs
    assert not floor_runs.cached_twin(str(tmp_path / "cache"), cmd, 3, str(tmp_path), 30.0)[1]  # another count: measured


def test_x_with_copies_of_a_zero_floor_is_none_not_a_division_by_zero():
    f = floor.op_floor(5.0, 0.0, (0, 0.0), copy_gbps=50.0)
    assert f["staging_us"] == 0.0 and f["ratio_with_copies"] is None and f["ratio"] is None


def test_ep1_command_and_environment():
    cmd = floor_runs.ep1_command(_args(iters=200, warmup=2), ["cuda"], ["decode", "sweep"], "/o/floor_ep1")
    assert cmd[1:4] == ["-m", "jax_moe.bench", "moe"]
    flags = dict(zip(cmd[4::2], cmd[5::2]))
    assert flags == {"--backend": "cuda", "--shape": "decode,sweep", "--ranks": "1", "--warmup": "2",
                     "--unroll": "25", "--seed": "0", "--out": "/o/floor_ep1", "--iters": "200"}
    os.environ["JAX_MOE_RANKS_PER_NODE"] = "1"
    try:
        env = floor_runs.ep1_env()
    finally:
        del os.environ["JAX_MOE_RANKS_PER_NODE"]
    assert "JAX_MOE_RANKS_PER_NODE" not in env and env["PATH"] == os.environ["PATH"]
    fab = floor_runs.fabric_command("shm", "cuda", [4096, 512], 2, "f.json")
    assert fab[fab.index("--sizes") + 1] == "0,512,4096" and fab[fab.index("--memory") + 1] == "cuda"


def test_floors_are_wanted_only_for_cuda_ranks_on_other_nodes():
    assert floor.wanted(_args()) and floor.wanted(_args(backend=None)) and floor.wanted(_args(backend="xla,cuda"))
    assert not floor.wanted(_args(processes=1))
    assert not floor.wanted(_args(ranks_per_node=None))
    assert not floor.wanted(_args(backend="cpu"))
    assert not floor.wanted(_args(floor_timeout=0))


# --- bounded runs ----------------------------------------------------------------------------------------------------
def test_a_floor_cache_runs_each_command_once_whatever_its_output_paths(tmp_path):
    runs = []

    def run(v):
        return lambda: (runs.append(v), {"v": v})[1]

    ep1 = ["py", "-m", "jax_moe.bench", "moe", "--shape", "decode", "--out", "/a/floor_ep1"]
    moved = ep1[:-1] + ["/b/floor_ep1"]  # the next memory's benchmark writes elsewhere: the same measurement
    assert floor_runs.cached_json(None, ep1, run(1)) == ({"v": 1}, False)
    assert floor_runs.cached_json(None, ep1, run(2)) == ({"v": 2}, False)  # no cache: every time
    cache = str(tmp_path / "cache")
    assert floor_runs.cached_json(cache, ep1, run(3)) == ({"v": 3}, False)
    assert floor_runs.cached_json(cache, moved, run(4)) == ({"v": 3}, True)
    other = ep1[:5] + ["prefill"] + ep1[6:]
    assert floor_runs.cached_json(cache, other, run(5)) == ({"v": 5}, False)
    fab = ["py", "-m", "jax_moe.bench", "fabric", "--providers", "shm", "--json", "/a/f.json"]
    assert floor_runs.cached_json(cache, fab, run(6)) == ({"v": 6}, False)
    assert floor_runs.cached_json(cache, fab[:-1] + ["/b/f.json"], run(7)) == ({"v": 6}, True)
    assert runs == [1, 2, 3, 5, 6]


def test_run_json_reads_the_json_and_turns_failures_into_reasons(tmp_path):
    out, log = str(tmp_path / "r.json"), str(tmp_path / "r.log")
    py = sys.executable
    write = f"import json; json.dump({{'a': 1}}, open({out!r}, 'w'))"
    assert floor_runs.run_json([py, "-c", write], out, 30, log) == {"a": 1}
    with pytest.raises(floor.Unavailable, match="exited with 3: boom"):
        floor_runs.run_json([py, "-c", "import sys; print('boom'); sys.exit(3)"], out, 30, log)
    with pytest.raises(floor.Unavailable, match="wrote no results"):  # also: the earlier run's JSON was removed
        floor_runs.run_json([py, "-c", "pass"], out, 30, log)
    # a run past its time goes, with the processes it started
    pid_file = tmp_path / "child.pid"
    hang = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    t0 = time.monotonic()
    with pytest.raises(floor.Unavailable, match="ran past 2 s"):
        floor_runs.run_json([py, "-c", hang], out, 2, log)
    assert time.monotonic() - t0 < 10
    child = int(pid_file.read_text())
    for _ in range(100):  # reaped by init once killed
        if not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail("the run's own child survived the timeout")


def test_report_never_raises_and_skips_stale_or_local_results(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"meta": {}, "results": [_rec(fabric=None)]}))
    floor.report_file(str(path), _args(), time.time() + 60)
    assert "from an earlier run" in capsys.readouterr().err
    floor.report_file(str(path), _args(), 0)
    assert "no result with ranks on other nodes" in capsys.readouterr().out
    path.write_text("{not json")
    floor.report_file(str(path), _args(), 0)
    assert "floors: n/a (JSONDecodeError" in capsys.readouterr().err


def test_fabric_bench_memory_cuda_without_the_cuda_module_says_so(monkeypatch, capsys):
    from jax_moe import _core

    monkeypatch.delattr(_core, "cuda", raising=False)
    assert fabric_bench.main(["--providers", "tcp", "--peers", "1", "--sizes", "64", "--memory", "cuda"]) == 2
    assert "no cuda module" in capsys.readouterr().err


def test_register_ptr_passes_a_dmabuf_only_with_device_memory():
    import numpy as np

    from jax_moe import fabric

    eng = fabric.TransferEngine("tcp" if "tcp" in _providers() else "shm")
    try:
        buf = np.zeros(4096, np.uint8)
        assert eng.register(buf).registration == "host"
        with pytest.raises(ValueError, match="dmabuf_fd is for device memory"):
            eng.register_ptr(buf.ctypes.data, buf.nbytes, dmabuf_fd=3)
    finally:
        eng.close()
    fake = fabric.TransferEngine("tcp" if "tcp" in _providers() else "shm", fake_device_memory=True)
    try:  # the device path as far as a CPU goes: how it was registered comes back to Python
        assert fake.register_ptr(buf.ctypes.data, buf.nbytes, device=0, dmabuf_fd=-1).registration.startswith("fake")
    finally:
        fake.close()


def _providers():
    from support.fabric_mp import AVAILABLE

    return AVAILABLE


# --- end to end on CPU -----------------------------------------------------------------------------------------------
@needs("tcp")
def test_fabric_bench_host_memory_reports_its_registration(tmp_path):
    out = tmp_path / "fabric.json"
    p = subprocess.run([sys.executable, "-m", "jax_moe.bench", "fabric", "--providers", "tcp", "--peers", "1",
                        "--sizes", "0,64,4K", "--memory", "host", "--warmup", "2", "--iters", "20",
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [r["size"] for r in doc["tcp"]] == [0, 64, 4096]
    assert all(r["memory"] == "host" and r["registration"] == "host" for r in doc["tcp"])
    assert doc["tcp_registration"] == "host"
    one_way, how = floor.parse_fabric(doc, "tcp")
    assert how == "host" and one_way[0] > 0 and set(one_way) == {0, 64, 4096}


@needs("tcp")
def test_report_measures_ep1_and_the_engine_and_writes_the_floors(tmp_path, capsys):
    """The launcher's step after the processes, on a results.json whose one record stands for a cuda run with a
    remote rank: the "cpu" backend's EP1 run and `bench fabric` on tcp give its floors, printed and written back."""
    rec = _rec(shape="small", tokens=64, backend="cpu")
    (tmp_path / "results.json").write_text(json.dumps({"meta": {"argv": []}, "results": [rec]}))
    args = _args(backend="cpu", iters=3, out=str(tmp_path))
    floor.report_file(str(tmp_path / "results.json"), args, 0)
    printed = capsys.readouterr().out
    doc = json.loads((tmp_path / "results.json").read_text())
    meta = doc["meta"]["floor"]
    assert "error" not in meta["ep1"] and "error" not in meta["fabric"], meta
    assert meta["provider"] == "tcp" and meta["fabric"]["memory"] == "host" and meta["fabric"]["registration"] == "host"
    assert sorted(meta["fabric"]["one_way_p50_us"]) == ["0", "1000", "500"]
    floors = doc["results"][0]["floor"]
    assert set(floors) == set(floor.OPS)
    for op, f in floors.items():
        assert f["ep1_p50_us"] > 0 and f["floor_us"] >= f["ep1_p50_us"], (op, f)
        assert f["ratio"] == pytest.approx(rec["stats"][op]["p50"] / f["floor_us"])
        # the receive halves and totals carry the wire (>= 0: at 500 B the one-way is within the p50s' noise, and a
        # loaded machine can clamp it to 0); the send halves none
        assert (f["wire_one_way_us"] >= 0) if floor.WIRE[op] is not None else not f["wire_one_way_us"], (op, f)
    assert floors["dispatch"]["wire_bytes"] == 500 and floors["combine"]["wire_bytes"] == 1000
    assert "error" not in meta["exchange"], meta["exchange"]  # both ways at once, beside the floor
    assert sorted(meta["exchange"]["both_ways_p50_us"]) == ["0", "1000", "500"]
    assert floors["dispatch"]["wire_both_ways_us"] > 0 and "wire_both_ways_us" not in floors["dispatch_send"]
    assert "FLOOR" in printed and printed.count("small       64 cpu") == len(floor.OPS)
    assert (tmp_path / "floor_ep1" / "results.json").exists() and (tmp_path / "floor_fabric.log").exists()
    assert (tmp_path / "floor_exchange.log").exists()
    assert "ep1_twin" not in meta  # processes sharing a GPU only: no GPU here
