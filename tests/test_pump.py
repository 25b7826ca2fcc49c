"""The GPU proxy path on CPU: the Pump (src/proxy/pump.h) serves ranks in other processes over tcp and shm while a
host thread plays the GPU (tests/support/pump_worker.py): it writes regions and doorbells and reads the flags the
pump raises, exactly as the kernels will. Every round's regions are checked byte for byte on every receiver."""
import json
import os
import subprocess
import sys
import time

import pytest

from support.fabric_mp import AVAILABLE

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support", "pump_worker.py")


def run_ranks(tmp_path, n, provider, rounds, mode, timeout=60.0, nodes=(), stragglers=(), reads=()):
    env = dict(os.environ, PYTHONUNBUFFERED="1", FI_LOG_LEVEL="warn", PUMP_NODES=",".join(map(str, nodes)),
               PUMP_STRAGGLER=",".join(map(str, stragglers)), PUMP_STRAGGLER_READS=",".join(map(str, reads)))
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(WORKER), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, WORKER, str(tmp_path), str(r), str(n), provider, str(rounds), mode],
                              stdout=open(tmp_path / f"log.{r}", "w"), stderr=subprocess.STDOUT, env=env)
             for r in range(n)]
    try:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, f"ranks still running after {timeout} s"
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = {r: (tmp_path / f"log.{r}").read_text() for r in range(n)}
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{logs[r]}"
    return {r: json.loads((tmp_path / f"result.{r}").read_text()) for r in range(n)
            if (tmp_path / f"result.{r}").exists()}


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_every_round_arrives_intact_through_the_pump(tmp_path, provider):
    if provider not in AVAILABLE:
        pytest.skip(f"libfabric provider {provider} not built in")
    results = run_ranks(tmp_path, 3, provider, rounds=12, mode="ok")  # 12 rounds over 3 lanes: credits cycle
    for r, res in results.items():
        assert res == {"rank": r, "rounds": 12, "error": "", "bad_regions": []}


@pytest.mark.parametrize("mode", ["ok", "slow"])
@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_buffers_of_other_nodes_ranks_only(tmp_path, provider, mode):
    """A GPU's areas hold regions for the ranks on other nodes only (proxy::RegionSlots::OtherNodes). Nodes of
    unequal size: ranks 0 and 1 share a node and exchange nothing through the pump; rank 2's and 3's buffers hold three
    regions a lane, 0's and 1's two, so a sender's region sits at another slot in each receiver (rank 3's at slot 2 in
    rank 2's buffer, at slot 1 in rank 0's). Every round of every pair still arrives intact where its receiver reads
    it."""
    if provider not in AVAILABLE:
        pytest.skip(f"libfabric provider {provider} not built in")
    results = run_ranks(tmp_path, 4, provider, rounds=9, mode=mode, nodes=(0, 0, 1, 2))
    for r, res in results.items():
        assert res == {"rank": r, "rounds": 9, "error": "", "bad_regions": [], "slots": 2 if r < 2 else 3}, res


@pytest.mark.parametrize("straggler", [0, 2])
@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_a_receiver_late_with_its_credits_holds_back_only_its_own_regions(tmp_path, provider, straggler):
    """A rank reads round 1, then gives no credit until the others have finished all 6 rounds (3 lanes): their rounds
    5 and 6 cannot go to it (its lanes are still unread) but must go to each other. The straggler is first in the
    others' order of remote ranks (rank 0: a pass that finds it without credit starts the next one after it, so the
    other receiver gets its rounds; a pump that kept asking it first would never post them) or last (rank 2)."""
    if provider not in AVAILABLE:
        pytest.skip(f"libfabric provider {provider} not built in")
    results = run_ranks(tmp_path, 3, provider, rounds=6, mode="straggler", stragglers=[straggler])
    for r, res in results.items():
        # `sent` (the lanes the device may rewrite) never passes what every receiver has: the straggler's credit
        # for round 1 lets rounds up to 1 + 3 lanes go to it
        assert r == straggler or res.pop("sent") <= 4, res
        assert res == {"rank": r, "rounds": 6, "error": "", "bad_regions": []}, res


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_two_late_receivers_hold_back_no_one_else(tmp_path, provider):
    """Ranks 0 and 1 of 4 hold their credits, rank 0 after reading 2 rounds, rank 1 after 1. A sender then has rank 0
    one round ahead of rank 1, and the two stop its pass at different rounds (1 at round 5, 0 at round 6), first and
    second in its order; ranks 2 and 3 must still get every round from each other. A pass that went on from where
    any round last stopped would keep skipping them (each stop moving the next pass's start past them)."""
    if provider not in AVAILABLE:
        pytest.skip(f"libfabric provider {provider} not built in")
    results = run_ranks(tmp_path, 4, provider, rounds=6, mode="straggler", stragglers=[0, 1], reads=[2, 1])
    for r, res in results.items():
        assert r in (0, 1) or res.pop("sent") <= 4, res  # rank 1's credit for round 1 lets rounds up to 4 go
        assert res == {"rank": r, "rounds": 6, "error": "", "bad_regions": []}, res


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_two_communicators_share_one_engine(tmp_path, provider):
    """A GPU's Communicators share its engine (one proxy thread per GPU): their pumps run side by side as hooks of
    its progress thread, and each sees exactly its own rounds, in whatever order the two are rung."""
    if provider not in AVAILABLE:
        pytest.skip(f"libfabric provider {provider} not built in")
    results = run_ranks(tmp_path, 3, provider, rounds=9, mode="shared")
    for r, res in results.items():
        assert res == {"rank": r, "rounds": 9, "error": "", "bad_regions": []}


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_hooks_not_ready_at_first_hold_each_round_back_in_order(tmp_path, provider):
    """A GPU's copy engine (fabric_memory="staged") is not done when the pump first asks: the pump asks again on
    later passes, posts and flags every round once, in order, and every region still arrives intact."""
    if provider not in AVAILABLE:
        pytest.skip(f"libfabric provider {provider} not built in")
    results = run_ranks(tmp_path, 3, provider, rounds=9, mode="slow")
    for r, res in results.items():
        assert res == {"rank": r, "rounds": 9, "error": "", "bad_regions": []}


def test_an_arrival_the_device_side_never_gets_ready_for_stops_the_pump(tmp_path):
    """A copy into GPU memory that never completes: rank 0's pump stops within twice the timeout, saying so, instead
    of leaving its receive kernel to wait; the others see rank 0 go quiet and fail naming it."""
    if "tcp" not in AVAILABLE:
        pytest.skip("libfabric provider tcp not built in")
    t0 = time.monotonic()
    results = run_ranks(tmp_path, 3, "tcp", rounds=3, mode="stuck")
    assert time.monotonic() - t0 < 50
    assert results[0]["rounds"] == 0, results[0]
    assert "arrived, but the device side was not ready to read it within 10 s" in results[0]["error"], results[0]
    for r in (1, 2):
        assert results[r]["rounds"] <= 1 and results[r]["error"], results[r]


def test_a_killed_peer_fails_the_survivors_within_the_timeout(tmp_path):
    if "tcp" not in AVAILABLE:
        pytest.skip("libfabric provider tcp not built in")
    t0 = time.monotonic()
    results = run_ranks(tmp_path, 3, "tcp", rounds=6, mode="kill")
    assert time.monotonic() - t0 < 40
    assert sorted(results) == [0, 1]
    for res in results.values():
        assert res["rounds"] == 2, res
        assert "no data from rank 2 within 5 s (round 3)" in res["error"], res


def test_a_forged_row_count_is_caught_before_it_is_followed(tmp_path):
    if "tcp" not in AVAILABLE:
        pytest.skip("libfabric provider tcp not built in")
    results = run_ranks(tmp_path, 3, "tcp", rounds=3, mode="forge")
    for r, res in results.items():
        assert res["rounds"] == 3 and res["error"] == "", res
        want = ["rank 1 announced 21 rows, more than the 16 a region holds"] if r != 1 else []
        assert res["bad_regions"] == want, res


def test_a_device_announcing_more_than_a_region_stops_its_pump(tmp_path):
    """Whatever a device announces, the pump writes nothing outside the receiver's region: it stops with an error
    the device sees, and the other ranks time out naming that rank."""
    if "tcp" not in AVAILABLE:
        pytest.skip("libfabric provider tcp not built in")
    results = run_ranks(tmp_path, 3, "tcp", rounds=3, mode="overflow")
    # Rank 1 may still finish round 2: its pump flags the others' round-2 regions as they arrive, possibly before the
    # pass that finds the bad announcement. Its own round 2 never leaves.
    assert results[1]["rounds"] in (1, 2) and "more than a region holds" in results[1]["error"], results[1]
    for r in (0, 2):
        assert results[r]["rounds"] == 1 and "no data from rank 1 within 5 s (round 2)" in results[r]["error"], results
