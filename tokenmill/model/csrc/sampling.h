// Sampling a token from logits, shared by the fused decode step's bursts
// (decode_step.cpp) and the engine's sampler (sample_rows, sampling.cpp), so that a sampled request gets the same token
// whichever path a step takes.
//
// Random numbers: one uniform per (request seed, output position), from splitmix64 as
// tokenmill/engine/runner.py's position_seed computes it, so a seeded request's tokens
// depend on neither the batch nor how many steps a call runs.
// Draw: inverse CDF over softmax(logits / temperature) in vocabulary order. Weights are
// exp((l - max) / T) in float32, summed per block of 16 and the blocks in float64; the
// token is the first whose running sum passes u * total. Masked tokens come as a very
// negative finite logit (the build assumes finite math) and weigh 0.
// Truncation (top-k, then top-p, then min-p) zeroes weights before the draw, so a
// truncated request samples in the bursts as well: top-k keeps every token whose logit
// is at least the k-th largest (ties keep more than k); top-p walks the kept weights from
// the largest down and keeps a token while the mass ahead of it is below top_p times
// their total (the largest always stays), and every token weighing as much as the last
// one kept; min-p keeps weights at least min_p times the largest (which is 1). Sums are
// in float64 in vocabulary order, so a row truncates the same in every call.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
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

// e [V] = exp((row - max(row)) / temp) in float32. One body (not inlined), so every
// caller gets the same roundings of exp.
__attribute__((noinline)) inline void weights(const float* row, int64_t V, float temp, float* e) {
  float m = row[0];
  for (int64_t i = 1; i < V; ++i) m = row[i] > m ? row[i] : m;
  const float inv = 1.f / temp;
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) {
    const float x = (row[i] - m) * inv;
    e[i] = x > -87.f ? std::exp(x) : 0.f;  // below e^-87 float32 has nothing
  }
}

struct Truncation {
  int64_t top_k = 0;  // <= 0: off
  float top_p = 1.f;  // >= 1: off
  float min_p = 0.f;  // <= 0: off
  bool active(int64_t V) const { return (top_k > 0 && top_k < V) || top_p < 1.f || min_p > 0.f; }
};

// The smallest weight top-p keeps among e[0..V) (zeros are out already): the smallest
// weight v with mass(e > v) < top_p * total, which is the walk from the largest weight
// down. Found by a radix select on the float bits (positive floats order as their bits):
// three passes of mass histograms over bits 30-20, 19-9 and 8-0, each narrowing to the
// bin the edge is in, so a flat row (a nucleus of thousands) costs three scans, no sort.
// tmp: scratch.
inline float top_p_edge(const float* e, int64_t V, float top_p, std::vector<float>& tmp) {
  double total = 0.0;
  float top = 0.f;
  for (int64_t i = 0; i < V; ++i) {
    total += e[i];
    top = e[i] > top ? e[i] : top;
  }
  const double target = static_cast<double>(top_p) * total;
  if (!(target > 0.0)) return top;  // top_p 0 keeps the largest
  // Only weights of at least (1 - top_p) * total / V can be in the nucleus: the ones
  // above that hold at least the target, so the edge is not below it. Halved for
  // rounding; a peaked row keeps a few candidates, a flat one many.
  const float floor = static_cast<float>(0.5 * (total - target) / static_cast<double>(V));
  tmp.clear();
  for (int64_t i = 0; i < V; ++i)
    if (e[i] > 0.f && e[i] >= floor) tmp.push_back(e[i]);
  constexpr int kShift[3] = {20, 9, 0}, kBits[3] = {11, 11, 9};
  double mass[2048];
  double above = 0.0;  // the mass of the candidates above the bin being narrowed
  uint32_t prefix = 0, fixed = 0;  // the edge's bits found so far, and which bits they are
  for (int pass = 0; pass < 3; ++pass) {
    const int nbins = 1 << kBits[pass], sh = kShift[pass];
    std::fill(mass, mass + nbins, 0.0);
    for (const float x : tmp) {
      uint32_t b;
      std::memcpy(&b, &x, 4);
      if ((b & fixed) == prefix) mass[(b >> sh) & (nbins - 1)] += x;
    }
    // the first bin from the top whose mass brings the walk to the target; if rounding
    // never gets there, the lowest bin with any mass
    int bin = -1, lowest = 0;
    for (int j = nbins - 1; j >= 0; --j) {
      if (mass[j] == 0.0) continue;
      lowest = j;
      if (above + mass[j] >= target) {
        bin = j;
        break;
      }
      above += mass[j];
    }
    if (bin < 0) {
      bin = lowest;
      above -= mass[lowest];
    }
    prefix |= static_cast<uint32_t>(bin) << sh;
    fixed |= static_cast<uint32_t>(nbins - 1) << sh;
  }
  float edge;
  std::memcpy(&edge, &prefix, 4);
  return edge;
}

// Zeroes the weights e [V] of the tokens truncation drops; row: the logits.
inline void truncate(const float* row, float* e, int64_t V, const Truncation& t, std::vector<float>& tmp) {
  if (t.top_k > 0 && t.top_k < V) {
    // the k-th largest logit: a min-heap of the k largest so far, one comparison for most
    // tokens (a selection over a copy of the row cost several times more at 49,152)
    tmp.assign(row, row + t.top_k);
    std::make_heap(tmp.begin(), tmp.end(), std::greater<float>());
    for (int64_t i = t.top_k; i < V; ++i)
      if (row[i] > tmp.front()) {
        std::pop_heap(tmp.begin(), tmp.end(), std::greater<float>());
        tmp.back() = row[i];
        std::push_heap(tmp.begin(), tmp.end(), std::greater<float>());
      }
    const float kth = tmp.front();
    for (int64_t i = 0; i < V; ++i)
      if (row[i] < kth) e[i] = 0.f;
  }
  if (t.top_p < 1.f) {
    const float edge = top_p_edge(e, V, t.top_p, tmp);
    for (int64_t i = 0; i < V; ++i)
      if (e[i] < edge) e[i] = 0.f;
  }
  if (t.min_p > 0.f)
    for (int64_t i = 0; i < V; ++i)
      if (e[i] < t.min_p) e[i] = 0.f;
}

// row [V] float32 -> a token id; temp > 0. buf, tmp: scratch.
inline int64_t sample_row(const float* row, int64_t V, float temp, double u, std::vector<float>& buf,
                          const Truncation& trunc, std::vector<float>& tmp) {
  const int64_t nb = (V + 15) / 16;
  buf.assign(nb * 16 + nb, 0.f);
  float* e = buf.data();
  float* bsum = e + nb * 16;
  weights(row, V, temp, e);
  if (trunc.active(V)) truncate(row, e, V, trunc, tmp);
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

// ---- over tensors: the entry points of sampling.cpp and decode_step.cpp's bursts ----

// Each row's truncation from top_ks int64 [M] and top_ps, min_ps float32 [M].
inline std::vector<Truncation> truncations(const torch::Tensor& top_ks, const torch::Tensor& top_ps,
                                           const torch::Tensor& min_ps, int64_t M) {
  TORCH_CHECK(top_ks.scalar_type() == at::kLong && top_ks.numel() == M, "top_ks: int64 [M]");
  TORCH_CHECK(top_ps.scalar_type() == at::kFloat && top_ps.numel() == M && min_ps.scalar_type() == at::kFloat &&
                  min_ps.numel() == M, "top_ps, min_ps: float32 [M]");
  auto k = top_ks.contiguous();
  auto p = top_ps.contiguous();
  auto mp = min_ps.contiguous();
  std::vector<Truncation> out(M);
  for (int64_t b = 0; b < M; ++b)
    out[b] = {k.data_ptr<int64_t>()[b], p.data_ptr<float>()[b], mp.data_ptr<float>()[b]};
  return out;
}

// out[b] for the rows b of logits [M, V] with temps[b] > 0: the token drawn at temps[b]
// with the uniform of (seeds[b], indices[b] + step) after trunc[b]. Rows in parallel
// (each is its own: the same tokens on any number of threads). Not inlined, so the
// sampler's calls and the bursts' run one body (one linked copy, the same roundings).
__attribute__((noinline)) inline void draw_rows(const float* logits, int64_t M, int64_t V, const float* temps,
                                                const int64_t* seeds, const int64_t* indices, int64_t step,
                                                const std::vector<Truncation>& trunc, int64_t* out) {
  at::internal::lazy_init_num_threads();
#pragma omp parallel if (M > 1)
  {
    std::vector<float> buf, tmp;
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < M; ++b)
      if (temps[b] > 0.f)
        out[b] = sample_row(logits + b * V, V, temps[b],
                            uniform(static_cast<uint64_t>(seeds[b]), static_cast<uint64_t>(indices[b] + step)),
                            buf, trunc[b], tmp);
  }
}

}  // namespace tm_sample
