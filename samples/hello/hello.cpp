// ferry-hello: the smallest complete ferry program, in two processes.
//
//   ferry-hello serve [--size N]    creates a readable and a writable, prints their metadata
//                                   as one JSON line, waits until a peer has used both, and
//                                   verifies what the peer wrote
//   ferry-hello connect [FILE|-]    reads that line (from FILE or stdin), reads the readable,
//                                   writes the writable, and verifies what it read
//   ferry-hello                     runs both, as two processes joined by a pipe
//
// Exit status 0 only when every byte checked out on both sides.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <ferry/ferry.hpp>
#include <nlohmann/json.hpp>

namespace {

using namespace std::chrono_literals;

// What each side puts into its memory: the server's bytes for reading, the client's for
// writing. Both sides can recompute them to verify.
std::byte server_byte(std::size_t i) { return static_cast<std::byte>((i * 131 + 7) & 0xff); }
std::byte client_byte(std::size_t i) { return static_cast<std::byte>((i * 17 + 99) & 0xff); }

template <class F>
std::vector<std::byte> make(std::size_t size, F byte) {
  std::vector<std::byte> v(size);
  for (std::size_t i = 0; i < size; ++i) v[i] = byte(i);
  return v;
}

template <class F>
bool verify(const std::vector<std::byte>& v, F byte, const char* who) {
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (v[i] != byte(i)) {
      std::fprintf(stderr, "%s: byte %zu is wrong\n", who, i);
      return false;
    }
  }
  return true;
}

int serve(std::size_t size, std::ostream& out) {
  ferry::ConnectorOptions options;
  options.name = "hello-server";
  options.default_timeout = 60s;  // nobody comes: give up rather than wait forever
  ferry::Connector connector(options);

  auto readable_mem = make(size, server_byte);
  std::vector<std::byte> writable_mem(size);
  auto readable = connector.create_readable({ferry::Descriptor(readable_mem.data(), size)});
  auto writable = connector.create_writable({ferry::Descriptor(writable_mem.data(), size)});

  nlohmann::json line = {{"readable", nlohmann::json::parse(readable.metadata().to_json())},
                         {"writable", nlohmann::json::parse(writable.metadata().to_json())}};
  out << line.dump() << std::endl;
  std::fprintf(stderr, "server: exposed %zu bytes to read and %zu to write at %s\n", size, size,
               connector.endpoints().front().address.c_str());

  readable.wait_for_completion();
  std::fprintf(stderr, "server: the peer has read our bytes\n");
  writable.wait_for_completion();
  bool ok = verify(writable_mem, client_byte, "server");
  std::fprintf(stderr, "server: the peer wrote %zu bytes: %s\n", size, ok ? "verified" : "WRONG");
  return ok ? 0 : 1;
}

int connect(std::istream& in) {
  std::string text;
  if (!std::getline(in, text)) {
    std::fprintf(stderr, "client: no metadata line\n");
    return 2;
  }
  auto doc = nlohmann::json::parse(text);
  auto readable = ferry::RdmaMetadata::from_json(doc.at("readable").dump());
  auto writable = ferry::RdmaMetadata::from_json(doc.at("writable").dump());

  ferry::ConnectorOptions options;
  options.name = "hello-client";
  options.default_timeout = 60s;
  ferry::Connector connector(options);

  std::vector<std::byte> got(readable.total_size());
  auto start = std::chrono::steady_clock::now();
  auto read = connector.begin_read(readable, {ferry::Descriptor(got.data(), got.size())});
  read.wait_for_completion();
  auto read_us = std::chrono::duration_cast<std::chrono::microseconds>(
                     std::chrono::steady_clock::now() - start)
                     .count();
  bool ok = verify(got, server_byte, "client");
  std::fprintf(stderr, "client: read %zu bytes from %s in %lld us: %s\n", got.size(),
               readable.owner.name.c_str(), static_cast<long long>(read_us),
               ok ? "verified" : "WRONG");

  auto mine = make(writable.total_size(), client_byte);
  start = std::chrono::steady_clock::now();
  auto write = connector.begin_write({ferry::Descriptor(mine.data(), mine.size())}, writable);
  write.wait_for_completion();
  auto write_us = std::chrono::duration_cast<std::chrono::microseconds>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  std::fprintf(stderr, "client: wrote %zu bytes in %lld us (acknowledged by the peer)\n",
               mine.size(), static_cast<long long>(write_us));
  return ok ? 0 : 1;
}

// Both sides as child processes of this one, the server's stdout piped to the client's stdin.
int both(const char* self, const std::string& size) {
  int fds[2];
  if (pipe(fds) != 0) return 2;
  pid_t server = fork();
  if (server == 0) {
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    execl(self, self, "serve", "--size", size.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  pid_t client = fork();
  if (client == 0) {
    dup2(fds[0], STDIN_FILENO);
    close(fds[0]);
    close(fds[1]);
    execl(self, self, "connect", "-", static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fds[0]);
  close(fds[1]);
  int server_status = 0;
  int client_status = 0;
  waitpid(server, &server_status, 0);
  waitpid(client, &client_status, 0);
  bool ok = WIFEXITED(server_status) && WEXITSTATUS(server_status) == 0 &&
            WIFEXITED(client_status) && WEXITSTATUS(client_status) == 0;
  std::fprintf(stderr, "hello: %s\n", ok ? "both sides verified every byte" : "FAILED");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string mode = argc > 1 ? argv[1] : "";
    std::string size = "1048576";
    for (int i = 2; i + 1 < argc; ++i)
      if (std::strcmp(argv[i], "--size") == 0) size = argv[i + 1];
    if (mode == "serve") return serve(std::stoull(size), std::cout);
    if (mode == "connect") {
      if (argc > 2 && std::strcmp(argv[2], "-") != 0) {
        std::ifstream file(argv[2]);
        return connect(file);
      }
      return connect(std::cin);
    }
    if (mode.empty() || mode == "--size") {
      if (mode == "--size" && argc > 2) size = argv[2];
      return both("/proc/self/exe", size);
    }
    std::fprintf(stderr, "usage: %s [serve [--size N] | connect [FILE|-]]\n", argv[0]);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hello: %s\n", e.what());
    return 1;
  }
}
