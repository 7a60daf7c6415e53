// ferry-info run as a user runs it: its text, its JSON, its exit status.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include <gtest/gtest.h>
#include <uv.h>
#include <ferry/connector.hpp>
#include <nlohmann/json.hpp>

#include "build_config.hpp"
#include "tests/tools/tool_run.hpp"

namespace ferry::test {
namespace {

// ferry-info runs as a child of this test and inherits this: a CUDA driver that is missing on
// every host, so that what it says of CUDA memory is known (tests/cuda/ covers a driver).
const bool kNoCudaDriver = [] {
  ::setenv("FERRY_CUDA_DRIVER", "/nonexistent/ferry-test/libcuda.so.1", 1);
  return true;
}();

using nlohmann::json;

json parsed(const ToolRun& run) {
  EXPECT_EQ(run.exit_code, 0) << run.err;
  return json::parse(run.out);  // throws, failing the test, when it is not JSON
}

const json& method(const json& doc, const std::string& name) {
  for (const json& m : doc.at("methods"))
    if (m.at("method") == name) return m;
  throw std::runtime_error("no method '" + name + "' in " + doc.at("methods").dump());
}

TEST(FerryInfo, PlainOutputNamesTcpAvailable) {
  ToolRun run = run_ferry_info({});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_TRUE(std::regex_search(run.out, std::regex("\n  tcp +100  available +needs: ")))
      << run.out;
  EXPECT_NE(run.out.find("highest-ranked method both offer"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("here nothing restricts it."), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("Offered here, best first: "), std::string::npos) << run.out;
#if FERRY_HAS_VERBS
  // Built: shown as probe_methods has it, offered or with its reason.
  EXPECT_TRUE(std::regex_search(
      run.out, std::regex("\n  verbs +300  (available +needs: |unavailable +)\\S")))
      << run.out;
  EXPECT_EQ(run.out.find("verbs     300  not built"), std::string::npos) << run.out;
#else
  EXPECT_TRUE(std::regex_search(run.out,
                                std::regex("\n  verbs +300  not built into this version of ferry")))
      << run.out;
#endif
  ASSERT_TRUE(kNoCudaDriver);
#if FERRY_HAS_CUDA
  // The driver this process names (below) is missing: ferry-info says so, and why.
  EXPECT_TRUE(std::regex_search(
      run.out, std::regex("\n  cuda +no CUDA driver: /nonexistent/ferry-test/libcuda.so.1 cannot "
                          "be loaded \\(")))
      << run.out;
#else
  EXPECT_TRUE(std::regex_search(run.out, std::regex("\n  cuda +not built into this version")))
      << run.out;
#endif
}

TEST(FerryInfo, TransportsOptionLeavesTheOthersOut) {
  ToolRun text = run_ferry_info({"--transports", "tcp"});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("here --transports restricts it to tcp."), std::string::npos) << text.out;

  json doc = parsed(run_ferry_info({"--json", "--transports", "tcp"}));
  EXPECT_EQ(doc.at("transports").at("source"), "--transports");
  EXPECT_EQ(doc.at("transports").at("methods"), json::array({"tcp"}));
  EXPECT_EQ(doc.at("offered"), json::array({"tcp"}));
  for (const json& m : doc.at("methods")) {
    if (m.at("method") == "tcp") {
      EXPECT_EQ(m.at("status"), "available") << m.dump();
    } else if (m.at("built").get<bool>()) {
      EXPECT_EQ(m.at("status"), "left out") << m.dump();
      EXPECT_FALSE(m.at("available").get<bool>()) << m.dump();
      EXPECT_NE(m.at("detail").get<std::string>().find("left out"), std::string::npos);
    } else {
      EXPECT_EQ(m.at("status"), "not built") << m.dump();
    }
  }
  // What it shows of each built method is what probe_methods says, in its order.
  ConnectorOptions options;
  options.transports = {"tcp"};
  json built = json::array();
  for (const json& m : doc.at("methods"))
    if (m.at("built").get<bool>()) built.push_back(m);
  std::vector<MethodInfo> probed = probe_methods(options);
  ASSERT_EQ(built.size(), probed.size()) << built.dump();
  for (std::size_t i = 0; i < probed.size(); ++i) {
    EXPECT_EQ(built[i].at("method"), probed[i].method);
    EXPECT_EQ(built[i].at("rank"), probed[i].rank);
    EXPECT_EQ(built[i].at("available"), probed[i].available);
    EXPECT_EQ(built[i].at("detail"), probed[i].detail);
  }
}

TEST(FerryInfo, TransportsFromTheEnvironment) {
  json doc = parsed(run_ferry_info({"--json"}, {"FERRY_TRANSPORTS=tcp"}));
  EXPECT_EQ(doc.at("transports").at("source"), "FERRY_TRANSPORTS");
  EXPECT_EQ(doc.at("transports").at("methods"), json::array({"tcp"}));
  EXPECT_EQ(method(doc, "tcp").at("status"), "available");
}

TEST(FerryInfo, UnknownTransportIsBadUsage) {
  ToolRun run = run_ferry_info({"--transports", "tcp,nosuch"});
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_NE(run.err.find("unknown method 'nosuch'"), std::string::npos) << run.err;
  EXPECT_EQ(run.out, "");
}

TEST(FerryInfo, UnknownTransportInTheEnvironmentIsShown) {
  json doc = parsed(run_ferry_info({"--json"}, {"FERRY_TRANSPORTS=nosuch"}));
  EXPECT_NE(doc.at("transports").at("error").get<std::string>().find("unknown method 'nosuch'"),
            std::string::npos)
      << doc.at("transports").dump();
  EXPECT_EQ(method(doc, "tcp").at("status"), "available");
}

TEST(FerryInfo, JsonListsMethodsBestFirst) {
  json doc = parsed(run_ferry_info({"--json"}));
  ASSERT_TRUE(doc.at("methods").is_array());
  ASSERT_FALSE(doc.at("methods").empty());
  int previous = 1 << 30;
  for (const json& m : doc.at("methods")) {
    EXPECT_TRUE(m.at("method").is_string());
    EXPECT_TRUE(m.at("available").is_boolean());
    EXPECT_TRUE(m.at("detail").is_string());
    EXPECT_LE(m.at("rank").get<int>(), previous) << "not best first: " << doc.at("methods");
    previous = m.at("rank").get<int>();
  }
  EXPECT_EQ(method(doc, "tcp").at("rank"), 100);
  EXPECT_EQ(method(doc, "tcp").at("available"), true);
#if FERRY_HAS_VERBS
  EXPECT_EQ(method(doc, "verbs").at("built"), true);
  EXPECT_EQ(method(doc, "verbs").at("rank"), 300);
  if (!method(doc, "verbs").at("available").get<bool>()) {
    EXPECT_EQ(method(doc, "verbs").at("status"), "unavailable");
    EXPECT_FALSE(method(doc, "verbs").at("detail").get<std::string>().empty());
  }
  ConnectorOptions only_verbs;
  only_verbs.transports = {"verbs"};
  for (const MethodInfo& m : probe_methods(only_verbs)) {
    if (m.method == "verbs") {
      EXPECT_EQ(method(doc, "verbs").at("detail"), m.detail);
    }
  }
#else
  EXPECT_EQ(method(doc, "verbs").at("built"), false);
  EXPECT_EQ(method(doc, "verbs").at("detail"), "not built into this version of ferry");
#endif
  EXPECT_EQ(doc.at("memory").at(1).at("kind"), "cuda");
  EXPECT_EQ(doc.at("memory").at(1).at("supported"), false);
  EXPECT_EQ(doc.at("versions").at("ferry"), FERRY_INFO_EXPECTED_VERSION);
  EXPECT_EQ(doc.at("versions").at("libuv"), uv_version_string());
  EXPECT_TRUE(doc.at("rdma").at("devices").is_array());
}

TEST(FerryInfo, SameHostFactsAreThisHosts) {
  json host = parsed(run_ferry_info({"--json"})).at("host");
  std::string boot_id;
  std::getline(std::ifstream("/proc/sys/kernel/random/boot_id"), boot_id);
  EXPECT_EQ(host.at("boot_id"), boot_id);
  EXPECT_EQ(host.at("pid_namespace"), std::filesystem::read_symlink("/proc/self/ns/pid").string());
  std::ifstream yama("/proc/sys/kernel/yama/ptrace_scope");
  int scope = -1;
  if (yama >> scope)
    EXPECT_EQ(host.at("ptrace_scope"), scope);
  else
    EXPECT_EQ(host.at("ptrace_scope_meaning"), "Yama not present");
}

TEST(FerryInfo, SaysWhenNoNatsServerIsConfigured) {
  ToolRun run = run_ferry_info({});
  EXPECT_NE(run.out.find("no NATS server configured (FERRY_NATS_URL unset): explicit metadata "
                         "works, subjects do not"),
            std::string::npos)
      << run.out;
  EXPECT_EQ(parsed(run_ferry_info({"--json", "--strict"})).at("nats").at("configured"), false);
}

TEST(FerryInfo, SaysWhyNoRdmaDeviceIsListed) {
  json rdma = parsed(run_ferry_info({"--json"})).at("rdma");
  std::error_code ec;
  bool none = std::filesystem::is_empty("/sys/class/infiniband", ec) || ec;
  if (!none) {
    // A host with devices: they are listed (or why not is said); no device is needed here.
    EXPECT_TRUE(!rdma.at("devices").empty() || rdma.contains("error")) << rdma.dump();
    return;
  }
  EXPECT_EQ(rdma.at("devices"), json::array()) << rdma.dump();
  ToolRun run = run_ferry_info({});
#if FERRY_HAS_VERBS
  if (!rdma.at("usable").get<bool>()) {
    // libibverbs or librdmacm cannot be loaded: the loader says why.
    std::string error = rdma.at("error");
    EXPECT_NE(error.find("cannot be loaded"), std::string::npos) << error;
    EXPECT_NE(run.out.find("\nRDMA devices\n  " + error.substr(0, 20)), std::string::npos)
        << run.out;
    return;
  }
  EXPECT_EQ(rdma.at("api"), "libibverbs");
  std::string detail = rdma.at("detail");
  // Without the kernel's user-space verbs (no /sys/class/infiniband_verbs) libibverbs answers
  // ENOSYS; with them and no device, an empty list.
  if (!std::filesystem::exists("/sys/class/infiniband_verbs", ec))
    EXPECT_EQ(detail, "no RDMA support in the kernel (ibv_get_device_list: ENOSYS)");
  else
    EXPECT_EQ(detail, "no RDMA device found");
  std::string expected = "\nRDMA devices (libibverbs)\n  no RDMA device found";
  if (detail != "no RDMA device found") expected += ": " + detail;
  EXPECT_NE(run.out.find(expected + "\n"), std::string::npos) << run.out;
#else
  EXPECT_EQ(rdma.at("usable"), false);
  EXPECT_NE(run.out.find("this ferry was built without verbs"), std::string::npos) << run.out;
#endif
}

TEST(FerryInfo, BadUsageExitsWith2) {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--bogus"}, {"--timeout-ms", "0"}, {"--timeout-ms", "x"}, {"--nats"}, {"--json=1"}}) {
    ToolRun run = run_ferry_info(args);
    EXPECT_EQ(run.exit_code, 2) << args.front();
    EXPECT_NE(run.err.find("usage: ferry-info"), std::string::npos) << run.err;
  }
}

TEST(FerryInfo, TakesSnakeCaseOptionsAsFerryBenchDoes) {
  ToolRun run = run_ferry_info({"--timeout_ms", "500", "--transports=tcp"});
  EXPECT_EQ(run.exit_code, 0) << run.err;
  ToolRun bad = run_ferry_info({"--timeout_ms=0"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("--timeout-ms wants milliseconds"), std::string::npos) << bad.err;
}

TEST(FerryInfo, HelpExitsWith0) {
  ToolRun run = run_ferry_info({"--help"});
  EXPECT_EQ(run.exit_code, 0);
  EXPECT_NE(run.out.find("usage: ferry-info"), std::string::npos);
  EXPECT_NE(run.out.find("--strict"), std::string::npos);
}

}  // namespace
}  // namespace ferry::test
