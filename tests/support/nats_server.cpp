#include "tests/support/nats_server.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>

namespace ferry::test {

namespace {

bool accepts(std::uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

}  // namespace

std::uint16_t free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    throw std::runtime_error("cannot bind a free port");
  }
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

NatsServer::NatsServer(Options options) : options_(std::move(options)) {
  if (options_.port == 0) options_.port = free_port();
  // In the temporary directory, never the working directory: a test killed before its
  // destructor runs must not leave files in the tree it was started from.
  std::string base = (std::filesystem::temp_directory_path() /
                      ("ferry-nats-" + std::to_string(::getpid()) + "-" +
                       std::to_string(options_.port)))
                         .string();
  log_path_ = base + ".log";
  if (!options_.config.empty()) {
    config_path_ = base + ".conf";
    std::ofstream(config_path_) << options_.config;
  }
  start();
}

NatsServer::~NatsServer() {
  kill();
  if (!config_path_.empty()) std::remove(config_path_.c_str());
  std::remove(log_path_.c_str());
}

void NatsServer::start() {
  if (process_) return;
  std::vector<std::string> argv{"/usr/sbin/nats-server",       "-a", "127.0.0.1", "-p",
                                std::to_string(options_.port), "-l", log_path_};
  if (!config_path_.empty()) {
    argv.push_back("-c");
    argv.push_back(config_path_);
  }
  argv.insert(argv.end(), options_.args.begin(), options_.args.end());
  process_ = std::make_unique<ChildProcess>(argv);
  // Ready once it accepts connections; bounded, so a server that cannot start fails the test.
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!accepts(options_.port)) {
    if (std::chrono::steady_clock::now() > until)
      throw std::runtime_error("nats-server did not come up on port " +
                               std::to_string(options_.port) + "; see " + log_path_);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void NatsServer::kill() {
  if (!process_) return;
  process_->kill(SIGKILL);
  process_->wait();
  process_.reset();
}

ConnectorOptions nats_options(std::string name, std::vector<std::string> urls) {
  ConnectorOptions o;
  o.name = std::move(name);
  o.nats.servers = std::move(urls);
  o.nats.use_environment = false;
  o.nats.reconnect_wait = std::chrono::milliseconds(100);
  return o;
}

}  // namespace ferry::test
