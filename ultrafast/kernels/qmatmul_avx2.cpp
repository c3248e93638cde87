// AVX2 + FMA kernels: fused GGUF dequantize + matmul, and one-query attention, for CPUs without AVX-512
// (Zen 1-3, most Intel client parts): the "avx2-fp32" path.
//
// The same scheme as the AVX-512 fp32 kernels (qmatmul_avx512.cpp, whose comment explains it): x is
// prepared once per row into the weights' lane order (the layouts of qmatmul_fp32.h, shared with that
// unit), a masked weight field converts to q * 2^(bit offset) exactly, block scales are applied once per
// block and offsets/mins through per-block sums of x. Each 16-value vector of a layout is two 8-lane
// registers here, lanes 0..7 then 8..15; with 16 registers instead of 32 a chunk holds at most 2 activation
// rows (RMAX).
//
// Batch invariance, as in every variant: y[r][n] is one fixed sequence of floating-point operations that
// depends only on (type, K, weight row n, activation row r), never on how many rows a call holds or which
// thread runs it: each activation row has its own accumulators, carried across K panels through memory,
// every FMA is explicit and the final sums are a fixed tree (-ffp-contract=off, no -ffast-math). The
// results are not bit-identical to the AVX-512 path's (another order of the same sums).
//
// Compiled for the baseline ISA with a target pragma, entered only after avx2_usable(); no standard-library
// or torch header (see qmatmul_kernels.h).
#include "qmatmul_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#include <immintrin.h>

#include "activation_simd.h"
#include "attention_simd.h"
#include "qmatmul_fp32.h"

#define UF_INLINE inline __attribute__((always_inline))
#define UF_INLINE_LAMBDA __attribute__((always_inline))

namespace ultrafast {
namespace {

#include "simd_bytes.h"



// Field n (bits 4n..4n+3) of each dword, as q * 2^(4n) in float, exactly. The top field does not fit a
// signed int32: shifted down to q, converted, then scaled back by 2^28 (exact).
template <int N>
UF_INLINE __m256 nibble_field(__m256i v) {
  if constexpr (N == 7) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28)), _mm256_set1_ps(268435456.0f));
  } else {
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)(0xFu << (4 * N)))));
  }
}

UF_INLINE void nibble_fields(__m256i v, __m256* q) {
  q[0] = nibble_field<0>(v);
  q[1] = nibble_field<1>(v);
  q[2] = nibble_field<2>(v);
  q[3] = nibble_field<3>(v);
  q[4] = nibble_field<4>(v);
  q[5] = nibble_field<5>(v);
  q[6] = nibble_field<6>(v);
  q[7] = nibble_field<7>(v);
}

// The eight products of one half (lanes 0..7 or 8..15 of the layout's 16-value vectors) of a 128-value
// group: vector n's x' at xr + 16n. Even vectors sum into *se, odd ones into *so.
UF_INLINE void half_products(const __m256* q, const float* xr, __m256* se, __m256* so) {
  __m256 e = _mm256_mul_ps(q[0], _mm256_loadu_ps(xr));
  __m256 o = _mm256_mul_ps(q[1], _mm256_loadu_ps(xr + 16));
  e = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xr + 32), e);
  o = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xr + 48), o);
  e = _mm256_fmadd_ps(q[4], _mm256_loadu_ps(xr + 64), e);
  o = _mm256_fmadd_ps(q[5], _mm256_loadu_ps(xr + 80), o);
  e = _mm256_fmadd_ps(q[6], _mm256_loadu_ps(xr + 96), e);
  o = _mm256_fmadd_ps(q[7], _mm256_loadu_ps(xr + 112), o);
  *se = e;
  *so = o;
}

// ---- Q4_K: lanes 0..7 of chunk c are sub-blocks 4c (even n) and 4c+1 (odd n), lanes 8..15 are 4c+2, 4c+3.
struct KQ4_K : LQ4_K {
  struct Acc {
    __m256 e, o;
  };
  static UF_INLINE void init(Acc& a) { a.e = a.o = _mm256_setzero_ps(); }
  static UF_INLINE float finish(const Acc& a) { return hsum8(_mm256_add_ps(a.e, a.o)); }
  template <int R>
  static UF_INLINE void block(const uint8_t* p, const float* xp, const float* xs, int64_t ldx, int64_t ldxs,
                              Acc* acc) {
    uint32_t s0, s1, s2;
    __builtin_memcpy(&s0, p + 4, 4);
    __builtin_memcpy(&s1, p + 8, 4);
    __builtin_memcpy(&s2, p + 12, 4);
    // 6-bit scales sc[0..7] and mins m[0..7] (ggml get_scale_min_k4)
    const uint32_t u0 = s0 & 0x3f3f3f3fu;
    const uint32_t u1 = (s2 & 0x0f0f0f0fu) | (((s0 >> 6) & 0x03030303u) << 4);
    const uint32_t u2 = s1 & 0x3f3f3f3fu;
    const uint32_t u3 = ((s2 >> 4) & 0x0f0f0f0fu) | (((s1 >> 6) & 0x03030303u) << 4);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)u0, (int)u1, 0, 0)));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)u2, (int)u3, 0, 0)));
    alignas(32) float ds[8];
    _mm256_store_ps(ds, _mm256_mul_ps(sc, _mm256_set1_ps(h2f(p))));       // d * sc[j], as ggml
    const __m256 dm = _mm256_mul_ps(mn, _mm256_set1_ps(h2f(p + 2)));     // dmin * m[j]
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r].e = _mm256_fnmadd_ps(dm, _mm256_loadu_ps(xs + r * ldxs), acc[r].e);
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m256 q[8];
        nibble_fields(load256(p + 16 + 64 * c + 32 * h), q);
        const __m256 de = _mm256_set1_ps(ds[4 * c + 2 * h]), dO = _mm256_set1_ps(ds[4 * c + 2 * h + 1]);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          __m256 se, so;
          half_products(q, xp + 128 * c + 8 * h + r * ldx, &se, &so);
          acc[r].e = _mm256_fmadd_ps(se, de, acc[r].e);
          acc[r].o = _mm256_fmadd_ps(so, dO, acc[r].o);
        }
      }
    }
  }
};

// ---- Q6_K: per 128-value half h, bytes A (values 0..63) and Bv (64..127) as in the layout; lanes 4g..4g+3
// of vector c share scale group g.
struct KQ6_K : LQ6_K {
  struct Acc {
    __m256 a, b;
  };
  static UF_INLINE void init(Acc& a) { a.a = a.b = _mm256_setzero_ps(); }
  static UF_INLINE float finish(const Acc& a) { return hsum8(_mm256_add_ps(a.a, a.b)); }
  template <int R>
  static UF_INLINE void block(const uint8_t* p, const float* xp, const float* xs, int64_t ldx, int64_t ldxs,
                              Acc* acc) {
    const __m256 d = _mm256_set1_ps(h2f(p + 208));
    const __m256 dsc0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load64(p + 192))));
    const __m256 dsc1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load64(p + 200))));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {  // the -32 offset
      acc[r].a = _mm256_fmadd_ps(dsc0, _mm256_loadu_ps(xs + r * ldxs), acc[r].a);
      acc[r].a = _mm256_fmadd_ps(dsc1, _mm256_loadu_ps(xs + r * ldxs + 8), acc[r].a);
    }
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    const __m256i lo4 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), hi4 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i QH = load256(p + 128 + 32 * h);
      const __m256 dsc = h == 0 ? dsc0 : dsc1;  // scales 8h .. 8h+7
      const __m256 dsA = dsc;
      const __m256 dsB = _mm256_permute2f128_ps(dsc, dsc, 0x11);  // 8h+4 .. 8h+7 in both halves
#pragma GCC unroll 2
      for (int hh = 0; hh < 2; ++hh) {  // lanes 0..7: bytes 0..31 of ql and qh; lanes 8..15: 32..63, qh >> 2
        const __m256i QL = load256(p + 64 * h + 32 * hh);
        const __m256i QHx = hh == 0 ? QH : _mm256_srli_epi16(QH, 2);
        // bits 0..3 from ql, bits 4..5 the qh pair (bits 6..7 are junk, dropped by the 0x3F masks below)
        const __m256i A = _mm256_or_si256(_mm256_and_si256(m0f, QL), _mm256_andnot_si256(m0f, _mm256_slli_epi16(QHx, 4)));
        const __m256i Bv =
            _mm256_or_si256(_mm256_and_si256(m0f, _mm256_srli_epi16(QL, 4)), _mm256_andnot_si256(m0f, QHx));
        const __m256i sel = hh == 0 ? lo4 : hi4;
        const __m256 dA = _mm256_permutevar8x32_ps(dsA, sel);  // dsc[8h + 2hh + (lane >= 4)]
        const __m256 dB = _mm256_permutevar8x32_ps(dsB, sel);  // dsc[8h + 4 + 2hh + (lane >= 4)]
        __m256 qa[4], qb[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const __m256i mk = _mm256_set1_epi32((int)(0x3Fu << (8 * c)));
          qa[c] = _mm256_cvtepi32_ps(_mm256_and_si256(A, mk));
          qb[c] = _mm256_cvtepi32_ps(_mm256_and_si256(Bv, mk));
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const float* xr = xp + 128 * h + 8 * hh + r * ldx;
          __m256 sa = _mm256_mul_ps(qa[0], _mm256_loadu_ps(xr));
          __m256 sb = _mm256_mul_ps(qb[0], _mm256_loadu_ps(xr + 64));
          sa = _mm256_fmadd_ps(qa[1], _mm256_loadu_ps(xr + 16), sa);
          sb = _mm256_fmadd_ps(qb[1], _mm256_loadu_ps(xr + 80), sb);
          sa = _mm256_fmadd_ps(qa[2], _mm256_loadu_ps(xr + 32), sa);
          sb = _mm256_fmadd_ps(qb[2], _mm256_loadu_ps(xr + 96), sb);
          sa = _mm256_fmadd_ps(qa[3], _mm256_loadu_ps(xr + 48), sa);
          sb = _mm256_fmadd_ps(qb[3], _mm256_loadu_ps(xr + 112), sb);
          acc[r].a = _mm256_fmadd_ps(sa, dA, acc[r].a);
          acc[r].b = _mm256_fmadd_ps(sb, dB, acc[r].b);
        }
      }
    }
  }
};

// ---- Q4_0 / Q4_1: lanes 0..7 hold GGUF blocks 0 and 1 of the kernel block, lanes 8..15 blocks 2 and 3.
// A short last kernel block decodes from a zero-padded copy (absent blocks: d = 0 and x' = 0).
template <bool Q41>
struct KQ4_01 : LQ4_01<Q41> {
  static constexpr int BB = LQ4_01<Q41>::BB, QOFF = LQ4_01<Q41>::QOFF;
  struct Acc {
    __m256 e, o;
  };
  static UF_INLINE void init(Acc& a) { a.e = a.o = _mm256_setzero_ps(); }
  static UF_INLINE float finish(const Acc& a) { return hsum8(_mm256_add_ps(a.e, a.o)); }
  template <int R>
  static UF_INLINE void block(const uint8_t* p, const float* xp, const float* xs, int64_t ldx, int64_t ldxs,
                              Acc* acc) {
    const float d0 = h2f(p), d1 = h2f(p + BB), d2 = h2f(p + 2 * BB), d3 = h2f(p + 3 * BB);
    // offsets: m_b * sum(x over block b) (Q4_1), d_b * (-8 * sum) (Q4_0), on lanes 0..3
    const __m256 off = Q41 ? _mm256_setr_ps(h2f(p + 2), h2f(p + BB + 2), h2f(p + 2 * BB + 2), h2f(p + 3 * BB + 2), 0, 0, 0, 0)
                           : _mm256_setr_ps(d0, d1, d2, d3, 0, 0, 0, 0);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      acc[r].e = _mm256_fmadd_ps(off, _mm256_zextps128_ps256(_mm_loadu_ps(xs + r * ldxs)), acc[r].e);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const uint8_t* pb = p + 2 * h * BB + QOFF;
      __m256 q[8];
      nibble_fields(_mm256_setr_m128i(load128(pb), load128(pb + BB)), q);
      const __m256 dv = h == 0 ? _mm256_setr_ps(d0, d0, d0, d0, d1, d1, d1, d1) : _mm256_setr_ps(d2, d2, d2, d2, d3, d3, d3, d3);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m256 se, so;
        half_products(q, xp + 8 * h + r * ldx, &se, &so);
        acc[r].e = _mm256_fmadd_ps(se, dv, acc[r].e);
        acc[r].o = _mm256_fmadd_ps(so, dv, acc[r].o);
      }
    }
  }
};

// ---- Direct decoders: the dequantized weights (exactly ggml's values) as four 8-float vectors, FMA'd with
// x; used for Q5_0, Q8_0 and the float types. f(i, v) gets vector i (values 8i .. 8i+7) of the block.
struct DQ5_0 {
  static constexpr int B = 32, BYTES = 22, UNIT = 32, UNIT_BYTES = 22;
  template <class F> static UF_INLINE void decode(const uint8_t* p, F& f) {
    const __m256 d = _mm256_set1_ps(h2f(p));
    uint32_t qh;
    __builtin_memcpy(&qh, p + 2, 4);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
    const __m256i bits = _mm256_set1_epi32((int)qh);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {  // values 8i..8i+7: bytes (8i..8i+7) % 16, low nibble for i < 2
      const __m256i z = _mm256_cvtepu8_epi32(load64(p + 6 + 8 * (i & 1)));
      const __m256i lo = i < 2 ? _mm256_and_si256(z, _mm256_set1_epi32(15)) : _mm256_srli_epi32(z, 4);
      const __m256i hb = _mm256_and_si256(_mm256_srlv_epi32(bits, _mm256_add_epi32(lane, _mm256_set1_epi32(8 * i))), one);
      const __m256i q = _mm256_or_si256(lo, _mm256_slli_epi32(hb, 4));
      // d * (q - 16): q - 16 is exact, one rounding, the value ggml computes
      f(i, _mm256_mul_ps(d, _mm256_sub_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(16.0f))));
    }
  }
};

struct DQ8_0 {
  static constexpr int B = 32, BYTES = 34, UNIT = 32, UNIT_BYTES = 34;
  template <class F> static UF_INLINE void decode(const uint8_t* p, F& f) {
    const __m256 d = _mm256_set1_ps(h2f(p));
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) f(i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load64(p + 2 + 8 * i))), d));
  }
};

struct DF32 {
  static constexpr int B = 32, BYTES = 128, UNIT = 1, UNIT_BYTES = 4;
  template <class F> static UF_INLINE void decode(const uint8_t* p, F& f) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) f(i, _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8 * i));
  }
};

struct DF16 {
  static constexpr int B = 32, BYTES = 64, UNIT = 1, UNIT_BYTES = 2;
  template <class F> static UF_INLINE void decode(const uint8_t* p, F& f) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) f(i, _mm256_cvtph_ps(load128(p + 16 * i)));
  }
};

struct DBF16 {
  static constexpr int B = 32, BYTES = 64, UNIT = 1, UNIT_BYTES = 2;
  template <class F> static UF_INLINE void decode(const uint8_t* p, F& f) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
      f(i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load128(p + 16 * i)), 16)));
  }
};

template <class D>
struct KDirect : LDirect<D::BYTES, D::UNIT, D::UNIT_BYTES> {
  struct Acc {
    __m256 a0, a1;
  };
  static UF_INLINE void init(Acc& a) { a.a0 = a.a1 = _mm256_setzero_ps(); }
  static UF_INLINE float finish(const Acc& a) { return hsum8(_mm256_add_ps(a.a0, a.a1)); }
  template <int R>
  static UF_INLINE void block(const uint8_t* p, const float* xp, const float*, int64_t ldx, int64_t, Acc* acc) {
    auto f = [&](int i, __m256 wv) UF_INLINE_LAMBDA {
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        if (i & 1)
          acc[r].a1 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp + r * ldx + 8 * i), acc[r].a1);
        else
          acc[r].a0 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp + r * ldx + 8 * i), acc[r].a0);
      }
    };
    D::decode(p, f);
  }
};

constexpr int RMAX = 2;  // activation rows per chunk: two rows' accumulators beside 8 decoded weight vectors


// The 8-lane vector of the attention (attention_simd.h) and the gated activation (activation_simd.h).
struct V256 {
  using F = __m256;
  static constexpr int W = 8, HEADS = 3;
  static constexpr int SCORE_HEADS = 1, SCORE_KEYS = 8;  // pass 1 head by head (16 registers)
  static UF_INLINE F zero() { return _mm256_setzero_ps(); }
  static UF_INLINE F set1(float x) { return _mm256_set1_ps(x); }
  static UF_INLINE F load(const float* p) { return _mm256_loadu_ps(p); }
  static UF_INLINE void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static UF_INLINE __m256i first(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static UF_INLINE F load_first(const float* p, int n) { return _mm256_maskload_ps(p, first(n)); }
  static UF_INLINE F keep_first(F v, int n) { return _mm256_and_ps(_mm256_castsi256_ps(first(n)), v); }
  static UF_INLINE void store_first(float* p, F v, int n) { _mm256_maskstore_ps(p, first(n), v); }
  static UF_INLINE F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static UF_INLINE F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static UF_INLINE F add(F a, F b) { return _mm256_add_ps(a, b); }
  static UF_INLINE F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static UF_INLINE F max(F a, F b) { return _mm256_max_ps(a, b); }
  static UF_INLINE F div(F a, F b) { return _mm256_div_ps(a, b); }
  static UF_INLINE F select_nonneg(F z, F a, F b) {
    return _mm256_blendv_ps(b, a, _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_GE_OQ));
  }
  static UF_INLINE float reduce_max(F v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static UF_INLINE float reduce_add(F v) { return hsum8(v); }

  static UF_INLINE F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static UF_INLINE F round(F v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // 2^n through the exponent field (n >= -126 after exp_neg's clamp)
  static UF_INLINE F scale2n(F p, F n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }

  // Lane t = fixed-tree sum of the 8 lanes of a[t] (pairs within 128-bit lanes, then 128-bit halves).
  static UF_INLINE F transpose_reduce(const F* a) {
    __m256 s[4], u[2];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
      s[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) {
      const __m256d x = _mm256_castps_pd(s[2 * i]), y = _mm256_castps_pd(s[2 * i + 1]);
      u[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
  }
};
}  // namespace

int64_t qmm_prep_bytes_avx2(int qtype, int64_t K, bool) {
  int64_t ld = 0;
  UF_FP32_DISPATCH(qtype, ld = PrepLayout<T>(K).ld)
  return 4 * ld;
}

int64_t qmm_prep_units_avx2(int, int64_t) { return 1; }

void qmm_prep_avx2(int qtype, const float* x, int64_t K, uint8_t* xg, int64_t u0, int64_t u1, bool) {
  if (u0 >= u1) return;
  UF_FP32_DISPATCH(qtype, prep_row<T>(x, K, xg))
}

bool qmm_rows_avx2(int qtype, const uint8_t* xg, int64_t k, int64_t K, const uint8_t* w, int64_t rb, float* y,
                   int64_t ldy, int64_t n0, int64_t n1, bool) {
  bool ok = false;
  UF_FP32_DISPATCH(qtype, ok = rows_prepared<T, RMAX>(xg, k, K, w, rb, y, ldy, n0, n1))
  return ok;
}

void attn_group_avx2(const float* q, int G, const float* kc, const float* vc, int64_t L, int64_t hd, float scale,
                     float* scores, int64_t lds, float* out, int64_t P, const int32_t* extra, const float* kc0,
                     const float* vc0, int64_t P0) {
  attention_group<V256>(q, G, kc, vc, L, hd, scale, scores, lds, out, P, extra, kc0, vc0, P0);
}

void silu_mul_avx2(float* g, const float* u, int64_t n) { silu_mul<V256>(g, u, n); }

int64_t avx2_fma_chains(int64_t n) {
  __m256 a[12];
#pragma GCC unroll 12
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(0.001f * (float)i);
  const __m256 b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(0.0001f);
  for (int64_t i = 0; i < n; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) a[j] = _mm256_fmadd_ps(a[j], b, c);
  }
  for (int j = 1; j < 12; ++j) a[0] = _mm256_add_ps(a[0], a[j]);
  return (int64_t)hsum8(a[0]);
}

bool avx2_usable() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

}  // namespace ultrafast

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86-64 GCC/clang: no AVX2 kernels

namespace ultrafast {
bool avx2_usable() { return false; }
int64_t qmm_prep_bytes_avx2(int, int64_t, bool) { return 0; }
int64_t qmm_prep_units_avx2(int, int64_t) { return 0; }
void qmm_prep_avx2(int, const float*, int64_t, uint8_t*, int64_t, int64_t, bool) {}
bool qmm_rows_avx2(int, const uint8_t*, int64_t, int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t, int64_t,
                   bool) {
  return false;
}
void attn_group_avx2(const float*, int, const float*, const float*, int64_t, int64_t, float, float*, int64_t, float*,
                     int64_t, const int32_t*) {}
void silu_mul_avx2(float*, const float*, int64_t) {}
int64_t avx2_fma_chains(int64_t) { return 0; }
}  // namespace ultrafast

#endif
