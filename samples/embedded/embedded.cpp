// ferry-embedded: a worker that owns a libuv loop and embeds a ferry connector in it.
//
//   ferry-embedded                      runs a worker on this thread's loop, spawns a client
//                                       (this program, `client PORT`) from that loop, and stops
//                                       the worker cleanly once the client has exited
//   ferry-embedded worker               runs the worker alone, until SIGINT or SIGTERM
//   ferry-embedded client PORT [SIZE]   asks the worker at 127.0.0.1:PORT for a readable and a
//                                       writable of SIZE bytes, reads the one, writes the other
//
// The worker's loop is its own: a heartbeat timer, a TCP server with a line protocol of its
// own, signal handlers, the client process. The connector joins that loop
// (ConnectorOptions::loop) instead of starting a thread of its own: its listener, connections
// and timers are handles on the same loop, and its completion callbacks run between the
// worker's other callbacks, on the same thread. Nothing in the worker blocks.
//
// The worker's line protocol (requests may be pipelined on one connection):
//   client -> worker   read N      expose N bytes of a known pattern for the client to read
//                      write N     expose N bytes for the client to write
//   worker -> client   {...}       the new operation's metadata (RdmaMetadata JSON, one line)
//                      error TEXT  the request was refused
//                      done STATUS ID [TEXT]
//                                  operation ID (the metadata's notification_key) ended;
//                                  STATUS is ferry's (complete, cancelled, errored), or
//                                  "mismatch" for a writable whose bytes did not verify
//
// Only 127.0.0.1 is used. Exit status 0 only when every byte checked out on both sides and,
// for the worker, its loop closed with nothing left open.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>
#include <uv.h>

#include <array>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <ferry/ferry.hpp>

namespace {

using namespace std::chrono_literals;

constexpr std::size_t kDefaultSize = 1u << 20;
constexpr std::size_t kMaxSize = 64u << 20;   // the worker refuses larger requests
constexpr std::size_t kMaxLine = 256;         // longest request line the worker accepts
constexpr std::size_t kMaxReply = 64u << 10;  // longest reply line the client accepts
// Every operation, on either side, gives up after this: nothing waits forever.
constexpr std::chrono::milliseconds kOperationTimeout = 30s;
constexpr std::uint64_t kHeartbeatMs = 100;
constexpr std::uint64_t kClientDeadlineMs = 30'000;

// What each side puts into its memory: the worker's bytes for reading, the client's for
// writing. Both sides can recompute them to verify.
std::byte worker_byte(std::size_t i) { return static_cast<std::byte>((i * 131 + 7) & 0xff); }
std::byte client_byte(std::size_t i) { return static_cast<std::byte>((i * 17 + 99) & 0xff); }

void fill(std::vector<std::byte>& v, std::byte (*byte)(std::size_t)) {
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = byte(i);
}

// The first byte that differs from the pattern, if any.
std::optional<std::size_t> first_mismatch(const std::vector<std::byte>& v,
                                          std::byte (*byte)(std::size_t)) {
  for (std::size_t i = 0; i < v.size(); ++i)
    if (v[i] != byte(i)) return i;
  return std::nullopt;
}

// A decimal number that is all of `text`, within [low, high].
std::optional<std::size_t> parse_number(std::string_view text, std::size_t low, std::size_t high) {
  std::size_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < low || value > high)
    return std::nullopt;
  return value;
}

// ---------------------------------------------------------------------------------------------
// The worker: everything below runs on the one thread that runs the loop.

class Worker;

// One operation a client asked for, with the memory it exposes.
struct Job {
  ferry::OperationKind kind = ferry::OperationKind::unspecified;
  // Declared before `op`, so destroyed after it: the handle's destructor cancels an
  // operation that has not ended, and only then may its memory go.
  std::vector<std::byte> memory;
  ferry::Operation op;
};

// One client connection of the worker's TCP server. Owned by Worker::sessions_ until libuv
// has closed its handle; completion callbacks hold it only weakly, since an operation may end
// after its client has gone.
struct Session {
  Worker* worker = nullptr;
  uv_tcp_t tcp{};
  std::string peer;     // "127.0.0.1:port", for the log
  std::string pending;  // bytes received that do not make a whole line yet
  std::array<char, 4096> buffer{};
  bool closing = false;                              // uv_close was called: write nothing more
  std::map<std::string, std::unique_ptr<Job>> jobs;  // by operation id, until each ends

  uv_stream_t* stream() { return reinterpret_cast<uv_stream_t*>(&tcp); }
  uv_handle_t* handle() { return reinterpret_cast<uv_handle_t*>(&tcp); }
};

// A line on its way to a client; libuv needs the bytes until the write callback.
struct LineWrite {
  uv_write_t req{};
  std::string text;
};

struct Tally {
  std::uint64_t ticks = 0;
  int reads_served = 0;     // readables a client read to the end
  int writes_verified = 0;  // writables a client filled with the right bytes
  int mismatches = 0;       // writables completed with wrong bytes
  int other_endings = 0;    // operations cancelled or errored
  bool client_ran = false;
  std::int64_t client_exit = -1;
  int client_signal = 0;
  bool client_timed_out = false;
};

class Worker {
 public:
  explicit Worker(uv_loop_t* loop) : loop_(loop) {}
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Opens the worker's handles and its connector. Throws std::runtime_error or ferry::Error;
  // whatever was opened is closed by shutdown() all the same.
  void start();
  // Runs this program as `client PORT SIZE`, as a child process watched by the loop.
  void spawn_client(std::size_t size);
  // Makes uv_run return at the end of this turn. The worker's handles (and the connector's)
  // keep the loop alive, so it never runs out of work on its own.
  void request_stop() { uv_stop(loop_); }
  // Loop thread, with the loop stopped: closes every handle and destroys the connector. The
  // caller then runs the loop until it is empty, so that the closes complete.
  void shutdown();

  const Tally& tally() const { return tally_; }

 private:
  [[gnu::format(printf, 2, 3)]] void log(const char* format, ...);

  static void on_heartbeat(uv_timer_t* timer);
  static void on_connection(uv_stream_t* server, int status);
  static void on_alloc(uv_handle_t* handle, std::size_t suggested, uv_buf_t* buf);
  static void on_read(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buf);
  static void on_client_exit(uv_process_t* process, std::int64_t exit_status, int term_signal);
  static void on_client_deadline(uv_timer_t* timer);
  static void on_signal(uv_signal_t* handle, int signum);

  void handle_line(const std::shared_ptr<Session>& session, std::string_view line);
  void on_job_end(const std::weak_ptr<Session>& weak, const std::string& id,
                  ferry::OperationStatus status, const ferry::Error* error);
  void send(Session& session, std::string text);
  void close_session(Session& session);

  uv_loop_t* loop_;
  uv_timer_t heartbeat_{};
  uv_tcp_t server_{};
  uv_signal_t sigint_{};
  uv_signal_t sigterm_{};
  uv_process_t client_{};
  uv_timer_t client_deadline_{};
  bool client_running_ = false;
  bool stop_at_next_tick_ = false;
  std::uint16_t port_ = 0;
  std::optional<ferry::Connector> connector_;
  std::map<Session*, std::shared_ptr<Session>> sessions_;
  int live_jobs_ = 0;
  Tally tally_;
};

void Worker::log(const char* format, ...) {
  char text[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof text, format, args);
  va_end(args);
  std::fprintf(stderr, "worker [tick %3llu]: %s\n", static_cast<unsigned long long>(tally_.ticks),
               text);
}

template <class Handle>
uv_handle_t* as_handle(Handle* h) {
  return reinterpret_cast<uv_handle_t*>(h);
}

// Closes a handle that was initialized and is not closing or closed yet. A handle still
// zero-filled (never initialized) has type UV_UNKNOWN_HANDLE.
void close_if_open(uv_handle_t* h) {
  if (h->type != UV_UNKNOWN_HANDLE && !uv_is_closing(h)) uv_close(h, nullptr);
}

void check(int rc, const char* what) {
  if (rc != 0) throw std::runtime_error(std::string(what) + ": " + uv_strerror(rc));
}

void Worker::start() {
  // The worker's own business first: a heartbeat, and signals that stop it.
  check(uv_timer_init(loop_, &heartbeat_), "uv_timer_init");
  heartbeat_.data = this;
  check(uv_timer_start(&heartbeat_, &Worker::on_heartbeat, kHeartbeatMs, kHeartbeatMs),
        "uv_timer_start");
  for (auto [handle, signum] : {std::pair{&sigint_, SIGINT}, std::pair{&sigterm_, SIGTERM}}) {
    check(uv_signal_init(loop_, handle), "uv_signal_init");
    handle->data = this;
    check(uv_signal_start(handle, &Worker::on_signal, signum), "uv_signal_start");
  }

  // The connector, on the same loop. ferry takes the thread that constructs it to be the
  // loop's thread: this one, which runs uv_run below.
  ferry::ConnectorOptions options;
  options.name = "embedded-worker";
  options.loop = loop_;
  options.tcp.bind_address = "127.0.0.1";
  // Pairing is by explicit metadata over the worker's own protocol: no NATS, even if
  // FERRY_NATS_URL is set (it would also move the listener to the NATS interface).
  options.nats.use_environment = false;
  // A readable or writable that no client uses gives up rather than pin its memory forever.
  options.default_timeout = kOperationTimeout;
  connector_.emplace(options);

  // The worker's TCP server: 127.0.0.1, a free port.
  check(uv_tcp_init(loop_, &server_), "uv_tcp_init");
  server_.data = this;
  sockaddr_in addr{};
  check(uv_ip4_addr("127.0.0.1", 0, &addr), "uv_ip4_addr");
  check(uv_tcp_bind(&server_, reinterpret_cast<const sockaddr*>(&addr), 0), "uv_tcp_bind");
  check(uv_listen(reinterpret_cast<uv_stream_t*>(&server_), 16, &Worker::on_connection),
        "uv_listen");
  sockaddr_in bound{};
  int length = sizeof bound;
  check(uv_tcp_getsockname(&server_, reinterpret_cast<sockaddr*>(&bound), &length),
        "uv_tcp_getsockname");
  port_ = ntohs(bound.sin_port);
  log("listening on 127.0.0.1:%u (line protocol); ferry serves at %s", port_,
      connector_->endpoints().front().address.c_str());
}

void Worker::spawn_client(std::size_t size) {
  std::array<char, 4096> exe{};
  std::size_t exe_length = exe.size();
  check(uv_exepath(exe.data(), &exe_length), "uv_exepath");
  std::string mode = "client";
  std::string port = std::to_string(port_);
  std::string bytes = std::to_string(size);
  char* args[] = {exe.data(), mode.data(), port.data(), bytes.data(), nullptr};

  uv_stdio_container_t stdio[3];
  stdio[0].flags = UV_IGNORE;
  stdio[1].flags = UV_INHERIT_FD;
  stdio[1].data.fd = STDOUT_FILENO;
  stdio[2].flags = UV_INHERIT_FD;
  stdio[2].data.fd = STDERR_FILENO;
  uv_process_options_t options{};
  options.file = exe.data();
  options.args = args;
  options.exit_cb = &Worker::on_client_exit;
  options.stdio_count = 3;
  options.stdio = stdio;
  client_.data = this;
  // On failure the handle is initialized all the same; shutdown() closes it.
  check(uv_spawn(loop_, &client_, &options), "uv_spawn");
  client_running_ = true;
  tally_.client_ran = true;
  log("spawned the client, pid %d", client_.pid);

  // Bounded: a client that has not finished within the deadline is killed.
  check(uv_timer_init(loop_, &client_deadline_), "uv_timer_init");
  client_deadline_.data = this;
  check(uv_timer_start(&client_deadline_, &Worker::on_client_deadline, kClientDeadlineMs, 0),
        "uv_timer_start");
}

void Worker::shutdown() {
  // The worker's own handles.
  close_if_open(as_handle(&heartbeat_));
  close_if_open(as_handle(&sigint_));
  close_if_open(as_handle(&sigterm_));
  close_if_open(as_handle(&client_deadline_));
  close_if_open(as_handle(&server_));
  if (client_running_) {
    uv_process_kill(&client_, SIGKILL);
    client_running_ = false;
  }
  close_if_open(as_handle(&client_));
  // Connections still open: marked closing, so that the completion callbacks the connector's
  // destructor is about to run write nothing more to them.
  for (auto& [raw, session] : sessions_) close_session(*session);

  // The connector goes here, on the loop's thread, while the loop is stopped. Its destructor
  // cancels the operations that have not ended (their callbacks run right here) and closes
  // its listener, connections and internal handles with uv_close, which libuv allows only on
  // the loop's thread. From any other thread it would post that teardown to the loop and wait
  // for it, a deadlock unless something kept running the loop meanwhile. The closes complete
  // in the next turns of the loop, which the caller runs until it is empty.
  connector_.reset();
}

void Worker::on_heartbeat(uv_timer_t* timer) {
  auto* self = static_cast<Worker*>(timer->data);
  ++self->tally_.ticks;
  if (self->tally_.ticks % 10 == 0 || self->stop_at_next_tick_)
    self->log("heartbeat: %zu connection(s), %d operation(s) pending", self->sessions_.size(),
              self->live_jobs_);
  if (self->stop_at_next_tick_) self->request_stop();
}

void Worker::on_signal(uv_signal_t* handle, int signum) {
  auto* self = static_cast<Worker*>(handle->data);
  self->log("signal %d: stopping", signum);
  self->request_stop();
}

void Worker::on_client_exit(uv_process_t* process, std::int64_t exit_status, int term_signal) {
  auto* self = static_cast<Worker*>(process->data);
  self->client_running_ = false;
  self->tally_.client_exit = exit_status;
  self->tally_.client_signal = term_signal;
  self->log("the client exited with status %lld%s", static_cast<long long>(exit_status),
            term_signal != 0 ? " (killed by a signal)" : "");
  uv_close(as_handle(process), nullptr);
  // The worker stops at its next heartbeat: its own clock decides, not the client.
  self->stop_at_next_tick_ = true;
}

void Worker::on_client_deadline(uv_timer_t* timer) {
  auto* self = static_cast<Worker*>(timer->data);
  self->log("the client has not finished within %llu ms: killing it",
            static_cast<unsigned long long>(kClientDeadlineMs));
  self->tally_.client_timed_out = true;
  if (self->client_running_) uv_process_kill(&self->client_, SIGKILL);
  self->request_stop();
}

void Worker::on_connection(uv_stream_t* server, int status) {
  auto* self = static_cast<Worker*>(server->data);
  if (status < 0) {
    self->log("accept failed: %s", uv_strerror(status));
    return;
  }
  auto session = std::make_shared<Session>();
  session->worker = self;
  if (int rc = uv_tcp_init(self->loop_, &session->tcp); rc != 0) {
    self->log("uv_tcp_init: %s", uv_strerror(rc));
    return;
  }
  session->tcp.data = session.get();
  self->sessions_.emplace(session.get(), session);
  if (int rc = uv_accept(server, session->stream()); rc != 0) {
    self->log("accept failed: %s", uv_strerror(rc));
    self->close_session(*session);
    return;
  }
  sockaddr_in peer{};
  int length = sizeof peer;
  if (uv_tcp_getpeername(&session->tcp, reinterpret_cast<sockaddr*>(&peer), &length) == 0) {
    char ip[INET_ADDRSTRLEN] = {};
    uv_ip4_name(&peer, ip, sizeof ip);
    session->peer = std::string(ip) + ":" + std::to_string(ntohs(peer.sin_port));
  }
  self->log("client %s connected", session->peer.c_str());
  if (int rc = uv_read_start(session->stream(), &Worker::on_alloc, &Worker::on_read); rc != 0) {
    self->log("client %s: uv_read_start: %s", session->peer.c_str(), uv_strerror(rc));
    self->close_session(*session);
  }
}

void Worker::on_alloc(uv_handle_t* handle, std::size_t, uv_buf_t* buf) {
  // libuv reads one buffer at a time per stream: the session's own will do.
  auto* session = static_cast<Session*>(handle->data);
  *buf = uv_buf_init(session->buffer.data(), static_cast<unsigned>(session->buffer.size()));
}

void Worker::on_read(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buf) {
  auto* raw = static_cast<Session*>(stream->data);
  Worker* self = raw->worker;
  // Held for the duration: handle_line may close the session.
  std::shared_ptr<Session> session = self->sessions_.at(raw);
  if (nread < 0) {
    if (nread != UV_EOF)
      self->log("client %s: %s", session->peer.c_str(), uv_strerror(static_cast<int>(nread)));
    else
      self->log("client %s disconnected", session->peer.c_str());
    self->close_session(*session);
    return;
  }
  session->pending.append(buf->base, static_cast<std::size_t>(nread));
  std::size_t newline;
  while (!session->closing && (newline = session->pending.find('\n')) != std::string::npos) {
    std::string line = session->pending.substr(0, newline);
    session->pending.erase(0, newline + 1);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    self->handle_line(session, line);
  }
  if (!session->closing && session->pending.size() > kMaxLine) {
    self->log("client %s: line too long, closing", session->peer.c_str());
    self->send(*session, "error line too long\n");
    self->close_session(*session);
  }
}

void Worker::handle_line(const std::shared_ptr<Session>& session, std::string_view line) {
  const std::size_t space = line.find(' ');
  const std::string_view verb = line.substr(0, space);
  // 0: no valid size (a valid one is at least 1).
  std::size_t size = 0;
  if (space != std::string_view::npos)
    size = parse_number(line.substr(space + 1), 1, kMaxSize).value_or(0);
  if ((verb != "read" && verb != "write") || size == 0) {
    send(*session,
         "error expected 'read N' or 'write N' with 1 <= N <= " + std::to_string(kMaxSize) + "\n");
    return;
  }
  try {
    auto job = std::make_unique<Job>();
    job->memory.resize(size);
    std::string metadata;
    const std::vector<ferry::Descriptor> local{ferry::Descriptor(job->memory.data(), size)};
    // On the loop thread, so these calls run inline: nothing here waits.
    if (verb == "read") {
      job->kind = ferry::OperationKind::read;
      fill(job->memory, worker_byte);
      auto readable = connector_->create_readable(local);
      metadata = readable.metadata().to_json();
      job->op = std::move(readable);
    } else {
      job->kind = ferry::OperationKind::write;
      auto writable = connector_->create_writable(local);
      metadata = writable.metadata().to_json();
      job->op = std::move(writable);
    }
    const std::string id = job->op.id();
    // The callback runs later on this same thread; it must not block (wait_for_completion
    // here would throw WrongThread). It holds the session weakly: the client may be gone.
    job->op.on_complete([this, weak = std::weak_ptr<Session>(session), id](
                            ferry::OperationStatus status, const ferry::Error* error) {
      on_job_end(weak, id, status, error);
    });
    session->jobs.emplace(id, std::move(job));
    ++live_jobs_;
    log("client %s: %.*s %zu bytes -> %s %s", session->peer.c_str(), static_cast<int>(verb.size()),
        verb.data(), size, verb == "read" ? "readable" : "writable", id.c_str());
    send(*session, metadata + "\n");
  } catch (const std::exception& e) {
    log("client %s: refused '%.*s': %s", session->peer.c_str(), static_cast<int>(line.size()),
        line.data(), e.what());
    send(*session, std::string("error ") + e.what() + "\n");
  }
}

void Worker::on_job_end(const std::weak_ptr<Session>& weak, const std::string& id,
                        ferry::OperationStatus status, const ferry::Error* error) {
  --live_jobs_;
  std::string word(ferry::to_string(status));
  std::string detail = error != nullptr ? error->what() : "";
  std::shared_ptr<Session> session = weak.lock();
  std::unique_ptr<Job> job;
  if (session) {
    if (auto it = session->jobs.find(id); it != session->jobs.end()) {
      job = std::move(it->second);
      session->jobs.erase(it);
    }
  }
  if (status != ferry::OperationStatus::complete) {
    ++tally_.other_endings;
    log("operation %s ended %s%s: %s", id.c_str(), word.c_str(),
        session ? "" : " (its client had left)", detail.c_str());
  } else if (!job) {
    // The client left between the completion and this callback (which runs a turn later):
    // its session, and the job's memory with it, are gone already.
    log("operation %s completed, but its client has left", id.c_str());
  } else if (job->kind == ferry::OperationKind::read) {
    ++tally_.reads_served;
    log("client %s has read readable %s (%zu bytes)", session->peer.c_str(), id.c_str(),
        job->memory.size());
  } else if (auto bad = first_mismatch(job->memory, client_byte)) {
    ++tally_.mismatches;
    word = "mismatch";
    detail = "byte " + std::to_string(*bad) + " is wrong";
    log("client %s wrote writable %s: %s", session->peer.c_str(), id.c_str(), detail.c_str());
  } else {
    ++tally_.writes_verified;
    log("client %s wrote writable %s (%zu bytes): verified", session->peer.c_str(), id.c_str(),
        job->memory.size());
  }
  // `job` goes at the end of this scope: its operation has ended, so its memory is free.
  if (session && !session->closing)
    send(*session, "done " + word + " " + id + (detail.empty() ? "" : " " + detail) + "\n");
}

void Worker::send(Session& session, std::string text) {
  if (session.closing) return;
  auto* write = new LineWrite;
  write->text = std::move(text);
  write->req.data = write;
  uv_buf_t buf = uv_buf_init(write->text.data(), static_cast<unsigned>(write->text.size()));
  // A write still queued when the session closes is called back with UV_ECANCELED; the
  // request owns its bytes and needs nothing of the session.
  int rc = uv_write(&write->req, session.stream(), &buf, 1,
                    [](uv_write_t* req, int) { delete static_cast<LineWrite*>(req->data); });
  if (rc != 0) {
    delete write;
    log("client %s: write failed: %s", session.peer.c_str(), uv_strerror(rc));
    close_session(session);
  }
}

void Worker::close_session(Session& session) {
  if (session.closing) return;
  session.closing = true;
  uv_close(session.handle(), [](uv_handle_t* handle) {
    // The last reference: the session's jobs go with it, and the destructor of each handle
    // cancels an operation the client left unused (its callback then finds no session).
    auto* raw = static_cast<Session*>(handle->data);
    raw->worker->sessions_.erase(raw);
  });
}

// Runs a worker on a loop of this thread's; with `client_size`, also a client process.
int run_worker(std::optional<std::size_t> client_size) {
  uv_loop_t loop;
  if (int rc = uv_loop_init(&loop); rc != 0) {
    std::fprintf(stderr, "worker: uv_loop_init: %s\n", uv_strerror(rc));
    return 1;
  }
  bool started = true;
  Tally tally;
  {
    Worker worker(&loop);
    try {
      worker.start();
      if (client_size) worker.spawn_client(*client_size);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "worker: %s\n", e.what());
      started = false;
    }
    if (started) uv_run(&loop, UV_RUN_DEFAULT);  // until request_stop()
    worker.shutdown();
    // The handles closed above, the connector's included, finish closing; then the loop has
    // nothing left and uv_run returns by itself.
    uv_run(&loop, UV_RUN_DEFAULT);
    tally = worker.tally();
  }
  const int close_rc = uv_loop_close(&loop);
  std::fprintf(
      stderr, "worker: %llu heartbeats; %d read(s) served, %d write(s) verified; loop %s\n",
      static_cast<unsigned long long>(tally.ticks), tally.reads_served, tally.writes_verified,
      close_rc == 0 ? "closed cleanly" : "still had open handles (uv_loop_close failed)");
  if (!client_size) return started && close_rc == 0 && tally.mismatches == 0 ? 0 : 1;

  const bool client_ok = tally.client_ran && !tally.client_timed_out && tally.client_exit == 0 &&
                         tally.client_signal == 0;
  const bool ok = started && client_ok && close_rc == 0 && tally.reads_served >= 1 &&
                  tally.writes_verified >= 1 && tally.mismatches == 0 && tally.other_endings == 0 &&
                  tally.ticks >= 1;
  if (ok) {
    std::fprintf(stderr,
                 "embedded: one loop ran the worker's timer, its TCP server and the embedded "
                 "connector; every byte verified on both sides\n");
    return 0;
  }
  std::fprintf(stderr,
               "embedded: FAILED (client %s, exit status %lld; %d mismatched write(s), %d "
               "operation(s) cancelled or errored)\n",
               !tally.client_ran        ? "not started"
               : tally.client_timed_out ? "timed out"
                                        : "finished",
               static_cast<long long>(tally.client_exit), tally.mismatches, tally.other_endings);
  return 1;
}

// ---------------------------------------------------------------------------------------------
// The client: an ordinary program with an owned-mode connector and blocking sockets.

// A blocking TCP connection to the worker, read and written a line at a time, with timeouts
// so that nothing blocks forever.
class LineSocket {
 public:
  explicit LineSocket(std::uint16_t port) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "socket");
    timeval timeout{};
    timeout.tv_sec = std::chrono::duration_cast<std::chrono::seconds>(kOperationTimeout).count();
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
      int error = errno;
      ::close(fd_);
      throw std::system_error(error, std::generic_category(),
                              "connect to 127.0.0.1:" + std::to_string(port));
    }
  }
  ~LineSocket() { ::close(fd_); }
  LineSocket(const LineSocket&) = delete;
  LineSocket& operator=(const LineSocket&) = delete;

  void send_line(const std::string& line) {
    std::string text = line + "\n";
    std::size_t sent = 0;
    while (sent < text.size()) {
      // MSG_NOSIGNAL: a worker that has gone away is an error here, not a SIGPIPE.
      ssize_t n = ::send(fd_, text.data() + sent, text.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw std::system_error(errno, std::generic_category(), "send to the worker");
      sent += static_cast<std::size_t>(n);
    }
  }

  std::string read_line() {
    for (;;) {
      if (auto newline = buffered_.find('\n'); newline != std::string::npos) {
        std::string line = buffered_.substr(0, newline);
        buffered_.erase(0, newline + 1);
        return line;
      }
      if (buffered_.size() > kMaxReply) throw std::runtime_error("the worker's line is too long");
      char chunk[4096];
      ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        throw std::runtime_error("the worker did not answer in time");
      if (n < 0) throw std::system_error(errno, std::generic_category(), "recv from the worker");
      if (n == 0) throw std::runtime_error("the worker closed the connection");
      buffered_.append(chunk, static_cast<std::size_t>(n));
    }
  }

 private:
  int fd_;
  std::string buffered_;
};

// Asks the worker for an operation; returns its metadata. Throws on "error ...".
ferry::RdmaMetadata ask(LineSocket& worker, const std::string& request) {
  worker.send_line(request);
  std::string reply = worker.read_line();
  if (reply.rfind("error", 0) == 0)
    throw std::runtime_error("the worker refused '" + request + "': " + reply);
  return ferry::RdmaMetadata::from_json(reply);
}

// Waits for the worker's "done" line about operation `id`; true if it reads "complete".
bool expect_done(LineSocket& worker, const std::string& id) {
  const std::string line = worker.read_line();
  const std::string want = "done complete " + id;
  if (line != want) {
    std::fprintf(stderr, "client: expected '%s', the worker said '%s'\n", want.c_str(),
                 line.c_str());
    return false;
  }
  std::fprintf(stderr, "client: the worker confirms: %s\n", line.c_str());
  return true;
}

long long micros_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                               start)
      .count();
}

int run_client(std::uint16_t port, std::size_t size) {
  ferry::ConnectorOptions options;
  options.name = "embedded-client";
  options.tcp.bind_address = "127.0.0.1";
  options.nats.use_environment = false;
  options.default_timeout = kOperationTimeout;
  ferry::Connector connector(options);  // owned mode: ferry runs its loop on a thread of its own
  LineSocket worker(port);
  bool ok = true;

  // Read the worker's bytes.
  const ferry::RdmaMetadata readable = ask(worker, "read " + std::to_string(size));
  std::vector<std::byte> got(size);
  auto start = std::chrono::steady_clock::now();
  auto read = connector.begin_read(readable, {ferry::Descriptor(got.data(), got.size())});
  if (!read.wait_for_completion(kOperationTimeout)) {
    std::fprintf(stderr, "client: the read did not finish in time\n");
    return 1;
  }
  const long long read_us = micros_since(start);
  const auto bad_read = first_mismatch(got, worker_byte);
  std::fprintf(stderr, "client: read %zu bytes from %s in %lld us: %s\n", got.size(),
               readable.owner.name.c_str(), read_us, bad_read ? "WRONG" : "verified");
  ok = !bad_read && ok;
  ok = expect_done(worker, readable.notification_key) && ok;

  // Write ours into the worker's memory.
  const ferry::RdmaMetadata writable = ask(worker, "write " + std::to_string(size));
  std::vector<std::byte> mine(size);
  fill(mine, client_byte);
  start = std::chrono::steady_clock::now();
  auto write = connector.begin_write({ferry::Descriptor(mine.data(), mine.size())}, writable);
  if (!write.wait_for_completion(kOperationTimeout)) {
    std::fprintf(stderr, "client: the write did not finish in time\n");
    return 1;
  }
  std::fprintf(stderr, "client: wrote %zu bytes to %s in %lld us\n", mine.size(),
               writable.owner.name.c_str(), micros_since(start));
  ok = expect_done(worker, writable.notification_key) && ok;

  std::fprintf(stderr, "client: %s\n", ok ? "all verified" : "FAILED");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (argc == 1) return run_worker(kDefaultSize);
    if (mode == "worker" && argc == 2) return run_worker(std::nullopt);
    if (mode == "client" && (argc == 3 || argc == 4)) {
      const auto port = parse_number(argv[2], 1, 65535);
      const auto size = argc == 4 ? parse_number(argv[3], 1, kMaxSize) : kDefaultSize;
      if (port && size) return run_client(static_cast<std::uint16_t>(*port), *size);
    }
    std::fprintf(stderr, "usage: %s [worker | client PORT [SIZE]]\n", argv[0]);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "embedded: %s\n", e.what());
    return 1;
  }
}
