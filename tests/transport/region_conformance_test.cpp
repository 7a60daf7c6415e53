// Every transport built, held to the region contracts of the Transport interface
// (transport/region.hpp, docs/regions.md) by the same tests, per attachment: revoking one, ending
// the region, bad ranges and late credentials, many peers at once, a peer lost mid-transfer.
// The SDK's own versions are in tests/sdk/region_test.cpp; these drive the transports directly
// (the rig: conformance_rig.hpp), so a method is held to the contract whatever the SDK checks
// before it.
#include "tests/transport/conformance_rig.hpp"

#include <map>
#include <set>

#include "transport/region.hpp"

namespace ferry::transport {
namespace {

using namespace conformance;

/// What a region's owner hears, from its loop; sealed like Log.
class RegionLog final : public RegionObserver {
 public:
  struct Record {
    std::string what;  ///< "attached", "transfer", "transfer failed" or "detached"
    std::uint64_t attachment = 0;
    std::string peer;                    ///< attached: the peer as the transport describes it
    std::optional<RegionNotice> notice;  ///< transfer, transfer failed
    std::optional<Error> error;          ///< detached: why, if the peer was lost
    bool after_seal = false;
  };

  /// Runs on the owner's loop for each transfer notice, after it is recorded.
  std::function<void(const RegionNotice&)> on_notice;

  void on_attached(const Attachment& a) override {
    Record r;
    r.what = "attached";
    r.attachment = a.id;
    r.peer = a.peer;
    add(std::move(r));
  }
  void on_region_transfer(const RegionNotice& n) override {
    Record r;
    r.what = n.error ? "transfer failed" : "transfer";
    r.attachment = n.attachment;
    r.notice = n;
    add(std::move(r));
    if (on_notice) on_notice(n);
  }
  void on_detached(std::uint64_t attachment, const std::optional<Error>& error) override {
    Record r;
    r.what = "detached";
    r.attachment = attachment;
    r.error = error;
    add(std::move(r));
  }
  void seal() {
    std::lock_guard lock(mu_);
    sealed_ = true;
  }
  std::size_t after_seal() const {
    std::lock_guard lock(mu_);
    std::size_t n = 0;
    for (const Record& r : records_) n += r.after_seal ? 1 : 0;
    return n;
  }
  /// Calls for `attachment` after the seal.
  std::size_t after_seal(std::uint64_t attachment) const {
    std::lock_guard lock(mu_);
    std::size_t n = 0;
    for (const Record& r : records_) n += r.after_seal && r.attachment == attachment ? 1 : 0;
    return n;
  }
  /// The attachments heard of, in order (waits for `n` of them).
  std::vector<std::uint64_t> attached(std::size_t n) const {
    std::vector<std::uint64_t> out;
    wait_for([&](const std::vector<Record>& records) {
      out.clear();
      for (const Record& r : records)
        if (r.what == "attached") out.push_back(r.attachment);
      return out.size() >= n;
    });
    return out;
  }
  /// The attachment of the peer whose description holds `name` (waits for it); 0 if none came.
  std::uint64_t attachment_of(const std::string& name) const {
    std::uint64_t out = 0;
    wait_for([&](const std::vector<Record>& records) {
      for (const Record& r : records)
        if (r.what == "attached" && contains(r.peer, name)) out = r.attachment;
      return out != 0;
    });
    return out;
  }
  std::size_t count(const std::string& what) const {
    std::lock_guard lock(mu_);
    std::size_t k = 0;
    for (const Record& r : records_) k += r.what == what ? 1 : 0;
    return k;
  }
  std::size_t count(const std::string& what, std::uint64_t attachment) const {
    std::lock_guard lock(mu_);
    std::size_t k = 0;
    for (const Record& r : records_) k += r.what == what && r.attachment == attachment ? 1 : 0;
    return k;
  }
  std::vector<Record> records() const {
    std::lock_guard lock(mu_);
    return records_;
  }
  /// Waits until `done(records)` holds; false after kWait.
  bool wait_for(const std::function<bool(const std::vector<Record>&)>& done) const {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, kWait, [&] { return done(records_); });
  }
  std::string text() const {
    std::string out;
    for (const Record& r : records()) {
      out += r.what + " " + std::to_string(r.attachment & 0xffff);
      if (r.notice && r.notice->error) out += std::string(" ") + r.notice->error->what();
      if (r.error) out += std::string(" ") + r.error->what();
      out += r.after_seal ? " (after seal); " : "; ";
    }
    return out;
  }

 private:
  void add(Record r) {
    {
      std::lock_guard lock(mu_);
      r.after_seal = sealed_;
      records_.push_back(std::move(r));
    }
    cv_.notify_all();
  }
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::vector<Record> records_;
  bool sealed_ = false;
};

/// How an attachment fares, active side.
class AttachLog final : public AttachObserver {
 public:
  void on_attached() override { set(1, std::nullopt); }
  void on_attach_failed(const Error& e, bool) override { set(2, e); }
  void on_detached(const Error& e) override { set(3, e); }
  /// Waits for `state` (1 attached, 2 failed, 3 detached); false after kWait.
  bool wait(int state) const {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, kWait, [&] { return state_ >= state; });
  }
  int state() const {
    std::lock_guard lock(mu_);
    return state_;
  }
  /// Why it failed or ended.
  std::optional<Error> error() const {
    std::lock_guard lock(mu_);
    return error_;
  }

 private:
  void set(int state, std::optional<Error> e) {
    {
      std::lock_guard lock(mu_);
      state_ = state;
      error_ = std::move(e);
    }
    cv_.notify_all();
  }
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  int state_ = 0;
  std::optional<Error> error_;
};

/// An attachment's active side, destroyed on its own loop (which detaches it).
class Attached {
 public:
  Attached() = default;
  Attached(Side& side, std::unique_ptr<RemoteRegion> remote)
      : side_(&side), remote_(std::move(remote)) {}
  Attached(Attached&&) = default;
  Attached& operator=(Attached&& other) {
    reset();
    side_ = other.side_;
    remote_ = std::move(other.remote_);
    return *this;
  }
  ~Attached() { reset(); }
  void reset() {
    if (side_ != nullptr && remote_) side_->call([this] { remote_.reset(); });
  }
  /// Loop thread only: destroys it here and now.
  void destroy_here() { remote_.reset(); }
  explicit operator bool() const { return remote_ != nullptr; }
  /// Loop thread only.
  RemoteRegion& operator*() const { return *remote_; }

 private:
  Side* side_ = nullptr;
  std::unique_ptr<RemoteRegion> remote_;
};

class RegionConformance : public ::testing::TestWithParam<Harness>, public Rig {
 protected:
  RegionConformance() : Rig(GetParam()) {}
  // The transports go first: they call the observers below until they are gone.
  ~RegionConformance() override { close_sides(); }

  RegionLog& region_log() { return region_logs_.emplace_back(); }
  AttachLog& attach_log() { return attach_logs_.emplace_back(); }

  /// Serves `regions` of `owner` as a region of `access`.
  RegionExposure serve(Side& owner, Access access, const std::vector<Region>& regions,
                       RegionLog& log) {
    RegionExposure r;
    r.id = next_exposure_id++;
    r.token = random_token();
    r.access = access;
    r.regions = regions;
    info_ = owner.call([&] {
      for (const Region& x : regions)
        registrations_.push_back(owner.transport().register_exposed(x));
      return owner.transport().serve_region(r, log);
    });
    return r;
  }
  /// What attaching to `region` of `owner` asks of a transport.
  AttachSpec attach_spec(const Side& owner, const RegionExposure& region) const {
    AttachSpec spec;
    spec.region = region.id;
    spec.token = region.token;
    spec.access = region.access;
    spec.endpoint = owner.endpoint();
    spec.endpoint.info = info_;
    spec.peer_name = owner.params().name;
    // As the SDK gives them, from the metadata's descriptors.
    for (const Region& r : region.regions) spec.ranges.emplace_back(address_of(r.ptr), r.size);
    return spec;
  }
  /// Attaches `active` to `region` of `owner`; waits until attached.
  Attached attach(Side& active, Side& owner, const RegionExposure& region, AttachLog& log) {
    Attached remote = start_attach(active, attach_spec(owner, region), log);
    EXPECT_TRUE(log.wait(1)) << "not attached";
    EXPECT_EQ(log.state(), 1) << (log.error() ? log.error()->what() : "");
    return remote;
  }
  /// Starts attaching `active` as `spec` says; returns at once.
  static Attached start_attach(Side& active, AttachSpec spec, AttachLog& log) {
    auto remote = active.call([&] { return active.transport().attach(std::move(spec), log); });
    return Attached(active, std::move(remote));
  }
  /// A transfer of `local` on `remote`, the whole region of `remote_regions`.
  Running transfer(Side& active, RemoteRegion& remote, Access access,
                   const std::vector<Region>& remote_regions, const std::vector<Region>& local,
                   TransferLog& log) {
    return transfer_on(active, remote, access, match(remote_regions, local), log);
  }
  /// A transfer of `segments` (remote addresses in the region) on `remote`, tagged `tag`.
  static Running transfer_on(Side& active, RemoteRegion& remote, Access access,
                             std::vector<Segment> segments, TransferLog& log,
                             std::string tag = "conformance") {
    TransferSpec spec;
    spec.access = access;
    spec.segments = std::move(segments);
    spec.region_tag = std::move(tag);
    auto t = active.call([&] { return remote.start(std::move(spec), log); });
    return Running(active, std::move(t));
  }
  /// Drops the RemoteRegion on its loop.
  static void drop(Side& active, std::unique_ptr<RemoteRegion>& remote) {
    active.call([&] { remote.reset(); });
  }
  static void drop(Side&, Attached& remote) { remote.reset(); }

  std::string info_;
  std::vector<std::shared_ptr<const Registration>> registrations_;
  std::deque<RegionLog> region_logs_;
  std::deque<AttachLog> attach_logs_;
};

/// Whether the 64 bytes at `data` hold the pattern `seed` at stream offset `offset` (while a
/// transfer may still be writing them).
bool landed_at(const std::byte* data, std::uint64_t offset, std::uint64_t seed) {
  const std::vector<std::byte> seen = test::peek(data, 64);
  return test::first_mismatch(seen.data(), 64, seed, offset) == -1;
}

// ---------------------------------------------------------------------------------------
// Revoking one attachment, ending the region: no byte moves after they return

TEST_P(RegionConformance, RevokingAnAttachmentMidWriteStopsEveryLaterWrite) {
  Side& owner = side("owner");
  Side& active = side("active", kSlowChunk);
  Pieces& dst = memory({kBig}, 0);
  Pieces& src = memory({kBig}, 31);
  RegionLog& rlog = region_log();
  AttachLog& alog = attach_log();
  TransferLog& tlog = transfer_log();
  RegionExposure region = serve(owner, Access::write, dst.regions(), rlog);
  auto remote = attach(active, owner, region, alog);
  ASSERT_TRUE(remote);
  const std::uint64_t att = rlog.attached(1).at(0);
  Running t = transfer(active, *remote, Access::write, dst.regions(), src.regions(), tlog);
  bool finished_first = false;
  ASSERT_TRUE(on_loop_when(owner, [&] {
    if (!landed(dst.data(), kMid, 31)) return false;
    finished_first = landed(dst.data(), kBig - 64, 31);
    owner.transport().revoke_attachment(att, Error(ErrorCode::Cancelled, "revoked by the test"));
    rlog.seal();
    std::memset(dst.data(), static_cast<int>(kPoison), kBig);
    return true;
  })) << "the write never reached the middle of the memory";
  ASSERT_FALSE(finished_first) << "the transfer ended before the revoke; it must be slower";
  expect_refused_after_revoke(tlog.wait_end());
  EXPECT_TRUE(alog.wait(3)) << "the peer did not hear it was revoked";
  owner.settle();
  active.settle();
  EXPECT_TRUE(owner.call([&] { return all_are(dst.data(), kBig, kPoison); }))
      << "bytes were written into the memory after revoke_attachment() returned";
  EXPECT_TRUE(dst.guards_intact());
  EXPECT_EQ(rlog.after_seal(), 0u);
  // The attachment is over: no transfer starts on it.
  EXPECT_THROW(
      (void)transfer(active, *remote, Access::write, dst.regions(), src.regions(), transfer_log()),
      Error);
  t.reset();
  drop(active, remote);
}

TEST_P(RegionConformance, EndingTheRegionStopsEveryAttachmentAndRefusesNewOnes) {
  Side& owner = side("owner");
  Side& a = side("a", kSlowChunk);
  Side& b = side("b", kSlowChunk);
  Pieces& dst = memory({kBig}, 0);
  Pieces& src = memory({kBig}, 32);
  RegionLog& rlog = region_log();
  AttachLog& alog_a = attach_log();
  AttachLog& alog_b = attach_log();
  TransferLog& ta = transfer_log();
  TransferLog& tb = transfer_log();
  RegionExposure region = serve(owner, Access::write, dst.regions(), rlog);
  auto ra = attach(a, owner, region, alog_a);
  auto rb = attach(b, owner, region, alog_b);
  ASSERT_TRUE(ra && rb);
  EXPECT_EQ(rlog.attached(2).size(), 2u);
  Running t1 = transfer(a, *ra, Access::write, dst.regions(), src.regions(), ta);
  Running t2 = transfer(b, *rb, Access::write, dst.regions(), src.regions(), tb);
  ASSERT_TRUE(on_loop_when(owner, [&] {
    if (!landed(dst.data(), kMid, 32)) return false;
    owner.transport().end_region(region.id, Error(ErrorCode::Cancelled, "revoked by the test"));
    rlog.seal();
    std::memset(dst.data(), static_cast<int>(kPoison), kBig);
    return true;
  }));
  expect_refused_after_revoke(ta.wait_end());
  expect_refused_after_revoke(tb.wait_end());
  owner.settle();
  a.settle();
  b.settle();
  EXPECT_TRUE(owner.call([&] { return all_are(dst.data(), kBig, kPoison); }))
      << "bytes were written into the memory after end_region() returned";
  EXPECT_EQ(rlog.after_seal(), 0u);
  // Attaching again with the region's token is refused.
  AttachLog& late = attach_log();
  AttachSpec spec;
  spec.region = region.id;
  spec.token = region.token;
  spec.access = Access::write;
  spec.endpoint = owner.endpoint();
  spec.endpoint.info = info_;
  spec.peer_name = "owner";
  Side& c = side("c");
  auto rc = c.call([&] { return c.transport().attach(spec, late); });
  EXPECT_TRUE(late.wait(2));
  t1.reset();
  t2.reset();
  drop(a, ra);
  drop(b, rb);
  drop(c, rc);
}

TEST_P(RegionConformance, AWritesNoticeComesOnlyOnceItsBytesAreIn) {
  Side& owner = side("owner");
  Side& active = side("active");
  Pieces& dst = memory({kMid}, 0);
  Pieces& src = memory({kMid}, 33);
  RegionLog& rlog = region_log();
  AttachLog& alog = attach_log();
  std::atomic<int> notices{0};
  std::atomic<bool> in_place{false};
  rlog.on_notice = [&](const RegionNotice& n) {
    // On the owner's loop: the bytes must be there now.
    in_place = !n.error && test::first_mismatch(dst.data(), kMid, 33) == -1;
    ++notices;
  };
  TransferLog& tlog = transfer_log();
  RegionExposure region = serve(owner, Access::write, dst.regions(), rlog);
  auto remote = attach(active, owner, region, alog);
  ASSERT_TRUE(remote);
  Running t = transfer(active, *remote, Access::write, dst.regions(), src.regions(), tlog);
  auto end = tlog.wait_end();
  ASSERT_TRUE(end.has_value());
  ASSERT_EQ(end->call, Call::complete) << (end->error ? end->error->what() : "");
  ASSERT_TRUE(on_loop_when(owner, [&] { return notices.load() == 1; }));
  EXPECT_TRUE(in_place.load());
  t.reset();
  drop(active, remote);
  // The owner hears the peer detach.
  EXPECT_TRUE(on_loop_when(owner, [&] { return rlog.count("detached") == 1; }));
}

TEST_P(RegionConformance, RevokingOneAttachmentLeavesAnotherTransferring) {
  constexpr std::size_t kQuarter = kBig / 4;
  Side& owner = side("owner");
  Side& revoked = side("revoked", kSlowChunk);
  Side& kept = side("kept", kSlowChunk);
  // Quarter 0: the revoked peer writes it. Quarter 1: the kept peer writes it; 2 and 3: it
  // reads them, both at once.
  Pieces& pool = memory({kBig}, 0);
  test::fill_pattern(pool.data() + 2 * kQuarter, 2 * kQuarter, 42);
  Pieces& revoked_src = memory({kQuarter}, 43);
  Pieces& kept_src = memory({kQuarter}, 44);
  Pieces& kept_dst = memory({2 * kQuarter}, 0);
  RegionLog& rlog = region_log();
  AttachLog& revoked_log = attach_log();
  AttachLog& kept_log = attach_log();
  RegionExposure region = serve(owner, Access::read_write, pool.regions(), rlog);
  Attached rr = attach(revoked, owner, region, revoked_log);
  Attached rk = attach(kept, owner, region, kept_log);
  ASSERT_TRUE(rr && rk);
  const std::uint64_t att = rlog.attachment_of("revoked");
  const std::uint64_t other = rlog.attachment_of("kept");
  ASSERT_NE(att, 0u) << rlog.text();
  ASSERT_NE(other, 0u) << rlog.text();
  ASSERT_NE(att, other);

  std::byte* const base = pool.data();
  TransferLog& revoked_write = transfer_log();
  TransferLog& kept_write = transfer_log();
  TransferLog& kept_read = transfer_log();
  Running t = transfer_on(revoked, *rr, Access::write,
                          {Segment{address_of(base), revoked_src.data(), kQuarter}}, revoked_write);
  Running w = transfer_on(kept, *rk, Access::write,
                          {Segment{address_of(base + kQuarter), kept_src.data(), kQuarter}},
                          kept_write, "kept write");
  Running r = transfer_on(kept, *rk, Access::read,
                          {Segment{address_of(base + 2 * kQuarter), kept_dst.data(), 2 * kQuarter}},
                          kept_read, "kept read");
  bool revoked_finished = false;
  bool kept_finished = false;
  // Early in the revoked peer's write (an eighth of it): under ThreadSanitizer the kept peer's
  // write, as slow, was once already over when the revoke came at half way.
  ASSERT_TRUE(on_loop_when(owner, [&] {
    if (!landed(base, kQuarter / 8, 43)) return false;
    revoked_finished = landed(base, kQuarter - 64, 43);
    kept_finished = landed_at(base + 2 * kQuarter - 64, kQuarter - 64, 44);
    owner.transport().revoke_attachment(att, Error(ErrorCode::Cancelled, "revoked by the test"));
    rlog.seal();
    std::memset(base, static_cast<int>(kPoison), kQuarter);
    return true;
  })) << "the revoked peer's write never reached an eighth of its quarter";
  ASSERT_FALSE(revoked_finished) << "the transfer ended before the revoke; it must be slower";
  ASSERT_FALSE(kept_finished)
      << "the other peer's write ended before the revoke; it must be slower";

  expect_refused_after_revoke(revoked_write.wait_end());
  EXPECT_TRUE(revoked_log.wait(3)) << "the revoked peer did not hear it";
  // The other attachment goes on: both its transfers complete, every byte in place.
  for (TransferLog* log : {&kept_write, &kept_read}) {
    auto end = log->wait_end();
    ASSERT_TRUE(end.has_value()) << "the other peer's transfer did not end";
    EXPECT_EQ(end->call, Call::complete)
        << call_name(end->call) << ": " << (end->error ? end->error->what() : "");
  }
  EXPECT_EQ(kept_log.state(), 1) << "the other attachment ended: " << kept_log.error()->what();
  // A revoked peer may attach again: revocation ends an attachment, not the region. Its ATTACH
  // goes the way its writes went, so once it is answered every write before it has arrived.
  AttachLog& again_log = attach_log();
  Attached again = attach(revoked, owner, region, again_log);
  EXPECT_TRUE(owner.call([&] { return all_are(base, kQuarter, kPoison); }))
      << "bytes were written into the memory after revoke_attachment() returned";
  EXPECT_EQ(owner.call([&] { return test::first_mismatch(base + kQuarter, kQuarter, 44); }), -1);
  EXPECT_EQ(kept.call([&] { return test::first_mismatch(kept_dst.data(), 2 * kQuarter, 42); }), -1);
  EXPECT_TRUE(pool.guards_intact());
  EXPECT_TRUE(kept_dst.guards_intact());
  // The owner hears nothing more of the revoked attachment, and each transfer of the other.
  EXPECT_TRUE(rlog.wait_for([&](const std::vector<RegionLog::Record>& records) {
    std::size_t n = 0;
    for (const auto& rec : records) n += rec.attachment == other && rec.notice ? 1 : 0;
    return n == 2;
  })) << rlog.text();
  EXPECT_EQ(rlog.count("transfer", other), 2u) << rlog.text();
  EXPECT_EQ(rlog.after_seal(att), 0u) << rlog.text();
}

TEST_P(RegionConformance, EndingTheRegionMidTransferMovesNoByteAfterItAndRefusesLaterAttaches) {
  constexpr std::size_t kHalf = kBig / 2;
  Side& owner = side("owner");
  Side& writer = side("writer", kSlowChunk);
  Side& reader = side("reader", kSlowChunk);
  // The writer writes the first half while the reader reads the second.
  Pieces& pool = memory({kBig}, 0);
  test::fill_pattern(pool.data() + kHalf, kHalf, 45);
  Pieces& src = memory({kHalf}, 46);
  Pieces& dst = memory({kHalf}, 0);
  RegionLog& rlog = region_log();
  AttachLog& writer_log = attach_log();
  AttachLog& reader_log = attach_log();
  RegionExposure region = serve(owner, Access::read_write, pool.regions(), rlog);
  Attached rw = attach(writer, owner, region, writer_log);
  Attached rr = attach(reader, owner, region, reader_log);
  ASSERT_TRUE(rw && rr);

  std::byte* const base = pool.data();
  TransferLog& wlog = transfer_log();
  TransferLog& rdlog = transfer_log();
  Running w =
      transfer_on(writer, *rw, Access::write, {Segment{address_of(base), src.data(), kHalf}}, wlog);
  Running r = transfer_on(reader, *rr, Access::read,
                          {Segment{address_of(base + kHalf), dst.data(), kHalf}}, rdlog);
  bool write_finished = false;
  bool read_finished = false;
  // As soon as both have moved their first chunk: the two run at their own pace (the read was
  // seen to finish while the write reached its middle, which this waited for before), and with
  // 4 KiB chunks each has about two thousand more round trips to go.
  ASSERT_TRUE(on_loop_when(owner, [&] {
    if (!landed(base, kSlowChunk, 46) ||
        !landed_at(dst.data() + kSlowChunk - 64, kSlowChunk - 64, 45))
      return false;
    write_finished = landed(base, kHalf - 64, 46);
    read_finished = landed_at(dst.data() + kHalf - 64, kHalf - 64, 45);
    owner.transport().end_region(region.id, Error(ErrorCode::Cancelled, "revoked by the test"));
    rlog.seal();
    std::memset(base, static_cast<int>(kPoison), kBig);
    return true;
  })) << "the transfers never moved their first chunk";
  ASSERT_FALSE(write_finished) << "the write ended before end_region(); it must be slower";
  ASSERT_FALSE(read_finished) << "the read ended before end_region(); it must be slower";

  expect_refused_after_revoke(wlog.wait_end());
  expect_refused_after_revoke(rdlog.wait_end());
  EXPECT_TRUE(writer_log.wait(3)) << "the writer did not hear the region end";
  EXPECT_TRUE(reader_log.wait(3)) << "the reader did not hear the region end";
  // Later attaches are refused: by the peers that were attached (their ATTACH goes the way their
  // requests went, so once it is answered every request before it has arrived) and a new one.
  Side& late = side("late");
  for (Side* s : {&writer, &reader, &late}) {
    AttachLog& log = attach_log();
    Attached refused = start_attach(*s, attach_spec(owner, region), log);
    ASSERT_TRUE(log.wait(2)) << s->params().name << ": the attach did not end";
    ASSERT_EQ(log.state(), 2) << s->params().name << ": attached to an ended region";
    EXPECT_EQ(log.error()->code(), ErrorCode::AccessDenied) << log.error()->what();
    EXPECT_TRUE(contains(log.error()->message(), "no live region matches this id and token"))
        << log.error()->what();
  }
  EXPECT_TRUE(owner.call([&] { return all_are(base, kBig, kPoison); }))
      << "bytes were written into the memory after end_region() returned";
  EXPECT_EQ(reader.call([&] { return foreign_bytes(dst.data(), kHalf, 45); }), 0u)
      << "bytes were read from the memory after end_region() returned";
  EXPECT_TRUE(pool.guards_intact());
  EXPECT_TRUE(dst.guards_intact());
  EXPECT_EQ(rlog.after_seal(), 0u) << rlog.text();
}

TEST_P(RegionConformance, ALateTransferUnderARevokedCredentialIsRefusedAndMovesNothing) {
  constexpr std::size_t kBlock = 4096;
  Side& owner = side("owner");
  Side& active = side("active");
  // Block 0 is read, block 1 written.
  Pieces& pool = memory({2 * kBlock}, 0);
  test::fill_pattern(pool.data(), kBlock, 47);
  Pieces& src = memory({kBlock}, 48);
  Pieces& dst = memory({kBlock}, 0);
  RegionLog& rlog = region_log();
  AttachLog& alog = attach_log();
  RegionExposure region = serve(owner, Access::read_write, pool.regions(), rlog);
  Attached remote = attach(active, owner, region, alog);
  ASSERT_TRUE(remote);
  const std::uint64_t att = rlog.attached(1).at(0);
  const std::uint64_t block0 = address_of(pool.data());
  const std::uint64_t block1 = block0 + kBlock;
  {
    // The credential works until it is revoked.
    TransferLog& log = transfer_log();
    Running ok =
        transfer_on(active, *remote, Access::read, {Segment{block0, dst.data(), kBlock}}, log);
    auto end = log.wait_end();
    ASSERT_TRUE(end.has_value());
    ASSERT_EQ(end->call, Call::complete) << (end->error ? end->error->what() : "");
    active.call([&] { std::memset(dst.data(), 0, kBlock); });
  }

  TransferLog& wlog = transfer_log();
  TransferLog& rdlog = transfer_log();
  Running late_write;
  Running late_read;
  active.call([&] {
    // The owner revokes while this loop is held here: the peer cannot have heard of it yet, so
    // its attachment still presents the revoked credential.
    owner.call([&] {
      owner.transport().revoke_attachment(att, Error(ErrorCode::Cancelled, "revoked by the test"));
      rlog.seal();
    });
    TransferSpec w;
    w.access = Access::write;
    w.segments = {Segment{block1, src.data(), kBlock}};
    w.region_tag = "late";
    late_write = Running(active, (*remote).start(std::move(w), wlog));
    TransferSpec rd;
    rd.access = Access::read;
    rd.segments = {Segment{block0, dst.data(), kBlock}};
    rd.region_tag = "late";
    late_read = Running(active, (*remote).start(std::move(rd), rdlog));
  });
  expect_refused_after_revoke(wlog.wait_end());
  expect_refused_after_revoke(rdlog.wait_end());
  EXPECT_TRUE(alog.wait(3)) << "the peer did not hear it was revoked";
  // Its ATTACH goes the way its requests went: once answered, they have all arrived.
  AttachLog& again_log = attach_log();
  Attached again = attach(active, owner, region, again_log);
  EXPECT_TRUE(owner.call([&] { return all_are(pool.data() + kBlock, kBlock, std::byte{0}); }))
      << "a write under the revoked credential landed";
  EXPECT_EQ(owner.call([&] { return test::first_mismatch(pool.data(), kBlock, 47); }), -1);
  EXPECT_TRUE(active.call([&] { return all_are(dst.data(), kBlock, std::byte{0}); }))
      << "a read under the revoked credential brought bytes";
  EXPECT_TRUE(pool.guards_intact());
  EXPECT_EQ(rlog.after_seal(att), 0u) << rlog.text();
}

// ---------------------------------------------------------------------------------------
// Bad ranges

TEST_P(RegionConformance, RangesOutsideTheRegionAreRefusedAndMoveNothing) {
  Side& owner = side("owner");
  Side& prober = side("prober");
  // Two descriptors with a gap between them: a range across the gap is outside too.
  Pieces& block = memory({3 * 4096}, 0);
  std::memset(block.data(), 0x77, 3 * 4096);
  std::byte* a = block.data();
  std::byte* b = block.data() + 2 * 4096;
  const std::vector<Region> regions = {{a, 4096, MemoryKind::host}, {b, 4096, MemoryKind::host}};
  Pieces& src = memory({8192}, 35);
  Pieces& sink = memory({8192}, 0);
  RegionLog& rlog = region_log();
  RegionExposure region = serve(owner, Access::read_write, regions, rlog);

  constexpr std::uint64_t kTop = ~std::uint64_t{0};
  struct Case {
    Access access;
    std::uint64_t addr;
    std::uint64_t len;
    const char* what;
  };
  const Case cases[] = {
      {Access::read, address_of(a) + 4000, 200, "off the end of the first descriptor"},
      {Access::read, address_of(a) - 1, 1, "one byte before"},
      {Access::read, address_of(b) + 4096, 1, "one byte after"},
      {Access::read, address_of(a) + 4095, 2, "into the gap"},
      {Access::read, kTop - 99, 200, "wrapping past the top of the address space"},
      {Access::write, address_of(a) + 4000, 200, "off the end of the first descriptor"},
      {Access::write, address_of(a) + 4096, 4096, "the gap itself"},
      {Access::write, address_of(b) - 8, 16, "from the gap into the second descriptor"},
      {Access::write, address_of(b) + 4095, 2, "off the end of the region"},
      {Access::write, kTop - 99, 200, "wrapping past the top of the address space"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.access == Access::read ? "read " : "write ") + c.what);
    // An attachment per case: a method may end the attachment over a refused range.
    AttachLog& alog = attach_log();
    Attached remote = attach(prober, owner, region, alog);
    ASSERT_TRUE(remote);
    TransferLog& log = transfer_log();
    std::byte* local = c.access == Access::read ? sink.data() : src.data();
    Running t = transfer_on(prober, *remote, c.access, {Segment{c.addr, local, c.len}}, log);
    auto end = log.wait_end();
    ASSERT_TRUE(end.has_value());
    if (end->call != Call::failed) {
      ADD_FAILURE() << "not refused: " << call_name(end->call);
      continue;
    }
    EXPECT_EQ(end->error->code(), ErrorCode::AccessDenied) << end->error->what();
  }
  // The region still serves (a read inside it completes), and its ATTACH went the way the
  // refused requests went: every one of them has arrived.
  AttachLog& alog = attach_log();
  Attached remote = attach(prober, owner, region, alog);
  ASSERT_TRUE(remote);
  TransferLog& log = transfer_log();
  Pieces& one = memory({1}, 0);
  Running t =
      transfer_on(prober, *remote, Access::read, {Segment{address_of(b), one.data(), 1}}, log);
  auto end = log.wait_end();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->call, Call::complete) << (end->error ? end->error->what() : "");
  EXPECT_EQ(prober.call([&] { return *one.data(); }), std::byte{0x77});
  EXPECT_TRUE(owner.call([&] { return all_are(block.data(), 3 * 4096, std::byte{0x77}); }))
      << "a refused write changed the memory";
  EXPECT_TRUE(block.guards_intact()) << "a refused write changed the memory around the region";
  EXPECT_TRUE(prober.call([&] { return all_are(sink.data(), 8192, std::byte{0}); }))
      << "a refused read brought bytes";
}

// ---------------------------------------------------------------------------------------
// Many peers, peer loss

TEST_P(RegionConformance, ManyPeersReadAndWriteDifferentBlocksAtOnce) {
  constexpr std::size_t kPeers = 4;
  constexpr std::size_t kEach = 3;  // writes, and as many reads, per peer
  constexpr std::size_t kBlock = 128u << 10;
  constexpr std::size_t kHalf = kPeers * kEach * kBlock;
  Side& owner = side("owner");
  // The peers write the first half, block by block, and read the second.
  Pieces& pool = memory({2 * kHalf}, 0);
  test::fill_pattern(pool.data() + kHalf, kHalf, 49, kHalf);
  RegionLog& rlog = region_log();
  RegionExposure region = serve(owner, Access::read_write, pool.regions(), rlog);

  struct Move {
    std::size_t peer = 0;
    Access access = Access::read;
    std::size_t block = 0;
    Pieces* local = nullptr;
    TransferLog* log = nullptr;
  };
  std::map<std::string, Move> moves;  // by tag
  std::vector<Attached> attached;
  std::vector<Side*> peers;
  for (std::size_t p = 0; p < kPeers; ++p) {
    peers.push_back(&side("peer" + std::to_string(p), kSlowChunk));
    attached.push_back(attach(*peers[p], owner, region, attach_log()));
    ASSERT_TRUE(attached[p]);
  }
  // Every transfer starts before any is waited for.
  std::vector<Running> running;
  for (std::size_t i = 0; i < kEach; ++i) {
    for (std::size_t p = 0; p < kPeers; ++p) {
      for (Access access : {Access::write, Access::read}) {
        Move m;
        m.peer = p;
        m.access = access;
        m.block = (access == Access::write ? 0 : kPeers * kEach) + p * kEach + i;
        m.local = &memory({kBlock}, access == Access::write ? 1000 + m.block : 0);
        m.log = &transfer_log();
        const std::string tag = "peer" + std::to_string(p) + " block " + std::to_string(m.block);
        running.push_back(transfer_on(
            *peers[p], *attached[p], access,
            {Segment{address_of(pool.data() + m.block * kBlock), m.local->data(), kBlock}}, *m.log,
            tag));
        moves[tag] = m;
      }
    }
  }
  for (const auto& [tag, m] : moves) {
    auto end = m.log->wait_end();
    ASSERT_TRUE(end.has_value()) << tag << " did not end";
    EXPECT_EQ(end->call, Call::complete)
        << tag << ": " << call_name(end->call) << " " << (end->error ? end->error->what() : "");
  }
  for (const auto& [tag, m] : moves) {
    // A write's bytes are in the owner's block; a read's in the peer's buffer.
    const bool wrote = m.access == Access::write;
    Side& holder = wrote ? owner : *peers[m.peer];
    const std::byte* at = wrote ? pool.data() + m.block * kBlock : m.local->data();
    const std::uint64_t seed = wrote ? 1000 + m.block : 49;
    const std::uint64_t offset = wrote ? 0 : m.block * kBlock;
    EXPECT_EQ(holder.call([&] { return test::first_mismatch(at, kBlock, seed, offset); }), -1)
        << tag;
  }
  EXPECT_TRUE(pool.guards_intact());

  // The owner heard each transfer once, from the attachment that made it, with its tag, its
  // kind and the range it reached.
  ASSERT_TRUE(rlog.wait_for([&](const std::vector<RegionLog::Record>& records) {
    std::size_t n = 0;
    for (const auto& rec : records) n += rec.notice ? 1 : 0;
    return n >= moves.size();
  })) << rlog.text();
  const std::vector<std::uint64_t> atts = rlog.attached(kPeers);
  const std::set<std::uint64_t> known(atts.begin(), atts.end());
  EXPECT_EQ(known.size(), kPeers);
  std::map<std::size_t, std::uint64_t> attachment_of_peer;
  std::set<std::string> heard;
  for (const auto& rec : rlog.records()) {
    if (!rec.notice) continue;
    const RegionNotice& n = *rec.notice;
    EXPECT_FALSE(n.error.has_value()) << n.tag << ": " << n.error->what();
    auto it = moves.find(n.tag);
    if (it == moves.end()) {
      ADD_FAILURE() << "a notice with an unknown tag '" << n.tag << "'";
      continue;
    }
    const Move& m = it->second;
    EXPECT_TRUE(heard.insert(n.tag).second) << n.tag << " heard twice";
    EXPECT_EQ(n.access, m.access) << n.tag;
    EXPECT_EQ(known.count(n.attachment), 1u) << n.tag;
    const auto seen = attachment_of_peer.emplace(m.peer, n.attachment).first;
    EXPECT_EQ(seen->second, n.attachment) << n.tag << ": another attachment than its peer's";
    const Ranges expected = {{address_of(pool.data() + m.block * kBlock), kBlock}};
    EXPECT_EQ(n.ranges, expected) << n.tag;
  }
  EXPECT_EQ(heard.size(), moves.size());
  std::set<std::uint64_t> distinct;
  for (const auto& [p, a] : attachment_of_peer) distinct.insert(a);
  EXPECT_EQ(distinct.size(), kPeers) << "two peers' transfers were told as one attachment's";
}

TEST_P(RegionConformance, APeerDestroyedMidTransferIsHeardAsDetachedAndTheOthersGoOn) {
  Side& owner = side("owner");
  Side& doomed = side("doomed", kSlowChunk);
  Side& other = side("other");
  Pieces& pool = memory({kBig}, 0);
  Pieces& src = memory({kBig}, 50);
  Pieces& block = memory({4096}, 51);
  RegionLog& rlog = region_log();
  AttachLog& doomed_log = attach_log();
  AttachLog& other_log = attach_log();
  RegionExposure region = serve(owner, Access::write, pool.regions(), rlog);
  Attached rd = attach(doomed, owner, region, doomed_log);
  Attached ro = attach(other, owner, region, other_log);
  ASSERT_TRUE(rd && ro);
  const std::uint64_t gone = rlog.attachment_of("doomed");
  const std::uint64_t kept = rlog.attachment_of("other");
  ASSERT_NE(gone, 0u) << rlog.text();
  ASSERT_NE(kept, 0u) << rlog.text();

  TransferLog& tlog = transfer_log();
  Running t = transfer(doomed, *rd, Access::write, pool.regions(), src.regions(), tlog);
  ASSERT_TRUE(on_loop_when(owner, [&] { return landed(pool.data(), kMid, 50); }))
      << "the write never reached the middle of the memory";
  const auto at = Clock::now();
  // Destroyed as a process that dies: its connections close before anything is said.
  doomed.call([&] {
    doomed.transport().close();
    t.destroy_here();
    rd.destroy_here();
  });
  doomed.destroy_transport();

  ASSERT_TRUE(rlog.wait_for([&](const std::vector<RegionLog::Record>& records) {
    for (const auto& rec : records)
      if (rec.what == "detached" && rec.attachment == gone) return true;
    return false;
  })) << "the owner did not hear the peer go: "
      << rlog.text();
  EXPECT_LT(Clock::now() - at, 5s);
  for (const auto& rec : rlog.records()) {
    if (rec.what != "detached" || rec.attachment != gone) continue;
    ASSERT_TRUE(rec.error.has_value()) << "a lost peer was told as one that detached";
    EXPECT_EQ(rec.error->code(), ErrorCode::PeerLost) << rec.error->what();
  }
  // The other attachment goes on.
  TransferLog& olog = transfer_log();
  Running w = transfer_on(other, *ro, Access::write,
                          {Segment{address_of(pool.data()), block.data(), 4096}}, olog, "other");
  auto end = olog.wait_end();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->call, Call::complete) << (end->error ? end->error->what() : "");
  EXPECT_EQ(owner.call([&] { return test::first_mismatch(pool.data(), 4096, 51); }), -1);
  EXPECT_TRUE(rlog.wait_for([&](const std::vector<RegionLog::Record>& records) {
    for (const auto& rec : records)
      if (rec.what == "transfer" && rec.attachment == kept) return true;
    return false;
  })) << rlog.text();
  // Nothing of the lost attachment after its detached; the other is still attached.
  bool after = false;
  std::size_t late = 0;
  for (const auto& rec : rlog.records()) {
    if (rec.attachment != gone) continue;
    late += after ? 1 : 0;
    after = after || rec.what == "detached";
  }
  EXPECT_EQ(late, 0u) << rlog.text();
  EXPECT_EQ(rlog.count("detached", kept), 0u) << rlog.text();
  EXPECT_EQ(other_log.state(), 1);
}

INSTANTIATE_TEST_SUITE_P(Transports, RegionConformance, ::testing::ValuesIn(harnesses()),
                         harness_name);

}  // namespace
}  // namespace ferry::transport
