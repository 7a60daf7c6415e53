// The loop contract: embedded mode, callbacks on the loop thread, blocking refused there,
// calls from many threads.
#include <gtest/gtest.h>

#include <uv.h>

#include <atomic>
#include <future>
#include <optional>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>

#include "loop/event_loop.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;

TEST(EventLoop, CallRunsOnTheLoopThreadAndReturnsOrRethrows) {
  loop::EventLoop loop;
  std::thread::id here = std::this_thread::get_id();
  std::thread::id there = loop.call([] { return std::this_thread::get_id(); });
  EXPECT_NE(there, here);
  EXPECT_FALSE(loop.in_loop_thread());
  EXPECT_TRUE(loop.call([&] { return loop.in_loop_thread(); }));
  EXPECT_THROW(loop.call([]() -> int { throw Error(ErrorCode::Internal, "boom"); }), Error);
  loop.close(nullptr);
  EXPECT_FALSE(loop.post([] {}));
  try {
    loop.call([] { return 1; });
    ADD_FAILURE() << "call on a closed loop";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidState);
  }
}

// A call() posted while close() is under way either runs or throws InvalidState: before the
// fix, a task posted after the loop had taken close's batch was dropped with its promise still
// held by the caller, who then waited forever (seen from Python: a cancel racing close()).
TEST(EventLoop, CallsRacingCloseEndInsteadOfHanging) {
  for (int round = 0; round < 200; ++round) {
    loop::EventLoop loop;
    std::atomic<int> ended{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 3; ++t) {
      threads.emplace_back([&] {
        for (;;) {
          try {
            loop.call([] { return 1; });
          } catch (const Error& e) {
            EXPECT_EQ(e.code(), ErrorCode::InvalidState);
            break;
          }
        }
        ++ended;
      });
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200 + round % 7 * 50));
    loop.close(nullptr);
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (ended.load() < 3 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    // A caller still waiting here hangs for good: fail loudly (terminate on the joinable
    // threads) rather than hang the suite.
    ASSERT_EQ(ended.load(), 3) << "a call racing close() never returned, round " << round;
    for (auto& th : threads) th.join();
  }
}

TEST(EventLoop, DeferredTasksRunAfterTheCurrentOneInOrder) {
  loop::EventLoop loop;
  std::vector<int> order;
  loop.call([&] {
    loop.defer([&] { order.push_back(2); });
    loop.defer([&] { order.push_back(3); });
    order.push_back(1);
  });
  loop.call([] {});  // a full turn later
  loop.call([] {});
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
}

// Deferred work runs in the turn of the event that deferred it, and work it defers in turn
// runs in that same turn too: a completion never waits a loop iteration per step.
TEST(EventLoop, DeferredWorkRunsInTheSameTurnAsTheEventThatDeferredIt) {
  uv_loop_t uv;
  ASSERT_EQ(uv_loop_init(&uv), 0);
  int turns = 0;
  uv_prepare_t prepare;
  uv_prepare_init(&uv, &prepare);
  prepare.data = &turns;
  uv_prepare_start(&prepare, [](uv_prepare_t* p) { ++*static_cast<int*>(p->data); });
  uv_unref(reinterpret_cast<uv_handle_t*>(&prepare));
  {
    loop::EventLoop loop(&uv);
    int at_event = -1, at_first = -1, at_second = -1, at_timer_first = -1, at_timer = -1;
    // From an I/O callback (the loop's async handle runs in the poll phase).
    loop.post([&] {
      at_event = turns;
      loop.defer([&] {
        at_first = turns;
        loop.defer([&] { at_second = turns; });
      });
    });
    // From a timer (before the poll phase): the loop must not block before running it.
    uv_timer_t timer;
    uv_timer_init(&uv, &timer);
    struct Ctx {
      loop::EventLoop* loop;
      int* turns;
      int* at_timer;
      int* at_timer_first;
    } ctx{&loop, &turns, &at_timer, &at_timer_first};
    timer.data = &ctx;
    uv_timer_start(
        &timer,
        [](uv_timer_t* t) {
          auto* c = static_cast<Ctx*>(t->data);
          *c->at_timer = *c->turns;
          c->loop->defer([c] { *c->at_timer_first = *c->turns; });
        },
        5, 0);
    for (int i = 0; i < 200 && (at_second < 0 || at_timer_first < 0); ++i) uv_run(&uv, UV_RUN_ONCE);
    EXPECT_GE(at_event, 0);
    EXPECT_EQ(at_first, at_event);
    EXPECT_EQ(at_second, at_event);
    EXPECT_GE(at_timer, 0);
    EXPECT_LE(at_timer_first, at_timer + 1);  // prepare counts before this turn's poll
    uv_close(reinterpret_cast<uv_handle_t*>(&timer), nullptr);
    loop.close(nullptr);
  }
  uv_close(reinterpret_cast<uv_handle_t*>(&prepare), nullptr);
  uv_run(&uv, UV_RUN_DEFAULT);
  EXPECT_EQ(uv_loop_close(&uv), 0);
}

TEST(Threading, CompletionCallbacksRunOnTheLoopThread) {
  Connector owner(test::named("owner"));
  Connector peer(test::named("peer"));
  auto src = test::patterned(1 << 16, 7);
  auto dst = test::buffer(1 << 16);
  auto readable = owner.create_readable({Descriptor(src.data(), src.size())});
  std::promise<std::pair<std::thread::id, OperationStatus>> seen;
  auto read = peer.begin_read(readable.metadata(), {Descriptor(dst.data(), dst.size())});
  read.on_complete([&](OperationStatus s, const Error* e) {
    EXPECT_EQ(e, nullptr);
    seen.set_value({std::this_thread::get_id(), s});
  });
  auto [thread, status] = seen.get_future().get();
  EXPECT_NE(thread, std::this_thread::get_id());
  EXPECT_EQ(status, OperationStatus::complete);

  // Registered after the end, it still runs once, on the loop thread.
  std::promise<std::thread::id> late;
  read.on_complete(
      [&](OperationStatus, const Error*) { late.set_value(std::this_thread::get_id()); });
  EXPECT_EQ(late.get_future().get(), thread);
}

TEST(Threading, BlockingWaitOnTheLoopThreadIsRefused) {
  Connector owner(test::named("owner"));
  auto src = test::patterned(64, 1);
  auto first = owner.create_readable({Descriptor(src.data(), src.size())});
  auto second = owner.create_writable({Descriptor(src.data(), src.size())});
  std::promise<ErrorCode> refused;
  first.on_complete([&](OperationStatus, const Error*) {
    try {
      second.wait_for_completion();
      refused.set_value(ErrorCode::Internal);
    } catch (const Error& e) {
      refused.set_value(e.code());
    }
  });
  first.cancel();
  EXPECT_EQ(refused.get_future().get(), ErrorCode::WrongThread);
}

TEST(Threading, ErrorCallbackCarriesTheReason) {
  Connector owner(test::named("owner"));
  auto src = test::patterned(64, 1);
  auto readable = owner.create_readable({Descriptor(src.data(), src.size())});
  std::promise<std::pair<OperationStatus, ErrorCode>> seen;
  readable.on_complete([&](OperationStatus s, const Error* e) {
    seen.set_value({s, e != nullptr ? e->code() : ErrorCode::Internal});
  });
  readable.cancel();
  auto [status, code] = seen.get_future().get();
  EXPECT_EQ(status, OperationStatus::cancelled);
  EXPECT_EQ(code, ErrorCode::Cancelled);
}

TEST(Threading, ManyThreadsStartOperationsOnOneConnector) {
  Connector owner(test::named("owner"));
  Connector peer(test::named("peer"));
  constexpr int kThreads = 8;
  constexpr int kPerThread = 16;
  constexpr std::size_t kSize = 8192;
  std::atomic<int> verified{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        std::uint64_t seed = static_cast<std::uint64_t>(t * 1000 + i + 1);
        auto src = test::patterned(kSize, seed);
        auto dst = test::buffer(kSize);
        auto readable = owner.create_readable({Descriptor(src.data(), kSize)});
        auto read = peer.begin_read(readable.metadata(), {Descriptor(dst.data(), kSize)});
        if (read.wait_for_completion(30s) && readable.wait_for_completion(30s) &&
            test::first_mismatch(dst.data(), kSize, seed) == -1)
          ++verified;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(verified.load(), kThreads * kPerThread);
}

// Runs `loop` until `done` or until `limit` turns; the loop holds a timer so it never idles
// for long inside one turn.
template <class F>
bool run_until(uv_loop_t* loop, F done, int limit = 100000) {
  for (int i = 0; i < limit && !done(); ++i) uv_run(loop, UV_RUN_ONCE);
  return done();
}

TEST(Embedded, ConnectorOnACallerOwnedLoopCompletesTransfers) {
  uv_loop_t loop;
  ASSERT_EQ(uv_loop_init(&loop), 0);
  // A ticking timer of the caller's own, as an embedding worker would have.
  uv_timer_t tick;
  uv_timer_init(&loop, &tick);
  int ticks = 0;
  tick.data = &ticks;
  uv_timer_start(
      &tick, [](uv_timer_t* t) { ++*static_cast<int*>(t->data); }, 1, 1);

  Connector remote(test::named("remote"));
  auto src = test::patterned(1 << 20, 9);
  auto back = test::buffer(1 << 20);
  {
    ConnectorOptions options = test::named("embedded");
    options.loop = &loop;
    Connector embedded(options);
    auto dst = test::buffer(1 << 20);
    auto readable = remote.create_readable({Descriptor(src.data(), src.size())});
    auto read = embedded.begin_read(readable.metadata(), {Descriptor(dst.data(), dst.size())});
    bool called = false;
    read.on_complete(
        [&](OperationStatus s, const Error*) { called = s == OperationStatus::complete; });
    ASSERT_TRUE(run_until(&loop, [&] { return called; }));
    EXPECT_EQ(test::first_mismatch(dst.data(), dst.size(), 9), -1);

    // Blocking on the embedding thread would stall the loop: refused.
    EXPECT_THROW(read.wait_for_completion(), Error);

    // The other direction: the embedded connector serves a writable to a foreign peer, whose
    // thread blocks while this thread runs the loop.
    auto writable = embedded.create_writable({Descriptor(back.data(), back.size())});
    auto pushed = std::async(std::launch::async, [&] {
      auto write = remote.begin_write({Descriptor(src.data(), src.size())}, writable.metadata());
      return write.wait_for_completion(30s);
    });
    ASSERT_TRUE(run_until(&loop, [&] { return writable.status() == OperationStatus::complete; }));
    EXPECT_TRUE(pushed.get());
  }
  EXPECT_EQ(test::first_mismatch(back.data(), back.size(), 9), -1);
  EXPECT_GT(ticks, 0);
  uv_close(reinterpret_cast<uv_handle_t*>(&tick), nullptr);
  // Everything the connector opened closes within a few turns; then the loop is empty.
  uv_run(&loop, UV_RUN_DEFAULT);
  EXPECT_EQ(uv_loop_close(&loop), 0);
}

// A worker that makes its connector in main() and then runs the loop on a thread of its own.
// The calls main() makes go to the loop's thread: a deadline armed there fires, a transfer
// completes. (Before, the deadline timer was started from main() while another thread ran
// the loop; it never fired and create_readable's operation waited for ever.)
TEST(Embedded, AConnectorMadeOnOneThreadServesALoopRunOnAnother) {
  uv_loop_t loop;
  ASSERT_EQ(uv_loop_init(&loop), 0);
  std::atomic<bool> stop{false};
  uv_timer_t stopper;
  uv_timer_init(&loop, &stopper);
  stopper.data = &stop;
  uv_timer_start(
      &stopper,
      [](uv_timer_t* t) {
        if (static_cast<std::atomic<bool>*>(t->data)->load())
          uv_close(reinterpret_cast<uv_handle_t*>(t), nullptr);
      },
      1, 1);

  auto connector = std::make_unique<Connector>([&] {
    ConnectorOptions options = test::named("embedded");
    options.loop = &loop;
    return options;
  }());
  // The run ends once the connector is gone and the stopper has stopped.
  std::thread runner([&] { uv_run(&loop, UV_RUN_DEFAULT); });

  auto src = test::buffer(4096);
  const auto started = std::chrono::steady_clock::now();
  auto readable = connector->create_readable({Descriptor(src.data(), src.size())},
                                             OperationOptions{.timeout = 300ms, .subject = {}});
  try {
    (void)readable.wait_for_completion(10s);
    ADD_FAILURE() << "a readable nobody read completed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - started, 5s);

  Connector remote(test::named("remote"));
  auto data = test::patterned(1 << 20, 4);
  auto served = remote.create_readable({Descriptor(data.data(), data.size())});
  auto dst = test::buffer(1 << 20);
  auto read = connector->begin_read(served.metadata(), {Descriptor(dst.data(), dst.size())});
  EXPECT_TRUE(read.wait_for_completion(30s));
  EXPECT_EQ(test::first_mismatch(dst.data(), dst.size(), 4), -1);

  connector.reset();
  stop = true;
  runner.join();
  uv_run(&loop, UV_RUN_DEFAULT);
  EXPECT_EQ(uv_loop_close(&loop), 0);
}

// A connector attached to a loop that nobody runs: calls from any thread work (each acts as
// the loop's thread while it runs), but a blocking wait could never end. It is refused
// (WrongThread) within kFirstTurn, on every thread, instead of hanging.
TEST(Embedded, ABlockingWaitOnALoopNobodyRunsIsRefusedNotHung) {
  uv_loop_t loop;
  ASSERT_EQ(uv_loop_init(&loop), 0);
  {
    ConnectorOptions options = test::named("idle-loop");
    options.loop = &loop;
    Connector connector(options);
    auto src = test::buffer(4096);
    auto waited = [&](ReadableOperation& readable) -> std::optional<ErrorCode> {
      try {
        (void)readable.wait_for_completion(30s);
      } catch (const Error& e) {
        return e.code();
      }
      return std::nullopt;
    };
    auto elsewhere = std::async(std::launch::async, [&] {
      auto readable = connector.create_readable({Descriptor(src.data(), src.size())});
      EXPECT_EQ(readable.status(), OperationStatus::initialized);
      return waited(readable);
    });
    const auto started = std::chrono::steady_clock::now();
    ASSERT_EQ(elsewhere.wait_for(30s), std::future_status::ready) << "the wait hung";
    EXPECT_EQ(elsewhere.get(), std::optional(ErrorCode::WrongThread));
    EXPECT_LT(std::chrono::steady_clock::now() - started,
              loop::EventLoop::kFirstTurn + std::chrono::seconds(3));
    auto here = connector.create_readable({Descriptor(src.data(), src.size())});
    EXPECT_EQ(waited(here), std::optional(ErrorCode::WrongThread));
  }
  uv_run(&loop, UV_RUN_DEFAULT);
  EXPECT_EQ(uv_loop_close(&loop), 0);
}

TEST(Threading, HandlesThatOutliveTheirConnectorStillAnswer) {
  auto src = test::patterned(64, 1);
  ReadableOperation readable;
  {
    Connector owner(test::named("owner"));
    readable = owner.create_readable({Descriptor(src.data(), src.size())});
  }
  EXPECT_EQ(readable.status(), OperationStatus::cancelled);
  // The loop thread is gone; its id may be reused by a new thread, which must not be
  // mistaken for it.
  std::thread([&] {
    try {
      readable.wait_for_completion();
      ADD_FAILURE() << "a cancelled operation completed";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Cancelled) << e.what();
    }
  }).join();
  // With no loop left, the callback runs at once, on the calling thread.
  bool ran = false;
  readable.on_complete([&](OperationStatus s, const Error* e) {
    ran = s == OperationStatus::cancelled && e != nullptr;
  });
  EXPECT_TRUE(ran);
}

TEST(Threading, DroppingAHandleTheMomentItCompletesIsSafe) {
  // The waiter wakes on the final status and drops the last handle at once, while the loop
  // may still be finishing the operation (queueing its callbacks). Many rounds, with a
  // callback registered so that there is something to queue; ASan builds check the memory,
  // every build checks that no loop task failed.
  Connector owner(test::named("owner"));
  Connector writer(test::named("writer"));
  auto src = test::patterned(4096, 1);
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 300; ++i) {
    auto dst = test::buffer(4096);
    std::atomic<int> called{0};
    {
      auto writable = owner.create_writable({Descriptor(dst.data(), dst.size())});
      // Many callbacks: queueing them keeps the loop inside finish() a while.
      for (int c = 0; c < 200; ++c)
        writable.on_complete([&](OperationStatus, const Error*) { ++called; });
      auto write = writer.begin_write({Descriptor(src.data(), src.size())}, writable.metadata());
      writable.wait_for_completion();
    }  // the handle goes here, possibly while the loop is still inside finish()
    ASSERT_TRUE(test::eventually([&] { return called.load() == 200; }, std::chrono::seconds(5)));
  }
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

}  // namespace
}  // namespace ferry
