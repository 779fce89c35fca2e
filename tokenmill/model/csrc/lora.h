// LoRA adapters' low-rank updates, row by row (tokenmill/model/lora.py).
//
// A matmul's update under one adapter: y[c] += sum_j B[c, j] * (A x)[seg[c] + j], where A
// stacks the A matrices of the parts of a fused projection that the adapter targets (q,
// k, v of qkv; gate, up of gate_up), B holds each output column's row of its part's B
// (times the adapter's scale) and seg[c] says where that part's block of A x starts (-1:
// the column is not targeted). Each row is computed alone, in a fixed order, by functions
// defined once (lora.cpp): the separate op and the fused decode step call the same code,
// so an adapter's rows come out the same whatever they are batched with and whichever
// path runs them.
#pragma once
#include <torch/extension.h>

#include <vector>

namespace tm_lora {

// One part of a fused matmul's outputs: columns [c0, c1) take A x's block from r0.
struct Part {
  int64_t c0, c1, r0;
};

struct Update {
  // float32 [k, R] and [r, n]: A and B transposed, so that both products are axpys over
  // contiguous rows (vectorized, each sum in one fixed order)
  torch::Tensor AT, BT;  // float32, or bfloat16 in a bfloat16 model's table (half the bytes a step reads)
  std::vector<Part> parts;  // the targeted column runs, in order
  int64_t R = 0, r = 0, k = 0, n = 0;
  bool defined() const { return R > 0; }
};

// Every adapter slot's updates for each of a model's matmuls (4 a layer: qkv, o,
// gate_up, down), filled from Python as adapters load and unload.
class LoraTable {
 public:
  // bf16: keep A and B in bfloat16 (a bfloat16 model's; the sums stay float32)
  LoraTable(int64_t slots, int64_t mats, bool bf16 = false);
  void set(int64_t slot, std::vector<torch::Tensor> As, std::vector<torch::Tensor> Bs,
           std::vector<torch::Tensor> segs);
  void clear(int64_t slot);
  int64_t slots() const { return static_cast<int64_t>(updates_.size()); }
  int64_t mats() const { return mats_; }
  // slot's update of matmul m, or nullptr where the adapter does not target it
  const Update* get(int64_t slot, int64_t m) const {
    if (slot < 0 || slot >= slots()) return nullptr;
    const Update& u = updates_[slot][m];
    return u.defined() ? &u : nullptr;
  }
  // the scratch a row needs, in floats: x as floats, 4 partial sums of A x and a row of
  // updates (for the largest k, R and n), each piece 64-byte aligned
  int64_t scratch() const { return 4 * max_R_ + max_k_ + max_n_ + 96; }

 private:
  std::vector<std::vector<Update>> updates_;
  int64_t mats_, max_R_ = 0, max_k_ = 0, max_n_ = 0;
  bool bf16_;
};

// Columns [c0, c1) of one output row y [n] += B (A x) for one input row x [k], rounded
// once to y's type; `scratch`: LoraTable::scratch() floats. Every column's sums run in
// one fixed order whatever [c0, c1) and the buffers' addresses, so threads that split
// the columns, and the separate op that does not, give the same numbers.
void update_row(const Update& u, const float* x, int64_t c0, int64_t c1, float* y, float* scratch);
void update_row(const Update& u, const c10::BFloat16* x, int64_t c0, int64_t c1, c10::BFloat16* y,
                float* scratch);

}  // namespace tm_lora
