// libibverbs backend. Per NIC: a PD, one CQ, a UD QP (the public address, carries the handshake), a
// shared receive queue of zero-byte receives for WRITE_WITH_IMM, and a SRQ of bounce buffers for
// control messages on the per-peer msg QPs. Per peer and NIC: two RC QPs (msg: SEND/RECV, rma:
// RDMA WRITE[_WITH_IMM]) brought up by the blob the engine's handshake carries (handshake.h).
//
// Untested on hardware (no RDMA NIC on our machines): the pure parts (handshake.cc, rc_state.h,
// wr_template.cc) are unit-tested; this file only sequences device calls around them.
#include <arpa/inet.h>
#include <infiniband/verbs.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <unordered_map>

#include "common/error.h"
#include "common/log.h"
#include "fabric/backend.h"
#include "fabric/nic_topology.h"
#include "fabric/verbs/handshake.h"
#include "fabric/verbs/rc_state.h"
#include "fabric/verbs/verbs_util.h"
#include "fabric/verbs/wr_template.h"

// ibv_reg_dmabuf_mr (rdma-core >= 34) is a function, so no header macro tells whether it exists, and the headers we
// compile against need not match the libibverbs loaded at run time. A weak declaration settles both: it compiles
// against any rdma-core and the pointer is null when the loaded library lacks the symbol.
extern "C" ibv_mr* ibv_reg_dmabuf_mr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access)
    __attribute__((weak));

namespace jax_moe::fabric {
namespace verbs {
namespace {

constexpr uint32_t kQkey = 0x4a4d4f45;       // "JMOE"; UD datagrams with another qkey are dropped
constexpr int kCqDepth = 8192;
constexpr int kQpDepth = 1024;
constexpr int kImmRecvs = 1024;               // pre-posted zero-byte receives per NIC
constexpr int kMsgSlots = 64;                 // control-message bounce buffers per direction
constexpr size_t kMsgBytes = 4096;
constexpr size_t kGrh = 40;                   // UD receives start with a global routing header
constexpr uint64_t kMaxChunk = 1ull << 30;
// Internal wr_ids have the low bit set; engine contexts are 16-byte aligned pointers.
constexpr uint64_t kTagImmRecv = 1, kTagMsgRecv = 3, kTagUdRecv = 5;

struct Region : BackendRegion {
  std::vector<ibv_mr*> mrs;
  ~Region() override {
    for (ibv_mr* mr : mrs) ibv_dereg_mr(mr);
  }
};

// An integer setting from the environment, `fallback` when unset or empty. A bad value is the user's to fix: it
// throws kInvalidArgument naming the variable and the value (provider auto reports it instead of moving on).
int EnvSetting(const char* name, int fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  errno = 0;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || x < lo || x > hi) {
    Throw(ErrorCode::kInvalidArgument, Format("%s='%s': expected an integer from %d to %d", name, v, lo, hi));
  }
  return static_cast<int>(x);
}

struct PeerNic {
  ibv_ah* ah = nullptr;
  UdAddress ud;
  ibv_qp* msg = nullptr;
  ibv_qp* rma = nullptr;
  uint32_t msg_psn = 0, rma_psn = 0;
};

struct Peer {
  std::vector<PeerNic> nics;
  RcConnection<std::pair<int, WriteRequest>> conn;
};

class VerbsBackend final : public Backend {
 public:
  // `devices` in the order to use them (nearest the GPU first); NIC i opens devices[i % size].
  VerbsBackend(const std::vector<ibv_device*>& devices, int num_nics) {
    // RoCE v2 lives at a GID index other than 0 (show_gids lists them), and some hosts cable port 2.
    port_ = static_cast<uint8_t>(EnvSetting("JAX_MOE_IB_PORT", 1, 1, 255));
    gid_index_ = static_cast<uint8_t>(EnvSetting("JAX_MOE_IB_GID_INDEX", 0, 0, 255));
    nics_.reserve(num_nics);
    try {
      for (int i = 0; i < num_nics; ++i) OpenNic(devices[i % devices.size()]);
    } catch (...) {
      Release();  // the destructor does not run for a constructor that threw
      throw;
    }
  }
  ~VerbsBackend() override { Release(); }

  std::string provider() const override { return "verbs"; }
  int num_nics() const override { return static_cast<int>(nics_.size()); }
  std::string NicAddress(int nic) const override { return nics_[nic].address.Serialize(); }
  std::string FormatAddress(int nic, const std::string& raw) const override {
    try {
      UdAddress a = UdAddress::Parse(raw);
      return "verbs lid " + std::to_string(a.lid) + " qpn " + std::to_string(a.qpn);
    } catch (const Error&) {
      return "verbs <bad address>";
    }
  }
  bool remote_virt_addr() const override { return true; }
  uint64_t max_write_bytes() const override { return kMaxChunk * WriteChain::kMaxChain; }
  // A dmabuf or nvidia-peermem may take CUDA memory; which (if either) is only known when registering: Register then
  // throws kUnavailable when neither does.
  bool supports_device_memory() const override { return true; }
  ImmMode imm_mode() const override { return ImmMode::kSource; }  // the RC QP names the sender

  std::unique_ptr<BackendRegion> Register(void* ptr, uint64_t nbytes, const MemorySpec& mem) override {
    if (mem.device < 0) return RegisterAs(ptr, nbytes, mem, Registration::kHost);
    // CUDA memory: through its dmabuf where the kernel and GPU driver support it (no extra module), else the pointer
    // itself, which only nvidia-peermem lets the HCA pin.
    std::string dmabuf_error;
    if (mem.dmabuf_fd < 0) {
      dmabuf_error = "no dmabuf given for the region";
    } else if (ibv_reg_dmabuf_mr == nullptr) {
      dmabuf_error = "this libibverbs has no ibv_reg_dmabuf_mr (rdma-core < 34)";
    } else {
      try {
        return RegisterAs(ptr, nbytes, mem, Registration::kDmabuf);
      } catch (const Error& e) {
        dmabuf_error = e.what();
        JAX_MOE_LOG(kInfo, "verbs: dmabuf registration refused (%s); registering the CUDA pointer", e.what());
      }
    }
    try {
      return RegisterAs(ptr, nbytes, mem, Registration::kCudaPointer);
    } catch (const Error& e) {
      Throw(ErrorCode::kUnavailable, "verbs cannot register memory of CUDA device " + std::to_string(mem.device) +
                                         " (" + dmabuf_error + "; " + e.what() +
                                         "): load nvidia-peermem or use a kernel/driver with dmabuf support");
    }
  }

  uint64_t AddPeer(int nic, uint32_t peer, const std::string& raw) override {
    Peer& p = peers_[peer];
    if (p.nics.size() < nics_.size()) p.nics.resize(nics_.size());
    PeerNic& pn = p.nics[nic];
    pn.ud = UdAddress::Parse(raw);
    Nic& n = nics_[nic];
    ibv_ah_attr ah{};
    ah.dlid = pn.ud.lid;
    ah.port_num = n.port;
    ah.is_global = 1;
    std::memcpy(ah.grh.dgid.raw, pn.ud.gid.data(), 16);
    ah.grh.sgid_index = n.gid_index;
    ah.grh.hop_limit = 64;
    pn.ah = CheckPtr(ibv_create_ah(n.pd, &ah), "ibv_create_ah");
    return peer;
  }

  std::string LocalConnectBlob(uint32_t peer) override {
    Peer& p = peers_.at(peer);
    RcActions a = p.conn.CreateLocal();
    if (a.create_local_qps) CreateQps(peer, p);
    ConnectBlob blob;
    for (size_t i = 0; i < nics_.size(); ++i) {
      blob.nics.push_back({p.nics[i].msg->qp_num, p.nics[i].msg_psn, p.nics[i].rma->qp_num, p.nics[i].rma_psn,
                           static_cast<uint8_t>(nics_[i].mtu)});
    }
    return blob.Serialize();
  }

  void AcceptConnectBlob(uint32_t peer, const std::string& raw) override {
    Peer& p = peers_.at(peer);
    ConnectBlob blob = ConnectBlob::Parse(raw);
    // Every local NIC i talks to the peer's NIC i % (its count), mirroring the engine's AV mapping.
    const RcEndpointInfo& first = blob.nics[0];
    RcActions a = p.conn.RemoteInfo(first);
    if (a.create_local_qps) CreateQps(peer, p);
    if (a.connect_qps) {
      for (size_t i = 0; i < nics_.size(); ++i) Connect(static_cast<int>(i), p.nics[i], blob.nics[i % blob.nics.size()]);
    }
    if (a.flush_parked) {
      for (auto& w : p.conn.TakeParked()) PostOne(w.first, w.second);
    }
  }

  size_t PostWrites(int nic, const WriteRequest* writes, size_t n) override {
    for (size_t i = 0; i < n; ++i) {
      Peer& p = peers_.at(static_cast<uint32_t>(writes[i].dest));
      if (p.conn.state() == RcState::kFailed) Throw(ErrorCode::kPeerFailed, p.conn.failure());
      if (p.conn.Submit({nic, writes[i]})) PostOne(nic, writes[i]);
    }
    return n;
  }

  bool PostSend(int nic, uint64_t dest, const void* buf, size_t len, void* context, bool bootstrap) override {
    Require(len <= kMsgBytes - kGrh, "verbs: control message too large");
    Nic& n = nics_[nic];
    if (n.free_send_slots.empty()) return false;
    const int slot = n.free_send_slots.back();
    n.free_send_slots.pop_back();
    char* dst = n.bounce + (kMsgSlots + slot) * kMsgBytes;
    std::memcpy(dst, buf, len);
    n.send_slot_of[context] = slot;
    ibv_sge sge{reinterpret_cast<uint64_t>(dst), static_cast<uint32_t>(len), n.bounce_mr->lkey};
    ibv_send_wr wr{};
    wr.wr_id = reinterpret_cast<uint64_t>(context);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    Peer& p = peers_.at(static_cast<uint32_t>(dest));
    ibv_qp* qp;
    if (!bootstrap && p.conn.state() == RcState::kConnected) {
      qp = p.nics[nic].msg;  // reliable once connected
    } else {
      // Hello/ack over UD: the peer's RC QPs may not be ready to receive yet. Unreliable: the engine
      // resends hellos until acknowledged.
      qp = n.ud;
      wr.wr.ud.ah = p.nics[nic].ah;
      wr.wr.ud.remote_qpn = p.nics[nic].ud.qpn;
      wr.wr.ud.remote_qkey = p.nics[nic].ud.qkey;
    }
    ibv_send_wr* bad = nullptr;
    CheckRc(ibv_post_send(qp, &wr, &bad), "ibv_post_send(control)");
    return true;
  }

  void PostRecv(int nic, void* buf, size_t len, void* context) override {
    // Control messages land in our bounce buffers; the engine's buffers are filled on completion.
    nics_[nic].engine_recvs.push_back({buf, len, context});
  }

  size_t Poll(int nic, std::vector<Completion>* out, size_t max) override {
    Nic& n = nics_[nic];
    ibv_wc wcs[32];
    int got = ibv_poll_cq(n.cq, static_cast<int>(std::min<size_t>(max, 32)), wcs);
    if (got < 0) Throw(ErrorCode::kInternal, "ibv_poll_cq failed");
    size_t produced = 0;
    for (int i = 0; i < got; ++i) {
      const ibv_wc& wc = wcs[i];
      const uint64_t tag = wc.wr_id & 7;
      Completion c;
      if (wc.status != IBV_WC_SUCCESS) {
        c.kind = Completion::kError;
        c.error = std::string("work completion: ") + ibv_wc_status_str(wc.status);
        c.context = (wc.wr_id & 1) ? nullptr : reinterpret_cast<void*>(wc.wr_id);
        ReleaseSendSlot(n, c.context);
        if (wc.wr_id & 1) RepostInternal(nic, wc.wr_id);
      } else if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        c.kind = Completion::kImm;
        c.imm = ntohl(wc.imm_data);
        auto it = peer_of_qp_.find(wc.qp_num);
        c.peer = it == peer_of_qp_.end() ? kUnknownPeer : it->second;
        RepostInternal(nic, wc.wr_id);
      } else if (tag == (kTagMsgRecv & 7) || tag == (kTagUdRecv & 7)) {
        const size_t skip = tag == (kTagUdRecv & 7) ? kGrh : 0;
        const int slot = static_cast<int>(wc.wr_id >> 8);
        if (n.engine_recvs.empty() || wc.byte_len < skip) {
          RepostInternal(nic, wc.wr_id);
          continue;  // no engine buffer: drop (the sender resends hellos)
        }
        EngineRecv r = n.engine_recvs.front();
        n.engine_recvs.pop_front();
        const size_t len = std::min<size_t>(wc.byte_len - skip, r.len);
        std::memcpy(r.buf, n.bounce + slot * kMsgBytes + skip, len);
        RepostInternal(nic, wc.wr_id);
        c.kind = Completion::kRecvDone;
        c.context = r.context;
        c.length = len;
      } else if (wc.opcode == IBV_WC_SEND) {
        c.kind = Completion::kSendDone;
        c.context = reinterpret_cast<void*>(wc.wr_id);
        ReleaseSendSlot(n, c.context);
      } else {
        c.kind = Completion::kWriteDone;
        c.context = reinterpret_cast<void*>(wc.wr_id);
      }
      out->push_back(std::move(c));
      ++produced;
    }
    return produced;
  }

 private:
  // Destroys everything opened so far, peers' QPs first (idempotent: the vectors are left empty).
  void Release() {
    for (auto& kv : peers_) {
      for (PeerNic& pn : kv.second.nics) {
        if (pn.msg) ibv_destroy_qp(pn.msg);
        if (pn.rma) ibv_destroy_qp(pn.rma);
        if (pn.ah) ibv_destroy_ah(pn.ah);
      }
    }
    for (auto& n : nics_) {
      if (n.ud) ibv_destroy_qp(n.ud);
      if (n.imm_srq) ibv_destroy_srq(n.imm_srq);
      if (n.msg_srq) ibv_destroy_srq(n.msg_srq);
      if (n.bounce_mr) ibv_dereg_mr(n.bounce_mr);
      if (n.cq) ibv_destroy_cq(n.cq);
      if (n.pd) ibv_dealloc_pd(n.pd);
      if (n.ctx) ibv_close_device(n.ctx);
    }
    peers_.clear();
    nics_.clear();
  }

  struct EngineRecv {
    void* buf;
    size_t len;
    void* context;
  };
  struct Nic {
    ibv_context* ctx = nullptr;
    ibv_pd* pd = nullptr;
    ibv_cq* cq = nullptr;
    ibv_srq* imm_srq = nullptr;
    ibv_srq* msg_srq = nullptr;
    ibv_qp* ud = nullptr;
    uint8_t port = 1;
    uint8_t gid_index = 0;
    ibv_mtu mtu = IBV_MTU_1024;
    UdAddress address;
    char* bounce = nullptr;  // kMsgSlots receive slots, then kMsgSlots send slots
    std::vector<char> bounce_storage;
    ibv_mr* bounce_mr = nullptr;
    std::vector<int> free_send_slots;
    std::unordered_map<void*, int> send_slot_of;
    std::deque<EngineRecv> engine_recvs;
  };

  // One registration per NIC, as `how` says; a failure releases the NICs already done (Region's destructor).
  std::unique_ptr<BackendRegion> RegisterAs(void* ptr, uint64_t nbytes, const MemorySpec& mem, Registration how) {
    auto r = std::make_unique<Region>();
    r->how = how;
    const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                       IBV_ACCESS_RELAXED_ORDERING;  // optional flag: ignored where unsupported
    for (auto& n : nics_) {
      ibv_mr* mr;
      const char* call;
      if (how == Registration::kDmabuf) {
        // iova = the virtual address: peers and our SGEs address the region by it, as with ibv_reg_mr.
        mr = ibv_reg_dmabuf_mr(n.pd, mem.dmabuf_offset, nbytes, reinterpret_cast<uint64_t>(ptr), mem.dmabuf_fd, access);
        call = "ibv_reg_dmabuf_mr";
      } else {
        mr = ibv_reg_mr(n.pd, ptr, nbytes, access);
        call = "ibv_reg_mr";
      }
      const int err = errno;
      if (mr == nullptr) {
        Throw(ErrorCode::kInternal, Format("%s on %s: %s", call, ibv_get_device_name(n.ctx->device),
                                           std::strerror(err ? err : EINVAL)));
      }
      r->mrs.push_back(mr);
      r->keys.push_back(mr->rkey);
      r->descs.push_back(reinterpret_cast<void*>(static_cast<uintptr_t>(mr->lkey)));
    }
    return r;
  }

  void OpenNic(ibv_device* dev) {
    nics_.emplace_back();
    Nic& n = nics_.back();
    n.port = port_;
    n.gid_index = gid_index_;
    const char* name = ibv_get_device_name(dev);
    n.ctx = CheckPtr(ibv_open_device(dev), "ibv_open_device");
    ibv_device_attr dev_attr{};
    CheckRc(ibv_query_device(n.ctx, &dev_attr), "ibv_query_device");
    if (n.port > dev_attr.phys_port_cnt) {
      Throw(ErrorCode::kInvalidArgument, Format("JAX_MOE_IB_PORT=%d: %s has %d port(s)", int(n.port), name,
                                                int(dev_attr.phys_port_cnt)));
    }
    n.pd = CheckPtr(ibv_alloc_pd(n.ctx), "ibv_alloc_pd");
    n.cq = CheckPtr(ibv_create_cq(n.ctx, kCqDepth, nullptr, nullptr, 0), "ibv_create_cq");
    ibv_port_attr port{};
    CheckRc(ibv_query_port(n.ctx, n.port, &port), "ibv_query_port");
    n.mtu = port.active_mtu;
    if (n.gid_index >= port.gid_tbl_len) {
      Throw(ErrorCode::kInvalidArgument, Format("JAX_MOE_IB_GID_INDEX=%d: %s port %d has %d GIDs", int(n.gid_index),
                                                name, int(n.port), port.gid_tbl_len));
    }
    ibv_gid gid{};
    CheckRc(ibv_query_gid(n.ctx, n.port, n.gid_index, &gid), "ibv_query_gid");
    static const ibv_gid kNoGid{};
    if (std::memcmp(gid.raw, kNoGid.raw, sizeof(gid.raw)) == 0) {
      Throw(ErrorCode::kInvalidArgument, Format("JAX_MOE_IB_GID_INDEX=%d: GID %d of %s port %d is unset (show_gids "
                                                "lists the valid ones)", int(n.gid_index), int(n.gid_index), name,
                                                int(n.port)));
    }
    JAX_MOE_LOG(kInfo, "verbs: NIC %s port %d GID index %d", name, int(n.port), int(n.gid_index));

    ibv_srq_init_attr srq{};
    srq.attr.max_wr = kImmRecvs;
    srq.attr.max_sge = 1;
    n.imm_srq = CheckPtr(ibv_create_srq(n.pd, &srq), "ibv_create_srq(imm)");
    srq.attr.max_wr = kMsgSlots;
    n.msg_srq = CheckPtr(ibv_create_srq(n.pd, &srq), "ibv_create_srq(msg)");

    n.bounce_storage.resize(2 * kMsgSlots * kMsgBytes);
    n.bounce = n.bounce_storage.data();
    n.bounce_mr = CheckPtr(ibv_reg_mr(n.pd, n.bounce, n.bounce_storage.size(), IBV_ACCESS_LOCAL_WRITE), "ibv_reg_mr(bounce)");
    for (int s = 0; s < kMsgSlots; ++s) n.free_send_slots.push_back(s);

    ibv_qp_init_attr ud{};
    ud.send_cq = n.cq;
    ud.recv_cq = n.cq;
    ud.qp_type = IBV_QPT_UD;
    ud.cap.max_send_wr = kMsgSlots;
    ud.cap.max_recv_wr = kMsgSlots;
    ud.cap.max_send_sge = ud.cap.max_recv_sge = 1;
    n.ud = CheckPtr(ibv_create_qp(n.pd, &ud), "ibv_create_qp(UD)");
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = n.port;
    a.qkey = kQkey;
    CheckRc(ibv_modify_qp(n.ud, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY), "ibv_modify_qp(UD INIT)");
    a = {};
    a.qp_state = IBV_QPS_RTR;
    CheckRc(ibv_modify_qp(n.ud, &a, IBV_QP_STATE), "ibv_modify_qp(UD RTR)");
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = 0;
    CheckRc(ibv_modify_qp(n.ud, &a, IBV_QP_STATE | IBV_QP_SQ_PSN), "ibv_modify_qp(UD RTS)");

    const int nic = static_cast<int>(nics_.size() - 1);
    // Half of the receive slots serve UD (bootstrap), half the msg SRQ (connected peers).
    for (int s = 0; s < kMsgSlots; ++s) RepostInternal(nic, (static_cast<uint64_t>(s) << 8) | (s % 2 ? kTagMsgRecv : kTagUdRecv));
    for (int i = 0; i < kImmRecvs; ++i) RepostInternal(nic, kTagImmRecv);

    std::memcpy(n.address.gid.data(), gid.raw, 16);
    n.address.lid = port.lid;
    n.address.qpn = n.ud->qp_num;
    n.address.qkey = kQkey;
    n.address.port = n.port;
    n.address.gid_index = n.gid_index;
  }

  void RepostInternal(int nic, uint64_t wr_id) {
    Nic& n = nics_[nic];
    ibv_recv_wr wr{};
    ibv_recv_wr* bad = nullptr;
    wr.wr_id = wr_id;
    if ((wr_id & 7) == kTagImmRecv) {
      wr.num_sge = 0;  // WRITE_WITH_IMM needs a receive but no buffer
      CheckRc(ibv_post_srq_recv(n.imm_srq, &wr, &bad), "ibv_post_srq_recv(imm)");
      return;
    }
    const int slot = static_cast<int>(wr_id >> 8);
    ibv_sge sge{reinterpret_cast<uint64_t>(n.bounce + slot * kMsgBytes), static_cast<uint32_t>(kMsgBytes), n.bounce_mr->lkey};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    if ((wr_id & 7) == kTagUdRecv) {
      CheckRc(ibv_post_recv(n.ud, &wr, &bad), "ibv_post_recv(UD)");
    } else {
      CheckRc(ibv_post_srq_recv(n.msg_srq, &wr, &bad), "ibv_post_srq_recv(msg)");
    }
  }

  void ReleaseSendSlot(Nic& n, void* context) {
    auto it = n.send_slot_of.find(context);
    if (it == n.send_slot_of.end()) return;
    n.free_send_slots.push_back(it->second);
    n.send_slot_of.erase(it);
  }

  void CreateQps(uint32_t peer, Peer& p) {
    static thread_local std::mt19937 rng(std::random_device{}());
    for (size_t i = 0; i < nics_.size(); ++i) {
      Nic& n = nics_[i];
      PeerNic& pn = p.nics[i];
      for (int which = 0; which < 2; ++which) {
        ibv_qp_init_attr init{};
        init.send_cq = n.cq;
        init.recv_cq = n.cq;
        init.srq = which == 0 ? n.msg_srq : n.imm_srq;
        init.qp_type = IBV_QPT_RC;
        init.cap.max_send_wr = kQpDepth;
        init.cap.max_send_sge = 1;
        ibv_qp* qp = CheckPtr(ibv_create_qp(n.pd, &init), "ibv_create_qp(RC)");
        ibv_qp_attr a{};
        a.qp_state = IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = n.port;
        a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
        CheckRc(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS),
                "ibv_modify_qp(RC INIT)");
        (which == 0 ? pn.msg : pn.rma) = qp;
        if (which == 1) peer_of_qp_[qp->qp_num] = peer;
        (which == 0 ? pn.msg_psn : pn.rma_psn) = rng() & kMax24;
      }
    }
  }

  void Connect(int nic, PeerNic& pn, const RcEndpointInfo& remote) {
    Nic& n = nics_[nic];
    const ibv_mtu mtu = static_cast<ibv_mtu>(std::min<int>(n.mtu, remote.mtu));
    for (int which = 0; which < 2; ++which) {
      ibv_qp* qp = which == 0 ? pn.msg : pn.rma;
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_RTR;
      a.path_mtu = mtu;
      a.dest_qp_num = which == 0 ? remote.msg_qpn : remote.rma_qpn;
      a.rq_psn = which == 0 ? remote.msg_psn : remote.rma_psn;
      a.max_dest_rd_atomic = 1;
      a.min_rnr_timer = 12;
      a.ah_attr.dlid = pn.ud.lid;
      a.ah_attr.port_num = n.port;
      a.ah_attr.is_global = 1;
      std::memcpy(a.ah_attr.grh.dgid.raw, pn.ud.gid.data(), 16);
      a.ah_attr.grh.sgid_index = n.gid_index;
      a.ah_attr.grh.hop_limit = 64;
      CheckRc(ibv_modify_qp(qp, &a,
                            IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER),
              "ibv_modify_qp(RC RTR)");
      a = {};
      a.qp_state = IBV_QPS_RTS;
      a.timeout = 14;
      a.retry_cnt = 7;
      a.rnr_retry = 7;
      a.sq_psn = which == 0 ? pn.msg_psn : pn.rma_psn;
      a.max_rd_atomic = 1;
      CheckRc(ibv_modify_qp(qp, &a,
                            IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                IBV_QP_MAX_QP_RD_ATOMIC),
              "ibv_modify_qp(RC RTS)");
    }
  }

  void PostOne(int nic, const WriteRequest& w) {
    PeerNic& pn = peers_.at(static_cast<uint32_t>(w.dest)).nics[nic];
    const uint32_t lkey = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(w.local_desc));
    WriteChain chain(static_cast<uint32_t>(w.rkey), w.remote_addr, lkey, kMaxChunk);
    uint64_t done = 0;
    do {
      size_t count = 0;
      uint64_t consumed = 0;
      ibv_send_wr* head = chain.Patch(reinterpret_cast<uint64_t>(w.local) + done, w.length - done, done,
                                      w.has_imm ? std::optional<uint32_t>(w.imm) : std::nullopt,
                                      reinterpret_cast<uint64_t>(w.context), &count, &consumed);
      ibv_send_wr* bad = nullptr;
      CheckRc(ibv_post_send(pn.rma, head, &bad), "ibv_post_send(write)");
      done += consumed;
    } while (done < w.length);
  }

  uint8_t port_ = 1;       // JAX_MOE_IB_PORT
  uint8_t gid_index_ = 0;  // JAX_MOE_IB_GID_INDEX
  std::vector<Nic> nics_;  // reserved up front: Nic addresses must not move after registration
  std::unordered_map<uint32_t, Peer> peers_;
  std::unordered_map<uint32_t, uint32_t> peer_of_qp_;  // rma QP number -> engine peer (names imm senders)
};

}  // namespace
}  // namespace verbs

std::unique_ptr<Backend> OpenVerbsBackend(int num_nics, const std::string& pci_bus_id) {
  int n = 0;
  struct ListDeleter {
    void operator()(ibv_device** l) const { ibv_free_device_list(l); }
  };
  std::unique_ptr<ibv_device*, ListDeleter> list(ibv_get_device_list(&n));  // open devices outlive the list
  if (list == nullptr || n <= 0) {
    Throw(ErrorCode::kUnavailable, "provider verbs: no RDMA device (ibv_get_device_list found none)");
  }
  std::vector<ibv_device*> devices(list.get(), list.get() + n);
  if (!pci_bus_id.empty()) {
    // Nearest the GPU first: /sys/class/infiniband/<name>/device resolves to the HCA's place on the PCIe tree.
    std::vector<std::string> paths;
    for (ibv_device* d : devices) paths.push_back(InfinibandSysfsPath(ibv_get_device_name(d)));
    std::vector<std::string> names;
    for (ibv_device* d : devices) names.emplace_back(ibv_get_device_name(d));
    std::vector<ibv_device*> ranked;
    for (int i : OrderNicsForGpu("verbs", pci_bus_id, names, paths, num_nics)) ranked.push_back(devices[i]);
    devices.swap(ranked);
  }
  return std::make_unique<verbs::VerbsBackend>(devices, num_nics);
}

}  // namespace jax_moe::fabric
