// The fused step's argmax over the logits (decode_step.cpp): the first maximum, NaN
// counted as the largest, as numpy's and torch's argmax give it.
#pragma once
#include <cstdint>
#include <cstring>
#include <immintrin.h>

namespace tm_argmax {

// For an argmax scanning in index order: whether value a, seen after b, replaces it. NaN
// counts as the largest and the first one stays, as numpy's and torch's argmax do; bits,
// not std::isnan, since -ffast-math lets the compiler assume no NaN.
inline bool is_nan(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u & 0x7FFFFFFFu) > 0x7F800000u;
}
inline bool later_wins(float a, float b) { return !is_nan(b) && (is_nan(a) || a > b); }

#if defined(__AVX512F__)
// The first maximum of row[c0, c1) (c1 - c0 a positive multiple of 16), as later_wins
// scans it: 16 lanes each keep their own first maximum, then the largest value's
// lowest index wins; a row holding a NaN takes the scalar scan. ~3 us for half the
// vocabulary where the scalar scan took ~36 (a step's 1%).
inline int64_t first_max(const float* row, int64_t c0, int64_t c1) {
  const __m512i abs_bits = _mm512_set1_epi32(0x7FFFFFFF), inf_bits = _mm512_set1_epi32(0x7F800000);
  const __m512i sixteen = _mm512_set1_epi32(16);
  __m512 best = _mm512_loadu_ps(row + c0);
  __m512i at = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(c0)),
                                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  __m512i best_at = at;
  __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(best), abs_bits), inf_bits);
  for (int64_t c = c0 + 16; c < c1; c += 16) {
    const __m512 v = _mm512_loadu_ps(row + c);
    at = _mm512_add_epi32(at, sixteen);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    best_at = _mm512_mask_mov_epi32(best_at, gt, at);
    nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs_bits), inf_bits);
  }
  if (nan) {
    int64_t bi = c0;
    for (int64_t c = c0 + 1; c < c1; ++c)
      if (later_wins(row[c], row[bi])) bi = c;
    return bi;
  }
  const __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(top, best_at);
}
#elif defined(__AVX2__)
// first_max in 8 lanes (c1 - c0 a positive multiple of 16).
inline int64_t first_max(const float* row, int64_t c0, int64_t c1) {
  const __m256i abs_bits = _mm256_set1_epi32(0x7FFFFFFF), inf_bits = _mm256_set1_epi32(0x7F800000);
  const __m256i eight = _mm256_set1_epi32(8);
  __m256 best = _mm256_loadu_ps(row + c0);
  __m256i at = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(c0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i best_at = at;
  __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(best), abs_bits), inf_bits);
  for (int64_t c = c0 + 8; c < c1; c += 8) {
    const __m256 v = _mm256_loadu_ps(row + c);
    at = _mm256_add_epi32(at, eight);
    const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, gt);
    best_at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_at), _mm256_castsi256_ps(at), gt));
    nan = _mm256_or_si256(nan, _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), abs_bits), inf_bits));
  }
  if (!_mm256_testz_si256(nan, nan)) {
    int64_t bi = c0;
    for (int64_t c = c0 + 1; c < c1; ++c)
      if (later_wins(row[c], row[bi])) bi = c;
    return bi;
  }
  alignas(32) float vals[8];
  alignas(32) int32_t idx[8];
  _mm256_store_ps(vals, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(idx), best_at);
  float top = vals[0];
  for (int i = 1; i < 8; ++i) top = vals[i] > top ? vals[i] : top;
  int64_t bi = c1;
  for (int i = 0; i < 8; ++i)
    if (vals[i] == top && idx[i] < bi) bi = idx[i];
  return bi;
}
#endif

}  // namespace tm_argmax
