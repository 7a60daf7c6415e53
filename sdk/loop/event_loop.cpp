#include "loop/event_loop.hpp"

#include "loop/uv_handle.hpp"

#include <exception>
#include <utility>

namespace ferry::loop {

// State shared between the EventLoop object and, in owned mode, its thread: the thread
// keeps it alive so that a connector destroyed from its own loop thread (where it cannot
// join) still leaves the loop intact until uv_run returns.
struct EventLoop::Shared {
  uv_loop_t own_loop{};
  uv_loop_t* loop = nullptr;
  uv_async_t* async = nullptr;
  uv_idle_t* idle = nullptr;        // active while work is deferred: the loop must not block
  uv_check_t* check = nullptr;      // runs deferred work right after the turn's I/O
  uv_prepare_t* prepare = nullptr;  // embedded: learns, every turn, which thread runs the loop
  std::atomic<std::thread::id> loop_thread{};
  std::atomic<bool> turned{false};
  // Embedded, until the loop first turns: held by whichever thread acts as the loop's, and
  // taken by the first turn before it claims the loop.
  std::recursive_mutex first_turn;
  Log log;

  std::mutex mu;
  std::vector<Task> queue;  // guarded by mu
  bool closing = false;     // guarded by mu
  bool closed = false;      // guarded by mu; once set, async must not be touched

  std::vector<Task> deferred;  // loop thread only
  bool armed = false;          // loop thread only: idle and check started
};

namespace {

void run_guarded(const Log& log, const EventLoop::Task& task) {
  // Exceptions must not unwind through libuv's C frames; call() tasks capture their own.
  try {
    task();
  } catch (const std::exception& e) {
    log.error(std::string("a loop task failed: ") + e.what());
  } catch (...) {
    log.error("a loop task failed");
  }
}

}  // namespace

EventLoop::EventLoop(uv_loop_t* external, Log log) : shared_(std::make_shared<Shared>()) {
  Shared& s = *shared_;
  s.log = std::move(log);
  embedded_ = external != nullptr;
  if (embedded_) {
    s.loop = external;
  } else {
    if (int rc = uv_loop_init(&s.own_loop); rc != 0)
      throw Error(ErrorCode::Internal, std::string("uv_loop_init: ") + uv_strerror(rc));
    s.loop = &s.own_loop;
  }
  loop_ = s.loop;

  s.async = new uv_async_t{};
  uv_async_init(s.loop, s.async, &EventLoop::on_async);
  s.async->data = &s;
  s.idle = new uv_idle_t{};
  uv_idle_init(s.loop, s.idle);
  s.idle->data = &s;
  s.check = new uv_check_t{};
  uv_check_init(s.loop, s.check);
  s.check->data = &s;

  if (embedded_) {
    // The caller may run its loop on another thread than this one: the loop says which, at
    // every turn (a prepare handle wakes nobody; unreferenced, it keeps no loop alive).
    s.prepare = new uv_prepare_t{};
    uv_prepare_init(s.loop, s.prepare);
    s.prepare->data = &s;
    uv_prepare_start(s.prepare, &EventLoop::on_prepare);
    uv_unref(reinterpret_cast<uv_handle_t*>(s.prepare));
    s.loop_thread.store(std::this_thread::get_id());
    return;
  }
  thread_ = std::thread([keep = shared_] {
    uv_run(keep->loop, UV_RUN_DEFAULT);
    if (uv_loop_close(keep->loop) != 0)
      keep->log.error("the event loop closed with handles still open");
  });
  s.loop_thread.store(thread_.get_id());
}

EventLoop::~EventLoop() {
  close(nullptr);
  if (thread_.joinable()) thread_.join();
}

const Log& EventLoop::log() const noexcept { return shared_->log; }

bool EventLoop::in_loop_thread() const noexcept {
  return shared_->loop_thread.load(std::memory_order_relaxed) == std::this_thread::get_id();
}

Error EventLoop::closed_error() {
  return Error(ErrorCode::InvalidState, "the connector is closed");
}

bool EventLoop::turned() const noexcept { return shared_->turned.load(std::memory_order_acquire); }

bool EventLoop::enter(Hold& hold) const {
  if (!embedded_ || turned()) return in_loop_thread();
  hold = Hold(shared_->first_turn);
  if (turned()) return in_loop_thread();
  // Nobody has run the loop yet: this thread acts as its thread until someone does.
  shared_->loop_thread.store(std::this_thread::get_id(), std::memory_order_relaxed);
  return true;
}

bool EventLoop::may_block() const {
  if (!embedded_ || turned()) return !in_loop_thread();
  // Embedded and never run: another thread may be about to run the loop (then blocking is
  // right, off that thread), or nobody will (then it would wait for ever). Give the first a
  // moment to show itself.
  const auto until = std::chrono::steady_clock::now() + kFirstTurn;
  while (!turned() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (!turned())
    throw Error(ErrorCode::WrongThread,
                "the connector's loop (ConnectorOptions::loop) has never run: a blocking wait "
                "would wait for ever; run the loop, or use on_complete()");
  return !in_loop_thread();
}

void EventLoop::on_prepare(uv_prepare_t* handle) {
  auto& s = *static_cast<Shared*>(handle->data);
  if (s.turned.load(std::memory_order_relaxed)) {
    s.loop_thread.store(std::this_thread::get_id(), std::memory_order_relaxed);
    return;
  }
  // The first turn: wait for a thread acting as the loop's to finish, then claim the loop.
  std::lock_guard hold(s.first_turn);
  s.loop_thread.store(std::this_thread::get_id(), std::memory_order_relaxed);
  s.turned.store(true, std::memory_order_release);
}

bool EventLoop::post(Task task) { return Poster(shared_).post(std::move(task)); }

bool EventLoop::Poster::post(Task task) const {
  if (!shared_) return false;
  Shared& s = *shared_;
  std::lock_guard lock(s.mu);
  if (s.closed) return false;
  s.queue.push_back(std::move(task));
  // Under the lock: close() marks `closed` under it before closing the async handle.
  uv_async_send(s.async);
  return true;
}

void EventLoop::defer(Task task) {
  Shared& s = *shared_;
  if (s.check == nullptr) {
    // Closed: no later turn will come; run it now.
    run_guarded(s.log, task);
    return;
  }
  s.deferred.push_back(std::move(task));
  if (!s.armed) {
    // The check handle runs the work after this turn's I/O callbacks. The idle handle only
    // keeps the loop from blocking in poll when the work was deferred before it (from a timer
    // or an idle callback), so that it still runs in this turn.
    uv_check_start(s.check, &EventLoop::on_check);
    uv_idle_start(s.idle, [](uv_idle_t*) {});
    s.armed = true;
  }
}

void EventLoop::run_deferred(Shared& s) {
  // Work deferred by deferred work runs here too: one completion never waits a turn for the
  // next step. Bounded, so that work that keeps deferring itself cannot starve the loop's I/O.
  for (int round = 0; round < 64 && !s.deferred.empty(); ++round) {
    std::vector<Task> tasks;
    tasks.swap(s.deferred);
    for (auto& task : tasks) run_guarded(s.log, task);
  }
}

void EventLoop::on_async(uv_async_t* handle) {
  auto& s = *static_cast<Shared*>(handle->data);
  s.loop_thread.store(std::this_thread::get_id(), std::memory_order_relaxed);
  std::vector<Task> tasks;
  {
    std::lock_guard lock(s.mu);
    tasks.swap(s.queue);
  }
  for (auto& task : tasks) run_guarded(s.log, task);
}

void EventLoop::on_check(uv_check_t* handle) {
  auto& s = *static_cast<Shared*>(handle->data);
  s.loop_thread.store(std::this_thread::get_id(), std::memory_order_relaxed);
  run_deferred(s);
  if (s.deferred.empty() && s.armed) {
    uv_check_stop(s.check);
    uv_idle_stop(s.idle);
    s.armed = false;
  }
}

void EventLoop::close(Task teardown) {
  std::shared_ptr<Shared> s = shared_;
  auto done = std::make_shared<std::promise<void>>();
  auto finished = done->get_future();
  Task finish = [s, done, teardown = std::move(teardown)] {
    if (teardown) run_guarded(s->log, teardown);
    // Callbacks of the operations the teardown ended still run, here, on the loop thread.
    while (!s->deferred.empty()) run_deferred(*s);
    std::vector<Task> dropped;
    {
      std::lock_guard lock(s->mu);
      s->closed = true;
      dropped.swap(s->queue);
    }
    dropped.clear();  // unblocks call()ers with InvalidState
    close_and_delete(s->async);
    close_and_delete(s->idle);
    close_and_delete(s->check);
    close_and_delete(s->prepare);
    s->prepare = nullptr;
    s->async = nullptr;
    s->idle = nullptr;
    s->check = nullptr;
    s->armed = false;
    // The thread may end and its id be reused by another: it is nobody's loop thread now.
    s->loop_thread.store(std::thread::id{});
    done->set_value();
  };

  Hold hold;
  const bool here = enter(hold);
  {
    std::lock_guard lock(s->mu);
    if (s->closing) return;
    s->closing = true;
    if (!here) {
      s->queue.push_back(std::move(finish));
      uv_async_send(s->async);
    }
  }
  if (here) {
    finish();
    // Owned mode, closing from the loop thread itself: the thread cannot join itself; it
    // finishes uv_run on its own and releases the shared state.
    if (thread_.joinable()) thread_.detach();
    return;
  }
  if (!embedded_) {
    thread_.join();
    return;
  }
  finished.wait();
}

}  // namespace ferry::loop
