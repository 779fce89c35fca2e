// One query row group's attention over a paged cache, in plain float loops the compiler
// vectorizes: paged_attention's kernel (paged_attention.cpp), and the fused decode step's
// attention where AVX-512 is missing (decode_step.cpp), so both give the same numbers.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace tm_rowattn {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <int D, typename cache_t>
inline void widen(const cache_t* rows, const float*, int64_t n, float* out) {
  for (int64_t x = 0; x < n * D; ++x) out[x] = to_f(rows[x]);
}
template <int D>
inline void widen(const int8_t* rows, const float* scales, int64_t n, float* out) {
  for (int64_t t = 0; t < n; ++t)
    for (int e = 0; e < D; ++e) out[t * D + e] = static_cast<float>(rows[t * D + e]) * scales[t];
}

// One (sequence, kv head): every query row of the sequence, the GQA group together.
// Blocks are widened to fp32 in a small buffer first (an int8 cache's rows times their
// scales), so the dot products and the weighted sum run as plain fp32 loops the compiler
// vectorizes (-O3 -ffast-math).
template <typename scalar_t, typename cache_t, int D>
void attend_one(const scalar_t* __restrict q,      // [n_q, H, D] rows of this sequence
                const cache_t* __restrict k_head,  // this kv head's slots
                const cache_t* __restrict v_head,
                const float* __restrict ks_head,   // int8 cache: this head's slot scales
                const float* __restrict vs_head,
                const int64_t* __restrict table, int64_t bs, int64_t n_q, int64_t seq_len,
                int64_t kvh, int64_t H, int64_t g, float scale,
                scalar_t* __restrict out,  // [n_q, H, D]
                int64_t window = 0) {      // > 0: a query sees its last `window` keys only
  // A query row's result depends only on its visible keys, not on the other rows of the
  // call nor on seq_len (every query row may come as its own sequence, see
  // tokenmill.model.attention.paged_attention): buffers and each head's scores start
  // 64-byte aligned, so the vectorized reductions split the same way every time.
  const int64_t ld = (seq_len + 15) / 16 * 16;
  std::vector<float> mem(g * D + g * ld + g * D + bs * D + 16);
  float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(mem.data()) + 63) & ~uintptr_t(63));
  float* qf = base;
  float* scores = qf + g * D;
  float* acc = scores + g * ld;
  float* buf = acc + g * D;
  for (int64_t i = 0; i < n_q; ++i) {
    const int64_t visible = seq_len - n_q + i + 1;  // causal: keys 0 .. position of query i
    const int64_t lo = window > 0 ? std::max<int64_t>(0, visible - window) : 0;  // the first key seen
    const int64_t nblocks = (visible + bs - 1) / bs;
    for (int64_t j = 0; j < g; ++j) {
      const scalar_t* qrow = q + (i * H + kvh * g + j) * D;
      for (int e = 0; e < D; ++e) qf[j * D + e] = to_f(qrow[e]) * scale;
    }
    for (int64_t b = lo / bs; b < nblocks; ++b) {
      const int64_t n_t = std::min(bs, visible - b * bs), t0 = std::max<int64_t>(0, lo - b * bs);
      const cache_t* kb = k_head + table[b] * bs * D;
      widen<D>(kb, ks_head ? ks_head + table[b] * bs : nullptr, n_t, buf);
      for (int64_t j = 0; j < g; ++j) {
        const float* qj = qf + j * D;
        float* sj = scores + j * ld + b * bs;
        for (int64_t t = t0; t < n_t; ++t) {
          const float* kr = buf + t * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int e = 0; e < D; ++e) s += qj[e] * kr[e];
          sj[t] = s;
        }
      }
    }
    for (int64_t j = 0; j < g; ++j) {
      float* sj = scores + j * ld;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t t = lo; t < visible; ++t) mx = sj[t] > mx ? sj[t] : mx;
      float sum = 0.f;
      for (int64_t t = lo; t < visible; ++t) {
        sj[t] = std::exp(sj[t] - mx);
        sum += sj[t];
      }
      const float inv = 1.f / sum;
      for (int64_t t = lo; t < visible; ++t) sj[t] *= inv;
    }
    std::fill(acc, acc + g * D, 0.f);
    for (int64_t b = lo / bs; b < nblocks; ++b) {
      const int64_t n_t = std::min(bs, visible - b * bs), t0 = std::max<int64_t>(0, lo - b * bs);
      const cache_t* vb = v_head + table[b] * bs * D;
      widen<D>(vb, vs_head ? vs_head + table[b] * bs : nullptr, n_t, buf);
      for (int64_t j = 0; j < g; ++j) {
        float* aj = acc + j * D;
        const float* pj = scores + j * ld + b * bs;
        for (int64_t t = t0; t < n_t; ++t) {
          const float p = pj[t];
          const float* vr = buf + t * D;
#pragma omp simd
          for (int e = 0; e < D; ++e) aj[e] += p * vr[e];
        }
      }
    }
    for (int64_t j = 0; j < g; ++j) {
      scalar_t* orow = out + (i * H + kvh * g + j) * D;
      for (int e = 0; e < D; ++e) orow[e] = static_cast<scalar_t>(acc[j * D + e]);
    }
  }
}

}  // namespace tm_rowattn
