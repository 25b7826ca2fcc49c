"""Matching GPUs to their nearest NICs by PCIe topology (src/fabric/nic_topology.h), on fake sysfs trees.

A tree mimics Linux: devices/pci<domain>:<bus>/<root port>/<switch ports...>/<device> directories, with
bus/pci/devices/<bus id> and class/infiniband/<name> symlinks into them.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

_core = pytest.importorskip("jax_moe._core")
T = _core.fabric._testing


class FakeSysfs:
    def __init__(self, root: Path) -> None:
        self.root = root

    def add_pci(self, chain: list[str]) -> str:
        """Adds the device at the end of `chain` (root complex, bridges..., device); returns its bus id."""
        device_dir = self.root.joinpath("devices", *chain)
        device_dir.mkdir(parents=True, exist_ok=True)
        bus_id = chain[-1]
        links = self.root / "bus" / "pci" / "devices"
        links.mkdir(parents=True, exist_ok=True)
        link = links / bus_id
        if not link.exists():
            os.symlink(os.path.relpath(device_dir, links), link)  # ../../../devices/pci.../<bus id>, as in /sys
        return bus_id

    def add_ib(self, name: str, nic_chain: list[str]) -> None:
        """An RDMA device `name` on the PCI function at the end of `nic_chain`."""
        self.add_pci(nic_chain)
        ib_dir = self.root.joinpath("devices", *nic_chain, "infiniband", name)
        ib_dir.mkdir(parents=True)
        os.symlink(f"../../../{nic_chain[-1]}", ib_dir / "device")
        cls = self.root / "class" / "infiniband"
        cls.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(ib_dir, cls), cls / name)

    def path(self, chain: list[str]) -> str:
        return str(self.root.joinpath("devices", *chain).resolve())


def switch_chain(rc_bus: int, port: int, base: int) -> list[str]:
    """Root complex pci0000:<rc_bus>, its root port <port>, a switch whose upstream port is on bus `base`."""
    return [f"pci0000:{rc_bus:02x}", f"0000:{rc_bus:02x}:{port:02x}.0", f"0000:{base:02x}:00.0"]


def dgx_like(root: Path) -> tuple[FakeSysfs, list[str], list[str]]:
    """8 GPUs and 4 NICs behind 4 PCIe switches (2 GPUs and 1 NIC each), 2 switches per root complex.

    The NICs are listed in reverse switch order, so matching by index alone would be wrong.
    """
    fs = FakeSysfs(root)
    gpus, nics = [], []
    for sw in range(4):
        rc_bus = 0x00 if sw < 2 else 0x80
        base = rc_bus + 0x10 + 0x10 * sw
        up = switch_chain(rc_bus, 1 + sw % 2, base)
        for g in range(2):
            down = f"0000:{base + 1:02x}:{g:02x}.0"
            gpus.append(fs.add_pci(up + [down, f"0000:{base + 2 + g:02x}:00.0"]))
        nics.append(fs.add_pci(up + [f"0000:{base + 1:02x}:02.0", f"0000:{base + 4:02x}:00.0"]))
    return fs, gpus, nics[::-1]


def test_each_gpu_gets_the_nic_under_its_own_switch(tmp_path: Path) -> None:
    fs, gpus, nics = dgx_like(tmp_path)
    root = str(tmp_path)
    # nics[::-1]: switch s's NIC is at index 3 - s.
    assert [T.nearest_nics(g, nics, root) for g in gpus] == [[3], [3], [2], [2], [1], [1], [0], [0]]


def test_rank_prefers_same_switch_then_same_root_complex(tmp_path: Path) -> None:
    fs, gpus, nics = dgx_like(tmp_path)
    root = str(tmp_path)
    nic_paths = [T.pci_sysfs_path(n, root) for n in nics]
    # GPU 0 (switch 0, root complex 0): its NIC (index 3), then switch 1's (2, same root complex), then the far
    # ones in their order.
    assert T.rank_nics(T.pci_sysfs_path(gpus[0], root), nic_paths) == [3, 2, 0, 1]
    assert T.rank_nics(T.pci_sysfs_path(gpus[5], root), nic_paths) == [1, 0, 2, 3]  # then the far ones, in order


def test_engines_open_the_nics_of_their_gpu_first(tmp_path: Path) -> None:
    """The order efa's and verbs' engines open NICs in (one function for both): each GPU's own NIC first; a NIC
    without a PCI path last; a GPU that sysfs does not know keeps the enumeration order."""
    fs, gpus, nics = dgx_like(tmp_path)
    root = str(tmp_path)
    paths = [T.pci_sysfs_path(n, root) for n in nics] + [""]
    names = [f"nic{i}" for i in range(len(paths))]
    assert [T.order_nics_for_gpu("test", g, names, paths, 1, root)[0] for g in gpus] == [3, 3, 2, 2, 1, 1, 0, 0]
    assert T.order_nics_for_gpu("test", gpus[0], names, paths, 2, root) == [3, 2, 0, 1, 4]
    assert T.order_nics_for_gpu("test", "0000:ee:00.0", names, paths, 2, root) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="one PCI path per NIC name"):  # not a read past the names
        T.order_nics_for_gpu("test", gpus[0], names[:1], paths, 2, root)


def test_ties_keep_their_order(tmp_path: Path) -> None:
    fs = FakeSysfs(tmp_path)
    up = switch_chain(0x00, 1, 0x10)
    gpu = fs.add_pci(up + ["0000:11:00.0", "0000:12:00.0"])
    nic_a = fs.add_pci(up + ["0000:11:01.0", "0000:13:00.0"])
    nic_b = fs.add_pci(up + ["0000:11:02.0", "0000:14:00.0"])
    far = fs.add_pci(switch_chain(0x80, 1, 0x90) + ["0000:91:00.0", "0000:92:00.0"])
    root = str(tmp_path)
    assert T.nearest_nics(gpu, [nic_a, far, nic_b], root) == [0, 2]
    assert T.nearest_nics(gpu, [nic_b, nic_a, far], root) == [0, 1]
    paths = [T.pci_sysfs_path(n, root) for n in (far, nic_b, nic_a)]
    assert T.rank_nics(T.pci_sysfs_path(gpu, root), paths) == [1, 2, 0]
    # Two ports of one NIC (functions .0 and .1) tie as well.
    nic_a1 = fs.add_pci(up + ["0000:11:01.0", "0000:13:00.1"])
    assert T.nearest_nics(gpu, [nic_a1, far, nic_a], root) == [0, 2]


def test_nics_on_other_root_complexes(tmp_path: Path) -> None:
    fs = FakeSysfs(tmp_path)
    gpu = fs.add_pci(switch_chain(0x00, 1, 0x10) + ["0000:11:00.0", "0000:12:00.0"])
    nic_rc1 = fs.add_pci(switch_chain(0x40, 1, 0x50) + ["0000:51:00.0", "0000:52:00.0"])
    nic_rc2 = fs.add_pci(switch_chain(0x80, 1, 0x90) + ["0000:91:00.0", "0000:92:00.0"])
    root = str(tmp_path)
    # None near: every NIC, in order.
    assert T.nearest_nics(gpu, [nic_rc1, nic_rc2], root) == [0, 1]
    # One on the GPU's root complex (another root port): that one only.
    nic_rc0 = fs.add_pci(switch_chain(0x00, 2, 0x20) + ["0000:21:00.0", "0000:22:00.0"])
    assert T.nearest_nics(gpu, [nic_rc1, nic_rc2, nic_rc0], root) == [2]
    # Another PCI domain entirely (e.g. VMD) is as far as another root complex.
    nic_dom = fs.add_pci(["pci10000:00", "10000:00:01.0", "10000:01:00.0"])
    assert T.nearest_nics(gpu, [nic_dom, nic_rc1], root) == [0, 1]


def test_unknown_gpu_gets_all_nics(tmp_path: Path) -> None:
    fs, gpus, nics = dgx_like(tmp_path)
    root = str(tmp_path)
    assert T.nearest_nics("0000:ee:00.0", nics, root) == [0, 1, 2, 3]  # not in sysfs
    assert T.nearest_nics("not a bus id", nics, root) == [0, 1, 2, 3]
    assert T.nearest_nics("", nics, root) == [0, 1, 2, 3]
    assert T.rank_nics("", ["/x/a", "/y/b"]) == [0, 1]
    assert T.nearest_nics(gpus[0], [], root) == []
    assert T.nearest_nics("", [], root) == []


def test_unknown_nic_is_ranked_last(tmp_path: Path) -> None:
    fs, gpus, nics = dgx_like(tmp_path)
    root = str(tmp_path)
    assert T.nearest_nics(gpus[0], ["0000:ee:00.0", nics[3]], root) == [1]
    gpu_path = T.pci_sysfs_path(gpus[0], root)
    assert T.rank_nics(gpu_path, ["", T.pci_sysfs_path(nics[0], root), T.pci_sysfs_path(nics[3], root)]) == [2, 1, 0]
    # Only unknown NICs: they tie, all of them.
    assert T.nearest_nics(gpus[0], ["0000:ee:00.0", "0000:ef:00.0"], root) == [0, 1]


def test_components_not_characters(tmp_path: Path) -> None:
    # "0000:11:00.0" is a string prefix of "0000:11:00.01", but they are different bridges.
    gpu = "/sys/devices/pci0000:00/0000:00:01.0/0000:11:00.0/0000:12:00.0"
    near = "/sys/devices/pci0000:00/0000:00:01.0/0000:11:00.0/0000:13:00.0"
    lookalike = "/sys/devices/pci0000:00/0000:00:01.0/0000:11:00.01/0000:12:00.0"
    assert T.nearest_nics_by_path(gpu, [lookalike, near]) == [1]
    assert T.rank_nics(gpu, [lookalike, near]) == [1, 0]


def test_bus_id_forms(tmp_path: Path) -> None:
    assert T.normalize_pci_bus_id("0000:18:00.0") == "0000:18:00.0"
    assert T.normalize_pci_bus_id("00000000:1A:1f.7") == "0000:1a:1f.7"  # CUDA's 8-digit domain, upper case
    assert T.normalize_pci_bus_id("18:00.1") == "0000:18:00.1"
    assert T.normalize_pci_bus_id("00010000:01:00.0") == "10000:01:00.0"  # domains past 0xffff, as Linux prints them
    for bad in ["", "0000:18:00", "0000:18.00.0", "zz:00.0", "0000:18:20.0", "0000:18:00.8", "0000:118:00.0",
                "000000000:18:00.0", "0000:18:00.0 ", ":18:00.0"]:
        assert T.normalize_pci_bus_id(bad) == "", bad


def test_sysfs_paths_resolve_links(tmp_path: Path) -> None:
    fs = FakeSysfs(tmp_path)
    chain = switch_chain(0x17, 1, 0x18) + ["0000:19:00.0", "0000:1a:00.0"]
    fs.add_pci(chain)
    want = fs.path(chain)
    assert want.endswith("/devices/pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:00.0/0000:1a:00.0")
    assert T.pci_sysfs_path("0000:1a:00.0", str(tmp_path)) == want
    assert T.pci_sysfs_path("00000000:1A:00.0", str(tmp_path)) == want
    assert T.pci_sysfs_path("0000:1b:00.0", str(tmp_path)) == ""
    nic_chain = switch_chain(0x17, 1, 0x18) + ["0000:19:01.0", "0000:1b:00.0"]
    fs.add_ib("mlx5_3", nic_chain)
    assert T.infiniband_sysfs_path("mlx5_3", str(tmp_path)) == fs.path(nic_chain)
    assert T.infiniband_sysfs_path("mlx5_9", str(tmp_path)) == ""
    assert T.infiniband_sysfs_path("../mlx5_3", str(tmp_path)) == ""


def test_verbs_devices_by_sysfs_name(tmp_path: Path) -> None:
    # What the verbs backend does: rank ibv devices by /sys/class/infiniband/<name>/device against the GPU.
    fs, gpus, _ = dgx_like(tmp_path)
    root = str(tmp_path)
    names = []
    for sw in range(4):
        rc_bus = 0x00 if sw < 2 else 0x80
        base = rc_bus + 0x10 + 0x10 * sw
        names.append(f"mlx5_{sw}")
        fs.add_ib(names[-1], switch_chain(rc_bus, 1 + sw % 2, base) + [f"0000:{base + 1:02x}:03.0",
                                                                         f"0000:{base + 5:02x}:00.0"])
    paths = [T.infiniband_sysfs_path(n, root) for n in names]
    assert all(paths)
    for g, gpu in enumerate(gpus):
        assert T.nearest_nics_by_path(T.pci_sysfs_path(gpu, root), paths) == [g // 2]


@pytest.mark.skipif(not Path("/sys/bus/pci/devices").is_dir(), reason="no PCI sysfs")
def test_real_sysfs_does_not_crash() -> None:
    ids = sorted(os.listdir("/sys/bus/pci/devices"))[:8]
    paths = [T.pci_sysfs_path(i) for i in ids]
    assert all(p.startswith("/sys/devices/") for p in paths)
    if ids:
        assert T.nearest_nics(ids[0], ids) == [0]  # a device is nearest itself


def test_cpu_lists_parse_or_refuse() -> None:
    assert T.parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert T.parse_cpu_list("5") == [5]
    assert T.parse_cpu_list("4-6,5") == [4, 5, 6]  # overlaps once
    for bad in ("", "a", "3-1", "1,,2", "-1", "1-"):
        assert T.parse_cpu_list(bad) == [], bad


def test_a_gpus_local_cpus_come_from_its_numa_node(tmp_path: Path) -> None:
    """The proxy of a GPU is kept on the CPUs of the GPU's NUMA node (local_cpulist of its PCI device)."""
    fs, gpus, _ = dgx_like(tmp_path)
    root = str(tmp_path)
    for i, g in enumerate(gpus):
        cpus = "0-15,64-79" if i < 4 else "16-31,80-95"
        (Path(T.pci_sysfs_path(g, root)) / "local_cpulist").write_text(cpus + "\n")
    assert T.pci_local_cpus(gpus[0], root) == list(range(16)) + list(range(64, 80))
    assert T.pci_local_cpus("00000000:" + gpus[7][5:], root) == list(range(16, 32)) + list(range(80, 96))
    assert T.pci_local_cpus("0000:ff:00.0", root) == []  # unknown device: anywhere


def test_a_gpus_numa_node_comes_from_sysfs(tmp_path: Path) -> None:
    """The pinned areas of a GPU prefer its NUMA node (numa_node of its PCI device); -1 where sysfs does not say."""
    fs, gpus, _ = dgx_like(tmp_path)
    root = str(tmp_path)
    for i, g in enumerate(gpus):
        (Path(T.pci_sysfs_path(g, root)) / "numa_node").write_text(f"{i // 4}\n")
    assert [T.pci_numa_node(g, root) for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert T.pci_numa_node("00000000:" + gpus[5][5:], root) == 1  # CUDA's spelling of the id
    (Path(T.pci_sysfs_path(gpus[0], root)) / "numa_node").write_text("-1\n")  # what a one-node VM says
    assert T.pci_numa_node(gpus[0], root) == -1
    (Path(T.pci_sysfs_path(gpus[1], root)) / "numa_node").write_text("x\n")
    assert T.pci_numa_node(gpus[1], root) == -1
    assert T.pci_numa_node("0000:ff:00.0", root) == -1 and T.pci_numa_node("not a bus id", root) == -1


def _numa_nodes() -> list[int]:
    return sorted(int(p.name[4:]) for p in Path("/sys/devices/system/node").glob("node[0-9]*")) or [0]


def test_numa_memory_refuses_no_node_and_stays_usable() -> None:
    """No node, or one that does not exist, is never an error: the memory gets the default placement (granted -1)."""
    assert T.numa_memory_nodes(4096, -1)[0] == -1
    assert T.numa_memory_nodes(4096, max(_numa_nodes()) + 7)[0] == -1
    assert T.numa_memory_nodes(1, 0)[0] in (0, -1)  # node 0 exists everywhere; -1 where mbind is refused


def test_numa_memory_lands_on_the_node_asked_for() -> None:
    """Every page, first and last, is on the node asked for. Only a machine with two nodes or more can show it (on one,
    every page is on node 0 whatever is asked), and only where the kernel lets us ask (containers without
    CAP_SYS_NICE refuse mbind)."""
    nodes = _numa_nodes()
    if len(nodes) < 2:
        pytest.skip("one NUMA node: placement cannot be told from the default")
    for node in nodes:
        for size in (1, 4096, 3 << 20):
            granted, first, last = T.numa_memory_nodes(size, node)
            if granted == -1:
                pytest.skip("mbind refused here (no CAP_SYS_NICE?)")
            assert granted == node and (first, last) == (node, node), (size, node, granted, first, last)
