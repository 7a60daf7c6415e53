#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "transport/context.hpp"
#include "transport/kit/lifetime.hpp"
#include "transport/transport.hpp"

namespace ferry::transport::kit {

template <class T>
class TransferTable;
template <class T>
class Handle;

/// What a method does for its TransferTable when a transfer ends.
template <class T>
class TransferHooks {
 public:
  /// The transfer ends (it completed, failed or is cancelled): let go of what it holds, so
  /// that nothing of the method touches the local memory any more (copies halted, queued
  /// frames released, receive sinks dropped), except what settle() waits for.
  virtual void stop(T& t) = 0;
  /// cancel() ends a transfer that had not ended: tell the peer `reason`, where it can hear.
  virtual void tell_peer(T& t, const Error& reason) = 0;
  /// cancel() or the transfer's destructor: returns once no work of the method touches the
  /// local memory (RDMA work requests in flight, say). Default: stop() was enough.
  virtual void settle(T& t) { (void)t; }

 protected:
  ~TransferHooks() = default;
};

/// What every active transfer of a method has (`T` derives from TransferBase<T>): the spec, the
/// observer, the claim secret. Its handle (Handle<T>) is what start() returns.
template <class T>
class TransferBase {
 public:
  TransferBase(TransferSpec what, TransferObserver& observer)
      : spec(std::move(what)), observer_(&observer) {
    for (const Segment& s : spec.segments) total += s.len;
  }
  TransferBase(const TransferBase&) = delete;
  TransferBase& operator=(const TransferBase&) = delete;

  std::uint64_t id() const noexcept { return id_; }
  /// Completed, failed or cancelled: nothing more is sent or received for it.
  bool finished() const noexcept { return finished_; }

  TransferSpec spec;
  std::uint64_t total = 0;      ///< bytes of the segments
  std::optional<Token> secret;  ///< the owner's claim secret, once it sent it

 private:
  friend class TransferTable<T>;
  friend class Handle<T>;
  TransferTable<T>* table_ = nullptr;  ///< null once the table let go of it
  TransferObserver* observer_;
  std::uint64_t id_ = 0;
  bool finished_ = false;
  bool reported_ = false;
};

/// The handle of a transfer: the cancel contract of transport.hpp, written once. cancel() and
/// the destructor go to the table, which stops the transfer and returns only when nothing
/// touches its memory, and no observer call follows; the transfer itself is destroyed after,
/// whole.
template <class T>
class Handle final : public Transfer {
 public:
  explicit Handle(std::unique_ptr<T> t) : t_(std::move(t)) {}
  ~Handle() override {
    if (t_->table_ != nullptr) t_->table_->forget(*t_);
  }
  void cancel(const Error& reason) override {
    if (t_->table_ != nullptr) t_->table_->cancel(*t_, reason);
  }
  std::optional<Token> claim_secret() const override { return t_->secret; }
  T& get() noexcept { return *t_; }
  T* operator->() noexcept { return t_.get(); }

 private:
  std::unique_ptr<T> t_;
};

/// A transport's active transfers: ids, the observer report (deferred, once, never after
/// cancel()), and the finish / cancel / forget sequence every method shares. Loop thread only.
template <class T>
class TransferTable {
 public:
  TransferTable(Defer defer, TransferHooks<T>& hooks) : defer_(std::move(defer)), hooks_(hooks) {}
  ~TransferTable() { detach_all(); }
  TransferTable(const TransferTable&) = delete;
  TransferTable& operator=(const TransferTable&) = delete;

  /// A new transfer in the table; its handle goes to the caller of start().
  template <class... Args>
  std::unique_ptr<Handle<T>> make(TransferSpec spec, TransferObserver& observer, Args&&... args) {
    auto t = std::make_unique<T>(std::move(spec), observer, std::forward<Args>(args)...);
    t->table_ = this;
    t->id_ = next_++;
    live_.emplace(t->id_, t.get());
    return std::make_unique<Handle<T>>(std::move(t));
  }
  /// The transfer with `id`, if its handle still lives.
  T* find(std::uint64_t id) const {
    auto it = live_.find(id);
    return it == live_.end() ? nullptr : it->second;
  }
  /// Ends `t`: stops it, then its observer hears `error` (none: complete; `setup`: failed before
  /// touching any memory) after the current callback, unless it is cancelled or forgotten
  /// first. No effect on a transfer that has ended.
  void finish(T& t, std::optional<Error> error, bool setup = false) {
    if (t.finished_) return;
    t.finished_ = true;
    hooks_.stop(t);
    life_.defer(defer_, [this, id = t.id_, error = std::move(error), setup] {
      T* live = find(id);
      if (live == nullptr || live->reported_) return;
      live->reported_ = true;
      report(*live->observer_, error, setup);
    });
  }
  /// Transfer::cancel: ends `t` with `reason` (the peer hears it), waits for the method's work
  /// to settle, and lets it go: no observer call follows.
  void cancel(T& t, const Error& reason) {
    if (!t.finished_) {
      finish(t, reason);
      hooks_.tell_peer(t, reason);
    }
    release(t);
  }
  /// The handle is destroyed: an unfinished transfer is cancelled.
  void forget(T& t) {
    if (!t.finished_) {
      cancel(t, Error(ErrorCode::Cancelled, "the operation was destroyed"));
      return;
    }
    release(t);
  }
  /// The transport closes: every transfer ends without a report, and is let go (its handle
  /// then does nothing). `stop` runs for each first.
  void detach_all() {
    life_.renew();
    auto all = std::move(live_);
    live_.clear();
    for (auto& [id, t] : all) {
      if (!t->finished_) {
        t->finished_ = true;
        hooks_.stop(*t);
      }
      t->reported_ = true;
      t->table_ = nullptr;
    }
  }
  /// The live transfers, by id.
  std::vector<T*> all() const {
    std::vector<T*> out;
    out.reserve(live_.size());
    for (const auto& [id, t] : live_) out.push_back(t);
    return out;
  }
  bool empty() const noexcept { return live_.empty(); }

 private:
  void release(T& t) {
    t.reported_ = true;
    hooks_.settle(t);
    live_.erase(t.id_);
    t.table_ = nullptr;
  }

  Defer defer_;
  TransferHooks<T>& hooks_;
  Lifetime life_;
  std::unordered_map<std::uint64_t, T*> live_;
  std::uint64_t next_ = 1;
};

}  // namespace ferry::transport::kit
