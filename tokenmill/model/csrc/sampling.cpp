// The native sampler's entry points: the engine's sampler draws every sampled row
// through sample_rows (tokenmill/engine/sampler.py), with the same code (sampling.h)
// the fused decode step's bursts draw with.
#include <torch/extension.h>
#include <vector>

#include "sampling.h"

// logits [B, V] float32 -> int64 [B]: row b sampled at temps[b] (> 0) with the uniform of
// (seeds[b], indices[b]) after truncation by top_ks[b] (int64), top_ps[b] and min_ps[b]
// (float32), as decode_steps samples (sampling.h). The engine's sampler draws every
// sampled row through this.
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temps, torch::Tensor seeds, torch::Tensor indices,
                          torch::Tensor top_ks, torch::Tensor top_ps, torch::Tensor min_ps) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) > 0, "logits: float32 [B, V]");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temps.scalar_type() == at::kFloat && temps.numel() == B, "temps: float32 [B]");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.numel() == B && indices.scalar_type() == at::kLong &&
                  indices.numel() == B, "seeds, indices: int64 [B]");
  const auto trunc = tm_sample::truncations(top_ks, top_ps, min_ps, B);
  auto lc = logits.contiguous();
  auto tc = temps.contiguous();
  auto sc = seeds.contiguous();
  auto ic = indices.contiguous();
  auto out = torch::empty({B}, sc.options());
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(tc.data_ptr<float>()[b] > 0.f, "sample_rows: temperatures must be positive");
  tm_sample::draw_rows(lc.data_ptr<float>(), B, V, tc.data_ptr<float>(), sc.data_ptr<int64_t>(),
                       ic.data_ptr<int64_t>(), 0, trunc, out.data_ptr<int64_t>());
  return out;
}

// Which tokens of one row [V] float32 the draw's truncation keeps at temperature temp
// (sampling.h), for tests: bool [V].
torch::Tensor truncation_kept(torch::Tensor row, double temp, int64_t top_k, double top_p, double min_p) {
  TORCH_CHECK(row.scalar_type() == at::kFloat && row.dim() == 1 && row.numel() > 0, "row: float32 [V]");
  TORCH_CHECK(temp > 0.0, "temp must be positive");
  auto r = row.contiguous();
  const int64_t V = r.numel();
  const float* x = r.data_ptr<float>();
  std::vector<float> e(V), tmp;
  tm_sample::weights(x, V, static_cast<float>(temp), e.data());
  tm_sample::truncate(x, e.data(), V, {top_k, static_cast<float>(top_p), static_cast<float>(min_p)}, tmp);
  auto out = torch::empty({V}, r.options().dtype(at::kBool));
  for (int64_t i = 0; i < V; ++i) out.data_ptr<bool>()[i] = e[i] > 0.f;
  return out;
}

void bind_sampling(pybind11::module& m) {
  m.def("sample_rows", &sample_rows, "sample each row at its temperature with the uniform of (seed, index)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("truncation_kept", &truncation_kept, "which tokens of one row the draw's top-k/top-p/min-p keep");
}
