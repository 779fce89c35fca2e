// Row-wise pieces of the Llama block shared by the separate ops (layer_ops.cpp) and the
// fused decode step (decode_step.cpp), so that both round the same way.
#pragma once
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "simd.h"

namespace tm_rows {

template <typename scalar_t>
void rms_row(const scalar_t* __restrict x, const scalar_t* __restrict w, scalar_t* __restrict y, int64_t n,
             float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t e = 0; e < n; ++e) {
    const float v = static_cast<float>(x[e]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t e = 0; e < n; ++e) y[e] = static_cast<scalar_t>(static_cast<float>(x[e]) * r * static_cast<float>(w[e]));
}

// x = rms_norm(x) * w in place: one q or k head (QK-norm). Not inlined, so the separate
// op and the fused step run one body (inlined, -ffast-math may sum in another order).
template <typename scalar_t>
__attribute__((noinline)) void rms_row_(scalar_t* __restrict x, const scalar_t* __restrict w, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t e = 0; e < n; ++e) {
    const float v = static_cast<float>(x[e]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t e = 0; e < n; ++e) x[e] = static_cast<scalar_t>(static_cast<float>(x[e]) * r * static_cast<float>(w[e]));
}

// h += delta (rounded to h's type), then y = rms_norm(h) * w.
template <typename scalar_t>
void add_rms_row(scalar_t* h, const scalar_t* delta, const scalar_t* w, scalar_t* y, int64_t n, float eps) {
  for (int64_t e = 0; e < n; ++e) h[e] = static_cast<scalar_t>(static_cast<float>(h[e]) + static_cast<float>(delta[e]));
  rms_row<scalar_t>(h, w, y, n, eps);
}

// Rotary embedding (rotate-half layout) on one head of `2 half` elements.
template <typename scalar_t>
void rope_head(scalar_t* v, const float* c, const float* s, int64_t half) {
  for (int64_t e = 0; e < half; ++e) {
    const float a = static_cast<float>(v[e]), b = static_cast<float>(v[e + half]);
    v[e] = static_cast<scalar_t>(a * c[e] - b * s[e]);
    v[e + half] = static_cast<scalar_t>(b * c[e] + a * s[e]);
  }
}

// The vectorized part of a row; returns how many elements it did.
template <typename T>
int64_t silu_mul_simd(const T*, const T*, T*, int64_t) { return 0; }
#if defined(__AVX512F__)
template <typename T>
int64_t silu_mul_avx512(const T* g, const T* u, T* o, int64_t I) {
  int64_t e = 0;
  for (; e + 16 <= I; e += 16) {
    const __m512 gv = tm_simd::load16(g + e);
    const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), tm_simd::exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    tm_simd::store16(o + e, _mm512_mul_ps(s, tm_simd::load16(u + e)));
  }
  return e;
}
template <>
inline int64_t silu_mul_simd(const float* g, const float* u, float* o, int64_t I) { return silu_mul_avx512(g, u, o, I); }
template <>
inline int64_t silu_mul_simd(const c10::BFloat16* g, const c10::BFloat16* u, c10::BFloat16* o, int64_t I) {
  return silu_mul_avx512(g, u, o, I);
}
#endif

// o[e] = silu(g[e]) * u[e] for e < I, u = g + I (the fused gate-up layout).
template <typename scalar_t>
void silu_mul_row(const scalar_t* g, scalar_t* o, int64_t I) {
  const scalar_t* u = g + I;
  int64_t e = silu_mul_simd(g, u, o, I);
  for (; e < I; ++e) {
    const float gv = static_cast<float>(g[e]);
    o[e] = static_cast<scalar_t>(gv / (1.f + std::exp(-gv)) * static_cast<float>(u[e]));
  }
}

// gelu(x) with tanh's approximation (torch's approximate="tanh", Gemma's GeGLU):
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(y) = 1 - 2 / (1 + e^(2y)).
constexpr float kGeluC = 0.7978845608028654f, kGeluA = 0.044715f;

template <typename T>
int64_t gelu_mul_simd(const T*, const T*, T*, int64_t) { return 0; }
#if defined(__AVX512F__)
template <typename T>
int64_t gelu_mul_avx512(const T* g, const T* u, T* o, int64_t I) {
  int64_t e = 0;
  const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f), half = _mm512_set1_ps(0.5f);
  for (; e + 16 <= I; e += 16) {
    const __m512 x = tm_simd::load16(g + e);
    __m512 y = _mm512_mul_ps(_mm512_set1_ps(kGeluC), _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(kGeluA), x),
                                                                      _mm512_mul_ps(x, x), x));
    y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-15.f)), _mm512_set1_ps(15.f));  // tanh is +-1 there
    const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(one, tm_simd::exp512(_mm512_mul_ps(two, y)))));
    const __m512 gelu = _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, t));
    tm_simd::store16(o + e, _mm512_mul_ps(gelu, tm_simd::load16(u + e)));
  }
  return e;
}
template <>
inline int64_t gelu_mul_simd(const float* g, const float* u, float* o, int64_t I) { return gelu_mul_avx512(g, u, o, I); }
template <>
inline int64_t gelu_mul_simd(const c10::BFloat16* g, const c10::BFloat16* u, c10::BFloat16* o, int64_t I) {
  return gelu_mul_avx512(g, u, o, I);
}
#endif

// o[e] = gelu_tanh(g[e]) * u[e] for e < I, u = g + I (the fused gate-up layout). Not
// inlined, as rms_row_.
template <typename scalar_t>
__attribute__((noinline)) void gelu_mul_row(const scalar_t* g, scalar_t* o, int64_t I) {
  const scalar_t* u = g + I;
  int64_t e = gelu_mul_simd(g, u, o, I);
  for (; e < I; ++e) {
    const float x = static_cast<float>(g[e]);
    const float y = std::min(15.f, std::max(-15.f, kGeluC * (x + kGeluA * x * x * x)));
    const float t = 1.f - 2.f / (1.f + std::exp(2.f * y));
    o[e] = static_cast<scalar_t>(0.5f * x * (1.f + t) * static_cast<float>(u[e]));
  }
}

}  // namespace tm_rows
