#include "sidechannel/subjects.hpp"

#include <vector>

#include "loop/ids.hpp"
#include "sidechannel/nats_channel.hpp"

namespace ferry::sidechannel {

namespace {

std::vector<std::string_view> tokens(std::string_view subject) {
  std::vector<std::string_view> out;
  for (std::size_t start = 0;;) {
    const std::size_t dot = subject.find('.', start);
    out.push_back(subject.substr(start, dot == std::string_view::npos ? dot : dot - start));
    if (dot == std::string_view::npos) return out;
    start = dot + 1;
  }
}

}  // namespace

std::optional<std::string> subject_problem(std::string_view subject) {
  if (subject.empty()) return "is empty";
  if (subject.size() > 1024) return "is longer than 1024 characters";
  std::size_t start = 0;
  for (;;) {
    std::size_t dot = subject.find('.', start);
    std::string_view token =
        subject.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start);
    if (token.empty()) return "has an empty token";
    if (token.find_first_of("*>") != std::string_view::npos) return "contains a wildcard";
    for (char c : token)
      if (static_cast<unsigned char>(c) <= ' ' || c == 0x7f)
        return "contains whitespace or a control character";
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  return std::nullopt;
}

bool is_reply_inbox(std::string_view prefix, std::string_view subject) {
  // "<prefix>.inbox.<16 hex>.r<1..16 hex>", exactly as request() writes it.
  constexpr std::string_view kInbox = ".inbox.";
  if (subject.size() <= prefix.size() + kInbox.size() ||
      subject.substr(0, prefix.size()) != prefix ||
      subject.substr(prefix.size(), kInbox.size()) != kInbox)
    return false;
  std::string_view rest = subject.substr(prefix.size() + kInbox.size());
  if (rest.size() < 16 + 3 || rest.size() > 16 + 2 + 16) return false;
  std::string_view id = rest.substr(0, 16);
  std::string_view n = rest.substr(18);
  return loop::is_lower_hex(id) && rest[16] == '.' && rest[17] == 'r' && loop::is_lower_hex(n) &&
         n[0] != '0';
}

std::optional<std::string> pattern_problem(std::string_view pattern) {
  if (pattern.empty()) return "is empty";
  if (pattern.size() > 1024) return "is longer than 1024 characters";
  const std::vector<std::string_view> parts = tokens(pattern);
  // Each wildcard token is checked here; the rest of the pattern, with the wildcards put as
  // plain tokens, by subject_problem's rules.
  std::string literal;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    std::string_view t = parts[i];
    if (t == ">" && i + 1 != parts.size()) return "has '>' before its last token";
    if (t.size() > 1 && t.find_first_of("*>") != std::string_view::npos)
      return "has a wildcard inside a token ('" + std::string(t) + "')";
    if (i > 0) literal += '.';
    literal += t == "*" || t == ">" ? std::string_view("w") : t;
  }
  return subject_problem(literal);
}

bool reaches_namespace(std::string_view pattern, std::string_view prefix) {
  const std::vector<std::string_view> p = tokens(pattern);
  const std::vector<std::string_view> q = tokens(prefix);
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (p[i] == ">") return true;    // matches one or more tokens: some of them ferry's
    if (i == q.size()) return true;  // the prefix matched, and more tokens follow
    if (p[i] != "*" && p[i] != q[i]) return false;
  }
  return false;  // no longer than the prefix: not inside its namespace
}

}  // namespace ferry::sidechannel
