#pragma once

#include <string>

#include <ferry/options.hpp>

#include "loop/log.hpp"

namespace ferry::detail {

/// `o` with what the caller left empty filled from FERRY_NATS_* (docs/sidechannel.md), the
/// defaults applied and the values checked (InvalidArgument).
NatsOptions resolve(NatsOptions o, const std::string& connector_name);

/// The methods a connector may use: ConnectorOptions::transports, else FERRY_TRANSPORTS (when
/// ConnectorOptions::use_environment), else empty (all). Throws InvalidArgument naming an unknown
/// one.
std::vector<std::string> resolve_transports(const ConnectorOptions& o);

/// The connector's log: ConnectorOptions::log, its level from FERRY_LOG when left at the
/// default and the environment is read. Throws InvalidArgument for a FERRY_LOG that names no
/// level.
loop::Log resolve_log(const ConnectorOptions& o, const std::string& connector_name);

/// Throws InvalidArgument for a subject ferry cannot serve or ask at, or one in ferry's own
/// namespace `prefix`.
void check_subject(const std::string& subject, const std::string& prefix);

/// Throws InvalidArgument unless `text` is valid UTF-8 of at most `max` bytes without control
/// characters; `what` names it in the message.
void check_text(const std::string& text, const char* what, std::size_t max);

}  // namespace ferry::detail
