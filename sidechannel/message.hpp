#pragma once

#include <functional>
#include <string>

namespace ferry::sidechannel {

/// A message as the loop sees it (copied out of cnats).
struct Message {
  std::string subject;
  std::string reply;
  std::string data;
  bool no_responders = false;  ///< the server's answer to a request nobody listens to
};
using MessageHandler = std::function<void(const Message&)>;

}  // namespace ferry::sidechannel
