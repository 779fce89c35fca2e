// Decode attention's pieces, shared by decode_attention (paged_attention.cpp) and the
// fused decode step (decode_step.cpp).
//
// Decode steps (every query a single new token): one op writes the step's keys and
// values into the cache and attends, reading q, k, v straight from the fused qkv
// projection. The context is split into chunks of kChunk tokens so that a single
// sequence still spreads over the cores (its 3 kv heads alone would leave one core
// idle a third of the time); chunks are merged with their softmax maxima and sums.
#pragma once
#include <torch/extension.h>
#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace tm_decode {

// A new token's key or value row into the cache: a copy, or (int8 cache) symmetric int8
// with one float scale per row. The rounding is the one tokenmill.model.attention's
// quantize_kv does (amax times the float 1/127, then a real division for the inverse),
// so a token quantizes to the same bytes whichever path writes it.
constexpr float kInv127 = 1.0f / 127.0f;

template <typename T, int D>
inline void store_row(const T* src, T* dst, float*) { std::copy(src, src + D, dst); }

template <typename T, int D>
inline void store_row(const T* src, int8_t* dst, float* scale) {
  float amax = 0.f;
  for (int e = 0; e < D; ++e) amax = std::max(amax, std::fabs(static_cast<float>(src[e])));
  float d = amax * kInv127;
  // -ffast-math would fold 1 / (amax / 127) into 127 / amax, which rounds differently
  // (x * inv at 63.499996 became 64, not torch's 63): the barriers keep the steps apart.
  __asm__("" : "+x"(d));
  float inv = d > 0.f ? 1.f / d : 0.f;
  __asm__("" : "+x"(inv));
  for (int e = 0; e < D; ++e)
    dst[e] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(static_cast<float>(src[e]) * inv))));
  *scale = d;
}

}  // namespace tm_decode

#if defined(__AVX512F__)

namespace tm_decode {

constexpr int64_t kChunk = 256;
constexpr int kMaxGroup = 16;

using tm_simd::exp512;
using tm_simd::load16;

// The unit a thread does next: its keys are fetched while this unit sums values.
template <typename T>
struct NextUnit {
  const T* kh = nullptr;  // null: none
  const int64_t* table = nullptr;
  int64_t t0 = 0, t1 = 0;
};

// Row t's address in a paged [slots, D] head.
template <typename T, int D>
inline const T* row_at(const T* base, const int64_t* table, int64_t bs, int64_t t) {
  return base + (table[t / bs] * bs + t % bs) * D;
}

template <typename T, int D>
inline void prefetch_row(const T* r) {
  for (int o = 0; o < D * static_cast<int>(sizeof(T)); o += 64) _mm_prefetch(reinterpret_cast<const char*>(r) + o, _MM_HINT_T0);
}

inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}

// 16 int8 cache entries widened to float.
inline __m512 load16_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Lane sums of 16 vectors: result[i] = sum of v[i]'s lanes (a transpose-and-add tree,
// ~3 ops a vector instead of a full horizontal reduction each). `add` sums two vectors:
// float lanes, or int32 lanes kept in float registers by their bits (the shuffles move
// bits only).
template <typename Add>
inline __m512 reduce16_tree(const __m512* v, Add add) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i) a[i] = add(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    b[i] = add(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
               _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s01 = add(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s23 = add(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return add(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m512 reduce16(const __m512* v) {
  return reduce16_tree(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}

inline __m512i reduce16i(const __m512* v) {
  return _mm512_castps_si512(reduce16_tree(v, [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }));
}

inline __m512 load16(const int8_t* p) { return load16_i8(p); }

// q . k as a vector of lane partial sums. FloatQueryDot: FMAs of the pre-scaled float
// query on keys (of any type) widened to float. bfloat16 (with AVX512_BF16): pairwise
// bf16 dot products into fp32 (exact products), the scale applied to the summed score.
template <typename T, int D>
struct FloatQueryDot {
  alignas(64) float qf[kMaxGroup * D];
  static constexpr bool kScaled = true;
  FloatQueryDot(const T* q, int g, float scale) {
    for (int j = 0; j < g; ++j)
      for (int c = 0; c < D / 16; ++c)
        _mm512_store_ps(qf + j * D + c * 16, _mm512_mul_ps(load16(q + j * D + c * 16), _mm512_set1_ps(scale)));
  }
  template <int G, typename K>
  void dots(const K* kr, int g, __m512* out) const {
    __m512 kv[D / 16];
    for (int c = 0; c < D / 16; ++c) kv[c] = load16(kr + c * 16);
    for (int j = 0; j < (G ? G : g); ++j) {
      __m512 a = _mm512_mul_ps(_mm512_load_ps(qf + j * D), kv[0]);
      for (int c = 1; c < D / 16; ++c) a = _mm512_fmadd_ps(_mm512_load_ps(qf + j * D + c * 16), kv[c], a);
      out[j * 16] = a;
    }
  }
};

template <typename T, int D>
struct QueryDot : FloatQueryDot<T, D> {
  using FloatQueryDot<T, D>::FloatQueryDot;
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Keys of an int8 cache against the query in two int8 levels (q ~ d (q1 + q2 / 256), so
// ~15 bits: rounding the query to one level cost 1.4 points of top-1 agreement), with
// VNNI byte dot products: vpdpbusd wants one unsigned operand, so the key bytes are
// flipped to k + 128 and 128 * sum(q) comes off the sum. An int32 lane partial per key
// (summed over the 16 keys by reduce16i); decode_chunk applies `corr`, `fac` and the
// key's scale. Widening keys to float instead cost ~3.5x the instructions a row, and
// decode attention over int8 then ran at ~10 GB/s, slower than bf16 per byte.
template <typename T, int D>
struct QueryDotI8 {
  static constexpr bool kIntLanes = true;
  static constexpr int W = (D + 63) / 64;
  static constexpr __mmask64 kTail = (D % 64) ? ((1ull << (D % 64)) - 1) : ~0ull;
  __m512i q1[kMaxGroup * W], q2[kMaxGroup * W];
  float corr[kMaxGroup], fac[kMaxGroup];
  QueryDotI8(const T* q, int g, float scale) {
    for (int j = 0; j < g; ++j) {
      alignas(64) int8_t b1[W * 64] = {}, b2[W * 64] = {};
      float amax = 0.f;
      for (int e = 0; e < D; ++e) amax = std::max(amax, std::fabs(static_cast<float>(q[j * D + e])));
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      int32_t s1 = 0, s2 = 0;
      for (int e = 0; e < D; ++e) {
        const float x = static_cast<float>(q[j * D + e]);
        const float l1 = std::min(127.f, std::max(-127.f, std::nearbyint(x * inv)));
        const float l2 = std::min(127.f, std::max(-127.f, std::nearbyint((x - d * l1) * 256.f * inv)));
        b1[e] = static_cast<int8_t>(l1);
        b2[e] = static_cast<int8_t>(l2);
        s1 += b1[e];
        s2 += b2[e];
      }
      for (int w = 0; w < W; ++w) {
        q1[j * W + w] = _mm512_load_si512(b1 + 64 * w);
        q2[j * W + w] = _mm512_load_si512(b2 + 64 * w);
      }
      corr[j] = 128.f * static_cast<float>(256 * s1 + s2);
      fac[j] = d / 256.f * scale;
    }
  }
  template <int G>
  void dots(const int8_t* kr, int g, __m512* out) const {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i k[W];
    for (int w = 0; w < W; ++w) {
      // (padding bytes load as 0, flip to 128, and meet zero query bytes)
      const __m512i raw = w + 1 < W ? _mm512_loadu_si512(kr + 64 * w) : _mm512_maskz_loadu_epi8(kTail, kr + 64 * w);
      k[w] = _mm512_xor_si512(raw, flip);
    }
    for (int j = 0; j < (G ? G : g); ++j) {
      __m512i a = _mm512_setzero_si512();
      for (int w = 0; w < W; ++w) a = _mm512_dpbusd_epi32(a, k[w], q1[j * W + w]);
      a = _mm512_slli_epi32(a, 8);
      for (int w = 0; w < W; ++w) a = _mm512_dpbusd_epi32(a, k[w], q2[j * W + w]);
      out[j * 16] = _mm512_castsi512_ps(a);
    }
  }
};

#else
// Without VNNI: keys widened to float against the pre-scaled query.
template <typename T, int D>
struct QueryDotI8 : FloatQueryDot<T, D> {
  static constexpr bool kIntLanes = false;
  float corr[kMaxGroup] = {}, fac[kMaxGroup];
  QueryDotI8(const T* q, int g, float scale) : FloatQueryDot<T, D>(q, g, scale) { std::fill(fac, fac + kMaxGroup, 1.f); }
};
#endif

#if defined(__AVX512BF16__)
template <int D>
struct QueryDot<c10::BFloat16, D> {
  static constexpr int W = (D + 31) / 32;  // 32-lane bf16 vectors a row
  static constexpr __mmask32 kTail = (D % 32) ? ((1u << (D % 32)) - 1) : 0xFFFFFFFFu;
  __m512bh qb[kMaxGroup * W];
  static constexpr bool kScaled = false;
  static __m512bh load32(const c10::BFloat16* p, int w) {
    const __m512i v = w + 1 < W ? _mm512_loadu_si512(p + w * 32) : _mm512_maskz_loadu_epi16(kTail, p + w * 32);
    return reinterpret_cast<__m512bh>(v);
  }
  QueryDot(const c10::BFloat16* q, int g, float) {
    for (int j = 0; j < g; ++j)
      for (int w = 0; w < W; ++w) qb[j * W + w] = load32(q + j * D, w);
  }
  template <int G>
  void dots(const c10::BFloat16* kr, int g, __m512* out) const {
    __m512bh kv[W];
    for (int w = 0; w < W; ++w) kv[w] = load32(kr, w);
    for (int j = 0; j < (G ? G : g); ++j) {
      __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[j * W], kv[0]);
      for (int w = 1; w < W; ++w) a = _mm512_dpbf16_ps(a, qb[j * W + w], kv[w]);
      out[j * 16] = a;
    }
  }
};
#endif

#if defined(__AVX512BF16__)
// Weighted sum of bf16 values with the weights rounded to bf16 (as transformers' eager
// attention does in bf16): two keys at a time, their rows interleaved so that one
// vdpbf16ps adds p_t v_t + p_t+1 v_t+1 for 16 columns. The unpack interleaves within
// 128-bit lanes, so accumulator lane i of chunk w, half h holds column
// 32 w + 8 (i / 4) + 4 h + i % 4; the result is put back in order at the end.
template <int D>
void value_sum_bf16(const c10::BFloat16* vh, const int64_t* table, int64_t bs, int64_t t0, int64_t t1, int g,
                    const float* s, float* part, const NextUnit<c10::BFloat16>& next) {
  constexpr int W = D / 32;
  alignas(64) uint16_t pb[kMaxGroup * kChunk];
  const int64_t n = t1 - t0;
  for (int j = 0; j < g; ++j)
    for (int64_t t = 0; t < n; t += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_load_ps(s + j * kChunk + t));
      _mm256_store_si256(reinterpret_cast<__m256i*>(pb + j * kChunk + t), reinterpret_cast<__m256i>(h));
    }
  // (the softmax pass left zeros past the last key, so an odd count pairs with a zero)
  __m512 acc[kMaxGroup * W * 2];
  for (int x = 0; x < g * W * 2; ++x) acc[x] = _mm512_setzero_ps();
  for (int64_t t = t0, blk = t0 / bs; t < t1; ++blk) {
    const c10::BFloat16* vb = vh + table[blk] * bs * D;
    const int64_t te = std::min(t1, t + bs);
    for (; t < te; t += 2) {
      const c10::BFloat16* a = vb + ((t - t0) % bs) * D;
      if (next.kh) {
        const int64_t nt = next.t0 + (t - t0);
        if (nt < next.t1) prefetch_row<c10::BFloat16, D>(row_at<c10::BFloat16, D>(next.kh, next.table, bs, nt));
        if (nt + 1 < next.t1) prefetch_row<c10::BFloat16, D>(row_at<c10::BFloat16, D>(next.kh, next.table, bs, nt + 1));
      }
      const bool pair = t + 1 < te;
      __m512i lo[W], hi[W];
      for (int w = 0; w < W; ++w) {
        const __m512i x = _mm512_loadu_si512(a + w * 32);
        const __m512i y = pair ? _mm512_loadu_si512(a + D + w * 32) : _mm512_setzero_si512();
        lo[w] = _mm512_unpacklo_epi16(x, y);
        hi[w] = _mm512_unpackhi_epi16(x, y);
      }
      for (int j = 0; j < g; ++j) {
        int32_t pp;
        std::memcpy(&pp, pb + j * kChunk + (t - t0), 4);
        const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pp));
        for (int w = 0; w < W; ++w) {
          acc[(j * W + w) * 2] = _mm512_dpbf16_ps(acc[(j * W + w) * 2], reinterpret_cast<__m512bh>(lo[w]), p);
          acc[(j * W + w) * 2 + 1] = _mm512_dpbf16_ps(acc[(j * W + w) * 2 + 1], reinterpret_cast<__m512bh>(hi[w]), p);
        }
      }
      if (!pair) t -= 1;  // the loop's += 2 then lands on te
    }
    t = te;
  }
  for (int j = 0; j < g; ++j) {
    float* out = part + j * (D + 2) + 2;
    for (int w = 0; w < W; ++w)
      for (int h = 0; h < 2; ++h) {
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, acc[(j * W + w) * 2 + h]);
        for (int i = 0; i < 16; ++i) out[32 * w + 8 * (i / 4) + 4 * h + i % 4] = lanes[i];
      }
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Weighted sum of int8 values (their scales already folded into the weights s): the
// weights of a query row rounded to int16 against the chunk's largest (absolute error
// below 2^-16 of it, finer than bf16's 2^-9 relative on the larger weights), two keys at
// a time as in value_sum_bf16 with vpdpwssd on the rows widened to int16 (~12
// instructions a row instead of ~31 widening them to float). int32 sums: at most
// 256 keys * 32767 * 127 < 2^31.
template <int D>
void value_sum_i8(const int8_t* vh, const int64_t* table, int64_t bs, int64_t t0, int64_t t1, int g,
                  const float* s, float* part, const NextUnit<int8_t>& next) {
  constexpr int W = D / 32;
  alignas(64) int16_t pw[kMaxGroup * kChunk];
  float wscale[kMaxGroup];
  const int64_t n = t1 - t0, npad = (n + 15) / 16 * 16;
  for (int j = 0; j < g; ++j) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t t = 0; t < npad; t += 16) mx = _mm512_max_ps(mx, _mm512_load_ps(s + j * kChunk + t));
    const float wmax = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(wmax > 0.f ? 32767.f / wmax : 0.f);
    wscale[j] = wmax / 32767.f;
    for (int64_t t = 0; t < npad; t += 16)
      _mm256_store_si256(reinterpret_cast<__m256i*>(pw + j * kChunk + t),
                         _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(s + j * kChunk + t), inv))));
    if (npad < kChunk) pw[j * kChunk + npad] = 0;  // (an odd last key pairs with a zero weight)
  }
  __m512i acc[kMaxGroup * W * 2];
  for (int x = 0; x < g * W * 2; ++x) acc[x] = _mm512_setzero_si512();
  for (int64_t t = t0, blk = t0 / bs; t < t1; ++blk) {
    const int8_t* vb = vh + table[blk] * bs * D;
    const int64_t te = std::min(t1, t + bs);
    for (; t < te; t += 2) {
      const int8_t* a = vb + ((t - t0) % bs) * D;
      if (next.kh) {
        const int64_t nt = next.t0 + (t - t0);
        if (nt < next.t1) prefetch_row<int8_t, D>(row_at<int8_t, D>(next.kh, next.table, bs, nt));
        if (nt + 1 < next.t1) prefetch_row<int8_t, D>(row_at<int8_t, D>(next.kh, next.table, bs, nt + 1));
      }
      const bool pair = t + 1 < te;
      __m512i lo[W], hi[W];
      for (int w = 0; w < W; ++w) {
        const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + w * 32)));
        const __m512i y = pair ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + D + w * 32)))
                               : _mm512_setzero_si512();
        lo[w] = _mm512_unpacklo_epi16(x, y);
        hi[w] = _mm512_unpackhi_epi16(x, y);
      }
      for (int j = 0; j < g; ++j) {
        int32_t pp;
        std::memcpy(&pp, pw + j * kChunk + (t - t0), 4);
        const __m512i p = _mm512_set1_epi32(pp);
        for (int w = 0; w < W; ++w) {
          acc[(j * W + w) * 2] = _mm512_dpwssd_epi32(acc[(j * W + w) * 2], lo[w], p);
          acc[(j * W + w) * 2 + 1] = _mm512_dpwssd_epi32(acc[(j * W + w) * 2 + 1], hi[w], p);
        }
      }
      if (!pair) t -= 1;  // the loop's += 2 then lands on te
    }
    t = te;
  }
  for (int j = 0; j < g; ++j) {
    float* out = part + j * (D + 2) + 2;
    const __m512 f = _mm512_set1_ps(wscale[j]);
    for (int w = 0; w < W; ++w)
      for (int h = 0; h < 2; ++h) {
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[(j * W + w) * 2 + h]), f));
        for (int i = 0; i < 16; ++i) out[32 * w + 8 * (i / 4) + 4 * h + i % 4] = lanes[i];
      }
  }
}
#endif

// One (sequence, kv head, chunk [t0, t1)), t0 a multiple of bs: writes per query row
// of the group [max, sum, acc[D]], acc unnormalized relative to max. Queries are T; the
// cache C is T or int8 (then ksh, vsh hold this head's per-slot scales). Keys before
// `lo` (a sliding window's first key, below t1) weigh nothing.
template <typename T, typename C, int D, int G>
void decode_chunk(const T* q, const C* kh, const C* vh, const float* ksh, const float* vsh, const int64_t* table,
                  int64_t bs, int64_t t0, int64_t t1, int g, float scale, float* part, const NextUnit<C>& next,
                  int64_t fetched, int64_t lo) {
  constexpr int V = D / 16;
  constexpr bool kI8 = std::is_same_v<C, int8_t>;
  if constexpr (G) g = G;
  alignas(64) float s[kMaxGroup * kChunk];
  alignas(64) float acc[kMaxGroup * D];
  alignas(64) float vf[16 * D];
  alignas(64) float kscale[16] = {};  // int8: the scales of the keys in `partial`
  __m512 partial[kMaxGroup * 16];
  using Dot = std::conditional_t<kI8, QueryDotI8<T, D>, QueryDot<T, D>>;
  const Dot qd(q, g, scale);
  const __m512 post = _mm512_set1_ps(kI8 || QueryDot<T, D>::kScaled ? 1.f : scale);
  const int64_t n = t1 - t0;
  // scores, 16 keys at a time, walking the chunk's blocks
  for (int64_t t = t0, blk = t0 / bs; t < t1; ++blk) {
    const C* kr = kh + table[blk] * bs * D;
    const C* vr = vh + table[blk] * bs * D;
    const int64_t te = std::min(t1, t + bs);
    // Blocks are scattered, so the hardware prefetcher stops at each block's end: the
    // next key block is fetched ahead, unless the previous unit's value pass fetched it
    // (its first `fetched` rows). Each key row's value row is fetched here for the value
    // pass: memory works while the cores compute (decode attention alone: 1.1-1.2x, 1
    // and 16 sequences of 640 tokens).
    if (te < t1 && te - t0 >= fetched) prefetch_block(kh + table[blk + 1] * bs * D, bs * D * sizeof(C));
    for (; t < te; ++t, kr += D, vr += D) {
      const int64_t i = t - t0;
      prefetch_row<C, D>(vr);
      qd.template dots<G>(kr, g, partial + (i & 15));
      if constexpr (kI8) kscale[i & 15] = ksh[table[blk] * bs + t - blk * bs];
      if ((i & 15) == 15 || t + 1 == t1) {
        if constexpr (kI8) {
          const __m512 ks = _mm512_load_ps(kscale);
          for (int j = 0; j < g; ++j) {
            const __m512 raw = Dot::kIntLanes
                                   ? _mm512_sub_ps(_mm512_cvtepi32_ps(reduce16i(partial + j * 16)), _mm512_set1_ps(qd.corr[j]))
                                   : reduce16(partial + j * 16);
            _mm512_store_ps(s + j * kChunk + (i & ~int64_t(15)), _mm512_mul_ps(_mm512_mul_ps(raw, ks), _mm512_set1_ps(qd.fac[j])));
          }
        } else {
          for (int j = 0; j < g; ++j) _mm512_store_ps(s + j * kChunk + (i & ~int64_t(15)), _mm512_mul_ps(reduce16(partial + j * 16), post));
        }
      }
    }
  }
  const int64_t npad = (n + 15) / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((n % 16) ? (1u << (n % 16)) - 1 : 0xFFFF);
  const int64_t skip = std::max<int64_t>(0, lo - t0);  // keys before the window
  // the keys [t, t + 16) that count: inside the chunk and not before the window
  auto seen = [&](int64_t t) -> __mmask16 {
    __mmask16 m = t + 16 <= n ? 0xFFFF : tail;
    if (t < skip) m &= static_cast<__mmask16>(skip - t >= 16 ? 0 : ~((1u << (skip - t)) - 1));
    return m;
  };
  for (int j = 0; j < g; ++j) {
    float* sj = s + j * kChunk;
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < npad; t += 16) mx = _mm512_mask_max_ps(mx, seen(t), mx, _mm512_load_ps(sj + t));
    const float m = _mm512_reduce_max_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < npad; t += 16) {
      const __m512 p = _mm512_maskz_mov_ps(seen(t), exp512(_mm512_sub_ps(_mm512_load_ps(sj + t), _mm512_set1_ps(m))));
      _mm512_store_ps(sj + t, p);
      sum = _mm512_add_ps(sum, p);
    }
    part[j * (D + 2)] = m;
    part[j * (D + 2) + 1] = _mm512_reduce_add_ps(sum);
  }
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T> && D % 32 == 0) {
    if (bs % 2 == 0) return value_sum_bf16<D>(vh, table, bs, t0, t1, g, s, part, next);
  }
#endif
  if constexpr (kI8) {  // each value row's scale folded into its weights
    alignas(64) float vscale[kChunk] = {};
    for (int64_t t = t0, blk = t0 / bs; t < t1; ++blk)
      for (const int64_t te = std::min(t1, t + bs); t < te; ++t) vscale[t - t0] = vsh[table[blk] * bs + t - blk * bs];
    for (int j = 0; j < g; ++j)
      for (int64_t t = 0; t < npad; t += 16)
        _mm512_store_ps(s + j * kChunk + t, _mm512_mul_ps(_mm512_load_ps(s + j * kChunk + t), _mm512_load_ps(vscale + t)));
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if constexpr (D % 32 == 0) {
      if (bs % 2 == 0) return value_sum_i8<D>(vh, table, bs, t0, t1, g, s, part, next);
    }
#endif
  }
  for (int x = 0; x < g * D; x += 16) _mm512_store_ps(acc + x, _mm512_setzero_ps());
  // weighted sum of values, a block at a time: widen the block once, then each query
  // row runs V independent FMA chains in registers
  for (int64_t t = t0, blk = t0 / bs; t < t1; ++blk) {
    const C* vb = vh + table[blk] * bs * D;
    const int64_t te = std::min(t1, t + bs);
    if (te < t1) prefetch_block(vh + table[blk + 1] * bs * D, bs * D * sizeof(C));
    for (int64_t u = t; u < te; u += 16) {
      const int64_t cnt = std::min<int64_t>(16, te - u);
      if (next.kh)
        for (int64_t r = next.t0 + (u - t0); r < std::min(next.t1, next.t0 + (u - t0) + cnt); ++r)
          prefetch_row<C, D>(row_at<C, D>(next.kh, next.table, bs, r));
      const float* rows;
      if constexpr (std::is_same_v<C, float>) {
        rows = vb + (u - t) * D;
      } else if constexpr (kI8) {  // (their scales are in the weights)
        for (int64_t r = 0; r < cnt; ++r)
          for (int c = 0; c < V; ++c) _mm512_store_ps(vf + r * D + c * 16, load16_i8(vb + (u - t + r) * D + c * 16));
        rows = vf;
      } else {
        for (int64_t r = 0; r < cnt; ++r)
          for (int c = 0; c < V; ++c) _mm512_store_ps(vf + r * D + c * 16, load16(vb + (u - t + r) * D + c * 16));
        rows = vf;
      }
      for (int j = 0; j < g; ++j) {
        __m512 a[V];
        for (int c = 0; c < V; ++c) a[c] = _mm512_load_ps(acc + j * D + c * 16);
        const float* pj = s + j * kChunk + (u - t0);
        for (int64_t r = 0; r < cnt; ++r) {
          const __m512 p = _mm512_set1_ps(pj[r]);
          for (int c = 0; c < V; ++c) a[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(rows + r * D + c * 16), a[c]);
        }
        for (int c = 0; c < V; ++c) _mm512_store_ps(acc + j * D + c * 16, a[c]);
      }
    }
    t = te;
  }
  for (int j = 0; j < g; ++j) std::copy(acc + j * D, acc + (j + 1) * D, part + j * (D + 2) + 2);
}


// Work units of a decode step: (sequence, chunk, kv head). Chunks are kPlanChunk tokens
// (whole blocks), whatever the batch: a query's chunks, and so the order its sums and
// bf16 roundings run in, then depend only on its own context, and a sequence gives the
// same numbers alone or in any batch (chunks sized to spread the batch over the threads
// did not). 64 keeps ~8 units a thread for one sequence of a few hundred tokens; longer
// contexts and larger batches get more units than the cores need (each ~16 keys of
// overhead, kUnitCost). first[b] is sequence b's first unit; returns the chunk length.
// los (optional): each sequence's first key (a sliding window's), so its units start at
// the chunk holding it.
constexpr int64_t kPlanChunk = 64;

inline int64_t first_chunk(const int64_t* los, int64_t b, int64_t chunk) { return los ? los[b] / chunk : 0; }

inline int64_t plan_units(const int64_t* lens, int64_t B, int64_t Hkv, int64_t bs, std::vector<int64_t>& first,
                          const int64_t* los = nullptr) {
  TORCH_CHECK(bs <= kChunk, "block_size above ", kChunk);
  const int64_t chunk = std::min<int64_t>(kChunk / bs * bs, (kPlanChunk + bs - 1) / bs * bs);
  first.assign(B + 1, 0);
  for (int64_t b = 0; b < B; ++b)
    first[b + 1] = first[b] + ((lens[b] + chunk - 1) / chunk - first_chunk(los, b, chunk)) * Hkv;
  return chunk;
}

// Sequence b's units run head by head, chunks in order within a head: a thread's run of
// units then walks one head's keys (and values) front to back, one stream the hardware
// prefetcher keeps following, rather than hopping between the heads' regions each unit.
inline int64_t unit_chunk(const std::vector<int64_t>& first, int64_t b, int64_t u, int64_t Hkv) {
  return (u - first[b]) % ((first[b + 1] - first[b]) / Hkv);
}
inline int64_t unit_head(const std::vector<int64_t>& first, int64_t b, int64_t u, int64_t Hkv) {
  return (u - first[b]) / ((first[b + 1] - first[b]) / Hkv);
}

// Thread t's units are [bounds[t], bounds[t + 1]): contiguous runs of about equal cost
// (keys read, plus a fixed cost a unit), since a sequence's last chunk is short.
inline std::vector<int64_t> unit_bounds(const std::vector<int64_t>& first, const int64_t* lens, int64_t chunk,
                                        int64_t Hkv, int64_t threads, const int64_t* los = nullptr) {
  constexpr int64_t kUnitCost = 16;
  const int64_t B = static_cast<int64_t>(first.size()) - 1, U = first[B];
  std::vector<int64_t> cost(U + 1, 0);  // prefix sums
  for (int64_t b = 0; b < B; ++b)
    for (int64_t u = first[b]; u < first[b + 1]; ++u) {
      const int64_t t0 = (first_chunk(los, b, chunk) + unit_chunk(first, b, u, Hkv)) * chunk;
      cost[u + 1] = cost[u] + std::min(chunk, lens[b] - t0) + kUnitCost;
    }
  std::vector<int64_t> bounds(threads + 1, U);
  bounds[0] = 0;
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t target = cost[U] * t / threads;
    int64_t u = std::lower_bound(cost.begin(), cost.end(), target) - cost.begin();
    if (u > 0 && target - cost[u - 1] < cost[u] - target) --u;  // the nearer boundary
    bounds[t] = std::max(bounds[t - 1], std::min(u, U));
  }
  return bounds;
}

// Units [u0, u1): q rows qp (row stride `row`, heads of a group adjacent), caches
// kp, vp [Hkv, S, D] (int8: their scales ksp, vsp [Hkv, S]); each unit writes
// g * (D + 2) floats to parts. los: as plan_units had them.
template <typename T, typename C, int D>
void run_units(int64_t u0, int64_t u1, const std::vector<int64_t>& first, int64_t chunk, const T* qp, int64_t row,
               const C* kp, const C* vp, const float* ksp, const float* vsp, int64_t S, const int64_t* tables,
               int64_t max_blocks, const int64_t* lens, int64_t Hkv, int64_t g, int64_t bs, float scale,
               float* parts, const int64_t* los = nullptr) {
  if (u0 >= u1) return;
  const int64_t stride = g * (D + 2);
  int64_t fetched = 0;  // rows of this unit's keys the previous unit's value pass fetched
  int64_t b = std::upper_bound(first.begin(), first.end(), u0) - first.begin() - 1;
  for (int64_t u = u0; u < u1; ++u) {
    while (u >= first[b + 1]) ++b;
    const int64_t c = first_chunk(los, b, chunk) + unit_chunk(first, b, u, Hkv), h = unit_head(first, b, u, Hkv);
    const int64_t t0 = c * chunk, t1 = std::min(lens[b], t0 + chunk), lo = los ? los[b] : 0;
    NextUnit<C> next;
    if (u + 1 < u1) {
      int64_t nb = b;
      while (u + 1 >= first[nb + 1]) ++nb;
      const int64_t nc = first_chunk(los, nb, chunk) + unit_chunk(first, nb, u + 1, Hkv);
      const int64_t nh = unit_head(first, nb, u + 1, Hkv);
      next = {kp + nh * S * D, tables + nb * max_blocks, nc * chunk, std::min(lens[nb], nc * chunk + chunk)};
    }
    const T* qh = qp + b * row + h * g * D;
    const C* kh = kp + h * S * D;
    const C* vh = vp + h * S * D;
    const float* ksh = ksp ? ksp + h * S : nullptr;
    const float* vsh = vsp ? vsp + h * S : nullptr;
    const int64_t* tb = tables + b * max_blocks;
    float* pu = parts + u * stride;
    // the common group sizes get registers-sized loops; others run the generic one
    switch (g) {
      case 1: decode_chunk<T, C, D, 1>(qh, kh, vh, ksh, vsh, tb, bs, t0, t1, 1, scale, pu, next, fetched, lo); break;
      case 2: decode_chunk<T, C, D, 2>(qh, kh, vh, ksh, vsh, tb, bs, t0, t1, 2, scale, pu, next, fetched, lo); break;
      case 3: decode_chunk<T, C, D, 3>(qh, kh, vh, ksh, vsh, tb, bs, t0, t1, 3, scale, pu, next, fetched, lo); break;
      case 4: decode_chunk<T, C, D, 4>(qh, kh, vh, ksh, vsh, tb, bs, t0, t1, 4, scale, pu, next, fetched, lo); break;
      default:
        decode_chunk<T, C, D, 0>(qh, kh, vh, ksh, vsh, tb, bs, t0, t1, static_cast<int>(g), scale, pu, next, fetched, lo);
    }
    fetched = t1 - t0;  // the value pass fetched as many of the next unit's rows as this has
  }
}

// Sequence b's chunks merged by their softmax maxima and sums into out [H * D].
template <typename T, int D>
void merge_units(const float* parts, const std::vector<int64_t>& first, int64_t b, int64_t Hkv, int64_t g, T* out) {
  const int64_t stride = g * (D + 2), nch = (first[b + 1] - first[b]) / Hkv;
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t j = 0; j < g; ++j) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < nch; ++c) m = std::max(m, parts[(first[b] + h * nch + c) * stride + j * (D + 2)]);
      float l = 0.f, o[D] = {};
      for (int64_t c = 0; c < nch; ++c) {
        const float* pc = parts + (first[b] + h * nch + c) * stride + j * (D + 2);
        const float w = std::exp(pc[0] - m);
        l += pc[1] * w;
        for (int e = 0; e < D; ++e) o[e] += pc[2 + e] * w;
      }
      T* orow = out + (h * g + j) * D;
      for (int e = 0; e < D; ++e) orow[e] = static_cast<T>(o[e] / l);
    }
}

}  // namespace tm_decode
#endif
