// ultrafast packed-weight kernels: torch bindings, input checks, threading, and the portable scalar
// fallback. Compiled for the baseline ISA; the AVX-512 fp32 path lives in qmatmul_avx512.cpp and the
// AVX512-VNNI integer path (int16 activations, quantized types) in qmatmul_vnni.cpp, chosen at runtime.
//
// Batch invariance contract (both paths): each output element is computed by exactly one thread with a
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
#include <string>
#include <vector>

#include "decoder_layer.h"
#include "qmatmul_kernels.h"
#include "scratch.h"

namespace ultrafast {
namespace {

std::atomic<bool> g_force_scalar{false};
std::atomic<bool> g_force_fp32{false};  // keep the quantized types on the AVX-512 fp32 path

bool use_avx512() {
  static const bool ok = avx512_usable();
  return ok && !g_force_scalar.load(std::memory_order_relaxed);
}

// AVX512-VNNI integer path (qmatmul_vnni.cpp), for the quantized types it supports.
bool vnni_on() {
  static const bool ok = avx512_usable() && vnni_usable();
  return ok && !g_force_scalar.load(std::memory_order_relaxed) && !g_force_fp32.load(std::memory_order_relaxed);
}

std::string path_in_use() { return vnni_on() ? "vnni-int16" : (use_avx512() ? "avx512-fp32" : "scalar"); }

void set_kernels_path(const std::string& p) {
  TORCH_CHECK_VALUE(p == "auto" || p == "vnni" || p == "fp32" || p == "scalar",
                    "kernels path must be auto, vnni, fp32 or scalar, got '", p, "'");
  g_force_scalar.store(p == "scalar");
  g_force_fp32.store(p == "fp32");
}

struct TypeInfo {
  int block;  // values per block
  int bytes;  // bytes per block
  const char* name;
};

bool type_info(int qtype, TypeInfo* ti) {
  switch (qtype) {
    case QT_F32: *ti = {1, 4, "F32"}; return true;
    case QT_F16: *ti = {1, 2, "F16"}; return true;
    case QT_BF16: *ti = {1, 2, "BF16"}; return true;
    case QT_Q4_0: *ti = {32, 18, "Q4_0"}; return true;
    case QT_Q4_1: *ti = {32, 20, "Q4_1"}; return true;
    case QT_Q5_0: *ti = {32, 22, "Q5_0"}; return true;
    case QT_Q8_0: *ti = {32, 34, "Q8_0"}; return true;
    case QT_Q4_K: *ti = {256, 144, "Q4_K"}; return true;
    case QT_Q6_K: *ti = {256, 210, "Q6_K"}; return true;
    default: return false;
  }
}

// ---------------------------------------------------------------------------------------------------
// Scalar fallback. Dequantizes a block exactly as gguf/ggml does, then accumulates into 16 lane sums per
// (weight row, activation row) in a fixed order, reduced by a fixed tree.

// Exact IEEE half -> float without branches or F16C (subnormal halves are em * 2^-24, exact in fp32).
inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7FFFu;
  const uint32_t normal = (em << 13) + 0x38000000u;            // rebias exponent 15 -> 127
  const uint32_t infnan = 0x7F800000u | ((em & 0x3FFu) << 13);
  float sub = (float)em * 5.9604644775390625e-8f;              // 2^-24
  uint32_t subbits;
  std::memcpy(&subbits, &sub, 4);
  const uint32_t bits = sign | (em >= 0x7C00u ? infnan : (em >= 0x0400u ? normal : subbits));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float rd_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_fp32(h);
}

inline float bf16_to_fp32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Dequantize one block (quantized types) into out[0..B), exactly as ggml.
#define UF_ALWAYS_INLINE inline __attribute__((always_inline))
UF_ALWAYS_INLINE void dequant_block(int qtype, const uint8_t* __restrict p, float* __restrict out) {
  switch (qtype) {
    case QT_Q4_0: {
      const float d = rd_f16(p);
      for (int j = 0; j < 16; ++j) {
        out[j] = d * (float)((int)(p[2 + j] & 0xF) - 8);
        out[j + 16] = d * (float)((int)(p[2 + j] >> 4) - 8);
      }
      break;
    }
    case QT_Q4_1: {
      const float d = rd_f16(p), m = rd_f16(p + 2);
      for (int j = 0; j < 16; ++j) {
        out[j] = d * (float)(p[4 + j] & 0xF) + m;
        out[j + 16] = d * (float)(p[4 + j] >> 4) + m;
      }
      break;
    }
    case QT_Q5_0: {
      const float d = rd_f16(p);
      uint32_t qh;
      std::memcpy(&qh, p + 2, 4);
      for (int j = 0; j < 16; ++j) {
        const int lo = (p[6 + j] & 0xF) | (int)(((qh >> j) & 1u) << 4);
        const int hi = (p[6 + j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
        out[j] = d * (float)(lo - 16);
        out[j + 16] = d * (float)(hi - 16);
      }
      break;
    }
    case QT_Q8_0: {
      const float d = rd_f16(p);
      for (int j = 0; j < 32; ++j) out[j] = (float)(int8_t)p[2 + j] * d;
      break;
    }
    case QT_Q4_K: {
      const float d = rd_f16(p), dmin = rd_f16(p + 2);
      const uint8_t* s = p + 4;
      const uint8_t* qs = p + 16;
      for (int g = 0; g < 4; ++g) {
        for (int h = 0; h < 2; ++h) {
          const int j = 2 * g + h;  // sub-block: 6-bit scale and min (ggml get_scale_min_k4)
          int sc, m;
          if (j < 4) {
            sc = s[j] & 63;
            m = s[j + 4] & 63;
          } else {
            sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
            m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
          }
          const float d1 = d * (float)sc, m1 = dmin * (float)m;
          float* o = out + 64 * g + 32 * h;
          const uint8_t* q = qs + 32 * g;
          if (h == 0)
            for (int l = 0; l < 32; ++l) o[l] = d1 * (float)(q[l] & 0xF) - m1;
          else
            for (int l = 0; l < 32; ++l) o[l] = d1 * (float)(q[l] >> 4) - m1;
        }
      }
      break;
    }
    case QT_Q6_K: {
      alignas(64) int8_t q[256];
      const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
      const float d = rd_f16(p + 208);
      for (int h = 0; h < 2; ++h) {  // value 128h + 32t + l
        const uint8_t* ql = p + 64 * h;
        const uint8_t* qh = p + 128 + 32 * h;
        int8_t* o = q + 128 * h;
        for (int l = 0; l < 32; ++l) {
          o[l] = (int8_t)(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
          o[l + 32] = (int8_t)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
          o[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
          o[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
      }
      for (int g = 0; g < 16; ++g) {
        const float ds = d * (float)sc[g];
        for (int l = 0; l < 16; ++l) out[16 * g + l] = ds * (float)q[16 * g + l];
      }
      break;
    }
    default: break;
  }
}

inline float lane_sum16(const float* a) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// Portable path: decode a block of the weight row once, then for each activation row accumulate into 16
// lane sums (value i of the row goes to lane i % 16) with separate multiply and add. Lane-wise loops the
// compiler vectorizes without changing any per-lane operation; on x86-64 Linux an AVX2 clone is picked
// at load time (same operations, so the same bits as the baseline clone).
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define UF_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define UF_CLONES
#endif
UF_CLONES void qmm_rows_scalar(int qtype, const float* x, int64_t k, int64_t K, const uint8_t* w, int64_t rb,
                               float* y, int64_t ldy, int64_t n0, int64_t n1) {
  TypeInfo ti;
  type_info(qtype, &ti);
  const bool flt = ti.block == 1;
  const int B = flt ? 32 : ti.block;
  std::vector<float> acc((size_t)k * 16);
  alignas(64) float wf[256];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * rb;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b0 = 0; b0 < K; b0 += B) {
      const int cnt = (int)std::min<int64_t>(B, K - b0);
      if (flt) {
        if (qtype == QT_F32) {
          std::memcpy(wf, wr + 4 * b0, 4 * (size_t)cnt);
        } else if (qtype == QT_F16) {
          for (int i = 0; i < cnt; ++i) wf[i] = rd_f16(wr + 2 * (b0 + i));
        } else {
          for (int i = 0; i < cnt; ++i) wf[i] = bf16_to_fp32(wr + 2 * (b0 + i));
        }
      } else {
        dequant_block(qtype, wr + (b0 / B) * ti.bytes, wf);
      }
      const int full = cnt & ~15;
      for (int64_t r = 0; r < k; ++r) {
        float* a = acc.data() + r * 16;
        const float* xr = x + r * K + b0;
        for (int i0 = 0; i0 < full; i0 += 16)
          for (int l = 0; l < 16; ++l) a[l] = a[l] + wf[i0 + l] * xr[i0 + l];
        for (int i = full; i < cnt; ++i) a[i & 15] = a[i & 15] + wf[i] * xr[i];
      }
    }
    for (int64_t r = 0; r < k; ++r) y[r * ldy + n] = lane_sum16(acc.data() + r * 16);
  }
}

void attn_one_scalar(const float* q, const float* kc, const float* vc, int64_t L, int64_t hd, float scale,
                     float* scores, float* out) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < L; ++j) {
    const float* kj = kc + j * hd;
    float a[16] = {0};
    for (int64_t d = 0; d < hd; ++d) a[d & 15] = a[d & 15] + q[d] * kj[d];
    const float s = lane_sum16(a) * scale;
    scores[j] = s;
    mx = std::max(mx, s);
  }
  float sum[16] = {0};
  for (int64_t j = 0; j < L; ++j) {
    const float e = std::exp(scores[j] - mx);
    scores[j] = e;
    sum[j & 15] = sum[j & 15] + e;
  }
  const float inv = 1.0f / lane_sum16(sum);
  for (int64_t d = 0; d < hd; ++d) out[d] = 0.0f;
  for (int64_t j = 0; j < L; ++j) {
    const float p = scores[j];
    const float* vj = vc + j * hd;
    for (int64_t d = 0; d < hd; ++d) out[d] = out[d] + p * vj[d];
  }
  for (int64_t d = 0; d < hd; ++d) out[d] = out[d] * inv;
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

  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t CH = 16;
  const int64_t nch = (N + CH - 1) / CH;
  const bool vnni = qmm_vnni_supports((int)qtype) && vnni_on();
  // int8 activations exist only on the VNNI path; float-typed weights (F32/F16/BF16) are always fp32 products
  TORCH_CHECK_VALUE(act_bits == 16 || vnni || !qmm_vnni_supports((int)qtype),
                    "qmatmul: int8 activations need the AVX512-VNNI kernels (path in use: ", path_in_use(), ")");
  const bool x8 = act_bits == 8;
  if (vnni) {
    // int16 (x8: int8) activations + exact integer dot products (qmatmul_vnni.cpp); prep per row (batch-invariant)
    static thread_local Scratch scratch_v;
    const int64_t xb = qmm_prep_bytes_vnni((int)qtype, K);
    uint8_t* xg = scratch_bytes(scratch_v, (size_t)(k * xb + 64));
    at::parallel_for(0, k, std::max<int64_t>(1, 16384 / K), [&](int64_t r0, int64_t r1) {
      qmm_prep_vnni((int)qtype, xp + r0 * K, r1 - r0, K, xg + r0 * xb, x8);
    });
    const int64_t grain =
        std::max<int64_t>(1, (48 * 1024) / std::max<int64_t>(1, CH * row_bytes * std::max<int64_t>(1, k / 4)));
    at::parallel_for(0, nch, grain, [&](int64_t c0, int64_t c1) {
      TORCH_CHECK(qmm_rows_vnni((int)qtype, xg, k, K, wp, rb, yp, N, c0 * CH, std::min(N, c1 * CH), x8),
                  "qmatmul: out of memory");
    });
    return y;
  }
  const bool avx = use_avx512();
  // AVX-512 path: permute/scale x once into the weights' lane order (per row, so batch-invariant), in
  // 64-byte aligned scratch (the kernel's full-vector loads of x' rely on that for speed).
  float* xprep = nullptr;
  float* xsums = nullptr;
  if (avx) {
    static thread_local Scratch scratch;
    int64_t nx = 0, ns = 0;
    qmm_prep_sizes_avx512((int)qtype, K, &nx, &ns);
    const int64_t off = (k * nx + 15) / 16 * 16;
    xprep = reinterpret_cast<float*>(scratch_bytes(scratch, sizeof(float) * (size_t)(off + k * ns + 16)));
    xsums = xprep + off;
    at::parallel_for(0, k, std::max<int64_t>(1, 65536 / K), [&](int64_t r0, int64_t r1) {
      qmm_prep_avx512((int)qtype, xp + r0 * K, r1 - r0, K, xprep + r0 * nx, xsums + r0 * ns);
    });
  }
  // Tasks are chunks of 16 weight rows (the kernel's row group); aim for >= ~48 KiB of weight bytes per
  // task so small matrices do not pay for waking threads. Thread splits never change results.
  const int64_t grain =
      std::max<int64_t>(1, (48 * 1024) / std::max<int64_t>(1, CH * row_bytes * std::max<int64_t>(1, k / 2)));
  at::parallel_for(0, nch, grain, [&](int64_t c0, int64_t c1) {
    const int64_t n0 = c0 * CH, n1 = std::min(N, c1 * CH);
    if (avx) {
      TORCH_CHECK(qmm_rows_avx512((int)qtype, xprep, xsums, k, K, wp, rb, yp, N, n0, n1), "qmatmul: out of memory");
    } else {
      qmm_rows_scalar((int)qtype, xp, k, K, wp, rb, yp, N, n0, n1);
    }
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
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * d;
      float* yr = yp + r * d;
      float a[16] = {0};
      for (int64_t i = 0; i < d; ++i) a[i & 15] = a[i & 15] + xr[i] * xr[i];
      const float mean = lane_sum16(a) / (float)d;
      const float inv = 1.0f / std::sqrt(mean + feps);
      for (int64_t i = 0; i < d; ++i) yr[i] = (xr[i] * inv) * wp[i];
    }
  });
  return y;
}

torch::Tensor attention(const torch::Tensor& q_in, const torch::Tensor& kc, const torch::Tensor& vc, int64_t start_pos,
                        double scale) {
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
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = kc.stride(0), vs0 = vc.stride(0);
  const int64_t group = H / Hkv;
  const float fscale = (float)scale;
  const bool avx = use_avx512() && hd % 16 == 0;
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
      const int64_t L = start_pos + i + 1;
      const float* qi = qp + (i * H + h0) * hd;
      float* oi = op + (i * H + h0) * hd;
      if (avx) {
        attn_group_avx512(qi, (int)hn, kp + kvh * ks0, vp + kvh * vs0, L, hd, fscale, scores.data(), lds, oi);
      } else {
        for (int64_t h = 0; h < hn; ++h)
          attn_one_scalar(qi + h * hd, kp + kvh * ks0, vp + kvh * vs0, L, hd, fscale, scores.data(), oi + h * hd);
      }
    }
  });
  return out;
}


// ---------------------------------------------------------------------------------------------------
// One whole decoder layer (pre-norm attention + SwiGLU feed-forward) for T rows, in a single call, so a
// decode step costs one Python->C++ crossing per layer instead of ~20 small torch ops. The T rows may belong
// to several sequences (segments of `lens` rows at positions starts[s].., each with its own KV cache): the
// linears then read every weight once for all of them (continuous batching), attention runs per sequence.
// Every stage is a
// per-row computation whose arithmetic does not depend on T (the kernels above, and plain per-row loops
// for bias, RoPE, the cache write, SiLU*up and the residual adds), so the layer stays batch-invariant.
// Linears in `w`: wq, wk, wv, wo, w1 (gate), w3 (up), w2 (down); `bias` holds bq, bk, bv or is empty.
torch::Tensor decoder_block(const torch::Tensor& x_in, const std::vector<int64_t>& starts,
                            const std::vector<int64_t>& lens, const torch::Tensor& attn_norm,
                            const torch::Tensor& ffn_norm, double eps, const std::vector<torch::Tensor>& w,
                            const std::vector<int64_t>& qt, const std::vector<torch::Tensor>& bias,
                            const std::vector<torch::Tensor>& kcs, const std::vector<torch::Tensor>& vcs,
                            const torch::Tensor& cos, const torch::Tensor& sin, int64_t n_heads, int64_t n_kv_heads,
                            int64_t hd, double scale, int64_t act_bits) {
  TORCH_CHECK_VALUE(act_bits == 16 || act_bits == 8, "decoder_block: act_bits must be 16 or 8, got ", act_bits);
  TORCH_CHECK_VALUE(w.size() == 7 && qt.size() == 7, "decoder_block: expected 7 linears");
  TORCH_CHECK_VALUE(bias.empty() || bias.size() == 3, "decoder_block: expected 0 or 3 biases");
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32, "decoder_block: x must be fp32 [T, d]");
  const size_t nseg = starts.size();
  TORCH_CHECK_VALUE(nseg >= 1 && lens.size() == nseg && kcs.size() == nseg && vcs.size() == nseg,
                    "decoder_block: one start, length, k cache and v cache per sequence");
  auto x = x_in.contiguous().clone();
  const int64_t T = x.size(0), d = x.size(1), nq = n_heads * hd, nkv = n_kv_heads * hd;
  int64_t total = 0;
  for (size_t s = 0; s < nseg; ++s) {
    TORCH_CHECK_VALUE(lens[s] >= 1 && starts[s] >= 0, "decoder_block: bad sequence segment");
    TORCH_CHECK_VALUE(kcs[s].size(0) == n_kv_heads && kcs[s].size(2) == hd && starts[s] + lens[s] <= kcs[s].size(1),
                      "decoder_block: cache shape mismatch or positions past its end");
    total += lens[s];
  }
  TORCH_CHECK_VALUE(total == T, "decoder_block: segment lengths must add up to the rows of x");
  TORCH_CHECK_VALUE(cos.size(0) == T && cos.size(1) == hd && sin.size(0) == T && sin.size(1) == hd &&
                        cos.is_contiguous() && sin.is_contiguous(),
                    "decoder_block: cos/sin must be contiguous [T, head_dim]");
  // The VNNI path runs the whole layer in one parallel region (decoder_layer.cpp): same per-row arithmetic,
  // one fork/join per layer instead of ~10.
  int qti[7];
  for (int i = 0; i < 7; ++i) qti[i] = (int)qt[i];
  bool team = vnni_on() && decoder_layer_team_ok(qti, hd) && attn_norm.is_contiguous() && ffn_norm.is_contiguous();
  for (size_t s = 0; s < nseg && team; ++s)
    team = kcs[s].scalar_type() == torch::kFloat32 && vcs[s].scalar_type() == torch::kFloat32 &&
           kcs[s].stride(1) == hd && vcs[s].stride(1) == hd && kcs[s].stride(2) == 1 && vcs[s].stride(2) == 1 &&
           vcs[s].sizes() == kcs[s].sizes();
  for (int i = 0; i < 7 && team; ++i) {
    TypeInfo ti;
    team = type_info(qti[i], &ti) && w[i].scalar_type() == torch::kUInt8 && w[i].dim() == 2 &&
           (w[i].size(0) <= 1 || w[i].stride(1) == 1);
  }
  if (team) {
    const int64_t f = w[4].size(0);
    const int64_t expect_rows[7] = {nq, nkv, nkv, d, f, f, d};
    const int64_t expect_k[7] = {d, d, d, nq, d, d, f};
    LayerArgs a{};
    for (int i = 0; i < 7; ++i) {
      TypeInfo ti;
      type_info(qti[i], &ti);
      TORCH_CHECK_VALUE(w[i].size(0) == expect_rows[i] && expect_k[i] % ti.block == 0 &&
                            w[i].size(1) == expect_k[i] / ti.block * ti.bytes,
                        "decoder_block: linear ", i, " has shape ", w[i].sizes(), ", expected ", expect_rows[i],
                        " rows of ", expect_k[i], " ", ti.name, " values");
      a.w[i] = w[i].data_ptr<uint8_t>();
      a.rb[i] = w[i].size(0) > 1 ? w[i].stride(0) : w[i].size(1);
      a.qt[i] = qti[i];
    }
    std::vector<float*> kp(nseg), vp(nseg);
    std::vector<int64_t> ks0(nseg), vs0(nseg);
    for (size_t s = 0; s < nseg; ++s) {
      kp[s] = kcs[s].data_ptr<float>();
      vp[s] = vcs[s].data_ptr<float>();
      ks0[s] = kcs[s].stride(0);
      vs0[s] = vcs[s].stride(0);
    }
    a.T = T, a.d = d, a.f = f, a.n_heads = n_heads, a.n_kv_heads = n_kv_heads, a.hd = hd;
    a.eps = (float)eps, a.scale = (float)scale;
    a.x = x.data_ptr<float>();
    a.attn_norm = attn_norm.data_ptr<float>(), a.ffn_norm = ffn_norm.data_ptr<float>();
    if (!bias.empty()) {
      TORCH_CHECK_VALUE(bias[0].numel() == nq && bias[1].numel() == nkv && bias[2].numel() == nkv,
                        "decoder_block: bias sizes do not match q/k/v");
      a.bq = bias[0].data_ptr<float>(), a.bk = bias[1].data_ptr<float>(), a.bv = bias[2].data_ptr<float>();
    }
    a.nseg = (int64_t)nseg, a.starts = starts.data(), a.lens = lens.data();
    a.kc = kp.data(), a.vc = vp.data(), a.ks0 = ks0.data(), a.vs0 = vs0.data();
    a.cos = cos.data_ptr<float>(), a.sin = sin.data_ptr<float>();
    a.nthreads = at::get_num_threads();
    a.x8 = act_bits == 8;
    TORCH_CHECK(decoder_layer_team(a), "decoder_block: out of memory");
    return x;
  }
  auto h = rmsnorm(x, attn_norm, eps);
  auto q = qmatmul(h, w[0], qt[0], d, act_bits);
  auto k = qmatmul(h, w[1], qt[1], d, act_bits);
  auto v = qmatmul(h, w[2], qt[2], d, act_bits);
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  if (!bias.empty()) {
    const float* bq = bias[0].data_ptr<float>();
    const float* bk = bias[1].data_ptr<float>();
    const float* bv = bias[2].data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < nq; ++i) qp[t * nq + i] += bq[i];
      for (int64_t i = 0; i < nkv; ++i) kp[t * nkv + i] += bk[i];
      for (int64_t i = 0; i < nkv; ++i) vp[t * nkv + i] += bv[i];
    }
  }
  // RoPE, rotate-half layout: y = x*cos + rotate_half(x)*sin, rotate_half(x) = (-x[half:], x[:half])
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t half = hd / 2;
  std::vector<float> tmp((size_t)hd);
  auto rope = [&](float* row, const float* c, const float* s) {
    for (int64_t i = 0; i < hd; ++i) {
      const float rot = i < half ? -row[i + half] : row[i - half];
      tmp[i] = row[i] * c[i] + rot * s[i];
    }
    std::memcpy(row, tmp.data(), sizeof(float) * hd);
  };
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t hh = 0; hh < n_heads; ++hh) rope(qp + t * nq + hh * hd, cp + t * hd, sp + t * hd);
    for (int64_t hh = 0; hh < n_kv_heads; ++hh) rope(kp + t * nkv + hh * hd, cp + t * hd, sp + t * hd);
  }
  // per sequence: write its new keys and values into its cache rows start..start+len-1, then attend
  auto att = torch::empty({T, n_heads, hd}, q.options());
  auto qv = q.view({T, n_heads, hd});
  int64_t row = 0;
  for (size_t s = 0; s < nseg; ++s) {
    const torch::Tensor& kc = kcs[s];
    const torch::Tensor& vc = vcs[s];
    float* kcp = kc.data_ptr<float>();
    float* vcp = vc.data_ptr<float>();
    const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), vs0 = vc.stride(0), vs1 = vc.stride(1);
    for (int64_t t = row; t < row + lens[s]; ++t)
      for (int64_t hh = 0; hh < n_kv_heads; ++hh) {
        const int64_t p = starts[s] + (t - row);
        std::memcpy(kcp + hh * ks0 + p * ks1, kp + t * nkv + hh * hd, sizeof(float) * hd);
        std::memcpy(vcp + hh * vs0 + p * vs1, vp + t * nkv + hh * hd, sizeof(float) * hd);
      }
    att.narrow(0, row, lens[s]).copy_(attention(qv.narrow(0, row, lens[s]), kc, vc, starts[s], scale));
    row += lens[s];
  }
  auto o = qmatmul(att.view({T, nq}), w[3], qt[3], nq, act_bits);
  float* xp = x.data_ptr<float>();
  const float* op = o.data_ptr<float>();
  for (int64_t i = 0; i < T * d; ++i) xp[i] += op[i];
  auto h2 = rmsnorm(x, ffn_norm, eps);
  auto g = qmatmul(h2, w[4], qt[4], d, act_bits);
  auto u = qmatmul(h2, w[5], qt[5], d, act_bits);
  const int64_t f = g.size(1);
  float* gp = g.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < f; ++i) {
      const float a = gp[t * f + i];
      gp[t * f + i] = a / (1.0f + std::exp(-a)) * up[t * f + i];
    }
  auto dn = qmatmul(g, w[6], qt[6], f, act_bits);
  const float* dp = dn.data_ptr<float>();
  for (int64_t i = 0; i < T * d; ++i) xp[i] += dp[i];
  return x;
}

// vpdpbusd instructions per second that `threads` threads sustain together (best of `reps` runs of `iters`
// iterations of 12 independent chains each): the multiply limit of the VNNI kernels. 0 without VNNI.
double vnni_multiply_peak(int64_t threads, int64_t iters, int64_t reps) {
  TORCH_CHECK_VALUE(threads >= 1 && iters >= 1 && reps >= 1, "vnni_multiply_peak: threads, iters and reps must be >= 1");
  if (!(avx512_usable() && vnni_usable())) return 0.0;
  double best = 0.0;
  std::atomic<int64_t> sink{0};
  for (int64_t r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads((int)threads)
    sink += vnni_dpbusd_chains(iters);  // the sums are kept, so the work cannot be dropped
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 12.0 * (double)iters * (double)threads / dt);
  }
  return best;
}

}  // namespace
}  // namespace ultrafast

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ultrafast batch-invariant packed-weight CPU kernels";
  // The compute entry points release the GIL (they touch no Python objects), so other Python threads,
  // e.g. a server's I/O, keep running during a forward pass.
  m.def("qmatmul", &ultrafast::qmatmul, "y = x @ dequant(w).T for raw GGUF weight rows", py::arg("x"), py::arg("w"),
        py::arg("qtype"), py::arg("in_features"), py::arg("act_bits") = 16, py::call_guard<py::gil_scoped_release>());
  m.def("rmsnorm", &ultrafast::rmsnorm, "row-wise RMSNorm", py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("attention", &ultrafast::attention, "causal GQA attention over a KV cache", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("start_pos"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  m.def("decoder_block", &ultrafast::decoder_block, "one decoder layer in one call", py::arg("x"),
        py::arg("starts"), py::arg("lens"), py::arg("attn_norm"), py::arg("ffn_norm"), py::arg("eps"), py::arg("w"),
        py::arg("qt"), py::arg("bias"), py::arg("k_caches"), py::arg("v_caches"), py::arg("cos"), py::arg("sin"),
        py::arg("n_heads"),
        py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("scale"), py::arg("act_bits") = 16, py::call_guard<py::gil_scoped_release>());
  m.def("avx512_supported", &ultrafast::avx512_usable, "whether this CPU can run the AVX-512 path");
  m.def("avx512_active", &ultrafast::use_avx512, "whether the AVX-512 path is in use");
  m.def("set_force_scalar", [](bool v) { ultrafast::g_force_scalar.store(v); },
        "force the portable scalar path (testing)");
  m.def("vnni_supported", []() { return ultrafast::avx512_usable() && ultrafast::vnni_usable(); },
        "whether this CPU can run the AVX512-VNNI integer path");
  m.def("path_in_use", &ultrafast::path_in_use, "vnni-int16, avx512-fp32 or scalar");
  m.def("set_kernels_path", &ultrafast::set_kernels_path, "auto, vnni (= auto), fp32 or scalar; process-wide");
  m.def("vnni_multiply_peak", &ultrafast::vnni_multiply_peak, "vpdpbusd per second on `threads` threads (0: no VNNI)",
        py::arg("threads"), py::arg("iters") = 10000000, py::arg("reps") = 3, py::call_guard<py::gil_scoped_release>());
  m.def("block_info", [](int64_t qtype) {
    ultrafast::TypeInfo ti;
    TORCH_CHECK_VALUE(ultrafast::type_info((int)qtype, &ti), "unsupported GGML type id ", qtype);
    return std::make_tuple((int64_t)ti.block, (int64_t)ti.bytes);
  });
}
