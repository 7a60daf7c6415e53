#include "tests/support/faulty_transport.hpp"

#include <stdexcept>

namespace ferry::test {

namespace {

/// A transfer refused at set-up: nothing to stop, only the observer call to call off.
class RefusedTransfer final : public transport::Transfer {
 public:
  ~RefusedTransfer() override { *live = false; }
  void cancel(const Error&) override { *live = false; }
  std::shared_ptr<bool> live = std::make_shared<bool>(true);
};

Error injected(transport::Access access) {
  return Error(
      ErrorCode::Unsupported,
      std::string(access == transport::Access::read ? "process_vm_readv" : "process_vm_writev") +
          ": EPERM (injected)");
}

}  // namespace

FaultyTransport::FaultyTransport(std::unique_ptr<transport::Transport> inner, Defer defer,
                                 std::shared_ptr<FaultyControl> control)
    : inner_(std::move(inner)), defer_(std::move(defer)), control_(std::move(control)) {}

FaultyTransport::~FaultyTransport() { close(); }

std::unique_ptr<transport::Transfer> FaultyTransport::start(transport::TransferSpec spec,
                                                            transport::TransferObserver& observer) {
  ++control_->attempts_;
  switch (control_->fault()) {
    case SetupFault::none:
      return inner_->start(std::move(spec), observer);
    case SetupFault::throw_error:
      ++control_->injected_;
      throw injected(spec.access);
    case SetupFault::report_failure: {
      ++control_->injected_;
      auto t = std::make_unique<RefusedTransfer>();
      // As a real transport does: never from inside start(), never after cancel().
      defer_([life = std::weak_ptr<int>(life_), live = t->live, &observer,
              error = injected(spec.access)] {
        if (life.expired() || !*live) return;
        *live = false;
        observer.on_transfer_setup_failed(error);
      });
      return t;
    }
  }
  throw Error(ErrorCode::Internal, "unknown injected fault");
}

void FaultyTransport::close() {
  life_.reset();
  inner_->close();
}

FaultyTransportFactory::FaultyTransportFactory(std::string name) : method_(std::move(name)) {
  transport::Method real;
  bool found = false;
  for (transport::Method& m : detail::methods())
    if (m.name == method_) {
      real = std::move(m);
      found = true;
    }
  if (!found) throw std::invalid_argument("this build has no method '" + method_ + "'");
  transport::Method method = real;
  method.make = [make = real.make, control = control_](
                    const transport::Context& context,
                    const ConnectorOptions& options) -> std::unique_ptr<transport::Transport> {
    auto inner = make(context, options);
    ++control->made_;
    return std::make_unique<FaultyTransport>(std::move(inner), context.defer, control);
  };
  detail::add_method(std::move(method));
}

FaultyTransportFactory::~FaultyTransportFactory() { detail::remove_method(method_); }

}  // namespace ferry::test
