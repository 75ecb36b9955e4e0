#pragma once
/// \file errors.hpp
/// The exception kvmem throws for bad input, and the helpers that build its message.
///
/// Every check runs on the host before any kernel is launched. The message always names the
/// parameter (a config field, a tensor, a command-line flag) and the offending value, so a user can
/// fix the call without reading kvmem's source.

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvmem {

/// Thrown for any invalid parameter, shape or file. `what()` reads "<parameter> = <value>: <reason>".
class invalid_argument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {
/// Builds "name = value: reason" (value streamed with operator<<).
template <class Value>
[[nodiscard]] std::string describe(const std::string& name, const Value& value, const std::string& reason) {
  std::ostringstream os;
  os << name << " = " << value << ": " << reason;
  return os.str();
}
}  // namespace detail

/// Throws kvmem::invalid_argument("name = value: reason") unless `ok`.
template <class Value>
void require(bool ok, const std::string& name, const Value& value, const std::string& reason) {
  if (!ok) throw invalid_argument(detail::describe(name, value, reason));
}

}  // namespace kvmem
