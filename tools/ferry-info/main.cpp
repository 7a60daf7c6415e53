// ferry-info: what this host offers ferry, so that "which method will I get, and why?" has an
// answer. It gathers the facts into one JSON document and prints it as text, or as it is with
// --json:
//
//   methods    every method of this build, best first, offered here or not and why
//              (ferry::probe_methods), the methods and memory kinds not built into this version
//   rdma       the RDMA devices libibverbs sees (loaded at run time through ferry's verbs
//              table): their limits, their ports' link layers and GID tables
//   nats       whether the NATS server(s) of --nats or FERRY_NATS_URL answer, and what they say;
//              where a connector's side channel stands right after it is made with them
//   versions   ferry, libuv, cnats, the kernel
//   host       the same-host facts cma relies on: boot id, PID namespace, Yama's ptrace_scope
//
// Exit status: 0; 2 for bad usage; 1 with --strict when a configured NATS server is unreachable.
#include <arpa/inet.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nats/nats.h>
#include <uv.h>
#include <ferry/ferry.hpp>
#include <nlohmann/json.hpp>

#include "build_config.hpp"
#include "tools/common/nats_client.hpp"
#if FERRY_HAS_VERBS
#include "transport/verbs/verbs_devices.hpp"
#endif
#if FERRY_HAS_CUDA
#include "transport/cuda/cuda_memory.hpp"
#endif

namespace {

using ferry::tools::connect_options;
using ferry::tools::env;
using ferry::tools::failure_text;
using ferry::tools::NatsConnectionPtr;
using ferry::tools::NatsOptionsPtr;
using ferry::tools::split_list;
using json = nlohmann::ordered_json;  // keys in the order the text shows them

constexpr const char* kNotBuilt = "not built into this version of ferry";

constexpr const char* kSynopsis =
    "usage: ferry-info [--json] [--nats URL[,URL...]] [--timeout-ms N]\n"
    "                  [--transports METHOD[,METHOD...]] [--strict] [--help]\n";

constexpr const char* kHelp =
    "\n"
    "Prints what this host offers ferry: its transfer methods, best first, and why each is\n"
    "offered or not; RDMA devices and ports; whether the NATS server answers; versions; and\n"
    "the same-host facts the cma method relies on.\n"
    "\n"
    "  --json              one JSON document with the same facts\n"
    "  --nats URL[,URL]    the NATS server(s) to try (default: FERRY_NATS_URL)\n"
    "  --timeout-ms N      how long to wait for NATS (default 2000)\n"
    "  --transports LIST   restrict the methods as ConnectorOptions::transports would\n"
    "                      (default: FERRY_TRANSPORTS)\n"
    "  --strict            exit 1 when a configured NATS server cannot be reached\n"
    "\n"
    "Exit status: 0; 1 with --strict and NATS unreachable; 2 for bad usage.\n";

/// Bad usage: reported with the usage text, exit status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Args {
  bool json = false;
  bool strict = false;
  bool help = false;
  std::optional<std::string> nats;        ///< --nats, else FERRY_NATS_URL
  std::optional<std::string> transports;  ///< --transports, else FERRY_TRANSPORTS
  std::chrono::milliseconds timeout{2000};
};

std::string join(const std::vector<std::string>& items, const char* separator = ", ") {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : separator) + item;
  return out;
}

std::chrono::milliseconds parse_timeout(std::string_view text) {
  long long ms = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), ms);
  if (ec != std::errc() || end != text.data() + text.size() || ms <= 0 || ms > 600000)
    throw UsageError("--timeout-ms wants milliseconds from 1 to 600000, not '" + std::string(text) +
                     "'");
  return std::chrono::milliseconds(ms);
}

Args parse_args(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::optional<std::string> inline_value;
    if (auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      inline_value = arg.substr(eq + 1);
      arg.erase(eq);
    }
    // --kebab-case, and --snake_case as ferry-bench (nixlbench's names) takes them: both.
    if (arg.rfind("--", 0) == 0) std::replace(arg.begin() + 2, arg.end(), '_', '-');
    auto value = [&]() -> std::string {
      if (inline_value) return *inline_value;
      if (i + 1 >= argc) throw UsageError(arg + " wants a value");
      return argv[++i];
    };
    auto flag = [&]() {
      if (inline_value) throw UsageError(arg + " takes no value");
      return true;
    };
    if (arg == "--json") {
      args.json = flag();
    } else if (arg == "--strict") {
      args.strict = flag();
    } else if (arg == "--help" || arg == "-h") {
      args.help = flag();
    } else if (arg == "--nats") {
      args.nats = value();
      if (split_list(*args.nats).empty()) throw UsageError("--nats wants at least one URL");
    } else if (arg == "--transports") {
      args.transports = value();
    } else if (arg == "--timeout-ms") {
      args.timeout = parse_timeout(value());
    } else {
      throw UsageError("unknown argument '" + arg + "'");
    }
  }
  return args;
}

// ---- methods ---------------------------------------------------------------------------------

/// Methods of ferry that a build may lack, with their rank: verbs, without the ibverbs and
/// rdma_cm headers or with FERRY_WITH_VERBS=OFF. A built method is shown as probe_methods has it.
struct LaterMethod {
  const char* method;
  int rank;
};
std::vector<LaterMethod> later_methods() {
#if FERRY_HAS_VERBS
  return {};
#else
  return {{"verbs", 300}};
#endif
}

/// Where the transports restriction comes from: --transports, FERRY_TRANSPORTS, or nowhere.
json restriction(const Args& args) {
  if (args.transports && !split_list(*args.transports).empty())
    return {{"source", "--transports"}, {"methods", split_list(*args.transports)}};
  if (auto from_env = env("FERRY_TRANSPORTS"); from_env && !split_list(*from_env).empty())
    return {{"source", "FERRY_TRANSPORTS"}, {"methods", split_list(*from_env)}};
  return {{"source", nullptr}, {"methods", json::array()}};
}

std::string method_status(const ferry::MethodInfo& info, const json& restricted) {
  if (info.available) return "available";
  auto wanted = restricted["methods"].get<std::vector<std::string>>();
  if (!wanted.empty() && std::find(wanted.begin(), wanted.end(), info.method) == wanted.end())
    return "left out";
  return "unavailable";
}

/// probe_methods under the restriction. A bad --transports is bad usage; a bad FERRY_TRANSPORTS
/// is a fact to show (a connector here would refuse to start), so the methods are probed
/// without it.
std::vector<ferry::MethodInfo> probe(const Args& args, json& restricted) {
  ferry::ConnectorOptions options;
  if (args.transports) options.transports = split_list(*args.transports);
  try {
    return ferry::probe_methods(options);
  } catch (const ferry::Error& e) {
    if (restricted["source"] == "--transports") throw UsageError(e.what());
    restricted["error"] = std::string(e.what()) + "; a connector here refuses to start";
    restricted["ignored"] = restricted["methods"];
    restricted["methods"] = json::array();
    options.use_environment = false;
    return ferry::probe_methods(options);
  }
}

json memory_kinds(const ferry::MethodInfo& info) {
  json kinds = json::array();
  if (info.moves_host) kinds.push_back("host");
  if (info.moves_cuda) kinds.push_back("cuda");
  return kinds;
}

json method_list(const Args& args, json& restricted) {
  json methods = json::array();
  for (const ferry::MethodInfo& info : probe(args, restricted))
    methods.push_back({{"method", info.method},
                       {"rank", info.rank},
                       {"built", true},
                       {"available", info.available},
                       {"status", method_status(info, restricted)},
                       {"detail", info.detail},
                       {"memory", memory_kinds(info)}});
  for (const LaterMethod& later : later_methods()) {
    auto built = [&](const json& m) { return m["method"] == later.method; };
    if (std::none_of(methods.begin(), methods.end(), built))
      methods.push_back({{"method", later.method},
                         {"rank", later.rank},
                         {"built", false},
                         {"available", false},
                         {"status", "not built"},
                         {"detail", kNotBuilt}});
  }
  std::stable_sort(methods.begin(), methods.end(),
                   [](const json& a, const json& b) { return a["rank"] > b["rank"]; });
  return methods;
}

std::string selection_rule(const json& restricted) {
  std::string rule =
      "Between two ferry processes the highest-ranked method both offer (and that fits: cma "
      "only between processes of one host and PID namespace) is used. FERRY_TRANSPORTS=tcp,cma "
      "or ConnectorOptions::transports restricts the set; ";
  if (restricted["source"].is_null()) return rule + "here nothing restricts it.";
  if (restricted.contains("error"))
    return rule + "here FERRY_TRANSPORTS is wrong (below); shown without it.";
  return rule + "here " + restricted["source"].get<std::string>() + " restricts it to " +
         join(restricted["methods"].get<std::vector<std::string>>()) + ".";
}

/// CUDA memory: the driver ferry loads at run time and its devices, or why it cannot be used.
json cuda_memory_facts(const json& methods) {
#if FERRY_HAS_CUDA
  std::optional<ferry::transport::cuda::DriverInfo> info;
  try {
    info = ferry::transport::cuda::describe();
  } catch (const ferry::Error& e) {
    return {{"kind", "cuda"}, {"supported", false}, {"detail", e.message()}};
  }
  json devices = json::array();
  std::string names;
  for (const auto& d : info->devices) {
    devices.push_back({{"device", "cuda:" + std::to_string(d.ordinal)},
                       {"name", d.name},
                       {"pci_bus_id", d.pci_bus_id},
                       {"vmm", d.vmm},
                       {"dmabuf", d.dmabuf}});
    names += (names.empty() ? "" : ", ") + ("cuda:" + std::to_string(d.ordinal)) + " " + d.name;
  }
  std::vector<std::string> movers;
  for (const json& m : methods)
    if (m["available"].get<bool>() &&
        std::find(m["memory"].begin(), m["memory"].end(), "cuda") != m["memory"].end())
      movers.push_back(m["method"].get<std::string>());
  const std::string driver = "driver " + info->library + " " +
                             std::to_string(info->version / 1000) + "." +
                             std::to_string(info->version % 1000 / 10);
  std::string detail = driver + "; " + (names.empty() ? "no device" : names) + "; ";
  detail += movers.empty() ? "no method offered here moves it yet" : "moved by " + join(movers);
  for (const json& m : methods)
    if (m["method"] == "cma" && m["available"].get<bool>())
      detail += "; by cma on the active side only (staged there)";
  return {{"kind", "cuda"},          {"supported", !movers.empty()},    {"detail", detail},
          {"driver", info->library}, {"driver_version", info->version}, {"devices", devices}};
#else
  (void)methods;
  return {{"kind", "cuda"},
          {"supported", false},
          {"detail", std::string(kNotBuilt) + " (built without the CUDA toolkit's cuda.h, or "
                                              "FERRY_WITH_CUDA=OFF)"}};
#endif
}

json methods_facts(const Args& args) {
  json restricted = restriction(args);
  json methods = method_list(args, restricted);
  std::vector<std::string> offered;
  for (const json& m : methods)
    if (m["available"].get<bool>()) offered.push_back(m["method"].get<std::string>());
  json memory = json::array({
#if FERRY_HAS_CUDA
    {{"kind", "host"},
     {"supported", true},
     {"detail", "moved by every method (by cuda_ipc to or from the peer's CUDA memory only)"}},
#else
    {{"kind", "host"}, {"supported", true}, {"detail", "moved by every method"}},
#endif
        cuda_memory_facts(methods),
  });
  return {{"methods", methods},
          {"offered", offered},
          {"transports", restricted},
          {"rule", selection_rule(restricted)},
          {"memory", std::move(memory)}};
}

// ---- RDMA ------------------------------------------------------------------------------------

/// The devices through the system's verbs table (transport/verbs/verbs_devices.hpp), or why
/// there is none to ask.
json rdma_facts() {
#if FERRY_HAS_VERBS
  const ferry::transport::verbs::VerbsApi* api = nullptr;
  try {
    api = &ferry::transport::verbs::system_verbs();
  } catch (const ferry::Error& e) {
    return {{"usable", false}, {"error", e.message()}, {"devices", json::array()}};
  }
  return json(ferry::transport::verbs::describe_devices(*api));
#else
  return {{"usable", false},
          {"error",
           "this ferry was built without verbs (no ibverbs headers, or "
           "FERRY_WITH_VERBS=OFF)"},
          {"devices", json::array()}};
#endif
}

// ---- NATS ------------------------------------------------------------------------------------

json connection_facts(natsConnection* connection, std::chrono::milliseconds timeout) {
  json facts = {{"reachable", true}};
  char text[512];
  if (natsConnection_GetConnectedUrl(connection, text, sizeof text) == NATS_OK)
    facts["connected_url"] = text;
  if (natsConnection_GetConnectedServerId(connection, text, sizeof text) == NATS_OK)
    facts["server_id"] = text;
  facts["max_payload"] = natsConnection_GetMaxPayload(connection);
  // natsConnection_GetRTT flushes with cnats' own 10 s limit; a timed flush (one PING/PONG)
  // keeps --timeout-ms the bound.
  auto start = std::chrono::steady_clock::now();
  if (natsConnection_FlushTimeout(connection, timeout.count()) == NATS_OK)
    facts["rtt_us"] = std::chrono::duration_cast<std::chrono::microseconds>(
                          std::chrono::steady_clock::now() - start)
                          .count();
  char* ip = nullptr;
  int port = 0;
  if (natsConnection_GetLocalIPAndPort(connection, &ip, &port) == NATS_OK && ip != nullptr) {
    facts["local_ip"] = ip;
    std::free(ip);  // allocated by cnats
  }
  return facts;
}

json reach(const std::vector<std::string>& servers, std::chrono::milliseconds timeout) {
  try {
    NatsOptionsPtr options = connect_options(servers, timeout, "ferry-info", false);
    natsConnection* raw = nullptr;
    natsStatus status = natsConnection_Connect(&raw, options.get());
    if (status != NATS_OK) return {{"reachable", false}, {"error", failure_text(status)}};
    NatsConnectionPtr connection(raw, natsConnection_Destroy);
    return connection_facts(connection.get(), timeout);
  } catch (const std::exception& e) {
    return {{"reachable", false}, {"error", e.what()}};
  }
}

/// What a connector made here with `servers` says of its side channel right after its
/// constructor: connected, connecting (it keeps trying in the background), or why it refuses
/// to start (credentials refused, say).
json connector_facts(const std::vector<std::string>& servers, std::chrono::milliseconds timeout) {
  try {
    ferry::ConnectorOptions options;
    options.name = "ferry-info";
    options.use_environment = false;  // the methods are another section's business
    options.transports = {"tcp"};
    options.nats.servers = servers;
    options.nats.connect_timeout = timeout;
    ferry::Connector connector(options);
    ferry::SideChannelStatus now = connector.side_channel_state();
    return {{"state", ferry::to_string(now.state)}, {"detail", now.detail}};
  } catch (const ferry::Error& e) {
    return {{"state", "refused"}, {"detail", e.what()}};
  }
}

json nats_facts(const Args& args) {
  std::vector<std::string> servers =
      split_list(args.nats.value_or(env("FERRY_NATS_URL").value_or("")));
  if (servers.empty()) return {{"configured", false}};
  json facts = {{"configured", true},
                {"source", args.nats ? "--nats" : "FERRY_NATS_URL"},
                {"servers", servers}};
  facts.update(reach(servers, args.timeout));
  facts["connector"] = connector_facts(servers, args.timeout);
  // Lets cnats' threads and memory go before exit (the connection is destroyed by now).
  nats_CloseAndWait(args.timeout.count());
  return facts;
}

// ---- versions and the same host --------------------------------------------------------------

std::optional<std::string> first_line(const char* path) {
  std::ifstream file(path);
  std::string line;
  if (!file || !std::getline(file, line)) return std::nullopt;
  return line;
}

json versions_facts() {
  json facts = {
      {"ferry", FERRY_INFO_VERSION}, {"libuv", uv_version_string()}, {"cnats", nats_GetVersion()}};
  utsname u{};
  if (uname(&u) == 0)
    facts["kernel"] = std::string(u.sysname) + " " + u.release + " " + u.version + " " + u.machine;
  return facts;
}

std::string ptrace_scope_meaning(int scope) {
  switch (scope) {
    case 0:
      return "classic: a process of the same user may read another (cma can be offered)";
    case 1:
      return "restricted: only ancestors may read a process, unless it lets any process in "
             "(CmaOptions::ptracer_any, FERRY_CMA_PTRACER_ANY=1)";
    case 2:
      return "admin only: reading another process needs CAP_SYS_PTRACE";
    case 3:
      return "no process may read another";
    default:
      return "unknown setting";
  }
}

json host_facts() {
  json facts;
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) == 0) facts["hostname"] = name;
  facts["boot_id"] = first_line("/proc/sys/kernel/random/boot_id").value_or("");
  char ns[128] = {};
  ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  facts["pid_namespace"] = n > 0 ? std::string(ns, static_cast<std::size_t>(n)) : "";
  auto scope = first_line("/proc/sys/kernel/yama/ptrace_scope");
  if (!scope) {
    facts["ptrace_scope"] = nullptr;
    facts["ptrace_scope_meaning"] = "Yama not present";
  } else {
    int value = std::atoi(scope->c_str());
    facts["ptrace_scope"] = value;
    facts["ptrace_scope_meaning"] = ptrace_scope_meaning(value);
  }
  return facts;
}

// ---- text ------------------------------------------------------------------------------------

/// `text` broken into lines of at most `width` characters, each after `indent` spaces.
std::string wrap(const std::string& text, std::size_t indent, std::size_t width = 96) {
  std::string out, line;
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t space = text.find(' ', start);
    std::string word =
        text.substr(start, space == std::string::npos ? std::string::npos : space - start);
    if (!line.empty() && indent + line.size() + 1 + word.size() > width) {
      out += std::string(indent, ' ') + line + "\n";
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
    if (space == std::string::npos) break;
    start = space + 1;
  }
  if (!line.empty()) out += std::string(indent, ' ') + line + "\n";
  return out;
}

void print_methods(const json& facts) {
  std::printf("Methods, best first\n");
  for (const json& m : facts["methods"]) {
    if (!m["built"].get<bool>()) {
      std::printf("  %-8s %4d  %s\n", m["method"].get<std::string>().c_str(), m["rank"].get<int>(),
                  kNotBuilt);
      continue;
    }
    std::string detail = m["detail"].get<std::string>();
    if (m["available"].get<bool>() && !detail.empty()) detail = "needs: " + detail;
    std::printf("  %-8s %4d  %-12s %s\n", m["method"].get<std::string>().c_str(),
                m["rank"].get<int>(), m["status"].get<std::string>().c_str(), detail.c_str());
  }
  std::printf("%s", wrap(facts["rule"].get<std::string>(), 2).c_str());
  if (facts["transports"].contains("error"))
    std::printf(
        "%s",
        wrap("FERRY_TRANSPORTS: " + facts["transports"]["error"].get<std::string>(), 2).c_str());
  auto offered = facts["offered"].get<std::vector<std::string>>();
  if (offered.empty())
    std::printf("  Offered here: none; a connector here cannot transfer.\n");
  else
    std::printf("  Offered here, best first: %s.\n", join(offered).c_str());
  std::printf("\nMemory\n");
  for (const json& m : facts["memory"])
    std::printf("  %-6s %s\n", m["kind"].get<std::string>().c_str(),
                m["detail"].get<std::string>().c_str());
}

/// `text` wrapped at column `column`, with `label` in front of its first line.
std::string labelled(const std::string& label, const std::string& text, std::size_t column) {
  std::string out = wrap(text, column);
  std::string head = "    " + label;
  head.resize(std::max(head.size() + 1, column), ' ');
  return head + out.substr(std::min(column, out.size()));
}

std::string number_text(const json& value) {
  if (value.is_number_float()) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", value.get<double>());
    return text;
  }
  return value.dump();
}

/// The device's limits in the order of ibv_query_device's man page.
std::string limits_text(const json& limits) {
  std::vector<std::string> parts;
  for (const char* key : {"max_mr_size", "max_mr", "max_pd", "max_qp", "max_qp_wr", "max_sge",
                          "max_cq", "max_cqe", "max_qp_rd_atom", "max_qp_init_rd_atom", "max_mw"})
    if (limits.contains(key)) parts.push_back(std::string(key) + " " + number_text(limits[key]));
  if (limits.contains("memory_window_type_2b"))
    parts.push_back(std::string("memory windows type 2B ") +
                    (limits["memory_window_type_2b"].get<bool>() ? "yes" : "no"));
  return join(parts);
}

std::string port_text(const json& p) {
  std::vector<std::string> parts{p["state"].get<std::string>(), p["link_layer"].get<std::string>()};
  parts.push_back("active MTU " + number_text(p["active_mtu"]) + " (max " +
                  number_text(p["max_mtu"]) + ")");
  if (p["link_layer"] == "InfiniBand")
    parts.push_back("LID " + number_text(p["lid"]) + ", SM LID " + number_text(p["sm_lid"]));
  parts.push_back("max message " + number_text(p["max_msg_sz"]) + " bytes");
  std::string rate;
  if (p.contains("width")) rate = p["width"].get<std::string>();
  if (p.contains("speed")) rate += (rate.empty() ? "" : " ") + p["speed"].get<std::string>();
  if (p.contains("rate_gbps")) rate += " (" + number_text(p["rate_gbps"]) + " Gb/s)";
  if (!rate.empty()) parts.push_back(rate);
  parts.push_back("GID table of " + number_text(p["gid_tbl_len"]) + " entries");
  return join(parts);
}

void print_device(const json& d) {
  std::printf("  %s  node GUID %s", d["name"].get<std::string>().c_str(),
              d["node_guid"].get<std::string>().c_str());
  if (d.contains("error")) {
    std::printf("  %s\n", d["error"].get<std::string>().c_str());
    return;
  }
  std::printf("  firmware %s\n", d["firmware"].get<std::string>().c_str());
  std::printf("%s", labelled("limits", limits_text(d["limits"]), 13).c_str());
  for (const json& p : d["ports"]) {
    std::string label = "port " + number_text(p["port"]);
    if (p.contains("error")) {
      std::printf("%s", labelled(label, p["error"].get<std::string>(), 13).c_str());
      continue;
    }
    std::printf("%s", labelled(label, port_text(p), 13).c_str());
    if (p["gids"].empty()) std::printf("             no GID set\n");
    for (const json& g : p["gids"]) {
      std::string line = "GID " + number_text(g["index"]);
      line.resize(std::max<std::size_t>(line.size() + 1, 8), ' ');
      line += g["gid"].get<std::string>();
      if (g.contains("ipv4")) line += " (IPv4 " + g["ipv4"].get<std::string>() + ")";
      std::printf("             %s\n", line.c_str());
    }
  }
}

void print_rdma(const json& facts) {
  std::printf("\nRDMA devices%s\n",
              facts.contains("api") ? (" (" + facts["api"].get<std::string>() + ")").c_str() : "");
  if (!facts["usable"].get<bool>()) {
    std::printf("%s", wrap(facts["error"].get<std::string>(), 2).c_str());
    return;
  }
  if (facts["devices"].empty()) {
    std::string detail = facts.value("detail", std::string("no RDMA device found"));
    std::printf("  %s\n", detail.starts_with("no RDMA device found")
                              ? detail.c_str()
                              : ("no RDMA device found: " + detail).c_str());
  }
  for (const json& d : facts["devices"]) print_device(d);
}

void print_nats(const json& facts) {
  std::printf("\nNATS\n");
  if (!facts["configured"].get<bool>()) {
    std::printf(
        "  no NATS server configured (FERRY_NATS_URL unset): explicit metadata works, subjects "
        "do not\n");
    return;
  }
  auto servers = join(facts["servers"].get<std::vector<std::string>>());
  std::printf("  servers        %s (from %s)\n", servers.c_str(),
              facts["source"].get<std::string>().c_str());
  if (facts.contains("connector")) {
    const json& c = facts["connector"];
    const std::string state = c["state"].get<std::string>();
    std::printf("  a connector    %s%s: %s\n", state.c_str(),
                state == "connecting" ? " (keeps trying in the background)" : "",
                c["detail"].get<std::string>().c_str());
  }
  if (!facts["reachable"].get<bool>()) {
    std::printf("  unreachable    %s\n", facts["error"].get<std::string>().c_str());
    return;
  }
  std::printf("  reachable      %s\n", facts.value("connected_url", std::string("?")).c_str());
  std::printf("  server id      %s\n", facts.value("server_id", std::string("?")).c_str());
  std::printf("  max payload    %lld bytes\n",
              static_cast<long long>(facts["max_payload"].get<std::int64_t>()));
  if (facts.contains("rtt_us"))
    std::printf("  round trip     %lld us\n",
                static_cast<long long>(facts["rtt_us"].get<std::int64_t>()));
  if (facts.contains("local_ip"))
    std::printf("  local address  %s (where a connector's tcp listener binds by default)\n",
                facts["local_ip"].get<std::string>().c_str());
}

void print_versions_and_host(const json& versions, const json& host) {
  std::printf("\nVersions\n");
  for (const char* key : {"ferry", "libuv", "cnats", "kernel"})
    if (versions.contains(key))
      std::printf("  %-7s %s\n", key, versions[key].get<std::string>().c_str());
  std::printf("\nSame host (what cma relies on)\n");
  std::printf("  host name      %s\n", host.value("hostname", std::string("?")).c_str());
  std::printf("  boot id        %s\n", host["boot_id"].get<std::string>().c_str());
  std::printf("  PID namespace  %s\n", host["pid_namespace"].get<std::string>().c_str());
  if (host["ptrace_scope"].is_null())
    std::printf("  ptrace_scope   Yama not present\n");
  else
    std::printf("  ptrace_scope   %d (%s)\n", host["ptrace_scope"].get<int>(),
                host["ptrace_scope_meaning"].get<std::string>().c_str());
}

void print_text(const json& doc) {
  print_methods(doc);
  print_rdma(doc["rdma"]);
  print_nats(doc["nats"]);
  print_versions_and_host(doc["versions"], doc["host"]);
}

json gather(const Args& args) {
  json doc = methods_facts(args);
  doc["rdma"] = rdma_facts();
  doc["nats"] = nats_facts(args);
  doc["versions"] = versions_facts();
  doc["host"] = host_facts();
  return doc;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args args = parse_args(argc, argv);
    if (args.help) {
      std::printf("%s%s", kSynopsis, kHelp);
      return 0;
    }
    json doc = gather(args);
    if (args.json)
      std::cout << doc.dump(2) << std::endl;
    else
      print_text(doc);
    bool unreachable =
        doc["nats"]["configured"].get<bool>() && !doc["nats"]["reachable"].get<bool>();
    return args.strict && unreachable ? 1 : 0;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "ferry-info: %s\n%s", e.what(), kSynopsis);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry-info: %s\n", e.what());
    return 1;
  }
}
