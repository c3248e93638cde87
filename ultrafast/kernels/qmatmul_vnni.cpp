// AVX512-VNNI integer kernels: fused GGUF dequantize + matmul with int16 activations.
//
// Compiled for the baseline ISA like the rest of the extension; the code below is enabled with a target
// pragma and only called after a runtime CPU check (vnni_usable()). No torch / standard-library header is
// included (see qmatmul_kernels.h).
//
// Numerics. Each activation row is quantized once per call, per block of 32 values, to int16:
// s_b = max|x| / 32639 (fp32), x_i = rint(x_i / s_b) (saturated), plus the exact integer block sums
// xsum_b = sum x_i. The weights stay exactly the file's: the small unsigned integers q of each block
// (Q4: 0..15, Q5_0: 0..31, Q6_K: 0..63; Q8_0's signed int8 as q + 128) are multiplied with x split into two
// signed bytes, x = 256 * xh + xl, by vpdpbusd (unsigned byte x signed byte, 4 products summed into each
// int32 lane): q.x = 256 * (q.xh) + q.xl, exact in int32. This is the int16 product at the cost of int16
// multiplies, but the weights' bytes go to the multiplier as they are (no widening to 16-bit lanes).
// Per block the integer dot product isum = sum q_i * x_i (with the block's integer offset folded in
// exactly: Q4_0 -8*xsum, Q5_0 -16*xsum, Q8_0 -128*xsum, Q6_K -32*xsum per 16-value scale group) is
// converted to fp32 and applied as
//     acc += (d_w * s_b) * isum            (d_w: the block's fp32 scale as ggml computes it, e.g. d*sc)
// and the fp32 offsets/mins as acc += m * (s_b * xsum) (Q4_1, per group) or acc -= (dmin*m) * (s_b * xsum)
// (Q4_K, the 8 sub-blocks of a super-block in one vector op).
// The only approximation is the int16 rounding of x (relative error ~1e-5 of sum |x*w| at worst).
//
// Lane layout. A "group" is the values one fp step covers: 128 values, 4 blocks of 32, for the 32-value-block
// types in the file's layout (K32); a super-block of 256 values for Q4_K (8 sub-blocks of 32, see KQ4K) and Q6_K
// (16 scale groups of 16, see KQ6K); 512 values in the layouts made at load (qmm_repack_vnni): Q4_K's pairs of
// super-blocks (QT_Q4_K_R2, KQ4K2) and 16 blocks of the 32-value-block types (QT_*_R16, KB16), one block per lane,
// the values already in lane order. Its weights are decoded into NVEC byte vectors (2; the K-quants 4; the layouts
// made at load 8) in which each int32 lane only ever holds values of one block, so after the dot products int32
// lanes 4i..4i+3 hold partial sums of block bm(i) (Q4_K: lanes 2m, 2m+1 sub-block sb_of(m); Q6_K: lane 4i+s scale
// group 4s+i; KQ4K2, KB16: lane l block l). The activation prep writes xh and xl in exactly that order, with
// per-lane vectors of s_b, the integer offsets (one lane per block) and s_b * xsum_b (one lane per block).
//
// Batch invariance: every output y[r][n] is one fixed sequence of operations that depends only on
// (qtype, K, weight row n, activation row r): per group the integer dot products (exact, in any order),
// one convert, one mul (d_w * s), one fma into the output's accumulator, then (Q4_1) one fma for the mins;
// groups in order; (Q4_K) after each group one fnmadd for its mins (the layouts made at load: the values past a
// row's last whole group then run as groups of the file's layout into the same accumulator); at the end a fixed
// horizontal sum. The tile size R, the row range and the thread never change that sequence; the unit is
// built with -ffp-contract=off.
// When weight rows are read whole (decode, verification) the weight stream is also prefetched ahead, into L1
// and into L2 (PF_NEAR, PF_FAR; measured on the 1.5B model: 49 -> 40 -> 37 ms per step).
#include "qmatmul_kernels.h"

#include <unistd.h>  // sysconf: the L1 data cache's size (a C header, included before the target pragma)

#if defined(__x86_64__) && defined(__GNUC__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#endif

#include <immintrin.h>

#define UF_INLINE inline __attribute__((always_inline))

namespace ultrafast {
namespace {

#include "simd_bytes.h"

UF_INLINE uint32_t rd32(const uint8_t* p) {
  uint32_t h;
  __builtin_memcpy(&h, p, 4);
  return h;
}

// Per-row, per-group activation data (layout written by prep, read by the kernels), NVEC: the weight vectors of a group.
//   xh[v], xl[v]: the int16 x of byte position j of weight vector v, split as x = 256 * xh + xl (both signed
//   bytes); s: s_b on the lanes of block b; ioff: integer offset on the block's first lane (0 elsewhere);
//   xsf: s_b * xsum_b on the block's first lane (0 elsewhere).
// With int8 x (X8) the x is xh alone and there is no xl: half the bytes, so that more activation rows' x stays in L1
// while the weight rows stream past it.
template <int NVEC, bool X8>
struct XGN {
  __m512i xh[NVEC];
  __m512i xl[NVEC];
  __m512 s;
  __m512i ioff;
  __m512 xsf;
};
template <int NVEC>
struct XGN<NVEC, true> {
  __m512i xh[NVEC];
  __m512 s;
  __m512i ioff;
  __m512 xsf;
};

// x = 256 * hi + lo with hi, lo signed bytes (|x| <= 32639 = 127 * 257).
UF_INLINE int8_t x_hi(int v) { return (int8_t)((v + 128) >> 8); }
UF_INLINE int8_t x_lo(int v) { return (int8_t)(v - 256 * ((v + 128) >> 8)); }

// Quantize 32 values to int16 (s = max|x| / XQMAX, q = rint(x / s)); returns s, writes q and the sum.
// XQMAX = 32639 = 127 * 257 is the largest |q| whose two signed bytes (x_hi, x_lo) cannot overflow.
// A block holding a NaN or an infinity gets s = NaN (and q = 0), so the outputs it feeds become NaN as on
// the fp32 path instead of silently finite.
constexpr float XQMAX = 32639.0f;
// With int8 activations (x8, llama.cpp's precision: twice the multiply rate, one vpdpbusd per weight vector)
// the top is 127 and x goes to the multiplier as one signed byte (in xh; xl stays zero and is not read).
constexpr float XQMAX8 = 127.0f;

template <bool X8>
UF_INLINE float quant32(const float* x, int16_t* q, int32_t* sum) {
  constexpr float TOP = X8 ? XQMAX8 : XQMAX;
  // Two vectors of 16 lanes; each operation is the scalar rule's, lane by lane (max is exact in any order,
  // the division IEEE's, roundscale to nearest even is rintf's), so the bits are those of a loop over the 32.
  // The loop (a divss an element) made a prepared row cost 0.87-1.12 ns a value, ten rows of 8960 (a verify pass's
  // down projection input) 78-100 us on one thread; this 0.39-0.60 (qmatmul of 10 rows against 2 weight rows).
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
  const __m512 fmax = _mm512_set1_ps(__FLT_MAX__);
  const __mmask16 ok0 = _mm512_cmp_ps_mask(a0, fmax, _CMP_LE_OQ), ok1 = _mm512_cmp_ps_mask(a1, fmax, _CMP_LE_OQ);
  if ((ok0 & ok1) != 0xFFFF) {  // a NaN or an infinity
    _mm512_storeu_si512(q, _mm512_setzero_si512());
    *sum = 0;
    return __builtin_nanf("");
  }
  const float mx = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
  const float s = mx / TOP;
  if (!(s > 0.0f)) {
    _mm512_storeu_si512(q, _mm512_setzero_si512());
    *sum = 0;
    return s;
  }
  const __m512 sv = _mm512_set1_ps(s), hi = _mm512_set1_ps(TOP), lo = _mm512_set1_ps(-TOP);
  const auto one = [&](__m512 xv) {
    const __m512 f = _mm512_roundscale_ps(_mm512_div_ps(xv, sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_cvttps_epi32(_mm512_max_ps(_mm512_min_ps(f, hi), lo));
  };
  const __m512i v0 = one(x0), v1 = one(x1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtepi32_epi16(v0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm512_cvtepi32_epi16(v1));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));
  return s;
}

// One group's prepared data staged in memory (lanes not written stay 0), then copied into its vectors.
template <int NVEC, bool X8>
struct GroupStage {
  alignas(64) int8_t xh[NVEC][64] = {}, xl[NVEC][64] = {};
  alignas(64) float s[16] = {}, xsf[16] = {};
  alignas(64) int32_t io[16] = {};
  void put(int v, int byte, int val) {  // x = 256 * xh + xl; int8 x: xh alone
    xh[v][byte] = X8 ? (int8_t)val : x_hi(val);
    xl[v][byte] = X8 ? 0 : x_lo(val);
  }
  void store(XGN<NVEC, X8>* g) const {
    for (int v = 0; v < NVEC; ++v) {
      g->xh[v] = _mm512_load_si512(xh[v]);
      if constexpr (!X8) g->xl[v] = _mm512_load_si512(xl[v]);
    }
    g->s = _mm512_load_ps(s);
    g->ioff = _mm512_load_si512(io);
    g->xsf = _mm512_load_ps(xsf);
  }
};

// The 4 chunks of 64 bytes at q split into 8 weight vectors: chunk u's low nibbles to W[2u], its high ones to W[2u + 1]
// (the nibble layouts made at load, KQ4K2 and KB16).
UF_INLINE void split_nibble_chunks(const uint8_t* q, __m512i* W) {
  const __m512i m0f = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int u = 0; u < 4; ++u) {
    const __m512i Q = _mm512_loadu_si512(q + 64 * u);
    W[2 * u] = _mm512_and_si512(Q, m0f);
    W[2 * u + 1] = _mm512_and_si512(_mm512_srli_epi16(Q, 4), m0f);
  }
}

// ---- kernel types ------------------------------------------------------------------------------------
// How a row whose K is not a multiple of KB ends (T::TAIL): TAIL_NONE it cannot (the K-quants: K % 256 == 0);
// TAIL_MASKED in a group of fewer blocks, loaded with masks (K32: context's n, the blocks there); TAIL_FILE the values
// past the last whole group stay in the file's layout and run as groups of T::Tail (KQ4K2: an odd last super-block,
// KQ4K; KB16: the last K / 32 mod 16 blocks, K32).
enum Tail : int { TAIL_NONE, TAIL_MASKED, TAIL_FILE };
// The low n bits set (n clamped to 0..64).
UF_INLINE uint64_t low_bits(int n) { return n >= 64 ? ~0ull : n <= 0 ? 0ull : (1ull << n) - 1; }

// Each: NVEC (weight vectors per group), GV (values per group), KB/KBYTES (values/bytes of one kernel block =
// GPK groups), TAIL (see Tail), IOFF (integer offset multiplier, 0 none), MINS (0 none; +1
// Q4_1: decode's mvec per group; -1 Q4_K: Ctx::m once per super-block), X (the prepared x of a group),
// context(p, n) once per kernel block (n: see TAIL_MASKED), and decode(p, g, ctx, W, dvec, mvec) for group g of the
// kernel block at p.
// The prep lays x out by bm(i) (K32) or stage() (the K-quants).

// Word-permute indices (vpermt2w over two 64-byte vectors; index bit 5 picks the second) gathering 8 words
// of each of 4 blocks of BB bytes, starting at byte OFF of the block, SHIFT words before the first vector.
template <int BB, int OFF, int SHIFT>
struct WIdx {
  alignas(64) int16_t v[32];
  constexpr WIdx() : v() {
    for (int j = 0; j < 32; ++j) v[j] = (int16_t)((((j / 8) & 3) * BB + OFF) / 2 + j % 8 - SHIFT);
  }
};
template <int BB, int OFF, int SHIFT>
inline constexpr WIdx<BB, OFF, SHIFT> kWIdx{};

// Q4_0, Q4_1, Q5_0, Q8_0: kernel block = one group = 4 GGUF blocks of 32
template <int QT>
struct K32 {
  static constexpr int BB = QT == QT_Q4_0 ? 18 : QT == QT_Q4_1 ? 20 : QT == QT_Q5_0 ? 22 : 34;
  static constexpr int NVEC = 2, GV = 128, GPK = 1, KB = 128, KBYTES = 4 * BB;
  // Q8_0's signed weights are multiplied as unsigned q + 128 (vpdpbusd's unsigned operand): -128 * xsum
  static constexpr int IOFF = QT == QT_Q4_0 ? -8 : QT == QT_Q5_0 ? -16 : QT == QT_Q8_0 ? -128 : 0;
  static constexpr int MINS = QT == QT_Q4_1 ? 1 : 0;
  static constexpr int TAIL = TAIL_MASKED;
  static UF_INLINE int bm(int i) { return i; }
  // The bytes loaded (masks of the loads at p, p + 64; Q8_0's at p + 8, p + 72): the group's n * BB (n >= 4: all
  // KBYTES); nothing past them is read, and the blocks past n read as zero (d = 0).
  struct Ctx {
    __mmask64 k0, k1, ka, kb;
    int n;
  };
  static UF_INLINE Ctx context(const uint8_t*, int n) {
    const int nb = (n < 4 ? n : 4) * BB;
    return {(__mmask64)low_bits(nb), (__mmask64)low_bits(nb - 64), (__mmask64)low_bits(nb - 8),
            (__mmask64)low_bits(nb - 72), n < 4 ? n : 4};
  }
  static UF_INLINE void decode(const uint8_t* p, int, const Ctx& c, __m512i* W, __m512& dvec, __m512& mvec) {
    // the group's bytes as two vectors
    const __m512i Z0 = _mm512_maskz_loadu_epi8(c.k0, p);
    const __m512i Z1 = _mm512_maskz_loadu_epi8(c.k1, p + 64);
    {  // fp16 d (and m) of the 4 blocks -> words 0..3 (4..7)
      alignas(64) static const int16_t dix[32] = {0, BB / 2, BB, 3 * BB / 2, 1, BB / 2 + 1, BB + 1, 3 * BB / 2 + 1};
      const __m512i dm16 = _mm512_permutex2var_epi16(Z0, _mm512_load_si512(dix), Z1);
      const __m512 dm = _mm512_zextps256_ps512(_mm256_cvtph_ps(_mm512_castsi512_si128(dm16)));
      dvec = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), dm);
      if constexpr (QT == QT_Q4_1)
        mvec = _mm512_permutexvar_ps(_mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7), dm);
      else
        mvec = _mm512_setzero_ps();
    }
    if constexpr (QT == QT_Q8_0) {
      // first halves (bytes 34b+2..) from [Z0 Z1]; second halves (34b+18..) from bytes 8..135
      const __m512i Za = _mm512_maskz_loadu_epi8(c.ka, p + 8), Zb = _mm512_maskz_loadu_epi8(c.kb, p + 72);
      const __m512i A = _mm512_permutex2var_epi16(Z0, _mm512_load_si512(kWIdx<BB, 2, 0>.v), Z1);
      const __m512i B = _mm512_permutex2var_epi16(Za, _mm512_load_si512(kWIdx<BB, 18, 4>.v), Zb);
      const __m512i x80 = _mm512_set1_epi8((char)0x80);
      W[0] = _mm512_xor_si512(A, x80);  // q + 128, values 0..15 of block b in lane b
      W[1] = _mm512_xor_si512(B, x80);  // values 16..31
    } else {
      constexpr int QOFF = QT == QT_Q4_0 ? 2 : QT == QT_Q4_1 ? 4 : 6;
      const __m512i Z = _mm512_permutex2var_epi16(Z0, _mm512_load_si512(kWIdx<BB, QOFF, 0>.v), Z1);  // block b's 16 bytes in lane b
      const __m512i m0f = _mm512_set1_epi8(0x0F);
      __m512i L = _mm512_and_si512(Z, m0f);
      __m512i H = _mm512_and_si512(_mm512_srli_epi16(Z, 4), m0f);
      if constexpr (QT == QT_Q5_0) {
        uint64_t mlo = 0, mhi = 0;
        for (int b = 0; b < c.n; ++b) {
          const uint32_t qh = rd32(p + b * BB + 2);
          mlo |= (uint64_t)(qh & 0xFFFFu) << (16 * b);
          mhi |= (uint64_t)(qh >> 16) << (16 * b);
        }
        const __m512i b16 = _mm512_set1_epi8(0x10);
        L = _mm512_or_si512(L, _mm512_maskz_mov_epi8((__mmask64)mlo, b16));
        H = _mm512_or_si512(H, _mm512_maskz_mov_epi8((__mmask64)mhi, b16));
      }
      W[0] = L;  // values 0..15 of block b in lane b
      W[1] = H;  // values 16..31
    }
  }
};

// Q4_K: kernel block = group = super-block of 256 (144 bytes): 8 sub-blocks of 32, two int32 lanes each.
// Its 4 weight vectors W[v] hold in 64-bit lane m the values 8v..8v+7 of sub-block sb_of(m) = 0,2,4,6,1,3,5,7
// (one permute of the raw bytes and one 128-bit shuffle per two vectors from the file's nibble order), so after
// the 8 dot products of a super-block every int32 lane holds 16 values of one sub-block, and one fp step
// (convert, d_w * s_b, fma) covers 256 values, half as many as with one lane group per block of a 128-value
// group.
struct KQ4K {
  static constexpr int NVEC = 4, GV = 256, GPK = 1, KB = 256, KBYTES = 144;
  // mins once per super-block: ctx.m (dmin * m of sub-block sb_of(m) on lanes 2m, 2m + 1) against the x vector
  // xsf (s_b * xsum_b on lane 2m, 0 on 2m + 1)
  static constexpr int IOFF = 0, MINS = -1;
  static constexpr int TAIL = TAIL_NONE;
  static UF_INLINE int sb_of(int m) { return m < 4 ? 2 * m : 2 * (m - 4) + 1; }
  // Prepared x (see prep_row_k): vector v, 64-bit lane m, byte j holds value 8v + j of sub-block sb_of(m); s_b on
  // lanes 2m, 2m + 1; s_b * xsum_b on lane 2m (0 on 2m + 1).
  template <bool X8>
  static void stage(const int16_t* q, const float* sb, const int32_t* sum, GroupStage<4, X8>& st) {
    for (int m = 0; m < 8; ++m) {
      const int b = sb_of(m);
      for (int v = 0; v < 4; ++v)
        for (int j = 0; j < 8; ++j) st.put(v, 8 * m + j, q[32 * b + 8 * v + j]);
      st.s[2 * m] = st.s[2 * m + 1] = sb[b];
      st.xsf[2 * m] = sb[b] * (float)sum[b];
    }
  }
  // Per 128-bit lane, a super-block's header as 32-bit words dm, s0, s1, s2 -> its 6-bit scales and mins as bytes
  // sc0..7, m0..7 (ggml's get_scale_min_k4, 4 at a time): sc0..3 = s0 & 63, m0..3 = s1 & 63, sc4..7 = (s2 & 15) |
  // (s0 >> 6) << 4, m4..7 = (s2 >> 4) | (s1 >> 6) << 4. One header (KQ4K) or two side by side (KQ4K2).
  static UF_INLINE __m256i scale_min_bytes(__m256i S) {
    __m256i A = _mm256_shuffle_epi32(S, _MM_SHUFFLE(3, 2, 3, 1));  // s0, s2, s1, s2
    A = _mm256_and_si256(_mm256_srlv_epi32(A, _mm256_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4)),
                         _mm256_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f,
                                           0x3f3f3f3f, 0x0f0f0f0f));
    const __m256i B = _mm256_and_si256(_mm256_srli_epi32(_mm256_shuffle_epi32(S, _MM_SHUFFLE(2, 2, 1, 1)), 2),
                                       _mm256_setr_epi32(0, 0x30303030, 0, 0x30303030, 0, 0x30303030, 0,
                                                         0x30303030));  // s0, s0, s1, s1
    return _mm256_or_si256(A, B);
  }
  static UF_INLINE __m512 scales(const uint8_t* p) {
    const __m128i sm8 = _mm256_castsi256_si128(scale_min_bytes(_mm256_zextsi128_si256(load128(p))));
    const __m512 sm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm8));
    const int hd2 = (int)rd32(p);
    const __m512 dd = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                            _mm512_zextps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(hd2))));
    return _mm512_mul_ps(sm, dd);  // [d*sc0..7, dmin*m0..7], as ggml
  }
  struct Ctx {
    __m512 d, m;
  };
  static UF_INLINE Ctx context(const uint8_t* p, int) {
    const __m512 dm = scales(p);
    return {_mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6, 1, 1, 3, 3, 5, 5, 7, 7), dm),
            _mm512_permutexvar_ps(_mm512_setr_epi32(8, 8, 10, 10, 12, 12, 14, 14, 9, 9, 11, 11, 13, 13, 15, 15), dm)};
  }
  static UF_INLINE void decode(const uint8_t* p, int, const Ctx& ctx, __m512i* W, __m512& dvec, __m512& mvec) {
    dvec = ctx.d;
    mvec = _mm512_setzero_ps();  // unused: the mins go once per super-block
    // qs byte 32c + i: sub-block 2c's value i (low nibble), 2c + 1's (high nibble)
    const __m512i Q0 = _mm512_loadu_si512(p + 16), Q1 = _mm512_loadu_si512(p + 80);
    const __m512i m0f = _mm512_set1_epi8(0x0F);

#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      // 64-bit lanes: bytes 8(2h)..+7 of the 4 chunks, then bytes 8(2h+1)..+7
      const __m512i T = _mm512_permutex2var_epi64(
          Q0, h ? _mm512_setr_epi64(2, 6, 10, 14, 3, 7, 11, 15) : _mm512_setr_epi64(0, 4, 8, 12, 1, 5, 9, 13), Q1);
      const __m512i L = _mm512_and_si512(T, m0f);                       // sub-blocks 0,2,4,6
      const __m512i H = _mm512_and_si512(_mm512_srli_epi16(T, 4), m0f);  // sub-blocks 1,3,5,7
      W[2 * h] = _mm512_shuffle_i64x2(L, H, _MM_SHUFFLE(1, 0, 1, 0));      // values 16h..16h+7
      W[2 * h + 1] = _mm512_shuffle_i64x2(L, H, _MM_SHUFFLE(3, 2, 3, 2));  // values 16h+8..16h+15
    }
  }
};

// Q4_K repacked in pairs of super-blocks (QT_Q4_K_R2, `qmm_repack_vnni`): kernel block = group = two super-blocks
// (512 values, 288 bytes: the two 16-byte headers of d, dmin and the 6-bit scales as in the file, then 256 bytes of
// nibbles). Each int32 lane l holds one sub-block for the whole group (lanes 0..7: sub-blocks 0..7 of the first
// super-block, 8..15 of the second), so the 16 dot products of the group (int8 x: 8) end in one fp step for 512
// values, and the weight decode is 4 loads, each split into its low and high nibbles: byte 4l + j of nibble
// chunk u holds value 8u + j of lane l's sub-block (low nibble, weight vector 2u) and value 8u + 4 + j (high
// nibble, vector 2u + 1). A row with an odd number of super-blocks keeps its last one in the file's layout (KQ4K).
struct KQ4K2 {
  static constexpr int NVEC = 8, GV = 512, GPK = 1, KB = 512, KBYTES = 288;
  static constexpr int IOFF = 0, MINS = -1;
  static constexpr int TAIL = TAIL_FILE;  // an odd last super-block: KQ4K's
  using Tail = KQ4K;
  // x prepared by prep_row_lanes: lane l holds sub-block l % 8 of super-block l / 8
  struct Ctx {
    __m512 d, m;
  };
  // The two headers' 6-bit scales and mins unpacked together, one super-block per 128-bit lane
  // (KQ4K::scale_min_bytes), then d * sc and dmin * m on the group's 16 lanes: the same products as two KQ4K::scales
  // calls (the same bits), with half their unpacking ops and without the two permutes that joined their results. At
  // small tiles this decode is a large share of a weight row's work: `python -m ultrafast.benchmarks.kernel_shapes
  // --ks 2,4,10 --reps 20 --activation-bits 8` on the 1.5B (AMD EPYC, 2 threads), alternated with two
  // KQ4K::scales calls: the gate projection (8960 x 1536) 0.245 / 0.245 ms against 0.278 / 0.269 at k = 4, 0.556 /
  // 0.547 against 0.593 / 0.578 at k = 10; wq (1536 x 1536) 0.046 / 0.047 against 0.049 / 0.057 at k = 4.
  static UF_INLINE Ctx context(const uint8_t* p, int) {
    const __m256i S = load256(p);  // per 128-bit lane (super-block) the words dm, s0, s1, s2
    // per lane sc0..7, m0..7 as bytes; 64-bit pieces reordered to [sc of both, m of both]
    const __m256i sm = _mm256_permute4x64_epi64(KQ4K::scale_min_bytes(S), _MM_SHUFFLE(3, 1, 2, 0));
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(sm)));
    const __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(sm, 1)));
    // d, dmin of each super-block: [dA, dminA, dB, dminB]
    const __m512 dd = _mm512_zextps128_ps512(_mm_cvtph_ps(_mm_unpacklo_epi32(
        _mm256_castsi256_si128(S), _mm256_extracti128_si256(S, 1))));
    return {_mm512_mul_ps(sc, _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), dd)),
            _mm512_mul_ps(m, _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3), dd))};
  }
  static UF_INLINE void decode(const uint8_t* p, int, const Ctx& ctx, __m512i* W, __m512& dvec, __m512& mvec) {
    dvec = ctx.d;
    mvec = _mm512_setzero_ps();
    split_nibble_chunks(p + 32, W);
  }
};

// Q4_0, Q4_1, Q5_0, Q8_0 repacked at load (QT_*_R16, `qmm_repack_vnni`): kernel block = group = 16 blocks of 32
// (512 values), one block per int32 lane, so the 16 dot products of a group (int8 x: 8) end in one fp32 step for
// 512 values where the file's layout (K32) takes one per 128, and the decode is a load (Q4: and a nibble split) per
// weight vector. A group is: the 16 fp16 d, (Q4_1) the 16 fp16 m, (Q5_0) the fifth bits as 8 masks of 64 bits (mask
// v, bit 4l + j: value 4v + j of block l), then the values: Q4 in 4 chunks of 64 bytes, byte 4l + j of chunk u
// holding value 8u + j of block l in its low nibble and 8u + 4 + j in its high one (weight vectors 2u and 2u + 1);
// Q8_0 in 8 chunks of 64 bytes, byte 4l + j of chunk v holding value 4v + j + 128. That is 16 times the file's block
// bytes, so a row keeps its size. The blocks past a row's last whole group (K / 32 mod 16) stay in the file's layout
// and run as K32 groups.
template <int QT>
struct KB16 {
  static constexpr int BB = K32<QT>::BB;
  static constexpr int NVEC = 8, GV = 512, GPK = 1, KB = 512, KBYTES = 16 * BB;
  static constexpr int IOFF = K32<QT>::IOFF, MINS = K32<QT>::MINS;
  static constexpr int TAIL = TAIL_FILE;
  using Tail = K32<QT>;
  // x prepared by prep_row_lanes: lane l holds block l of the group
  struct Ctx {
    __m512 d, m;
  };
  static UF_INLINE Ctx context(const uint8_t* p, int) {
    Ctx c{_mm512_cvtph_ps(load256(p)), _mm512_setzero_ps()};
    if constexpr (QT == QT_Q4_1) c.m = _mm512_cvtph_ps(load256(p + 32));
    return c;
  }
  static UF_INLINE void decode(const uint8_t* p, int, const Ctx& c, __m512i* W, __m512& dvec, __m512& mvec) {
    dvec = c.d;
    mvec = c.m;
    if constexpr (QT == QT_Q8_0) {
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) W[v] = _mm512_loadu_si512(p + 32 + 64 * v);
    } else {
      constexpr int HEAD = QT == QT_Q4_1 ? 64 : QT == QT_Q5_0 ? 96 : 32;  // bytes before the values
      split_nibble_chunks(p + HEAD, W);
      if constexpr (QT == QT_Q5_0) {  // the fifth bits: + 16 where set (the nibble is below 16)
        const __m512i b16 = _mm512_set1_epi8(0x10);
#pragma GCC unroll 8
        for (int v = 0; v < 8; ++v) {
          uint64_t h;
          __builtin_memcpy(&h, p + 32 + 8 * v, 8);
          W[v] = _mm512_mask_add_epi8(W[v], (__mmask64)h, W[v], b16);
        }
      }
    }
  }
};

// Q6_K: kernel block = group = super-block of 256 (210 bytes): 16 scale groups of 16, one int32 lane each.
// Per half h the 6-bit values are decoded into byte vectors A (values 0..63 of the half) and B (64..127), one
// scale group per 128-bit lane; a 4 x 4 transpose of 32-bit pieces within each 128-bit lane across A0, B0, A1,
// B1 gives the 4 weight vectors W[v] whose int32 lane 4i + s holds values 4v..4v+3 of scale group 4s + i, so
// after the 8 dot products of a super-block every lane holds one scale group's 16 values and one fp step
// covers 256 values. The lane sums stay exact through the convert: |sum (q - 32) x| <= 16 * 32 * 32639 < 2^24.
struct Q6KShape {  // what the Q6_K layouts (KQ6K, KQ6KR) share: a super-block a group, d * sc on its lanes
  static constexpr int NVEC = 4, GV = 256, GPK = 1, KB = 256, KBYTES = 210;
  static constexpr int IOFF = -32, MINS = 0;
  static constexpr int TAIL = TAIL_NONE;
  struct Ctx {
    __m512 d;
  };
  static UF_INLINE __m512 dsc(const uint8_t* p) {  // d * sc of scale group g on lane g
    return _mm512_mul_ps(_mm512_set1_ps(h2f(p + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load128(p + 192))));
  }
};
struct KQ6K : Q6KShape {
  // Prepared x (see prep_row_k): vector v, 128-bit lane i, bytes 4t..4t+3 hold values 64t + 16i + 4v .. +3
  // (scale group 4t + i); its s_b, and -32 * its integer sum, on int32 lane 4i + t.
  template <bool X8>
  static void stage(const int16_t* q, const float* sb, const int32_t*, GroupStage<4, X8>& st) {
    for (int i = 0; i < 4; ++i)
      for (int t = 0; t < 4; ++t) {
        const int start = 64 * t + 16 * i;  // scale group 4t + i
        for (int v = 0; v < 4; ++v)
          for (int j = 0; j < 4; ++j) st.put(v, 16 * i + 4 * t + j, q[start + 4 * v + j]);
        int32_t gs = 0;
        for (int u = 0; u < 16; ++u) gs += q[start + u];
        st.s[4 * i + t] = sb[start / 32];
        st.io[4 * i + t] = -32 * gs;
      }
  }
  static UF_INLINE Ctx context(const uint8_t* p, int) {  // d * sc of scale group 4s + i on lane 4i + s
    return {_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), dsc(p))};
  }
  static UF_INLINE void decode(const uint8_t* p, int, const Ctx& ctx, __m512i* W, __m512& dvec, __m512& mvec) {
    dvec = ctx.d;
    mvec = _mm512_setzero_ps();
    const __m512i m0f = _mm512_set1_epi8(0x0F), m3f = _mm512_set1_epi8(0x3F);
    __m512i S[4];  // A0, B0, A1, B1: 128-bit lane i of S[s] holds scale group 4s + i
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i QL = _mm512_loadu_si512(p + 64 * h);
      __m512i QHx = _mm512_broadcast_i64x4(load256(p + 128 + 32 * h));
      QHx = _mm512_mask_srli_epi16(QHx, (__mmask32)0xFFFF0000u, QHx, 2);
      S[2 * h] = _mm512_and_si512(_mm512_ternarylogic_epi32(m0f, QL, _mm512_slli_epi16(QHx, 4), 0xCA), m3f);
      S[2 * h + 1] = _mm512_and_si512(_mm512_ternarylogic_epi32(m0f, _mm512_srli_epi16(QL, 4), QHx, 0xCA), m3f);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(S[0], S[1]), t1 = _mm512_unpackhi_epi32(S[0], S[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(S[2], S[3]), t3 = _mm512_unpackhi_epi32(S[2], S[3]);
    W[0] = _mm512_unpacklo_epi64(t0, t2);
    W[1] = _mm512_unpackhi_epi64(t0, t2);
    W[2] = _mm512_unpacklo_epi64(t1, t3);
    W[3] = _mm512_unpackhi_epi64(t1, t3);
  }
};

// Q6_K repacked at load (QT_Q6_K_R16, `qmm_repack_vnni`): kernel block = group = super-block of 256 (210 bytes), one
// scale group of 16 values per int32 lane, in lane order: the low nibbles in 2 chunks of 64 bytes (byte 4l + j of chunk
// c: value 8c + j of scale group l in its low nibble, 8c + 4 + j in its high one: weight vectors 2c, 2c + 1), the high
// two bits in one chunk of 64 bytes (byte 4l + j, bits 2v..2v + 1: value 4v + j of scale group l), then the 16 int8
// scales in lane order and d. The decode is 3 loads and 12 logic ops a super-block (KQ6K: 2 loads, 2 broadcasts, 26
// ops, the scales permuted); the products and the fp32 step are KQ6K's.
struct KQ6KR : Q6KShape {
  // Prepared x: vector v, int32 lane l, byte j holds value 16l + 4v + j; lane l its block's s_b and -32 * the scale
  // group's integer sum.
  template <bool X8>
  static void stage(const int16_t* q, const float* sb, const int32_t*, GroupStage<4, X8>& st) {
    for (int l = 0; l < 16; ++l) {
      int32_t gs = 0;
      for (int v = 0; v < 4; ++v)
        for (int j = 0; j < 4; ++j) st.put(v, 4 * l + j, q[16 * l + 4 * v + j]), gs += q[16 * l + 4 * v + j];
      st.s[l] = sb[l / 2];
      st.io[l] = -32 * gs;
    }
  }
  static UF_INLINE Ctx context(const uint8_t* p, int) { return {dsc(p)}; }  // the scales are in lane order
  static UF_INLINE void decode(const uint8_t* p, int, const Ctx& ctx, __m512i* W, __m512& dvec, __m512& mvec) {
    dvec = ctx.d;
    mvec = _mm512_setzero_ps();
    const __m512i m0f = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i H = _mm512_loadu_si512(p + 128);
    // (lo & 0x0F) | (hi & 0x30): ternary logic 0xF8 on (lo & 0x0F, hi, 0x30), A | (B & C)
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
      const __m512i Q = _mm512_loadu_si512(p + 64 * c);
      const __m512i HL = c ? H : _mm512_slli_epi16(H, 4);                  // bits 4c..4c+1 -> 4..5
      const __m512i HH = c ? _mm512_srli_epi16(H, 2) : _mm512_slli_epi16(H, 2);  // bits 4c+2..4c+3 -> 4..5
      W[2 * c] = _mm512_ternarylogic_epi32(_mm512_and_si512(Q, m0f), HL, m30, 0xF8);
      W[2 * c + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(Q, 4), m0f), HH, m30, 0xF8);
    }
  }
};

// ---- activation prep --------------------------------------------------------------------------------

// 32-value-block types but Q4_K: group G covers blocks 4G..4G+3 (those < nblk); lane i <- block bm(i).
template <class T, bool X8>
void prep_row32(const float* x, int64_t K, uint8_t* out, int64_t G0, int64_t G1) {
  const int64_t nblk = K / 32;
  for (int64_t G = G0; G < G1; ++G) {
    GroupStage<2, X8> st;
    for (int i = 0; i < 4; ++i) {
      const int64_t blk = 4 * G + T::bm(i);
      int16_t q[32] = {};
      int32_t sum = 0;
      float sb = 0.0f;
      if (blk < nblk) sb = quant32<X8>(x + 32 * blk, q, &sum);
      for (int v = 0; v < 2; ++v)
        for (int j = 0; j < 16; ++j) st.put(v, 16 * i + j, q[16 * v + j]);
      for (int j = 0; j < 4; ++j) st.s[4 * i + j] = sb;
      st.io[4 * i] = T::IOFF * sum;
      st.xsf[4 * i] = sb * (float)sum;
    }
    st.store(reinterpret_cast<XGN<2, X8>*>(out + G * sizeof(XGN<2, X8>)));
  }
}

// K-quant types (T = KQ4K, KQ6K): group S is super-block S, its 256 values quantized per block of 32 and
// laid out by T::stage (q: the values, sb: each block's s_b, sum: each block's integer sum).
template <class T, bool X8>
void prep_row_k(const float* x, uint8_t* out, int64_t S0, int64_t S1) {
  for (int64_t S = S0; S < S1; ++S) {
    int16_t q[256];
    float sb[8];
    int32_t sum[8];
    for (int b = 0; b < 8; ++b) sb[b] = quant32<X8>(x + 256 * S + 32 * b, q + 32 * b, &sum[b]);
    GroupStage<4, X8> st;
    T::stage(q, sb, sum, st);
    st.store(reinterpret_cast<XGN<4, X8>*>(out + S * sizeof(XGN<4, X8>)));
  }
}

// The layouts of one block of 32 per int32 lane, 16 blocks a group (T = KQ4K2, KB16): unit G < K / 512 is the group
// of blocks 16G..16G + 15: vector v, int32 lane l, byte j holds value 4v + j of block l; lane l also holds the
// block's s_b, T::IOFF * xsum_b and s_b * xsum_b. The values past the last whole group are laid out for T::Tail after
// the groups, one more unit each of its groups.
template <class T, bool X8>
void prep_row_lanes(const float* x, int64_t K, uint8_t* out, int64_t G0, int64_t G1) {
  const int64_t nfull = K / 512;
  for (int64_t G = G0; G < G1; ++G) {
    if (G >= nfull) {  // past the whole groups: T::Tail's prep of the rest
      uint8_t* tail = out + nfull * sizeof(XGN<8, X8>);
      if constexpr (T::Tail::KB == 256)
        prep_row_k<typename T::Tail, X8>(x + 512 * nfull, tail, G - nfull, G - nfull + 1);
      else
        prep_row32<typename T::Tail, X8>(x + 512 * nfull, K - 512 * nfull, tail, G - nfull, G - nfull + 1);
      continue;
    }
    int16_t q[512];
    float sb[16];
    int32_t sum[16];
    for (int l = 0; l < 16; ++l) sb[l] = quant32<X8>(x + 512 * G + 32 * l, q + 32 * l, &sum[l]);
    GroupStage<8, X8> st;
    for (int l = 0; l < 16; ++l) {
      for (int v = 0; v < 8; ++v)
        for (int j = 0; j < 4; ++j) st.put(v, 4 * l + j, q[32 * l + 4 * v + j]);
      st.s[l] = sb[l];
      st.io[l] = T::IOFF * sum[l];
      st.xsf[l] = sb[l] * (float)sum[l];
    }
    st.store(reinterpret_cast<XGN<8, X8>*>(out + G * sizeof(XGN<8, X8>)));
  }
}

// ---- driver -----------------------------------------------------------------------------------------

// The register tile: NW weight rows x R activation rows. Each group's decoded weight vectors feed R
// activation rows, and each activation row's x vectors, loaded once into registers, feed NW weight rows, so
// a product costs its vpdpbusd and its fp32 step, not the loads of its operands (the one-weight-row tile
// re-loaded x from memory for every product: ~5 vector loads per 4 vpdpbusd). Tiles used: NW_MAX x up to
// R_MAX (verification, batched decode), NW_MAX x 1 (decode: independent chains across weight rows), and
// NW = 1 for the last row of an odd range. The tile never changes an output's arithmetic (see below).
constexpr int NW_MAX = 2, R_MAX = 4;
// The layouts made at load with eight weight vectors a row (KQ4K2, KB16) also allow a tile of one weight row x up to
// R2_MAX activation rows, which pays where the chunks' x stays in L1 (see rows()). Measured with a harness over these
// kernels (random Q4_K, 2 threads, weights from memory; time against the file's layout), 8960 x 1536, int8, k = 1 /
// 4 / 10 / 16: 2 x 4 tile 0.80 / 0.87 / 0.83 / 0.87, 1 x 8 tile 0.88 / 0.92 / 0.74 / 0.72; 1536 x 8960 (x 21 KB a
// row): 2 x 4 0.71 / 0.80 / 0.80 / 0.78, 1 x 8 0.81 / 1.11 / 1.05 / 1.06. Up to 16 rows a tile (16 accumulators and
// the 8 weight vectors stay in registers) where their x fits L1 (then 3/4 of it): on a 48 KB L1 (Intel Xeon) the
// 1.5B's r(k) at int8 (`ultrafast bench --activation-bits 8`, alternated with 8 rows a tile and a fixed 32 KB bound)
// fell 2-12% at k = 5..15 (r(9) 1.90-2.02 against 2.14-2.21: one chunk instead of two; r(12) 2.40-2.44 against
// 2.61-2.72), r(16) within noise; at int16 unchanged but r(9).
constexpr int R2_MAX = 16;
// Tried on the Intel Xeon (AMX, 48 KB L1), 2026-12-07, not kept (every output's bits were unchanged in both):
// - The products ordered by weight vector, 2 weight rows x up to 10 activation rows (20 int32 chains, each x vector
//   loaded once for both weight rows, where the one-row tile loads it per product: its loads bound it, as the same
//   products ran twice as fast when all rows' x was one address). A 1-thread harness over this unit (L2-resident)
//   gave 10-24% less time at k = 8..16, but `python -m ultrafast.benchmarks.kernel_shapes --activation-bits 8`
//   (the 1.5B, 2 threads, weights from memory, alternated twice) +0-8% on the gate projection at k = 8..16, -3-9% on
//   the down projection.
// - AMX tile multiplies (TDPBUSD, a 16 x 16 tile of weight rows x activation rows per block of 32, then each lane's
//   fp32 step as here on vectors over the activation rows, the same tree for the sum): bit-identical, but 85 us
//   against 52-85 at k = 2..16 (512 x 1536 repacked Q4_K, 1 thread). The layouts here hold a block per int32 lane,
//   so every tile needs the decoded weights transposed (~32 shuffles a weight row and group, all on one port), and
//   the fp32 step costs 4 ops and 4-6 memory operations per (weight row, block) whatever k is. With the decode
//   left out (what weights laid out for the tiles, a second copy, would save) the calls still took 48-50 us at
//   k = 2..16: 25 without the fp32 step, 33 without the tile instructions, 9 without both (the fp32 step ~5 cycles
//   per weight row and block, bound by its memory operations; the two did not overlap). The fp32 step per weight
//   row with its 16 lane accumulators in registers (all groups' tiles first) was slower still.
// Where the one-row tile's time goes on the Intel Xeon (AMX, 48 KB L1), measured again in a later session of 2026-12-07
// with a 1-thread harness over this unit (`python -m ultrafast.benchmarks.kernel_harness tiles|amx|mix`: repacked Q4_K,
// int8, 512 x 1536, L2-resident; every output's bits unchanged; an hour later the host ran ~10% slower throughout):
// k = 10 takes 48-51 us, 2.4-2.5 G vpdpbusd/s against 6.3-6.9 for bare vpdpbusd (../shared/tools/mulpeak.c), and the
// same with 8 weight rows (all in L1): the instructions bind, not the memory. The same mix on register operands
// (vnni_paired_chains: 8 vpdpbusd, convert, scale multiply, fma, fnmadd) runs 4.68 G/s (4.25 later, bare 5.94); a loop
// of this tile's own pattern with its operands from L1 (x for each vpdpbusd, s and xsf loaded) and no weight decode
// 3.0-3.2 (3.29 later); 12 vpdpbusd
// with memory operands 4.4 against 6.5 with registers (vnni_load_beside: a 64-byte load takes 0.35-0.48 of a vpdpbusd
// slot here; `ultrafast bench` prints it). Per weight row and group at k = 10: ~80 vpdpbusd, ~40 fp32 ops (each a
// vpdpbusd slot here too: vnni_fma_beside 0.96-1.00), ~100 loads and ~35 ops of decode and scales; the loads cost more
// than the decode, and only x reuse across weight rows would win them back. Not kept, none faster: rows' chains
// interleaved in twos or fours, or split (even and odd weight vectors), 48-51 us against 48-51 (not latency); the
// 2 x R tiles that load each x vector once for two weight rows, chunks of R: k = 10 2 x 4 58.6, 2 x 5 51-52, 2 x 6
// 53-55 us against 48-49.5; k = 16 88-91 against 75.5-77.7. The one that pays: two weight rows against all k rows in
// one sweep (each weight row decoded once, x loaded once for both, the 2k accumulators spilled; the harness's `2xk`),
// k = 4 / 10 / 16 22.9-23.6 / 46.2-49.2 / 75.9-78.4 us against 24.9-25.0 / 53.0-54.4 / 82.6-89.5, bits unchanged:
// 6-13% less, not yet in rows() (on Zen 4 the 2 x R tiles lost, above and below: it would want a per-host choice).
// AMX again, with every unit's operands in the tiles' own order (no transposes): per 16 weight rows and block of 32, B
// = the 16 rows' 32 nibbles split into bytes (8 x 64, from a copy of the weights laid out for it), A = the int8 x of
// the block (R rows of the plain quantized row, stride K), TDPBSUD into C, C stored; the fp32 step on vectors over the
// 16 weight rows, per activation row (the same per-output operations: bits identical to this unit's at k = 1..16), each
// lane's groups in turn so that its R accumulators stay in registers, the final sum _mm512_reduce_add_ps's tree on
// vectors over weight rows; decode 6 units ahead and tiles 4 ahead (two tile sets). With the scales precomputed (what a
// load-time layout of d * sc and dmin * m would give): 25.8 / 27.2 / 39.1 / 60.5 us at k = 1 / 4 / 10 / 16 against this
// unit's 11.9 / 23.5 / 51.2 / 82.6 (1.31x at k = 10); computed per tile and transposed 33-34 / 37.6 / 47.7 / 65.
// Without the tile instructions 8.9 / 12.6 / 21.0 / 31.4. The harness's `amx` (the same design, its scales transposed
// by scalar moves) an hour later: precomputed 27.9 / 29.6 / 43.3 / 58.1 against 12.7 / 24.9 / 54.4 / 85.2, per call
// 39.8 / 41.5 / 55.4 / 71.8, without tiles 11.3 / 15.1 / 23.6 / 33.7. The tiles add ~18 us at k = 10 (~40 cycles a
// unit) and do not overlap the vector work. A bare loop of one unit's tile instructions (the harness's last line) takes
// 9.7 / 10.0 / 19.7 ns a unit at k = 1 / 10 / 16 (~33 cycles at the ~3.4 GHz that bare vpdpbusd at two a cycle
// implies); a TILESTORED 4.6-4.7 ns (~16 cycles) whatever its rows, one per block of 32 since each block has its own
// scales. So the tiles hold the Q4_K products near 1.3x at k = 10 under these numerics.
// The same products by vpdpbusd over the AMX prototype's layout, 2026-12-08 (the harness's `lanes`: int32 lanes = 16
// weight rows, each x dword a broadcast, one decode for all activation rows; bits identical at k = 1..16): k = 1 / 4 /
// 10 / 16 12.6 / 24.5 / 49.5 / 79.6 us against the engine's 12.3 / 25.0 / 54.5 / 85.0, 9% less at k = 10 (as the 2 x k
// sweep: x reuse buys ~10% here). Its ablations at k = 10: without the weight decode 42.4-43.2, without the fp32 step
// 35.0-35.2, without both 30.2-30.4 us (80 vpdpbusd and their x broadcasts a unit and activation row at 4.0 G/s, 62% of
// bare vpdpbusd; the same with the broadcasts folded into vpdpbusd as {1to16}, or the rows' chains interleaved: no
// faster). So at k = 10 the fp32 step (4 ops a unit and activation row: t = d * s, convert, fma, fnmadd, fixed by the
// bits every output must keep) takes ~30% of the time and the decode ~12%; with both free the vpdpbusd would still run
// at 62% of their bare rate. Under these numerics no VNNI schedule here reaches the ~1.3x per row the ultrafast tier's
// n = 10 goal asks (README, HumanEval); the AMX tiles (1.26-1.47x at k = 10..16, Q4_K only) are the one route measured.
// With the gate's shape from memory (8960 x 1536, 1 thread; `kernel_harness lanes|tiles|amx --rows 8960 --reps 20`)
// the harness's variants, which issue no software prefetch, keep less: lanes 956-971 against 964-991 us at k = 10,
// 1499-1508 against 1550-1554 at k = 16 (0-3%); 2 x k 925-936 against 953-985 and 1461-1499 against 1464-1552 (0-6%);
// AMX with its scales precomputed 874-885 against 1036 at k = 10 (1.18x), 1.33x at k = 16.
// Tried on a Zen 4 (AMD EPYC, 32 KB L1), 2026-12-07: a 1-thread harness over this unit (repacked Q4_K and Q6_K, 512 x
// 1536, int8, L2-resident; variants alternated three times, best of each; runs spread ~15%), every output's bits
// unchanged, none faster: the 2 x R tile by weight vector (above) at Q4_K k = 10, 61 us (R = 8) and 75 (R = 10)
// against 60; the same tile ordered by activation row (accumulators spilled) 79; the one-row tile's integer chain
// split in two (even and odd weight vectors, joined by an add) 60 against 60; two or three activation rows' chains
// interleaved, Q6_K 64 / 67 against 64; Q6_K's chain start as a register instead of a load (to time it) 63 against
// 64. By ablation (bits not kept), k = 10: Q6_K 64.6 us, without the weight decode 56.5, without the fp32 step 55.6,
// without both 44.7 (the vpdpbusd and their loads alone at 75% of the 1-thread peak of 3.65 G/s, measured with
// ../shared/tools/mulpeak.c); Q4_K 60.7, 55.8, 54.7, 48.9 (69%). Halving the x loads changed nothing, so loads do not
// bind there; the fp32 step takes the multiply pipes' slots (vnni_fma_beside) and the decode the rest.
// Up to this many bytes of prepared x, every tile of weight rows is read whole against all activation rows
// (x stays in L2); more (prefill) takes the weight-tiled schedule (see rows()). Measured on the 1.5B's down
// projection (Q6_K, K = 8960, 31 KB of x per row), 1 thread: k = 16 (500 KB) whole rows 8.7 cycles per
// 128-value product against 10.7 for the K-panelled schedule used before; k = 24 (750 KB) 9.2 against 10.7.
constexpr int64_t WHOLE_ROWS_X = 768 * 1024;
// With one weight row a tile every weight row re-reads all rows' x, which must then stay in L1: that tile only where a
// chunk's x fits the L1 data cache (l1_bytes(): 32 KB on Zen 4, 48 KB on Zen 5 and recent Xeons) less L1_WEIGHT_ROOM,
// and whole rows while all of x fits there, else the weight-tiled schedule. Measured on Zen 4, Q4_K 8960 x 1536
// repacked, 2 threads, int16, k = 10 / 16: 2.01 / 2.65 ns per 128-value product with whole rows at any size, 1.70 /
// 1.64 with a bound of 3/4 of L1.
// What L1 keeps beside the chunk's x: the weight rows passing through (the group being decoded, PF_NEAR ahead). With 3/4
// of a 32 KB L1 (8 KB) instead, the 1.5B's LM head (Q6_K, 151936 x 1536, int8 x of 2688 bytes a row: 9 rows fit, not
// 10) took 13.3 ms at k = 10 (two chunks of 5 rows, each decoding every weight row) against 11.9 with 4 KB (one chunk);
// 2 KB the same as 4; the other shapes and k unchanged (`python -m ultrafast.benchmarks.kernel_shapes --ks
// 8,10,12,14,16 --activation-bits 8`, AMD EPYC with 32 KB L1, 2026-12-05).
constexpr int64_t L1_WEIGHT_ROOM = 4 * 1024;
int64_t l1_bytes() {
  static const int64_t bytes = [] {
    const long got = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    return got >= 16 * 1024 && got <= 1024 * 1024 ? (int64_t)got : (int64_t)32 * 1024;  // unknown: Zen 4's
  }();
  return bytes;
}
// The layouts that take that tile: those with eight weight vectors a group (Q6_K's, with four, take two weight rows
// instead: TileRows).
template <class T>
constexpr bool one_row_tiles = T::NVEC > 4;
// Activation rows of the NW_MAX-row tile: R_MAX for the layouts with eight weight vectors a group (16 of them in
// registers for the two weight rows), 2 * R_MAX for Q6_K's four (16 accumulators; the 1.5B's down projections, whose
// x does not fit L1, and the LM head at int16: `python -m ultrafast.benchmarks.kernel_shapes`, alternated with 4, the
// down projection at int8 0.65 against 0.71-0.74 ms at k = 8, the LM head at int16 12.1 against 14.5-14.8 ms).
// With int8 x, Q6_K's repacked layout takes 3 * R_MAX (24 accumulators, 8 weight vectors, one x vector and the two
// chains fill the 32 registers) in place of the one-row tiles it took before: each x vector loaded feeds two
// products, and a decode (3 loads, 12 logic ops, the scales' convert) twelve. The VNNI unit alone (1 thread, 256 x
// 1536 Q6_K rows resident in L2, checksums of all outputs unchanged), microseconds a call, one-row tiles against
// this: k = 5 23.2 / 17.7, 8 30.9 / 26.5, 10 38.1 / 33.0, 12 49.4 / 39.2, 16 62.0 / 55.5; 128 x 8960 at k = 10 109 /
// 103. The 1.5B's LM head (151936 x 1536, from memory, 2 threads), two runs of `python -m
// ultrafast.benchmarks.kernel_shapes --activation-bits 8` alternated with the build before: k = 8 8.8 / 9.3 ms
// against 11.2 / 10.2, k = 10 10.7 / 11.0 against 12.2 / 12.1, k = 16 18.5 / 18.4 against 19.7 / 19.2.
template <class T, bool X8>
struct TileRows {
  static constexpr int value = R_MAX;
};
template <bool X8>
struct TileRows<KQ6K, X8> {
  static constexpr int value = 2 * R_MAX;
};
template <bool X8>
struct TileRows<KQ6KR, X8> {
  static constexpr int value = X8 ? 3 * R_MAX : 2 * R_MAX;
};

// One fp32 accumulator per (weight row, activation row). Every tile holds at least two independent outputs
// (NW_MAX weight rows, or several activation rows), and a group's integer products take several times the
// FMA latency, so one chain per output does not wait on it; two chains per output (even and odd groups),
// used before, cost registers that the tile's x operands need instead. Measured with a 1-thread harness
// (Q4_K 512 x 1536, L2-resident, k = 8): 8.7 -> 8.1 cycles per 128-value product at int16, 6.3 -> 5.8 at
// int8; k = 1 unchanged. On the 1.5B's shapes, 2 threads, weights from memory: 2-11% less time at k = 2..8.

// Prefetch distances (bytes ahead in the weight stream) when a call reads each weight row from start to
// end: into L1 PF_NEAR ahead, into L2 PF_FAR ahead. Measured on the 1.5B model (k = 1, median of 100
// steps, runs alternated): L1 only at 3072: 39-42 ms per step; with L2 at 12288 and L1 at 2048: 37-38 ms.
// The down projection (K = 8960) gains most: streamed from DRAM 20 -> 27 GB/s. The L2 prefetch is only
// issued when the call's rows hold at least PF_FAR_MIN bytes: on SmolLM2's small matrices (70-550 KB) it
// made steps slower (6.1 -> 6.5 ms), 12 KB past a thread's share being a large part of it. The L1 prefetch
// is not bounded by the call's rows: past them lie the next rows or the next tensor of the file.
constexpr int64_t PF_NEAR = 2048, PF_FAR = 12288, PF_FAR_MIN = 512 * 1024;

// One kernel block of NW weight rows (row w at p + w * rb) against R activation rows. acc[w * R + r].
// Per output the operations are, per group: the integer dot products (exact, in any order), one convert,
// one mul (d_w * s), one fma into its accumulator; (Q4_1) one fma for the mins; (Q4_K) after the block one
// fnmadd for its mins. The same for every NW and R.
// Per activation row the integer products run as two chains per weight row, one for x's high bytes and one
// for its low bytes, joined as (hi << 8) + lo: half the dependency chain of hi, shift, lo in one, and each x
// vector is loaded once into a register for the NW weight rows (one live at a time). Measured against the
// single chain with the x vectors of a group pinned (1 thread, weights from memory, ns per 128-value product
// at k = 1 / 4 / 16): Q6_K 1536 x 8960 4.22 / 3.06 / 2.69 -> 4.18 / 2.73 / 2.63; Q8_0 1536 x 576
// 11.57 / 4.77 / 4.90 -> 9.99 / 4.39 / 4.35.
// c[w] += W[w][v] . xv for the NW weight rows (v == 0 starts the chains at `start`), xv loaded once into a register
// for all of them (left to itself the compiler folds the load into each vpdpbusd, reading it NW times).
template <int NW, int NV>
UF_INLINE void dot_step(const __m512i (&W)[NW][NV], int v, __m512i xv, __m512i* c, __m512i start) {
  if constexpr (NW > 1) __asm__("" : "+v"(xv));
#pragma GCC unroll 4
  for (int w = 0; w < NW; ++w) c[w] = _mm512_dpbusd_epi32(v == 0 ? start : c[w], W[w][v], xv);
}

// n: the blocks of a TAIL_MASKED group (a row's last, if partial; 16: whole); unread by the other types.
// The loops over the R activation rows unroll up to R2_MAX: unrolled only partly, acc[w * R + r] is indexed at run
// time and lives in memory. With 8 (before), Q4_K's one-row tile at R = 10 / 11 took 0.73 / 0.80 ms on the 1.5B's gate
// projection (8960 x 1536, int8) against 0.71 at R = 12; unrolled fully 0.59 / 0.64 (`python -m
// ultrafast.benchmarks.kernel_shapes --activation-bits 8`).
template <class T, int NW, int R, bool X8>
UF_INLINE void kblock(const uint8_t* p, int64_t rb, const uint8_t* xg, int64_t ldx, __m512* acc, int n = 16) {
  using X = XGN<T::NVEC, X8>;
  typename T::Ctx ctx[NW];
#pragma GCC unroll 4
  for (int w = 0; w < NW; ++w) ctx[w] = T::context(p + w * rb, n);
#pragma GCC unroll 4
  for (int g = 0; g < T::GPK; ++g) {
    __m512i W[NW][T::NVEC];
    __m512 dvec[NW], mvec[NW];
#pragma GCC unroll 4
    for (int w = 0; w < NW; ++w) T::decode(p + w * rb, g, ctx[w], W[w], dvec[w], mvec[w]);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const X* xr = reinterpret_cast<const X*>(xg + r * ldx) + g;
      __m512i ia[NW], il[NW];  // the chains of x's high bytes and of its low bytes
      // The block's integer offset is where a chain starts (int8 x: the one chain; int16: the low bytes'), not an add
      // after it: the same int32 sum (exact in any order), one vector op fewer per product. Q6_K's repacked layout at
      // int8, 512 x 1536, L2-resident, 1 thread (a harness over this unit, Intel Xeon, three runs alternated; every
      // output's bits unchanged): k = 10 57.7-61.2 against 61.1-64.9 us, k = 16 98-104 against 101-112.
      const __m512i start = T::IOFF != 0 ? xr->ioff : _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int v = 0; v < T::NVEC; ++v) {
        dot_step<NW>(W, v, xr->xh[v], ia, X8 ? start : _mm512_setzero_si512());
        if constexpr (!X8) dot_step<NW>(W, v, xr->xl[v], il, start);
      }
      if constexpr (!X8) {
#pragma GCC unroll 4
        for (int w = 0; w < NW; ++w) ia[w] = _mm512_add_epi32(_mm512_slli_epi32(ia[w], 8), il[w]);
      }
      __m512 s = xr->s;
      if constexpr (NW > 1) __asm__("" : "+v"(s));
#pragma GCC unroll 4
      for (int w = 0; w < NW; ++w) {
        const __m512 t = _mm512_mul_ps(dvec[w], s);
        __m512& a = acc[w * R + r];
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[w]), t, a);
        if constexpr (T::MINS > 0) a = _mm512_fmadd_ps(mvec[w], xr->xsf, a);
      }
    }
  }
  if constexpr (T::MINS < 0) {  // after the last group
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xsf = reinterpret_cast<const X*>(xg + r * ldx)->xsf;
#pragma GCC unroll 4
      for (int w = 0; w < NW; ++w) {
        __m512& a = acc[w * R + r];
        a = _mm512_fnmadd_ps(ctx[w].m, xsf, a);
      }
    }
  }
}

// The weight stream ahead of the LEN bytes at p of each of the NW rows (p + w * rb): PF_NEAR ahead into L1 and, when
// far, PF_FAR ahead into L2.
template <int NW, int LEN>
UF_INLINE void prefetch_ahead(const uint8_t* p, int64_t rb, bool far) {
#pragma GCC unroll 4
  for (int w = 0; w < NW; ++w) {
    const uint8_t* q = p + w * rb;
#pragma GCC unroll 16
    for (int o = 0; o < LEN; o += 64) {
      _mm_prefetch((const char*)(q + PF_NEAR + o), _MM_HINT_T0);
      if (far) _mm_prefetch((const char*)(q + PF_FAR + o), _MM_HINT_T1);
    }
  }
}

// NW weight rows (wr, wr + rb, ...) against R activation rows: y[r * ldy + w]. The weight stream is
// prefetched ahead in each row (rows are read whole and in address order, so what lies ahead is the rest of
// the row, then the next rows).
template <class T, int NW, int R, bool X8>
__attribute__((noinline)) void run(const uint8_t* __restrict wr, int64_t rb, int64_t K, const uint8_t* __restrict xg,
                                   int64_t ldx, float* y, int64_t ldy, bool far) {
  const int64_t nfull = K / T::KB;
  constexpr int64_t XB = (int64_t)sizeof(XGN<T::NVEC, X8>) * T::GPK;  // x bytes per kernel block
  __m512 acc[NW * R];
#pragma GCC unroll 32
  for (int i = 0; i < NW * R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nfull; ++b) {
    const uint8_t* p = wr + b * T::KBYTES;
    prefetch_ahead<NW, T::KBYTES>(p, rb, far);
    kblock<T, NW, R, X8>(p, rb, xg + b * XB, ldx, acc);
  }
  if constexpr (T::TAIL == TAIL_MASKED) {  // a last group of fewer blocks
    if (nfull * T::KB < K)
      kblock<T, NW, R, X8>(wr + nfull * T::KBYTES, rb, xg + nfull * XB, ldx, acc, (int)((K - nfull * T::KB) / 32));
  } else if constexpr (T::TAIL == TAIL_FILE) {  // the rest in the file's layout: T::Tail's groups (the last partial?)
    using U = typename T::Tail;
    const uint8_t* wt = wr + nfull * T::KBYTES;
    const uint8_t* xt = xg + nfull * XB;
    const int64_t rest = K - nfull * T::KB;
    for (int64_t g = 0; g * U::KB < rest; ++g) {
      prefetch_ahead<NW, U::KBYTES>(wt + g * U::KBYTES, rb, far);
      kblock<U, NW, R, X8>(wt + g * U::KBYTES, rb, xt + g * (int64_t)sizeof(XGN<U::NVEC, X8>), ldx, acc,
                           (int)((rest - g * U::KB) / 32));
    }
  }
#pragma GCC unroll 4
  for (int w = 0; w < NW; ++w)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      y[r * ldy + w] = _mm512_reduce_add_ps(acc[w * R + r]);
    }
}

// f(Rows<R>{}) for the compile-time R equal to rr (R0 <= rr), or R1 when rr >= R1.
template <int N>
struct Rows {
  static constexpr int value = N;
};
template <int R0, int R1, class F>
UF_INLINE void with_rows(int64_t rr, F&& f) {
  if constexpr (R0 < R1) {
    if (rr == R0) return f(Rows<R0>{});
    with_rows<R0 + 1, R1>(rr, f);
  } else {
    f(Rows<R1>{});
  }
}

// run() on the widest weight tile that fits the weight rows [n, ne) left (NW_MAX, or 1 for the last of an odd
// range) against activation rows [r0, r0 + rr), rr <= RT; returns the number of weight rows done.
template <class T, int NWT, int RT, bool X8>
UF_INLINE int64_t run_tile(const uint8_t* xg, int64_t ldx, int64_t r0, int64_t rr, int64_t K, const uint8_t* w,
                           int64_t rb, float* y, int64_t ldy, int64_t n, int64_t ne, bool far) {
  auto go = [&](auto NWc) {
    constexpr int NW = decltype(NWc)::value;
    with_rows<1, RT>(rr, [&](auto R) {
      run<T, NW, decltype(R)::value, X8>(w + n * rb, rb, K, xg + r0 * ldx, ldx, y + r0 * ldy + n, ldy, far);
    });
    return (int64_t)NW;
  };
  return ne - n >= NWT ? go(Rows<NWT>{}) : go(Rows<1>{});
}

// Weight rows [n0, n1), two schedules of the same run() (so every output gets the same operations in the same
// order whichever is taken):
// - Few activation rows (decode, verification: up to 2 * R_MAX, or as many as keep their prepared x within
//   WHOLE_ROWS_X): each tile of weight rows is read whole from memory by run(), once per chunk of `per` activation
//   rows (the later chunks find the tile's bytes in L1/L2).
// - More (prefill): tiles of weight rows of ~256 KB, read from memory once and kept in L2, each swept by every
//   chunk of `per` activation rows. (A K-panelled schedule that kept the partial sums of all rows in memory
//   between panels ran at 12.6-14.7 cycles per 128-value product on the 1.5B's shapes at k = 512; this one
//   at 8.7-10.4, 1 thread.)
// The schedule below with tiles of NWT weight rows x up to RT activation rows; whole: rows read whole (else the
// weight-tiled schedule); per: the activation rows of a chunk (<= RT, `rows_per_chunk`).
template <class T, int NWT, int RT, bool X8>
bool schedule(const uint8_t* xg, int64_t ldx, int64_t k, int64_t K, const uint8_t* w, int64_t rb, float* y,
              int64_t ldy, int64_t n0, int64_t n1, bool whole, int64_t per) {
  if (whole) {  // all rows' x stays in L2 (L1): whole rows, chunks of `per` rows
    const bool far = (n1 - n0) * rb >= PF_FAR_MIN;
    for (int64_t n = n0, step = 0; n < n1; n += step)
      for (int64_t r0 = 0; r0 < k; r0 += per)
        step = run_tile<T, NWT, RT, X8>(xg, ldx, r0, k - r0 < per ? k - r0 : per, K, w, rb, y, ldy, n, n1, far);
    return true;
  }
  // Prefill: tiles of weight rows of about TILE_BYTES (streamed from memory once, then kept in L2), each
  // swept by every chunk of `per` activation rows (whose x stays in L1/L2 while it meets the tile's rows).
  constexpr int64_t TILE_BYTES = 256 * 1024;
  int64_t G = TILE_BYTES / rb;
  G = G < NW_MAX ? NW_MAX : G / NW_MAX * NW_MAX;
  for (int64_t nt = n0; nt < n1; nt += G) {
    const int64_t ne = nt + G < n1 ? nt + G : n1;
    for (int64_t r0 = 0; r0 < k; r0 += per)
      for (int64_t n = nt; n < ne;)
        n += run_tile<T, NWT, RT, X8>(xg, ldx, r0, k - r0 < per ? k - r0 : per, K, w, rb, y, ldy, n, ne, false);
  }
  return true;
}

// Chunks of at most `most` of the k activation rows, as even as they can be: the rows of each.
static inline int64_t rows_per_chunk(int64_t k, int64_t most) {
  const int64_t nch = (k + most - 1) / most;
  return (k + nch - 1) / nch;
}

// The tile and schedule for k activation rows (the tile never changes an output's arithmetic): the layouts of
// one_row_tiles take one weight row x up to R2_MAX activation rows when k > R_MAX and chunks of more than R_MAX rows
// keep their x within L1 less L1_WEIGHT_ROOM (whole rows while all of x fits there);
// every other case NW_MAX x TileRows, whole rows up to 2 * R_MAX activation rows or WHOLE_ROWS_X bytes of x.
template <class T, bool X8>
bool rows(const uint8_t* xg, int64_t ldx, int64_t k, int64_t K, const uint8_t* w, int64_t rb, float* y,
          int64_t ldy, int64_t n0, int64_t n1) {
  if constexpr (one_row_tiles<T>) {
    const int64_t room = l1_bytes() - L1_WEIGHT_ROOM, fit = ldx > 0 ? room / ldx : 0;  // rows whose x fits together
    if (k > R_MAX && fit > R_MAX) {
      const int64_t per = rows_per_chunk(k, fit < R2_MAX ? fit : R2_MAX);
      if (per > R_MAX)
        return schedule<T, 1, R2_MAX, X8>(xg, ldx, k, K, w, rb, y, ldy, n0, n1, k * ldx <= room, per);
    }
  }
  constexpr int RT = TileRows<T, X8>::value;
  return schedule<T, NW_MAX, RT, X8>(xg, ldx, k, K, w, rb, y, ldy, n0, n1,
                                     k <= 2 * R_MAX || k * ldx <= WHOLE_ROWS_X, rows_per_chunk(k, RT));
}

// A row's prepared x: its kernel blocks (the last maybe partial), or (TAIL_FILE) its whole kernel blocks and then
// T::Tail's groups of the rest; units: how many of each, bytes: what they take.
template <class T>
void x_units(int64_t K, int64_t* own, int64_t* tail) {
  if constexpr (T::TAIL == TAIL_FILE) {
    *own = K / T::KB;
    *tail = (K % T::KB + T::Tail::KB - 1) / T::Tail::KB;
  } else {
    *own = (K + T::KB - 1) / T::KB;
    *tail = 0;
  }
}
template <class T>
int64_t row_units_x(int64_t K) {
  int64_t own, tail;
  x_units<T>(K, &own, &tail);
  return own + tail;
}
template <class T, bool X8>
int64_t row_bytes_x(int64_t K) {
  int64_t own, tail;
  x_units<T>(K, &own, &tail);
  int64_t bytes = own * T::GPK * (int64_t)sizeof(XGN<T::NVEC, X8>);
  if constexpr (T::TAIL == TAIL_FILE) bytes += tail * (int64_t)sizeof(XGN<T::Tail::NVEC, X8>);
  return bytes;
}

}  // namespace

#define UF_VNNI_DISPATCH(qtype, CALL)                       \
  switch (qtype) {                                          \
    case QT_Q4_0: { using T = K32<QT_Q4_0>; CALL; break; }  \
    case QT_Q4_1: { using T = K32<QT_Q4_1>; CALL; break; }  \
    case QT_Q5_0: { using T = K32<QT_Q5_0>; CALL; break; }  \
    case QT_Q8_0: { using T = K32<QT_Q8_0>; CALL; break; }  \
    case QT_Q4_K: { using T = KQ4K; CALL; break; }          \
    case QT_Q4_K_R2: { using T = KQ4K2; CALL; break; }      \
    case QT_Q4_0_R16: { using T = KB16<QT_Q4_0>; CALL; break; } \
    case QT_Q4_1_R16: { using T = KB16<QT_Q4_1>; CALL; break; } \
    case QT_Q5_0_R16: { using T = KB16<QT_Q5_0>; CALL; break; } \
    case QT_Q8_0_R16: { using T = KB16<QT_Q8_0>; CALL; break; } \
    case QT_Q6_K: { using T = KQ6K; CALL; break; }          \
    case QT_Q6_K_R16: { using T = KQ6KR; CALL; break; }     \
    default: break;                                         \
  }

bool vnni_usable() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("avx2");
}

bool qmm_vnni_supports(int qtype) {
  switch (qtype) {
    case QT_Q4_0: case QT_Q4_1: case QT_Q5_0: case QT_Q8_0: case QT_Q4_K: case QT_Q6_K: return true;
    default: return is_vnni_layout(qtype);
  }
}

int64_t qmm_prep_bytes_vnni(int qtype, int64_t K, bool x8) {
  int64_t n = 0;
  if (x8) {
    UF_VNNI_DISPATCH(qtype, n = (row_bytes_x<T, true>(K)))
  } else {
    UF_VNNI_DISPATCH(qtype, n = (row_bytes_x<T, false>(K)))
  }
  return n;
}

int64_t qmm_prep_units_vnni(int qtype, int64_t K) {
  int64_t n = 0;
  UF_VNNI_DISPATCH(qtype, n = row_units_x<T>(K))
  return n;
}

template <bool X8>
void prep_range(int qtype, const float* x, int64_t K, uint8_t* xg, int64_t G0, int64_t G1) {
  switch (qtype) {
    case QT_Q6_K: prep_row_k<KQ6K, X8>(x, xg, G0, G1); break;
    case QT_Q6_K_R16: prep_row_k<KQ6KR, X8>(x, xg, G0, G1); break;
    case QT_Q4_K: prep_row_k<KQ4K, X8>(x, xg, G0, G1); break;
    case QT_Q4_K_R2: prep_row_lanes<KQ4K2, X8>(x, K, xg, G0, G1); break;
    case QT_Q4_0_R16: prep_row_lanes<KB16<QT_Q4_0>, X8>(x, K, xg, G0, G1); break;
    case QT_Q4_1_R16: prep_row_lanes<KB16<QT_Q4_1>, X8>(x, K, xg, G0, G1); break;
    case QT_Q5_0_R16: prep_row_lanes<KB16<QT_Q5_0>, X8>(x, K, xg, G0, G1); break;
    case QT_Q8_0_R16: prep_row_lanes<KB16<QT_Q8_0>, X8>(x, K, xg, G0, G1); break;
    case QT_Q4_0: prep_row32<K32<QT_Q4_0>, X8>(x, K, xg, G0, G1); break;
    case QT_Q4_1: prep_row32<K32<QT_Q4_1>, X8>(x, K, xg, G0, G1); break;
    case QT_Q5_0: prep_row32<K32<QT_Q5_0>, X8>(x, K, xg, G0, G1); break;
    case QT_Q8_0: prep_row32<K32<QT_Q8_0>, X8>(x, K, xg, G0, G1); break;
    default: break;
  }
}

void qmm_prep_vnni(int qtype, const float* x, int64_t K, uint8_t* xg, int64_t G0, int64_t G1, bool x8) {
  if (x8)
    prep_range<true>(qtype, x, K, xg, G0, G1);
  else
    prep_range<false>(qtype, x, K, xg, G0, G1);
}

bool qmm_rows_vnni(int qtype, const uint8_t* xg, int64_t k, int64_t K, const uint8_t* w, int64_t rb, float* y,
                   int64_t ldy, int64_t n0, int64_t n1, bool x8) {
  const int64_t ldx = qmm_prep_bytes_vnni(qtype, K, x8);
  bool ok = false;
  if (x8) {
    UF_VNNI_DISPATCH(qtype, ok = (rows<T, true>(xg, ldx, k, K, w, rb, y, ldy, n0, n1)))
  } else {
    UF_VNNI_DISPATCH(qtype, ok = (rows<T, false>(xg, ldx, k, K, w, rb, y, ldy, n0, n1)))
  }
  return ok;
}

int64_t vnni_dpbusd_chains(int64_t n) {
  __m512i x = _mm512_set1_epi8(3), w = _mm512_set1_epi8(5);
  __m512i a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);  // distinct, so the chains cannot be merged
  for (int64_t it = 0; it < n; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], x, w);
    __asm__ volatile("" : "+v"(x), "+v"(w));
  }
  __m512i s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_epi32(s, a[i]);
  return _mm512_reduce_add_epi32(s);
}

// 12 independent groups of kblock's arithmetic, register operands (no loads, no weight decode): per group NV vpdpbusd
// (int16 x: the high and the low bytes' chains, joined), then its fp step, a convert, a scale multiply and an fma, and
// with MINS Q4_K's fnmadd for the mins. NV = 4 without mins is a K-quant group of 256 values (two 128-value products:
// KQ6K, KQ6KR, KQ4K), NV = 8 with mins a paired layout's group of 512 (one product: KQ4K2; KB16's have no fnmadd, or
// Q4_1's fma). The loop count is what vnni_product_peak and vnni_paired_peak time.
template <bool X8, int NV, bool MINS>
int64_t group_chains(int64_t n) {
  __m512i w[NV], x[NV];
  for (int v = 0; v < NV; ++v) w[v] = _mm512_set1_epi8((char)(3 + v)), x[v] = _mm512_set1_epi8((char)(7 + v));
  __m512 d = _mm512_set1_ps(1e-9f), s = _mm512_set1_ps(1.0f), m = _mm512_set1_ps(1e-9f), xsf = _mm512_set1_ps(1.0f);
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps((float)i);
  for (int64_t it = 0; it < n; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) {
      // each group's operands are new: nothing is shared or hoisted. d and s too: with them fixed (s = 1) the compiler
      // folded and hoisted the scale multiply (d_w * s) out of the loop (48 vpdpbusd, 12 fma, no vmulps at int8), and
      // the probe read 80% of the peak where the kernels' instructions, which multiply per product, reach ~66% (on
      // Zen 4 fp32 multiplies and fmas take vpdpbusd's pipes, a vpdpbusd slot each: vnni_fma_beside)
      if constexpr (MINS)
        __asm__ volatile("" : "+v"(x[0]), "+v"(w[0]), "+v"(d), "+v"(s), "+v"(m), "+v"(xsf));
      else
        __asm__ volatile("" : "+v"(x[0]), "+v"(w[0]), "+v"(d), "+v"(s));
      __m512i ih = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], x[0]);
#pragma GCC unroll 8
      for (int v = 1; v < NV; ++v) ih = _mm512_dpbusd_epi32(ih, w[v], x[v]);
      if constexpr (!X8) {
        __m512i il = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], x[NV - 1]);
#pragma GCC unroll 8
        for (int v = 1; v < NV; ++v) il = _mm512_dpbusd_epi32(il, w[v], x[NV - 1 - v]);
        ih = _mm512_add_epi32(_mm512_slli_epi32(ih, 8), il);
      }
      a[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ih), _mm512_mul_ps(d, s), a[i]);
      if constexpr (MINS) a[i] = _mm512_fnmadd_ps(m, xsf, a[i]);
    }
  }
  float t = 0.0f;
  for (int i = 0; i < 12; ++i) t += _mm512_reduce_add_ps(a[i]);
  return (int64_t)t;
}

int64_t vnni_product_chains(int64_t n, bool x8) {
  return x8 ? group_chains<true, 4, false>(n) : group_chains<false, 4, false>(n);
}
int64_t vnni_paired_chains(int64_t n, bool x8) {
  return x8 ? group_chains<true, 8, true>(n) : group_chains<false, 8, true>(n);
}

// What an fp32 FMA costs beside vpdpbusd: `n` loops of 12 independent vpdpbusd, and with `fma` also 6 independent fp32
// FMAs (on zeros: no denormals), written in assembly so that the compiler can neither hoist nor spill them. Where the
// two share the multiply pipes (Zen 4: each FMA takes one vpdpbusd slot) the loop with FMAs takes 1.5x as long; where
// they do not, about as long. This is what bounds the kernels' arithmetic (vnni_product_chains) below the bare peak:
// their fp32 step (a scale multiply and an fma, Q4_K's mins one more) per 4-8 vpdpbusd. The bare loop is not
// vnni_dpbusd_chains' on purpose: the ratio needs both loops of one shape, the FMAs the only difference.
#define UF_Z(r) "vpxord %%zmm" #r ", %%zmm" #r ", %%zmm" #r "\n\t"
#define UF_DP(i) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define UF_FMA(i) "vfmadd231ps %%zmm28, %%zmm29, %%zmm" #i "\n\t"
#define UF_ZEROS \
  UF_Z(0) UF_Z(1) UF_Z(2) UF_Z(3) UF_Z(4) UF_Z(5) UF_Z(6) UF_Z(7) UF_Z(8) UF_Z(9) UF_Z(10) UF_Z(11) UF_Z(12) UF_Z(13) \
  UF_Z(14) UF_Z(15) UF_Z(16) UF_Z(17) UF_Z(28) UF_Z(29) UF_Z(30) UF_Z(31)
#define UF_CLOBBERS                                                                                                \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", \
      "xmm14", "xmm15", "xmm16", "xmm17", "xmm28", "xmm29", "xmm30", "xmm31", "cc"
int64_t vnni_fma_beside(int64_t n, bool fma) {
  if (n <= 0) return 0;
  if (fma)
    __asm__ volatile(UF_ZEROS "1:\n\t" UF_DP(0) UF_DP(1) UF_FMA(12) UF_DP(2) UF_DP(3) UF_FMA(13) UF_DP(4) UF_DP(5)
                         UF_FMA(14) UF_DP(6) UF_DP(7) UF_FMA(15) UF_DP(8) UF_DP(9) UF_FMA(16) UF_DP(10) UF_DP(11)
                             UF_FMA(17) "dec %0\n\tjnz 1b"
                     : "+r"(n)
                     :
                     : UF_CLOBBERS);
  else
    __asm__ volatile(UF_ZEROS "1:\n\t" UF_DP(0) UF_DP(1) UF_DP(2) UF_DP(3) UF_DP(4) UF_DP(5) UF_DP(6) UF_DP(7)
                         UF_DP(8) UF_DP(9) UF_DP(10) UF_DP(11) "dec %0\n\tjnz 1b"
                     : "+r"(n)
                     :
                     : UF_CLOBBERS);
  return n;
}
// What a 64-byte load costs beside vpdpbusd: `n` loops of 12 independent vpdpbusd, their x operands from registers
// (vnni_fma_beside's bare loop) or, with `mem`, each from its own 64 bytes of an L1-resident buffer (as the one-row
// tile's products read x: one load a vpdpbusd). Where loads bind beside the multiplies (the Intel Xeon: 4.4 against
// 6.5 G/s, 1 thread) the loop with loads takes ~1.5x as long; where they do not, about as long (on Zen 4 halving the
// kernels' x loads changed nothing, above; this probe not yet run there).
#define UF_DPM(i) "vpdpbusd " #i "*64(%1), %%zmm30, %%zmm" #i "\n\t"
int64_t vnni_load_beside(int64_t n, bool mem) {
  if (!mem || n <= 0) return vnni_fma_beside(n, false);
  alignas(64) uint8_t x[12 * 64];
  for (int i = 0; i < 12 * 64; ++i) x[i] = (uint8_t)i;
  __asm__ volatile(UF_ZEROS "1:\n\t" UF_DPM(0) UF_DPM(1) UF_DPM(2) UF_DPM(3) UF_DPM(4) UF_DPM(5) UF_DPM(6) UF_DPM(7)
                       UF_DPM(8) UF_DPM(9) UF_DPM(10) UF_DPM(11) "dec %0\n\tjnz 1b"
                   : "+r"(n)
                   : "r"(x), "m"(*(const uint8_t(*)[12 * 64])x)
                   : UF_CLOBBERS);
  return n;
}
#undef UF_DPM
#undef UF_Z
#undef UF_DP
#undef UF_FMA
#undef UF_ZEROS
#undef UF_CLOBBERS

}  // namespace ultrafast

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86-64 GCC/clang

namespace ultrafast {
bool vnni_usable() { return false; }
bool qmm_vnni_supports(int) { return false; }
int64_t qmm_prep_bytes_vnni(int, int64_t, bool) { return 0; }
int64_t qmm_prep_units_vnni(int, int64_t) { return 0; }
void qmm_prep_vnni(int, const float*, int64_t, uint8_t*, int64_t, int64_t, bool) {}
bool qmm_rows_vnni(int, const uint8_t*, int64_t, int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t,
                   int64_t, bool) {
  return false;
}
int64_t vnni_dpbusd_chains(int64_t) { return 0; }
int64_t vnni_product_chains(int64_t, bool) { return 0; }
int64_t vnni_paired_chains(int64_t, bool) { return 0; }
int64_t vnni_fma_beside(int64_t, bool) { return 0; }
int64_t vnni_load_beside(int64_t, bool) { return 0; }
}  // namespace ultrafast

#endif

// The VNNI kernels' layouts (KQ4K2, KB16, KQ6KR), plain C++ (no vector instructions): made once per weight, at load.
namespace ultrafast {
namespace {

void repack_q4k_pairs(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t K) {
  const int64_t rb = K / 256 * 144, npairs = K / 512;
  for (int64_t n = 0; n < rows; ++n) {
    const uint8_t* r = src + n * rb;
    uint8_t* o = dst + n * rb;
    for (int64_t P = 0; P < npairs; ++P) {
      const uint8_t* s = r + P * 288;
      uint8_t* d = o + P * 288;
      for (int i = 0; i < 16; ++i) d[i] = s[i], d[16 + i] = s[144 + i];  // the two headers as they are
      for (int l = 0; l < 16; ++l) {
        const uint8_t* qs = s + 144 * (l / 8) + 16;
        const int sb = l % 8;
        // value i of sub-block sb: qs byte 32 * (sb / 2) + i, low nibble for even sb, high for odd
        auto val = [&](int i) { return (qs[32 * (sb / 2) + i] >> (4 * (sb % 2))) & 15; };
        for (int u = 0; u < 4; ++u)
          for (int j = 0; j < 4; ++j) d[32 + 64 * u + 4 * l + j] = (uint8_t)(val(8 * u + j) | val(8 * u + 4 + j) << 4);
      }
    }
    for (int64_t i = npairs * 288; i < rb; ++i) o[i] = r[i];  // an odd last super-block as it is
  }
}

// Q4_0 / Q4_1 / Q5_0 / Q8_0 (bb bytes a block: fp16 d, Q4_1 fp16 m, Q5_0 32 fifth bits, then the values) in
// groups of 16 blocks, the blocks past a row's last whole group as they are (see KB16).
void repack_lanes(int qtype, int bb, const uint8_t* src, uint8_t* dst, int64_t rows, int64_t K) {
  const int64_t nblk = K / 32, rb = nblk * bb;
  const int head = qtype == QT_Q4_1 ? 4 : qtype == QT_Q5_0 ? 6 : 2;  // a block's bytes before its values
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = nblk / 16 * 16 * bb; i < rb; ++i) dst[r * rb + i] = src[r * rb + i];  // the rest as it is
    for (int64_t g0 = 0; g0 + 16 <= nblk; g0 += 16) {
      const uint8_t* s = src + r * rb + g0 * bb;
      uint8_t* d = dst + r * rb + g0 * bb;
      // value i (0..31) of block l as the kernels multiply it: Q4 the nibble, Q5_0 without its fifth bit, Q8_0 + 128
      auto val = [&](int l, int i) -> int {
        const uint8_t* q = s + l * bb + head;
        if (qtype == QT_Q8_0) return q[i] ^ 0x80;
        return i < 16 ? q[i] & 15 : q[i - 16] >> 4;
      };
      for (int l = 0; l < 16; ++l) d[2 * l] = s[l * bb], d[2 * l + 1] = s[l * bb + 1];  // the d
      int off = 32;
      if (qtype == QT_Q4_1) {  // the m
        for (int l = 0; l < 16; ++l) d[off + 2 * l] = s[l * bb + 2], d[off + 2 * l + 1] = s[l * bb + 3];
        off += 32;
      }
      if (qtype == QT_Q5_0) {  // mask v, bit 4l + j: the fifth bit of value 4v + j of block l
        uint64_t mask[8] = {};
        for (int l = 0; l < 16; ++l) {
          uint32_t qh;
          __builtin_memcpy(&qh, s + l * bb + 2, 4);
          for (int v = 0; v < 8; ++v)
            for (int j = 0; j < 4; ++j) mask[v] |= (uint64_t)(qh >> (4 * v + j) & 1) << (4 * l + j);
        }
        __builtin_memcpy(d + off, mask, 64);
        off += 64;
      }
      if (qtype == QT_Q8_0) {  // chunk v, byte 4l + j: value 4v + j of block l
        for (int v = 0; v < 8; ++v)
          for (int l = 0; l < 16; ++l)
            for (int j = 0; j < 4; ++j) d[off + 64 * v + 4 * l + j] = (uint8_t)val(l, 4 * v + j);
      } else {  // chunk u, byte 4l + j: values 8u + j (low nibble) and 8u + 4 + j (high) of block l
        for (int u = 0; u < 4; ++u)
          for (int l = 0; l < 16; ++l)
            for (int j = 0; j < 4; ++j)
              d[off + 64 * u + 4 * l + j] = (uint8_t)(val(l, 8 * u + j) | val(l, 8 * u + 4 + j) << 4);
      }
    }
  }
}

// Q6_K's super-blocks in KQ6KR's layout.
void repack_q6k(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t K) {
  const int64_t nsb = rows * (K / 256);
  for (int64_t b = 0; b < nsb; ++b) {
    const uint8_t* s = src + 210 * b;
    uint8_t* d = dst + 210 * b;
    // value i (0..63 unsigned) of the super-block, as ggml's dequantize_row_q6_K reads it
    auto val = [&](int i) {
      const int h = i / 128, t = i % 128 / 32, l = i % 32;
      const int lo = (s[64 * h + l + 32 * (t & 1)] >> (4 * (t >> 1))) & 15;
      const int hi = (s[128 + 32 * h + l] >> (2 * t)) & 3;
      return lo | hi << 4;
    };
    for (int g = 0; g < 16; ++g)  // scale group g on lane g
      for (int j = 0; j < 4; ++j) {
        for (int c = 0; c < 2; ++c)
          d[64 * c + 4 * g + j] = (uint8_t)((val(16 * g + 8 * c + j) & 15) | (val(16 * g + 8 * c + 4 + j) & 15) << 4);
        int h = 0;
        for (int v = 0; v < 4; ++v) h |= (val(16 * g + 4 * v + j) >> 4) << (2 * v);
        d[128 + 4 * g + j] = (uint8_t)h;
      }
    for (int i = 192; i < 210; ++i) d[i] = s[i];  // the scales (already one per scale group, in order) and d
  }
}

}  // namespace

void qmm_repack_vnni(int qtype, const uint8_t* src, uint8_t* dst, int64_t rows, int64_t K) {
  TypeInfo ti;
  if (qtype == QT_Q4_K)
    repack_q4k_pairs(src, dst, rows, K);
  else if (qtype == QT_Q6_K)
    repack_q6k(src, dst, rows, K);
  else if (vnni_layout(qtype) > 0 && type_info(qtype, &ti))
    repack_lanes(qtype, ti.bytes, src, dst, rows, K);
}

}  // namespace ultrafast
