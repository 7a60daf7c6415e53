#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace ferry::sidechannel {

/// Why `pattern` cannot be subscribed to ("has an empty token"), or none when it can: as
/// subject_problem() (nats_channel.hpp), but a token may be the wildcard `*` (any one token) or,
/// last, `>` (one or more tokens). A token that holds a wildcard among other characters is
/// refused ("a*" would be a literal to the server, but reads as a pattern).
std::optional<std::string> pattern_problem(std::string_view pattern);

/// Whether a subject in the namespace "<prefix>." (a subject of more tokens than `prefix`,
/// starting with them) can match `pattern` (a literal subject, or one that pattern_problem()
/// accepts): "ferry.>", "*.inbox.x", ">" and "ferry.notify.1" reach "ferry"'s namespace;
/// "ferry", "ferryx.>" and "*" do not.
bool reaches_namespace(std::string_view pattern, std::string_view prefix);

}  // namespace ferry::sidechannel
