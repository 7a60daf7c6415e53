#include "sidechannel/subjects.hpp"

#include <vector>

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
