#pragma once
/// \file token_checks.hpp
/// The one path of the host-side input checks every memory runs before any kernel, shared by Memory,
/// EvictionMemory and TrellisMemory so that they refuse the same inputs with the same messages: the token
/// tensors (q, k, v, y, gates, lse: [B, heads, T] or [B, heads, T, channels] with a contiguous channel axis),
/// a decode step's one token, a prefill's per-sequence lengths and a sequence index. Every message is built
/// only on failure: decode runs these at every token and must not allocate.

#include <Kokkos_Core.hpp>
#include <span>
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

/// The readout's log-sum-exp `lse` [batch, Hq, T] float32 (the lse_out of kvmem::AttentionMemory), checked
/// as check_token_view checks a token tensor where it is given; an unallocated view (none asked) passes.
template <class Lse>
void check_lse_view(const Lse& lse, const char* where, long batch, long query_heads, long tokens) {
  if (lse.data() != nullptr)
    check_token_view(lse, "lse", where, batch, {query_heads, "the query heads Hq"}, tokens, {0, ""});
}

/// A decode step takes one token per sequence: throws kvmem::invalid_argument ("q.extent(2) = 3: decode
/// takes one token per sequence") unless q [B, heads, 1, D] has one token.
template <class Q>
void check_one_token(const Q& q) {
  if (q.extent(2) != 1)
    throw invalid_argument(describe("q.extent(2)", q.extent(2), "decode takes one token per sequence"));
}

/// A prefill's or extend's `lengths` (tokens per sequence, empty: every sequence takes all T tokens): throws
/// kvmem::invalid_argument unless it is empty or has `batch` entries, each in [0, T].
inline void check_lengths(std::span<const long> lengths, long batch, long tokens) {
  if (lengths.empty()) return;
  if (static_cast<long>(lengths.size()) != batch)
    throw invalid_argument(describe("lengths.size()", lengths.size(), "must equal the batch size " + std::to_string(batch)));
  for (long b = 0; b < batch; ++b)
    if (lengths[b] < 0 || lengths[b] > tokens)
      throw invalid_argument(describe("lengths[" + std::to_string(b) + "]", lengths[b],
                                      "must be in [0, T = " + std::to_string(tokens) + "]"));
}

/// A sequence index `b` of a memory of `batch` sequences whose host counts `what` (e.g. "tokens(b)") are
/// read: throws kvmem::invalid_argument for b outside [0, batch), or when the device is `ahead` of the host
/// (decode_async steps ran since the last sync()).
inline void check_sequence(long b, long batch, bool ahead, const char* what) {
  if (b < 0 || b >= batch)
    throw invalid_argument(describe("b", b, "must be in [0, batch = " + std::to_string(batch) + ")"));
  if (ahead) throw invalid_argument(describe(what, b, "the device is ahead after decode_async: call sync() first"));
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
