#pragma once

// A fault-injecting decorator of a real transport (cma by default): everything is the real
// transport's, except that start(), as the policy says, refuses the transfer at set-up as the
// kernel would refuse process_vm_readv (EPERM) -- reported to the observer from the loop, or
// thrown from start() itself. FaultyTransportFactory puts it in place of the built-in method
// for the connectors created while it lives.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "sdk/src/transport_registry.hpp"
#include "transport/transport.hpp"

namespace ferry::test {

/// What start() does.
enum class SetupFault : std::uint8_t {
  none,            ///< the real transport's start()
  report_failure,  ///< returns a transfer whose observer hears, deferred to the loop,
                   ///< on_transfer_setup_failed(Error(Unsupported, "...: EPERM (injected)"))
  throw_error,     ///< throws Error(Unsupported, "...: EPERM (injected)")
};

/// Shared by a test and the decorators made for it: the policy, and what they counted.
/// Any thread.
class FaultyControl {
 public:
  void set_fault(SetupFault fault) noexcept { fault_.store(fault); }
  SetupFault fault() const noexcept { return fault_.load(); }
  /// start() calls, refused or not.
  std::uint64_t setup_attempts() const noexcept { return attempts_.load(); }
  /// start() calls refused by the policy.
  std::uint64_t injected() const noexcept { return injected_.load(); }
  /// Transports decorated.
  std::uint64_t transports_made() const noexcept { return made_.load(); }

 private:
  friend class FaultyTransport;
  friend class FaultyTransportFactory;
  std::atomic<SetupFault> fault_{SetupFault::none};
  std::atomic<std::uint64_t> attempts_{0};
  std::atomic<std::uint64_t> injected_{0};
  std::atomic<std::uint64_t> made_{0};
};

/// See the file comment. Loop thread only, as the transport it wraps.
class FaultyTransport final : public transport::Transport {
 public:
  using Defer = transport::Defer;
  FaultyTransport(std::unique_ptr<transport::Transport> inner, Defer defer,
                  std::shared_ptr<FaultyControl> control);
  ~FaultyTransport() override;

  const transport::Capabilities& capabilities() const override { return inner_->capabilities(); }
  std::vector<Endpoint> endpoints() const override { return inner_->endpoints(); }
  std::shared_ptr<const transport::Registration> register_memory(
      const transport::Region& region) override {
    return inner_->register_memory(region);
  }
  std::shared_ptr<const transport::Registration> register_exposed(
      const transport::Region& region) override {
    return inner_->register_exposed(region);
  }
  std::string expose(const transport::Exposure& exposure,
                     transport::ExposureObserver& observer) override {
    return inner_->expose(exposure, observer);
  }
  void revoke(std::uint64_t id, const Error& reason) override { inner_->revoke(id, reason); }
  std::optional<Error> unreachable(const Endpoint& endpoint) const override {
    return inner_->unreachable(endpoint);
  }
  std::optional<Error> endpoint_error(const Endpoint& endpoint) const override {
    return inner_->endpoint_error(endpoint);
  }
  std::unique_ptr<transport::Transfer> start(transport::TransferSpec spec,
                                             transport::TransferObserver& observer) override;
  void close() override;

 private:
  std::unique_ptr<transport::Transport> inner_;
  Defer defer_;
  std::shared_ptr<FaultyControl> control_;
  /// Deferred observer calls hold it weakly: none runs once the transport is closed.
  std::shared_ptr<int> life_ = std::make_shared<int>(0);
};

/// Registers, with ferry::detail::add_method, a method that makes the built-in
/// `method`'s transport and wraps it in a FaultyTransport sharing control(); the destructor
/// removes it, so that connectors created after use the built-in method again. The method's
/// availability, rank and needs stay the built-in's. Throws std::invalid_argument when this
/// build has no such method. Any thread.
class FaultyTransportFactory {
 public:
  explicit FaultyTransportFactory(std::string method = "cma");
  ~FaultyTransportFactory();
  FaultyTransportFactory(const FaultyTransportFactory&) = delete;
  FaultyTransportFactory& operator=(const FaultyTransportFactory&) = delete;

  FaultyControl& control() noexcept { return *control_; }

 private:
  std::string method_;
  std::shared_ptr<FaultyControl> control_ = std::make_shared<FaultyControl>();
};

}  // namespace ferry::test
