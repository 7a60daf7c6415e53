#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "transport/context.hpp"
#include "transport/kit/lifetime.hpp"
#include "transport/region.hpp"

namespace ferry::transport::kit {

/// A transfer refused at start(): it fails with `error` later (through `defer`), having moved
/// nothing; cancelling or destroying it first silences it.
class RefusedTransfer final : public Transfer {
 public:
  RefusedTransfer(const Defer& defer, Error error, TransferObserver& observer) {
    life_.defer(defer,
                [error = std::move(error), &observer] { observer.on_transfer_failed(error); });
  }
  void cancel(const Error&) override { life_.end(); }

 private:
  Lifetime life_;
};

/// Why a transfer's remote ranges are not all inside `region` (pairs of address and length),
/// or none. An empty `region` checks nothing.
inline std::optional<Error> outside(
    const std::vector<std::pair<std::uint64_t, std::uint64_t>>& region,
    const std::vector<Segment>& segments) {
  if (region.empty()) return std::nullopt;
  for (const Segment& s : segments) {
    bool inside = s.len > 0;
    if (inside) {
      inside = false;
      for (const auto& [base, size] : region)
        if (s.remote_addr >= base && s.len <= size && s.remote_addr - base <= size - s.len) {
          inside = true;
          break;
        }
    }
    if (!inside)
      return Error(ErrorCode::AccessDenied, "range of " + std::to_string(s.len) + " bytes at " +
                                                std::to_string(s.remote_addr) +
                                                " is empty or outside the region");
  }
  return std::nullopt;
}

/// What every method's active side of an attachment shares: the spec, its state (attaching,
/// attached, over) and the observer calls, each made once, later (through `defer`), and never
/// after the object is gone. A method derives from it and adds its connection and credential.
/// Loop thread only.
class RemoteRegionBase : public RemoteRegion {
 public:
  RemoteRegionBase(Defer defer, AttachSpec spec, AttachObserver& observer)
      : defer_(std::move(defer)), spec_(std::move(spec)), observer_(&observer) {}
  ~RemoteRegionBase() override { life_.end(); }

  const AttachSpec& spec() const noexcept { return spec_; }

  /// For start(): a transfer that reaches outside the region, refused before any byte moves
  /// (it fails AccessDenied, later); null for one inside it.
  std::unique_ptr<Transfer> refuse_outside(const TransferSpec& spec,
                                           TransferObserver& observer) const {
    std::optional<Error> why = outside(spec_.ranges, spec.segments);
    if (!why) return nullptr;
    return std::make_unique<RefusedTransfer>(defer_, std::move(*why), observer);
  }
  bool attached() const noexcept { return state_ == State::attached; }

  /// The owner answered ATTACH: transfers may start.
  void on_attach() {
    if (state_ != State::attaching) return;
    state_ = State::attached;
    report([](AttachObserver& o) { o.on_attached(); });
  }
  /// The owner refused ATTACH.
  void on_refused(const Error& error) {
    if (state_ != State::attaching) return;
    state_ = State::over;
    report([error](AttachObserver& o) { o.on_attach_failed(error, false); });
  }
  /// The owner ended the attachment (revoked it, or ended the region).
  void on_ended(const Error& error) {
    if (state_ != State::attached) return;
    state_ = State::over;
    report([error](AttachObserver& o) { o.on_detached(error); });
  }
  /// The connection closed; `setup`: before the owner was reached.
  void on_lost(const Error& error, bool setup) {
    const State was = state_;
    state_ = State::over;
    if (was == State::attaching)
      report([error, setup](AttachObserver& o) { o.on_attach_failed(error, setup); });
    else if (was == State::attached)
      report([error](AttachObserver& o) { o.on_detached(error); });
  }

 protected:
  /// Throws Error(InvalidState) unless attached.
  void check_attached() const {
    if (state_ != State::attached)
      throw Error(ErrorCode::InvalidState, state_ == State::attaching
                                               ? "the attachment is not attached yet"
                                               : "the attachment has ended");
  }

 private:
  enum class State { attaching, attached, over };
  void report(std::function<void(AttachObserver&)> call) {
    life_.defer(defer_, [this, call = std::move(call)] { call(*observer_); });
  }

  Defer defer_;
  AttachSpec spec_;
  AttachObserver* observer_;
  State state_ = State::attaching;
  Lifetime life_;
};

}  // namespace ferry::transport::kit
