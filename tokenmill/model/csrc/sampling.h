// Sampling a token from logits, shared by the fused decode step's bursts and the
// engine's sampler (through sample_rows), so that a sampled request gets the same token
// whichever path a step takes.
//
// Random numbers: one uniform per (request seed, output position), from splitmix64 as
// tokenmill/engine/runner.py's position_seed computes it, so a seeded request's tokens
// depend on neither the batch nor how many steps a call runs.
// Draw: inverse CDF over softmax(logits / temperature) in vocabulary order. Weights are
// exp((l - max) / T) in float32, summed per block of 16 and the blocks in float64; the
// token is the first whose running sum passes u * total. Masked tokens come as a very
// negative finite logit (the build assumes finite math) and weigh 0.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

namespace tm_sample {

inline uint64_t position_seed(uint64_t seed, uint64_t index) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + (index + 1) * 0xD1B54A32D192ED03ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// in [0, 1): the top 53 bits
inline double uniform(uint64_t seed, uint64_t index) {
  return static_cast<double>(position_seed(seed, index) >> 11) * (1.0 / 9007199254740992.0);
}

// row [V] float32 -> a token id; temp > 0. buf: scratch.
inline int64_t sample_row(const float* row, int64_t V, float temp, double u, std::vector<float>& buf) {
  float m = row[0];
  for (int64_t i = 1; i < V; ++i) m = row[i] > m ? row[i] : m;
  const int64_t nb = (V + 15) / 16;
  buf.assign(nb * 16 + nb, 0.f);
  float* e = buf.data();
  float* bsum = e + nb * 16;
  const float inv = 1.f / temp;
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) {
    const float x = (row[i] - m) * inv;
    e[i] = x > -87.f ? std::exp(x) : 0.f;  // below e^-87 float32 has nothing
  }
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    float s = 0.f;
    for (int j = 0; j < 16; ++j) s += e[b * 16 + j];
    bsum[b] = s;
    total += s;
  }
  const double thr = u * total;
  double cum = 0.0;
  int64_t last = 0;
  for (int64_t b = 0; b < nb; ++b) {
    if (bsum[b] == 0.f) continue;
    if (cum + bsum[b] > thr) {
      for (int64_t i = b * 16; i < b * 16 + 16; ++i) {
        if (e[i] == 0.f) continue;
        cum += e[i];
        last = i;
        if (cum > thr) return i;
      }
    } else {
      cum += bsum[b];
      for (int64_t i = b * 16 + 15; i >= b * 16; --i)
        if (e[i] != 0.f) { last = i; break; }
    }
  }
  return last;  // rounding left the running sum short of thr: the last token with weight
}

}  // namespace tm_sample
