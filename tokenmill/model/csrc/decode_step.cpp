// A whole decode step of an int4 model in one call: every layer's norms, matmuls,
// rotary embedding, K/V write and attention inside one OpenMP parallel region.
//
// Why: a decode step of a small model is ~270 separate ops, each a Python call, a
// pybind crossing and an OpenMP fork/join, and the cores idle between them while the
// weight streams restart. Here the threads stay up for the whole step and meet at five
// barriers a layer; the row-sized work in between (norms, activation quantization,
// silu, merging attention chunks) each thread does for itself, on private copies,
// rather than paying a barrier to share it.
//
// Numerics are those of the separate native ops (same row functions, same bf16
// roundings, same chunking of attention), so the two paths give identical outputs as
// long as the separate path would also use the packed kernels for every layer (fewer
// rows than any layer's switch to its dense copy; see tokenmill/model/fused.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <cstring>
#include <vector>

#include "argmax.h"
#include "decode_attention.h"
#include "lora.h"
#include "quant_tiles.h"
#include "row_attention.h"
#include "rows.h"
#include "sampling.h"

// Two builds of the step. With AVX-512 (VNNI, BF16) attention runs decode_attention.h's
// chunked kernels, as the separate decode_attention op does; with AVX2 and no AVX-512,
// each (row, kv head) runs row_attention.h's loop, as the separate paged_attention op
// does there. Either way the step matches the separate ops that machine would run.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define TM_FUSED_DECODE 1
#define TM_FUSED_CHUNKED_ATTENTION 1
#elif TM_QUANT_TILES && !defined(__AVX512F__)
// (with AVX-512 but not VNNI and BF16 the separate ops take decode attention, which the
// step would not match: there it stays off)
#define TM_FUSED_DECODE 1
#define TM_FUSED_CHUNKED_ATTENTION 0
#endif

namespace {

using BF16 = c10::BFloat16;
using tm_argmax::first_max;
using tm_argmax::later_wins;

// [begin, end) of n items for thread t of nt, in contiguous runs as at::parallel_for splits.
inline std::pair<int64_t, int64_t> share(int64_t n, int t, int nt) {
  const int64_t per = (n + nt - 1) / nt;
  return {std::min(n, t * per), std::min(n, (t + 1) * per)};
}

struct Mat {
  torch::Tensor tiles;
  int64_t n = 0, k = 0, tile_bytes = 0;
  int64_t kind = 1;  // tm_quant's tile kinds: 1 int4, 2 int4 precise, 3 int8 blocks precise, 4 Q5_0 blocks
                     // precise, 5 int8 blocks, 6 Q5_0 blocks
  torch::Tensor bias;  // bfloat16 [n], or undefined for none
};

}  // namespace

class DecodeModel {
 public:
  // mats: per layer qkv, o, gate_up, down (tiles, see quant_gemv.cpp); kinds: the same
  // order, 1 int4, 2 int4 with precise activations, 3 int8 blocks; norms: per layer input
  // and post-attention norms, then the final norm; cos, sin [max_pos, head_dim / 2] float32;
  // biases: the same order as mats, bfloat16 [N] or empty for none (Qwen2's qkv has one),
  // added to the matmul's bf16 output and rounded, as the separate ops do.
  DecodeModel(std::vector<torch::Tensor> mats, std::vector<int64_t> kinds, std::vector<torch::Tensor> norms,
              torch::Tensor cos, torch::Tensor sin, int64_t H, int64_t Hkv, int64_t head_dim, double eps,
              double scale, std::vector<torch::Tensor> biases)
      : cos_(cos.contiguous()), sin_(sin.contiguous()), H_(H), Hkv_(Hkv), D_(head_dim), eps_(eps), scale_(scale) {
    TORCH_CHECK(mats.size() % 4 == 0 && !mats.empty() && kinds.size() == mats.size(), "4 matmuls a layer");
    TORCH_CHECK(biases.size() == mats.size(), "a bias (or an empty tensor) for each matmul");
    L_ = static_cast<int64_t>(mats.size() / 4);
    TORCH_CHECK(norms.size() == static_cast<size_t>(2 * L_ + 1), "2 norms a layer and a final one");
#if TM_FUSED_CHUNKED_ATTENTION
    TORCH_CHECK(H % Hkv == 0 && H / Hkv <= tm_decode::kMaxGroup, "query heads per kv head");
#else
    TORCH_CHECK(H % Hkv == 0, "query heads per kv head");
#endif
    TORCH_CHECK(cos_.scalar_type() == at::kFloat && sin_.scalar_type() == at::kFloat && cos_.dim() == 2 &&
                    cos_.size(1) == head_dim / 2 && sin_.sizes() == cos_.sizes(),
                "cos, sin: float32 [positions, head_dim / 2]");
    for (size_t i = 0; i < mats.size(); ++i) {
      const auto& t = mats[i];
      const int64_t kind = kinds[i];
      const int64_t group_bytes = kind == 3 || kind == 5 ? 544 : kind == 4 || kind == 6 ? 352 : 320;
      TORCH_CHECK(kind >= 1 && kind <= 6, "tile kinds: 1 int4, 2 int4 precise, 3 int8 blocks precise, "
                  "4 Q5_0 blocks precise, 5 int8 blocks, 6 Q5_0 blocks");
      TORCH_CHECK(t.scalar_type() == at::kByte && t.dim() == 2 && t.is_contiguous() && t.size(1) % group_bytes == 0,
                  "tiles [N/16, K/32 * ", group_bytes, "]");
      mats_.push_back({t, t.size(0) * 16, t.size(1) / group_bytes * 32, t.size(1), kind, torch::Tensor()});
      if (biases[i].numel() > 0) {
        TORCH_CHECK(biases[i].scalar_type() == at::kBFloat16 && biases[i].dim() == 1 && biases[i].is_contiguous() &&
                        biases[i].numel() == mats_.back().n, "bias ", i, ": contiguous bfloat16 [N]");
        mats_.back().bias = biases[i];
      }
    }
    for (auto& n : norms) {
      TORCH_CHECK(n.scalar_type() == at::kBFloat16 && n.is_contiguous(), "bfloat16 norms");
      norms_.push_back(n);
    }
    hidden_ = norms_.back().numel();
    for (auto& n : norms_) TORCH_CHECK(n.numel() == hidden_, "norm weights of the hidden size");
    inter_ = mats_[2].n / 2;
    for (int64_t l = 0; l < L_; ++l) {
      const Mat* m = &mats_[4 * l];
      TORCH_CHECK(m[0].k == hidden_ && m[0].n == (H + 2 * Hkv) * head_dim && m[1].k == H * head_dim &&
                      m[1].n == hidden_ && m[2].k == hidden_ && m[2].n == 2 * inter_ && m[3].k == inter_ &&
                      m[3].n == hidden_ && head_dim % 16 == 0,
                  "layer ", l, ": matmul shapes do not chain");
    }
  }

  // k, v: per layer [Hkv, slots, head_dim] bfloat16, or int8 with their scales ks, vs
  // [Hkv, slots] float32; kept for the steps that follow.
  void bind_cache(std::vector<torch::Tensor> k, std::vector<torch::Tensor> v, std::vector<torch::Tensor> ks,
                  std::vector<torch::Tensor> vs) {
    TORCH_CHECK(static_cast<int64_t>(k.size()) == L_ && static_cast<int64_t>(v.size()) == L_, "a cache per layer");
    const bool i8 = k[0].scalar_type() == at::kChar;
    TORCH_CHECK(i8 ? static_cast<int64_t>(ks.size()) == L_ && static_cast<int64_t>(vs.size()) == L_
                   : ks.empty() && vs.empty(), "scales for each layer of an int8 cache, none for bfloat16");
    const auto type = i8 ? at::kChar : at::kBFloat16;
    for (int64_t l = 0; l < L_; ++l) {
      TORCH_CHECK(k[l].is_contiguous() && v[l].is_contiguous() && k[l].scalar_type() == type &&
                      v[l].scalar_type() == type && k[l].dim() == 3 && k[l].size(0) == Hkv_ &&
                      k[l].size(2) == D_ && v[l].sizes() == k[l].sizes() && k[l].size(1) == k[0].size(1),
                  "layer ", l, ": cache [Hkv, slots, head_dim] bfloat16 or int8, the same slots in every layer");
      if (i8)
        for (const auto* t : {&ks[l], &vs[l]})
          TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                          t->size(0) == Hkv_ && t->size(1) == k[l].size(1),
                      "layer ", l, ": scales float32 [Hkv, slots]");
    }
    k_ = std::move(k);
    v_ = std::move(v);
    ks_ = std::move(ks);
    vs_ = std::move(vs);
  }

  // Qwen3's and Gemma 3's parts, each list empty or one a layer: q and k norms [head_dim]
  // (QK-norm, before RoPE), norms [hidden] on the attention's and the MLP's outputs, and
  // sliding windows (0: none; one size for all sliding layers) whose layers take RoPE
  // from local_cos, local_sin; gelu: GeGLU instead of SwiGLU. They run the separate ops'
  // row functions (rows.h), in their order.
  void set_family(std::vector<torch::Tensor> q_norms, std::vector<torch::Tensor> k_norms,
                  std::vector<torch::Tensor> attn_out_norms, std::vector<torch::Tensor> ffn_out_norms,
                  std::vector<int64_t> windows, torch::Tensor local_cos, torch::Tensor local_sin, bool gelu) {
    auto check = [&](const std::vector<torch::Tensor>& v, int64_t n, const char* what) {
      TORCH_CHECK(v.empty() || static_cast<int64_t>(v.size()) == L_, what, ": one a layer or none");
      for (const auto& t : v)
        TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.numel() == n, what,
                    ": contiguous bfloat16 [", n, "]");
    };
    check(q_norms, D_, "q norms");
    check(k_norms, D_, "k norms");
    check(attn_out_norms, hidden_, "attention output norms");
    check(ffn_out_norms, hidden_, "MLP output norms");
    TORCH_CHECK(q_norms.size() == k_norms.size() && attn_out_norms.size() == ffn_out_norms.size(),
                "q and k norms together, both output norms together");
    TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == L_, "windows: one a layer or none");
    window_ = 0;
    for (const int64_t w : windows) {
      TORCH_CHECK(w >= 0 && (w == 0 || window_ == 0 || w == window_), "windows: 0 or one size");
      window_ = std::max(window_, w);
    }
    TORCH_CHECK(local_cos.scalar_type() == at::kFloat && local_sin.scalar_type() == at::kFloat &&
                    local_cos.sizes() == cos_.sizes() && local_sin.sizes() == cos_.sizes(),
                "local_cos, local_sin: float32 like cos, sin");
    q_norms_ = std::move(q_norms);
    k_norms_ = std::move(k_norms);
    attn_out_norms_ = std::move(attn_out_norms);
    ffn_out_norms_ = std::move(ffn_out_norms);
    windows_ = std::move(windows);
    local_cos_ = local_cos.contiguous();
    local_sin_ = local_sin.contiguous();
    gelu_ = gelu;
  }

  // h [M, hidden] bfloat16 embeddings of the step's tokens (one a sequence); positions,
  // slot_mapping, seq_lens [M]; block_tables [M, max_blocks]. Returns the final norm's
  // output [M, hidden].
  torch::Tensor forward(torch::Tensor h, torch::Tensor positions, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, torch::Tensor seq_lens, int64_t block_size) {
    TORCH_CHECK(h.scalar_type() == at::kBFloat16 && h.dim() == 2 && h.size(1) == hidden_, "h: bf16 [M, hidden]");
    auto hc = h.contiguous();
    auto out = torch::empty_like(hc);
    step(hc, positions, slot_mapping, block_tables, seq_lens, block_size, out, nullptr);
    return out;
  }

  // LoRA adapters' updates, each row's adapter given before each call (set_row_adapters)
  void set_lora(std::shared_ptr<tm_lora::LoraTable> table) {
    TORCH_CHECK(table->mats() == static_cast<int64_t>(mats_.size()), "a LoRA table of this model's matmuls");
    lora_ = std::move(table);
  }

  // The rows' adapter slots for the calls that follow (int64 [M], -1 for none); an empty
  // tensor: no row has one.
  void set_row_adapters(torch::Tensor slots) {
    TORCH_CHECK(slots.numel() == 0 || (slots.scalar_type() == at::kLong && slots.dim() == 1 && lora_),
                "int64 [M] slots, after set_lora");
    row_adapters_ = slots.contiguous();
  }

  // The output projection (int8 block tiles, see quant_gemv.cpp) and the embedding, for
  // forward_logits. The projection's float32 logits are the ones q8b_gemv gives.
  // embed_scale: the embedding rows' multiplier (Gemma), rounded to bfloat16 by the
  // caller, as the model's own product rounds.
  void set_head(torch::Tensor embed, torch::Tensor head_tiles, double embed_scale) {
    TORCH_CHECK(embed.scalar_type() == at::kBFloat16 && embed.dim() == 2 && embed.size(1) == hidden_ &&
                    embed.is_contiguous(), "embed: contiguous bf16 [vocab, hidden]");
    TORCH_CHECK(head_tiles.scalar_type() == at::kByte && head_tiles.dim() == 2 && head_tiles.is_contiguous() &&
                    head_tiles.size(1) == hidden_ / tm_quant::kGroup * 544, "head: uint8 int8 block tiles [N/16, K/32 * 544]");
    // each step's token indexes the embedding in decode_steps
    TORCH_CHECK(head_tiles.size(0) * tm_quant::kTile <= embed.size(0), "head rows beyond the embedding");
    embed_ = embed;
    head_ = head_tiles;
    embed_scale_ = static_cast<float>(embed_scale);
  }

  // token ids [M] -> {logits float32 [M, vocab], argmax int64 [M]} (the first maximum).
  // Saves the step's embedding, output projection and sampling argmax as separate calls:
  // each cost tens of microseconds with the caches cold from the weight stream.
  std::vector<torch::Tensor> forward_logits(torch::Tensor ids, torch::Tensor positions, torch::Tensor slot_mapping,
                                            torch::Tensor block_tables, torch::Tensor seq_lens, int64_t block_size) {
    TORCH_CHECK(head_.defined(), "set_head first");
    TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "ids: int64 [M]");
    auto idc = ids.contiguous();
    const int64_t M = idc.numel(), V = head_.size(0) * tm_quant::kTile;
    const int64_t* ip = idc.data_ptr<int64_t>();
    for (int64_t b = 0; b < M; ++b) TORCH_CHECK(ip[b] >= 0 && ip[b] < embed_.size(0), "token id out of range");
    auto h = embed_.index_select(0, idc);
    if (embed_scale_ != 1.f)
      for (int64_t b = 0; b < M; ++b) embed_row(ip[b], h.data_ptr<BF16>() + b * hidden_);
    auto logits = torch::empty({M, V}, h.options().dtype(at::kFloat));
    auto best = torch::empty({M}, idc.options());
    Head head{logits.data_ptr<float>(), best.data_ptr<int64_t>(), V};
    step(h, positions, slot_mapping, block_tables, seq_lens, block_size, h, &head);
    return {logits, best};
  }

  // `steps` decode steps in one call: each step's token is the next step's input,
  // positions and lengths grow by one a step, slots come from the block tables (which
  // must already hold the blocks for every step). ids, positions, seq_lens [M];
  // block_tables [M, max_blocks]; temps float32 [M] (0: the argmax, else sampled at that
  // temperature with the uniform of (seeds[b], indices[b] + step) after truncation by
  // top_ks[b], top_ps[b], min_ps[b], see sampling.h).
  // Returns the tokens [steps, M]: row s is what step s chose, the same tokens `steps`
  // forward_logits calls and the engine's sampler would give.
  // Why: between two steps the Python of an engine step (schedule, sample, update) costs
  // a tenth of a batch-1 step, most of it cache misses after the weight stream.
  torch::Tensor decode_steps(torch::Tensor ids, torch::Tensor positions, torch::Tensor block_tables,
                             torch::Tensor seq_lens, int64_t block_size, int64_t steps, torch::Tensor temps,
                             torch::Tensor seeds, torch::Tensor indices, torch::Tensor top_ks, torch::Tensor top_ps,
                             torch::Tensor min_ps) {
    TORCH_CHECK(head_.defined(), "set_head first");
    TORCH_CHECK(steps >= 1, "steps must be positive");
    TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "ids: int64 [M]");
    const int64_t M = ids.numel(), V = head_.size(0) * tm_quant::kTile;
    for (const auto* t : {&positions, &seq_lens, &seeds, &indices})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == M, "int64 [M] positions, lengths, seeds, indices");
    TORCH_CHECK(temps.scalar_type() == at::kFloat && temps.numel() == M, "temps: float32 [M]");
    const auto trunc = tm_sample::truncations(top_ks, top_ps, min_ps, M);
    TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == M,
                "block tables [M, blocks]");
    TORCH_CHECK(block_size >= 1, "block_size must be positive");
    auto tc = temps.contiguous();
    auto sc = seeds.contiguous();
    auto ic = indices.contiguous();
    const float* tp = tc.data_ptr<float>();
    const int64_t* seedp = sc.data_ptr<int64_t>();
    const int64_t* idxp = ic.data_ptr<int64_t>();
    // private copies the loop advances
    auto cur = ids.clone(at::MemoryFormat::Contiguous);
    auto pos = positions.clone(at::MemoryFormat::Contiguous);
    auto lens = seq_lens.clone(at::MemoryFormat::Contiguous);
    auto tables = block_tables.contiguous();
    const int64_t mb = tables.size(1), slots_total = k_.empty() ? 0 : k_[0].size(1);
    const int64_t* tb = tables.data_ptr<int64_t>();
    int64_t* cp = cur.data_ptr<int64_t>();
    int64_t* pp = pos.data_ptr<int64_t>();
    int64_t* lp = lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < M; ++b) {
      TORCH_CHECK(cp[b] >= 0 && cp[b] < embed_.size(0), "token id out of range");
      TORCH_CHECK(pp[b] >= 0 && lp[b] == pp[b] + 1, "decode positions are their lengths - 1");
      TORCH_CHECK(lp[b] + steps - 1 <= mb * block_size, "the block tables do not hold every step's token");
      TORCH_CHECK(pp[b] + steps <= cos_.size(0), "position out of range");
      for (int64_t j = pp[b] / block_size; j <= (pp[b] + steps - 1) / block_size; ++j)
        TORCH_CHECK(tb[b * mb + j] >= 0 && (tb[b * mb + j] + 1) * block_size <= slots_total,
                    "block id out of range");
    }
    auto out = torch::empty({steps, M}, cur.options());
    auto slots = torch::empty({M}, cur.options());
    auto logits = torch::empty({M, V}, cur.options().dtype(at::kFloat));
    auto h = torch::empty({M, hidden_}, embed_.options());
    int64_t* sp = slots.data_ptr<int64_t>();
    int64_t* op = out.data_ptr<int64_t>();
    BF16* hp = h.data_ptr<BF16>();
    for (int64_t s = 0; s < steps; ++s) {
      for (int64_t b = 0; b < M; ++b) {
        sp[b] = tb[b * mb + pp[b] / block_size] * block_size + pp[b] % block_size;
        embed_row(cp[b], hp + b * hidden_);
      }
      Head head{logits.data_ptr<float>(), op + s * M, V};
      step(h, pos, slots, tables, lens, block_size, h, &head);
      tm_sample::draw_rows(logits.data_ptr<float>(), M, V, tp, seedp, idxp, s, trunc, op + s * M);
      for (int64_t b = 0; b < M; ++b) {
        cp[b] = op[s * M + b];
        ++pp[b];
        ++lp[b];
      }
    }
    return out;
  }

 private:
  // dst [hidden] = token id's embedding row times embed_scale_ (rounded as torch's bf16 product)
  void embed_row(int64_t id, BF16* dst) const {
    const BF16* src = embed_.data_ptr<BF16>() + id * hidden_;
    if (embed_scale_ == 1.f) {
      std::copy(src, src + hidden_, dst);
      return;
    }
    for (int64_t e = 0; e < hidden_; ++e) dst[e] = static_cast<BF16>(static_cast<float>(src[e]) * embed_scale_);
  }

  struct Head {
    float* logits;
    int64_t* best;
    int64_t V;
  };

  void step(const torch::Tensor& h, const torch::Tensor& positions, const torch::Tensor& slot_mapping,
            const torch::Tensor& block_tables, const torch::Tensor& seq_lens, int64_t block_size, torch::Tensor& out,
            const Head* head) {
    TORCH_CHECK(!k_.empty(), "bind_cache first");
    const int64_t M = h.size(0);
    for (const auto* t : {&positions, &slot_mapping, &seq_lens})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == M, "int64 [M] positions, slots, lengths");
    TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.size(0) == M, "block tables [M, blocks]");
    auto pos_t = positions.contiguous(), slots_t = slot_mapping.contiguous(), lens_t = seq_lens.contiguous();
    const int64_t* pos = pos_t.data_ptr<int64_t>();
    for (int64_t b = 0; b < M; ++b) TORCH_CHECK(pos[b] >= 0 && pos[b] < cos_.size(0), "position out of range");
    auto hc = h.contiguous();
    auto tables = block_tables.contiguous();
#if TM_FUSED_DECODE
    const bool i8 = !ks_.empty();
    switch (D_) {
      case 64: i8 ? run<64, int8_t>(hc, pos, slots_t, tables, lens_t, block_size, out, head)
               : run<64, BF16>(hc, pos, slots_t, tables, lens_t, block_size, out, head); break;
      case 80: i8 ? run<80, int8_t>(hc, pos, slots_t, tables, lens_t, block_size, out, head)
               : run<80, BF16>(hc, pos, slots_t, tables, lens_t, block_size, out, head); break;
      case 96: i8 ? run<96, int8_t>(hc, pos, slots_t, tables, lens_t, block_size, out, head)
               : run<96, BF16>(hc, pos, slots_t, tables, lens_t, block_size, out, head); break;
      case 128: i8 ? run<128, int8_t>(hc, pos, slots_t, tables, lens_t, block_size, out, head)
               : run<128, BF16>(hc, pos, slots_t, tables, lens_t, block_size, out, head); break;
      case 256: i8 ? run<256, int8_t>(hc, pos, slots_t, tables, lens_t, block_size, out, head)
               : run<256, BF16>(hc, pos, slots_t, tables, lens_t, block_size, out, head); break;
      default: TORCH_CHECK(false, "head_dim ", D_, " not built");
    }
#else
    TORCH_CHECK(false, "the fused decode step needs AVX-512 VNNI and BF16, or AVX2 without AVX-512");
#endif
  }

  // A block's output row, or (Gemma) a private copy of it after layer l's norm: the
  // separate ops' in-place rms_norm_ on the same row function.
  const BF16* out_norm(const std::vector<torch::Tensor>& norms, int64_t l, const BF16* row, BF16* copy) const {
    if (norms.empty()) return row;
    std::copy(row, row + hidden_, copy);
    tm_rows::rms_row_(copy, norms[l].data_ptr<BF16>(), hidden_, static_cast<float>(eps_));
    return copy;
  }

#if TM_FUSED_DECODE
  template <int D, typename C>
  void run(const torch::Tensor& h, const int64_t* pos, const torch::Tensor& slot_mapping,
           const torch::Tensor& tables, const torch::Tensor& seq_lens, int64_t bs, torch::Tensor& out,
           const Head* head) {
    using tm_quant::QuantX;
    const int64_t M = h.size(0), hid = hidden_, I = inter_, H = H_, Hkv = Hkv_, g = H / Hkv;
    const int64_t nq = (H + 2 * Hkv) * D, half = D / 2, S = k_[0].size(1), mb = tables.size(1);
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    const int64_t* tb = tables.data_ptr<int64_t>();
    const float* cosp = cos_.data_ptr<float>();
    const float* sinp = sin_.data_ptr<float>();
    // sliding layers' RoPE (Gemma 3's local base)
    const float* lcosp = local_cos_.defined() ? local_cos_.data_ptr<float>() : cosp;
    const float* lsinp = local_sin_.defined() ? local_sin_.data_ptr<float>() : sinp;
    const float eps = static_cast<float>(eps_), scale = static_cast<float>(scale_);
    for (int64_t b = 0; b < M; ++b)
      TORCH_CHECK(slots[b] >= 0 && slots[b] < S && lens[b] >= 1 && lens[b] <= mb * bs, "slot or length out of range");
    // this thread's OpenMP team size follows torch's setting, as at::parallel_for's does
    at::internal::lazy_init_num_threads();
    const int64_t threads = at::get_num_threads();
#if TM_FUSED_CHUNKED_ATTENTION
    // the units of full layers, and of sliding ones (from each row's first key in the window)
    std::vector<int64_t> first, wfirst, los;
    const int64_t chunk = tm_decode::plan_units(lens, M, Hkv, bs, first);
    const std::vector<int64_t> bounds = tm_decode::unit_bounds(first, lens, chunk, Hkv, threads);
    std::vector<int64_t> wbounds;
    int64_t wchunk = chunk;
    if (window_ > 0) {
      for (int64_t b = 0; b < M; ++b) los.push_back(std::max<int64_t>(0, lens[b] - window_));
      wchunk = tm_decode::plan_units(lens, M, Hkv, bs, wfirst, los.data());
      wbounds = tm_decode::unit_bounds(wfirst, lens, wchunk, Hkv, threads, los.data());
    }
    // attention's partial results
    std::vector<float> parts(std::max(first[M], window_ > 0 ? wfirst[M] : 0) * g * (D + 2));
#else
    std::vector<BF16> attn_rows(M * H * D);  // attention's output
#endif
    // shared between the threads: each matmul's output
    std::vector<BF16> qkv(M * nq), o(M * hid), gu(M * 2 * I), dn(M * hid);
    // each thread's best logit and its index per row, over the vocabulary slice it computed
    std::vector<float> best_val(threads * M, -std::numeric_limits<float>::infinity());
    std::vector<int64_t> best_idx(threads * M, 0);
    const BF16* h0 = h.data_ptr<BF16>();
    BF16* outp = out.data_ptr<BF16>();
    const int64_t* adapters = row_adapters_.defined() && row_adapters_.numel() ? row_adapters_.data_ptr<int64_t>() : nullptr;
    TORCH_CHECK(!adapters || row_adapters_.numel() == M, "one adapter slot a row");
    const int64_t lora_scratch = adapters ? lora_->scratch() : 0;
    auto mm = [&](const Mat& m, const QuantX& xq, int64_t t0, int64_t t1, BF16* y) {
      const uint8_t* w = m.tiles.data_ptr<uint8_t>();
      switch (m.kind) {
        case 1: return tm_quant::tiles_range<1>(w, m.tile_bytes, xq, M, m.k, m.n, t0, t1, y);
        case 2: return tm_quant::tiles_range<2>(w, m.tile_bytes, xq, M, m.k, m.n, t0, t1, y);
        case 4: return tm_quant::tiles_range<4>(w, m.tile_bytes, xq, M, m.k, m.n, t0, t1, y);
        case 5: return tm_quant::tiles_range<5>(w, m.tile_bytes, xq, M, m.k, m.n, t0, t1, y);
        case 6: return tm_quant::tiles_range<6>(w, m.tile_bytes, xq, M, m.k, m.n, t0, t1, y);
        default: return tm_quant::tiles_range<3>(w, m.tile_bytes, xq, M, m.k, m.n, t0, t1, y);
      }
    };
    // columns [c0, c1) of y [M, m.n] plus m's bias, rounded to bf16 as torch's add does
    auto add_bias = [&](const Mat& m, int64_t c0, int64_t c1, BF16* y) {
      if (!m.bias.defined()) return;
      const BF16* bp = m.bias.data_ptr<BF16>();
      for (int64_t b = 0; b < M; ++b)
        for (int64_t c = c0; c < c1; ++c)
          y[b * m.n + c] = static_cast<BF16>(static_cast<float>(y[b * m.n + c]) + static_cast<float>(bp[c]));
    };
#pragma omp parallel
    {
      const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
      // each thread's own residual stream and norm output (row-sized work: cheaper done
      // twice than shared through a barrier)
      std::vector<BF16> hp(h0, h0 + M * hid), xp(M * hid), act(M * I), normed(M * hid);
      std::vector<float> lora_buf(lora_scratch);
      // columns [c0, c1) of matmul mi's output y (rows of yn) += each row's adapter update from x (rows of xk)
      auto lora = [&](int64_t l, int64_t mi, const BF16* x, int64_t xk, int64_t c0, int64_t c1, BF16* y, int64_t yn) {
        if (!adapters || c1 <= c0) return;
        for (int64_t b = 0; b < M; ++b) {
          const tm_lora::Update* u = lora_->get(adapters[b], 4 * l + mi);
          if (u == nullptr) continue;
          tm_lora::update_row(*u, x + b * xk, c0, c1, y + b * yn, lora_buf.data());
        }
      };
#if TM_FUSED_CHUNKED_ATTENTION
      std::vector<BF16> attn(M * H * D);
#endif
      const BF16* norm0 = norms_[0].data_ptr<BF16>();
      for (int64_t b = 0; b < M; ++b) tm_rows::rms_row(hp.data() + b * hid, norm0, xp.data() + b * hid, hid, eps);
      for (int64_t l = 0; l < L_; ++l) {
        const Mat* w = &mats_[4 * l];
        const bool sliding = !windows_.empty() && windows_[l] > 0;
        const float* lc = sliding ? lcosp : cosp;
        const float* ls = sliding ? lsinp : sinp;
        const BF16* qn = q_norms_.empty() ? nullptr : q_norms_[l].data_ptr<BF16>();
        const BF16* kn = k_norms_.empty() ? nullptr : k_norms_[l].data_ptr<BF16>();
        C* kc = k_[l].data_ptr<C>();
        C* vc = v_[l].data_ptr<C>();
        float* ksc = ks_.empty() ? nullptr : ks_[l].data_ptr<float>();
        float* vsc = vs_.empty() ? nullptr : vs_[l].data_ptr<float>();
        // qkv, split by heads so each thread ropes and caches the heads it computed
        {
          const QuantX& xq = tm_quant::quantize_rows(xp.data(), M, hid, w[0].kind);
          const auto [h0_, h1_] = share(H + 2 * Hkv, tid, nt);
          mm(w[0], xq, h0_ * D / 16, h1_ * D / 16, qkv.data());
          add_bias(w[0], h0_ * D, h1_ * D, qkv.data());
          lora(l, 0, xp.data(), hid, h0_ * D, h1_ * D, qkv.data(), nq);
          for (int64_t hd = h0_; hd < h1_; ++hd)
            for (int64_t b = 0; b < M; ++b) {
              BF16* v = qkv.data() + b * nq + hd * D;
              if (hd < H + Hkv) {
                if (qn) tm_rows::rms_row_(v, hd < H ? qn : kn, D, eps);
                tm_rows::rope_head(v, lc + pos[b] * half, ls + pos[b] * half, half);
              }
              if (hd >= H + Hkv) {
                const int64_t at = (hd - H - Hkv) * S + slots[b];
                tm_decode::store_row<BF16, D>(v, vc + at * D, vsc ? vsc + at : nullptr);
              } else if (hd >= H) {
                const int64_t at = (hd - H) * S + slots[b];
                tm_decode::store_row<BF16, D>(v, kc + at * D, ksc ? ksc + at : nullptr);
              }
            }
        }
#pragma omp barrier
#if TM_FUSED_CHUNKED_ATTENTION
        {
          // (the region has the threads it was planned for; any it lacks, the last one covers)
          const std::vector<int64_t>& bd = sliding ? wbounds : bounds;
          const int64_t u0 = bd[std::min<int64_t>(tid, threads)];
          const int64_t u1 = tid + 1 < nt ? bd[std::min<int64_t>(tid + 1, threads)] : (sliding ? wfirst : first)[M];
          tm_decode::run_units<BF16, C, D>(u0, u1, sliding ? wfirst : first, sliding ? wchunk : chunk, qkv.data(), nq,
                                           kc, vc, ksc, vsc, S, tb, mb, lens, Hkv, g, bs, scale, parts.data(),
                                           sliding ? los.data() : nullptr);
        }
#pragma omp barrier
        for (int64_t b = 0; b < M; ++b)
          tm_decode::merge_units<BF16, D>(parts.data(), sliding ? wfirst : first, b, Hkv, g, attn.data() + b * H * D);
        const BF16* attn_in = attn.data();
#else
        {
          // each (row, kv head) as the separate op runs it: the row as its own sequence
          const auto [w0, w1] = share(M * Hkv, tid, nt);
          for (int64_t u = w0; u < w1; ++u) {
            const int64_t b = u / Hkv, kvh = u % Hkv;
            tm_rowattn::attend_one<BF16, C, D>(qkv.data() + b * nq, kc + kvh * S * D, vc + kvh * S * D,
                                               ksc ? ksc + kvh * S : nullptr, vsc ? vsc + kvh * S : nullptr,
                                               tb + b * mb, bs, 1, lens[b], kvh, H, g, scale,
                                               attn_rows.data() + b * H * D, sliding ? windows_[l] : 0);
          }
        }
#pragma omp barrier
        const BF16* attn_in = attn_rows.data();
#endif
        {
          const QuantX& xq = tm_quant::quantize_rows(attn_in, M, H * D, w[1].kind);
          const auto [t0, t1] = share(w[1].n / 16, tid, nt);
          mm(w[1], xq, t0, t1, o.data());
          add_bias(w[1], 16 * t0, 16 * t1, o.data());
          lora(l, 1, attn_in, H * D, 16 * t0, 16 * t1, o.data(), hid);
        }
#pragma omp barrier
        {
          const BF16* post = norms_[2 * l + 1].data_ptr<BF16>();
          for (int64_t b = 0; b < M; ++b)
            tm_rows::add_rms_row(hp.data() + b * hid, out_norm(attn_out_norms_, l, o.data() + b * hid, normed.data() + b * hid),
                                 post, xp.data() + b * hid, hid, eps);
          const QuantX& xq = tm_quant::quantize_rows(xp.data(), M, hid, w[2].kind);
          const auto [t0, t1] = share(w[2].n / 16, tid, nt);
          mm(w[2], xq, t0, t1, gu.data());
          add_bias(w[2], 16 * t0, 16 * t1, gu.data());
          lora(l, 2, xp.data(), hid, 16 * t0, 16 * t1, gu.data(), 2 * I);
        }
#pragma omp barrier
        {
          for (int64_t b = 0; b < M; ++b) {
            if (gelu_) tm_rows::gelu_mul_row(gu.data() + b * 2 * I, act.data() + b * I, I);
            else tm_rows::silu_mul_row(gu.data() + b * 2 * I, act.data() + b * I, I);
          }
          const QuantX& xq = tm_quant::quantize_rows(act.data(), M, I, w[3].kind);
          const auto [t0, t1] = share(w[3].n / 16, tid, nt);
          mm(w[3], xq, t0, t1, dn.data());
          add_bias(w[3], 16 * t0, 16 * t1, dn.data());
          lora(l, 3, act.data(), I, 16 * t0, 16 * t1, dn.data(), hid);
        }
#pragma omp barrier
        const BF16* next = norms_[l + 1 < L_ ? 2 * (l + 1) : 2 * L_].data_ptr<BF16>();
        for (int64_t b = 0; b < M; ++b)
          tm_rows::add_rms_row(hp.data() + b * hid, out_norm(ffn_out_norms_, l, dn.data() + b * hid, normed.data() + b * hid),
                               next, xp.data() + b * hid, hid, eps);
      }
      if (head) {
        // every thread holds the final norm's output: no barrier before the projection
        const QuantX& xq = tm_quant::quantize_rows(xp.data(), M, hid, 3);  // the head: int8 blocks
        const int64_t V = head->V;
        const auto [t0, t1] = share(V / 16, tid, nt);
        tm_quant::tiles_range<3>(head_.data_ptr<uint8_t>(), head_.size(1), xq, M, hid, V, t0, t1, head->logits);
        if (tid < threads && t1 > t0)
          for (int64_t b = 0; b < M; ++b) {
            const float* row = head->logits + b * V;
            const int64_t bi = first_max(row, 16 * t0, 16 * t1);
            best_val[tid * M + b] = row[bi];
            best_idx[tid * M + b] = bi;
          }
      } else if (tid == 0) {
        std::copy(xp.begin(), xp.end(), outp);
      }
    }
    if (head)  // the slices in vocabulary order, so the first maximum wins ties
      for (int64_t b = 0; b < M; ++b) {
        int64_t bi = best_idx[b];
        float bv = best_val[b];
        for (int64_t t = 1; t < threads; ++t)
          if (later_wins(best_val[t * M + b], bv)) bv = best_val[t * M + b], bi = best_idx[t * M + b];
        head->best[b] = bi;
      }
  }
#endif

  std::vector<Mat> mats_;
  std::shared_ptr<tm_lora::LoraTable> lora_;  // adapters' updates (set_lora), or none
  torch::Tensor row_adapters_;  // int64 [M] the next call's rows' adapter slots (-1: none), or empty
  std::vector<torch::Tensor> norms_, k_, v_, ks_, vs_;  // ks_, vs_: an int8 cache's scales
  torch::Tensor embed_, head_;  // optional (set_head)
  torch::Tensor cos_, sin_;
  // the family's parts (set_family); empty: Llama's block
  std::vector<torch::Tensor> q_norms_, k_norms_, attn_out_norms_, ffn_out_norms_;
  std::vector<int64_t> windows_;
  torch::Tensor local_cos_, local_sin_;
  int64_t window_ = 0;  // the sliding layers' window
  bool gelu_ = false;
  float embed_scale_ = 1.f;
  int64_t L_ = 0, H_, Hkv_, D_, hidden_ = 0, inter_ = 0;
  double eps_, scale_;
};

// The fused head's argmax over one row (a multiple of 16 long), for tests.
int64_t first_max_row(torch::Tensor row) {
  TORCH_CHECK(row.scalar_type() == at::kFloat && row.dim() == 1 && row.numel() > 0 && row.numel() % 16 == 0,
              "float32 [16 k]");
#if TM_FUSED_DECODE
  auto r = row.contiguous();
  return first_max(r.data_ptr<float>(), 0, r.numel());
#else
  TORCH_CHECK(false, "the fused decode step needs AVX-512 VNNI and BF16, or AVX2 without AVX-512");
#endif
}

bool decode_step_available() {
#if TM_FUSED_DECODE
  return true;
#else
  return false;
#endif
}

void bind_decode_step(pybind11::module& m) {
  pybind11::class_<DecodeModel>(m, "DecodeModel")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<torch::Tensor>, torch::Tensor,
                          torch::Tensor, int64_t, int64_t, int64_t, double, double, std::vector<torch::Tensor>>())
      .def("bind_cache", &DecodeModel::bind_cache)
      .def("set_head", &DecodeModel::set_head, pybind11::arg("embed"), pybind11::arg("head_tiles"),
           pybind11::arg("embed_scale") = 1.0)
      .def("set_family", &DecodeModel::set_family)
      .def("set_lora", &DecodeModel::set_lora)
      .def("set_row_adapters", &DecodeModel::set_row_adapters)
      // touches no Python object: other Python threads (the server's) run during a step
      .def("forward", &DecodeModel::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_logits", &DecodeModel::forward_logits, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("decode_steps", &DecodeModel::decode_steps, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("first_max", &first_max_row, "the fused step's argmax over one float32 row: the first maximum, NaN largest");
  m.def("decode_step_available", &decode_step_available, "whether the fused int4 decode step was built");
}
