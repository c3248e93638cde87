// The portable kernels (the "scalar" variant of kernel_variant.h): any CPU, every GGML type. A block of a
// weight row is dequantized exactly as gguf/ggml does, then each activation row accumulates into 16 lane
// sums (value i of the row into lane i % 16) with separate multiply and add, in a fixed order, reduced by a
// fixed tree (row_ops.h). Compiled for the baseline ISA; on x86-64 Linux the row loop also gets an AVX2
// clone picked at load time (the same per-lane operations, so the same bits).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "qmatmul_kernels.h"
#include "row_ops.h"

namespace ultrafast {
namespace {

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

// Portable path: decode a block of the weight row once, then for each activation row accumulate into 16
// lane sums (value i of the row goes to lane i % 16) with separate multiply and add. Lane-wise loops the
// compiler vectorizes without changing any per-lane operation; on x86-64 Linux an AVX2 clone is picked
// at load time (same operations, so the same bits as the baseline clone).
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define UF_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define UF_CLONES
#endif
UF_CLONES void qmm_rows_scalar_x(int qtype, const float* x, int64_t ldx, int64_t k, int64_t K, const uint8_t* w,
                                 int64_t rb, float* y, int64_t ldy, int64_t n0, int64_t n1) {
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
        const float* xr = x + r * ldx + b0;
        for (int i0 = 0; i0 < full; i0 += 16)
          for (int l = 0; l < 16; ++l) a[l] = a[l] + wf[i0 + l] * xr[i0 + l];
        for (int i = full; i < cnt; ++i) a[i & 15] = a[i & 15] + wf[i] * xr[i];
      }
    }
    for (int64_t r = 0; r < k; ++r) y[r * ldy + n] = lane_sum16(acc.data() + r * 16);
  }
}

void attn_one_scalar(const float* q, const float* kc, const float* vc, int64_t L, int64_t hd, float scale,
                     float* scores, float* out, int64_t P, const int32_t* extra) {
  auto row = [&](int64_t j) -> int64_t { return extra == nullptr || j < P ? j : (int64_t)extra[j - P]; };
  float mx = -INFINITY;
  for (int64_t j = 0; j < L; ++j) {
    const float* kj = kc + row(j) * hd;
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
    const float* vj = vc + row(j) * hd;
    for (int64_t d = 0; d < hd; ++d) out[d] = out[d] + p * vj[d];
  }
  for (int64_t d = 0; d < hd; ++d) out[d] = out[d] * inv;
}

}  // namespace

// A prepared row is x itself, padded to 64 bytes.
int64_t qmm_prep_bytes_scalar(int, int64_t K, bool) { return (4 * K + 63) / 64 * 64; }
int64_t qmm_prep_units_scalar(int, int64_t) { return 1; }
void qmm_prep_scalar(int, const float* x, int64_t K, uint8_t* xg, int64_t u0, int64_t u1, bool) {
  if (u0 < u1) std::memcpy(xg, x, sizeof(float) * (size_t)K);
}

bool qmm_rows_scalar(int qtype, const uint8_t* xg, int64_t k, int64_t K, const uint8_t* w, int64_t rb, float* y,
                     int64_t ldy, int64_t n0, int64_t n1, bool) {
  qmm_rows_scalar_x(qtype, reinterpret_cast<const float*>(xg), qmm_prep_bytes_scalar(qtype, K, false) / 4, k, K, w, rb, y,
                    ldy, n0, n1);
  return true;
}

void attn_group_scalar(const float* q, int G, const float* kc, const float* vc, int64_t L, int64_t hd, float scale,
                       float* scores, int64_t, float* out, int64_t P, const int32_t* extra, const float*, const float*,
                       int64_t) {  // (the sibling's rows are the same as kc's: the scalar path reads its own)
  for (int g = 0; g < G; ++g) attn_one_scalar(q + g * hd, kc, vc, L, hd, scale, scores, out + g * hd, P, extra);
}

void silu_mul_scalar(float* g, const float* u, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float z = g[i];
    g[i] = z / (1.0f + std::exp(-z)) * u[i];
  }
}

}  // namespace ultrafast
