// Plain-C++ interface between the torch binding (qmatmul.cpp, compiled for the baseline ISA) and the
// AVX-512 translation unit (qmatmul_avx512.cpp, compiled with a target pragma). This header must not
// include any torch or standard-library template headers: anything inline instantiated inside the
// AVX-512 unit could otherwise be merged by the linker with the baseline copy and run on a CPU without
// AVX-512.
#pragma once
#include <stdint.h>

namespace ultrafast {

// Prefetch `bytes` from p into L2 (prefetcht1), a line at a time: the tiled schedules' next group of weight
// rows. static: each translation unit keeps its own copy (see above).
static inline void prefetch_l2(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

// GGML type ids (gguf.GGMLQuantizationType).
enum QType : int {
  QT_F32 = 0, QT_F16 = 1, QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q5_0 = 6, QT_Q8_0 = 8,
  QT_Q4_K = 12, QT_Q6_K = 14, QT_BF16 = 30,
  // Not GGML types: the VNNI kernels' own layouts of a type's bytes (qmm_repack_vnni), each id its type's + 100.
  // Q4_K in pairs of super-blocks; the 32-value-block types 16 blocks a group, one block per int32 lane; Q6_K its
  // 16 scale groups of a super-block one per lane, the values in lane order.
  QT_Q4_0_R16 = 102, QT_Q4_1_R16 = 103, QT_Q5_0_R16 = 106, QT_Q8_0_R16 = 108, QT_Q4_K_R2 = 112, QT_Q6_K_R16 = 114,
};

// Values and bytes per block of a GGML type (F32/F16/BF16: one value per "block").
struct TypeInfo {
  int block;
  int bytes;
  const char* name;
};
static inline bool type_info(int qtype, TypeInfo* ti) {
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
    // the VNNI kernels' layouts: the same bytes per block as the type they hold
    case QT_Q4_0_R16: *ti = {32, 18, "Q4_0_R16"}; return true;
    case QT_Q4_1_R16: *ti = {32, 20, "Q4_1_R16"}; return true;
    case QT_Q5_0_R16: *ti = {32, 22, "Q5_0_R16"}; return true;
    case QT_Q8_0_R16: *ti = {32, 34, "Q8_0_R16"}; return true;
    case QT_Q4_K_R2: *ti = {256, 144, "Q4_K_R2"}; return true;
    case QT_Q6_K_R16: *ti = {256, 210, "Q6_K_R16"}; return true;
    default: return false;
  }
}

// Each variant below provides the functions of kernel_variant.h's LinearOps for its types (prepared rows of
// *_prep_bytes bytes, 64-byte aligned).

// ---- portable path (scalar.cpp): every type, any CPU. A prepared row is x itself.
int64_t qmm_prep_bytes_scalar(int qtype, int64_t K, bool x8);
int64_t qmm_prep_units_scalar(int qtype, int64_t K);
void qmm_prep_scalar(int qtype, const float* x, int64_t K, uint8_t* xg, int64_t u0, int64_t u1, bool x8);
bool qmm_rows_scalar(int qtype, const uint8_t* xg, int64_t k, int64_t K, const uint8_t* w, int64_t rb, float* y,
                     int64_t ldy, int64_t n0, int64_t n1, bool x8);
void attn_group_scalar(const float* q, int G, const float* kc, const float* vc, int64_t L, int64_t head_dim,
                       float scale, float* scores, int64_t lds, float* out, int64_t P, const int32_t* extra,
                       const float* kc0, const float* vc0, int64_t P0);
// g[i] = silu(g[i]) * u[i] for i < n (libm's exp)
void silu_mul_scalar(float* g, const float* u, int64_t n);

// ---- AVX-512 fp32 path (qmatmul_avx512.cpp): every type.
// True when this CPU can run the AVX-512 kernels (F, BW, VL, DQ + FMA/F16C), checked at runtime.
bool avx512_usable();

// A prepared row holds x permuted to the packed weights' lane order, scaled by exact powers of two and
// zero-padded, then the per-block sums of x (block offsets/mins). One unit per row.
int64_t qmm_prep_bytes_avx512(int qtype, int64_t K, bool x8);
int64_t qmm_prep_units_avx512(int qtype, int64_t K);
void qmm_prep_avx512(int qtype, const float* x, int64_t K, uint8_t* xg, int64_t u0, int64_t u1, bool x8);
// y[r * ldy + n] = sum_i x[r][i] * W[n][i]  for r in [0, k), n in [n0, n1), from the prepared rows.
// W rows are `rb` bytes apart starting at `w`. Per output element the arithmetic depends only on
// (qtype, K, the row of W, the row of x): never on k, n0, n1 or the thread. Returns false only if a small
// scratch allocation failed. x8 is not supported (ignored; kernel_variant.cpp never asks it).
bool qmm_rows_avx512(int qtype, const uint8_t* xg, int64_t k, int64_t K, const uint8_t* w, int64_t rb, float* y,
                     int64_t ldy, int64_t n0, int64_t n1, bool x8);

// Causal attention of one query position for G <= 64 heads sharing one kv head: for each g,
// out[g*hd + d] = sum_j softmax_j(scale * q_g . k_j) v_j[d] over keys j < L. q holds the G query vectors
// (hd floats apart), kc/vc point at position 0 of the kv head (rows hd floats apart), scores has room for
// G rows of lds >= L + 16 floats. head_dim % 16 == 0. The result for a head depends only on its query
// vector, the L keys/values and L. Keys are cache rows 0..P-1, then rows extra[0..L-P-1] (a token tree: the
// ancestors of the query's node); extra == nullptr means P == L. A row's result is the same bits whether its
// keys are contiguous or listed, for the same key sequence. Rows r < P0 are read from kc0/vc0 where given (a
// sibling's cache holding the same rows: kernel_variant.h's AttentionOp).
void attn_group_avx512(const float* q, int G, const float* kc, const float* vc, int64_t L, int64_t head_dim,
                       float scale, float* scores, int64_t lds, float* out, int64_t P, const int32_t* extra,
                       const float* kc0, const float* vc0, int64_t P0);
// g[i] = silu(g[i]) * u[i] for i < n, 16 lanes at a time (activation_simd.h)
void silu_mul_avx512(float* g, const float* u, int64_t n);

// ---- AVX2 fp32 path (qmatmul_avx2.cpp): every type, the AVX-512 fp32 path's scheme in 8-lane registers,
// for CPUs without AVX-512. The same contract as qmm_rows_avx512 (not the same bits).
bool avx2_usable();  // AVX2 + FMA + F16C, checked at runtime
int64_t qmm_prep_bytes_avx2(int qtype, int64_t K, bool x8);
int64_t qmm_prep_units_avx2(int qtype, int64_t K);
void qmm_prep_avx2(int qtype, const float* x, int64_t K, uint8_t* xg, int64_t u0, int64_t u1, bool x8);
bool qmm_rows_avx2(int qtype, const uint8_t* xg, int64_t k, int64_t K, const uint8_t* w, int64_t rb, float* y,
                   int64_t ldy, int64_t n0, int64_t n1, bool x8);
// The multiply limit of the fp32 kernels here, measured: n iterations of 12 independent 8-lane FMA chains
// (12 * n instructions, 8 multiply-adds each) on the calling thread. Returns a value derived from the sums.
int64_t avx2_fma_chains(int64_t n);
// attn_group_avx512's contract, for head_dim % 8 == 0.
void attn_group_avx2(const float* q, int G, const float* kc, const float* vc, int64_t L, int64_t head_dim,
                     float scale, float* scores, int64_t lds, float* out, int64_t P, const int32_t* extra,
                     const float* kc0, const float* vc0, int64_t P0);
// silu_mul_avx512's contract, 8 lanes at a time
void silu_mul_avx2(float* g, const float* u, int64_t n);

// ---- AVX2 integer path (qmatmul_avx2_int8.cpp). x8 (avx2-int8): the quantized types in the file's layout and
// Q4_K / Q6_K also in the VNNI kernels' layouts made at load (QT_Q4_K_R2, QT_Q6_K_R16: layout_in_use), x
// quantized to int8 per super-block of 256 for Q4_K and Q6_K (llama.cpp's Q8_K), per block of 32 for Q4_0, Q4_1,
// Q5_0 and Q8_0 (its Q8_0 / Q8_1), vpmaddubsw/vpmaddwd integer sums. Not x8 (avx2-int16): the same types but Q6_K in
// the file's layout (qmm_avx2_int16_supports), x quantized to int16 (per super-block of 256 for the K-quants, per
// block of 32 for the others) and multiplied as two signed byte planes. The same contract as qmm_rows_avx512 (not
// the same bits).
bool qmm_avx2_int8_supports(int qtype);
bool qmm_avx2_int16_supports(int qtype);
int64_t qmm_prep_bytes_avx2_int8(int qtype, int64_t K, bool x8);
int64_t qmm_prep_units_avx2_int8(int qtype, int64_t K);
void qmm_prep_avx2_int8(int qtype, const float* x, int64_t K, uint8_t* xg, int64_t u0, int64_t u1, bool x8);
bool qmm_rows_avx2_int8(int qtype, const uint8_t* xg, int64_t k, int64_t K, const uint8_t* w, int64_t rb, float* y,
                        int64_t ldy, int64_t n0, int64_t n1, bool x8);
// The limit of that arithmetic, measured: 6 independent chains of vpmaddubsw summed as int16 by vpaddw, a vpmaddwd by
// the scales and a vpaddd per 8 of them, 12 n vpmaddubsw (each 32 multiply-adds of a weight byte and an int8 x) on the
// calling thread. Returns a value derived from the sums.
int64_t avx2_madd_chains(int64_t n);

// ---- AVX512-VNNI integer path (qmatmul_vnni.cpp): int16 activations (per 32-block scale; x8: int8, as
// llama.cpp), exact integer dot products with the file's quantized weights. Types Q4_0, Q4_1, Q5_0, Q8_0,
// Q4_K, Q6_K, and their layouts made at load (vnni_layout).
bool vnni_usable();                 // AVX-512 F/BW/VL/DQ + VNNI (+FMA/F16C), checked at runtime
bool qmm_vnni_supports(int qtype);  // the quantized types above
// Bytes of prepared activation data per row (a multiple of 64; x8: int8 activations, half the x bytes); xg must be
// 64-byte aligned.
int64_t qmm_prep_bytes_vnni(int qtype, int64_t K, bool x8);
// Quantize and lay out one row's units [G0, G1) (of qmm_prep_units_vnni: groups of 128 values, the K-quants'
// super-blocks of 256, the layouts' groups of 512 and then the file layout's groups of the rest); per row, so
// batch-invariant. x8: int8 activations (prep and rows must agree).
int64_t qmm_prep_units_vnni(int qtype, int64_t K);
void qmm_prep_vnni(int qtype, const float* x, int64_t K, uint8_t* xg, int64_t G0, int64_t G1, bool x8);
// y[r * ldy + n] for r in [0, k), n in [n0, n1); per element the arithmetic depends only on (qtype, K,
// weight row n, activation row r, x8). Returns false only if a scratch allocation failed.
bool qmm_rows_vnni(int qtype, const uint8_t* xg, int64_t k, int64_t K, const uint8_t* w, int64_t rb, float* y,
                   int64_t ldy, int64_t n0, int64_t n1, bool x8);
// The multiply limit, measured: n iterations of 12 independent vpdpbusd chains (12 * n instructions, each 64
// u8 x s8 multiply-adds) on the calling thread; the rate the units sustain, not one chain's latency. Returns a
// value derived from the sums so the work cannot be dropped.
// The VNNI kernels' own layout of qtype (its id, see QType), or -1 where they read the file's bytes.
static inline int vnni_layout(int qtype) {
  switch (qtype) {
    case QT_Q4_0: case QT_Q4_1: case QT_Q5_0: case QT_Q8_0: case QT_Q4_K: case QT_Q6_K: return qtype + 100;
    default: return -1;
  }
}
static inline bool is_vnni_layout(int qtype) { return qtype > 100 && vnni_layout(qtype - 100) == qtype; }
// Rows [rows, K values of qtype] -> the same bytes laid out as vnni_layout(qtype) (plain C++; made once, at load).
void qmm_repack_vnni(int qtype, const uint8_t* src, uint8_t* dst, int64_t rows, int64_t K);
int64_t vnni_dpbusd_chains(int64_t n);
// The kernels' own arithmetic at full rate: n iterations of 12 independent K-quant groups of 256 values (two
// 128-value products each), each the instructions kblock issues for one (weight row, activation row, group)
// with register operands (int16: 8 vpdpbusd in a high and a low chain, a shift and an add; int8: 4 vpdpbusd;
// then convert, the scale multiply and the fma). No loads, no weight decode: the ceiling of this numerics for
// Q4_K and Q6_K, below the multiply peak because on Zen 4 the fp32 step shares the multiply units (the
// 32-value-block types issue one fp32 step per 128 values, twice as many). Returns a value derived from the
// sums.
int64_t vnni_product_chains(int64_t n, bool x8);
int64_t vnni_paired_chains(int64_t n, bool x8);  // a paired layout's 512-value group (KQ4K2): 8 vpdpbusd, 3 fp32
int64_t vnni_fma_beside(int64_t n, bool fma);  // 12 vpdpbusd a loop (fma: and 6 fp32 FMAs)
int64_t vnni_load_beside(int64_t n, bool mem);  // 12 vpdpbusd a loop (mem: each x operand a 64-byte load from L1)

}  // namespace ultrafast
