#pragma once

#include <string>
#include <vector>

#include <ferry/connector.hpp>

#include "transport/method.hpp"

namespace ferry::detail {

/// The methods connectors know: this build's (transport::builtin_methods(), each described once
/// in its folder), then those added by add_method(), which replace a built-in method of the
/// same name. Every connector starts one transport per method, unless
/// ConnectorOptions::transports leaves it out. Any thread.
std::vector<transport::Method> methods();

/// Adds a method for connectors created from now on, in this process (tests add a fake
/// transport, or verbs on a simulated fabric, this way). Replaces the method of the same name,
/// built in or added before. Any thread.
void add_method(transport::Method method);
/// Removes a method added by add_method. Any thread.
void remove_method(const std::string& name);

/// What MethodInfo says of `method` before a connector runs it.
MethodInfo describe(const transport::Method& method);

}  // namespace ferry::detail
