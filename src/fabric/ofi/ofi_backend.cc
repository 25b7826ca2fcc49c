// libfabric backend: one fabric/domain/AV/CQ/RDM endpoint per NIC, writes with remote CQ data.
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_rma.h>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <map>
#include <random>
#include <set>
#include <unordered_map>

#include "common/error.h"
#include "common/log.h"
#include "fabric/backend.h"
#include "fabric/nic_topology.h"
#include "fabric/ofi/notice_apart.h"
#include "fabric/ofi/ofi_util.h"

namespace jax_moe::fabric {
namespace ofi {
namespace {

// The API version we ask for: 1.20 where the headers have it (FI_MR_DMABUF needs it), else 1.17, the oldest we build
// against. Not 2.x: its semantics differ in ways this backend does not need.
#if FI_VERSION_GE(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), FI_VERSION(1, 20))
constexpr uint32_t kApiVersion = FI_VERSION(1, 20);
#else
constexpr uint32_t kApiVersion = FI_VERSION(1, 17);
#endif

constexpr uint64_t kMrModeWeHandle =
    FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT | FI_MR_HMEM;

struct InfoDeleter {
  void operator()(fi_info* i) const { fi_freeinfo(i); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;

std::string LibfabricName(const std::string& provider) {
  if (provider == "tcp") return "tcp;ofi_rxm";
  return provider;  // "efa", "shm"
}

InfoPtr GetInfo(const std::string& provider, bool want_hmem, bool want_source) {
  InfoPtr hints(fi_allocinfo());
  if (!hints) Throw(ErrorCode::kInternal, "fi_allocinfo failed");
  hints->caps = FI_MSG | FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_SEND | FI_RECV | (want_hmem ? FI_HMEM : 0) |
               (want_source ? FI_SOURCE : 0);
  hints->mode = FI_CONTEXT | FI_CONTEXT2;  // our op contexts reserve OpContextStorage for the provider
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->mr_mode = static_cast<int>(kMrModeWeHandle);
  hints->domain_attr->threading = FI_THREAD_DOMAIN;  // only the progress thread touches the domain
  hints->fabric_attr->prov_name = strdup(LibfabricName(provider).c_str());
  if (provider == "tcp") hints->addr_format = FI_SOCKADDR_IN;
  fi_info* info = nullptr;
  int rc = fi_getinfo(kApiVersion, nullptr, nullptr, 0, hints.get(), &info);
  if (rc != 0 || info == nullptr) {
    Throw(ErrorCode::kUnavailable, "fi_getinfo(provider=" + LibfabricName(provider) + (want_hmem ? ", FI_HMEM" : "") +
                                       (want_source ? ", FI_SOURCE" : "") + "): " + fi_strerror(-rc));
  }
  return InfoPtr(info);
}

struct OfiRegion : BackendRegion {
  std::vector<Fid<fid_mr>> mrs;
};

class OfiBackend final : public Backend {
 public:
  OfiBackend(const std::string& provider, int num_nics, const std::string& pci_bus_id, bool host_memory_only)
      : provider_(provider) {
    // Most wanted first: CUDA memory (FI_HMEM, every provider: efa, and shm and tcp where libfabric was built with
    // CUDA) and, on efa, FI_SOURCE (names senders of 4-byte immediates). Without FI_HMEM only host memory registers.
    InfoPtr list;
    const bool efa = provider == "efa";
    const char* want = std::getenv("JAX_MOE_FABRIC_HMEM");  // "0": never ask (host memory only)
    const bool ask_hmem = !host_memory_only && (want == nullptr || std::string(want) != "0");
    for (int attempt = 0; attempt < 4 && !list; ++attempt) {
      const bool hmem = ask_hmem && attempt < 2, source = efa && attempt % 2 == 0;
      if ((!efa && source) || (!ask_hmem && attempt < 2)) continue;
      try {
        list = GetInfo(provider, hmem, source);
      } catch (const Error&) {
        if (attempt == 3) throw;
      }
    }
    // efa: one NIC per distinct device, those nearest the engine's GPU first (nic_topology.h). tcp/shm: several
    // endpoints on the same device.
    std::vector<fi_info*> devices;
    std::set<std::string> seen;
    for (fi_info* i = list.get(); i != nullptr; i = i->next) {
      if (i->domain_attr->cq_data_size < 4) continue;
      if ((i->domain_attr->mr_mode & ~static_cast<int>(kMrModeWeHandle)) != 0 && i->domain_attr->mr_mode != FI_MR_BASIC) {
        continue;  // e.g. FI_MR_RAW keys we cannot carry
      }
      if (seen.insert(i->domain_attr->name).second) devices.push_back(i);
    }
    if (devices.empty()) {
      Throw(ErrorCode::kUnavailable, "provider " + provider + ": no domain with 4-byte CQ data and usable mr_mode");
    }
    if (provider != "efa") devices.resize(1);
    if (efa && !pci_bus_id.empty()) {
      std::vector<std::string> paths;  // empty where the provider gives no PCI address: ranked last
      for (const fi_info* d : devices) {
        const fi_bus_attr* bus = d->nic != nullptr ? d->nic->bus_attr : nullptr;
        if (bus == nullptr || bus->bus_type != FI_BUS_PCI) {
          paths.emplace_back();
          continue;
        }
        const fi_pci_attr& pci = bus->attr.pci;
        paths.push_back(PciSysfsPath(Format("%04x:%02x:%02x.%x", unsigned(pci.domain_id), unsigned(pci.bus_id),
                                            unsigned(pci.device_id), unsigned(pci.function_id))));
      }
      std::vector<std::string> names;
      for (const fi_info* d : devices) names.emplace_back(d->domain_attr->name);
      std::vector<fi_info*> ranked;
      for (int i : OrderNicsForGpu("ofi efa", pci_bus_id, names, paths, num_nics)) ranked.push_back(devices[i]);
      devices.swap(ranked);
    }
    for (int n = 0; n < num_nics; ++n) Open(devices[n % devices.size()]);
    const fi_info* info = nics_[0]->info.get();
    mr_mode_ = info->domain_attr->mr_mode == FI_MR_BASIC ? (FI_MR_VIRT_ADDR | FI_MR_PROV_KEY | FI_MR_ALLOCATED)
                                                         : static_cast<uint64_t>(info->domain_attr->mr_mode);
    max_msg_ = info->ep_attr->max_msg_size;
    hmem_ = (info->caps & FI_HMEM) != 0;
    if (info->domain_attr->cq_data_size >= 8) {
      imm_mode_ = ImmMode::kWide;
    } else if (info->caps & FI_SOURCE) {
      imm_mode_ = ImmMode::kSource;
    } else {
      imm_mode_ = ImmMode::kPacked;
    }
    // shm copies a write with CQ data on the receiver's progress, one without on the sender's (notice_apart.h).
    // $JAX_MOE_FABRIC_NOTICE_APART: "0" keeps the notice in the write (to measure the difference).
    const char* apart = std::getenv("JAX_MOE_FABRIC_NOTICE_APART");
    notice_apart_ = provider_ == "shm" && (apart == nullptr || std::string(apart) != "0");
    JAX_MOE_LOG(kInfo, "ofi: provider %s, domain %s, mr_mode 0x%llx, NICs %d", info->fabric_attr->prov_name,
                info->domain_attr->name, static_cast<unsigned long long>(mr_mode_), int(num_nics));
  }

  ~OfiBackend() override {
    for (auto& kv : msg_mrs_) fi_close(&kv.second->fid);
  }

  std::string provider() const override { return provider_; }
  int num_nics() const override { return static_cast<int>(nics_.size()); }
  std::string NicAddress(int nic) const override { return nics_[nic]->address; }
  bool remote_virt_addr() const override { return (mr_mode_ & FI_MR_VIRT_ADDR) != 0; }
  uint64_t max_write_bytes() const override { return max_msg_; }
  bool supports_device_memory() const override { return hmem_; }
  ImmMode imm_mode() const override { return imm_mode_; }
  uint64_t notices_apart() const override { return notices_apart_count_; }

  std::string FormatAddress(int nic, const std::string& raw) const override {
    char buf[256];
    size_t len = sizeof(buf);
    fi_av_straddr(nics_[nic]->av.get(), raw.data(), buf, &len);
    return provider_ + " " + std::string(buf, strnlen(buf, sizeof(buf)));
  }

  std::unique_ptr<BackendRegion> Register(void* ptr, uint64_t nbytes, const MemorySpec& mem) override {
    if (mem.device < 0) return RegisterAs(ptr, nbytes, mem, Registration::kHost);
    if (!hmem_) {
      Throw(ErrorCode::kUnavailable, "provider " + provider_ + " did not grant FI_HMEM: it cannot register CUDA memory");
    }
#ifdef FI_MR_DMABUF
    // A dmabuf is how a NIC's kernel driver maps GPU memory without nvidia-peermem: efa takes it. shm copies with
    // CUDA itself (IPC handles, cudaMemcpy) and needs the pointer; on libfabric 2.6 its dmabuf registrations
    // delivered wrong data here. $JAX_MOE_FABRIC_DMABUF: "1" tries it on every provider, "0" on none.
    const char* env = std::getenv("JAX_MOE_FABRIC_DMABUF");
    const std::string dmabuf = env == nullptr ? "" : env;
    if (mem.dmabuf_fd >= 0 && dmabuf != "0" && (provider_ == "efa" || dmabuf == "1")) {
      try {
        return RegisterAs(ptr, nbytes, mem, Registration::kDmabuf);
      } catch (const Error& e) {
        JAX_MOE_LOG(kInfo, "ofi %s: dmabuf registration refused (%s); registering the CUDA pointer", provider_.c_str(),
                    e.what());
      }
    }
#endif
    try {
      return RegisterAs(ptr, nbytes, mem, Registration::kCudaPointer);
    } catch (const Error& e) {
      Throw(ErrorCode::kUnavailable, "provider " + provider_ + " cannot register CUDA memory (" + e.what() +
                                         "): is this libfabric built with CUDA (configure --with-cuda)?");
    }
  }

  uint64_t AddPeer(int nic, uint32_t peer, const std::string& raw) override {
    if (provider_ == "shm") CheckShmPeerAlive(raw);
    fi_addr_t addr = FI_ADDR_NOTAVAIL;
    int rc = fi_av_insert(nics_[nic]->av.get(), raw.data(), 1, &addr, 0, nullptr);
    if (rc != 1) Throw(ErrorCode::kInvalidArgument, "fi_av_insert: " + std::string(fi_strerror(rc < 0 ? -rc : FI_EINVAL)));
    nics_[nic]->peer_of[addr] = peer;
    return addr;
  }

  size_t PostWrites(int nic, const WriteRequest* writes, size_t n) override {
    fid_ep* ep = nics_[nic]->ep.get();
    for (size_t i = 0; i < n; ++i) {
      const WriteRequest& w = writes[i];
      const uint64_t data = CqData(w);
      if (notice_apart_ && w.has_imm && w.length > 0 && w.host_to_host) {
        if (!nics_[nic]->notices.PostBytes(ep, w, data)) return i;
        ++notices_apart_count_;
        continue;
      }
      const ssize_t rc = WriteMsg(ep, w.local, w.length, w.local_desc, w.dest, w.remote_addr, w.rkey, data, w.context,
                                  FI_COMPLETION | (w.has_imm ? FI_REMOTE_CQ_DATA : 0));
      if (rc == -FI_EAGAIN) return i;
      Check(rc, "fi_writemsg");
    }
    return n;
  }

  bool PostSend(int nic, uint64_t dest, const void* buf, size_t len, void* context, bool /*bootstrap*/) override {
    ssize_t rc = fi_send(nics_[nic]->ep.get(), buf, len, MsgDesc(nic, buf, len, FI_SEND, context), dest, context);
    if (rc == -FI_EAGAIN) return false;
    Check(rc, "fi_send");
    return true;
  }

  void PostRecv(int nic, void* buf, size_t len, void* context) override {
    void* desc = MsgDesc(nic, buf, len, FI_RECV, nullptr);
    for (;;) {
      ssize_t rc = fi_recv(nics_[nic]->ep.get(), buf, len, desc, FI_ADDR_UNSPEC, context);
      if (rc != -FI_EAGAIN) {
        Check(rc, "fi_recv");
        return;
      }
      fi_cq_data_entry e;
      fi_cq_read(nics_[nic]->cq.get(), &e, 0);  // drive progress, then retry
    }
  }

  size_t Poll(int nic, std::vector<Completion>* out, size_t max) override {
    Nic& n = *nics_[nic];
    fid_cq* cq = n.cq.get();
    const size_t before = out->size();
    size_t consumed = 0;  // completions of notice_apart's bytes, handled here
    fi_cq_data_entry entries[64];
    fi_addr_t sources[64];
    const size_t want = std::min<size_t>(max, 64);
    ssize_t rc = imm_mode_ == ImmMode::kSource ? fi_cq_readfrom(cq, entries, want, sources) : fi_cq_read(cq, entries, want);
    if (rc == -FI_EAGAIN) return PostNotices(n, out, before, consumed);
    if (rc == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      ssize_t erc = fi_cq_readerr(cq, &err, 0);
      if (erc < 0) return PostNotices(n, out, before, consumed);
      Completion c;
      c.kind = Completion::kError;
      c.context = n.notices.Owns(err.op_context) ? n.notices.OnBytes(err.op_context, false) : err.op_context;
      const char* prov = fi_cq_strerror(cq, err.prov_errno, err.err_data, nullptr, 0);
      c.error = std::string("completion error: ") + fi_strerror(err.err) + (prov ? std::string(" (") + prov + ")" : "");
      if (c.context == nullptr) n.notices.OnStrayError(c.error);
      ReleaseMsgDesc(err.op_context);
      out->push_back(std::move(c));
      return PostNotices(n, out, before, consumed);
    }
    Check(rc, "fi_cq_read");
    for (ssize_t i = 0; i < rc; ++i) {
      const fi_cq_data_entry& e = entries[i];
      if (n.notices.Owns(e.op_context)) {
        n.notices.OnBytes(e.op_context, true);
        ++consumed;
        continue;
      }
      Completion c;
      if ((e.flags & FI_REMOTE_CQ_DATA) && (e.flags & (FI_REMOTE_WRITE | FI_RMA)) && !(e.flags & FI_MSG)) {
        c.kind = Completion::kImm;
        switch (imm_mode_) {
          case ImmMode::kWide:
            c.imm = static_cast<uint32_t>(e.data);
            c.peer = static_cast<uint32_t>(e.data >> 32);
            break;
          case ImmMode::kSource: {
            c.imm = static_cast<uint32_t>(e.data);
            auto it = nics_[nic]->peer_of.find(sources[i]);
            c.peer = it == nics_[nic]->peer_of.end() ? kUnknownPeer : it->second;
            break;
          }
          case ImmMode::kPacked:
            c.imm = ImmUser(static_cast<uint32_t>(e.data));
            c.peer = ImmPeerId(static_cast<uint32_t>(e.data));
            break;
        }
      } else if (e.flags & FI_RECV) {
        c.kind = Completion::kRecvDone;
        c.context = e.op_context;
        c.length = e.len;
      } else if (e.flags & FI_SEND) {
        c.kind = Completion::kSendDone;
        c.context = e.op_context;
        ReleaseMsgDesc(e.op_context);
      } else {
        c.kind = Completion::kWriteDone;
        c.context = e.op_context;
      }
      out->push_back(c);
    }
    return PostNotices(n, out, before, consumed);
  }

 private:
  struct Nic {
    InfoPtr info;
    Fid<fid_fabric> fabric;
    Fid<fid_domain> domain;
    Fid<fid_av> av;
    Fid<fid_cq> cq;
    Fid<fid_ep> ep;
    std::string address;
    std::unordered_map<fi_addr_t, uint32_t> peer_of;  // for FI_SOURCE: sender address -> engine peer
    NoticeApart notices;                              // writes whose notice follows their bytes (notice_apart_)
    ~Nic() {
      // Endpoint first, then what it is bound to.
      ep.reset();
      av.reset();
      cq.reset();
      domain.reset();
      fabric.reset();
    }
  };

  uint64_t CqData(const WriteRequest& w) const {
    switch (imm_mode_) {
      case ImmMode::kWide: return (static_cast<uint64_t>(w.sender_peer_id) << 32) | w.imm;
      case ImmMode::kSource: return w.imm;
      case ImmMode::kPacked: return EncodeImm(w.sender_peer_id, w.imm);
    }
    return 0;
  }

  // Posts the notices whose bytes are done (those refused by a full queue wait for the next poll); returns what this
  // poll handled.
  size_t PostNotices(Nic& n, std::vector<Completion>* out, size_t before, size_t consumed) {
    if (n.notices.queued() > 0) n.notices.PostNotices(n.ep.get(), out);
    return out->size() - before + consumed;
  }

  void Open(const fi_info* device) {
    auto nic = std::make_unique<Nic>();
    nic->info.reset(fi_dupinfo(device));
    fi_info* info = nic->info.get();
    Check(fi_fabric(info->fabric_attr, nic->fabric.out(), nullptr), "fi_fabric");
    Check(fi_domain(nic->fabric.get(), info, nic->domain.out(), nullptr), "fi_domain");
    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE;
    Check(fi_av_open(nic->domain.get(), &av_attr, nic->av.out(), nullptr), "fi_av_open");
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.wait_obj = FI_WAIT_NONE;
    cq_attr.size = 4096;
    Check(fi_cq_open(nic->domain.get(), &cq_attr, nic->cq.out(), nullptr), "fi_cq_open");
    Check(fi_endpoint(nic->domain.get(), info, nic->ep.out(), nullptr), "fi_endpoint");
    Check(fi_ep_bind(nic->ep.get(), &nic->av->fid, 0), "fi_ep_bind(av)");
    Check(fi_ep_bind(nic->ep.get(), &nic->cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
    if (provider_ == "shm") NameShmEndpoint(nic->ep.get());
#if FI_VERSION_GE(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), FI_VERSION(1, 18))  // an enum value, not a macro
    // A NIC that reads and writes GPU memory itself (efa) must make no CUDA call on the proxy thread while kernels
    // spin waiting for it (a call that waits for the device would wait for them). shm and tcp copy GPU memory with
    // CUDA calls (there is no GDRCopy here): they keep them, and copy on the progress thread: their copies use the legacy
    // stream, which waits for no kernel of XLA's (its streams are non-blocking).
    if (provider_ == "efa" && (info->caps & FI_HMEM)) {
      bool permitted = false;
      const int rc = fi_setopt(&nic->ep->fid, FI_OPT_ENDPOINT, FI_OPT_CUDA_API_PERMITTED, &permitted, sizeof(permitted));
      if (rc != 0) JAX_MOE_LOG(kWarn, "ofi efa: FI_OPT_CUDA_API_PERMITTED=false refused (%s)", fi_strerror(-rc));
    }
#endif
    Check(fi_enable(nic->ep.get()), "fi_enable");
    char name[256];
    size_t len = sizeof(name);
    Check(fi_getname(&nic->ep->fid, name, &len), "fi_getname");
    nic->address.assign(name, len);
    nics_.push_back(std::move(nic));
  }

  // One fi_mr_regattr per NIC, as `how` says (host memory, a dmabuf, or a CUDA pointer).
  std::unique_ptr<BackendRegion> RegisterAs(void* ptr, uint64_t nbytes, const MemorySpec& mem, Registration how) {
    auto region = std::make_unique<OfiRegion>();
    region->how = how;
    for (auto& nic : nics_) {
      iovec iov{ptr, nbytes};
      fi_mr_attr attr{};
      uint64_t flags = 0;
      attr.access = FI_WRITE | FI_REMOTE_WRITE | FI_READ | FI_REMOTE_READ | FI_SEND | FI_RECV;
      attr.requested_key = next_key_++;  // unique per domain when the provider does not pick keys
      attr.iface = how == Registration::kHost ? FI_HMEM_SYSTEM : FI_HMEM_CUDA;
      if (how != Registration::kHost) attr.device.cuda = mem.device;
#ifdef FI_MR_DMABUF
      fi_mr_dmabuf dmabuf{};
      if (how == Registration::kDmabuf) {
        dmabuf.fd = mem.dmabuf_fd;
        dmabuf.offset = mem.dmabuf_offset;
        dmabuf.len = nbytes;
        // The dmabuf's own start: libfabric places the region at base_addr + offset, and with FI_MR_VIRT_ADDR
        // peers address it by that virtual address, which must be `ptr`.
        dmabuf.base_addr = static_cast<uint8_t*>(ptr) - mem.dmabuf_offset;
        attr.dmabuf = &dmabuf;
        attr.iov_count = 1;
        flags = FI_MR_DMABUF;
      } else
#endif
      {
        attr.mr_iov = &iov;
        attr.iov_count = 1;
      }
      Fid<fid_mr> mr;
      Check(fi_mr_regattr(nic->domain.get(), &attr, flags, mr.out()), "fi_mr_regattr");
      if (mr_mode_ & FI_MR_ENDPOINT) {
        Check(fi_mr_bind(mr.get(), &nic->ep->fid, 0), "fi_mr_bind");
        Check(fi_mr_enable(mr.get()), "fi_mr_enable");
      }
      region->keys.push_back(fi_mr_key(mr.get()));
      region->descs.push_back(fi_mr_desc(mr.get()));
      region->mrs.push_back(std::move(mr));
    }
    return region;
  }

  // shm's default endpoint name is "<pid>:<n>:<m>", and its region /dev/shm/<that name>. A process that ended
  // without closing its endpoint (SIGKILL, os._exit) leaves the region behind, and a later process that gets the
  // same pid then fails fi_enable with EBUSY ("shm file in use"). A random part in the name avoids the clash; the
  // name still starts with the pid, which CheckShmPeerAlive reads.
  static void NameShmEndpoint(fid_ep* ep) {
    static std::atomic<unsigned> counter{0};
    std::random_device rd;
    char name[64];
    std::snprintf(name, sizeof(name), "fi_shm://%ld_%08x%08x:%u", static_cast<long>(getpid()), rd(), rd(),
                  counter.fetch_add(1));
    Check(fi_setname(&ep->fid, name, std::strlen(name) + 1), "fi_setname(shm)");
  }

  // libfabric 1.17's shm provider crashes in fi_av_insert when the peer's shared-memory region is
  // gone. Its names are "fi_shm://<pid>:<...>" backed by /dev/shm/<pid>:<...>; refuse early instead.
  static void CheckShmPeerAlive(const std::string& raw) {
    std::string name(raw.c_str());  // drop the trailing NUL
    const std::string prefix = "fi_shm://";
    if (name.compare(0, prefix.size(), prefix) != 0) return;
    name = name.substr(prefix.size());
    const long pid = std::strtol(name.c_str(), nullptr, 10);
    if (pid > 0 && kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      Throw(ErrorCode::kPeerFailed, "shm peer process " + std::to_string(pid) + " is gone");
    }
    struct stat st;
    if (name.find('/') == std::string::npos && stat(("/dev/shm/" + name).c_str(), &st) != 0) {
      Throw(ErrorCode::kPeerFailed, "shm peer region /dev/shm/" + name + " does not exist (endpoint closed?)");
    }
  }

  // Control-message buffers need a registration only when the provider asks for FI_MR_LOCAL (efa).
  void* MsgDesc(int nic, const void* buf, size_t len, uint64_t access, void* send_context) {
    if (!(mr_mode_ & FI_MR_LOCAL)) return nullptr;
    auto key = std::make_pair(const_cast<void*>(buf), nic);
    auto it = msg_mrs_.find(key);
    if (it == msg_mrs_.end()) {
      fid_mr* mr = nullptr;
      Check(fi_mr_reg(nics_[nic]->domain.get(), buf, len, access, 0, next_key_++, 0, &mr, nullptr), "fi_mr_reg(msg)");
      it = msg_mrs_.emplace(key, mr).first;
    }
    if (send_context != nullptr) send_mrs_[send_context] = key;
    return fi_mr_desc(it->second);
  }
  void ReleaseMsgDesc(void* send_context) {
    auto it = send_mrs_.find(send_context);
    if (it == send_mrs_.end()) return;
    auto mit = msg_mrs_.find(it->second);
    if (mit != msg_mrs_.end()) {
      fi_close(&mit->second->fid);
      msg_mrs_.erase(mit);
    }
    send_mrs_.erase(it);
  }

  std::string provider_;
  std::vector<std::unique_ptr<Nic>> nics_;
  uint64_t mr_mode_ = 0;
  uint64_t max_msg_ = 0;
  bool hmem_ = false;
  bool notice_apart_ = false;  // NoticeApart for host-to-host writes with a notice (shm; see notice_apart.h)
  uint64_t notices_apart_count_ = 0;
  ImmMode imm_mode_ = ImmMode::kPacked;
  uint64_t next_key_ = 1;
  std::map<std::pair<void*, int>, fid_mr*> msg_mrs_;
  std::unordered_map<void*, std::pair<void*, int>> send_mrs_;
};

}  // namespace
}  // namespace ofi

std::unique_ptr<Backend> OpenOfiBackend(const std::string& provider, int num_nics, const std::string& pci_bus_id,
                                        bool host_memory_only) {
  return std::make_unique<ofi::OfiBackend>(provider, num_nics, pci_bus_id, host_memory_only);
}

}  // namespace jax_moe::fabric
