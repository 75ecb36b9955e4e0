#pragma once
// The largest error of an output against its reference, made so that bad data fails: every float64
// comparison of the unit tests goes through it. `std::max(worst, err)` skips a NaN error (max(0, NaN) is 0),
// so an all-NaN output passes a `worst <= tol` check; here a NaN or an infinity in either operand makes the
// worst error +infinity, and so do operands of different sizes, each with a message that says which.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <ostream>
#include <sstream>
#include <string>

namespace kvmem_test {

/// The largest error over a tensor's elements, NaN-aware: value() is +infinity once an element's error is
/// NaN or infinite (a NaN or an infinity in the output or in its reference) or once the operands' sizes
/// differ, and problem() says what happened first. It compares with a tolerance as the double it stands
/// for, `CHECK(worst <= tol)`, and Catch2 prints it with its problem when the check fails.
class WorstError {
 public:
  /// One element's error, computed from the output and its reference (|got - want|, a relative error, an
  /// excess over a bound) so that a NaN or an infinity in either reaches it: the largest finite one is
  /// kept; a NaN or infinite one makes the worst +infinity.
  void add_error(double error) {
    if (!std::isfinite(error)) {
      std::ostringstream what;
      what << "the error of element " << elements_ << " is " << error;
      fail(what.str());
    } else if (error > worst_) {
      worst_ = error;
    }
    ++elements_;
  }
  /// |got - want| of one element; a NaN or an infinity in either operand makes the worst +infinity.
  void add(double got, double want) {
    if (!std::isfinite(got) || !std::isfinite(want)) {
      std::ostringstream what;
      what << "element " << elements_ << ": got " << got << ", want " << want;
      fail(what.str());
      ++elements_;
      return;
    }
    add_error(std::abs(got - want));
  }
  /// Every element of `got` against the same element of `want` (anything with size() and operator[]);
  /// sizes that differ make the worst +infinity without reading either.
  template <class Got, class Want>
  void add_all(const Got& got, const Want& want) {
    if (got.size() != want.size()) {
      fail("sizes differ: got " + std::to_string(got.size()) + " elements, want " + std::to_string(want.size()));
      return;
    }
    for (std::size_t i = 0; i < want.size(); ++i) add(static_cast<double>(got[i]), static_cast<double>(want[i]));
  }
  /// The worst error divided by `scale` (> 0), a relative error; +infinity and the problem stay.
  [[nodiscard]] WorstError relative_to(double scale) const {
    WorstError e = *this;
    if (std::isfinite(e.worst_)) e.worst_ /= scale;
    return e;
  }

  [[nodiscard]] double value() const { return worst_; }
  /// What made the worst error +infinity (the first NaN or infinite element, or the sizes), else empty.
  [[nodiscard]] const std::string& problem() const { return problem_; }

  friend bool operator<=(const WorstError& e, double tolerance) { return e.worst_ <= tolerance; }
  friend bool operator<(const WorstError& e, double tolerance) { return e.worst_ < tolerance; }
  friend bool operator==(const WorstError& e, double x) { return e.worst_ == x; }
  friend std::ostream& operator<<(std::ostream& os, const WorstError& e) {
    os << e.worst_;
    if (!e.problem_.empty()) os << " (" << e.problem_ << ")";
    return os;
  }

 private:
  void fail(const std::string& what) {
    if (problem_.empty()) problem_ = what;
    worst_ = std::numeric_limits<double>::infinity();
  }

  double worst_ = 0.0;
  long elements_ = 0;
  std::string problem_;
};

/// Largest |got[i] - want[i]| over two tensors of the same size, NaN-aware (WorstError).
template <class Got, class Want>
WorstError worst_abs_error(const Got& got, const Want& want) {
  WorstError e;
  e.add_all(got, want);
  return e;
}

/// Largest |got[i] - want[i]| / max(1, max |want|), NaN-aware (WorstError): the relative error measure of
/// the acceptance checks.
template <class Got, class Want>
WorstError relative_error(const Got& got, const Want& want) {
  double scale = 1.0;
  for (std::size_t i = 0; i < want.size(); ++i) scale = std::max(scale, std::abs(static_cast<double>(want[i])));
  return worst_abs_error(got, want).relative_to(scale);
}

}  // namespace kvmem_test
