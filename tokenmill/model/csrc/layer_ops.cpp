// Small fused ops of the Llama block, for the few-row batches of decode, where each
// separate torch op costs more in dispatch (and OpenMP fork/join) than in arithmetic.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <immintrin.h>

#include "rows.h"

using namespace tm_rows;

namespace {

// Rows per parallel task: a decode batch of a few rows runs on the calling thread.
constexpr int64_t kRowGrain = 16;

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
        add_rms_row<scalar_t>(h + r * n, dl + r * n, w, y + r * n, n, static_cast<float>(eps));
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
        for (int64_t h = 0; h < heads; ++h) rope_head(xp + t * stride + h * head_dim, cp + t * half, sp + t * half, half);
      }
    });
  });
}

// y[m, n] = scale[n] * sum_k w[n, k] * x[m, k] for a few rows of x: the int8 weight-only
// matmul of decode. torch's packed int8 kernel reads the output projection (vocab x
// hidden) well below memory speed; this converts each weight vector once and feeds it
// to up to four rows of x (float copies that stay in L1).
namespace {

#if defined(__AVX512F__)
template <int R>
void gemv_rows_avx512(const float* xp, const int8_t* wp, const float* sp, float* yp, int64_t K, int64_t N,
                      int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = wp + n * K;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m512 w16 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k))));
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(w16, _mm512_loadu_ps(xp + r * K + k), acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      float tail = 0.f;
      for (int64_t t = k; t < K; ++t) tail += static_cast<float>(wr[t]) * xp[r * K + t];
      yp[r * N + n] = (_mm512_reduce_add_ps(acc[r]) + tail) * sp[n];
    }
  }
}
#endif

void gemv_rows_scalar(const float* xp, const int8_t* wp, const float* sp, float* yp, int64_t R, int64_t K,
                      int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = wp + n * K;
    for (int64_t r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += static_cast<float>(wr[k]) * xp[r * K + k];
      yp[r * N + n] = acc * sp[n];
    }
  }
}

}  // namespace

torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor scales) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(), "w: contiguous int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), "scales: float32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && scales.numel() == N);
  auto xf = x.to(at::kFloat).contiguous();
  auto out = torch::empty({M, N}, x.options().dtype(at::kFloat));
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int64_t R = std::min<int64_t>(4, M - m0);
    const float* xp = xf.data_ptr<float>() + m0 * K;
    float* yp = out.data_ptr<float>() + m0 * N;
    at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
#if defined(__AVX512F__)
      switch (R) {
        case 1: return gemv_rows_avx512<1>(xp, wp, sp, yp, K, N, n0, n1);
        case 2: return gemv_rows_avx512<2>(xp, wp, sp, yp, K, N, n0, n1);
        case 3: return gemv_rows_avx512<3>(xp, wp, sp, yp, K, N, n0, n1);
        default: return gemv_rows_avx512<4>(xp, wp, sp, yp, K, N, n0, n1);
      }
#else
      gemv_rows_scalar(xp, wp, sp, yp, R, K, N, n0, n1);
#endif
    });
  }
  return out;
}


// gu [T, 2I] (gate then up) -> silu(gate) * up [T, I]: the MLP's activation in one pass.
torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && gu.size(1) % 2 == 0);
  const int64_t T = gu.size(0), I = gu.size(1) / 2, row = gu.stride(0);
  auto out = torch::empty({T, I}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, gu.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gu.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        silu_mul_row(gp + t * row, op + t * I, I);
      }
    });
  });
  return out;
}

// gu [T, 2I] (gate then up) -> gelu_tanh(gate) * up [T, I]: GeGLU (Gemma).
torch::Tensor gelu_tanh_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && gu.size(1) % 2 == 0);
  const int64_t T = gu.size(0), I = gu.size(1) / 2, row = gu.stride(0);
  auto out = torch::empty({T, I}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, gu.scalar_type(), "gelu_tanh_mul", [&] {
    const scalar_t* gp = gu.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) gelu_mul_row(gp + t * row, op + t * I, I);
    });
  });
  return out;
}

// QK-norm in place: rms_norm over each of the first H (q) heads of every row of
// qkv [T, row_stride] with q_w [D], and over the next Hkv (k) heads with k_w [D].
void qk_norm_(torch::Tensor qkv, torch::Tensor q_w, torch::Tensor k_w, int64_t H, int64_t Hkv, int64_t D,
              double eps) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= (H + Hkv) * D, "qkv [T, >= (H + Hkv) D]");
  TORCH_CHECK(q_w.is_contiguous() && k_w.is_contiguous() && q_w.numel() == D && k_w.numel() == D &&
                  q_w.scalar_type() == qkv.scalar_type() && k_w.scalar_type() == qkv.scalar_type(),
              "q_w, k_w: [D] of qkv's type");
  const int64_t T = qkv.size(0), stride = qkv.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, qkv.scalar_type(), "qk_norm_", [&] {
    scalar_t* xp = qkv.data_ptr<scalar_t>();
    const scalar_t* qw = q_w.data_ptr<scalar_t>();
    const scalar_t* kw = k_w.data_ptr<scalar_t>();
    at::parallel_for(0, T, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < H + Hkv; ++h)
          rms_row_(xp + t * stride + h * D, h < H ? qw : kw, D, static_cast<float>(eps));
    });
  });
}

// Each row of x [T, n] = rms_norm(row) * weight, in place: Gemma's norms on a block's
// outputs (the fused step runs the same row function on its copy).
void rms_norm_(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(), "x: contiguous [T, n], weight [n] of its type");
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "rms_norm_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_row_(xp + r * n, w, n, static_cast<float>(eps));
    });
  });
}
