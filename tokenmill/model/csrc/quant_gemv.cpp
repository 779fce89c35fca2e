// Quantized matmuls for the few-row batches of decode, with the activations quantized to
// int8 on the fly so the inner loop is integer dot products (AVX-512 VNNI vpdpbusd), the
// approach of llama.cpp's Q4_1 x Q8_1 dot. Decode reads every weight once per step; with
// float unpacking the two cores cannot keep up with memory, with VNNI they can.
//
// Weight layout ("tiles"): output rows in tiles of 16; within a tile, groups of 32
// inputs; within a group, 4 chunks of 64 bytes, chunk c holding for each of the 16 rows
// (4 bytes each) its weights at inputs 4c..4c+3 and (int4: high nibbles) 16+4c..16+4c+3.
// One 64-byte load then feeds one vpdpbusd whose 16 int32 lanes are the 16 rows, with
// the activation's 4 bytes broadcast, so a tile's results need no horizontal sums.
//   int4: w = q * d + m, q in 0..15 (u8 nibble), d and m float16 per (row, group), stored
//         after each group's 256 bytes as 16 d then 16 m (320 bytes a group).
//   int8: w = (u - 128) * s, u = q + 128 in 1..255, one float32 scale s per row, the
//         tile's 16 scales (64 bytes) ahead of its groups (512 bytes each).
//   int8 blocks: w = (u - 128) * d, d float16 per (row, group) after each group's 512
//         bytes of codes (544 bytes a group): GGUF's Q8_0.
//   Q5_0 blocks: w = (q - 16) * d, q in 0..31: its low 4 bits as int4's nibbles (256
//         bytes), its fifth bit in 4 x 16 bytes of bit planes (chunk c: 8 bytes for the
//         low nibbles' codes, 8 for the high ones', bit i for byte i of the chunk), then
//         the 16 rows' float16 d (352 bytes a group): GGUF's Q5_0, 5.5 bits a weight.
// Scales ride inside the weight stream so that each thread reads one sequential stream
// (the hardware prefetcher follows one stream better than two).
// Activations: per row of x and 16 inputs, xq = round(x / dx) in -127..127 with
// dx = max|x| / 127. int4 adds m * sum(x) per group with the exact float sum of x.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <type_traits>

#include "quant_tiles.h"

namespace {

using namespace tm_quant;

#if TM_QUANT_TILES
// x [M, K] against all tiles of w (tile_bytes each); returns [M, N] in out_dtype.
template <int Kind, typename In, typename Out>
void run_tiles(const In* x, const uint8_t* w, int64_t tile_bytes, int64_t M, int64_t K, int64_t N, Out* y) {
  const QuantX& xq = quantize_rows(x, M, K, Kind);
  at::parallel_for(0, N / kTile, 8, [&](int64_t t0, int64_t t1) {
    tiles_range<Kind>(w, tile_bytes, xq, M, K, N, t0, t1, y);
  });
}

template <int Kind>
torch::Tensor gemv(const torch::Tensor& x_, const torch::Tensor& w, int64_t N, int64_t tile_bytes, bool float_out) {
  auto x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto out = torch::empty({M, N}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  auto go = [&](auto* xp) {
    if (float_out) return run_tiles<Kind>(xp, wp, tile_bytes, M, K, N, out.data_ptr<float>());
    using In = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    run_tiles<Kind>(xp, wp, tile_bytes, M, K, N, out.data_ptr<In>());
  };
  if (x.scalar_type() == at::kBFloat16) go(x.data_ptr<c10::BFloat16>());
  else if (x.scalar_type() == at::kFloat) go(x.data_ptr<float>());
  else TORCH_CHECK(false, "quantized matmul: float32 or bfloat16 activations, got ", x.scalar_type());
  return out;
}
#else
template <int Kind>
torch::Tensor gemv(const torch::Tensor&, const torch::Tensor&, int64_t, int64_t, bool) {
  TORCH_CHECK(false, "the int8-activation kernels need AVX-512 VNNI or AVX2 (check quant_gemv_vnni())");
}
#endif

}  // namespace

bool quant_gemv_vnni() { return kVnni; }

// x [M, K] (float32 or bfloat16) @ int4 tiles -> [M, N]; w uint8 [N/16, K/32 * 320].
// precise: activations in two int8 levels (~16 bits), for inputs with outlier channels.
torch::Tensor q4_gemv(torch::Tensor x, torch::Tensor w, bool float_out, bool precise) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 2, "w: uint8 tiles [N/16, K/32 * 320]");
  const int64_t K = x.size(1), N = w.size(0) * kTile;
  TORCH_CHECK(x.dim() == 2 && K % kGroup == 0 && w.size(1) == K / kGroup * 320, "shape mismatch");
  return precise ? gemv<2>(x, w, N, w.size(1), float_out) : gemv<1>(x, w, N, w.size(1), float_out);
}

// x [M, K] @ int8 block tiles (Q8_0 grid) -> [M, N]; w uint8 [N/16, K/32 * 544].
torch::Tensor q8b_gemv(torch::Tensor x, torch::Tensor w, bool float_out, bool precise) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 2, "w: uint8 tiles [N/16, K/32 * 544]");
  const int64_t K = x.size(1), N = w.size(0) * kTile;
  TORCH_CHECK(x.dim() == 2 && K % kGroup == 0 && w.size(1) == K / kGroup * 544, "shape mismatch");
  return precise ? gemv<3>(x, w, N, w.size(1), float_out) : gemv<5>(x, w, N, w.size(1), float_out);
}

// x [M, K] @ Q5_0 block tiles -> [M, N]; w uint8 [N/16, K/32 * 352].
torch::Tensor q5_gemv(torch::Tensor x, torch::Tensor w, bool float_out, bool precise) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 2, "w: uint8 tiles [N/16, K/32 * 352]");
  const int64_t K = x.size(1), N = w.size(0) * kTile;
  TORCH_CHECK(x.dim() == 2 && K % kGroup == 0 && w.size(1) == K / kGroup * 352, "shape mismatch");
  return precise ? gemv<4>(x, w, N, w.size(1), float_out) : gemv<6>(x, w, N, w.size(1), float_out);
}

// x [M, K] @ int8 tiles -> [M, N]; w uint8 [N/16, 64 + K/32 * 512].
torch::Tensor q8_gemv(torch::Tensor x, torch::Tensor w, bool float_out) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 2, "w: uint8 tiles [N/16, 64 + K/32 * 512]");
  const int64_t K = x.size(1), N = w.size(0) * kTile;
  TORCH_CHECK(x.dim() == 2 && K % kGroup == 0 && w.size(1) == 64 + K / kGroup * 512, "shape mismatch");
  return gemv<0>(x, w, N, w.size(1), float_out);
}
