// Small fused ops of the Llama block, for the few-row batches of decode, where each
// separate torch op costs more in dispatch (and OpenMP fork/join) than in arithmetic.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

namespace {

// Rows per parallel task: a decode batch of a few rows runs on the calling thread.
constexpr int64_t kRowGrain = 16;

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

}  // namespace

// residual += delta (in place); returns rms_norm(residual) * weight.
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(residual.is_contiguous() && delta.is_contiguous() && weight.is_contiguous());
  const int64_t rows = residual.size(0), n = residual.size(1);
  auto out = torch::empty_like(residual);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, residual.scalar_type(), "add_rms_norm", [&] {
    scalar_t* h = residual.data_ptr<scalar_t>();
    const scalar_t* dl = delta.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* y = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* hr = h + r * n;
        const scalar_t* dr = dl + r * n;
        for (int64_t e = 0; e < n; ++e) hr[e] = static_cast<scalar_t>(static_cast<float>(hr[e]) + static_cast<float>(dr[e]));
        rms_row<scalar_t>(hr, w, y + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous());
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* y = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_row<scalar_t>(xp + r * n, w, y + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

// Rotary embedding (rotate-half layout) applied in place to the first `heads` head
// slots of each row of x [T, row_stride]: q and k heads of a fused qkv projection.
// cos, sin [T, d/2] float32.
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(x.stride(1) == 1 && cos.is_contiguous() && sin.is_contiguous());
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32);
  const int64_t T = x.size(0), stride = x.stride(0), half = head_dim / 2;
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "rope_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    at::parallel_for(0, T, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cp + t * half;
        const float* s = sp + t * half;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* v = xp + t * stride + h * head_dim;
          for (int64_t e = 0; e < half; ++e) {
            const float a = static_cast<float>(v[e]), b = static_cast<float>(v[e + half]);
            v[e] = static_cast<scalar_t>(a * c[e] - b * s[e]);
            v[e + half] = static_cast<scalar_t>(b * c[e] + a * s[e]);
          }
        }
      }
    });
  });
}
