// The test of the tests' float64 comparison (worst_error.hpp): bad data fails it. An output of NaN or of
// infinities, a NaN or an infinity in the reference, and an output of another size each give a worst error
// of +infinity that no `<= tol` check passes, with a message that says which; good data gives its error.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "worst_error.hpp"

using Catch::Matchers::ContainsSubstring;
using kvmem_test::WorstError;

namespace {
constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();
constexpr float inf_f = std::numeric_limits<float>::infinity();
const std::vector<double> reference{0.5, -1.25, 2.0, 0.0};

/// Whether a worst error fails every tolerance a test uses, and prints as infinite with its problem.
bool fails(const WorstError& e) {
  std::ostringstream printed;
  printed << e;
  return !(e <= 1e30) && !(e < 1e30) && !(e == 0.0) && std::isinf(e.value()) && !e.problem().empty() &&
         printed.str().find(e.problem()) != std::string::npos;
}
}  // namespace

TEST_CASE("worst error: good data gives the largest absolute and relative error", "[harness][numerics]") {
  const std::vector<float> got{0.5f, -1.0f, 2.0f, 0.125f};
  const auto abs = kvmem_test::worst_abs_error(got, reference);
  CHECK(abs.value() == 0.25);
  CHECK(abs <= 0.25);
  CHECK_FALSE(abs < 0.25);
  CHECK(abs.problem().empty());
  CHECK(kvmem_test::relative_error(got, reference).value() == 0.125);  // 0.25 / max(1, max |want| = 2)
  CHECK(kvmem_test::worst_abs_error(reference, reference) == 0.0);
  CHECK(kvmem_test::worst_abs_error(std::vector<float>{}, std::vector<double>{}) == 0.0);
}

TEST_CASE("worst error: an output of NaN fails, where std::max(worst, err) passed it", "[harness][numerics]") {
  const std::vector<float> all_nan(reference.size(), nan_f);
  double max_kept = 0.0;  // the comparison this header replaces
  for (std::size_t i = 0; i < reference.size(); ++i) max_kept = std::max(max_kept, std::abs(all_nan[i] - reference[i]));
  REQUIRE(max_kept == 0.0);  // std::max skips NaN: an all-NaN output passed every tolerance
  const auto e = kvmem_test::worst_abs_error(all_nan, reference);
  CHECK(fails(e));
  CHECK_THAT(e.problem(), ContainsSubstring("element 0") && ContainsSubstring("nan"));
  CHECK(fails(kvmem_test::relative_error(all_nan, reference)));
  std::vector<float> one_nan{0.5f, -1.25f, nan_f, 0.0f};
  CHECK_THAT(kvmem_test::worst_abs_error(one_nan, reference).problem(), ContainsSubstring("element 2"));
  CHECK(fails(kvmem_test::worst_abs_error(one_nan, reference)));
  const std::vector<double> nan_reference{0.5, std::nan(""), 2.0, 0.0};  // a NaN in the reference fails too
  CHECK(fails(kvmem_test::worst_abs_error(reference, nan_reference)));
}

TEST_CASE("worst error: an infinity in the output or the reference fails, equal infinities too", "[harness][numerics]") {
  for (float bad : {inf_f, -inf_f}) {
    const std::vector<float> got{0.5f, bad, 2.0f, 0.0f};
    CHECK(fails(kvmem_test::worst_abs_error(got, reference)));
    CHECK(fails(kvmem_test::relative_error(got, reference)));
    const std::vector<double> infinite_reference{0.5, double(bad), 2.0, 0.0};
    CHECK(fails(kvmem_test::worst_abs_error(got, infinite_reference)));  // inf - inf would be NaN
    CHECK(fails(kvmem_test::relative_error(std::vector<float>{0.5f, -1.25f, 2.0f, 0.0f}, infinite_reference)));
  }
}

TEST_CASE("worst error: outputs of another size fail, naming both sizes", "[harness][numerics]") {
  const std::vector<float> shorter{0.5f, -1.25f, 2.0f}, longer{0.5f, -1.25f, 2.0f, 0.0f, 9.0f};
  for (const auto* got : {&shorter, &longer}) {
    const auto e = kvmem_test::worst_abs_error(*got, reference);
    CHECK(fails(e));
    CHECK_THAT(e.problem(), ContainsSubstring("sizes differ: got " + std::to_string(got->size()) + " elements, want 4"));
    CHECK(fails(kvmem_test::relative_error(*got, reference)));
  }
  CHECK(fails(kvmem_test::worst_abs_error(std::vector<float>{}, reference)));
}

TEST_CASE("worst error: element by element, a NaN error fails and a later good element does not hide it",
          "[harness][numerics]") {
  WorstError worst;
  worst.add(1.0, 1.5);
  CHECK(worst.value() == 0.5);
  worst.add_error(std::nan(""));  // an error computed from a NaN output (an excess over a bound, a ratio)
  worst.add(2.0, 2.0);
  CHECK(fails(worst));
  CHECK_THAT(worst.problem(), ContainsSubstring("the error of element 1 is nan"));
  WorstError excess;  // exact_bound.hpp's form: |y - ref| - limit, within the bound below zero
  excess.add_error(-0.25);
  CHECK(excess <= 0.0);
  excess.add_error(std::abs(double(nan_f) - 1.0) - 0.5);
  CHECK(fails(excess));
  CHECK(fails(excess.relative_to(4.0)));  // infinity and the problem stay
}
