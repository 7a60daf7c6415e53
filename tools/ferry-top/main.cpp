// ferry-top: a live view of every ferry connector on a NATS cluster (docs/operations.md).
// Each round it publishes one request at "<prefix>.stats", which every connector with
// NatsOptions::answer_stats answers, gathers the answers for --timeout-ms, and shows one line
// per worker, the totals and the busiest peer pairs; rates come from two rounds.
#include <signal.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <atomic>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nats/nats.h>
#include <nlohmann/json.hpp>

#include "tools/common/nats_client.hpp"
#include "tools/ferry-top/view.hpp"

namespace {

using namespace std::chrono_literals;
using ferry::tools::split_list;

constexpr const char* kUsage =
    "usage: ferry-top [--nats URL[,URL...]] [--prefix PREFIX] [--interval SECONDS]\n"
    "                 [--timeout-ms N] [--once] [--json] [--count N] [--help]\n";

constexpr const char* kHelp =
    "\n"
    "Shows every ferry connector that answers on the NATS cluster: one line per worker\n"
    "(host, name, methods, operations/s, bytes/s in and out, p50/p99 latency, live\n"
    "operations, errors by code since it started), the totals, and the busiest peer pairs.\n"
    "\n"
    "  --nats URL[,URL]   the NATS server(s) (default: FERRY_NATS_URL); credentials from\n"
    "                     FERRY_NATS_USER/PASSWORD, _TOKEN, _CREDS, _NKEY, _TLS_* as a\n"
    "                     connector reads them\n"
    "  --prefix PREFIX    ferry's subject prefix (default: FERRY_NATS_PREFIX, else ferry)\n"
    "  --interval SECONDS between refreshes (default 2; rates are over this interval)\n"
    "  --timeout-ms N     how long each round gathers answers (default 500)\n"
    "  --once             one view (two rounds, an interval apart, for the rates), then exit\n"
    "  --json             JSON, one document per line, instead of the table\n"
    "  --count N          stop after N views\n"
    "\n"
    "Exit status: 0; 1 when NATS cannot be reached; 2 for a bad argument.\n";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Args {
  std::vector<std::string> servers;
  std::string prefix;
  std::chrono::milliseconds interval{2000};
  std::chrono::milliseconds window{500};
  bool once = false;
  bool json = false;
  long count = 0;  // 0: until stopped
};

long parse_number(std::string_view text, const char* what, long low, long high) {
  long v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v < low || v > high)
    throw UsageError(std::string(what) + " wants a whole number from " + std::to_string(low) +
                     " to " + std::to_string(high) + ", not '" + std::string(text) + "'");
  return v;
}

Args parse_args(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(arg + " wants a value");
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage << kHelp;
      std::exit(0);
    } else if (arg == "--nats") {
      args.servers = split_list(value());
      if (args.servers.empty()) throw UsageError("--nats wants at least one URL");
    } else if (arg == "--prefix") {
      args.prefix = value();
      if (args.prefix.empty()) throw UsageError("--prefix wants a subject prefix");
    } else if (arg == "--interval") {
      const std::string v = value();
      double seconds = 0;
      try {
        std::size_t used = 0;
        seconds = std::stod(v, &used);
        if (used != v.size()) seconds = -1;
      } catch (const std::exception&) {
        seconds = -1;
      }
      if (!(seconds >= 0.1 && seconds <= 3600))
        throw UsageError("--interval wants seconds from 0.1 to 3600, not '" + v + "'");
      args.interval = std::chrono::milliseconds(static_cast<long>(seconds * 1000));
    } else if (arg == "--timeout-ms") {
      args.window = std::chrono::milliseconds(parse_number(value(), "--timeout-ms", 1, 60000));
    } else if (arg == "--once") {
      args.once = true;
    } else if (arg == "--json") {
      args.json = true;
    } else if (arg == "--count") {
      args.count = parse_number(value(), "--count", 1, 1000000000);
    } else {
      throw UsageError("unknown option '" + arg + "'");
    }
  }
  if (args.servers.empty())
    if (auto url = ferry::tools::env("FERRY_NATS_URL")) args.servers = split_list(*url);
  if (args.servers.empty())
    throw UsageError("no NATS server: pass --nats URL or set FERRY_NATS_URL");
  if (args.prefix.empty()) args.prefix = ferry::tools::env("FERRY_NATS_PREFIX").value_or("ferry");
  if (args.window >= args.interval)
    args.window = std::max(args.interval / 2, std::chrono::milliseconds(1));
  return args;
}

std::atomic<bool> stopping{false};

// Answers arriving at this process's inbox, kept for the round they answer.
struct Inbox {
  std::mutex mu;
  std::string round;  // the reply subject of the current round
  std::vector<nlohmann::json> answers;

  static void on_message(natsConnection*, natsSubscription*, natsMsg* msg, void* closure) {
    auto* self = static_cast<Inbox*>(closure);
    const std::string subject = natsMsg_GetSubject(msg);
    std::string data(natsMsg_GetData(msg), static_cast<std::size_t>(natsMsg_GetDataLength(msg)));
    natsMsg_Destroy(msg);
    auto answer = nlohmann::json::parse(data, nullptr, false);
    if (answer.is_discarded()) return;
    std::lock_guard lock(self->mu);
    if (subject == self->round) self->answers.push_back(std::move(answer));
  }
};

std::string random_hex16() {
  std::random_device rd;
  std::uint64_t v = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

int terminal_width() {
  winsize ws{};
  if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  return 132;
}

std::string clock_text() {
  std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buf[16];
  std::strftime(buf, sizeof buf, "%H:%M:%S", &local);
  return buf;
}

int run(const Args& args) {
  ferry::tools::NatsOptionsPtr options =
      ferry::tools::connect_options(args.servers, 2000ms, "ferry-top", true);
  natsConnection* raw = nullptr;
  if (natsStatus s = natsConnection_Connect(&raw, options.get()); s != NATS_OK) {
    std::string urls;
    for (const auto& u : args.servers) urls += (urls.empty() ? "" : ",") + u;
    std::cerr << "ferry-top: cannot reach NATS at " << urls << ": " << ferry::tools::failure_text(s)
              << "\n";
    return 1;
  }
  ferry::tools::NatsConnectionPtr nc(raw, natsConnection_Destroy);
  Inbox inbox;
  // A request inbox as a connector's own ("<prefix>.inbox.<16 hex>.r<n>"): connectors answer
  // only there.
  const std::string inbox_prefix = args.prefix + ".inbox." + random_hex16();
  natsSubscription* sub = nullptr;
  ferry::tools::check(natsConnection_Subscribe(&sub, nc.get(), (inbox_prefix + ".*").c_str(),
                                               &Inbox::on_message, &inbox),
                      "subscribing to ferry-top's inbox");
  std::unique_ptr<natsSubscription, void (*)(natsSubscription*)> keep(sub,
                                                                      natsSubscription_Destroy);
  natsSubscription_SetPendingLimits(sub, 65536, 256 << 20);
  natsConnection_Flush(nc.get());

  const std::string subject = args.prefix + ".stats";
  ferry::tools::View view;
  const long views = args.once ? 1 : args.count;
  const bool tty = ::isatty(STDOUT_FILENO) == 1;
  long shown = 0;
  for (std::uint64_t round = 1; !stopping; ++round) {
    const auto started = std::chrono::steady_clock::now();
    char reply[96];
    std::snprintf(reply, sizeof reply, "%s.r%llx", inbox_prefix.c_str(),
                  static_cast<unsigned long long>(round));
    {
      std::lock_guard lock(inbox.mu);
      inbox.round = reply;
      inbox.answers.clear();
    }
    natsConnection_PublishRequestString(nc.get(), subject.c_str(), reply, "{}");
    natsConnection_Flush(nc.get());
    while (!stopping && std::chrono::steady_clock::now() - started < args.window)
      std::this_thread::sleep_for(10ms);
    std::vector<nlohmann::json> answers;
    {
      std::lock_guard lock(inbox.mu);
      answers.swap(inbox.answers);
      inbox.round.clear();
    }
    view.update(answers);
    // --once shows the second round: the first has no rates yet.
    const bool show = !(args.once && round == 1);
    if (show) {
      if (args.json) {
        nlohmann::json j = view.to_json();
        j["subject"] = subject;
        std::cout << j.dump() << std::endl;
      } else {
        char every[32];
        std::snprintf(every, sizeof every, "%.1f s",
                      static_cast<double>(args.interval.count()) / 1000.0);
        const std::string title = "ferry-top: " + std::to_string(view.rows().size()) +
                                  " connector" + (view.rows().size() == 1 ? "" : "s") +
                                  " answering at '" + subject + "', every " + every + "    " +
                                  clock_text();
        std::string text = view.table(title, terminal_width());
        if (view.rows().empty())
          text += "\n(no connector answered within " + std::to_string(args.window.count()) +
                  " ms: none running, NatsOptions::answer_stats off, or another --prefix?)\n";
        if (tty && !args.once) std::cout << "\x1b[H\x1b[2J";
        std::cout << text << std::flush;
      }
      if (views > 0 && ++shown >= views) break;
    }
    while (!stopping && std::chrono::steady_clock::now() - started < args.interval)
      std::this_thread::sleep_for(20ms);
  }
  natsSubscription_Unsubscribe(sub);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse_args(argc, argv);
  } catch (const UsageError& e) {
    std::cerr << "ferry-top: " << e.what() << "\n" << kUsage;
    return 2;
  }
  struct sigaction sa {};
  sa.sa_handler = [](int) { stopping = true; };
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  try {
    const int rc = run(args);
    nats_Close();
    return rc;
  } catch (const std::exception& e) {
    std::cerr << "ferry-top: " << e.what() << "\n";
    return 1;
  }
}
