// The Python module of tokenmill's native kernels (built by tokenmill/model/kernels.py).
#include <torch/extension.h>

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens,
                              torch::Tensor query_start, int64_t block_size, double scale,
                              c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                              int64_t window);
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight, double eps);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void rms_norm_(torch::Tensor x, torch::Tensor weight, double eps);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim);
torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor scales);
torch::Tensor q4_gemv(torch::Tensor x, torch::Tensor w, bool float_out, bool precise);
torch::Tensor q8_gemv(torch::Tensor x, torch::Tensor w, bool float_out);
torch::Tensor q8b_gemv(torch::Tensor x, torch::Tensor w, bool float_out, bool precise);
torch::Tensor q5_gemv(torch::Tensor x, torch::Tensor w, bool float_out, bool precise);
bool quant_gemv_vnni();
torch::Tensor silu_mul(torch::Tensor gu);
torch::Tensor gelu_tanh_mul(torch::Tensor gu);
void qk_norm_(torch::Tensor qkv, torch::Tensor q_w, torch::Tensor k_w, int64_t H, int64_t Hkv, int64_t D,
              double eps);
bool decode_attention_available();
torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor seq_lens,
                               int64_t H, int64_t Hkv, int64_t block_size, double scale,
                               c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                               int64_t window);

void bind_decode_step(pybind11::module& m);
void bind_sampling(pybind11::module& m);
void bind_lora(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_decode_step(m);
  bind_sampling(m);
  bind_lora(m);
  m.def("paged_attention", &paged_attention, "attention over the paged KV cache for short queries",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("seq_lens"), pybind11::arg("query_start"), pybind11::arg("block_size"), pybind11::arg("scale"),
        pybind11::arg("k_scale") = pybind11::none(), pybind11::arg("v_scale") = pybind11::none(),
        pybind11::arg("window") = 0);
  m.def("add_rms_norm", &add_rms_norm, "residual += delta; return rms_norm(residual) * weight");
  m.def("rms_norm", &rms_norm, "rms_norm(x) * weight");
  m.def("rms_norm_", &rms_norm_, "x = rms_norm(x) * weight in place (its own row function: Gemma's output norms)");
  m.def("rope_", &rope_, "rotary embedding in place on the q and k heads of a fused projection");
  m.def("decode_attention", &decode_attention, "write a decode step's k/v into the cache and attend (one token per sequence)",
        pybind11::arg("qkv"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("slot_mapping"),
        pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("H"), pybind11::arg("Hkv"),
        pybind11::arg("block_size"), pybind11::arg("scale"), pybind11::arg("k_scale") = pybind11::none(),
        pybind11::arg("v_scale") = pybind11::none(), pybind11::arg("window") = 0);
  m.def("decode_attention_available", &decode_attention_available, "whether decode_attention was built (AVX-512)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up from the fused gate-up projection's output");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu_tanh(gate) * up from the fused gate-up projection's output");
  m.def("qk_norm_", &qk_norm_, "rms_norm over each q and k head of a fused qkv projection, in place");
  m.def("q4_gemv", &q4_gemv, "x @ int4 tiled weights with x quantized to int8 per group of 32 (few rows)");
  m.def("q8_gemv", &q8_gemv, "x @ int8 tiled weights with x quantized to int8 per group of 32 (few rows)");
  m.def("q5_gemv", &q5_gemv, "x @ Q5_0 block tiles, x in one or (precise) two int8 levels per group of 16");
  m.def("q8b_gemv", &q8b_gemv, "x @ int8 block tiles (Q8_0 grid), x in one or (precise) two int8 levels per group of 16");
  m.def("quant_gemv_vnni", &quant_gemv_vnni, "whether q4_gemv/q8_gemv were built with AVX-512 VNNI");
  m.def("int8_gemv", &int8_gemv, "x [M, K] @ (int8 w [N, K] * scales[:, None]).T in float32, for a few rows");
}
