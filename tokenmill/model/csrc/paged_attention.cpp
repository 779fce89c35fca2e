// Attention for short queries (decode, small prefill chunks) read straight from the
// paged KV cache through block tables: no gathered or padded copy of K/V.
//
// Cache layout per layer: k, v [kv_heads, num_blocks * block_size, head_dim], so a
// block of one head is block_size * head_dim contiguous elements. Work is split over
// (sequence, kv head); the query heads of a GQA group share each key as it is read.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <typename scalar_t>
void attend_one(const scalar_t* __restrict q,      // [n_q, H, d] rows of this sequence
                const scalar_t* __restrict k_head,  // this kv head's slots
                const scalar_t* __restrict v_head,
                const int64_t* __restrict table, int64_t block_size, int64_t n_q, int64_t seq_len,
                int64_t kvh, int64_t H, int64_t d, int64_t g, float scale,
                scalar_t* __restrict out) {  // [n_q, H, d]
  std::vector<float> qf(g * d), scores(seq_len), acc(d);
  for (int64_t i = 0; i < n_q; ++i) {
    const int64_t visible = seq_len - n_q + i + 1;  // causal: keys 0 .. position of query i
    for (int64_t j = 0; j < g; ++j) {
      const scalar_t* qrow = q + (i * H + kvh * g + j) * d;
      for (int64_t e = 0; e < d; ++e) qf[j * d + e] = to_f(qrow[e]) * scale;
    }
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = qf.data() + j * d;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < visible; ++t) {
        const scalar_t* kr = k_head + (table[t / block_size] * block_size + t % block_size) * d;
        float s = 0.f;
        for (int64_t e = 0; e < d; ++e) s += qj[e] * to_f(kr[e]);
        scores[t] = s;
        mx = s > mx ? s : mx;
      }
      float sum = 0.f;
      for (int64_t t = 0; t < visible; ++t) {
        scores[t] = std::exp(scores[t] - mx);
        sum += scores[t];
      }
      const float inv = 1.f / sum;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < visible; ++t) {
        const scalar_t* vr = v_head + (table[t / block_size] * block_size + t % block_size) * d;
        const float p = scores[t] * inv;
        for (int64_t e = 0; e < d; ++e) acc[e] += p * to_f(vr[e]);
      }
      scalar_t* orow = out + (i * H + kvh * g + j) * d;
      for (int64_t e = 0; e < d; ++e) orow[e] = static_cast<scalar_t>(acc[e]);
    }
  }
}

}  // namespace

// q [T, H, d]; k_cache, v_cache [Hkv, S, d]; block_tables [B, max_blocks] int64;
// seq_lens [B] (tokens in context including this step's); query_start [B + 1].
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens,
                              torch::Tensor query_start, int64_t block_size, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64);
  const int64_t H = q.size(1), d = q.size(2), Hkv = k_cache.size(0), S = k_cache.size(1);
  const int64_t B = seq_lens.size(0), g = H / Hkv, max_blocks = block_tables.size(1);
  auto out = torch::empty_like(q);
  auto bt = block_tables.contiguous();
  const int64_t* tables = bt.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* qs = query_start.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "paged_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) {
        const int64_t b = w / Hkv, h = w % Hkv;
        const int64_t n_q = qs[b + 1] - qs[b];
        attend_one<scalar_t>(qp + qs[b] * H * d, kp + h * S * d, vp + h * S * d, tables + b * max_blocks,
                             block_size, n_q, lens[b], h, H, d, g, static_cast<float>(scale),
                             op + qs[b] * H * d);
      }
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "attention over the paged KV cache for short queries");
}
