// The safetensors reader and writer: round trip, and clear errors for truncated or corrupt files.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <cmath>
#include <cstring>

#include <kvmem/io/safetensors.hpp>

using Catch::Matchers::ContainsSubstring;
using kvmem::io::SafetensorsFile;

namespace {
std::vector<unsigned char> file_of(const std::string& header, std::size_t data_bytes) {
  std::vector<unsigned char> bytes(8 + header.size() + data_bytes, 0);
  const std::uint64_t n = header.size();
  std::memcpy(bytes.data(), &n, 8);
  std::memcpy(bytes.data() + 8, header.data(), header.size());
  return bytes;
}
}  // namespace

TEST_CASE("safetensors round trip", "[io]") {
  SafetensorsFile f;
  const float a[] = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, 8.0f};
  const std::int64_t n[] = {3, 0};
  f.put("a", {2, 3}, a);
  f.put("n", {2}, n);
  f.metadata["source"] = "test";
  const std::string path = "/tmp/kvmem_test_roundtrip.safetensors";
  f.write(path);
  const auto g = SafetensorsFile::read(path);
  REQUIRE(g.at("a").shape == std::vector<std::int64_t>{2, 3});
  REQUIRE(kvmem::io::to_double(g.at("a"), "a") == std::vector<double>{1.5, -2.0, 3.25, 0.0, 7.0, 8.0});
  REQUIRE(kvmem::io::to_double(g.at("n"), "n") == std::vector<double>{3, 0});
  REQUIRE(g.metadata.at("source") == "test");
  REQUIRE_THROWS_WITH(g.at("q"), ContainsSubstring("'q'"));
}

TEST_CASE("corrupt safetensors files are rejected with a named reason", "[io][errors]") {
  auto parse = [](const std::vector<unsigned char>& b) { return SafetensorsFile::parse(b, "x.safetensors"); };
  REQUIRE_THROWS_WITH(parse({1, 2, 3}), ContainsSubstring("too short"));
  auto big = file_of("{}", 0);
  big[0] = 0xff;
  big[5] = 0x7f;
  REQUIRE_THROWS_WITH(parse(big), ContainsSubstring("header length"));
  REQUIRE_THROWS_WITH(parse(file_of("{not json", 0)), ContainsSubstring("not valid JSON"));
  REQUIRE_THROWS_WITH(parse(file_of("[1,2]", 0)), ContainsSubstring("must be a JSON object"));
  REQUIRE_THROWS_WITH(parse(file_of(R"({"a":{"dtype":"Q8","shape":[1],"data_offsets":[0,1]}})", 1)),
                      ContainsSubstring("unknown dtype"));
  REQUIRE_THROWS_WITH(parse(file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4)),
                      ContainsSubstring("data_offsets"));
  REQUIRE_THROWS_WITH(parse(file_of(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8)),
                      ContainsSubstring("need 12"));
  REQUIRE_THROWS_WITH(parse(file_of(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})", 0)),
                      ContainsSubstring("non-negative"));
  REQUIRE_THROWS_WITH(
      parse(file_of(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}})", 16)),
      ContainsSubstring("more elements than the file"));
  REQUIRE_THROWS_WITH(parse(file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                    R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                    12)),
                      ContainsSubstring("overlap"));
  REQUIRE_THROWS_WITH(SafetensorsFile::read("/nonexistent/file.safetensors"), ContainsSubstring("cannot be opened"));
  SafetensorsFile f;
  const std::int64_t i[] = {1};
  f.put("i", {1}, i);
  f.tensors["i"].dtype = "I16";
  f.tensors["i"].bytes.resize(2);
  f.tensors["i"].shape = {1};
  REQUIRE_THROWS_WITH(kvmem::io::to_double(f.at("i"), "i"), ContainsSubstring("dtype = I16"));
}

TEST_CASE("safetensors BF16 and F16 tensors round trip bit for bit and read exactly", "[io][dtype]") {
  // Normal values, -0, the extremes of each type's range and (float16) subnormals: each is a value of its
  // type, so to_double must give it back exactly, and the file must keep every bit.
  const float values[] = {1.0f, -2.5f, 0.1f, -0.0f, 3.0e38f, 1.0e-30f, 65504.0f, 0x1p-24f, 0x1p-14f, 1234.5f};
  constexpr std::size_t n = sizeof(values) / sizeof(values[0]);
  kvmem::bfloat16 bf[n];
  kvmem::float16 hf[n];
  for (std::size_t i = 0; i < n; ++i)
    bf[i] = kvmem::from_float<kvmem::bfloat16>(values[i]), hf[i] = kvmem::from_float<kvmem::float16>(values[i]);
  SafetensorsFile f;
  f.put("bf", {2, 5}, bf);
  f.put("hf", {5, 2}, hf);
  const auto g = SafetensorsFile::parse(f.serialize(), "dtypes.safetensors");
  REQUIRE(g.at("bf").dtype == "BF16");
  REQUIRE(g.at("hf").dtype == "F16");
  REQUIRE(g.at("bf").shape == std::vector<std::int64_t>{2, 5});
  REQUIRE(g.at("hf").bytes.size() == 2 * n);
  REQUIRE(std::memcmp(g.at("bf").bytes.data(), bf, sizeof(bf)) == 0);
  REQUIRE(std::memcmp(g.at("hf").bytes.data(), hf, sizeof(hf)) == 0);
  const auto bd = kvmem::io::to_double(g.at("bf"), "bf"), hd = kvmem::io::to_double(g.at("hf"), "hf");
  for (std::size_t i = 0; i < n; ++i) {
    CAPTURE(i, values[i]);
    REQUIRE(bd[i] == static_cast<double>(kvmem::to_float(bf[i])));
    REQUIRE(hd[i] == static_cast<double>(kvmem::to_float(hf[i])));
  }
  REQUIRE(hd[7] == 0x1p-24);  // float16's smallest subnormal
  REQUIRE(hd[6] == 65504.0);  // float16's largest finite value
  REQUIRE(bd[0] == 1.0);
  REQUIRE(std::signbit(bd[3]));
}

TEST_CASE("to_double names the tensor and its dtype when it cannot convert it", "[io][errors]") {
  SafetensorsFile f;
  const unsigned char mask[] = {0, 1, 1};
  f.put("mask", {3}, mask);
  REQUIRE(f.at("mask").dtype == "U8");
  REQUIRE_THROWS_WITH(kvmem::io::to_double(f.at("mask"), "mask"),
                      ContainsSubstring("tensor 'mask' dtype = U8") && ContainsSubstring("BF16, F16"));
  f.tensors["mask"].dtype = "I8";
  REQUIRE_THROWS_WITH(kvmem::io::to_double(f.at("mask"), "mask"), ContainsSubstring("tensor 'mask' dtype = I8"));
}
