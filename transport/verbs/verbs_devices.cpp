#include "transport/verbs/verbs_devices.hpp"

#include <arpa/inet.h>
#include <endian.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

namespace ferry::transport::verbs {

namespace {

using nlohmann::json;

std::string error_text(const char* call, int err) {
  return std::string(call) + " failed: " + (err != 0 ? std::strerror(err) : "no reason given");
}

std::string guid_text(__be64 guid) {
  const std::uint64_t host = be64toh(guid);
  char text[24];
  std::snprintf(text, sizeof text, "%04x:%04x:%04x:%04x", static_cast<unsigned>(host >> 48),
                static_cast<unsigned>((host >> 32) & 0xffff),
                static_cast<unsigned>((host >> 16) & 0xffff), static_cast<unsigned>(host & 0xffff));
  return text;
}

const char* state_text(ibv_port_state state) {
  switch (state) {
    case IBV_PORT_NOP:
      return "nop";
    case IBV_PORT_DOWN:
      return "down";
    case IBV_PORT_INIT:
      return "init";
    case IBV_PORT_ARMED:
      return "armed";
    case IBV_PORT_ACTIVE:
      return "active";
    case IBV_PORT_ACTIVE_DEFER:
      return "active (deferred)";
  }
  return "unknown";
}

// As ibv_devinfo: a port that does not say is an InfiniBand port (drivers older than RoCE).
const char* link_layer_text(std::uint8_t link_layer) {
  switch (link_layer) {
    case IBV_LINK_LAYER_UNSPECIFIED:
    case IBV_LINK_LAYER_INFINIBAND:
      return "InfiniBand";
    case IBV_LINK_LAYER_ETHERNET:
      return "Ethernet";
    default:
      return "unknown";
  }
}

int mtu_bytes(ibv_mtu mtu) {
  const int code = static_cast<int>(mtu);  // IBV_MTU_256 is 1, IBV_MTU_4096 is 5
  return code >= 1 && code <= 5 ? 128 << code : 0;
}

/// Lanes of an active_width code; 0 for a code not known here.
int lanes(std::uint8_t width) {
  switch (width) {
    case 1:
      return 1;
    case 2:
      return 4;
    case 4:
      return 8;
    case 8:
      return 12;
    case 16:
      return 2;
    default:
      return 0;
  }
}

struct Speed {
  const char* name;
  double lane_gbps;  ///< the data rate of one lane, as ibv_devinfo counts it
};

/// The active_speed code's name and lane rate; null name for a code not known here.
Speed speed(std::uint8_t code) {
  switch (code) {
    case 1:
      return {"SDR", 2.5};
    case 2:
      return {"DDR", 5.0};
    case 4:
      return {"QDR", 10.0};
    case 8:
      return {"FDR10", 10.0};
    case 16:
      return {"FDR", 14.0};
    case 32:
      return {"EDR", 25.0};
    case 64:
      return {"HDR", 50.0};
    case 128:
      return {"NDR", 100.0};
    default:
      return {nullptr, 0.0};
  }
}

bool is_zero(const ibv_gid& gid) {
  return std::all_of(std::begin(gid.raw), std::end(gid.raw), [](std::uint8_t b) { return b == 0; });
}

/// ::ffff:a.b.c.d, the form of a RoCE v2 GID made from an IPv4 address.
bool is_ipv4_mapped(const ibv_gid& gid) {
  static constexpr std::uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(gid.raw, kPrefix, sizeof kPrefix) == 0;
}

json gid_entry(int index, const ibv_gid& gid) {
  char text[INET6_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET6, gid.raw, text, sizeof text);
  json entry = {{"index", index}, {"gid", text}};
  if (is_ipv4_mapped(gid)) {
    char v4[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, gid.raw + 12, v4, sizeof v4);
    entry["ipv4"] = v4;
  }
  return entry;
}

json port_facts(const VerbsApi& api, ibv_context* ctx, std::uint8_t port) {
  ibv_port_attr attr{};
  json facts = {{"port", port}};
  errno = 0;
  if (int rc = api.query_port(ctx, port, &attr); rc != 0) {
    facts["error"] = error_text("ibv_query_port", rc > 0 ? rc : errno);
    return facts;
  }
  facts["state"] = state_text(attr.state);
  facts["link_layer"] = link_layer_text(attr.link_layer);
  facts["active_mtu"] = mtu_bytes(attr.active_mtu);
  facts["max_mtu"] = mtu_bytes(attr.max_mtu);
  facts["lid"] = attr.lid;
  facts["sm_lid"] = attr.sm_lid;
  facts["max_msg_sz"] = attr.max_msg_sz;
  const int n = lanes(attr.active_width);
  const Speed s = speed(attr.active_speed);
  if (n != 0) facts["width"] = std::to_string(n) + "x";
  if (s.name != nullptr) facts["speed"] = s.name;
  if (n != 0 && s.name != nullptr) facts["rate_gbps"] = n * s.lane_gbps;
  facts["gid_tbl_len"] = attr.gid_tbl_len;
  // Unused entries read as zero, or (RoCE, newer kernels) fail to read: neither is shown.
  json gids = json::array();
  for (int i = 0; i < attr.gid_tbl_len; ++i) {
    ibv_gid gid{};
    if (api.query_gid(ctx, port, i, &gid) == 0 && !is_zero(gid)) gids.push_back(gid_entry(i, gid));
  }
  facts["gids"] = std::move(gids);
  return facts;
}

json limits(const ibv_device_attr& attr) {
  return {
      {"max_mr_size", attr.max_mr_size},
      {"max_qp", attr.max_qp},
      {"max_qp_wr", attr.max_qp_wr},
      {"max_sge", attr.max_sge},
      {"max_cq", attr.max_cq},
      {"max_cqe", attr.max_cqe},
      {"max_mr", attr.max_mr},
      {"max_pd", attr.max_pd},
      {"max_qp_rd_atom", attr.max_qp_rd_atom},
      {"max_qp_init_rd_atom", attr.max_qp_init_rd_atom},
      {"max_mw", attr.max_mw},
      {"memory_window_type_2b", (attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B) != 0},
  };
}

json device_facts(const VerbsApi& api, ibv_device* device) {
  const char* name = api.get_device_name(device);
  json facts = {{"name", name != nullptr ? name : "?"},
                {"node_guid", guid_text(api.get_device_guid(device))}};
  errno = 0;
  ibv_context* raw = api.open_device(device);
  if (raw == nullptr) {
    facts["error"] = error_text("ibv_open_device", errno);
    return facts;
  }
  auto close = [&api](ibv_context* ctx) { api.close_device(ctx); };
  std::unique_ptr<ibv_context, decltype(close)> ctx(raw, close);
  ibv_device_attr attr{};
  errno = 0;
  if (int rc = api.query_device(ctx.get(), &attr); rc != 0) {
    facts["error"] = error_text("ibv_query_device", rc > 0 ? rc : errno);
    return facts;
  }
  facts["firmware"] = std::string(attr.fw_ver, ::strnlen(attr.fw_ver, sizeof attr.fw_ver));
  facts["vendor_id"] = attr.vendor_id;
  facts["vendor_part_id"] = attr.vendor_part_id;
  facts["hw_ver"] = attr.hw_ver;
  facts["limits"] = limits(attr);
  json ports = json::array();
  for (int port = 1; port <= attr.phys_port_cnt; ++port)
    ports.push_back(port_facts(api, ctx.get(), static_cast<std::uint8_t>(port)));
  facts["ports"] = std::move(ports);
  return facts;
}

}  // namespace

json describe_devices(const VerbsApi& api) {
  json out = {{"api", api.name}};
  int count = 0;
  errno = 0;
  ibv_device** list = api.get_device_list(&count);
  const int err = errno;
  if (list == nullptr && err == ENOSYS) {
    // rdma-core's answer when the kernel offers no RDMA to user space (no ib_uverbs).
    out["usable"] = true;
    out["devices"] = json::array();
    out["detail"] = "no RDMA support in the kernel (ibv_get_device_list: ENOSYS)";
    return out;
  }
  if (list == nullptr) {
    out["usable"] = false;
    out["devices"] = json::array();
    out["error"] = error_text("ibv_get_device_list", err);
    return out;
  }
  auto free_list = [&api](ibv_device** l) { api.free_device_list(l); };
  std::unique_ptr<ibv_device*, decltype(free_list)> owned(list, free_list);
  json devices = json::array();
  for (int i = 0; i < count && list[i] != nullptr; ++i)
    devices.push_back(device_facts(api, list[i]));
  out["usable"] = true;
  if (devices.empty()) out["detail"] = "no RDMA device found";
  out["devices"] = std::move(devices);
  return out;
}

}  // namespace ferry::transport::verbs
