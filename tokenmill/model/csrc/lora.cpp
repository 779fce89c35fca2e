// LoRA's row functions and the separate op (see lora.h).
#include "lora.h"

#include <ATen/Parallel.h>

#include <memory>

namespace tm_lora {

LoraTable::LoraTable(int64_t slots, int64_t mats) : updates_(slots, std::vector<Update>(mats)), mats_(mats) {
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
    TORCH_CHECK(A.is_contiguous() && B.is_contiguous() && seg.is_contiguous(), "contiguous");
    Update u{A, B, seg, A.size(0), B.size(1), A.size(1), B.size(0)};
    const int32_t* s = seg.data_ptr<int32_t>();
    for (int64_t c = 0; c < u.n; ++c) TORCH_CHECK(s[c] < 0 || s[c] + u.r <= u.R, "seg out of range");
    max_R_ = std::max(max_R_, u.R);
    row[m] = u;
  }
  updates_[slot] = std::move(row);
}

void LoraTable::clear(int64_t slot) {
  TORCH_CHECK(slot >= 0 && slot < slots(), "slot out of range");
  updates_[slot] = std::vector<Update>(mats_);
}

template <typename T>
static void project(const Update& u, const T* x, float* xa) {
  const float* A = u.A.data_ptr<float>();
  for (int64_t i = 0; i < u.R; ++i) {
    const float* a = A + i * u.k;
    float s = 0.f;
    for (int64_t e = 0; e < u.k; ++e) s += a[e] * static_cast<float>(x[e]);
    xa[i] = s;
  }
}

template <typename T>
static void add(const Update& u, const float* xa, int64_t c0, int64_t c1, T* y) {
  const float* B = u.B.data_ptr<float>();
  const int32_t* seg = u.seg.data_ptr<int32_t>();
  for (int64_t c = c0; c < c1; ++c) {
    if (seg[c] < 0) continue;
    const float* b = B + c * u.r;
    const float* v = xa + seg[c];
    float s = 0.f;
    for (int64_t j = 0; j < u.r; ++j) s += b[j] * v[j];
    y[c] = static_cast<T>(static_cast<float>(y[c]) + s);
  }
}

void project_row(const Update& u, const float* x, float* xa) { project(u, x, xa); }
void project_row(const Update& u, const c10::BFloat16* x, float* xa) { project(u, x, xa); }
void add_row(const Update& u, const float* xa, int64_t c0, int64_t c1, float* y) { add(u, xa, c0, c1, y); }
void add_row(const Update& u, const float* xa, int64_t c0, int64_t c1, c10::BFloat16* y) { add(u, xa, c0, c1, y); }

template <typename T>
static void apply(const LoraTable& t, int64_t m, const torch::Tensor& x, torch::Tensor& y, const int64_t* slots) {
  const int64_t M = x.size(0), k = x.size(1), n = y.size(1);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, M, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> xa(t.max_rank());
    for (int64_t b = b0; b < b1; ++b) {
      const Update* u = t.get(slots[b], m);
      if (u == nullptr) continue;
      TORCH_CHECK(u->k == k && u->n == n, "adapter shape does not match the matmul");
      project_row(*u, xp + b * k, xa.data());
      add_row(*u, xa.data(), 0, n, yp + b * n);
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
      .def(pybind11::init<int64_t, int64_t>())
      .def("set", &tm_lora::LoraTable::set)
      .def("clear", &tm_lora::LoraTable::clear)
      .def_property_readonly("slots", &tm_lora::LoraTable::slots);
  m.def("lora_apply_", &lora_apply_, "y += each row's adapter update of matmul m (LoRA), in place",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
