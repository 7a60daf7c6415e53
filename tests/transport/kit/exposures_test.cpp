// transport/kit/exposures.hpp: the bookkeeping every transport shares. Observer calls are
// deferred, never made after revoke(), clear() or destruction; coverage counts each byte once.
#include "transport/kit/exposures.hpp"

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ferry::transport::kit {
namespace {

/// Deferred work, run when the test says.
struct Queue {
  std::vector<std::function<void()>> tasks;
  transport::Defer defer() {
    return [this](std::function<void()> t) { tasks.push_back(std::move(t)); };
  }
  void run() {
    while (!tasks.empty()) {
      auto batch = std::move(tasks);
      tasks.clear();
      for (auto& t : batch) t();
    }
  }
};

struct Recorder : ExposureObserver {
  std::vector<std::string> calls;
  std::optional<Claim> claim;
  std::optional<Error> error;
  void on_claimed(const Claim& c) override {
    calls.push_back("claimed");
    claim = c;
  }
  void on_peer_finished(const std::string& peer, const std::optional<Error>& e) override {
    calls.push_back("finished:" + peer + (e ? ":" + std::string(to_string(e->code())) : ""));
    error = e;
  }
  void on_peer_lost(const Error& e) override {
    calls.push_back("lost");
    error = e;
  }
};

class ExposuresTest : public ::testing::Test {
 protected:
  Exposure exposure(std::uint64_t id, Access access, std::uint64_t size = 8192) {
    Exposure e;
    e.id = id;
    e.token = random_token();
    e.access = access;
    e.regions = {Region{memory_.data(), size, MemoryKind::host}};
    return e;
  }
  std::uint64_t base() const { return reinterpret_cast<std::uint64_t>(memory_.data()); }

  std::vector<std::byte> memory_ = std::vector<std::byte>(65536);
  Queue queue_;
  Exposures exposures_{"test", queue_.defer()};
};

TEST_F(ExposuresTest, ClaimIsToldLaterAndOnlyOnce) {
  Recorder r;
  const Exposure e = exposure(1, Access::read);
  exposures_.add(e, r);
  auto* entry = exposures_.find(1);
  ASSERT_NE(entry, nullptr);
  auto secret = exposures_.claim(*entry, 7, "peer", "'peer' at somewhere", "00000000000000aa");
  ASSERT_TRUE(secret.has_value());
  EXPECT_FALSE(tokens_equal(*secret, e.token));
  EXPECT_TRUE(r.calls.empty()) << "the observer was called from inside the transport's call";
  EXPECT_FALSE(exposures_.claim(*entry, 7, "peer", "again", "").has_value());
  EXPECT_FALSE(exposures_.claim(*entry, 8, "other", "other", "").has_value());
  queue_.run();
  ASSERT_EQ(r.calls, (std::vector<std::string>{"claimed"}));
  EXPECT_EQ(r.claim->method, "test");
  EXPECT_EQ(r.claim->peer, "'peer' at somewhere");
  EXPECT_EQ(r.claim->peer_id, "00000000000000aa");
  EXPECT_TRUE(tokens_equal(r.claim->secret, *secret));
  // Bound to connection 7: another is refused, naming the claimant.
  auto v = exposures_.check(1, e.token, Access::read, base(), 16, 8);
  EXPECT_FALSE(v.ok());
  EXPECT_EQ(v.message, "the operation is claimed by another peer (peer)");
  EXPECT_TRUE(exposures_.check(1, e.token, Access::read, base(), 16, 7).ok());
}

TEST_F(ExposuresTest, RevokeBetweenAClaimAndItsNoticeSilencesIt) {
  Recorder r;
  exposures_.add(exposure(1, Access::read), r);
  exposures_.claim(*exposures_.find(1), 7, "peer", "peer", "");
  EXPECT_EQ(exposures_.revoke(1), 7u);
  queue_.run();
  EXPECT_TRUE(r.calls.empty());
  EXPECT_EQ(exposures_.find(1), nullptr);
}

TEST_F(ExposuresTest, RevokeBetweenFinishAndItsNoticeSilencesIt) {
  Recorder r;
  exposures_.add(exposure(1, Access::write), r);
  exposures_.claim(*exposures_.find(1), 7, "peer", "peer", "");
  queue_.run();
  EXPECT_EQ(exposures_.finish(1, std::nullopt), 7u);
  EXPECT_EQ(exposures_.revoke(1), 0u);  // already gone from the table
  queue_.run();
  EXPECT_EQ(r.calls, (std::vector<std::string>{"claimed"}));
}

TEST_F(ExposuresTest, FinishKillsTheTokenAtOnceAndTellsTheObserverLater) {
  Recorder r;
  const Exposure e = exposure(1, Access::read);
  exposures_.add(e, r);
  exposures_.claim(*exposures_.find(1), 7, "peer", "peer", "");
  exposures_.finish(1, Error(ErrorCode::Cancelled, "gave up"));
  auto v = exposures_.check(1, e.token, Access::read, base(), 16, 7);
  EXPECT_FALSE(v.ok());
  EXPECT_EQ(v.message, transport::kit::ExposureTable::kNoLiveOperation);
  EXPECT_EQ(exposures_.finish(1, std::nullopt), 0u);  // once
  queue_.run();
  EXPECT_EQ(r.calls, (std::vector<std::string>{"claimed", "finished:peer:Cancelled"}));
}

TEST_F(ExposuresTest, OverlappingWritesCountEachByteOnce) {
  Recorder r;
  exposures_.add(exposure(1, Access::write, 8192), r);
  EXPECT_EQ(exposures_.exposed(1), 8192u);
  exposures_.landed(1, base(), 4096);
  exposures_.landed(1, base(), 4096);
  EXPECT_EQ(exposures_.written(1), 4096u);
  exposures_.landed(1, base() + 2048, 4096);
  EXPECT_EQ(exposures_.written(1), 6144u);
  exposures_.landed(1, base() + 6144, 2048);
  EXPECT_EQ(exposures_.written(1), 8192u);
}

TEST_F(ExposuresTest, ExposedCountsNestedAndTouchingRegionsOnce) {
  Recorder r;
  Exposure e = exposure(1, Access::write);
  e.regions = {Region{memory_.data(), 4096, MemoryKind::host},
               Region{memory_.data() + 1024, 1024, MemoryKind::host},  // inside the first
               Region{memory_.data() + 4096, 4096, MemoryKind::host},  // touches it
               Region{memory_.data() + 16384, 100, MemoryKind::host}};
  exposures_.add(e, r);
  EXPECT_EQ(exposures_.exposed(1), 8192u + 100u);
  EXPECT_EQ(exposures_.exposed(2), 0u);
}

TEST_F(ExposuresTest, ALostConnectionEndsOnlyWhatItClaimed) {
  Recorder a;
  Recorder b;
  Recorder c;
  exposures_.add(exposure(1, Access::read), a);
  exposures_.add(exposure(2, Access::read), b);
  exposures_.add(exposure(3, Access::read), c);
  exposures_.claim(*exposures_.find(1), 7, "seven", "seven", "");
  exposures_.claim(*exposures_.find(2), 8, "eight", "eight", "");
  exposures_.lose_connection(7, Error(ErrorCode::PeerLost, "peer seven disconnected"));
  EXPECT_EQ(exposures_.find(1), nullptr);
  EXPECT_NE(exposures_.find(2), nullptr);
  EXPECT_NE(exposures_.find(3), nullptr);
  queue_.run();
  EXPECT_EQ(a.calls, (std::vector<std::string>{"claimed", "lost"}));
  EXPECT_EQ(a.error->code(), ErrorCode::PeerLost);
  EXPECT_EQ(b.calls, (std::vector<std::string>{"claimed"}));
  EXPECT_TRUE(c.calls.empty());
}

TEST_F(ExposuresTest, ClearAndDestructionDropPendingNotices) {
  Recorder r;
  exposures_.add(exposure(1, Access::read), r);
  exposures_.claim(*exposures_.find(1), 7, "peer", "peer", "");
  exposures_.clear();
  EXPECT_EQ(exposures_.size(), 0u);
  queue_.run();
  EXPECT_TRUE(r.calls.empty());

  Recorder s;
  auto gone = std::make_unique<Exposures>("test", queue_.defer());
  gone->add(exposure(2, Access::read), s);
  gone->claim(*gone->find(2), 7, "peer", "peer", "");
  gone->finish(2, std::nullopt);
  gone.reset();
  queue_.run();
  EXPECT_TRUE(s.calls.empty());
}

TEST_F(ExposuresTest, AReadableFinishesOnlyOnceItsLastSendLeft) {
  Recorder r;
  exposures_.add(exposure(1, Access::read), r);
  exposures_.sending(1);
  exposures_.sending(1);
  EXPECT_FALSE(exposures_.done_reading(1));  // two sends still read the memory
  EXPECT_FALSE(exposures_.sent(1));
  EXPECT_TRUE(exposures_.sent(1));   // the last one: finish now
  EXPECT_FALSE(exposures_.sent(1));  // no send left to count
  Recorder s;
  exposures_.add(exposure(2, Access::read), s);
  EXPECT_TRUE(exposures_.done_reading(2));  // nothing in flight
}

TEST_F(ExposuresTest, ATakenIdIsInternal) {
  Recorder r;
  exposures_.add(exposure(1, Access::read), r);
  try {
    exposures_.add(exposure(1, Access::write), r);
    ADD_FAILURE() << "a second exposure took id 1";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Internal);
  }
}

}  // namespace
}  // namespace ferry::transport::kit
