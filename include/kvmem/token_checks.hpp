#pragma once
/// \file token_checks.hpp
/// The host-side shape check every memory runs on its token tensors before any kernel: q, k, v, y (and the
/// gates) are [B, heads, T] or [B, heads, T, channels] with a contiguous channel axis. Shared by Memory,
/// EvictionMemory and TrellisMemory so that their messages read the same.

#include <Kokkos_Core.hpp>
#include <string>
#include <type_traits>
#include <utility>

#include "errors.hpp"

namespace kvmem::detail {

/// An expected extent and how a message names it, e.g. {8, "head_dim D"} gives "must equal head_dim D = 8".
struct ExpectedExtent {
  long value;
  const char* what;
};

/// Throws kvmem::invalid_argument, naming the tensor, the axis and its extent ("k.extent(1) = 3: must equal
/// the kv-heads Hkv = 2 (prefill)"), unless x is [batch, heads, tokens] (rank 3) or [batch, heads, tokens,
/// channels] (rank 4) with a contiguous channel axis (stride 1, or at most one channel). `where` names the
/// call ("prefill", "decode"). The message is built only on failure: decode runs this at every token and
/// must not allocate.
template <class View>
void check_token_view(const View& x, const char* name, const char* where, long batch, ExpectedExtent heads,
                      long tokens, ExpectedExtent channels) {
  auto fail = [&](const char* field, auto value, const std::string& reason) {
    throw invalid_argument(describe(std::string(name) + field, value, reason + " (" + where + ")"));
  };
  auto must_equal = [](const ExpectedExtent& e) { return "must equal " + std::string(e.what) + " = " + std::to_string(e.value); };
  if (static_cast<long>(x.extent(0)) != batch) fail(".extent(0)", x.extent(0), must_equal({batch, "the batch size B"}));
  if (static_cast<long>(x.extent(1)) != heads.value) fail(".extent(1)", x.extent(1), must_equal(heads));
  if (static_cast<long>(x.extent(2)) != tokens) fail(".extent(2)", x.extent(2), must_equal({tokens, "the token count T of q"}));
  if constexpr (std::remove_cvref_t<View>::rank() == 4) {
    if (static_cast<long>(x.extent(3)) != channels.value) fail(".extent(3)", x.extent(3), must_equal(channels));
    if (x.stride(3) != 1 && x.extent(3) > 1) fail(".stride(3)", x.stride(3), "channels must be contiguous");
  }
}

/// The checks above for attention's four tensors: q [batch, Hq, T, D], k [batch, Hkv, T, D],
/// v [batch, Hkv, T, Dv] and y [batch, Hq, T, Dv] (Memory and EvictionMemory).
template <class Q, class K, class V, class Y>
void check_attention_views(const Q& q, const K& k, const V& v, const Y& y, const char* where, long batch,
                           long query_heads, long kv_heads, long tokens, long head_dim, long value_dim) {
  const ExpectedExtent hq{query_heads, "the query heads Hq"}, hkv{kv_heads, "the kv-heads Hkv"};
  const ExpectedExtent d{head_dim, "head_dim D"}, dv{value_dim, "value_dim Dv"};
  check_token_view(q, "q", where, batch, hq, tokens, d);
  check_token_view(k, "k", where, batch, hkv, tokens, d);
  check_token_view(v, "v", where, batch, hkv, tokens, dv);
  check_token_view(y, "y", where, batch, hq, tokens, dv);
}

/// Token t of a token view x, [B, heads, T] or [B, heads, T, channels], as a view of one token ([B, heads,
/// 1] or [B, heads, 1, channels], the same strides, no copy): a prefill that continues a sequence hands its
/// tokens one by one to the decode step. An unallocated view (an absent gate) stays unallocated.
template <class View>
[[nodiscard]] View token_slice(const View& x, long t) {
  if (x.data() == nullptr) return View{};
  const auto one = std::make_pair(t, t + 1);
  if constexpr (View::rank() == 3)
    return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, one);
  else
    return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, one, Kokkos::ALL);
}

}  // namespace kvmem::detail
