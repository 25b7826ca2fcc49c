"""TransferEngine across 3-4 processes on localhost over the tcp and shm libfabric providers."""
import pytest

from support.fabric_mp import needs, run_world

PROVIDERS = [pytest.param(p, marks=needs(p)) for p in ("tcp", "shm")]

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("world", [3, 4])
def test_scatter_rounds_byte_exact(tmp_path, provider, world):
    """Per-peer sizes/offsets (1 MB rounds, then 300 small rounds back to back), checked byte for byte."""
    res = run_world(tmp_path, world, provider, "rounds", rounds=300)
    assert len(res) == world
    for r in res.values():
        st = r["stats"]
        assert st["write_errors"] == 0
        assert st["writes_completed"] == st["writes_posted"] == (304 * (world - 1) + 2 * (world - 1))
        assert sum(st["imms_per_nic"]) == 306 * (world - 1)
        assert r["guard_clean"]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_two_nics_shard_peers(tmp_path, provider):
    """num_nics=2: a peer set's members are split over both domains; receivers count per NIC."""
    res = run_world(tmp_path, 3, provider, "rounds", num_nics=2, rounds=60)
    per_nic = [0, 0]
    for r in res.values():
        assert len(r["stats"]["imms_per_nic"]) == 2
        for i, c in enumerate(r["stats"]["imms_per_nic"]):
            per_nic[i] += c
    assert per_nic[0] > 0 and per_nic[1] > 0, per_nic
    assert sum(per_nic) == 3 * 2 * 66


@pytest.mark.parametrize("provider", PROVIDERS)
def test_killed_peer_errors_within_timeout(tmp_path, provider):
    """A SIGKILLed peer: survivors get TimeoutError naming it within the 3 s bound, never a hang."""
    res = run_world(tmp_path, 3, provider, "killed")
    survivors = [r for r in res.values() if "victim_peer" in r]
    assert len(survivors) == 2
    for r in survivors:
        victim = f"peer {r['victim_peer']} ("
        assert r["wait_imm"].startswith("TimeoutError"), r
        assert victim in r["wait_imm"], r
        assert "got 1;" in r["wait_imm"], r  # the other survivor's write still arrived
        assert r["wait_imm_seconds"] < 5.0
        # Our writes to the dead peer either completed locally or fail/time out naming it.
        assert r["wait_sends"] == "ok" or victim in r["wait_sends"], r
        assert r["wait_sends_seconds"] < 5.0


@pytest.mark.parametrize("provider", PROVIDERS)
def test_forged_descriptors_rejected(tmp_path, provider):
    res = run_world(tmp_path, 3, provider, "forged")
    r = res[0]
    for key in ("corrupt", "truncated", "garbage", "other_owner", "write_corrupt", "out_of_range"):
        assert r[key].startswith("ValueError"), (key, r[key])
    for key in ("oversized", "shifted", "other_key"):
        assert r[key].startswith("ValueError") and "rejected by its owner" in r[key], (key, r[key])
        assert r[key + "_peer_set"].startswith("ValueError"), (key, r[key + "_peer_set"])
    assert r["genuine"] == "ok"
    assert all(x["recv_untouched"] for x in res.values())
