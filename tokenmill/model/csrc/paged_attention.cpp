// Attention for short queries (decode, small prefill chunks) read straight from the
// paged KV cache through block tables: no gathered or padded copy of K/V.
//
// Cache layout per layer: k, v [kv_heads, num_blocks * block_size, head_dim], so a
// block of one head is block_size * head_dim contiguous elements. Work is split over
// (sequence, kv head); the query heads of a GQA group share each key as it is read.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

#include "row_attention.h"

namespace {

using tm_rowattn::attend_one;

template <typename scalar_t, typename cache_t, int D>
void run_all(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
             const float* ksp, const float* vsp,
             const int64_t* tables, int64_t max_blocks, const int64_t* lens, const int64_t* qs, int64_t B,
             int64_t block_size, float scale, torch::Tensor& out, int64_t window) {
  const int64_t H = q.size(1), Hkv = k_cache.size(0), S = k_cache.size(1), g = H / Hkv;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kp = k_cache.data_ptr<cache_t>();
  const cache_t* vp = v_cache.data_ptr<cache_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / Hkv, h = w % Hkv;
      attend_one<scalar_t, cache_t, D>(qp + qs[b] * H * D, kp + h * S * D, vp + h * S * D,
                                       ksp ? ksp + h * S : nullptr, vsp ? vsp + h * S : nullptr, tables + b * max_blocks,
                              block_size, qs[b + 1] - qs[b], lens[b], h, H, g, scale, op + qs[b] * H * D, window);
    }
  });
}

}  // namespace

namespace {
// An int8 cache's scales [Hkv, S] float32 (both or neither given): their data, or null.
std::pair<const float*, const float*> cache_scales(const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                                   const c10::optional<torch::Tensor>& k_scale,
                                                   const c10::optional<torch::Tensor>& v_scale) {
  const bool i8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k and v caches of one type");
  TORCH_CHECK(i8 == (k_scale.has_value() && v_scale.has_value()) && k_scale.has_value() == v_scale.has_value(),
              "an int8 cache needs its k and v scales, another cache none");
  if (!i8) return {nullptr, nullptr};
  for (const auto* t : {&*k_scale, &*v_scale})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == k_cache.size(0) && t->size(1) == k_cache.size(1),
                "cache scales: contiguous float32 [kv_heads, slots]");
  return {k_scale->data_ptr<float>(), v_scale->data_ptr<float>()};
}
}  // namespace

// q [T, H, d]; k_cache, v_cache [Hkv, S, d] (q's type, or int8 with k_scale, v_scale
// [Hkv, S]); block_tables [B, max_blocks] int64; seq_lens [B] (tokens in context
// including this step's); query_start [B + 1]; window > 0: each query sees its last
// `window` keys only (a sliding-window layer).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens,
                              torch::Tensor query_start, int64_t block_size, double scale,
                              c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                              int64_t window) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  const auto scales = cache_scales(k_cache, v_cache, k_scale, v_scale);
  const float* ksp = scales.first;
  const float* vsp = scales.second;
  TORCH_CHECK(ksp || k_cache.scalar_type() == q.scalar_type(), "the cache holds q's type or int8");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64);
  const int64_t d = q.size(2), B = seq_lens.size(0), max_blocks = block_tables.size(1);
  auto out = torch::empty_like(q);
  auto bt = block_tables.contiguous();
  const int64_t* tables = bt.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* qs = query_start.data_ptr<int64_t>();
  TORCH_CHECK(d == 64 || d == 128 || d == 96 || d == 80 || d == 256, "unsupported head_dim ", d);  // see kernels.py
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "paged_attention", [&] {
    const float sc = static_cast<float>(scale);
    auto go = [&](auto tag) {
      using C = decltype(tag);
      switch (d) {
        case 64: return run_all<scalar_t, C, 64>(q, k_cache, v_cache, ksp, vsp, tables, max_blocks, lens, qs, B, block_size, sc, out, window);
        case 80: return run_all<scalar_t, C, 80>(q, k_cache, v_cache, ksp, vsp, tables, max_blocks, lens, qs, B, block_size, sc, out, window);
        case 96: return run_all<scalar_t, C, 96>(q, k_cache, v_cache, ksp, vsp, tables, max_blocks, lens, qs, B, block_size, sc, out, window);
        case 256: return run_all<scalar_t, C, 256>(q, k_cache, v_cache, ksp, vsp, tables, max_blocks, lens, qs, B, block_size, sc, out, window);
        default: return run_all<scalar_t, C, 128>(q, k_cache, v_cache, ksp, vsp, tables, max_blocks, lens, qs, B, block_size, sc, out, window);
      }
    };
    if (ksp) go(int8_t{});
    else go(scalar_t{});
  });
  return out;
}

// ---------------------------------------------------------------------------------
#include "decode_attention.h"
#if defined(__AVX512F__)

namespace {

using namespace tm_decode;

template <typename T, typename C, int D>
void decode_all(const torch::Tensor& qkv, torch::Tensor& k_cache, torch::Tensor& v_cache, float* ksp, float* vsp,
                const int64_t* slots, const int64_t* tables, int64_t max_blocks, const int64_t* lens, int64_t B,
                int64_t H, int64_t Hkv, int64_t bs, float scale, torch::Tensor& out, int64_t window) {
  const int64_t S = k_cache.size(1), g = H / Hkv, row = qkv.stride(0);
  const T* qp = qkv.data_ptr<T>();
  C* kp = k_cache.data_ptr<C>();
  C* vp = v_cache.data_ptr<C>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hkv; ++h) {
      const T* src = qp + b * row + (H + h) * D;
      const int64_t at = h * S + slots[b];
      store_row<T, D>(src, kp + at * D, ksp ? ksp + at : nullptr);
      store_row<T, D>(src + Hkv * D, vp + at * D, vsp ? vsp + at : nullptr);
    }
  std::vector<int64_t> first, los;
  if (window > 0)
    for (int64_t b = 0; b < B; ++b) los.push_back(std::max<int64_t>(0, lens[b] - window));
  const int64_t* lo = los.empty() ? nullptr : los.data();
  const int64_t chunk = plan_units(lens, B, Hkv, bs, first, lo);
  std::vector<float> parts(first[B] * g * (D + 2));
  const int64_t nt = at::get_num_threads();
  const std::vector<int64_t> bounds = unit_bounds(first, lens, chunk, Hkv, nt, lo);
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      run_units<T, C, D>(bounds[t], bounds[t + 1], first, chunk, qp, row, kp, vp, ksp, vsp, S, tables, max_blocks,
                         lens, Hkv, g, bs, scale, parts.data(), lo);
  });
  T* op = out.data_ptr<T>();
  for (int64_t b = 0; b < B; ++b) merge_units<T, D>(parts.data(), first, b, Hkv, g, op + b * H * D);
}

}  // namespace

bool decode_attention_available() { return true; }

// qkv [B, (H + 2 Hkv) D] (rows may be strided); k_cache, v_cache [Hkv, S, D] (qkv's
// type, or int8 with k_scale, v_scale [Hkv, S]); slot_mapping [B]; block_tables
// [B, max_blocks]; seq_lens [B] (including this token); window > 0: each query sees its
// last `window` keys only.
torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor seq_lens,
                               int64_t H, int64_t Hkv, int64_t block_size, double scale,
                               c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                               int64_t window) {
  TORCH_CHECK(qkv.stride(1) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous());
  const auto scales = cache_scales(k_cache, v_cache, k_scale, v_scale);
  float* ksp = const_cast<float*>(scales.first);  // written: the new token's scales
  float* vsp = const_cast<float*>(scales.second);
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64 &&
              slot_mapping.scalar_type() == torch::kInt64);
  TORCH_CHECK((ksp || qkv.scalar_type() == k_cache.scalar_type()) && H % Hkv == 0 && H / Hkv <= kMaxGroup);
  const int64_t B = qkv.size(0), d = k_cache.size(2);
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * d && seq_lens.numel() == B && slot_mapping.numel() == B);
  auto bt = block_tables.contiguous();
  auto out = torch::empty({B, H * d}, qkv.options());
  auto slots_c = slot_mapping.contiguous(), lens_c = seq_lens.contiguous();
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  const int64_t* lens = lens_c.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  const int64_t mb = bt.size(1);
  // (a sequence without tokens would have no work units: there is no query to attend)
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= mb * block_size && slots[b] >= 0 && slots[b] < k_cache.size(1),
                "decode_attention: slot or length out of range");
  auto run2 = [&](auto tag, auto ctag) {
    using T = decltype(tag);
    using C = decltype(ctag);
    const int64_t* tables = bt.data_ptr<int64_t>();
    switch (d) {
      case 64: return decode_all<T, C, 64>(qkv, k_cache, v_cache, ksp, vsp, slots, tables, mb, lens, B, H, Hkv, block_size, sc, out, window);
      case 80: return decode_all<T, C, 80>(qkv, k_cache, v_cache, ksp, vsp, slots, tables, mb, lens, B, H, Hkv, block_size, sc, out, window);
      case 96: return decode_all<T, C, 96>(qkv, k_cache, v_cache, ksp, vsp, slots, tables, mb, lens, B, H, Hkv, block_size, sc, out, window);
      case 128: return decode_all<T, C, 128>(qkv, k_cache, v_cache, ksp, vsp, slots, tables, mb, lens, B, H, Hkv, block_size, sc, out, window);
      case 256: return decode_all<T, C, 256>(qkv, k_cache, v_cache, ksp, vsp, slots, tables, mb, lens, B, H, Hkv, block_size, sc, out, window);
      default: TORCH_CHECK(false, "unsupported head_dim ", d);
    }
  };
  auto run = [&](auto tag) {
    if (ksp) run2(tag, int8_t{});
    else run2(tag, tag);
  };
  if (qkv.scalar_type() == at::kFloat) run(float{});
  else if (qkv.scalar_type() == at::kBFloat16) run(c10::BFloat16{});
  else TORCH_CHECK(false, "decode_attention: float32 or bfloat16, got ", qkv.scalar_type());
  return out;
}
#else
bool decode_attention_available() { return false; }
torch::Tensor decode_attention(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                               torch::Tensor, int64_t, int64_t, int64_t, double, c10::optional<torch::Tensor>,
                               c10::optional<torch::Tensor>, int64_t) {
  TORCH_CHECK(false, "decode_attention needs AVX-512");
}
#endif
