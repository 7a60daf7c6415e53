#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ferry/connector.hpp>

#include "tests/support/child_process.hpp"

namespace ferry::test {

/// A free TCP port on 127.0.0.1 (bound and released; another process may take it meanwhile,
/// which only makes a test fail loudly).
std::uint16_t free_port();

/// A private nats-server on 127.0.0.1, owned by the test: started in the constructor, killed
/// and reaped in the destructor. Its log goes to a file beside the test's working directory.
class NatsServer {
 public:
  struct Options {
    std::uint16_t port = 0;         ///< 0: a free one
    std::vector<std::string> args;  ///< more command-line arguments
    std::string config;             ///< text of a configuration file, if any
  };
  explicit NatsServer(Options options);
  NatsServer() : NatsServer(Options{}) {}
  ~NatsServer();

  std::uint16_t port() const noexcept { return options_.port; }
  std::string url() const { return "nats://127.0.0.1:" + std::to_string(options_.port); }
  /// Kills it (SIGKILL) and waits for it to exit.
  void kill();
  /// Starts it again, on the same port.
  void start();
  bool running() const noexcept { return process_ != nullptr; }

 private:
  Options options_;
  std::string config_path_;
  std::string log_path_;
  std::unique_ptr<ChildProcess> process_;
};

/// Options of a connector named `name` that uses the servers at `urls`.
ConnectorOptions nats_options(std::string name, std::vector<std::string> urls);

}  // namespace ferry::test
