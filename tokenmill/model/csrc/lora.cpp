// LoRA's row functions and the separate op (see lora.h).
#include "lora.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <memory>

namespace tm_lora {

LoraTable::LoraTable(int64_t slots, int64_t mats, bool bf16)
    : updates_(slots, std::vector<Update>(mats)), mats_(mats), bf16_(bf16) {
  TORCH_CHECK(slots >= 1 && mats >= 1, "a table of at least one slot and one matmul");
}

void LoraTable::set(int64_t slot, std::vector<torch::Tensor> As, std::vector<torch::Tensor> Bs,
                    std::vector<torch::Tensor> segs) {
  TORCH_CHECK(slot >= 0 && slot < slots(), "slot out of range");
  TORCH_CHECK(static_cast<int64_t>(As.size()) == mats_ && Bs.size() == As.size() && segs.size() == As.size(),
              "an A, a B and a seg (or empty tensors) for each matmul");
  std::vector<Update> row(mats_);
  for (int64_t m = 0; m < mats_; ++m) {
    if (As[m].numel() == 0) continue;
    const auto &A = As[m], &B = Bs[m], &seg = segs[m];
    TORCH_CHECK(A.scalar_type() == at::kFloat && B.scalar_type() == at::kFloat && seg.scalar_type() == at::kInt,
                "A and B float32, seg int32");
    TORCH_CHECK(A.dim() == 2 && B.dim() == 2 && seg.dim() == 1 && seg.size(0) == B.size(0), "A [R, k], B [n, r], seg [n]");
    Update u;
    const auto dt = bf16_ ? at::kBFloat16 : at::kFloat;
    u.AT = A.t().contiguous().to(dt);
    u.BT = B.t().contiguous().to(dt);
    u.R = A.size(0), u.k = A.size(1), u.r = B.size(1), u.n = B.size(0);
    auto sc = seg.contiguous();
    const int32_t* s = sc.data_ptr<int32_t>();
    for (int64_t c = 0; c < u.n;) {  // runs of columns that share a block of A x
      int64_t e = c;
      while (e < u.n && s[e] == s[c]) ++e;
      TORCH_CHECK(s[c] < 0 || s[c] + u.r <= u.R, "seg out of range");
      if (s[c] >= 0) u.parts.push_back({c, e, s[c]});
      c = e;
    }
    max_R_ = std::max(max_R_, u.R);
    max_k_ = std::max(max_k_, u.k);
    max_n_ = std::max(max_n_, u.n);
    row[m] = std::move(u);
  }
  updates_[slot] = std::move(row);
}

void LoraTable::clear(int64_t slot) {
  TORCH_CHECK(slot >= 0 && slot < slots(), "slot out of range");
  updates_[slot] = std::vector<Update>(mats_);
}

template <typename T, typename W>
static void update_w(const Update& u, const T* x, int64_t c0, int64_t c1, T* y, float* scratch) {
  // (64-byte aligned pieces of the scratch: the loops below never depend on where it lies)
  float* xf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t(63));
  const int64_t R16 = (u.R + 15) & ~int64_t(15);
  float* part = xf + ((u.k + 15) & ~int64_t(15));  // 4 partial sums of A x, R16 apart
  float* acc = part + 4 * R16;
  for (int64_t e = 0; e < u.k; ++e) xf[e] = static_cast<float>(x[e]);
  const W* AT = u.AT.data_ptr<W>();
  std::fill(part, part + 4 * R16, 0.f);
  // A x as k axpys, in 4 interleaved chains (input e into chain e mod 4: they run in
  // parallel, where one chain would wait on each FMA), summed in one fixed order
  for (int64_t e = 0; e < u.k; ++e) {
    const float v = xf[e];
    const W* at = AT + e * u.R;
    float* p = part + (e & 3) * R16;
    for (int64_t i = 0; i < u.R; ++i) p[i] = std::fma(v, static_cast<float>(at[i]), p[i]);
  }
  float* xa = part;
  for (int64_t i = 0; i < R16; ++i)  // (whole vectors: every element takes the same code)
    xa[i] = (part[i] + part[R16 + i]) + (part[2 * R16 + i] + part[3 * R16 + i]);
  const W* BT = u.BT.data_ptr<W>();
  for (const Part& p : u.parts) {
    const int64_t a = std::max(c0, p.c0), b = std::min(c1, p.c1);
    if (a >= b) continue;
    std::fill(acc + a, acc + b, 0.f);
    for (int64_t j = 0; j < u.r; ++j) {  // an axpy a rank: each column's sum in j order
      const float v = xa[p.r0 + j];
      const W* bt = BT + j * u.n;
      for (int64_t c = a; c < b; ++c) acc[c] = std::fma(v, static_cast<float>(bt[c]), acc[c]);
    }
    for (int64_t c = a; c < b; ++c) y[c] = static_cast<T>(static_cast<float>(y[c]) + acc[c]);
  }
}

template <typename T>
static void update(const Update& u, const T* x, int64_t c0, int64_t c1, T* y, float* scratch) {
  if (u.AT.scalar_type() == at::kBFloat16)
    update_w<T, c10::BFloat16>(u, x, c0, c1, y, scratch);
  else
    update_w<T, float>(u, x, c0, c1, y, scratch);
}

void update_row(const Update& u, const float* x, int64_t c0, int64_t c1, float* y, float* scratch) {
  update(u, x, c0, c1, y, scratch);
}
void update_row(const Update& u, const c10::BFloat16* x, int64_t c0, int64_t c1, c10::BFloat16* y, float* scratch) {
  update(u, x, c0, c1, y, scratch);
}

template <typename T>
static void apply(const LoraTable& t, int64_t m, const torch::Tensor& x, torch::Tensor& y, const int64_t* slots) {
  const int64_t M = x.size(0), k = x.size(1), n = y.size(1);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  for (int64_t b = 0; b < M; ++b) {
    const Update* u = t.get(slots[b], m);
    TORCH_CHECK(u == nullptr || (u->k == k && u->n == n), "adapter shape does not match the matmul");
  }
  at::parallel_for(0, M, 1, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < t.scratch()) scratch.resize(t.scratch());
    for (int64_t b = b0; b < b1; ++b) {
      const Update* u = t.get(slots[b], m);
      if (u != nullptr) update_row(*u, xp + b * k, 0, n, yp + b * n, scratch.data());
    }
  });
}

}  // namespace tm_lora

// y [M, n] += each row's adapter's update of matmul m from x [M, k], in place; slots [M]
// int64 (-1, or a slot without an update of m: the row is left alone)
void lora_apply_(const tm_lora::LoraTable& table, int64_t m, torch::Tensor x, torch::Tensor y, torch::Tensor slots) {
  TORCH_CHECK(m >= 0 && m < table.mats(), "matmul index out of range");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.scalar_type() == y.scalar_type(),
              "x [M, k] and y [M, n] of one dtype");
  TORCH_CHECK(y.is_contiguous(), "y contiguous (updated in place)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == x.size(0), "int64 slots [M]");
  auto xc = x.contiguous();
  auto sc = slots.contiguous();
  if (x.scalar_type() == at::kFloat)
    tm_lora::apply<float>(table, m, xc, y, sc.data_ptr<int64_t>());
  else if (x.scalar_type() == at::kBFloat16)
    tm_lora::apply<c10::BFloat16>(table, m, xc, y, sc.data_ptr<int64_t>());
  else
    TORCH_CHECK(false, "float32 or bfloat16");
}

void bind_lora(pybind11::module& m) {
  pybind11::class_<tm_lora::LoraTable, std::shared_ptr<tm_lora::LoraTable>>(m, "LoraTable")
      .def(pybind11::init<int64_t, int64_t, bool>(), pybind11::arg("slots"), pybind11::arg("mats"),
           pybind11::arg("bf16") = false)
      .def("set", &tm_lora::LoraTable::set)
      .def("clear", &tm_lora::LoraTable::clear)
      .def_property_readonly("slots", &tm_lora::LoraTable::slots);
  m.def("lora_apply_", &lora_apply_, "y += each row's adapter update of matmul m (LoRA), in place",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
