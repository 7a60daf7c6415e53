#pragma once

// What a verbs table sees of this host's RDMA devices, as JSON (ferry-info shows it): each
// device with its limits, each port with its link layer and GID table. Every call goes through
// the table, so the system's libibverbs and a simulated fabric are described alike.

#include <nlohmann/json.hpp>

#include "transport/verbs/verbs_api.hpp"

namespace ferry::transport::verbs {

/// {"api": api.name, "usable": bool, "devices": [...], and "detail" or "error"}.
///
/// usable is false only when the device list cannot be had (then "error" says why);
/// get_device_list failing with ENOSYS (the kernel has no RDMA support for user space) is a
/// usable answer with no device, and "detail" says so, as it does for an empty list.
///
/// A device: "name", "node_guid" ("0002:c903:0031:8f20"), "firmware", "vendor_id",
/// "vendor_part_id", "hw_ver", "limits" (from ibv_query_device: "max_mr_size", "max_qp",
/// "max_qp_wr", "max_sge", "max_cq", "max_cqe", "max_mr", "max_pd", "max_qp_rd_atom",
/// "max_qp_init_rd_atom", "max_mw", "memory_window_type_2b"), "ports"; or "error" from where
/// opening or querying it stopped.
///
/// A port: "port", "state" ("active", "down", ...), "link_layer" ("InfiniBand", "Ethernet"),
/// "active_mtu" and "max_mtu" in bytes, "lid", "sm_lid", "max_msg_sz", "width" ("4x"),
/// "speed" ("EDR"), "rate_gbps" (width times the lane rate; the last three when the port
/// reports codes known here), "gid_tbl_len", "gids": every non-zero entry of the GID table as
/// {"index", "gid" (IPv6 text), "ipv4" (for an IPv4-mapped GID, as RoCE v2 uses)}; or "error".
nlohmann::json describe_devices(const VerbsApi& api);

}  // namespace ferry::transport::verbs
