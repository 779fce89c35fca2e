// The Python module of tokenmill's native kernels (built by tokenmill/model/kernels.py).
#include <torch/extension.h>

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens,
                              torch::Tensor query_start, int64_t block_size, double scale);
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight, double eps);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim);
torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor scales);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "attention over the paged KV cache for short queries");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta; return rms_norm(residual) * weight");
  m.def("rms_norm", &rms_norm, "rms_norm(x) * weight");
  m.def("rope_", &rope_, "rotary embedding in place on the q and k heads of a fused projection");
  m.def("int8_gemv", &int8_gemv, "x [M, K] @ (int8 w [N, K] * scales[:, None]).T in float32, for a few rows");
}
