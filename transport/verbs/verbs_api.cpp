#include "transport/verbs/verbs_api.hpp"

#include <dlfcn.h>

#include <mutex>
#include <optional>
#include <string>

#include <ferry/error.hpp>

namespace ferry::transport::verbs {

namespace {

// The inline verbs of <infiniband/verbs.h> dispatch through the context's provider table, so
// they need no symbol of libibverbs: wrapping them here binds nothing at link time.
int inline_post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  return ibv_post_send(qp, wr, bad);
}
int inline_post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  return ibv_post_recv(qp, wr, bad);
}
int inline_poll_cq(ibv_cq* cq, int n, ibv_wc* wc) { return ibv_poll_cq(cq, n, wc); }
int inline_req_notify_cq(ibv_cq* cq, int solicited) { return ibv_req_notify_cq(cq, solicited); }
ibv_mw* inline_alloc_mw(ibv_pd* pd, ibv_mw_type type) { return ibv_alloc_mw(pd, type); }
int inline_dealloc_mw(ibv_mw* mw) { return ibv_dealloc_mw(mw); }

/// Binds `out` to `symbol` of `lib`; throws Error(Unsupported) when the library lacks it.
template <class F>
void bind(void* lib, const char* symbol, F& out) {
  void* p = ::dlsym(lib, symbol);
  if (p == nullptr) throw Error(ErrorCode::Unsupported, std::string("the library lacks ") + symbol);
  out = reinterpret_cast<F>(p);
}

/// The table, bound; throws Error(Unsupported) naming what is missing.
VerbsApi load() {
  void* ib = ::dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
  if (ib == nullptr) {
    const char* e = ::dlerror();
    throw Error(ErrorCode::Unsupported,
                std::string("libibverbs.so.1 cannot be loaded: ") + (e ? e : "unknown error"));
  }
  void* cm = ::dlopen("librdmacm.so.1", RTLD_NOW | RTLD_LOCAL);
  if (cm == nullptr) {
    const char* e = ::dlerror();
    // The libraries stay loaded for the life of the process, as they would linked.
    throw Error(ErrorCode::Unsupported,
                std::string("librdmacm.so.1 cannot be loaded: ") + (e ? e : "unknown error"));
  }
  VerbsApi a;
  a.name = "libibverbs";
  bind(ib, "ibv_get_device_list", a.get_device_list);
  bind(ib, "ibv_free_device_list", a.free_device_list);
  bind(ib, "ibv_get_device_name", a.get_device_name);
  bind(ib, "ibv_get_device_guid", a.get_device_guid);
  bind(ib, "ibv_open_device", a.open_device);
  bind(ib, "ibv_close_device", a.close_device);
  bind(ib, "ibv_query_device", a.query_device);
  bind(ib, "ibv_query_port", a.query_port);
  bind(ib, "ibv_query_gid", a.query_gid);
  bind(ib, "ibv_get_async_event", a.get_async_event);
  bind(ib, "ibv_ack_async_event", a.ack_async_event);
  bind(ib, "ibv_alloc_pd", a.alloc_pd);
  bind(ib, "ibv_dealloc_pd", a.dealloc_pd);
  bind(ib, "ibv_reg_mr", a.reg_mr);
  bind(ib, "ibv_dereg_mr", a.dereg_mr);
  // A library without it still offers verbs, for host memory.
  if (void* p = ::dlsym(ib, "ibv_reg_dmabuf_mr"))
    a.reg_dmabuf_mr = reinterpret_cast<decltype(a.reg_dmabuf_mr)>(p);
  bind(ib, "ibv_create_comp_channel", a.create_comp_channel);
  bind(ib, "ibv_destroy_comp_channel", a.destroy_comp_channel);
  bind(ib, "ibv_create_cq", a.create_cq);
  bind(ib, "ibv_destroy_cq", a.destroy_cq);
  bind(ib, "ibv_get_cq_event", a.get_cq_event);
  bind(ib, "ibv_ack_cq_events", a.ack_cq_events);
  bind(ib, "ibv_modify_qp", a.modify_qp);
  a.post_send = inline_post_send;
  a.post_recv = inline_post_recv;
  a.poll_cq = inline_poll_cq;
  a.req_notify_cq = inline_req_notify_cq;
  a.alloc_mw = inline_alloc_mw;
  a.dealloc_mw = inline_dealloc_mw;
  bind(cm, "rdma_create_event_channel", a.create_event_channel);
  bind(cm, "rdma_destroy_event_channel", a.destroy_event_channel);
  bind(cm, "rdma_get_devices", a.get_devices);
  bind(cm, "rdma_free_devices", a.free_devices);
  bind(cm, "rdma_create_id", a.create_id);
  bind(cm, "rdma_destroy_id", a.destroy_id);
  bind(cm, "rdma_bind_addr", a.bind_addr);
  bind(cm, "rdma_listen", a.listen);
  bind(cm, "rdma_resolve_addr", a.resolve_addr);
  bind(cm, "rdma_resolve_route", a.resolve_route);
  bind(cm, "rdma_create_qp", a.create_qp);
  bind(cm, "rdma_destroy_qp", a.destroy_qp);
  bind(cm, "rdma_connect", a.connect);
  bind(cm, "rdma_accept", a.accept);
  bind(cm, "rdma_reject", a.reject);
  bind(cm, "rdma_disconnect", a.disconnect);
  bind(cm, "rdma_get_cm_event", a.get_cm_event);
  bind(cm, "rdma_ack_cm_event", a.ack_cm_event);
  bind(cm, "rdma_get_src_port", a.get_src_port);
  return a;
}

}  // namespace

const VerbsApi& system_verbs() {
  static std::once_flag once;
  static VerbsApi api;
  static std::optional<Error> error;
  std::call_once(once, [] {
    try {
      api = load();
    } catch (const Error& e) {
      error = e;
    }
  });
  if (error) throw *error;
  return api;
}

const char* wc_status_text(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_SUCCESS:
      return "success";
    case IBV_WC_LOC_LEN_ERR:
      return "local length error";
    case IBV_WC_LOC_QP_OP_ERR:
      return "local queue pair operation error";
    case IBV_WC_LOC_EEC_OP_ERR:
      return "local EE context operation error";
    case IBV_WC_LOC_PROT_ERR:
      return "local protection error";
    case IBV_WC_WR_FLUSH_ERR:
      return "flushed (the queue pair was in error)";
    case IBV_WC_MW_BIND_ERR:
      return "memory window bind error";
    case IBV_WC_BAD_RESP_ERR:
      return "bad response";
    case IBV_WC_LOC_ACCESS_ERR:
      return "local access error";
    case IBV_WC_REM_INV_REQ_ERR:
      return "remote invalid request";
    case IBV_WC_REM_ACCESS_ERR:
      return "remote access error";
    case IBV_WC_REM_OP_ERR:
      return "remote operation error";
    case IBV_WC_RETRY_EXC_ERR:
      return "transport retry counter exceeded";
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return "receiver-not-ready retry counter exceeded";
    case IBV_WC_LOC_RDD_VIOL_ERR:
      return "local RDD violation";
    case IBV_WC_REM_INV_RD_REQ_ERR:
      return "remote invalid RD request";
    case IBV_WC_REM_ABORT_ERR:
      return "remote aborted";
    case IBV_WC_INV_EECN_ERR:
      return "invalid EE context number";
    case IBV_WC_INV_EEC_STATE_ERR:
      return "invalid EE context state";
    case IBV_WC_FATAL_ERR:
      return "fatal error";
    case IBV_WC_RESP_TIMEOUT_ERR:
      return "response timeout";
    case IBV_WC_GENERAL_ERR:
      return "general error";
    default:
      return "unknown completion status";
  }
}

const char* async_event_text(ibv_event_type type) {
  switch (type) {
    case IBV_EVENT_CQ_ERR:
      return "completion queue error";
    case IBV_EVENT_QP_FATAL:
      return "queue pair fatal error";
    case IBV_EVENT_QP_REQ_ERR:
      return "queue pair invalid request";
    case IBV_EVENT_QP_ACCESS_ERR:
      return "queue pair access error";
    case IBV_EVENT_COMM_EST:
      return "communication established";
    case IBV_EVENT_SQ_DRAINED:
      return "send queue drained";
    case IBV_EVENT_PATH_MIG:
      return "path migrated";
    case IBV_EVENT_PATH_MIG_ERR:
      return "path migration error";
    case IBV_EVENT_DEVICE_FATAL:
      return "device fatal error";
    case IBV_EVENT_PORT_ACTIVE:
      return "port active";
    case IBV_EVENT_PORT_ERR:
      return "port down";
    case IBV_EVENT_LID_CHANGE:
      return "LID changed";
    case IBV_EVENT_PKEY_CHANGE:
      return "P_Key table changed";
    case IBV_EVENT_SM_CHANGE:
      return "subnet manager changed";
    case IBV_EVENT_SRQ_ERR:
      return "shared receive queue error";
    case IBV_EVENT_SRQ_LIMIT_REACHED:
      return "shared receive queue limit reached";
    case IBV_EVENT_QP_LAST_WQE_REACHED:
      return "last work request reached";
    case IBV_EVENT_CLIENT_REREGISTER:
      return "client re-register request";
    case IBV_EVENT_GID_CHANGE:
      return "GID table changed";
    case IBV_EVENT_WQ_FATAL:
      return "work queue fatal error";
    default:
      return "unknown async event";
  }
}

const char* cm_event_text(rdma_cm_event_type type) {
  switch (type) {
    case RDMA_CM_EVENT_ADDR_RESOLVED:
      return "address resolved";
    case RDMA_CM_EVENT_ADDR_ERROR:
      return "address resolution failed";
    case RDMA_CM_EVENT_ROUTE_RESOLVED:
      return "route resolved";
    case RDMA_CM_EVENT_ROUTE_ERROR:
      return "route resolution failed";
    case RDMA_CM_EVENT_CONNECT_REQUEST:
      return "connect request";
    case RDMA_CM_EVENT_CONNECT_RESPONSE:
      return "connect response";
    case RDMA_CM_EVENT_CONNECT_ERROR:
      return "connection error";
    case RDMA_CM_EVENT_UNREACHABLE:
      return "peer unreachable";
    case RDMA_CM_EVENT_REJECTED:
      return "connection rejected";
    case RDMA_CM_EVENT_ESTABLISHED:
      return "connection established";
    case RDMA_CM_EVENT_DISCONNECTED:
      return "disconnected";
    case RDMA_CM_EVENT_DEVICE_REMOVAL:
      return "device removed";
    case RDMA_CM_EVENT_TIMEWAIT_EXIT:
      return "timewait exit";
    case RDMA_CM_EVENT_ADDR_CHANGE:
      return "address changed";
    default:
      return "unknown rdma_cm event";
  }
}

}  // namespace ferry::transport::verbs
