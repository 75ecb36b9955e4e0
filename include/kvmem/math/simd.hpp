#pragma once
/// \file simd.hpp
/// A register vector of float32 for the readout's register tiles: the host CPU's vector register where
/// the compiler offers GCC vector extensions (x86 SSE/AVX2/AVX-512, ARM NEON), a plain array elsewhere
/// (device code, other compilers). Every operation is element-wise and rounds as the scalar code does
/// (fma is one fused multiply-add per element exactly where kernels::mul_add is one), so a kernel gives
/// the same bits with either form.
///
/// Why not Kokkos::Experimental::simd: its vector ABI is fixed when Kokkos itself is configured
/// (KOKKOS_ARCH_AVX2 and friends), and distribution packages of Kokkos (Debian's 5.2.2) are configured
/// for a generic CPU, where its native simd is one scalar. kvmem is header-only and compiled with the
/// engine's flags (-march=native), so it takes the vector width from the compiler instead.
///
/// Defining KVMEM_SIMD_PORTABLE takes the portable form on the host too (the form device code and
/// nvcc builds compile; tests/CMakeLists.txt runs the tile-form bit tests in it as "portable: ...").

#include <Kokkos_Core.hpp>
#include <type_traits>
#include <utility>

#include "../dtype.hpp"
#include "vector_ops.hpp"

#if defined(__GNUC__) && !defined(__CUDACC__) && !defined(__HIPCC__) && !defined(__SYCL_DEVICE_ONLY__) && \
    !defined(KVMEM_SIMD_PORTABLE) && (defined(__AVX__) || defined(__SSE2__) || defined(__ARM_NEON))
#define KVMEM_SIMD_VECTOR_EXTENSIONS 1
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
// bfloat16 rows read as 32-bit pairs of channels (transposed_blocks, add_weighted_rows): the lower-addressed
// channel in the low 16 bits.
#define KVMEM_SIMD_CHANNEL_PAIRS 1
#endif
#endif

namespace kvmem::kernels::simd {

#if defined(KVMEM_SIMD_VECTOR_EXTENSIONS)
/// Whether vec is a CPU vector register (a thread gains from register tiles of several rows at once);
/// false for the portable form, where a GPU thread is better off with one row and more threads.
inline constexpr bool vector_registers = true;
/// Floats per register vector: the widest vector register the compiler targets.
#if defined(__AVX512F__)
inline constexpr int width = 16;
#elif defined(__AVX__)
inline constexpr int width = 8;
#else
inline constexpr int width = 4;
#endif
/// Register vectors the register tiles assume a thread has: 32 under AVX-512 (and on AArch64), 16
/// otherwise. Register tiles hold half of them as accumulators (QueryBlock::qk_keys, pv_vectors): enough
/// independent fma chains to keep two fma units busy through the fma latency, with room left for the
/// operands.
#if defined(__AVX512F__) || defined(__aarch64__)
inline constexpr int registers = 32;
#else
inline constexpr int registers = 16;
#endif
/// One register vector of `width` floats (a GCC vector extension type, e.g. __m256 under AVX2).
typedef float vec __attribute__((vector_size(width * sizeof(float))));

/// Loads width floats from p (no alignment needed).
KOKKOS_INLINE_FUNCTION vec load(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
/// Stores v to p [width] (no alignment needed).
KOKKOS_INLINE_FUNCTION void store(float* p, const vec& v) { __builtin_memcpy(p, &v, sizeof v); }
/// Asks the CPU to bring the `bytes` bytes from p into its caches, one request per 64-byte line: a hint
/// that changes no result (GCC's __builtin_prefetch).
KOKKOS_INLINE_FUNCTION void prefetch(const void* p, long bytes) {
  for (long b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b);
}
/// Makes the compiler read the array `a` back from memory after it was stored (an empty asm that may
/// change it): its elements are then broadcast straight from memory (a load port) instead of extracted
/// from the register that was stored (two shuffles per element). Changes no value.
template <class T, int N>
KOKKOS_INLINE_FUNCTION void in_memory(T (&a)[N]) {
  __asm__("" : "+m"(a));
}
/// Loads width bfloat16 values from p as float32 (exact): each widened into a float's high 16 bits.
KOKKOS_INLINE_FUNCTION vec load(const bfloat16* p) {
  typedef unsigned short halves __attribute__((vector_size(width * sizeof(short))));
  typedef unsigned int words __attribute__((vector_size(width * sizeof(int))));
  halves h;
  __builtin_memcpy(&h, p, sizeof h);
  const words u = __builtin_convertvector(h, words) << 16;
  vec v;
  __builtin_memcpy(&v, &u, sizeof v);
  return v;
}
/// Loads width float16 values from p as float32 (exact): the CPU's conversion instruction where it has
/// one (x86 F16C), to_float per lane otherwise; both give the same bits.
KOKKOS_INLINE_FUNCTION vec load(const float16* p) {
#if defined(__F16C__) && defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__) && defined(__AVX__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__F16C__)
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  vec v;
  for (int i = 0; i < width; ++i) v[i] = to_float(p[i]);
  return v;
#endif
}
/// Every lane x.
KOKKOS_INLINE_FUNCTION vec broadcast(float x) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(x);
#elif defined(__AVX__)
  return _mm256_set1_ps(x);
#elif defined(__SSE2__)
  return _mm_set1_ps(x);
#else
  vec v;
  for (int i = 0; i < width; ++i) v[i] = x;  // not vec{} + x, which would turn -0 into +0
  return v;
#endif
}
/// Every lane the value of the stored element *p, widened (to_float).
template <StorageType T>
KOKKOS_INLINE_FUNCTION vec broadcast_from(const T* p) {
  return broadcast(to_float(*p));
}
#if defined(__F16C__)
/// float16 under F16C: the 16 bits broadcast, then one vector conversion (the scalar conversion of a
/// compiler that targets AVX512-FP16 merges into its destination register, a dependency chain through a
/// loop of broadcasts). The same bits as to_float.
KOKKOS_INLINE_FUNCTION vec broadcast_from(const float16* p) {
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(p->bits)));
#elif defined(__AVX__)
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(p->bits)));
#else
  return _mm_cvtph_ps(_mm_set1_epi16(static_cast<short>(p->bits)));
#endif
}
#endif
/// a * b + c per lane, rounded as kernels::mul_add rounds it.
KOKKOS_INLINE_FUNCTION vec fma(const vec& a, const vec& b, const vec& c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  vec r;
  for (int i = 0; i < width; ++i) r[i] = mul_add(a[i], b[i], c[i]);
  return r;
#endif
}
/// a * b per lane.
KOKKOS_INLINE_FUNCTION vec mul(const vec& a, const vec& b) { return a * b; }
/// One int per lane (row indices; the all-ones / zero lanes of a comparison).
typedef int ivec __attribute__((vector_size(width * sizeof(int))));
/// Lane mask of a > b (false where either is NaN).
KOKKOS_INLINE_FUNCTION ivec greater(const vec& a, const vec& b) { return a > b; }
/// m ? a : b per lane, for a mask m of all-ones / zero lanes (a comparison's): one blend instruction.
KOKKOS_INLINE_FUNCTION vec select(const ivec& m, const vec& a, const vec& b) { return m ? a : b; }
/// m ? a : b per lane (m a comparison's mask).
KOKKOS_INLINE_FUNCTION ivec select(const ivec& m, const ivec& a, const ivec& b) { return m ? a : b; }
/// The bits of each lane as an int.
KOKKOS_INLINE_FUNCTION ivec as_int(const vec& v) { return reinterpret_cast<ivec>(v); }
/// The float whose bits each lane holds (the inverse of as_int).
KOKKOS_INLINE_FUNCTION vec as_float(const ivec& v) { return reinterpret_cast<vec>(v); }
/// Every lane x.
KOKKOS_INLINE_FUNCTION ivec broadcast_int(int x) { return ivec{} + x; }
/// Stores v to p [width].
KOKKOS_INLINE_FUNCTION void store(int* p, const ivec& v) { __builtin_memcpy(p, &v, sizeof v); }
/// Loads p [width].
KOKKOS_INLINE_FUNCTION ivec load_int(const int* p) {
  ivec v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

namespace detail {
// One stage of the block transpose of `transpose`: rows i and i + B (bit B of i clear) exchange their
// column blocks of width B (bit B of the column set in row i, clear in row i + B).
template <int B, int... J>
vec upper_of_pair(const vec& a, const vec& b, std::integer_sequence<int, J...>) {
  return __builtin_shufflevector(a, b, ((J & B) ? J - B + width : J)...);
}
template <int B, int... J>
vec lower_of_pair(const vec& a, const vec& b, std::integer_sequence<int, J...>) {
  return __builtin_shufflevector(a, b, ((J & B) ? J + width : J + B)...);
}
template <int B>
KOKKOS_INLINE_FUNCTION void transpose_stage(vec* r) {
  if constexpr (B >= 1) {
    constexpr auto columns = std::make_integer_sequence<int, width>{};
    for (int i = 0; i < width; ++i)
      if ((i & B) == 0) {
        const vec upper = upper_of_pair<B>(r[i], r[i + B], columns);
        r[i + B] = lower_of_pair<B>(r[i], r[i + B], columns);
        r[i] = upper;
      }
    transpose_stage<B / 2>(r);
  }
}
}  // namespace detail
/// r[i][j] <- r[j][i] for the width x width floats of `width` register vectors: log2(width) stages of
/// lane shuffles (24 for AVX2's 8 x 8), no memory round trip.
KOKKOS_INLINE_FUNCTION void transpose(vec* r) { detail::transpose_stage<width / 2>(r); }

namespace detail {
template <int... J>
KOKKOS_INLINE_FUNCTION void deinterleave(vec& a, vec& b, std::integer_sequence<int, J...>) {
  const vec even = __builtin_shufflevector(a, b, (2 * J)...), odd = __builtin_shufflevector(a, b, (2 * J + 1)...);
  a = even, b = odd;
}
template <int... J>
KOKKOS_INLINE_FUNCTION void interleave(vec& a, vec& b, std::integer_sequence<int, J...>) {
  const vec lo = __builtin_shufflevector(a, b, ((J & 1) ? width + J / 2 : J / 2)...);
  const vec hi = __builtin_shufflevector(a, b, ((J & 1) ? width + (width + J) / 2 : (width + J) / 2)...);
  a = lo, b = hi;
}
}  // namespace detail
/// (a, b) = 2 * width consecutive floats -> (a, b) = (the even ones, the odd ones), in order.
KOKKOS_INLINE_FUNCTION void deinterleave(vec& a, vec& b) {
  detail::deinterleave(a, b, std::make_integer_sequence<int, width>{});
}
/// The inverse of deinterleave: (even, odd) -> 2 * width consecutive floats.
KOKKOS_INLINE_FUNCTION void interleave(vec& a, vec& b) {
  detail::interleave(a, b, std::make_integer_sequence<int, width>{});
}
#else
inline constexpr bool vector_registers = false;
inline constexpr int width = 8;
/// Register vectors the register tiles assume (the portable form: the compiler's choice).
inline constexpr int registers = 16;
/// The portable form: width floats that the compiler keeps in registers or spreads over its own vectors.
struct vec {
  float lane[width];
};
/// Loads width elements of a storage type from p as float32 (to_float per lane).
template <StorageType T>
KOKKOS_INLINE_FUNCTION vec load(const T* p) {
  vec v;
  for (int i = 0; i < width; ++i) v.lane[i] = to_float(p[i]);
  return v;
}
KOKKOS_INLINE_FUNCTION void store(float* p, const vec& v) {
  for (int i = 0; i < width; ++i) p[i] = v.lane[i];
}
/// No prefetch in the portable form (device code: the GPU's own memory pipeline).
KOKKOS_INLINE_FUNCTION void prefetch(const void*, long) {}
/// Nothing to do in the portable form (the vector form's in_memory keeps a stored array in memory).
template <class T, int N>
KOKKOS_INLINE_FUNCTION void in_memory(T (&)[N]) {}
KOKKOS_INLINE_FUNCTION vec broadcast(float x) {
  vec v;
  for (int i = 0; i < width; ++i) v.lane[i] = x;
  return v;
}
/// Every lane the value of the stored element *p, widened (to_float).
template <StorageType T>
KOKKOS_INLINE_FUNCTION vec broadcast_from(const T* p) {
  return broadcast(to_float(*p));
}
KOKKOS_INLINE_FUNCTION vec fma(const vec& a, const vec& b, const vec& c) {
  vec r;
  for (int i = 0; i < width; ++i) r.lane[i] = mul_add(a.lane[i], b.lane[i], c.lane[i]);
  return r;
}
KOKKOS_INLINE_FUNCTION vec mul(const vec& a, const vec& b) {
  vec r;
  for (int i = 0; i < width; ++i) r.lane[i] = a.lane[i] * b.lane[i];
  return r;
}
struct ivec {
  int lane[width];
};
namespace detail {
KOKKOS_INLINE_FUNCTION float lane_of(const vec& v, int i) { return v.lane[i]; }
KOKKOS_INLINE_FUNCTION int lane_of(const ivec& v, int i) { return v.lane[i]; }
KOKKOS_INLINE_FUNCTION float lane_of(float x, int) { return x; }
KOKKOS_INLINE_FUNCTION int lane_of(int x, int) { return x; }
/// R whose lane i is op(lane i of a, lane i of b); a scalar operand counts for every lane.
template <class R, class A, class B, class Op>
KOKKOS_INLINE_FUNCTION R lanewise(const A& a, const B& b, Op op) {
  R r;
  for (int i = 0; i < width; ++i) r.lane[i] = op(lane_of(a, i), lane_of(b, i));
  return r;
}
}  // namespace detail
// The operators GCC's vector extensions give the vector form, lane by lane (comparisons: -1 true, 0 false).
KOKKOS_INLINE_FUNCTION vec operator+(const vec& a, const vec& b) {
  return detail::lanewise<vec>(a, b, [](float x, float y) { return x + y; });
}
KOKKOS_INLINE_FUNCTION vec operator-(const vec& a, const vec& b) {
  return detail::lanewise<vec>(a, b, [](float x, float y) { return x - y; });
}
KOKKOS_INLINE_FUNCTION vec operator*(const vec& a, const vec& b) {
  return detail::lanewise<vec>(a, b, [](float x, float y) { return x * y; });
}
KOKKOS_INLINE_FUNCTION ivec operator<(const vec& a, const vec& b) {
  return detail::lanewise<ivec>(a, b, [](float x, float y) { return x < y ? -1 : 0; });
}
KOKKOS_INLINE_FUNCTION ivec operator>(const vec& a, const vec& b) { return b < a; }
KOKKOS_INLINE_FUNCTION ivec operator==(const vec& a, const vec& b) {
  return detail::lanewise<ivec>(a, b, [](float x, float y) { return x == y ? -1 : 0; });
}
KOKKOS_INLINE_FUNCTION ivec operator<(const ivec& a, const ivec& b) {
  return detail::lanewise<ivec>(a, b, [](int x, int y) { return x < y ? -1 : 0; });
}
KOKKOS_INLINE_FUNCTION ivec operator>(const ivec& a, const ivec& b) { return b < a; }
KOKKOS_INLINE_FUNCTION ivec operator&(const ivec& a, const ivec& b) {
  return detail::lanewise<ivec>(a, b, [](int x, int y) { return x & y; });
}
KOKKOS_INLINE_FUNCTION ivec operator+(const ivec& a, int b) {
  return detail::lanewise<ivec>(a, b, [](int x, int y) { return x + y; });
}
KOKKOS_INLINE_FUNCTION ivec operator-(const ivec& a, const ivec& b) {
  return detail::lanewise<ivec>(a, b, [](int x, int y) { return x - y; });
}
KOKKOS_INLINE_FUNCTION ivec operator<<(const ivec& a, int b) {
  return detail::lanewise<ivec>(a, b, [](int x, int y) { return static_cast<int>(static_cast<unsigned>(x) << y); });
}
KOKKOS_INLINE_FUNCTION ivec as_int(const vec& v) {
  ivec r;
  for (int i = 0; i < width; ++i) r.lane[i] = Kokkos::bit_cast<int>(v.lane[i]);
  return r;
}
KOKKOS_INLINE_FUNCTION vec as_float(const ivec& v) {
  vec r;
  for (int i = 0; i < width; ++i) r.lane[i] = Kokkos::bit_cast<float>(v.lane[i]);
  return r;
}
KOKKOS_INLINE_FUNCTION ivec greater(const vec& a, const vec& b) {
  ivec m;
  for (int i = 0; i < width; ++i) m.lane[i] = a.lane[i] > b.lane[i] ? -1 : 0;
  return m;
}
KOKKOS_INLINE_FUNCTION vec select(const ivec& m, const vec& a, const vec& b) {
  vec r;
  for (int i = 0; i < width; ++i) r.lane[i] = m.lane[i] ? a.lane[i] : b.lane[i];
  return r;
}
KOKKOS_INLINE_FUNCTION ivec select(const ivec& m, const ivec& a, const ivec& b) {
  ivec r;
  for (int i = 0; i < width; ++i) r.lane[i] = m.lane[i] ? a.lane[i] : b.lane[i];
  return r;
}
KOKKOS_INLINE_FUNCTION ivec broadcast_int(int x) {
  ivec v;
  for (int i = 0; i < width; ++i) v.lane[i] = x;
  return v;
}
KOKKOS_INLINE_FUNCTION void store(int* p, const ivec& v) {
  for (int i = 0; i < width; ++i) p[i] = v.lane[i];
}
KOKKOS_INLINE_FUNCTION ivec load_int(const int* p) {
  ivec v;
  for (int i = 0; i < width; ++i) v.lane[i] = p[i];
  return v;
}
/// r[i][j] <- r[j][i] for the width x width floats of `width` vectors.
KOKKOS_INLINE_FUNCTION void transpose(vec* r) {
  for (int i = 0; i < width; ++i)
    for (int j = i + 1; j < width; ++j) {
      const float x = r[i].lane[j];
      r[i].lane[j] = r[j].lane[i];
      r[j].lane[i] = x;
    }
}
#endif

/// s[k][x] = sum_c at[c][x * width + lane] * rows[k][c] for K rows, channels c in increasing order, one
/// fma a step: the register tile of a block of L vectors (queries or tokens, transposed: at is [dim][L])
/// against K rows (keys), every product of the tile's lanes with a row's channel in one fma. Per (lane,
/// row) the same chain as kernels::dot of the two vectors, so the same bits. `finish(k, x, s)` receives
/// each accumulator vector. Rows of any storage type (converted by to_float as they are read).
template <int L, int K, class Row, class Finish>
KOKKOS_INLINE_FUNCTION void lane_dots(const float* at, int dim, const Row* const* rows, Finish&& finish) {
  static_assert(L % width == 0, "a lane block fills whole register vectors");
  constexpr int V = L / width;
  vec s[K][V];
  for (int k = 0; k < K; ++k)
    for (int x = 0; x < V; ++x) s[k][x] = broadcast(0.0f);
  for (int c = 0; c < dim; ++c) {
    vec a[V];
    for (int x = 0; x < V; ++x) a[x] = load(at + long(c) * L + x * width);
    for (int k = 0; k < K; ++k) {
      const vec r = broadcast_from(rows[k] + c);
      for (int x = 0; x < V; ++x) s[k][x] = fma(a[x], r, s[k][x]);
    }
  }
  for (int k = 0; k < K; ++k)
    for (int x = 0; x < V; ++x) finish(k, x, s[k][x]);
}

/// The most channels in one block of transposed_blocks for rows of storage type Row: 2 * width for
/// bfloat16 rows under vector extensions (channel pairs), width otherwise.
template <class Row>
inline constexpr int transposed_block_channels =
#if defined(KVMEM_SIMD_CHANNEL_PAIRS)
    std::is_same_v<std::remove_cv_t<Row>, bfloat16> ? 2 * width : width;
#else
    width;
#endif

/// Walks the channels of `width` rows in increasing order, transposed in registers so that one vector
/// holds channel c of every row (lane k: rows[k][c], widened exactly to float32): on_block(c0, n) for each
/// block of n channels [c0, c0 + n) (n a std::integral_constant), then on_channel(c, t) for each of its
/// channels in order. Blocks of `width` channels (width rows loaded as width vectors, log2(width) stages
/// of shuffles); bfloat16 rows first in blocks of 2 * width channels transposed as 32-bit channel pairs,
/// each pair then split exactly into its even and odd channel by a shift and a mask (half the shuffles
/// per channel, no widening instruction). Returns the first channel past the last whole block (the caller
/// takes the rest one row at a time). The rows of row_dots.
template <class Row, class OnBlock, class OnChannel>
KOKKOS_INLINE_FUNCTION int transposed_blocks(int dim, const Row* const* rows, OnBlock&& on_block,
                                             OnChannel&& on_channel) {
  int c0 = 0;
#if defined(KVMEM_SIMD_CHANNEL_PAIRS)
  if constexpr (std::is_same_v<std::remove_cv_t<Row>, bfloat16>) {
    for (; c0 + 2 * width <= dim; c0 += 2 * width) {
      vec t[width];  // row k's channels c0 + 2p (low 16 bits) and c0 + 2p + 1 (high) in its 32-bit word p
      for (int k = 0; k < width; ++k) t[k] = load(reinterpret_cast<const float*>(rows[k] + c0));
      transpose(t);  // t[p] holds channel pair p of every row
      on_block(c0, std::integral_constant<int, 2 * width>{});
      for (int p = 0; p < width; ++p) {
        const ivec w = reinterpret_cast<ivec>(t[p]);
        on_channel(c0 + 2 * p, reinterpret_cast<vec>(w << 16));
        on_channel(c0 + 2 * p + 1, reinterpret_cast<vec>(w & ~0xffff));
      }
    }
  }
#endif
  for (; c0 + width <= dim; c0 += width) {
    vec t[width];
    for (int k = 0; k < width; ++k) t[k] = load(rows[k] + c0);
    transpose(t);  // t[c] holds channel c0 + c of every row
    on_block(c0, std::integral_constant<int, width>{});
    for (int c = 0; c < width; ++c) on_channel(c0 + c, t[c]);
  }
  return c0;
}

namespace detail {
/// The float32 chains of row_dots over a walk of transposed_blocks: one vector s, lane k row k's chain
/// `s = mul_add(q[c], rows[k][c], s)` in channel order. A query other than float32 is widened once per
/// block and each channel broadcast from memory (not widened once per fma through a general register).
template <class Q, class Row>
struct DotChains {
  static constexpr bool float_query = std::is_same_v<std::remove_cv_t<Q>, float>;
  const Q* q;
  long q_stride;
  vec s = broadcast(0.0f);
  float qc[transposed_block_channels<Row>];  // a 16-bit query's block, widened
  int block = 0;
  KOKKOS_INLINE_FUNCTION DotChains(const Q* query, long stride) : q(query), q_stride(stride) {}
  template <class N>
  KOKKOS_INLINE_FUNCTION void begin(int b0, N) {
    constexpr int n = N::value;
    block = b0;
    if constexpr (!float_query) {
      if (q_stride == 1)
        for (int c = 0; c < n; c += width) store(qc + c, load(q + b0 + c));
      else
        for (int c = 0; c < n; ++c) qc[c] = to_float(q[(b0 + c) * q_stride]);
      in_memory(qc);
    }
  }
  KOKKOS_INLINE_FUNCTION void add(int c, const vec& t) {
    if constexpr (float_query)
      s = fma(t, broadcast(q[c * q_stride]), s);
    else
      s = fma(t, broadcast(qc[c - block]), s);
  }
  /// out [width]: the chains, continued one row at a time over channels [c0, dim).
  KOKKOS_INLINE_FUNCTION void finish(int c0, int dim, const Row* const* rows, float* out) const {
    store(out, s);
    for (int c = c0; c < dim; ++c)
      for (int k = 0; k < width; ++k) out[k] = mul_add(to_float(q[c * q_stride]), to_float(rows[k][c]), out[k]);
  }
};
}  // namespace detail

/// out[k] = sum_c q[c * q_stride] * rows[k][c] for the `width` rows k, channels c in increasing order, one
/// fma a step: per row the chain of kernels::dot (the same bits), advanced in vector lanes. One query
/// against a register's width of rows (the readout's decode step, an eviction step's logits), the rows'
/// channels transposed in registers (transposed_blocks), so each fma moves every row's chain on by one
/// channel; channels past the last whole block continue the chains one row at a time. `out` [width]. The
/// query and the rows may be of any storage type (converted as they are read; detail::DotChains).
template <class Q, class Row>
KOKKOS_INLINE_FUNCTION void row_dots(const Q* q, long q_stride, int dim, const Row* const* rows, float* out) {
  detail::DotChains<Q, Row> chains(q, q_stride);
  const int c0 = transposed_blocks(
      dim, rows, [&](int b0, auto n) { chains.begin(b0, n); }, [&](int c, const vec& t) { chains.add(c, t); });
  chains.finish(c0, dim, rows, out);
}

/// r[x] lane l (channel x * width + l of a block of CV * width channels) += sum_{j < n} weight_of(j) *
/// row_of(j)[x * width + l], rows j in order, one fma per row and channel: per channel the chain
/// `r = mul_add(w_j, v_j[c], r)`, so the bits of the scalar loop. The value side of a readout or an
/// eviction step (probabilities times value rows). row_of(j) points at the block's first channel of value
/// row j, of any storage type. bfloat16 rows (CV even) are read as 32-bit channel pairs split by a shift and
/// a mask into an even-channel and an odd-channel vector, with the accumulators reordered to match once
/// per call (deinterleave / interleave): no widening instruction per row.
template <int CV, class WeightOf, class RowOf>
KOKKOS_INLINE_FUNCTION void add_weighted_rows(vec (&r)[CV], long n, WeightOf weight_of, RowOf row_of) {
  using row_t = std::remove_cv_t<std::remove_pointer_t<decltype(row_of(0L))>>;
#if defined(KVMEM_SIMD_CHANNEL_PAIRS)
  if constexpr (std::is_same_v<row_t, bfloat16> && CV % 2 == 0) {
    for (int x = 0; x < CV; x += 2) deinterleave(r[x], r[x + 1]);
    for (long j = 0; j < n; ++j) {
      const vec w = broadcast(weight_of(j));
      const row_t* v = row_of(j);
      for (int x = 0; x < CV; x += 2) {
        const ivec p = reinterpret_cast<ivec>(load(reinterpret_cast<const float*>(v + x * width)));
        r[x] = fma(w, reinterpret_cast<vec>(p << 16), r[x]);
        r[x + 1] = fma(w, reinterpret_cast<vec>(p & ~0xffff), r[x + 1]);
      }
    }
    for (int x = 0; x < CV; x += 2) interleave(r[x], r[x + 1]);
    return;
  }
#endif
  for (long j = 0; j < n; ++j) {
    const vec w = broadcast(weight_of(j));
    const row_t* v = row_of(j);
    for (int x = 0; x < CV; ++x) r[x] = fma(w, load(v + x * width), r[x]);
  }
}

}  // namespace kvmem::kernels::simd
