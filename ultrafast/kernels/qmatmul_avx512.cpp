// AVX-512 kernels: fused GGUF dequantize + matmul, and one-query causal attention.
//
// This translation unit is compiled for the baseline ISA like the rest of the extension; the AVX-512
// code below is enabled with a target pragma and only called after a runtime CPU check
// (avx512_usable()). It deliberately includes no torch / C++ standard-library headers (see
// qmatmul_kernels.h).
//
// How the quantized kernels work. A dot product may visit its terms in any order, and the activation row
// x is shared by all N weight rows, so each call first permutes x once ("prep", O(k*K)) into the order in
// which the nibbles/bytes sit inside the 32-bit lanes of the packed weights, pre-scaled by the power of
// two that the lane's bit position implies (exact). A weight vector is then just `and` with a constant
// mask + int->float conversion: the masked field converts to q * 2^(bit offset) exactly, and the x'
// factor 2^-(bit offset) cancels it exactly. For each quantization block the kernel sums s = sum(q * x)
// with the small integers held exactly in fp32, then applies the block scale once (acc += d * s) and
// the block offset/min through per-block sums of x that prep also computes (acc += m * sum(x)). That is
// the algebraic reorganisation of dequantize-then-dot allowed by the numerics contract: the weights are
// the GGUF file's own values (fp16 scales converted exactly, d*sc etc. rounded as ggml does), only the
// rounding of the sums differs (~1e-7 of sum |x*w|). Q5_0, Q8_0 and the float types decode each
// 16-weight vector to its exact dequantized value instead and FMA it with x.
//
// No standard-library or torch header is included here: inline functions they define would be compiled
// for AVX-512 in this unit and could be merged by the linker with the baseline copies.
//
// Batch invariance: every output element y[r][n] is produced by one fixed sequence of floating-point
// operations that depends only on (qtype, K, weight row n, activation row r). The templates differ in
// how many activation rows (R) share one decode of the weights, and the work is split into K panels
// and row groups for cache locality, but per element the sequence is the same in every case:
// accumulators are carried across panels through memory (exact), each activation row has its own
// accumulators, every FMA is explicit, and the final horizontal reductions are fixed. The file is built
// with -ffp-contract=off and without -ffast-math, so the compiler cannot fuse or reassociate anything
// differently between instantiations.
#include "qmatmul_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
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


UF_INLINE __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

// ----------------------------------------------------------------------------------------------------
// Kernel types. Each provides
//   B, BYTES        values / bytes per kernel block (a Q4_1 kernel block is 4 GGUF blocks)
//   UNIT, UNIT_BYTES  smallest piece of a row (a GGUF block, or one value for float types); a row whose K
//                   is not a multiple of B ends in a partial kernel block, decoded from a zero-padded copy
//   XS              per-block sums of x that prep stores (block offsets / mins)
//   prep(x, K, Kp, xp, xs)   permute + scale one activation row into xp[Kp] (zero-padded), sums into xs
//   Acc, init, finish        per (weight row, activation row) accumulators
//   block<R>(p, xp, xs, ldx, ldxs, acc)   one kernel block for R activation rows

// ---- Q4_K (layout: LQ4_K in qmatmul_fp32.h)
struct KQ4_K : LQ4_K {
  struct Acc {
    __m512 e, o;
  };
  static UF_INLINE void init(Acc& a) { a.e = a.o = _mm512_setzero_ps(); }
  static UF_INLINE float finish(const Acc& a) { return _mm512_reduce_add_ps(_mm512_add_ps(a.e, a.o)); }
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
    const __m512 sm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_setr_epi32((int)u0, (int)u1, (int)u2, (int)u3)));
    // [d x8, dmin x8] from the two fp16 at p
    int hd2;
    __builtin_memcpy(&hd2, p, 4);
    const __m512 dd = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                            _mm512_zextps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(hd2))));
    const __m512 dm = _mm512_mul_ps(sm, dd);  // [d*sc0..7, dmin*m0..7], as ggml
    // mins: lanes 0..7 of acc.e -= dmin*m[j] * sum(x over sub-block j)
    const __m512 m1 = _mm512_shuffle_f32x4(dm, dm, 0x0E);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      acc[r].e = _mm512_mask3_fnmadd_ps(m1, _mm512_zextps256_ps512(_mm256_loadu_ps(xs + r * ldxs)), acc[r].e, (__mmask16)0x00FF);
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
      const __m512i QL = _mm512_loadu_si512(p + 16 + 64 * c);
      const __m512 de = _mm512_permutexvar_ps(
          _mm512_setr_epi32(4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c + 2, 4 * c + 2, 4 * c + 2,
                            4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2),
          dm);
      const __m512 dO = _mm512_permutexvar_ps(
          _mm512_setr_epi32(4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1,
                            4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3),
          dm);
      __m512 q[8];
#pragma GCC unroll 8
      for (int n = 0; n < 8; ++n)
        q[n] = _mm512_cvtepu32_ps(_mm512_and_si512(QL, _mm512_set1_epi32((int)(0xFu << (4 * n)))));
      const float* xc = xp + 128 * c;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float* xr = xc + r * ldx;
        __m512 se = _mm512_mul_ps(q[0], _mm512_loadu_ps(xr));
        __m512 so = _mm512_mul_ps(q[1], _mm512_loadu_ps(xr + 16));
        se = _mm512_fmadd_ps(q[2], _mm512_loadu_ps(xr + 32), se);
        so = _mm512_fmadd_ps(q[3], _mm512_loadu_ps(xr + 48), so);
        se = _mm512_fmadd_ps(q[4], _mm512_loadu_ps(xr + 64), se);
        so = _mm512_fmadd_ps(q[5], _mm512_loadu_ps(xr + 80), so);
        se = _mm512_fmadd_ps(q[6], _mm512_loadu_ps(xr + 96), se);
        so = _mm512_fmadd_ps(q[7], _mm512_loadu_ps(xr + 112), so);
        acc[r].e = _mm512_fmadd_ps(se, de, acc[r].e);
        acc[r].o = _mm512_fmadd_ps(so, dO, acc[r].o);
      }
    }
  }
};

// ---- Q6_K (layout: LQ6_K in qmatmul_fp32.h)
struct KQ6_K : LQ6_K {
  struct Acc {
    __m512 a, b;
  };
  static UF_INLINE void init(Acc& a) { a.a = a.b = _mm512_setzero_ps(); }
  static UF_INLINE float finish(const Acc& a) { return _mm512_reduce_add_ps(_mm512_add_ps(a.a, a.b)); }
  template <int R>
  static UF_INLINE void block(const uint8_t* p, const float* xp, const float* xs, int64_t ldx, int64_t ldxs,
                              Acc* acc) {
    const __m512 dsc =
        _mm512_mul_ps(_mm512_set1_ps(h2f(p + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load128(p + 192))));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r].a = _mm512_fmadd_ps(dsc, _mm512_loadu_ps(xs + r * ldxs), acc[r].a);  // -32 offset
    const __m512i m0f = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i QL = _mm512_loadu_si512(p + 64 * h);
      __m512i QHx = _mm512_broadcast_i64x4(load256(p + 128 + 32 * h));
      QHx = _mm512_mask_srli_epi16(QHx, (__mmask32)0xFFFF0000u, QHx, 2);  // upper half: qh >> 2
      // bits 0..3 from ql, bits 4..5 the qh pair (bits 6..7 are junk, dropped by the 0x3F masks below)
      const __m512i A = _mm512_ternarylogic_epi32(m0f, QL, _mm512_slli_epi16(QHx, 4), 0xCA);
      const __m512i Bv = _mm512_ternarylogic_epi32(m0f, _mm512_srli_epi16(QL, 4), QHx, 0xCA);
      const __m512 dA = _mm512_permutexvar_ps(
          _mm512_setr_epi32(8 * h, 8 * h, 8 * h, 8 * h, 8 * h + 1, 8 * h + 1, 8 * h + 1, 8 * h + 1, 8 * h + 2,
                            8 * h + 2, 8 * h + 2, 8 * h + 2, 8 * h + 3, 8 * h + 3, 8 * h + 3, 8 * h + 3),
          dsc);
      const __m512 dB = _mm512_permutexvar_ps(
          _mm512_setr_epi32(8 * h + 4, 8 * h + 4, 8 * h + 4, 8 * h + 4, 8 * h + 5, 8 * h + 5, 8 * h + 5, 8 * h + 5,
                            8 * h + 6, 8 * h + 6, 8 * h + 6, 8 * h + 6, 8 * h + 7, 8 * h + 7, 8 * h + 7, 8 * h + 7),
          dsc);
      __m512 qa[4], qb[4];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i mk = _mm512_set1_epi32((int)(0x3Fu << (8 * c)));
        qa[c] = _mm512_cvtepi32_ps(_mm512_and_si512(A, mk));
        qb[c] = _mm512_cvtepi32_ps(_mm512_and_si512(Bv, mk));
      }
      const float* xh = xp + 128 * h;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float* xr = xh + r * ldx;
        __m512 sa = _mm512_mul_ps(qa[0], _mm512_loadu_ps(xr));
        __m512 sb = _mm512_mul_ps(qb[0], _mm512_loadu_ps(xr + 64));
        sa = _mm512_fmadd_ps(qa[1], _mm512_loadu_ps(xr + 16), sa);
        sb = _mm512_fmadd_ps(qb[1], _mm512_loadu_ps(xr + 80), sb);
        sa = _mm512_fmadd_ps(qa[2], _mm512_loadu_ps(xr + 32), sa);
        sb = _mm512_fmadd_ps(qb[2], _mm512_loadu_ps(xr + 96), sb);
        sa = _mm512_fmadd_ps(qa[3], _mm512_loadu_ps(xr + 48), sa);
        sb = _mm512_fmadd_ps(qb[3], _mm512_loadu_ps(xr + 112), sb);
        acc[r].a = _mm512_fmadd_ps(sa, dA, acc[r].a);
        acc[r].b = _mm512_fmadd_ps(sb, dB, acc[r].b);
      }
    }
  }
};

// ---- Q4_0 / Q4_1 (layout: LQ4_01 in qmatmul_fp32.h)
template <bool Q41>
struct KQ4_01 : LQ4_01<Q41> {
  static constexpr int BB = LQ4_01<Q41>::BB;
  struct Acc {
    __m512 e, o;
  };
  static UF_INLINE void init(Acc& a) { a.e = a.o = _mm512_setzero_ps(); }
  static UF_INLINE float finish(const Acc& a) { return _mm512_reduce_add_ps(_mm512_add_ps(a.e, a.o)); }
  // NV = number of GGUF blocks present (4, or 1..3 for the partial last kernel block of a row; absent
  // blocks read as zeros and are never loaded, so nothing past the row is touched).
  template <int R, int NV = 4>
  static UF_INLINE void block(const uint8_t* p, const float* xp, const float* xs, int64_t ldx, int64_t ldxs,
                              Acc* acc) {
    // the kernel block spans 4*BB = 80 (Q4_1) or 72 (Q4_0) bytes: Z0 = bytes 0..63, Z1 = bytes 64..
    constexpr int SPAN = NV * BB;
    const __m512i Z0 = SPAN >= 64 ? _mm512_loadu_si512(p)
                                  : _mm512_maskz_loadu_epi8((__mmask64)((1ull << (SPAN < 64 ? SPAN : 0)) - 1ull), p);
    const __m512i Z1 = SPAN > 64 ? _mm512_maskz_loadu_epi8((__mmask64)((1ull << (SPAN > 64 ? SPAN - 64 : 0)) - 1ull), p + 64)
                                 : _mm512_setzero_si512();
    // nibbles of block b -> dwords 4b..4b+3 (one cross-lane permute of the two loads)
    __m512i QS;
    if constexpr (Q41) {  // nibbles at bytes 20b+4: dwords 5b+1 .. 5b+4
      QS = _mm512_permutex2var_epi32(Z0, _mm512_setr_epi32(1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14, 16, 17, 18, 19), Z1);
    } else {  // nibbles at bytes 18b+2: words 9b+1 .. 9b+8
      QS = _mm512_permutex2var_epi16(
          Z0,
          _mm512_set_epi16(35, 34, 33, 32, 31, 30, 29, 28, 26, 25, 24, 23, 22, 21, 20, 19,  //
                           17, 16, 15, 14, 13, 12, 11, 10, 8, 7, 6, 5, 4, 3, 2, 1),
          Z1);
    }
    // fp16 d_b is word b*BB/2 (Q4_1: m_b the next word; Q4_0 uses d_b again, prep folded the -8 into xs):
    // dm = [d0..d3, m0..m3] as floats, dv = d_b on lanes 4b..4b+3
    constexpr int W = BB / 2;
    constexpr int M = Q41 ? 1 : 0;
    const __m512i hw = _mm512_permutexvar_epi16(
        _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  //
                         3 * W + M, 2 * W + M, W + M, M, 3 * W, 2 * W, W, 0),
        Z0);
    const __m512 dm = _mm512_zextps256_ps512(_mm256_cvtph_ps(_mm512_castsi512_si128(hw)));
    const __m512 dv = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), dm);
    __m512 q[8];
#pragma GCC unroll 8
    for (int n = 0; n < 8; ++n)
      q[n] = _mm512_cvtepu32_ps(_mm512_and_si512(QS, _mm512_set1_epi32((int)(0xFu << (4 * n)))));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float* xr = xp + r * ldx;
      // offsets: lanes 4..7 of acc.e += m_b * sum(x over block b) (Q4_0: d_b * (-8 * sum))
      acc[r].e = _mm512_mask3_fmadd_ps(dm, _mm512_broadcast_f32x4(_mm_loadu_ps(xs + r * ldxs)), acc[r].e, (__mmask16)0x00F0);
      __m512 se = _mm512_mul_ps(q[0], _mm512_loadu_ps(xr));
      __m512 so = _mm512_mul_ps(q[1], _mm512_loadu_ps(xr + 16));
      se = _mm512_fmadd_ps(q[2], _mm512_loadu_ps(xr + 32), se);
      so = _mm512_fmadd_ps(q[3], _mm512_loadu_ps(xr + 48), so);
      se = _mm512_fmadd_ps(q[4], _mm512_loadu_ps(xr + 64), se);
      so = _mm512_fmadd_ps(q[5], _mm512_loadu_ps(xr + 80), so);
      se = _mm512_fmadd_ps(q[6], _mm512_loadu_ps(xr + 96), se);
      so = _mm512_fmadd_ps(q[7], _mm512_loadu_ps(xr + 112), so);
      acc[r].e = _mm512_fmadd_ps(se, dv, acc[r].e);
      acc[r].o = _mm512_fmadd_ps(so, dv, acc[r].o);
    }
  }
  // A last kernel block of 1 or 2 GGUF blocks (e.g. K = 576 = 4*128 + 64) fills only lanes 0..7, so it
  // is done with 256-bit operations on those lanes (the same per-lane operations as block<>).
  template <int R, int NV>
  static UF_INLINE void half(const uint8_t* p, const float* xp, const float* xs, int64_t ldx, int64_t ldxs,
                             Acc* acc) {
    static_assert(NV == 1 || NV == 2, "half block");
    const __m512i Z0 = _mm512_maskz_loadu_epi8((__mmask64)((1ull << (NV * BB)) - 1ull), p);
    const __m256i lo = _mm512_castsi512_si256(Z0), hi = _mm512_extracti64x4_epi64(Z0, 1);
    __m256i QS;
    if constexpr (Q41) {
      QS = _mm256_permutex2var_epi32(lo, _mm256_setr_epi32(1, 2, 3, 4, 6, 7, 8, 9), hi);
    } else {
      QS = _mm256_permutex2var_epi16(lo, _mm256_set_epi16(17, 16, 15, 14, 13, 12, 11, 10, 8, 7, 6, 5, 4, 3, 2, 1),
                                     hi);
    }
    constexpr int W = BB / 2;
    constexpr int M = Q41 ? 1 : 0;
    const __m512i hw = _mm512_permutexvar_epi16(
        _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  //
                         3 * W + M, 2 * W + M, W + M, M, 3 * W, 2 * W, W, 0),
        Z0);
    const __m256 dm8 = _mm256_cvtph_ps(_mm512_castsi512_si128(hw));
    const __m512 dm = _mm512_zextps256_ps512(dm8);
    const __m256 dv = _mm256_permutexvar_ps(_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), dm8);
    __m256 q[8];
#pragma GCC unroll 8
    for (int n = 0; n < 8; ++n)
      q[n] = _mm256_cvtepu32_ps(_mm256_and_si256(QS, _mm256_set1_epi32((int)(0xFu << (4 * n)))));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float* xr = xp + r * ldx;
      acc[r].e = _mm512_mask3_fmadd_ps(dm, _mm512_broadcast_f32x4(_mm_loadu_ps(xs + r * ldxs)), acc[r].e, (__mmask16)0x00F0);
      __m256 se = _mm256_mul_ps(q[0], _mm256_loadu_ps(xr));
      __m256 so = _mm256_mul_ps(q[1], _mm256_loadu_ps(xr + 16));
      se = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xr + 32), se);
      so = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xr + 48), so);
      se = _mm256_fmadd_ps(q[4], _mm256_loadu_ps(xr + 64), se);
      so = _mm256_fmadd_ps(q[5], _mm256_loadu_ps(xr + 80), so);
      se = _mm256_fmadd_ps(q[6], _mm256_loadu_ps(xr + 96), se);
      so = _mm256_fmadd_ps(q[7], _mm256_loadu_ps(xr + 112), so);
      const __m512 dvz = _mm512_zextps256_ps512(dv);
      acc[r].e = _mm512_mask3_fmadd_ps(_mm512_zextps256_ps512(se), dvz, acc[r].e, (__mmask16)0x00FF);
      acc[r].o = _mm512_mask3_fmadd_ps(_mm512_zextps256_ps512(so), dvz, acc[r].o, (__mmask16)0x00FF);
    }
  }
  static constexpr bool NATIVE_PARTIAL = true;
  template <int R>
  static UF_INLINE void partial(const uint8_t* p, int64_t nunits, const float* xp, const float* xs, int64_t ldx,
                                int64_t ldxs, Acc* acc) {
    if (nunits == 1) half<R, 1>(p, xp, xs, ldx, ldxs, acc);
    else if (nunits == 2) half<R, 2>(p, xp, xs, ldx, ldxs, acc);
    else block<R, 3>(p, xp, xs, ldx, ldxs, acc);
  }
};

// ---- Direct decoders: produce the dequantized weights (exactly ggml's values) as 16-float vectors and
// FMA them with x; used for Q5_0, Q8_0 and the float types. f(i, v) gets vector i of the block.
struct DQ5_0 {
  static constexpr int B = 32, BYTES = 22, UNIT = 32, UNIT_BYTES = 22;
  template <class F> static UF_INLINE void decode(const uint8_t* p, F& f) {
    const __m512 d = _mm512_set1_ps(h2f(p));
    uint32_t qh;
    __builtin_memcpy(&qh, p + 2, 4);
    const __m512 tlo = _mm512_mul_ps(d, _mm512_add_ps(iota16(), _mm512_set1_ps(-16.0f)));  // q = 0..15
    const __m512 thi = _mm512_mul_ps(d, iota16());                                         // q = 16..31
    const __m512i z = _mm512_cvtepu8_epi32(load128(p + 6));
    const __m512i c16 = _mm512_set1_epi32(16);
    __m512i i0 = _mm512_and_si512(z, _mm512_set1_epi32(15));
    i0 = _mm512_mask_or_epi32(i0, (__mmask16)(qh & 0xFFFFu), i0, c16);
    __m512i i1 = _mm512_srli_epi32(z, 4);
    i1 = _mm512_mask_or_epi32(i1, (__mmask16)(qh >> 16), i1, c16);
    f(0, _mm512_permutex2var_ps(tlo, i0, thi));  // index bit 4 selects thi; higher bits ignored
    f(1, _mm512_permutex2var_ps(tlo, i1, thi));
  }
};

struct DQ8_0 {
  static constexpr int B = 32, BYTES = 34, UNIT = 32, UNIT_BYTES = 34;
  template <class F> static UF_INLINE void decode(const uint8_t* p, F& f) {
    const __m512 d = _mm512_set1_ps(h2f(p));
    f(0, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load128(p + 2))), d));
    f(1, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load128(p + 18))), d));
  }
};

// Float weights: blocks of 32 values.
struct DF32 {
  static constexpr int B = 32, BYTES = 128, UNIT = 1, UNIT_BYTES = 4;
  template <class F> static UF_INLINE void decode(const uint8_t* p, F& f) {
    f(0, _mm512_loadu_ps(reinterpret_cast<const float*>(p)));
    f(1, _mm512_loadu_ps(reinterpret_cast<const float*>(p) + 16));
  }
};

struct DF16 {
  static constexpr int B = 32, BYTES = 64, UNIT = 1, UNIT_BYTES = 2;
  template <class F> static UF_INLINE void decode(const uint8_t* p, F& f) {
    f(0, _mm512_cvtph_ps(load256(p)));
    f(1, _mm512_cvtph_ps(load256(p + 32)));
  }
};

struct DBF16 {
  static constexpr int B = 32, BYTES = 64, UNIT = 1, UNIT_BYTES = 2;
  static UF_INLINE __m512 cvt(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }
  template <class F> static UF_INLINE void decode(const uint8_t* p, F& f) {
    f(0, cvt(load256(p)));
    f(1, cvt(load256(p + 32)));
  }
};

template <class D>
struct KDirect : LDirect<D::BYTES, D::UNIT, D::UNIT_BYTES> {
  struct Acc {
    __m512 a0, a1;
  };
  static UF_INLINE void init(Acc& a) { a.a0 = a.a1 = _mm512_setzero_ps(); }
  static UF_INLINE float finish(const Acc& a) { return _mm512_reduce_add_ps(_mm512_add_ps(a.a0, a.a1)); }
  template <int R>
  static UF_INLINE void block(const uint8_t* p, const float* xp, const float*, int64_t ldx, int64_t, Acc* acc) {
    auto f = [&](int i, __m512 wv) UF_INLINE_LAMBDA {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        if (i & 1)
          acc[r].a1 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp + r * ldx + 16 * i), acc[r].a1);
        else
          acc[r].a0 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp + r * ldx + 16 * i), acc[r].a0);
      }
    };
    D::decode(p, f);
  }
};

constexpr int RMAX = 4;  // activation rows per chunk: 4 rows' accumulators and x' loads fit the 32 registers

// The 16-lane vector of the attention (attention_simd.h) and the gated activation (activation_simd.h).
struct V512 {
  using F = __m512;
  static constexpr int W = 16, HEADS = 6;
  static constexpr int SCORE_HEADS = 3, SCORE_KEYS = 8;  // pass 1's tile: 24 accumulators, 3 queries, a key
  static UF_INLINE F zero() { return _mm512_setzero_ps(); }
  static UF_INLINE F set1(float x) { return _mm512_set1_ps(x); }
  static UF_INLINE F load(const float* p) { return _mm512_loadu_ps(p); }
  static UF_INLINE void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static UF_INLINE __mmask16 first(int n) { return (__mmask16)((1u << n) - 1u); }
  static UF_INLINE F load_first(const float* p, int n) { return _mm512_maskz_loadu_ps(first(n), p); }
  static UF_INLINE F keep_first(F v, int n) { return _mm512_maskz_mov_ps(first(n), v); }
  static UF_INLINE void store_first(float* p, F v, int n) { _mm512_mask_storeu_ps(p, first(n), v); }
  static UF_INLINE F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static UF_INLINE F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static UF_INLINE F add(F a, F b) { return _mm512_add_ps(a, b); }
  static UF_INLINE F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static UF_INLINE F max(F a, F b) { return _mm512_max_ps(a, b); }
  static UF_INLINE F div(F a, F b) { return _mm512_div_ps(a, b); }
  static UF_INLINE F select_nonneg(F z, F a, F b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_GE_OQ), b, a);
  }
  static UF_INLINE float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
  static UF_INLINE float reduce_add(F v) { return _mm512_reduce_add_ps(v); }

  static UF_INLINE F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static UF_INLINE F round(F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static UF_INLINE F scale2n(F p, F n) { return _mm512_scalef_ps(p, n); }

  // Lane t = fixed-tree sum of the 16 lanes of a[t] (pairs of 128-bit lanes, then 128-bit halves, then
  // 256-bit halves).
  static UF_INLINE F transpose_reduce(const F* a) {
    __m512 s[8], u[4];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)
      s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m512d x = _mm512_castps_pd(s[2 * i]), y = _mm512_castps_pd(s[2 * i + 1]);
      u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
  }
};

}  // namespace

int64_t qmm_prep_bytes_avx512(int qtype, int64_t K, bool) {
  int64_t ld = 0;
  UF_FP32_DISPATCH(qtype, ld = PrepLayout<T>(K).ld)
  return 4 * ld;
}

int64_t qmm_prep_units_avx512(int, int64_t) { return 1; }

void qmm_prep_avx512(int qtype, const float* x, int64_t K, uint8_t* xg, int64_t u0, int64_t u1, bool) {
  if (u0 >= u1) return;
  UF_FP32_DISPATCH(qtype, prep_row<T>(x, K, xg))
}

bool qmm_rows_avx512(int qtype, const uint8_t* xg, int64_t k, int64_t K, const uint8_t* w, int64_t rb, float* y,
                     int64_t ldy, int64_t n0, int64_t n1, bool) {
  bool ok = false;
  UF_FP32_DISPATCH(qtype, ok = rows_prepared<T, RMAX>(xg, k, K, w, rb, y, ldy, n0, n1))
  return ok;
}

void attn_group_avx512(const float* q, int G, const float* kc, const float* vc, int64_t L, int64_t hd, float scale,
                       float* scores, int64_t lds, float* out, int64_t P, const int32_t* extra, const float* kc0,
                       const float* vc0, int64_t P0) {
  attention_group<V512>(q, G, kc, vc, L, hd, scale, scores, lds, out, P, extra, kc0, vc0, P0);
}

void silu_mul_avx512(float* g, const float* u, int64_t n) { silu_mul<V512>(g, u, n); }

bool avx512_usable() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");
}

}  // namespace ultrafast

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86-64 GCC/clang: no AVX-512 kernels

namespace ultrafast {
bool avx512_usable() { return false; }
int64_t qmm_prep_bytes_avx512(int, int64_t, bool) { return 0; }
int64_t qmm_prep_units_avx512(int, int64_t) { return 0; }
void qmm_prep_avx512(int, const float*, int64_t, uint8_t*, int64_t, int64_t, bool) {}
bool qmm_rows_avx512(int, const uint8_t*, int64_t, int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t, int64_t,
                     bool) {
  return false;
}
void attn_group_avx512(const float*, int, const float*, const float*, int64_t, int64_t, float, float*, int64_t, float*,
                       int64_t, const int32_t*) {}
void silu_mul_avx512(float*, const float*, int64_t) {}
}  // namespace ultrafast

#endif
