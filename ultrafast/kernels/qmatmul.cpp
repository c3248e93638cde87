// ultrafast packed-weight kernels: the torch bindings: input checks, threading, and the entry points
// (qmatmul, rmsnorm, attention, decoder_block, the path in use, the multiply peak). The kernels themselves
// sit behind the seam of kernel_variant.h (vnni-int16, avx512-fp32, scalar), chosen at runtime; the one
// fused decoder layer is decoder_layer.cpp.
//
// Batch invariance contract (every variant): each output element is computed by exactly one thread with a
// sequence of floating-point operations that depends only on its own inputs (weight row, activation row,
// K; for attention the query, the keys/values it sees and their count). Threads split the output rows
// (qmatmul, rmsnorm) or the (query, head) pairs (attention); no reduction is ever split across threads or
// shaped by the number of rows in the call.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "decoder_layer.h"
#include "kernel_variant.h"
#include "qmatmul_kernels.h"
#include "row_ops.h"
#include "scratch.h"

namespace ultrafast {
void register_sampling(pybind11::module_& m);  // sampling.cpp

namespace {

void set_kernels_path(const std::string& p) {
  TORCH_CHECK_VALUE(p == "auto" || p == "vnni" || p == "fp32" || p == "avx2" || p == "avx2-fp32" || p == "scalar",
                    "kernels path must be auto, vnni, fp32, avx2, avx2-fp32 or scalar, got '", p, "'");
  request_path(p == "scalar"      ? PathRequest::Scalar
               : p == "fp32"      ? PathRequest::Fp32
               : p == "avx2"      ? PathRequest::Avx2
               : p == "avx2-fp32" ? PathRequest::Avx2Fp32
                                  : PathRequest::Auto);
}

// ---------------------------------------------------------------------------------------------------
// Bindings. Input errors are TORCH_CHECK_VALUE: a ValueError in Python with a clear message.

// The calling thread's scratch (scratch.h) for the prepared activations, or an error.
static uint8_t* scratch_bytes(Scratch& s, size_t bytes) {
  uint8_t* p = s.get(bytes);
  TORCH_CHECK(p != nullptr, "qmatmul: out of memory for ", bytes, " bytes of scratch");
  return p;
}

torch::Tensor qmatmul(const torch::Tensor& x_in, const torch::Tensor& w, int64_t qtype, int64_t in_features,
                      int64_t act_bits) {
  TypeInfo ti;
  TORCH_CHECK_VALUE(act_bits == 16 || act_bits == 8, "qmatmul: act_bits must be 16 or 8, got ", act_bits);
  TORCH_CHECK_VALUE(type_info((int)qtype, &ti), "qmatmul: unsupported GGML type id ", qtype,
                    " (supported: F32=0, F16=1, Q4_0=2, Q4_1=3, Q5_0=6, Q8_0=8, Q4_K=12, Q6_K=14, BF16=30)");
  TORCH_CHECK_VALUE(x_in.device().is_cpu() && w.device().is_cpu(), "qmatmul: tensors must be on the CPU");
  TORCH_CHECK_VALUE(x_in.scalar_type() == torch::kFloat32, "qmatmul: x must be float32, got ", x_in.scalar_type());
  TORCH_CHECK_VALUE(x_in.dim() == 2, "qmatmul: x must be 2-D [k, in_features], got shape ", x_in.sizes());
  TORCH_CHECK_VALUE(w.scalar_type() == torch::kUInt8, "qmatmul: w must be uint8 (raw GGUF bytes), got ",
                    w.scalar_type());
  TORCH_CHECK_VALUE(w.dim() == 2, "qmatmul: w must be 2-D [out_features, row_bytes], got shape ", w.sizes());
  const int64_t K = in_features;
  TORCH_CHECK_VALUE(K > 0, "qmatmul: in_features must be positive");
  TORCH_CHECK_VALUE(x_in.size(1) == K, "qmatmul: x has ", x_in.size(1), " features, expected in_features=", K);
  TORCH_CHECK_VALUE(K % ti.block == 0, "qmatmul: in_features (", K, ") must be a multiple of the block size ",
                    ti.block, " of ", ti.name);
  const int64_t row_bytes = K / ti.block * ti.bytes;
  TORCH_CHECK_VALUE(w.size(1) == row_bytes, "qmatmul: w has ", w.size(1), " bytes per row; ", K, " ", ti.name,
                    " values take ", row_bytes);
  TORCH_CHECK_VALUE(w.size(0) <= 1 || w.stride(1) == 1, "qmatmul: w rows must be contiguous");
  const torch::Tensor x = x_in.contiguous();
  const int64_t k = x.size(0), N = w.size(0);
  const int64_t rb = (w.size(0) > 1 && w.stride(1) == 1) ? w.stride(0) : row_bytes;
  TORCH_CHECK_VALUE(rb >= row_bytes, "qmatmul: w rows overlap (row stride ", rb, ")");
  auto y = torch::empty({k, N}, x.options());
  if (k == 0 || N == 0) return y;

  const LinearOps* ops = linear_ops((int)qtype, act_bits == 8);
  TORCH_CHECK_VALUE(ops != nullptr, "qmatmul: ", no_linear_ops_why((int)qtype, act_bits == 8), " (path in use: ",
                    path_in_use(), ", ", act_bits, "-bit activations)");
  const bool x8 = act_bits == 8;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // Prepare every activation row on its own (batch-invariant), into 64-byte aligned scratch.
  static thread_local Scratch scratch;
  const int64_t xb = ops->prep_bytes((int)qtype, K, x8), units = ops->prep_units((int)qtype, K);
  uint8_t* xg = scratch_bytes(scratch, (size_t)(k * xb + 64));
  at::parallel_for(0, k, std::max<int64_t>(1, 16384 / K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) ops->prep((int)qtype, xp + r * K, K, xg + r * xb, 0, units, x8);
  });
  // Tasks are chunks of 16 weight rows; aim for >= ~48 KiB of weight bytes per task so small matrices do
  // not pay for waking threads. Thread splits never change results.
  constexpr int64_t CH = 16;
  const int64_t nch = (N + CH - 1) / CH;
  const int64_t grain =
      std::max<int64_t>(1, (48 * 1024) / std::max<int64_t>(1, CH * row_bytes * std::max<int64_t>(1, k / 4)));
  at::parallel_for(0, nch, grain, [&](int64_t c0, int64_t c1) {
    TORCH_CHECK(ops->rows((int)qtype, xg, k, K, wp, rb, yp, N, c0 * CH, std::min(N, c1 * CH), x8),
                "qmatmul: out of memory");
  });
  return y;
}

torch::Tensor rmsnorm(const torch::Tensor& x_in, const torch::Tensor& w_in, double eps) {
  TORCH_CHECK_VALUE(x_in.device().is_cpu() && w_in.device().is_cpu(), "rmsnorm: tensors must be on the CPU");
  TORCH_CHECK_VALUE(x_in.scalar_type() == torch::kFloat32 && w_in.scalar_type() == torch::kFloat32,
                    "rmsnorm: x and weight must be float32, got ", x_in.scalar_type(), " and ", w_in.scalar_type());
  TORCH_CHECK_VALUE(x_in.dim() == 2, "rmsnorm: x must be 2-D [k, d], got shape ", x_in.sizes());
  TORCH_CHECK_VALUE(w_in.dim() == 1 && w_in.size(0) == x_in.size(1), "rmsnorm: weight must be 1-D of size ",
                    x_in.size(1), ", got shape ", w_in.sizes());
  const torch::Tensor x = x_in.contiguous(), weight = w_in.contiguous();
  const int64_t k = x.size(0), d = x.size(1);
  TORCH_CHECK_VALUE(d > 0, "rmsnorm: empty rows");
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float feps = (float)eps;
  at::parallel_for(0, k, std::max<int64_t>(1, 65536 / d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rmsnorm_row(xp + r * d, wp, d, feps, yp + r * d);
  });
  return y;
}

// silu(gate) * up, elementwise, with the op the decoder layer uses under the path in force.
torch::Tensor silu_mul(const torch::Tensor& g_in, const torch::Tensor& u_in) {
  TORCH_CHECK_VALUE(g_in.device().is_cpu() && u_in.device().is_cpu(), "silu_mul: tensors must be on the CPU");
  TORCH_CHECK_VALUE(g_in.scalar_type() == torch::kFloat32 && u_in.scalar_type() == torch::kFloat32,
                    "silu_mul: gate and up must be float32, got ", g_in.scalar_type(), " and ", u_in.scalar_type());
  TORCH_CHECK_VALUE(g_in.sizes() == u_in.sizes(), "silu_mul: gate ", g_in.sizes(), " and up ", u_in.sizes(),
                    " differ in shape");
  torch::Tensor g = g_in.contiguous().clone();
  const torch::Tensor u = u_in.contiguous();
  const GatedActOp op = silu_mul_op();
  float* gp = g.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  at::parallel_for(0, g.numel(), 16384, [&](int64_t i0, int64_t i1) { op(gp + i0, up + i0, i1 - i0); });
  return g;
}

// A token tree's key lists (see LayerArgs): keys [T, 2] int64 (prefix length, number of listed rows) and the
// listed rows, int32, row after row; checked against the cache length. Returns each row's offset into them.
std::vector<int64_t> tree_offsets(const torch::Tensor& keys, const torch::Tensor& extra, int64_t T, int64_t maxlen,
                                  int64_t hd) {
  TORCH_CHECK_VALUE(keys.scalar_type() == torch::kInt64 && keys.dim() == 2 && keys.size(0) == T && keys.size(1) == 2 &&
                        keys.is_contiguous() && extra.scalar_type() == torch::kInt32 && extra.dim() == 1 &&
                        extra.is_contiguous(),
                    "tree: keys must be int64 [T, 2] and the listed rows int32 [n], contiguous");
  TORCH_CHECK_VALUE(hd <= 256, "tree: head_dim above 256 is not supported");
  const int64_t* k = keys.data_ptr<int64_t>();
  const int32_t* e = extra.data_ptr<int32_t>();
  std::vector<int64_t> off((size_t)T);
  int64_t o = 0;
  for (int64_t r = 0; r < T; ++r) {
    TORCH_CHECK_VALUE(k[2 * r] >= 1 && k[2 * r + 1] >= 0 && k[2 * r] + k[2 * r + 1] <= maxlen,
                      "tree: row ", r, " has a bad key list");
    off[(size_t)r] = o;
    o += k[2 * r + 1];
  }
  TORCH_CHECK_VALUE(o == extra.numel(), "tree: the listed rows do not add up");
  for (int64_t i = 0; i < o; ++i) TORCH_CHECK_VALUE(e[i] >= 0 && e[i] < maxlen, "tree: listed row past the cache");
  return off;
}

torch::Tensor attention(const torch::Tensor& q_in, const torch::Tensor& kc, const torch::Tensor& vc, int64_t start_pos,
                        double scale, const c10::optional<torch::Tensor>& tree_keys,
                        const c10::optional<torch::Tensor>& tree_extra) {
  TORCH_CHECK_VALUE(q_in.device().is_cpu() && kc.device().is_cpu() && vc.device().is_cpu(),
                    "attention: tensors must be on the CPU");
  TORCH_CHECK_VALUE(q_in.scalar_type() == torch::kFloat32 && kc.scalar_type() == torch::kFloat32 &&
                        vc.scalar_type() == torch::kFloat32,
                    "attention: q, k_cache and v_cache must be float32");
  TORCH_CHECK_VALUE(q_in.dim() == 3, "attention: q must be 3-D [k, n_heads, head_dim], got shape ", q_in.sizes());
  TORCH_CHECK_VALUE(kc.dim() == 3 && vc.dim() == 3,
                    "attention: k_cache and v_cache must be 3-D [n_kv_heads, max_len, head_dim]");
  TORCH_CHECK_VALUE(kc.sizes() == vc.sizes(), "attention: k_cache ", kc.sizes(), " and v_cache ", vc.sizes(),
                    " shapes differ");
  const torch::Tensor q = q_in.contiguous();
  const int64_t k = q.size(0), H = q.size(1), hd = q.size(2);
  const int64_t Hkv = kc.size(0), maxlen = kc.size(1);
  TORCH_CHECK_VALUE(kc.size(2) == hd, "attention: head_dim of q (", hd, ") and cache (", kc.size(2), ") differ");
  TORCH_CHECK_VALUE(Hkv > 0 && H % Hkv == 0, "attention: n_heads (", H, ") must be a multiple of n_kv_heads (", Hkv,
                    ")");
  TORCH_CHECK_VALUE((kc.stride(2) == 1 && vc.stride(2) == 1 && kc.stride(1) == hd && vc.stride(1) == hd) ||
                        maxlen <= 1,
                    "attention: cache rows must be contiguous [.., max_len, head_dim]");
  TORCH_CHECK_VALUE(start_pos >= 0 && start_pos + k <= maxlen, "attention: positions ", start_pos, "..",
                    start_pos + k - 1, " exceed the cache length ", maxlen);
  auto out = torch::empty_like(q);
  if (k == 0 || H == 0 || hd == 0) return out;
  const bool tree = tree_keys.has_value() && tree_keys->defined();
  std::vector<int64_t> toff;
  if (tree) toff = tree_offsets(*tree_keys, *tree_extra, k, maxlen, hd);
  const int64_t* tk = tree ? tree_keys->data_ptr<int64_t>() : nullptr;
  const int32_t* te = tree ? tree_extra->data_ptr<int32_t>() : nullptr;
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = kc.stride(0), vs0 = vc.stride(0);
  const int64_t group = H / Hkv;
  const float fscale = (float)scale;
  const AttentionOp attend = attention_op(hd);
  // Tasks: (query, run of up to `gh` heads of one kv group). The AVX-512 kernel loads each key/value row
  // once for the run; per head the arithmetic depends only on its query, its kv head and its length, so
  // neither the grouping nor the thread split changes any result.
  int64_t gh = std::min<int64_t>(group, 6);
  const int64_t nthreads = at::get_num_threads();
  while (gh > 1 && k * Hkv * ((group + gh - 1) / gh) < 2 * nthreads) gh = (gh + 1) / 2;
  const int64_t nsub = (group + gh - 1) / gh;
  const int64_t lds = (start_pos + k + 16 + 15) / 16 * 16;
  at::parallel_for(0, k * Hkv * nsub, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores((size_t)(gh * lds));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t / (Hkv * nsub), rem = t % (Hkv * nsub), kvh = rem / nsub, sub = rem % nsub;
      const int64_t h0 = kvh * group + sub * gh, hn = std::min<int64_t>(gh, (kvh + 1) * group - h0);
      const int64_t P = tree ? tk[2 * i] : start_pos + i + 1;
      const int64_t L = tree ? P + tk[2 * i + 1] : P;
      const float* qi = qp + (i * H + h0) * hd;
      float* oi = op + (i * H + h0) * hd;
      attend(qi, (int)hn, kp + kvh * ks0, vp + kvh * vs0, L, hd, fscale, scores.data(), lds, oi, P,
             tree ? te + toff[(size_t)i] : nullptr, nullptr, nullptr, 0);
    }
  });
  return out;
}


// ---------------------------------------------------------------------------------------------------
// One whole decoder layer (pre-norm attention + SwiGLU feed-forward) for T rows, in a single call, so a
// decode step costs one Python->C++ crossing per layer instead of ~20 small torch ops (decoder_layer.cpp,
// with the kernel variant in use). The T rows may belong to several sequences (segments of `lens` rows at
// positions starts[s].., each with its own KV cache): the linears then read every weight once for all of
// them (continuous batching), attention runs per sequence. Every stage is a per-row computation whose
// arithmetic does not depend on T, so the layer stays batch-invariant.
// Linears in `w`: wq, wk, wv, wo, w1 (gate), w3 (up), w2 (down); `bias` holds bq, bk, bv or is empty.
//
// layer_on: the layer's checks and its run on x (fp32 [T, d], contiguous, the caller's own copy: updated in place by
// part 0); returns x, or (part 1, 2) this rank's partial sum. kcs, vcs: a cache per sequence. decoder_block runs it
// once, decoder_stack for each of several layers.
torch::Tensor layer_on(torch::Tensor& x, const std::vector<int64_t>& starts, const std::vector<int64_t>& lens,
                       const torch::Tensor& attn_norm_in, const torch::Tensor& ffn_norm_in, double eps,
                       at::TensorList w, at::IntArrayRef qt, at::TensorList bias_in, at::TensorList kcs,
                       at::TensorList vcs, const torch::Tensor& cos, const torch::Tensor& sin, int64_t n_heads,
                       int64_t n_kv_heads, int64_t hd, double scale, int64_t act_bits,
                       const c10::optional<torch::Tensor>& tree_keys, const c10::optional<torch::Tensor>& tree_extra,
                       int64_t part, const std::vector<int64_t>& share) {
  TORCH_CHECK_VALUE(w.size() == 7 && qt.size() == 7, "decoder_block: expected 7 linears");
  TORCH_CHECK_VALUE(bias_in.empty() || bias_in.size() == 3, "decoder_block: expected 0 or 3 biases");
  TORCH_CHECK_VALUE(n_heads >= 1 && n_kv_heads >= 1 && n_heads % n_kv_heads == 0 && hd >= 2 && hd % 2 == 0,
                    "decoder_block: n_heads must be a multiple of n_kv_heads and head_dim even");
  const size_t nseg = starts.size();
  TORCH_CHECK_VALUE(nseg >= 1 && lens.size() == nseg && kcs.size() == nseg && vcs.size() == nseg,
                    "decoder_block: one start, length, k cache and v cache per sequence");
  const int64_t T = x.size(0), d = x.size(1), nq = n_heads * hd, nkv = n_kv_heads * hd;
  int64_t total = 0;
  for (size_t s = 0; s < nseg; ++s) {
    TORCH_CHECK_VALUE(lens[s] >= 1 && starts[s] >= 0, "decoder_block: bad sequence segment");
    TORCH_CHECK_VALUE(kcs[s].dim() == 3 && kcs[s].size(0) == n_kv_heads && kcs[s].size(2) == hd &&
                          starts[s] + lens[s] <= kcs[s].size(1) && vcs[s].sizes() == kcs[s].sizes(),
                      "decoder_block: cache shape mismatch or positions past its end");
    TORCH_CHECK_VALUE(kcs[s].scalar_type() == torch::kFloat32 && vcs[s].scalar_type() == torch::kFloat32 &&
                          kcs[s].stride(2) == 1 && vcs[s].stride(2) == 1 && kcs[s].stride(1) == hd &&
                          vcs[s].stride(1) == hd,
                      "decoder_block: caches must be fp32 with contiguous rows [n_kv_heads, max_len, head_dim]");
    total += lens[s];
  }
  TORCH_CHECK_VALUE(total == T, "decoder_block: segment lengths must add up to the rows of x");
  TORCH_CHECK_VALUE(cos.size(0) == T && cos.size(1) == hd && sin.size(0) == T && sin.size(1) == hd &&
                        cos.is_contiguous() && sin.is_contiguous(),
                    "decoder_block: cos/sin must be contiguous [T, head_dim]");
  const torch::Tensor attn_norm = attn_norm_in.contiguous(), ffn_norm = ffn_norm_in.contiguous();
  TORCH_CHECK_VALUE(attn_norm.numel() == d && ffn_norm.numel() == d && attn_norm.scalar_type() == torch::kFloat32 &&
                        ffn_norm.scalar_type() == torch::kFloat32,
                    "decoder_block: the norms' weights must be fp32 of size ", d);
  const int64_t f = w[4].dim() == 2 ? w[4].size(0) : 0;
  const int64_t expect_rows[7] = {nq, nkv, nkv, d, f, f, d};
  const int64_t expect_k[7] = {d, d, d, nq, d, d, f};
  LayerArgs a{};
  for (int i = 0; i < 7; ++i) {
    TypeInfo ti;
    TORCH_CHECK_VALUE(type_info((int)qt[i], &ti), "decoder_block: linear ", i, ": unsupported GGML type id ", qt[i]);
    TORCH_CHECK_VALUE(w[i].scalar_type() == torch::kUInt8 && w[i].dim() == 2 && w[i].device().is_cpu() &&
                          (w[i].size(0) <= 1 || w[i].stride(1) == 1),
                      "decoder_block: linear ", i, " must be raw GGUF rows (uint8 [rows, row_bytes], rows contiguous)");
    TORCH_CHECK_VALUE(w[i].size(0) == expect_rows[i] && expect_k[i] % ti.block == 0 &&
                          w[i].size(1) == expect_k[i] / ti.block * ti.bytes,
                      "decoder_block: linear ", i, " has shape ", w[i].sizes(), ", expected ", expect_rows[i],
                      " rows of ", expect_k[i], " ", ti.name, " values");
    a.ops[i] = linear_ops((int)qt[i], act_bits == 8);
    TORCH_CHECK_VALUE(a.ops[i] != nullptr, "decoder_block: linear ", i, ": ", no_linear_ops_why((int)qt[i], act_bits == 8),
                      " (path in use: ", path_in_use(), ", ", act_bits, "-bit activations)");
    a.w[i] = w[i].data_ptr<uint8_t>();
    a.rb[i] = w[i].size(0) > 1 ? w[i].stride(0) : w[i].size(1);
    a.qt[i] = (int)qt[i];
  }
  std::vector<torch::Tensor> bias;
  for (const auto& b : bias_in) bias.push_back(b.contiguous());
  if (!bias.empty()) {
    TORCH_CHECK_VALUE(bias[0].numel() == nq && bias[1].numel() == nkv && bias[2].numel() == nkv &&
                          bias[0].scalar_type() == torch::kFloat32 && bias[1].scalar_type() == torch::kFloat32 &&
                          bias[2].scalar_type() == torch::kFloat32,
                      "decoder_block: bias sizes do not match q/k/v");
    a.bq = bias[0].data_ptr<float>(), a.bk = bias[1].data_ptr<float>(), a.bv = bias[2].data_ptr<float>();
  }
  std::vector<float*> kp(nseg), vp(nseg);
  std::vector<int64_t> ks0(nseg), vs0(nseg);
  for (size_t s = 0; s < nseg; ++s) {
    kp[s] = kcs[s].data_ptr<float>();
    vp[s] = vcs[s].data_ptr<float>();
    ks0[s] = kcs[s].stride(0);
    vs0[s] = vcs[s].stride(0);
  }
  a.attn = attention_op(hd);
  a.silu_mul = silu_mul_op();
  a.T = T, a.d = d, a.f = f, a.n_heads = n_heads, a.n_kv_heads = n_kv_heads, a.hd = hd;
  a.eps = (float)eps, a.scale = (float)scale;
  a.x = x.data_ptr<float>();
  a.attn_norm = attn_norm.data_ptr<float>(), a.ffn_norm = ffn_norm.data_ptr<float>();
  a.nseg = (int64_t)nseg, a.starts = starts.data(), a.lens = lens.data();
  a.kc = kp.data(), a.vc = vp.data(), a.ks0 = ks0.data(), a.vs0 = vs0.data();
  // share: per sequence (source sequence, rows) or empty; rows a source holds as well, below both sequences' starts
  // (this pass writes neither's rows there)
  std::vector<int64_t> share_src, share_rows;
  if (!share.empty()) {
    TORCH_CHECK_VALUE(share.size() == 2 * nseg, "decoder_block: share needs (source, rows) per sequence");
    share_src.resize(nseg), share_rows.resize(nseg);
    for (size_t s = 0; s < nseg; ++s) {
      const int64_t j = share[2 * s], m = share[2 * s + 1];
      const bool none = j < 0 || m <= 0;
      TORCH_CHECK_VALUE(none || (j < (int64_t)nseg && m <= starts[s] && m <= starts[(size_t)j] &&
                                 kcs[(size_t)j].sizes() == kcs[s].sizes() && ks0[(size_t)j] == ks0[s] &&
                                 vs0[(size_t)j] == vs0[s]),
                        "decoder_block: sequence ", s, " cannot share ", m, " rows with sequence ", j);
      share_src[s] = none ? -1 : j;
      share_rows[s] = none ? 0 : m;
    }
    a.share_src = share_src.data(), a.share_rows = share_rows.data();
  }
  a.cos = cos.data_ptr<float>(), a.sin = sin.data_ptr<float>();
  a.nthreads = at::get_num_threads();
  a.x8 = act_bits == 8;
  std::vector<int64_t> toff;
  if (tree_keys.has_value() && tree_keys->defined()) {
    TORCH_CHECK_VALUE(nseg == 1, "decoder_block: a token tree is one sequence");
    toff = tree_offsets(*tree_keys, *tree_extra, T, kcs[0].size(1), hd);
    a.tree_keys = tree_keys->data_ptr<int64_t>(), a.tree_extra = tree_extra->data_ptr<int32_t>();
    a.tree_off = toff.data();
  }
  torch::Tensor out;
  a.part = (int)part;
  if (part != 0) {  // this rank's partial sum of wo's (1) or down's (2) output; x itself is left as it was
    out = torch::empty({T, d}, x.options());
    a.out = out.data_ptr<float>();
  }
  TORCH_CHECK(decoder_layer(a), "decoder_block: out of memory");
  return part == 0 ? x : out;
}

torch::Tensor private_rows(const torch::Tensor& x_in) {
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32 && x_in.device().is_cpu(),
                    "decoder_block: x must be fp32 [T, d] on the CPU");
  return x_in.contiguous().clone();
}

void check_mode(int64_t act_bits, int64_t part) {
  TORCH_CHECK_VALUE(act_bits == 16 || act_bits == 8, "decoder_block: act_bits must be 16 or 8, got ", act_bits);
  TORCH_CHECK_VALUE(part >= 0 && part <= 2, "decoder_block: part must be 0 (the layer), 1 (attention) or 2 (ffn)");
}

torch::Tensor decoder_block(const torch::Tensor& x_in, const std::vector<int64_t>& starts,
                            const std::vector<int64_t>& lens, const torch::Tensor& attn_norm,
                            const torch::Tensor& ffn_norm, double eps, const std::vector<torch::Tensor>& w,
                            const std::vector<int64_t>& qt, const std::vector<torch::Tensor>& bias,
                            const std::vector<torch::Tensor>& kcs, const std::vector<torch::Tensor>& vcs,
                            const torch::Tensor& cos, const torch::Tensor& sin, int64_t n_heads, int64_t n_kv_heads,
                            int64_t hd, double scale, int64_t act_bits, const c10::optional<torch::Tensor>& tree_keys,
                            const c10::optional<torch::Tensor>& tree_extra, int64_t part,
                            const std::vector<int64_t>& share) {
  check_mode(act_bits, part);
  torch::Tensor x = private_rows(x_in);
  return layer_on(x, starts, lens, attn_norm, ffn_norm, eps, w, qt, bias, kcs, vcs, cos, sin, n_heads, n_kv_heads, hd,
                  scale, act_bits, tree_keys, tree_extra, part, share);
}

// Several decoder layers in one call, in the order given (a model's, or a subset of it): what decoder_block does
// for each, on one private copy of x, without a Python->C++ crossing per layer. The per-layer arguments come as
// flat lists, layer l's at: norms [l], w and qt [7l, 7l + 7), bias [3l, 3l + 3) (or none at all), caches
// [l * nseg, (l + 1) * nseg). keep: positions in that order after which x is also returned (a copy), for the
// readers of hidden states. Returns x after the last layer and the kept copies.
std::tuple<torch::Tensor, std::vector<torch::Tensor>> decoder_stack(
    const torch::Tensor& x_in, const std::vector<int64_t>& starts, const std::vector<int64_t>& lens,
    const std::vector<torch::Tensor>& attn_norms, const std::vector<torch::Tensor>& ffn_norms, double eps,
    const std::vector<torch::Tensor>& w, const std::vector<int64_t>& qt, const std::vector<torch::Tensor>& bias,
    const std::vector<torch::Tensor>& kcs, const std::vector<torch::Tensor>& vcs, const torch::Tensor& cos,
    const torch::Tensor& sin, int64_t n_heads, int64_t n_kv_heads, int64_t hd, double scale, int64_t act_bits,
    const c10::optional<torch::Tensor>& tree_keys, const c10::optional<torch::Tensor>& tree_extra,
    const std::vector<int64_t>& keep, const std::vector<int64_t>& share) {
  check_mode(act_bits, 0);
  const size_t L = attn_norms.size(), nseg = starts.size();
  TORCH_CHECK_VALUE(L >= 1 && ffn_norms.size() == L && w.size() == 7 * L && qt.size() == 7 * L &&
                        (bias.empty() || bias.size() == 3 * L) && nseg >= 1 && kcs.size() == L * nseg &&
                        vcs.size() == L * nseg,
                    "decoder_stack: per layer two norms, 7 linears, 0 or 3 biases and a k and v cache per sequence");
  std::vector<bool> kept_after(L, false);
  for (int64_t i : keep) {
    TORCH_CHECK_VALUE(i >= 0 && i < (int64_t)L, "decoder_stack: keep position ", i, " is not one of the ", L,
                      " layers");
    kept_after[(size_t)i] = true;
  }
  torch::Tensor x = private_rows(x_in);
  std::vector<torch::Tensor> kept;
  const at::TensorList W(w), B(bias), KC(kcs), VC(vcs);
  const at::IntArrayRef Q(qt);
  for (size_t l = 0; l < L; ++l) {
    layer_on(x, starts, lens, attn_norms[l], ffn_norms[l], eps, W.slice(7 * l, 7), Q.slice(7 * l, 7),
             bias.empty() ? B : B.slice(3 * l, 3), KC.slice(l * nseg, nseg), VC.slice(l * nseg, nseg), cos, sin,
             n_heads, n_kv_heads, hd, scale, act_bits, tree_keys, tree_extra, 0, share);
    if (kept_after[l]) kept.push_back(x.clone());
  }
  return {x, kept};
}

// 12 * iters * threads units per second when `threads` threads each run `chains(iters)` together, the best of
// `reps` runs (the loops keep their sums, so the work cannot be dropped).
template <class F>
double best_rate(int64_t threads, int64_t iters, int64_t reps, F chains) {
  double best = 0.0;
  std::atomic<int64_t> sink{0};
  for (int64_t r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads((int)threads)
    sink += chains(iters);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 12.0 * (double)iters * (double)threads / dt);
  }
  return best;
}

// vpdpbusd instructions per second that `threads` threads sustain together (best of `reps` runs of `iters`
// iterations of 12 independent chains each): the multiply limit of the VNNI kernels. 0 without VNNI.
double vnni_multiply_peak(int64_t threads, int64_t iters, int64_t reps) {
  TORCH_CHECK_VALUE(threads >= 1 && iters >= 1 && reps >= 1, "vnni_multiply_peak: threads, iters and reps must be >= 1");
  if (!(avx512_usable() && vnni_usable())) return 0.0;
  return best_rate(threads, iters, reps, [](int64_t n) { return vnni_dpbusd_chains(n); });
}

// Products per second of `chains(n, x8)` (`per_loop` products a loop) on `threads` threads, best of `reps` runs of
// `iters` loops: vnni_product_peak's and vnni_paired_peak's measurement. 0 without VNNI.
template <class F>
double group_peak(const char* name, int64_t threads, int64_t iters, int64_t reps, int64_t act_bits, double per_loop,
                  F chains) {
  TORCH_CHECK_VALUE(threads >= 1 && iters >= 1 && reps >= 1, name, ": threads, iters and reps must be >= 1");
  TORCH_CHECK_VALUE(act_bits == 16 || act_bits == 8, name, ": act_bits must be 16 or 8");
  if (!(avx512_usable() && vnni_usable())) return 0.0;
  const bool x8 = act_bits == 8;
  return per_loop * best_rate(threads, iters, reps, [x8, chains](int64_t n) { return chains(n, x8); });
}

// 128-value products per second that `threads` threads sustain together with the kernels' arithmetic (loops of 12
// independent K-quant groups of two products each; see vnni_product_chains). 0 without VNNI.
double vnni_product_peak(int64_t threads, int64_t iters, int64_t reps, int64_t act_bits) {
  return group_peak("vnni_product_peak", threads, iters, reps, act_bits, 2.0, vnni_product_chains);
}

// 512-value products per second with the arithmetic of the layouts of eight weight vectors a row (Q4_K in pairs:
// 8 vpdpbusd, then convert, scale multiply, fma and the mins' fnmadd; see vnni_paired_chains). 0 without VNNI.
double vnni_paired_peak(int64_t threads, int64_t iters, int64_t reps, int64_t act_bits) {
  return group_peak("vnni_paired_peak", threads, iters, reps, act_bits, 1.0, vnni_paired_chains);
}

// vpdpbusd slots one fp32 FMA takes beside them on `threads` threads (best of `reps` runs of `iters` loops each with
// and without 6 FMAs per 12 vpdpbusd; see vnni_fma_beside): ~1 where the FMAs share the multiply pipes, ~0 where
// not. 0 without VNNI.
double vnni_fma_cost(int64_t threads, int64_t iters, int64_t reps) {
  TORCH_CHECK_VALUE(threads >= 1 && iters >= 1 && reps >= 1, "vnni_fma_cost: threads, iters and reps must be >= 1");
  if (!(avx512_usable() && vnni_usable())) return 0.0;
  const double bare = best_rate(threads, iters, reps, [](int64_t n) { return vnni_fma_beside(n, false); });
  const double with = best_rate(threads, iters, reps, [](int64_t n) { return vnni_fma_beside(n, true); });
  return std::max(0.0, (bare / with - 1.0) * 12.0 / 6.0);
}

// vpdpbusd slots one 64-byte load (a vpdpbusd's x operand from L1) takes beside them on `threads` threads (best of
// `reps` runs of `iters` loops of 12 vpdpbusd, their x operands in registers and then each from memory; see
// vnni_load_beside): 0.35-0.48 on the Intel Xeon, ~0 where loads do not bind. 0 without VNNI.
double vnni_load_cost(int64_t threads, int64_t iters, int64_t reps) {
  TORCH_CHECK_VALUE(threads >= 1 && iters >= 1 && reps >= 1, "vnni_load_cost: threads, iters and reps must be >= 1");
  if (!(avx512_usable() && vnni_usable())) return 0.0;
  const double bare = best_rate(threads, iters, reps, [](int64_t n) { return vnni_load_beside(n, false); });
  const double with = best_rate(threads, iters, reps, [](int64_t n) { return vnni_load_beside(n, true); });
  return std::max(0.0, bare / with - 1.0);
}

// 8-lane fp32 FMA instructions per second that `threads` threads sustain together (best of `reps` runs of `iters`
// iterations of 12 independent chains each): the multiply limit of the AVX2 fp32 kernels. 0 without AVX2.
double avx2_fma_peak(int64_t threads, int64_t iters, int64_t reps) {
  TORCH_CHECK_VALUE(threads >= 1 && iters >= 1 && reps >= 1, "avx2_fma_peak: threads, iters and reps must be >= 1");
  if (!avx2_usable()) return 0.0;
  return best_rate(threads, iters, reps, [](int64_t n) { return avx2_fma_chains(n); });
}

double avx2_madd_peak(int64_t threads, int64_t iters, int64_t reps) {
  TORCH_CHECK_VALUE(threads >= 1 && iters >= 1 && reps >= 1, "avx2_madd_peak: threads, iters and reps must be >= 1");
  if (!avx2_usable()) return 0.0;
  return best_rate(threads, iters, reps, [](int64_t n) { return avx2_madd_chains(n); });
}

// Rows of qtype laid out for the VNNI kernels (qmm_repack_vnni, type vnni_layout(qtype)): into `out` (uint8, w's shape,
// contiguous, not overlapping w) when given, else a new tensor of the same shape; returns it.
torch::Tensor repack_vnni(const torch::Tensor& w, int64_t qtype, int64_t in_features,
                          const std::optional<torch::Tensor>& out_opt) {
  TypeInfo ti;
  TORCH_CHECK_VALUE(vnni_layout((int)qtype) > 0 && type_info((int)qtype, &ti), "repack_vnni: type ", qtype,
                    " has no layout of the VNNI kernels (the quantized types have)");
  TORCH_CHECK_VALUE(w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.device().is_cpu(),
                    "repack_vnni: w must be uint8 [rows, row_bytes] on the CPU");
  TORCH_CHECK_VALUE(in_features > 0 && in_features % ti.block == 0 && w.size(1) == in_features / ti.block * ti.bytes,
                    "repack_vnni: w has ", w.size(1), " bytes per row; ", in_features, " ", ti.name, " values take ",
                    in_features / ti.block * ti.bytes, " (in_features a multiple of ", ti.block, ")");
  const torch::Tensor src = w.contiguous();
  torch::Tensor out;
  if (out_opt.has_value()) {
    out = *out_opt;
    TORCH_CHECK_VALUE(out.scalar_type() == torch::kUInt8 && out.device().is_cpu() && out.is_contiguous() &&
                          out.sizes() == src.sizes(),
                      "repack_vnni: out must be a contiguous uint8 CPU tensor of w's shape ", src.sizes());
    const uintptr_t a = (uintptr_t)out.data_ptr(), b = (uintptr_t)src.data_ptr(), n = (uintptr_t)src.numel();
    TORCH_CHECK_VALUE(n == 0 || a + n <= b || b + n <= a, "repack_vnni: out must not overlap w");
  } else {
    out = torch::empty_like(src);
  }
  const int64_t rows = src.size(0), rb = src.size(1);
  const uint8_t* sp = src.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    qmm_repack_vnni((int)qtype, sp + r0 * rb, op + r0 * rb, r1 - r0, in_features);
  });
  return out;
}

}  // namespace
}  // namespace ultrafast

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ultrafast batch-invariant packed-weight CPU kernels";
  ultrafast::register_sampling(m);
  // The compute entry points release the GIL (they touch no Python objects), so other Python threads,
  // e.g. a server's I/O, keep running during a forward pass.
  m.def("qmatmul", &ultrafast::qmatmul, "y = x @ dequant(w).T for raw GGUF weight rows", py::arg("x"), py::arg("w"),
        py::arg("qtype"), py::arg("in_features"), py::arg("act_bits") = 16, py::call_guard<py::gil_scoped_release>());
  m.def("repack_vnni", &ultrafast::repack_vnni, "rows in the VNNI kernels' layout of their type (into out if given)",
        py::arg("w"), py::arg("qtype"), py::arg("in_features"), py::arg("out") = py::none());
  m.def("vnni_layout", [](int64_t qtype) { return ultrafast::vnni_layout((int)qtype); },
        "the type id of the VNNI kernels' layout of qtype, -1 if none", py::arg("qtype"));
  m.def("rmsnorm", &ultrafast::rmsnorm, "row-wise RMSNorm", py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &ultrafast::silu_mul, "silu(gate) * up, elementwise (the decoder layer's op)", py::arg("gate"),
        py::arg("up"), py::call_guard<py::gil_scoped_release>());
  m.def("attention", &ultrafast::attention, "causal GQA attention over a KV cache", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("start_pos"), py::arg("scale"), py::arg("tree_keys") = py::none(),
        py::arg("tree_extra") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("decoder_block", &ultrafast::decoder_block, "one decoder layer in one call", py::arg("x"),
        py::arg("starts"), py::arg("lens"), py::arg("attn_norm"), py::arg("ffn_norm"), py::arg("eps"), py::arg("w"),
        py::arg("qt"), py::arg("bias"), py::arg("k_caches"), py::arg("v_caches"), py::arg("cos"), py::arg("sin"),
        py::arg("n_heads"),
        py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("scale"), py::arg("act_bits") = 16,
        py::arg("tree_keys") = py::none(), py::arg("tree_extra") = py::none(), py::arg("part") = 0,
        py::arg("share") = std::vector<int64_t>{}, py::call_guard<py::gil_scoped_release>());
  m.def("decoder_stack", &ultrafast::decoder_stack, "several decoder layers in one call", py::arg("x"),
        py::arg("starts"), py::arg("lens"), py::arg("attn_norms"), py::arg("ffn_norms"), py::arg("eps"), py::arg("w"),
        py::arg("qt"), py::arg("bias"), py::arg("k_caches"), py::arg("v_caches"), py::arg("cos"), py::arg("sin"),
        py::arg("n_heads"), py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("scale"), py::arg("act_bits"),
        py::arg("tree_keys"), py::arg("tree_extra"), py::arg("keep"), py::arg("share") = std::vector<int64_t>{},
        py::call_guard<py::gil_scoped_release>());
  m.def("avx512_supported", &ultrafast::avx512_usable, "whether this CPU can run the AVX-512 path");
  m.def("avx512_active", &ultrafast::avx512_in_use, "whether the AVX-512 path is in use");
  m.def("set_force_scalar", &ultrafast::force_scalar, "force the portable scalar path (testing)");
  m.def("vnni_supported", []() { return ultrafast::avx512_usable() && ultrafast::vnni_usable(); },
        "whether this CPU can run the AVX512-VNNI integer path");
  m.def("avx2_supported", &ultrafast::avx2_usable, "whether this CPU can run the AVX2 path");
  m.def("linear_path", [](int64_t qtype, int64_t act_bits) {
          const ultrafast::LinearOps* ops = ultrafast::linear_ops((int)qtype, act_bits == 8);
          return std::string(ops != nullptr ? ops->name : "");
        }, "the kernels a linear of this type and activation width runs on now ('' where none does)",
        py::arg("qtype"), py::arg("act_bits"));
  m.def("layout_in_use", [](int64_t qtype, int64_t act_bits) { return ultrafast::layout_in_use((int)qtype, act_bits == 8); },
        "the type id of the layout made at load (repack_vnni) that the kernels in force read for a linear of this type and "
        "activation width, -1 where they read the file's bytes", py::arg("qtype"), py::arg("act_bits"));
  m.def("path_in_use", []() { return std::string(ultrafast::path_in_use()); },
        "vnni-int16, avx512-fp32, avx2-fp32 or scalar");
  m.def("set_kernels_path", &ultrafast::set_kernels_path, "auto, vnni (= auto), fp32, avx2, avx2-fp32 or scalar; process-wide");
  m.def("vnni_multiply_peak", &ultrafast::vnni_multiply_peak, "vpdpbusd per second on `threads` threads (0: no VNNI)",
        py::arg("threads"), py::arg("iters") = 10000000, py::arg("reps") = 3, py::call_guard<py::gil_scoped_release>());
  m.def("avx2_fma_peak", &ultrafast::avx2_fma_peak, "8-lane FMA per second on `threads` threads (0: no AVX2)",
        py::arg("threads"), py::arg("iters") = 10000000, py::arg("reps") = 3, py::call_guard<py::gil_scoped_release>());
  m.def("avx2_madd_peak", &ultrafast::avx2_madd_peak,
        "vpmaddubsw per second (summed by vpaddw, a vpmaddwd per 8) on `threads` threads (0: no AVX2)", py::arg("threads"),
        py::arg("iters") = 10000000, py::arg("reps") = 3, py::call_guard<py::gil_scoped_release>());
  m.def("vnni_product_peak", &ultrafast::vnni_product_peak,
        "128-value products per second with the kernels' arithmetic on `threads` threads (0: no VNNI)",
        py::arg("threads"), py::arg("iters"), py::arg("reps"), py::arg("act_bits"), py::call_guard<py::gil_scoped_release>());
  m.def("vnni_paired_peak", &ultrafast::vnni_paired_peak,
        "512-value products per second with the paired layouts' arithmetic on `threads` threads (0: no VNNI)",
        py::arg("threads"), py::arg("iters"), py::arg("reps"), py::arg("act_bits"), py::call_guard<py::gil_scoped_release>());
  m.def("vnni_fma_cost", &ultrafast::vnni_fma_cost,
        "vpdpbusd slots one fp32 FMA takes beside them on `threads` threads (0: no VNNI)", py::arg("threads"),
        py::arg("iters"), py::arg("reps"), py::call_guard<py::gil_scoped_release>());
  m.def("vnni_load_cost", &ultrafast::vnni_load_cost,
        "vpdpbusd slots one 64-byte load from L1 takes beside them on `threads` threads (0: no VNNI)", py::arg("threads"),
        py::arg("iters"), py::arg("reps"), py::call_guard<py::gil_scoped_release>());
  m.def("block_info", [](int64_t qtype) {
    ultrafast::TypeInfo ti;
    TORCH_CHECK_VALUE(ultrafast::type_info((int)qtype, &ti), "unsupported GGML type id ", qtype);
    return std::make_tuple((int64_t)ti.block, (int64_t)ti.bytes);
  });
}
