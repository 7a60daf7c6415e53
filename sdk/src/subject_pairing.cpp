#include "sdk/src/subject_pairing.hpp"

#include <algorithm>

#include "loop/ids.hpp"
#include "sdk/src/active_operation.hpp"
#include "sdk/src/core.hpp"
#include "sdk/src/passive_operation.hpp"
#include "sdk/src/region_state.hpp"
#include "sidechannel/pairing.hpp"
#include "transport/token.hpp"

namespace ferry::detail::pairing {

namespace {

// Requests of one operation left open at once: a late answer to any of them still pairs, but a
// subscriber that never answers cannot make them pile up.
constexpr std::size_t kMaxOpenRequests = 4;

void on_retry(uv_timer_t* timer) {
  auto* op = static_cast<ActiveOperation*>(timer->data);
  if (op == nullptr || is_final(op->status())) return;
  auto keep = op->shared_from_this();
  loop::guarded(
      op->core->loop->log(), "metadata request",
      [&] {
        if (op->core->nats) ask(*op);
      },
      [op](const char* what) {
        op->finish(OperationStatus::errored,
                   Error(ErrorCode::SideChannel, std::string("asking for the metadata: ") + what));
      });
}

void retry_after(ActiveOperation& op, std::chrono::milliseconds delay) {
  uv_timer_start(op.asking->retry.get(), on_retry, static_cast<std::uint64_t>(delay.count()), 0);
}

bool is_ended_answer(const std::string& data) {
  // Cheap first: metadata documents never start this way.
  return data.size() < 64 && data.find("\"ended\"") != std::string::npos;
}

void on_answer(ActiveOperation& op, std::uint64_t request, const sidechannel::Message& reply) {
  if (!op.asking) return;
  std::erase(op.asking->requests, request);
  if (is_final(op.status()) || op.remote) return;
  if (reply.no_responders || is_ended_answer(reply.data)) {
    // Nobody serves the subject (yet, or any more). The first time, ask again at once (the
    // server may only just be getting the subscription); then after 1, 2, 4 ... ms, up to a
    // quarter second.
    using std::chrono::milliseconds;
    retry_after(op, op.asking->backoff);
    op.asking->backoff = std::clamp(op.asking->backoff * 2, milliseconds(1), milliseconds(250));
    return;
  }
  const std::string subject = op.asking->subject;
  stop_asking(op);  // the first answer wins; the others are dropped
  op.paired();
  auto keep = op.shared_from_this();
  try {
    op.start(RdmaMetadata::from_json(reply.data));
  } catch (const Error& e) {
    op.finish(
        OperationStatus::errored,
        Error(e.code(), "the metadata served at '" + subject + "': " + e.message(), e.field()));
  } catch (const std::exception& e) {
    // Whatever went wrong, the operation ends: it never stays in_progress.
    op.finish(OperationStatus::errored,
              Error(ErrorCode::Internal,
                    "the metadata served at '" + subject + "' could not be used: " + e.what()));
  }
}

}  // namespace

std::string document(Core& core, const PassiveOperation& op) {
  std::string doc = op.metadata.to_json();
  const auto limit = static_cast<std::uint64_t>(core.nats->max_payload());
  if (doc.size() <= limit) return doc;
  RdmaMetadata merged = coalesced(op.metadata);
  doc = merged.to_json();
  if (doc.size() > limit)
    throw Error(ErrorCode::InvalidArgument,
                "the metadata of " + std::to_string(doc.size()) + " bytes (" +
                    std::to_string(merged.descriptors.size()) +
                    " descriptors after merging adjacent ones) exceeds the NATS server's "
                    "max_payload of " +
                    std::to_string(limit) + " bytes");
  return doc;
}

void serve(Core& core, PassiveOperation& op, const std::string& subject, std::string doc) {
  auto registered = std::make_shared<std::promise<void>>();
  op.served = registered->get_future().share();
  std::weak_ptr<OperationState> weak = op.shared_from_this();
  std::weak_ptr<PassiveOperation> passive =
      std::static_pointer_cast<PassiveOperation>(op.shared_from_this());
  op.subject = subject;
  // Answered on cnats' delivery thread, not the loop (two thread hops less per pairing): the
  // document is fixed, and whether the operation has ended is an atomic status.
  op.serving = core.nats->serve(
      subject,
      [passive, doc = std::move(doc)](const std::string&) {
        auto live = passive.lock();
        const bool ended = !live || is_final(live->status());
        if (live) live->asked = true;
        return ended ? std::string(kEndedAnswer) : doc;
      },
      [registered, weak](const std::string& error) {
        // A subject that cannot be served fails the operation: nobody could ever pair.
        if (auto o = weak.lock(); o && !error.empty())
          o->finish(OperationStatus::errored, Error(ErrorCode::SideChannel, error));
        registered->set_value();
      });
}

void serve_region(Core& core, RegionState& region) {
  std::string doc = region.metadata.to_json();
  const auto limit = static_cast<std::uint64_t>(core.nats->max_payload());
  if (doc.size() > limit)
    throw Error(ErrorCode::InvalidArgument, "the region's metadata of " +
                                                std::to_string(doc.size()) +
                                                " bytes exceeds the NATS server's max_payload of " +
                                                std::to_string(limit) + " bytes");
  auto registered = std::make_shared<std::promise<void>>();
  region.served = registered->get_future().share();
  std::weak_ptr<RegionState> weak = region.shared_from_this();
  region.serving = core.nats->serve(
      region.options.subject,
      [weak, doc = std::move(doc)](const std::string&) {
        auto live = weak.lock();
        return live && live->is_open() ? doc : std::string(kEndedAnswer);
      },
      [registered, weak](const std::string& error) {
        // A subject that cannot be served ends the region: nobody could attach by it.
        if (auto r = weak.lock(); r && !error.empty()) r->end(Error(ErrorCode::SideChannel, error));
        registered->set_value();
      });
}

void stop_serving(Core& core, PassiveOperation& op) {
  if (op.serving != 0 && core.nats) core.nats->unsubscribe(op.serving, kEndedAnswer);
  op.serving = 0;
}

void ask(ActiveOperation& op) {
  auto& nats = *op.core->nats;
  auto& a = *op.asking;
  sidechannel::MetadataRequest request{op.kind, op.core->identity.name};
  std::weak_ptr<OperationState> weak = op.shared_from_this();
  auto id = std::make_shared<std::uint64_t>(0);
  *id = nats.request(a.subject, sidechannel::encode(request),
                     [weak, id](const sidechannel::Message& m) {
                       if (auto self = weak.lock())
                         on_answer(static_cast<ActiveOperation&>(*self), *id, m);
                     });
  a.requests.push_back(*id);
  while (a.requests.size() > kMaxOpenRequests) {
    nats.cancel_request(a.requests.front());
    a.requests.erase(a.requests.begin());
  }
  if (!a.retry) a.retry = loop::Timer::timer(op.core->loop->uv(), &op);
  // An answer lost in a reconnect (or a subscriber that never answers) is asked for again
  // after request_timeout.
  retry_after(op, op.core->options.nats.request_timeout);
}

void stop_asking(ActiveOperation& op) {
  if (!op.asking) return;
  if (op.core->nats)
    for (std::uint64_t r : op.asking->requests) op.core->nats->cancel_request(r);
  op.asking->requests.clear();
  op.asking->retry.reset();
}

void notify_owner(ActiveOperation& op, const std::optional<Error>& error,
                  const std::optional<transport::Token>& claim) {
  Core& core = *op.core;
  if (!core.nats || !op.remote) return;
  sidechannel::CompletionNotice notice{op.remote->notification_key,
                                       op.remote->token,
                                       core.identity.name,
                                       core.identity.id,
                                       error,
                                       {}};
  if (claim) notice.claim = transport::token_to_hex(*claim);
  core.nats->publish(core.nats->own_subject("notify." + op.remote->owner.id),
                     sidechannel::encode(notice));
}

void on_notice(Core& core, const sidechannel::Message& message) {
  auto notice = sidechannel::decode_notice(message.data);
  std::uint64_t key = 0;
  if (!notice || !loop::parse_hex16(notice->key, key)) return;
  auto it = core.live.find(key);
  if (it == core.live.end()) return;
  auto op = std::dynamic_pointer_cast<PassiveOperation>(it->second.lock());
  // Only failures count: every transport reports a completed transfer itself (TCP's DONE),
  // and a "complete" from the side channel could end an operation nobody wrote. Only for
  // operations served at a subject, whose peers may never reach them by a transport.
  if (!notice->error || !op || op->serving == 0) return;
  if (!op->accepts_notice(notice->token, notice->claim)) return;
  op->finish(OperationStatus::errored,
             Error(notice->error->code(),
                   "peer '" + loop::sanitized_utf8(notice->from) +
                       "' ended the transfer: " + loop::sanitized_utf8(notice->error->message())));
}

}  // namespace ferry::detail::pairing
