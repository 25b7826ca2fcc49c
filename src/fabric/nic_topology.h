// Which NICs sit nearest a GPU on the PCIe tree, from sysfs paths. Pure string and filesystem code (no CUDA, no
// libfabric, no verbs), so tests run it on CPU against fake sysfs trees.
//
// A device's resolved sysfs path lists the bridges above it, e.g. /sys/devices/pci0000:17/0000:17:01.0/0000:18:00.0
// (root complex, root port, device). Two devices behind the same PCIe switch share more leading components than two
// that only share a root complex, and those more than devices on different root complexes. Traffic between a GPU and a
// NIC under one switch stays off the CPU's root complex.
#pragma once
#include <string>
#include <vector>

namespace jax_moe::fabric {

// "dddd:bb:dd.f" (lowercase, domain at least 4 hex digits) from "0000:18:00.0", CUDA's "00000000:18:00.0" or
// "18:00.0" (domain 0); empty when `bus_id` is not a PCI address.
std::string NormalizePciBusId(const std::string& bus_id);

// realpath of <sysfs_root>/bus/pci/devices/<normalised bus id>; empty when the id is malformed or not present.
std::string PciSysfsPath(const std::string& bus_id, const std::string& sysfs_root = "/sys");

// realpath of <sysfs_root>/class/infiniband/<ibv device name>/device; empty when not present.
std::string InfinibandSysfsPath(const std::string& ibv_name, const std::string& sysfs_root = "/sys");

// Every NIC index, nearest the GPU first (most leading path components shared); ties keep their input order. An
// empty (unknown) NIC path shares nothing. An empty GPU path leaves the input order.
std::vector<int> RankNics(const std::string& gpu_path, const std::vector<std::string>& nic_paths);

// The NICs sharing the most leading path components with the GPU (same switch, else same root complex, else all), in
// input order. All NICs when the GPU path is empty; empty when there are none.
std::vector<int> NearestNics(const std::string& gpu_path, const std::vector<std::string>& nic_paths);

// NearestNics with the GPU and NICs named by PCI bus id, resolved under `sysfs_root`.
std::vector<int> NicsForGpu(const std::string& gpu_bus_id, const std::vector<std::string>& nic_bus_ids,
                            const std::string& sysfs_root = "/sys");

// The order in which an engine of the GPU at `gpu_bus_id` opens its NICs: RankNics of their sysfs `paths` (empty:
// unknown, ranked last), logging under `who` ("ofi efa", "verbs") how many are nearest and which `opened` are taken
// (`names`: the NICs' names). The input order, with a warning, when the GPU is not found in sysfs.
std::vector<int> OrderNicsForGpu(const std::string& who, const std::string& gpu_bus_id,
                                 const std::vector<std::string>& names, const std::vector<std::string>& paths,
                                 int opened, const std::string& sysfs_root = "/sys");

// The CPUs local to a PCI device (its NUMA node: <sysfs_root>/bus/pci/devices/<id>/local_cpulist, "0-15,32-47"),
// ascending; empty when unknown. A GPU's proxy thread runs there by default: its polls of host-mapped words and its
// copies stay on the GPU's and NIC's socket.
std::vector<int> PciLocalCpus(const std::string& bus_id, const std::string& sysfs_root = "/sys");

// The NUMA node of a PCI device (<sysfs_root>/bus/pci/devices/<id>/numa_node); -1 when unknown (no such device, or
// a machine that does not say: one node, many VMs). A GPU's pinned areas prefer it (numa_memory.h).
int PciNumaNode(const std::string& bus_id, const std::string& sysfs_root = "/sys");

// "0-3,8,10-11" -> {0,1,2,3,8,10,11}; empty on malformed input.
std::vector<int> ParseCpuList(const std::string& list);

}  // namespace jax_moe::fabric
