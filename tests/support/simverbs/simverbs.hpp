#pragma once

// A simulated RDMA fabric behind ferry's verbs function table (transport/verbs/verbs_api.hpp),
// for tests on hosts without an RDMA NIC.
//
// Each process that uses the simulation has its own "NIC": one thread, started on first need,
// that runs an epoll loop over Unix stream sockets (one per rdma_cm connection, abstract
// namespace; listeners are named "@ferry-simverbs-<ip>-<port>") and an eventfd doorbell.
// One-sided operations execute on the target's NIC thread against the target process's own
// memory registration table, so peers in other processes (fork/exec) work, and a peer's death
// is real: its sockets reach end of file.
//
// Choices where real hardware leaves room:
//  - A send WR longer than the port's max_msg_sz completes with IBV_WC_LOC_LEN_ERR (QP to
//    error); it is not refused by post_send.
//  - A SEND or SEND_WITH_IMM longer than the posted receive buffer: the receive completes with
//    IBV_WC_LOC_LEN_ERR, the sender's WR with IBV_WC_REM_INV_REQ_ERR, both QPs go to error.
//  - A receive buffer that fails its lkey check: receive IBV_WC_LOC_PROT_ERR, sender
//    IBV_WC_REM_OP_ERR, both QPs to error.
//  - No receive posted when a SEND / WRITE_WITH_IMM arrives (RNR, rnr_retry=7): the responder
//    stops reading that connection until one is posted (later requests and responses on it wait).
//  - Connecting where nobody listens: RDMA_CM_EVENT_REJECTED with status 8 (invalid service
//    id); a device whose port is down: RDMA_CM_EVENT_UNREACHABLE on connect,
//    RDMA_CM_EVENT_ADDR_ERROR on resolve_addr, RDMA_CM_EVENT_ROUTE_ERROR on resolve_route.
//  - The peer's socket reaching end of file: every WR already on the wire completes with
//    IBV_WC_RETRY_EXC_ERR, the rest (and every receive) with IBV_WC_WR_FLUSH_ERR; the id gets
//    RDMA_CM_EVENT_DISCONNECTED (established), RDMA_CM_EVENT_UNREACHABLE (connecting, active
//    side) or RDMA_CM_EVENT_CONNECT_ERROR (passive side before established).
//  - An MR deregistered (or MW invalidated) while a WR streams from or into it: the rest of
//    that stream is zeros (sender) or dropped (receiver); a local buffer gives the WR
//    IBV_WC_LOC_PROT_ERR, a remote one IBV_WC_REM_ACCESS_ERR; the QP goes to error at once.
//  - IBV_WR_BIND_MW and IBV_WR_LOCAL_INV execute when posted (under post_send), complete in
//    send queue order. A type-2 window must be free (unbound or invalidated) to be bound; a
//    bind error is IBV_WC_MW_BIND_ERR, a LOCAL_INV of a key that names no bound window
//    IBV_WC_LOC_PROT_ERR.
//  - The send queue slot of a WR is free once its completion is generated (or suppressed by
//    selective signalling).
//  - A memory region made by reg_dmabuf_mr maps the dmabuf fd (from `offset`) and answers to
//    addresses from `iova`; one made by reg_mr is the memory at its address. reg_mr checks that
//    every page of the range is readable (process_vm_readv), as pinning the pages would.
//  - ibv_qp::state is written only by calls of the application (create_qp, accept, modify_qp,
//    get_cm_event of ESTABLISHED), as libibverbs does; errors found by the NIC do not change it.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "transport/verbs/verbs_api.hpp"

namespace ferry::test::simverbs {

struct DeviceConfig {
  std::string name;  ///< "sim0"
  std::string ipv4;  ///< the address rdma_cm resolves to this device, "127.0.0.1"
};

struct Config {
  std::vector<DeviceConfig> devices{{"sim0", "127.0.0.1"}, {"sim1", "127.0.0.2"}};
  uint32_t max_sge = 4;                ///< ibv_device_attr::max_sge (send and receive)
  uint32_t max_msg_sz = 1u << 20;      ///< ibv_port_attr::max_msg_sz
  uint64_t max_mr_size = 64ull << 20;  ///< ibv_device_attr::max_mr_size
  uint32_t max_qp_wr = 256;            ///< ibv_device_attr::max_qp_wr
  uint32_t max_cqe = 65536;            ///< ibv_device_attr::max_cqe
  bool mw = true;                      ///< type-2B memory windows supported
  uint64_t rate_mbps = 0;  ///< cap on payload this process's NIC sends, megabits/s; 0: none
  /// ibv_reg_dmabuf_mr works (else it fails with EOPNOTSUPP, as on a kernel or provider
  /// without dmabuf support).
  bool dmabuf = true;
  /// ibv_reg_mr of memory the CPU cannot reach (a simulated GPU's device memory) works, as with
  /// nvidia-peermem loaded: the NIC reaches the pages through the GPU driver (here: the
  /// simulated CUDA driver that FERRY_CUDA_DRIVER names, through its dmabuf export). Else such
  /// a registration fails with EFAULT, as pinning the pages does without the module.
  bool peermem = false;
};

/// Parses the FERRY_SIMVERBS form: "key=value,key=value"; keys are the fields of Config, and
/// "devices=sim0:127.0.0.1/sim1:127.0.0.2". Throws std::invalid_argument on a bad entry.
Config parse_config(const std::string& text);
/// The FERRY_SIMVERBS form of `config` (for a child process's environment).
std::string to_string(const Config& config);

/// Sets the configuration. Before first use it decides everything; later calls change the
/// limits for calls made afterwards (the device list stays the one of first use). Without a
/// call, the first use reads FERRY_SIMVERBS (a bad value is reported on stderr and ignored).
void configure(const Config& config);
/// The configuration in force.
Config current_config();

/// The table of the simulated functions.
const transport::verbs::VerbsApi& api();

struct Counters {
  uint64_t poll_cq = 0;             ///< poll_cq calls
  uint64_t req_notify_cq = 0;       ///< req_notify_cq calls
  uint64_t get_cq_event = 0;        ///< get_cq_event calls (also those answering EAGAIN)
  uint64_t cq_events_acked = 0;     ///< sum of ack_cq_events' nevents
  uint64_t async_events_acked = 0;  ///< ack_async_event calls
  uint64_t dmabuf_mrs = 0;          ///< memory regions registered by reg_dmabuf_mr
  uint64_t peermem_mrs = 0;  ///< regions of CPU-unreachable memory registered by reg_mr (peermem)
  uint64_t refused_mrs = 0;  ///< reg_mr of CPU-unreachable memory refused (no peermem)
};
/// This process's counters since it started (a forked child starts again from zero).
Counters counters();

// Fault injection.

/// Queues a completion event for `cq` on its channel now, whether or not it is armed, with no
/// new completion behind it (the arm state is left as it is).
void inject_spurious_event(ibv_cq* cq);
/// From now on, completion events reach their channel's fd `delay` after they are raised.
void set_event_delay(std::chrono::milliseconds delay);
/// The next event that arming `cq` would produce is lost (the CQ still disarms): a missed
/// wakeup.
void drop_next_event(ibv_cq* cq);
/// Port `port` of this process's device `device` goes down (IBV_EVENT_PORT_ERR on every open
/// context of it; every connection of this process through it breaks: WRs on the wire
/// IBV_WC_RETRY_EXC_ERR, the rest flush, socket closed, RDMA_CM_EVENT_DISCONNECTED; new
/// connections through it fail) or up again (IBV_EVENT_PORT_ACTIVE). Unknown device or port:
/// nothing happens, returns false.
bool set_port_state(const std::string& device, uint8_t port, bool up);
/// IBV_EVENT_QP_FATAL (element.qp) on the QP's context; the QP goes to error, all its WRs
/// flush.
void qp_fatal(ibv_qp* qp);
/// Performs here the access that a request arriving on local QP `qp_num` would make: reads
/// (write=false) `len` bytes at `addr` under `rkey` into `buf`, or writes them from `buf`.
/// Checks exactly as the NIC does (key alive, access flag, bounds, a type-2 window's QP);
/// returns IBV_WC_SUCCESS or IBV_WC_REM_ACCESS_ERR, memory unchanged on error. A probe: it
/// never moves the QP to error, and needs no connection (qp_num 0 names no QP: only MR keys
/// pass).
ibv_wc_status inject_access(uint32_t qp_num, uint32_t rkey, uint64_t addr, void* buf,
                            std::size_t len, bool write);

}  // namespace ferry::test::simverbs
