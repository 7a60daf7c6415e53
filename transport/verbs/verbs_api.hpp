#pragma once

// The one table of ibverbs and rdma_cm functions the verbs method calls. Nothing in ferry calls
// libibverbs or librdmacm by name: the system table binds them at run time (dlopen of
// libibverbs.so.1 and librdmacm.so.1), so ferry runs on a host without them and loses only the
// verbs method; tests put a simulated fabric under the transport by handing it another table
// (tests/support/simverbs/).
//
// Every entry has the signature and the error convention of the function it is named after
// (see its man page); the inline verbs of <infiniband/verbs.h> (ibv_post_send, ibv_poll_cq,
// ibv_req_notify_cq, ibv_alloc_mw, ibv_dealloc_mw) are entries too. A table is immutable once
// made and may be used from any thread, as the library functions may.

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <string>

namespace ferry::transport::verbs {

struct VerbsApi {
  const char* name = "";  ///< "libibverbs" or the name of a simulation, for messages

  // Devices.
  ibv_device** (*get_device_list)(int* num_devices) = nullptr;
  void (*free_device_list)(ibv_device** list) = nullptr;
  const char* (*get_device_name)(ibv_device* device) = nullptr;
  __be64 (*get_device_guid)(ibv_device* device) = nullptr;
  ibv_context* (*open_device)(ibv_device* device) = nullptr;
  int (*close_device)(ibv_context* context) = nullptr;
  int (*query_device)(ibv_context* context, ibv_device_attr* attr) = nullptr;
  int (*query_port)(ibv_context* context, uint8_t port_num, ibv_port_attr* attr) = nullptr;
  int (*query_gid)(ibv_context* context, uint8_t port_num, int index, ibv_gid* gid) = nullptr;
  /// Reads one event from context->async_fd (blocking unless the fd is non-blocking: then -1
  /// with errno EAGAIN when none is there).
  int (*get_async_event)(ibv_context* context, ibv_async_event* event) = nullptr;
  void (*ack_async_event)(ibv_async_event* event) = nullptr;

  // Protection domains, memory regions and windows.
  ibv_pd* (*alloc_pd)(ibv_context* context) = nullptr;
  int (*dealloc_pd)(ibv_pd* pd) = nullptr;
  ibv_mr* (*reg_mr)(ibv_pd* pd, void* addr, size_t length, int access) = nullptr;
  int (*dereg_mr)(ibv_mr* mr) = nullptr;
  /// Optional (null where libibverbs predates it, rdma-core 34): registers `length` bytes of
  /// the dmabuf `fd` from `offset`, reached at addresses from `iova`; GPUDirect RDMA to device
  /// memory that the GPU driver exports as a dmabuf, without nvidia-peermem.
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                           int access) = nullptr;
  ibv_mw* (*alloc_mw)(ibv_pd* pd, ibv_mw_type type) = nullptr;
  int (*dealloc_mw)(ibv_mw* mw) = nullptr;

  // Completion channels and queues.
  ibv_comp_channel* (*create_comp_channel)(ibv_context* context) = nullptr;
  int (*destroy_comp_channel)(ibv_comp_channel* channel) = nullptr;
  ibv_cq* (*create_cq)(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel,
                       int comp_vector) = nullptr;
  int (*destroy_cq)(ibv_cq* cq) = nullptr;
  /// Reads one event from channel->fd (non-blocking fd: -1 with errno EAGAIN when none).
  int (*get_cq_event)(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) = nullptr;
  void (*ack_cq_events)(ibv_cq* cq, unsigned int nevents) = nullptr;
  int (*req_notify_cq)(ibv_cq* cq, int solicited_only) = nullptr;
  int (*poll_cq)(ibv_cq* cq, int num_entries, ibv_wc* wc) = nullptr;

  // Queue pairs (created and destroyed through rdma_cm below).
  int (*post_send)(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) = nullptr;
  int (*post_recv)(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) = nullptr;
  int (*modify_qp)(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask) = nullptr;

  // rdma_cm.
  rdma_event_channel* (*create_event_channel)() = nullptr;
  void (*destroy_event_channel)(rdma_event_channel* channel) = nullptr;
  /// The contexts rdma_cm uses (cm_id->verbs is always one of them), null-terminated.
  ibv_context** (*get_devices)(int* num_devices) = nullptr;
  void (*free_devices)(ibv_context** list) = nullptr;
  int (*create_id)(rdma_event_channel* channel, rdma_cm_id** id, void* context,
                   rdma_port_space ps) = nullptr;
  int (*destroy_id)(rdma_cm_id* id) = nullptr;
  int (*bind_addr)(rdma_cm_id* id, sockaddr* addr) = nullptr;
  int (*listen)(rdma_cm_id* id, int backlog) = nullptr;
  int (*resolve_addr)(rdma_cm_id* id, sockaddr* src_addr, sockaddr* dst_addr,
                      int timeout_ms) = nullptr;
  int (*resolve_route)(rdma_cm_id* id, int timeout_ms) = nullptr;
  int (*create_qp)(rdma_cm_id* id, ibv_pd* pd, ibv_qp_init_attr* attr) = nullptr;
  void (*destroy_qp)(rdma_cm_id* id) = nullptr;
  int (*connect)(rdma_cm_id* id, rdma_conn_param* param) = nullptr;
  int (*accept)(rdma_cm_id* id, rdma_conn_param* param) = nullptr;
  int (*reject)(rdma_cm_id* id, const void* private_data, uint8_t private_data_len) = nullptr;
  int (*disconnect)(rdma_cm_id* id) = nullptr;
  /// Reads one event from channel->fd (non-blocking fd: -1 with errno EAGAIN when none).
  int (*get_cm_event)(rdma_event_channel* channel, rdma_cm_event** event) = nullptr;
  int (*ack_cm_event)(rdma_cm_event* event) = nullptr;
  /// The port an id is bound to, in network byte order (rdma_get_src_port).
  __be16 (*get_src_port)(rdma_cm_id* id) = nullptr;
};

/// The system's libibverbs and librdmacm, bound once per process. Throws Error(Unsupported)
/// saying why they cannot be (at every call): a library is missing, or lacks a function ferry
/// needs. Any thread.
const VerbsApi& system_verbs();

/// Texts for messages: "remote access error", "transport retry counter exceeded", ...
const char* wc_status_text(ibv_wc_status status);
const char* async_event_text(ibv_event_type type);
const char* cm_event_text(rdma_cm_event_type type);

}  // namespace ferry::transport::verbs
