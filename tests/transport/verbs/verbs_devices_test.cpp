// describe_devices over a hand-made table: one device with an InfiniBand and an Ethernet port,
// GID tables with holes, the ENOSYS answer of a kernel without RDMA, and a list that fails.
#include <arpa/inet.h>
#include <endian.h>

#include <cerrno>
#include <cstring>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "transport/verbs/verbs_devices.hpp"

namespace ferry::transport::verbs {
namespace {

using nlohmann::json;

enum class ListAnswer { OneDevice, Empty, Enosys, Eperm };

struct Fake {
  ListAnswer list = ListAnswer::OneDevice;
  bool open_fails = false;
  int lists_freed = 0;
  int opened = 0;
  int closed = 0;
};
Fake fake;
ibv_device device{};
ibv_device* devices[2] = {&device, nullptr};
ibv_context context{};

ibv_device** get_device_list(int* n) {
  switch (fake.list) {
    case ListAnswer::OneDevice:
      *n = 1;
      return devices;
    case ListAnswer::Empty:
      *n = 0;
      return devices + 1;  // a list holding only its terminator
    case ListAnswer::Enosys:
      errno = ENOSYS;
      return nullptr;
    case ListAnswer::Eperm:
      errno = EPERM;
      return nullptr;
  }
  return nullptr;
}
void free_device_list(ibv_device**) { ++fake.lists_freed; }
const char* get_device_name(ibv_device* d) { return d == &device ? "fake_0" : "?"; }
__be64 get_device_guid(ibv_device*) { return htobe64(0x0002c90300318f20ull); }
ibv_context* open_device(ibv_device* d) {
  if (fake.open_fails) {
    errno = EACCES;
    return nullptr;
  }
  ++fake.opened;
  context.device = d;
  return &context;
}
int close_device(ibv_context* c) {
  EXPECT_EQ(c, &context);
  ++fake.closed;
  return 0;
}

int query_device(ibv_context*, ibv_device_attr* a) {
  std::memset(a, 0, sizeof *a);
  std::strcpy(a->fw_ver, "16.35.2000");
  a->vendor_id = 0x02c9;
  a->vendor_part_id = 4119;
  a->phys_port_cnt = 2;
  a->max_mr_size = 0xffffffffffffffffull;
  a->max_qp = 262144;
  a->max_qp_wr = 32768;
  a->max_sge = 30;
  a->max_cq = 16777216;
  a->max_cqe = 4194303;
  a->max_mr = 16777215;
  a->max_pd = 8388608;
  a->max_qp_rd_atom = 16;
  a->max_qp_init_rd_atom = 8;
  a->max_mw = 16777214;
  a->device_cap_flags = IBV_DEVICE_MEM_WINDOW | IBV_DEVICE_MEM_WINDOW_TYPE_2B;
  return 0;
}

int query_port(ibv_context*, uint8_t port, ibv_port_attr* a) {
  std::memset(a, 0, sizeof *a);
  a->max_msg_sz = 1u << 30;
  if (port == 1) {
    a->state = IBV_PORT_ACTIVE;
    a->link_layer = IBV_LINK_LAYER_INFINIBAND;
    a->active_mtu = IBV_MTU_4096;
    a->max_mtu = IBV_MTU_4096;
    a->lid = 7;
    a->sm_lid = 1;
    a->active_width = 2;   // 4x
    a->active_speed = 32;  // EDR
    a->gid_tbl_len = 4;
    return 0;
  }
  if (port == 2) {
    a->state = IBV_PORT_DOWN;
    a->link_layer = IBV_LINK_LAYER_ETHERNET;
    a->active_mtu = IBV_MTU_1024;
    a->max_mtu = IBV_MTU_4096;
    a->active_width = 1;   // 1x
    a->active_speed = 64;  // HDR
    a->gid_tbl_len = 6;
    return 0;
  }
  return EINVAL;
}

/// Writes `text` (IPv6) into `gid`.
int gid_from(const char* text, ibv_gid* gid) {
  return inet_pton(AF_INET6, text, gid->raw) == 1 ? 0 : -1;
}

int query_gid(ibv_context*, uint8_t port, int index, ibv_gid* gid) {
  std::memset(gid->raw, 0, sizeof gid->raw);
  if (port == 1) {
    if (index == 0) return gid_from("fe80::2:c903:31:8f21", gid);
    if (index == 3) return gid_from("2001:db8::1", gid);
    return 0;  // 1 and 2: unused, zero
  }
  switch (index) {
    case 0:
      return gid_from("fe80::526b:4bff:fe0c:1a2b", gid);
    case 1:
      return gid_from("::ffff:192.168.1.5", gid);
    case 3:
      errno = ENODATA;  // an unused RoCE entry, as newer kernels answer
      return -1;
    case 4:
      return gid_from("::ffff:10.0.0.7", gid);
    default:
      return 0;  // 2 and 5: unused, zero
  }
}

VerbsApi fake_api() {
  VerbsApi api;
  api.name = "fake";
  api.get_device_list = get_device_list;
  api.free_device_list = free_device_list;
  api.get_device_name = get_device_name;
  api.get_device_guid = get_device_guid;
  api.open_device = open_device;
  api.close_device = close_device;
  api.query_device = query_device;
  api.query_port = query_port;
  api.query_gid = query_gid;
  return api;
}

class DescribeDevices : public ::testing::Test {
 protected:
  void SetUp() override { fake = Fake{}; }
};

TEST_F(DescribeDevices, OneDeviceWithItsLimitsPortsAndGids) {
  const json doc = describe_devices(fake_api());
  EXPECT_EQ(doc.at("api"), "fake");
  EXPECT_EQ(doc.at("usable"), true);
  EXPECT_FALSE(doc.contains("error")) << doc.dump(2);
  EXPECT_FALSE(doc.contains("detail")) << doc.dump(2);
  ASSERT_EQ(doc.at("devices").size(), 1u) << doc.dump(2);
  const json& d = doc.at("devices").at(0);
  EXPECT_EQ(d.at("name"), "fake_0");
  EXPECT_EQ(d.at("node_guid"), "0002:c903:0031:8f20");
  EXPECT_EQ(d.at("firmware"), "16.35.2000");
  EXPECT_EQ(d.at("vendor_id"), 0x02c9);
  EXPECT_EQ(d.at("vendor_part_id"), 4119);

  const json& l = d.at("limits");
  EXPECT_EQ(l.at("max_mr_size").get<std::uint64_t>(), 0xffffffffffffffffull);
  EXPECT_EQ(l.at("max_qp"), 262144);
  EXPECT_EQ(l.at("max_qp_wr"), 32768);
  EXPECT_EQ(l.at("max_sge"), 30);
  EXPECT_EQ(l.at("max_cq"), 16777216);
  EXPECT_EQ(l.at("max_cqe"), 4194303);
  EXPECT_EQ(l.at("max_mr"), 16777215);
  EXPECT_EQ(l.at("max_pd"), 8388608);
  EXPECT_EQ(l.at("max_qp_rd_atom"), 16);
  EXPECT_EQ(l.at("max_qp_init_rd_atom"), 8);
  EXPECT_EQ(l.at("max_mw"), 16777214);
  EXPECT_EQ(l.at("memory_window_type_2b"), true);

  ASSERT_EQ(d.at("ports").size(), 2u);
  const json& ib = d.at("ports").at(0);
  EXPECT_EQ(ib.at("port"), 1);
  EXPECT_EQ(ib.at("state"), "active");
  EXPECT_EQ(ib.at("link_layer"), "InfiniBand");
  EXPECT_EQ(ib.at("active_mtu"), 4096);
  EXPECT_EQ(ib.at("max_mtu"), 4096);
  EXPECT_EQ(ib.at("lid"), 7);
  EXPECT_EQ(ib.at("sm_lid"), 1);
  EXPECT_EQ(ib.at("max_msg_sz"), 1u << 30);
  EXPECT_EQ(ib.at("width"), "4x");
  EXPECT_EQ(ib.at("speed"), "EDR");
  EXPECT_DOUBLE_EQ(ib.at("rate_gbps").get<double>(), 100.0);
  EXPECT_EQ(ib.at("gid_tbl_len"), 4);
  EXPECT_EQ(ib.at("gids"), json::parse(R"([{"index": 0, "gid": "fe80::2:c903:31:8f21"},
                                            {"index": 3, "gid": "2001:db8::1"}])"));

  const json& eth = d.at("ports").at(1);
  EXPECT_EQ(eth.at("port"), 2);
  EXPECT_EQ(eth.at("state"), "down");
  EXPECT_EQ(eth.at("link_layer"), "Ethernet");
  EXPECT_EQ(eth.at("active_mtu"), 1024);
  EXPECT_EQ(eth.at("max_mtu"), 4096);
  EXPECT_EQ(eth.at("width"), "1x");
  EXPECT_EQ(eth.at("speed"), "HDR");
  EXPECT_DOUBLE_EQ(eth.at("rate_gbps").get<double>(), 50.0);
  EXPECT_EQ(eth.at("gid_tbl_len"), 6);
  // Zero entries (2, 5) and the one that fails to read (3) are left out.
  EXPECT_EQ(eth.at("gids"), json::parse(R"([
      {"index": 0, "gid": "fe80::526b:4bff:fe0c:1a2b"},
      {"index": 1, "gid": "::ffff:192.168.1.5", "ipv4": "192.168.1.5"},
      {"index": 4, "gid": "::ffff:10.0.0.7", "ipv4": "10.0.0.7"}])"));

  EXPECT_EQ(fake.opened, 1);
  EXPECT_EQ(fake.closed, 1);
  EXPECT_EQ(fake.lists_freed, 1);
}

TEST_F(DescribeDevices, NoKernelSupportIsUsableWithoutDevices) {
  fake.list = ListAnswer::Enosys;
  const json doc = describe_devices(fake_api());
  EXPECT_EQ(doc.at("usable"), true);
  EXPECT_EQ(doc.at("devices"), json::array());
  EXPECT_EQ(doc.at("detail"), "no RDMA support in the kernel (ibv_get_device_list: ENOSYS)");
  EXPECT_FALSE(doc.contains("error"));
  EXPECT_EQ(fake.opened, 0);
  EXPECT_EQ(fake.lists_freed, 0);
}

TEST_F(DescribeDevices, AFailingListIsNotUsable) {
  fake.list = ListAnswer::Eperm;
  const json doc = describe_devices(fake_api());
  EXPECT_EQ(doc.at("usable"), false);
  EXPECT_EQ(doc.at("devices"), json::array());
  EXPECT_EQ(doc.at("error"), std::string("ibv_get_device_list failed: ") + std::strerror(EPERM));
  EXPECT_FALSE(doc.contains("detail"));
}

TEST_F(DescribeDevices, AnEmptyListSaysNoDeviceFound) {
  fake.list = ListAnswer::Empty;
  const json doc = describe_devices(fake_api());
  EXPECT_EQ(doc.at("usable"), true);
  EXPECT_EQ(doc.at("devices"), json::array());
  EXPECT_EQ(doc.at("detail"), "no RDMA device found");
  EXPECT_EQ(fake.lists_freed, 1);
}

TEST_F(DescribeDevices, ADeviceThatCannotBeOpenedSaysWhy) {
  fake.open_fails = true;
  const json doc = describe_devices(fake_api());
  EXPECT_EQ(doc.at("usable"), true);
  ASSERT_EQ(doc.at("devices").size(), 1u);
  const json& d = doc.at("devices").at(0);
  EXPECT_EQ(d.at("name"), "fake_0");
  EXPECT_EQ(d.at("error"), std::string("ibv_open_device failed: ") + std::strerror(EACCES));
  EXPECT_FALSE(d.contains("ports"));
  EXPECT_EQ(fake.closed, 0);
  EXPECT_EQ(fake.lists_freed, 1);
}

}  // namespace
}  // namespace ferry::transport::verbs
