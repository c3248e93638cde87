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

#include "qmatmul_fp32.h"

#define UF_INLINE inline __attribute__((always_inline))
#define UF_INLINE_LAMBDA __attribute__((always_inline))

namespace ultrafast {
namespace {

UF_INLINE float h2f(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);  // fp16 -> fp32 is exact
}

UF_INLINE __m128i load64(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
UF_INLINE __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
UF_INLINE __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Fixed-tree sum of the 8 lanes.
UF_INLINE float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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


// exp for x <= 0 (softmax arguments), Cephes expf polynomial; 2^n through the exponent field (n >= -126
// after the clamp); ~1 ulp.
UF_INLINE __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Lane t of the result = fixed-tree sum of the 8 lanes of a[t] (pairs within 128-bit lanes, then 128-bit
// halves); no lane of a[t] reaches another output lane, so a key's score never depends on its neighbours.
UF_INLINE __m256 transpose_reduce8(const __m256* a) {
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

// out[g] = inv[g] * sum_j p[g][j] * v_j over dims [8*v0, 8*(v0+NV)) for G <= 3 heads (NV <= 4). Value rows:
// j < P are rows j, later ones rows extra[j - P] (the same accumulation order either way).
template <int NV, int G>
__attribute__((noinline)) void attn_pv_chunk(const float* vc, int64_t L, int64_t hd, const float* sc, int64_t lds,
                                             int v0, const float* inv, float* out, int64_t P, const int32_t* extra) {
  __m256 o[G][NV];
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) o[g][v] = _mm256_setzero_ps();
  const float* vb = vc + 8 * v0;
  for (int64_t j = 0; j < L; ++j) {
    __m256 vv[NV];
    const int64_t jr = extra == nullptr || j < P ? j : (int64_t)extra[j - P];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vv[v] = _mm256_loadu_ps(vb + jr * hd + 8 * v);
#pragma GCC unroll 3
    for (int g = 0; g < G; ++g) {
      const __m256 pj = _mm256_broadcast_ss(sc + g * lds + j);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) o[g][v] = _mm256_fmadd_ps(pj, vv[v], o[g][v]);
    }
  }
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g) {
    const __m256 iv = _mm256_set1_ps(inv[g]);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + g * hd + 8 * (v0 + v), _mm256_mul_ps(o[g][v], iv));
  }
}

template <int NV>
UF_INLINE void attn_pv_heads(int G, const float* vc, int64_t L, int64_t hd, const float* sc, int64_t lds, int v0,
                             const float* inv, float* out, int64_t P, const int32_t* ex) {
  switch (G) {
    case 1: attn_pv_chunk<NV, 1>(vc, L, hd, sc, lds, v0, inv, out, P, ex); break;
    case 2: attn_pv_chunk<NV, 2>(vc, L, hd, sc, lds, v0, inv, out, P, ex); break;
    default: attn_pv_chunk<NV, 3>(vc, L, hd, sc, lds, v0, inv, out, P, ex); break;
  }
}
}  // namespace

int64_t qmm_prep_bytes_avx2(int qtype, int64_t K) {
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
                     float* scores, int64_t lds, float* out, int64_t P, const int32_t* extra) {
  // The contract and the three passes of attn_group_avx512, 8 keys / 8 dims at a time.
  const int64_t nv = hd / 8;
  if (extra == nullptr) P = L;
  // pass 1: scores, 8 keys at a time; a partial last block leaves the missing keys' sums at zero. Blocks past
  // the contiguous prefix (a tree's ancestors) gather their rows into `tb` first: the same values in the same
  // lanes, so the same sums.
  alignas(32) float tb[8 * 256];
  alignas(32) float part[8];
  for (int64_t j0 = 0; j0 < L; j0 += 8) {
    const int cnt = L - j0 < 8 ? (int)(L - j0) : 8;
    const float* kb = kc + j0 * hd;
    if (j0 + cnt > P && hd <= 256) {
      for (int t = 0; t < cnt; ++t) {
        const int64_t j = j0 + t, jr = j < P ? j : (int64_t)extra[j - P];
        __builtin_memcpy(tb + t * hd, kc + jr * hd, sizeof(float) * (size_t)hd);
      }
      kb = tb;
    }
    for (int g = 0; g < G; ++g) {
      const float* qg = q + g * hd;
      __m256 acc[8];
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
      if (cnt == 8) {
        for (int64_t v = 0; v < nv; ++v) {
          const __m256 qv = _mm256_loadu_ps(qg + 8 * v);
#pragma GCC unroll 8
          for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kb + t * hd + 8 * v), acc[t]);
        }
      } else {
        for (int64_t v = 0; v < nv; ++v) {
          const __m256 qv = _mm256_loadu_ps(qg + 8 * v);
          for (int t = 0; t < cnt; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kb + t * hd + 8 * v), acc[t]);
        }
      }
      const __m256 sv = _mm256_mul_ps(transpose_reduce8(acc), _mm256_set1_ps(scale));
      if (cnt == 8) {
        _mm256_storeu_ps(scores + g * lds + j0, sv);
      } else {
        _mm256_store_ps(part, sv);
        for (int t = 0; t < cnt; ++t) scores[g * lds + j0 + t] = part[t];
      }
    }
  }
  // pass 2: per head, max (order-independent), exponentials and their sum over 8 lanes in a fixed order
  float inv[64];
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * lds;
    float mx = -__builtin_inff();
    __m256 mxv = _mm256_set1_ps(mx);
    int64_t j = 0;
    for (; j + 8 <= L; j += 8) mxv = _mm256_max_ps(mxv, _mm256_loadu_ps(sg + j));
    _mm256_store_ps(part, mxv);
    for (int t = 0; t < 8; ++t) mx = part[t] > mx ? part[t] : mx;
    for (int64_t t = j; t < L; ++t) mx = sg[t] > mx ? sg[t] : mx;
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= L; j += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + j), vmx));
      _mm256_storeu_ps(sg + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    if (j < L) {  // the tail's lanes past L are zero
      const int cnt = (int)(L - j);
      for (int t = 0; t < 8; ++t) part[t] = t < cnt ? sg[j + t] : mx;
      const __m256 live = _mm256_castsi256_ps(
          _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
      const __m256 e = _mm256_and_ps(live, exp256(_mm256_sub_ps(_mm256_load_ps(part), vmx)));
      _mm256_store_ps(part, e);
      for (int t = 0; t < cnt; ++t) sg[j + t] = part[t];
      sum = _mm256_add_ps(sum, e);
    }
    inv[g] = 1.0f / hsum8(sum);
  }
  // pass 3: weighted sums of the values, 32 dims x up to 3 heads at a time (value rows loaded once)
  for (int g0 = 0; g0 < G; g0 += 3) {
    const int gc = G - g0 < 3 ? G - g0 : 3;
    const float* sc = scores + g0 * lds;
    float* og = out + g0 * hd;
    for (int v0 = 0; v0 < (int)nv; v0 += 4) {
      switch ((int)nv - v0 < 4 ? (int)nv - v0 : 4) {
        case 1: attn_pv_heads<1>(gc, vc, L, hd, sc, lds, v0, inv + g0, og, P, extra); break;
        case 2: attn_pv_heads<2>(gc, vc, L, hd, sc, lds, v0, inv + g0, og, P, extra); break;
        case 3: attn_pv_heads<3>(gc, vc, L, hd, sc, lds, v0, inv + g0, og, P, extra); break;
        default: attn_pv_heads<4>(gc, vc, L, hd, sc, lds, v0, inv + g0, og, P, extra); break;
      }
    }
  }
}

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
int64_t qmm_prep_bytes_avx2(int, int64_t) { return 0; }
int64_t qmm_prep_units_avx2(int, int64_t) { return 0; }
void qmm_prep_avx2(int, const float*, int64_t, uint8_t*, int64_t, int64_t, bool) {}
bool qmm_rows_avx2(int, const uint8_t*, int64_t, int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t, int64_t,
                   bool) {
  return false;
}
void attn_group_avx2(const float*, int, const float*, const float*, int64_t, int64_t, float, float*, int64_t, float*,
                     int64_t, const int32_t*) {}
int64_t avx2_fma_chains(int64_t) { return 0; }
}  // namespace ultrafast

#endif
