// The int8-activation tile kernels of quant_gemv.cpp, shared with the fused decode step
// (decode_step.cpp). Layouts and numerics are described in quant_gemv.cpp.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <vector>

#include "simd.h"

namespace tm_quant {

constexpr int64_t kTile = 16, kGroup = 32;

constexpr int64_t kXGroup = 16;  // activations: one int8 scale per 16 inputs

struct QuantX {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> d;      // [M, K/16] scale per half group
  std::vector<int32_t> qsum; // [M, K/16] sum of xq per half group (int8's -128 correction)
  std::vector<float> sum;    // [M, K/32] float sum of x per group (int4's m term)
  // second level (precise mode): the rounding residual x - d * q, itself in int8
  std::vector<int8_t> q2;    // [M, K]
  std::vector<float> d2;     // [M, K/16]
  std::vector<int32_t> qsum2; // [M, K/16] sum of q2 per half group
};

#if defined(__AVX2__) && defined(__FMA__)
// 8-lane helpers of quantize_rows and the AVX2 tiles
inline __m256 avx2_load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 avx2_load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 avx2_abs(__m256 v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
inline float avx2_hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float avx2_hsum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}
// 16 int32 (8 in a, 8 in b) to int8 with saturation, in order
inline void avx2_store16_i8(int8_t* p, __m256i a, __m256i b) {
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), _MM_SHUFFLE(3, 1, 2, 0));  // 16 int16
  const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bytes);
}
inline void avx2_store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void avx2_store8(c10::BFloat16* p, __m256 v) {  // round to nearest even, as c10::BFloat16 does (NaN aside)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  // 8 int32 (each < 2^16) -> 8 uint16: pack within lanes, then gather the two lanes' halves
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
// One int8 level of a 16-input group (f0, f1): codes into q, returns the scale, and
// the codes themselves in q0, q1.
inline float avx2_round_level(__m256 f0, __m256 f1, int8_t* q, __m256i& q0, __m256i& q1) {
  const float d = avx2_hmax(_mm256_max_ps(avx2_abs(f0), avx2_abs(f1))) / 127.f;
  const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  q0 = _mm256_cvtps_epi32(_mm256_mul_ps(f0, inv));
  q1 = _mm256_cvtps_epi32(_mm256_mul_ps(f1, inv));
  avx2_store16_i8(q, q0, q1);
  return d;
}
#endif

// What a tile kind reads of the quantized activations; the rest is not computed (the
// horizontal sums cost as much as the rounding: at 512 rows, quantizing took ~11% of a
// prefill). Kinds: 0 int8 rows, 1 int4, 2 int4 precise, 3 int8 blocks precise, 4 Q5_0
// precise, 5 int8 blocks, 6 Q5_0 (precise: the activations' second int8 level).
struct XNeeds {
  bool precise;  // the second int8 level
  bool qsums;    // sums of the codes: the AVX-512 int8 tiles' -128 correction
  bool sums;     // float sums per group: the int4 and Q5_0 tiles' m term
};
constexpr XNeeds x_needs(int kind) {
  // (the condition of the AVX-512 tiles below, the only readers of the code sums; the
  // AVX2 quantize loop never writes them)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  const bool qsums = kind == 0 || kind == 3 || kind == 5;
#else
  const bool qsums = false;  // the AVX2 int8 tiles carry the sign instead
#endif
  return {kind >= 2 && kind <= 4, qsums, kind == 1 || kind == 2 || kind == 4 || kind == 6};
}

// A half group's float sum into its group's (the first half sets it, the second adds)
inline void add_half_sum(QuantX& r, int64_t i, float s) {
  if (i % 2 == 0) r.sum[i / 2] = s;
  else r.sum[i / 2] += s;
}

// Scales per 16 inputs, not 32: the inputs of the qkv and down projections carry
// outlier channels, and with 32 a group perplexity rose 2% (benchmarks/quality.py
// --decode-kernels); the kernels' lo/hi halves of a group map onto the two scales.
// Half groups [i0, i1) of x (i0 even: a group's float sum is made of its two halves)
// into r, which is sized already.
template <typename In>
void quantize_range(const In* x, int64_t i0, int64_t i1, XNeeds need, QuantX& r) {
  const bool precise = need.precise;
  int64_t i = i0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // One 16-input group is one vector. The scalar loop below cost ~12 us a layer for each
  // thread of the fused decode step (both quantize the same rows), ~8% of a step.
  for (; i < i1; ++i) {
    const __m512 f = tm_simd::load16(x + i * kXGroup);
    const float d = _mm512_reduce_max_ps(_mm512_abs_ps(f)) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    // (the conversion rounds to nearest even, as nearbyint does in the default mode)
    const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(f, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q.data() + i * kXGroup), _mm512_cvtsepi32_epi8(qi));
    r.d[i] = d;
    if (need.qsums) r.qsum[i] = _mm512_reduce_add_epi32(qi);
    if (precise) {
      const __m512 res = _mm512_fnmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(qi), f);
      const float d2 = _mm512_reduce_max_ps(_mm512_abs_ps(res)) / 127.f, inv2 = d2 > 0.f ? 1.f / d2 : 0.f;
      const __m512i q2 = _mm512_cvtps_epi32(_mm512_mul_ps(res, _mm512_set1_ps(inv2)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q2.data() + i * kXGroup), _mm512_cvtsepi32_epi8(q2));
      r.d2[i] = d2;
      if (need.qsums) r.qsum2[i] = _mm512_reduce_add_epi32(q2);
    }
    if (need.sums) add_half_sum(r, i, _mm512_reduce_add_ps(f));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // The same in two 8-lane halves.
  for (; i < i1; ++i) {
    const __m256 f0 = avx2_load8(x + i * kXGroup), f1 = avx2_load8(x + i * kXGroup + 8);
    __m256i q0, q1;
    const float d = r.d[i] = avx2_round_level(f0, f1, r.q.data() + i * kXGroup, q0, q1);
    if (precise) {  // the second level rounds the first's residual
      const __m256 vd = _mm256_set1_ps(d);
      __m256i p0, p1;
      r.d2[i] = avx2_round_level(_mm256_fnmadd_ps(vd, _mm256_cvtepi32_ps(q0), f0),
                                 _mm256_fnmadd_ps(vd, _mm256_cvtepi32_ps(q1), f1), r.q2.data() + i * kXGroup,
                                 p0, p1);
    }
    if (need.sums) add_half_sum(r, i, avx2_hsum(_mm256_add_ps(f0, f1)));
  }
#endif
  for (; i < i1; ++i) {
    const In* v = x + i * kXGroup;
    float f[kXGroup];
    float amax = 0.f, s = 0.f;
    for (int e = 0; e < kXGroup; ++e) {
      f[e] = static_cast<float>(v[e]);
      amax = std::max(amax, std::fabs(f[e]));
      s += f[e];
    }
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int32_t qs = 0;
    int8_t* q = r.q.data() + i * kXGroup;
    for (int e = 0; e < kXGroup; ++e) {
      q[e] = static_cast<int8_t>(std::nearbyint(f[e] * inv));
      qs += q[e];
    }
    r.d[i] = d;
    if (need.qsums) r.qsum[i] = qs;
    if (precise) {  // |residual| <= d / 2: 8 more bits below the first level's
      float res[kXGroup], rmax = 0.f;
      for (int e = 0; e < kXGroup; ++e) {
        res[e] = f[e] - d * q[e];
        rmax = std::max(rmax, std::fabs(res[e]));
      }
      const float d2 = rmax / 127.f, inv2 = d2 > 0.f ? 1.f / d2 : 0.f;
      int8_t* q2 = r.q2.data() + i * kXGroup;
      int32_t qs2 = 0;
      for (int e = 0; e < kXGroup; ++e) {
        q2[e] = static_cast<int8_t>(std::nearbyint(res[e] * inv2));
        qs2 += q2[e];
      }
      r.d2[i] = d2;
      if (need.qsums) r.qsum2[i] = qs2;
    }
    if (need.sums) add_half_sum(r, i, s);
  }
}

inline QuantX& sized_quant_buffers(int64_t M, int64_t K, XNeeds need) {
  // reused across calls (decode calls these ~120 times a step; allocation showed up)
  thread_local QuantX r;
  const int64_t H = K / kXGroup;
  r.q.resize(M * K);
  r.d.resize(M * H);
  if (need.qsums) r.qsum.resize(M * H);
  if (need.sums) r.sum.resize(M * H / 2);
  if (need.precise) {
    r.q2.resize(M * K);
    r.d2.resize(M * H);
    if (need.qsums) r.qsum2.resize(M * H);
  }
  return r;
}

// x [M, K] quantized for tiles of `kind`, rows shared among the threads (a prefill's
// hundreds of rows: on one thread the other waited ~11% of the time). Inside the fused
// decode step's parallel region at::parallel_for runs inline, so there each thread
// quantizes the rows for itself, into its own buffers.
template <typename In>
const QuantX& quantize_rows(const In* x, int64_t M, int64_t K, int kind) {
  const XNeeds need = x_needs(kind);
  QuantX& r = sized_quant_buffers(M, K, need);
  const int64_t H = K / kXGroup;
  at::parallel_for(0, M, 16, [&](int64_t b0, int64_t b1) { quantize_range(x, b0 * H, b1 * H, need, r); });
  return r;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TM_QUANT_TILES 1
constexpr bool kVnni = true;

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// One tile (16 output rows) for R rows of x starting at xrow. Precise: the activations'
// second int8 level too (twice the dot products, still under the memory time at 1 row).
// Q5: GGUF's Q5_0 (kind 4): each code's fifth bit from the group's bit planes, and
// m = -16 d.
template <int R, bool Precise, bool Q5 = false>
void q4_tile(const uint8_t* w, const QuantX& xq, int64_t xrow, int64_t K, __m512 out[R]) {
  const int64_t G = K / kGroup;
  constexpr int64_t kGroupBytes = Q5 ? 352 : 320;
  const __m512i lo_mask = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i lo_dot[R], hi_dot[R];  // inputs 0..15 and 16..31 of the group: two x scales
    __m512i lo_dot2[Precise ? R : 1], hi_dot2[Precise ? R : 1];
    for (int r = 0; r < R; ++r) lo_dot[r] = hi_dot[r] = _mm512_setzero_si512();
    if constexpr (Precise)
      for (int r = 0; r < R; ++r) lo_dot2[r] = hi_dot2[r] = _mm512_setzero_si512();
    const uint8_t* wg = w + g * kGroupBytes;
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(wg + c * 64);
      __m512i lo = _mm512_and_si512(v, lo_mask);
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo_mask);
      if constexpr (Q5) {  // bit i of a plane: byte i of the chunk
        uint64_t plo, phi;
        std::memcpy(&plo, wg + 256 + c * 16, 8);
        std::memcpy(&phi, wg + 256 + c * 16 + 8, 8);
        lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(plo), lo, sixteen);
        hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(phi), hi, sixteen);
      }
      for (int r = 0; r < R; ++r) {
        const int64_t xo = (xrow + r) * K + g * kGroup + 4 * c;
        lo_dot[r] = _mm512_dpbusd_epi32(lo_dot[r], lo, bcast4(xq.q.data() + xo));
        hi_dot[r] = _mm512_dpbusd_epi32(hi_dot[r], hi, bcast4(xq.q.data() + xo + 16));
        if constexpr (Precise) {
          lo_dot2[r] = _mm512_dpbusd_epi32(lo_dot2[r], lo, bcast4(xq.q2.data() + xo));
          hi_dot2[r] = _mm512_dpbusd_epi32(hi_dot2[r], hi, bcast4(xq.q2.data() + xo + 16));
        }
      }
    }
    const uint16_t* dmg = reinterpret_cast<const uint16_t*>(wg + (Q5 ? 320 : 256));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dmg)));
    const __m512 m = Q5 ? _mm512_mul_ps(d, _mm512_set1_ps(-16.f))
                        : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dmg + 16)));
    for (int r = 0; r < R; ++r) {
      const int64_t gi = (xrow + r) * G + g;
      const float* dx = xq.d.data() + 2 * gi;
      __m512 dots = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo_dot[r]), _mm512_set1_ps(dx[0]),
                                    _mm512_mul_ps(_mm512_cvtepi32_ps(hi_dot[r]), _mm512_set1_ps(dx[1])));
      if constexpr (Precise) {
        const float* dx2 = xq.d2.data() + 2 * gi;
        dots = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo_dot2[r]), _mm512_set1_ps(dx2[0]), dots);
        dots = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi_dot2[r]), _mm512_set1_ps(dx2[1]), dots);
      }
      acc[r] = _mm512_fmadd_ps(dots, d, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xq.sum[gi]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

template <int R>
void q8_tile(const uint8_t* w, const QuantX& xq, int64_t xrow, int64_t K, __m512 out[R]) {
  const int64_t G = K / kGroup;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    // u = q + 128, so sum(u * x) counts 128 * sum(xq) too much: start below by that;
    // chunks 0-3 hold inputs 0..15 of the group, 4-7 inputs 16..31 (two x scales)
    __m512i lo_dot[R], hi_dot[R];
    for (int r = 0; r < R; ++r) {
      lo_dot[r] = _mm512_set1_epi32(-128 * xq.qsum[2 * ((xrow + r) * G + g)]);
      hi_dot[r] = _mm512_set1_epi32(-128 * xq.qsum[2 * ((xrow + r) * G + g) + 1]);
    }
    const uint8_t* wg = w + 64 + g * 512;
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(wg + c * 64);
      const __m512i u = _mm512_loadu_si512(wg + (c + 4) * 64);
      for (int r = 0; r < R; ++r) {
        const int8_t* xg = xq.q.data() + (xrow + r) * K + g * kGroup;
        lo_dot[r] = _mm512_dpbusd_epi32(lo_dot[r], v, bcast4(xg + 4 * c));
        hi_dot[r] = _mm512_dpbusd_epi32(hi_dot[r], u, bcast4(xg + 16 + 4 * c));
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* dx = xq.d.data() + 2 * ((xrow + r) * G + g);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo_dot[r]), _mm512_set1_ps(dx[0]), acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi_dot[r]), _mm512_set1_ps(dx[1]), acc[r]);
    }
  }
  const __m512 s = _mm512_loadu_ps(reinterpret_cast<const float*>(w));
  for (int r = 0; r < R; ++r) out[r] = _mm512_mul_ps(acc[r], s);
}

// int8 codes with a float16 scale per (row, group of 32): GGUF's Q8_0 grid, so a Q8_0
// tensor's codes and scales come back exactly (the output projection, where a second
// rounding decides ties between the top logits). Per group 512 bytes of codes as in
// q8_tile, then the 16 rows' scales: 544 bytes. Precise: the activations' second int8
// level too; the output projection always takes it (x's rounding moves every logit at
// once), the blocks' layers as the model's activation levels say.
template <int R, bool Precise = true>
void q8b_tile(const uint8_t* w, const QuantX& xq, int64_t xrow, int64_t K, __m512 out[R]) {
  const int64_t G = K / kGroup;
  constexpr int R2 = Precise ? R : 1;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i lo_dot[R], hi_dot[R], lo_dot2[R2], hi_dot2[R2];
    for (int r = 0; r < R; ++r) {
      const int64_t hg = 2 * ((xrow + r) * G + g);
      lo_dot[r] = _mm512_set1_epi32(-128 * xq.qsum[hg]);
      hi_dot[r] = _mm512_set1_epi32(-128 * xq.qsum[hg + 1]);
      if constexpr (Precise) {
        lo_dot2[r] = _mm512_set1_epi32(-128 * xq.qsum2[hg]);
        hi_dot2[r] = _mm512_set1_epi32(-128 * xq.qsum2[hg + 1]);
      }
    }
    const uint8_t* wg = w + g * 544;
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(wg + c * 64);
      const __m512i u = _mm512_loadu_si512(wg + (c + 4) * 64);
      for (int r = 0; r < R; ++r) {
        const int64_t xo = (xrow + r) * K + g * kGroup + 4 * c;
        lo_dot[r] = _mm512_dpbusd_epi32(lo_dot[r], v, bcast4(xq.q.data() + xo));
        hi_dot[r] = _mm512_dpbusd_epi32(hi_dot[r], u, bcast4(xq.q.data() + xo + 16));
        if constexpr (Precise) {
          lo_dot2[r] = _mm512_dpbusd_epi32(lo_dot2[r], v, bcast4(xq.q2.data() + xo));
          hi_dot2[r] = _mm512_dpbusd_epi32(hi_dot2[r], u, bcast4(xq.q2.data() + xo + 16));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 512)));
    for (int r = 0; r < R; ++r) {
      const int64_t hg = 2 * ((xrow + r) * G + g);
      const float* dx = xq.d.data() + hg;
      __m512 dots = _mm512_mul_ps(_mm512_cvtepi32_ps(lo_dot[r]), _mm512_set1_ps(dx[0]));
      dots = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi_dot[r]), _mm512_set1_ps(dx[1]), dots);
      if constexpr (Precise) {
        const float* dx2 = xq.d2.data() + hg;
        dots = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo_dot2[r]), _mm512_set1_ps(dx2[0]), dots);
        dots = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi_dot2[r]), _mm512_set1_ps(dx2[1]), dots);
      }
      acc[r] = _mm512_fmadd_ps(dots, d, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// Kind: 0 int8 (row scales), 1 int4, 2 int4 precise, 3 int8 blocks (Q8_0 grid) precise,
// 4 Q5_0 blocks precise, 5 int8 blocks, 6 Q5_0 blocks
template <int R, int Kind>
void tile_rows(const uint8_t* w, const QuantX& xq, int64_t m0, int64_t K, __m512* out) {
  if constexpr (Kind == 0) q8_tile<R>(w, xq, m0, K, out);
  else if constexpr (Kind == 3 || Kind == 5) q8b_tile<R, Kind == 3>(w, xq, m0, K, out);
  else if constexpr (Kind == 4 || Kind == 6) q4_tile<R, Kind == 4, true>(w, xq, m0, K, out);
  else q4_tile<R, Kind == 2>(w, xq, m0, K, out);
}

// Tiles [t0, t1) of w (tile_bytes each) for the M rows of xq: y [M, N] columns
// 16 t0 .. 16 t1.
template <int Kind, typename Out>
void tiles_range(const uint8_t* w, int64_t tile_bytes, const QuantX& xq, int64_t M, int64_t K, int64_t N,
                 int64_t t0, int64_t t1, Out* y) {
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = w + t * tile_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      __m512 res[4];
      const int64_t R = std::min<int64_t>(4, M - m0);
      switch (R) {
        case 1: tile_rows<1, Kind>(wt, xq, m0, K, res); break;
        case 2: tile_rows<2, Kind>(wt, xq, m0, K, res); break;
        case 3: tile_rows<3, Kind>(wt, xq, m0, K, res); break;
        default: tile_rows<4, Kind>(wt, xq, m0, K, res);
      }
      for (int64_t r = 0; r < R; ++r) tm_simd::store16(y + (m0 + r) * N + t * kTile, res[r]);
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 (no AVX-512: AMD Zen 1-3, Intel client parts): the same tiles, layouts and
// integer dot products, each 16-row tile as two 8-row halves of 32 bytes. vpdpbusd
// becomes vpmaddubsw (u8 x s8 pairs into int16) then vpmaddwd against ones (int16
// pairs into int32). The integer dots are exact and the float steps in the same order,
// so the two agree to rounding (a group's float sum of x is added in another order).
#define TM_QUANT_TILES 1
constexpr bool kVnni = true;

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}


// s8 weights w x s8 activations x, 4 at a time into int32 lanes (vpdpbusd's sum): |w|
// (aw, taken once for every row of x) against x carrying w's sign, so no pair of
// products exceeds 2^15 in vpmaddubsw.
inline __m256i dot_s8(__m256i aw, __m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}

// 32 bits to 32 bytes: 16 where the bit is set, else 0 (bit i: byte i)
inline __m256i avx2_bits_to_16s(uint32_t bits) {
  // byte i takes byte i / 8 of the bits (shuffles stay in 128-bit lanes; each holds all 4)
  const __m256i which = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), which), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), _mm256_set1_epi8(16));
}

// One tile for R rows of x: out[2r + h] holds row r's outputs at tile rows 8h..8h+7.
// Q5: GGUF's Q5_0 (kind 4), as the AVX-512 tile.
template <int R, bool Precise, bool Q5 = false>
void q4_tile(const uint8_t* w, const QuantX& xq, int64_t xrow, int64_t K, __m256 out[2 * R]) {
  const int64_t G = K / kGroup;
  constexpr int64_t kGroupBytes = Q5 ? 352 : 320;
  const __m256i lo_mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  // one 8-row half at a time over all groups: 16 ymm registers hold one half's
  // accumulators for 4 rows, not both halves' (1.27x at 512 rows, no slower at 1)
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wg = w + g * kGroupBytes;
      const uint16_t* dmg = reinterpret_cast<const uint16_t*>(wg + (Q5 ? 320 : 256));
      // int16 sums over the group's 4 chunks: at most 8 * 31 * 127, no overflow
      __m256i lo16[R], hi16[R], lo16b[Precise ? R : 1], hi16b[Precise ? R : 1];
      for (int r = 0; r < R; ++r) lo16[r] = hi16[r] = _mm256_setzero_si256();
      if constexpr (Precise)
        for (int r = 0; r < R; ++r) lo16b[r] = hi16b[r] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + c * 64 + h * 32));
        __m256i lo = _mm256_and_si256(v, lo_mask);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo_mask);
        if constexpr (Q5) {  // this half's 32 bits of each plane
          uint32_t plo, phi;
          std::memcpy(&plo, wg + 256 + c * 16 + 4 * h, 4);
          std::memcpy(&phi, wg + 256 + c * 16 + 8 + 4 * h, 4);
          lo = _mm256_or_si256(lo, avx2_bits_to_16s(plo));
          hi = _mm256_or_si256(hi, avx2_bits_to_16s(phi));
        }
        for (int r = 0; r < R; ++r) {
          const int64_t xo = (xrow + r) * K + g * kGroup + 4 * c;
          lo16[r] = _mm256_add_epi16(lo16[r], _mm256_maddubs_epi16(lo, bcast4(xq.q.data() + xo)));
          hi16[r] = _mm256_add_epi16(hi16[r], _mm256_maddubs_epi16(hi, bcast4(xq.q.data() + xo + 16)));
          if constexpr (Precise) {
            lo16b[r] = _mm256_add_epi16(lo16b[r], _mm256_maddubs_epi16(lo, bcast4(xq.q2.data() + xo)));
            hi16b[r] = _mm256_add_epi16(hi16b[r], _mm256_maddubs_epi16(hi, bcast4(xq.q2.data() + xo + 16)));
          }
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dmg + 8 * h)));
      const __m256 m = Q5 ? _mm256_mul_ps(d, _mm256_set1_ps(-16.f))
                          : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dmg + 16 + 8 * h)));
      for (int r = 0; r < R; ++r) {
        const int64_t gi = (xrow + r) * G + g;
        const float* dx = xq.d.data() + 2 * gi;
        const __m256 lo_dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(lo16[r], ones));
        const __m256 hi_dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(hi16[r], ones));
        __m256 dots = _mm256_fmadd_ps(lo_dot, _mm256_set1_ps(dx[0]), _mm256_mul_ps(hi_dot, _mm256_set1_ps(dx[1])));
        if constexpr (Precise) {
          const float* dx2 = xq.d2.data() + 2 * gi;
          dots = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(lo16b[r], ones)), _mm256_set1_ps(dx2[0]), dots);
          dots = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(hi16b[r], ones)), _mm256_set1_ps(dx2[1]), dots);
        }
        acc[r] = _mm256_fmadd_ps(dots, d, acc[r]);
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xq.sum[gi]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[2 * r + h] = acc[r];
  }
}

// q + 128 bytes back to the signed codes q
inline __m256i codes_s8(const uint8_t* p) {
  return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_set1_epi8(-128));
}

template <int R>
void q8_tile(const uint8_t* w, const QuantX& xq, int64_t xrow, int64_t K, __m256 out[2 * R]) {
  const int64_t G = K / kGroup;
  __m256 acc[2 * R];
  for (int r = 0; r < 2 * R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + 64 + g * 512;
    for (int h = 0; h < 2; ++h) {
      // (signed codes: no 128 * sum(xq) to take off, the same int32 dots)
      __m256i lo_dot[R], hi_dot[R];
      for (int r = 0; r < R; ++r) lo_dot[r] = hi_dot[r] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i v = codes_s8(wg + c * 64 + h * 32);
        const __m256i u = codes_s8(wg + (c + 4) * 64 + h * 32);
        const __m256i av = _mm256_sign_epi8(v, v), au = _mm256_sign_epi8(u, u);
        for (int r = 0; r < R; ++r) {
          const int8_t* xg = xq.q.data() + (xrow + r) * K + g * kGroup;
          lo_dot[r] = _mm256_add_epi32(lo_dot[r], dot_s8(av, v, bcast4(xg + 4 * c)));
          hi_dot[r] = _mm256_add_epi32(hi_dot[r], dot_s8(au, u, bcast4(xg + 16 + 4 * c)));
        }
      }
      for (int r = 0; r < R; ++r) {
        const float* dx = xq.d.data() + 2 * ((xrow + r) * G + g);
        __m256& a = acc[2 * r + h];
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo_dot[r]), _mm256_set1_ps(dx[0]), a);
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi_dot[r]), _mm256_set1_ps(dx[1]), a);
      }
    }
  }
  const float* s = reinterpret_cast<const float*>(w);
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) out[2 * r + h] = _mm256_mul_ps(acc[2 * r + h], avx2_load8(s + 8 * h));
}

template <int R, bool Precise = true>
void q8b_tile(const uint8_t* w, const QuantX& xq, int64_t xrow, int64_t K, __m256 out[2 * R]) {
  const int64_t G = K / kGroup;
  for (int h = 0; h < 2; ++h) {  // one half at a time, as q4_tile
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wg = w + g * 544;
      __m256i lo_dot[R], hi_dot[R], lo_dot2[R], hi_dot2[R];
      for (int r = 0; r < R; ++r) lo_dot[r] = hi_dot[r] = lo_dot2[r] = hi_dot2[r] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i v = codes_s8(wg + c * 64 + h * 32);
        const __m256i u = codes_s8(wg + (c + 4) * 64 + h * 32);
        const __m256i av = _mm256_sign_epi8(v, v), au = _mm256_sign_epi8(u, u);
        for (int r = 0; r < R; ++r) {
          const int64_t xo = (xrow + r) * K + g * kGroup + 4 * c;
          lo_dot[r] = _mm256_add_epi32(lo_dot[r], dot_s8(av, v, bcast4(xq.q.data() + xo)));
          hi_dot[r] = _mm256_add_epi32(hi_dot[r], dot_s8(au, u, bcast4(xq.q.data() + xo + 16)));
          if constexpr (Precise) {
            lo_dot2[r] = _mm256_add_epi32(lo_dot2[r], dot_s8(av, v, bcast4(xq.q2.data() + xo)));
            hi_dot2[r] = _mm256_add_epi32(hi_dot2[r], dot_s8(au, u, bcast4(xq.q2.data() + xo + 16)));
          }
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 512 + 16 * h)));
      for (int r = 0; r < R; ++r) {
        const int64_t hg = 2 * ((xrow + r) * G + g);
        const float* dx = xq.d.data() + hg;
        __m256 dots = _mm256_mul_ps(_mm256_cvtepi32_ps(lo_dot[r]), _mm256_set1_ps(dx[0]));
        dots = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi_dot[r]), _mm256_set1_ps(dx[1]), dots);
        if constexpr (Precise) {
          const float* dx2 = xq.d2.data() + hg;
          dots = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo_dot2[r]), _mm256_set1_ps(dx2[0]), dots);
          dots = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi_dot2[r]), _mm256_set1_ps(dx2[1]), dots);
        }
        acc[r] = _mm256_fmadd_ps(dots, d, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[2 * r + h] = acc[r];
  }
}

template <int R, int Kind>
void tile_rows(const uint8_t* w, const QuantX& xq, int64_t m0, int64_t K, __m256* out) {
  if constexpr (Kind == 0) q8_tile<R>(w, xq, m0, K, out);
  else if constexpr (Kind == 3 || Kind == 5) q8b_tile<R, Kind == 3>(w, xq, m0, K, out);
  else if constexpr (Kind == 4 || Kind == 6) q4_tile<R, Kind == 4, true>(w, xq, m0, K, out);
  else q4_tile<R, Kind == 2>(w, xq, m0, K, out);
}

template <int Kind, typename Out>
void tiles_range(const uint8_t* w, int64_t tile_bytes, const QuantX& xq, int64_t M, int64_t K, int64_t N,
                 int64_t t0, int64_t t1, Out* y) {
  // int4 with two-level activations keeps twice the accumulators: 2 rows at a time fit
  // the 16 registers (1.14x over 4 at 512 rows; int8 blocks gained nothing)
  constexpr int64_t kRows = Kind == 2 || Kind == 4 ? 2 : 4;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = w + t * tile_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      __m256 res[8];
      const int64_t R = std::min<int64_t>(kRows, M - m0);
      switch (R) {
        case 1: tile_rows<1, Kind>(wt, xq, m0, K, res); break;
        case 2: tile_rows<2, Kind>(wt, xq, m0, K, res); break;
        case 3: if constexpr (kRows > 2) tile_rows<3, Kind>(wt, xq, m0, K, res); break;
        default: if constexpr (kRows > 2) tile_rows<4, Kind>(wt, xq, m0, K, res);
      }
      for (int64_t r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) avx2_store8(y + (m0 + r) * N + t * kTile + 8 * h, res[2 * r + h]);
    }
  }
}
#else
constexpr bool kVnni = false;
#endif

}  // namespace tm_quant
