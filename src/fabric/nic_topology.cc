#include "fabric/nic_topology.h"

#include "common/error.h"
#include "common/log.h"

#include <stdlib.h>  // realpath (POSIX)

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>

namespace jax_moe::fabric {
namespace {

// `s` as hexadecimal of 1..max_digits digits, or -1.
long ParseHex(const std::string& s, size_t max_digits) {
  if (s.empty() || s.size() > max_digits) return -1;
  long v = 0;
  for (char c : s) {
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else if (c >= 'A' && c <= 'F') {
      d = c - 'A' + 10;
    } else {
      return -1;
    }
    v = v * 16 + d;
  }
  return v;
}

std::string RealPath(const std::string& path) {
  std::unique_ptr<char, decltype(&::free)> resolved(::realpath(path.c_str(), nullptr), &::free);
  return resolved ? std::string(resolved.get()) : std::string();
}

std::vector<std::string> Components(const std::string& path) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find('/', start);
    if (end == std::string::npos) end = path.size();
    if (end > start) out.push_back(path.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

// Leading components two paths share; whole components, so ".../0000:18:00.0" and ".../0000:18:00.01" share none.
size_t SharedDepth(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

std::vector<size_t> Depths(const std::string& gpu_path, const std::vector<std::string>& nic_paths) {
  const std::vector<std::string> gpu = Components(gpu_path);
  std::vector<size_t> depth;
  depth.reserve(nic_paths.size());
  for (const std::string& p : nic_paths) depth.push_back(p.empty() ? 0 : SharedDepth(gpu, Components(p)));
  return depth;
}

// Indices by decreasing depth; ties keep their input order.
std::vector<int> ByDepth(const std::vector<size_t>& depth) {
  std::vector<int> order(depth.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return depth[a] > depth[b]; });
  return order;
}

}  // namespace

std::string NormalizePciBusId(const std::string& bus_id) {
  // [domain:]bus:device.function
  const size_t dot = bus_id.rfind('.');
  if (dot == std::string::npos) return {};
  const size_t colon2 = bus_id.rfind(':', dot);
  if (colon2 == std::string::npos) return {};
  const size_t colon1 = colon2 == 0 ? std::string::npos : bus_id.rfind(':', colon2 - 1);
  const long domain = colon1 == std::string::npos ? 0 : ParseHex(bus_id.substr(0, colon1), 8);
  const size_t bus_start = colon1 == std::string::npos ? 0 : colon1 + 1;
  const long bus = ParseHex(bus_id.substr(bus_start, colon2 - bus_start), 2);
  const long dev = ParseHex(bus_id.substr(colon2 + 1, dot - colon2 - 1), 2);
  const long fn = ParseHex(bus_id.substr(dot + 1), 1);
  if (domain < 0 || bus < 0 || dev < 0 || dev > 0x1f || fn < 0 || fn > 7) return {};
  char out[32];
  std::snprintf(out, sizeof(out), "%04lx:%02lx:%02lx.%lx", domain, bus, dev, fn);  // as Linux names them
  return out;
}

std::string PciSysfsPath(const std::string& bus_id, const std::string& sysfs_root) {
  const std::string id = NormalizePciBusId(bus_id);
  if (id.empty()) return {};
  return RealPath(sysfs_root + "/bus/pci/devices/" + id);
}

std::string InfinibandSysfsPath(const std::string& ibv_name, const std::string& sysfs_root) {
  if (ibv_name.empty() || ibv_name.find('/') != std::string::npos) return {};
  return RealPath(sysfs_root + "/class/infiniband/" + ibv_name + "/device");
}

std::vector<int> RankNics(const std::string& gpu_path, const std::vector<std::string>& nic_paths) {
  if (gpu_path.empty()) return ByDepth(std::vector<size_t>(nic_paths.size(), 0));
  return ByDepth(Depths(gpu_path, nic_paths));
}

std::vector<int> NearestNics(const std::string& gpu_path, const std::vector<std::string>& nic_paths) {
  if (gpu_path.empty() || nic_paths.empty()) return RankNics(gpu_path, nic_paths);
  const std::vector<size_t> depth = Depths(gpu_path, nic_paths);
  const size_t best = *std::max_element(depth.begin(), depth.end());
  std::vector<int> out;
  for (size_t i = 0; i < depth.size(); ++i) {
    if (depth[i] == best) out.push_back(static_cast<int>(i));
  }
  return out;
}

std::vector<int> NicsForGpu(const std::string& gpu_bus_id, const std::vector<std::string>& nic_bus_ids,
                            const std::string& sysfs_root) {
  std::vector<std::string> nic_paths;
  nic_paths.reserve(nic_bus_ids.size());
  for (const std::string& id : nic_bus_ids) nic_paths.push_back(PciSysfsPath(id, sysfs_root));
  return NearestNics(PciSysfsPath(gpu_bus_id, sysfs_root), nic_paths);
}

std::vector<int> ParseCpuList(const std::string& list) {
  std::vector<int> cpus;
  size_t at = 0;
  const std::string text = list.substr(0, list.find_last_not_of(" \n\t") + 1);
  while (at < text.size()) {
    size_t end = text.find(',', at);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(at, end - at);
    char* stop = nullptr;
    const long lo = std::strtol(item.c_str(), &stop, 10);
    long hi = lo;
    if (stop == item.c_str() || lo < 0) return {};
    if (*stop == '-') {
      const char* from = stop + 1;
      hi = std::strtol(from, &stop, 10);
      if (stop == from || hi < lo) return {};
    }
    if (*stop != 0 || hi >= 1 << 16) return {};
    for (long c = lo; c <= hi; ++c) cpus.push_back(int(c));
    at = end + 1;
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

namespace {

// The first line of a PCI device's sysfs attribute <sysfs_root>/bus/pci/devices/<id>/<name>; empty when unknown.
std::string PciAttribute(const std::string& bus_id, const char* name, const std::string& sysfs_root) {
  const std::string id = NormalizePciBusId(bus_id);
  if (id.empty()) return {};
  std::ifstream in(sysfs_root + "/bus/pci/devices/" + id + "/" + name);
  std::string line;
  if (!in || !std::getline(in, line)) return {};
  return line;
}

}  // namespace

std::vector<int> PciLocalCpus(const std::string& bus_id, const std::string& sysfs_root) {
  const std::string line = PciAttribute(bus_id, "local_cpulist", sysfs_root);
  return line.empty() ? std::vector<int>{} : ParseCpuList(line);
}

int PciNumaNode(const std::string& bus_id, const std::string& sysfs_root) {
  // strtol, not `in >> node`: a stream's number parsing goes through the process's locale facets, which crashed
  // (SIGSEGV in codecvt) where another C++ runtime is loaded beside ours (the GPU machine's torch venv).
  const std::string line = PciAttribute(bus_id, "numa_node", sysfs_root);
  char* end = nullptr;
  const long node = std::strtol(line.c_str(), &end, 10);
  if (end == line.c_str() || *end != 0 || node < 0 || node > INT_MAX) return -1;
  return static_cast<int>(node);
}

std::vector<int> OrderNicsForGpu(const std::string& who, const std::string& gpu_bus_id,
                                 const std::vector<std::string>& names, const std::vector<std::string>& paths,
                                 int opened, const std::string& sysfs_root) {
  Require(names.size() == paths.size(), who + ": one PCI path per NIC name");
  const std::string gpu = PciSysfsPath(gpu_bus_id, sysfs_root);
  if (gpu.empty()) JAX_MOE_LOG(kWarn, "%s: GPU %s not found in sysfs: NICs in enumeration order", who.c_str(), gpu_bus_id.c_str());
  const std::vector<int> order = RankNics(gpu, paths);
  std::string chosen;
  for (size_t j = 0; j < order.size() && int(j) < opened; ++j) {
    const int i = order[j];
    chosen += Format("%s%s (%s)", chosen.empty() ? "" : ", ", names[i].c_str(),
                     paths[i].empty() ? "no PCI path" : paths[i].c_str());
  }
  JAX_MOE_LOG(kInfo, "%s: GPU %s: %zu of %zu NICs nearest; opening %s", who.c_str(), gpu_bus_id.c_str(),
              NearestNics(gpu, paths).size(), paths.size(), chosen.c_str());
  return order;
}

}  // namespace jax_moe::fabric
