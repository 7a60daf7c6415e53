#pragma once

#include <optional>
#include <string>

#include <ferry/error.hpp>

#include "transport/memory.hpp"

namespace ferry::sidechannel {
struct Message;
}

namespace ferry::detail {

class Core;
class PassiveOperation;
class ActiveOperation;
class RegionState;

/// Pairing by subject (docs/sidechannel.md), all of it: the passive side serves its metadata
/// at a subject, the active side asks for it there, and tells the owner how it ended by a
/// completion notice. Loop thread only.
namespace pairing {

/// The metadata document `op` serves: its metadata, with adjacent descriptors merged when it
/// would not fit the server's max_payload. Throws InvalidArgument naming both sizes when it
/// still does not fit.
std::string document(Core& core, const PassiveOperation& op);

/// Serves `document` at `subject` until stop_serving(); `op.served` becomes ready once the
/// server has the subscription. A subject that cannot be served errors the operation.
void serve(Core& core, PassiveOperation& op, const std::string& subject, std::string document);
void stop_serving(Core& core, PassiveOperation& op);
/// Serves `region`'s metadata at its options.subject while it is open (RegionState::end stops
/// it). Throws InvalidArgument when the document does not fit the server's max_payload.
void serve_region(Core& core, RegionState& region);

/// Asks for the metadata at `op.asking->subject` (again): the first valid answer starts the
/// transfer; "no responders" and ended servers are asked again with a growing back-off, an
/// unanswered request after request_timeout.
void ask(ActiveOperation& op);
void stop_asking(ActiveOperation& op);

/// Tells the owner of `op.remote` how `op` ended (`error` empty: complete), with the claim
/// secret the owner handed to the transfer, if any.
void notify_owner(ActiveOperation& op, const std::optional<Error>& error,
                  const std::optional<transport::Token>& claim);

/// A completion notice arrived at this connector's notice subject.
void on_notice(Core& core, const sidechannel::Message& message);

/// The answer a finished operation's subscription gives while the server still routes
/// requests to it: the asker asks again at once instead of waiting for request_timeout.
inline constexpr const char* kEndedAnswer = R"({"version":1,"ended":true})";

}  // namespace pairing
}  // namespace ferry::detail
