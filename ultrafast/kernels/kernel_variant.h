// The seam where a kernel variant plugs in. The one fused decoder layer (decoder_layer.cpp) and the
// per-op bindings (qmatmul.cpp) never name an ISA: they ask for the linear ops of a weight type and the
// attention op, and get those of the path in force (kernel_variant.cpp):
//   vnni-int16   AVX512-VNNI integer kernels (qmatmul_vnni.cpp) for the quantized types, int16 or int8 x;
//   avx512-fp32  AVX-512 dequantize-in-register + FMA (qmatmul_avx512.cpp), every type;
//   avx2-fp32    the same scheme on AVX2 + FMA (qmatmul_avx2.cpp), every type, for CPUs without AVX-512;
//   avx2-int8    AVX2 integer kernels for int8 x (qmatmul_avx2_int8.cpp), the quantized types, where VNNI is not in use;
//   avx2-int16   the same kernels for int16 x, the quantized types but Q6_K's file layout (Q4_K and Q6_K in their
//                lane layouts), where avx2-fp32 is the fp32 path;
//   scalar       portable loops (scalar.cpp), every type, any CPU.
// A new variant (another ISA, an accelerator) is one more LinearOps table and one more case where the ops
// are chosen. Every variant keeps the batch-invariance contract: y[r][n] is one fixed sequence of
// operations that depends only on (type, K, weight row n, activation row r), never on how many rows a call
// holds, the split of rows between threads or which rows a thread gets.
// Plain C++ (no torch, no standard-library templates), like qmatmul_kernels.h.
#pragma once
#include <stdint.h>

namespace ultrafast {

struct LinearOps {
  const char* name;
  // Bytes of one prepared activation row: a multiple of 64, rows laid this far apart from a 64-byte aligned
  // base. x8: int8 activations (VNNI only).
  int64_t (*prep_bytes)(int qt, int64_t K, bool x8);
  // A row's preparation is cut into this many independent units (threads may share a row).
  int64_t (*prep_units)(int qt, int64_t K);
  // Prepare units [u0, u1) of the row x[0, K) into its prepared row xg. x8: int8 activations (VNNI only).
  void (*prep)(int qt, const float* x, int64_t K, uint8_t* xg, int64_t u0, int64_t u1, bool x8);
  // y[r * ldy + n] = sum_i x[r][i] * W[n][i] for the k prepared rows at xg and weight rows [n0, n1) (rows `rb`
  // bytes apart from w). False only when a scratch allocation failed.
  bool (*rows)(int qt, const uint8_t* xg, int64_t k, int64_t K, const uint8_t* w, int64_t rb, float* y,
               int64_t ldy, int64_t n0, int64_t n1, bool x8);
};

// Attention of one query position for G heads sharing one kv head over L keys (contract of attn_group_avx512
// in qmatmul_kernels.h, for any head_dim): key j is cache row j for j < P, row extra[j - P] after (a token
// tree's ancestors; extra == nullptr: P == L, the causal prefix). Rows r < P0 may be read from kc0/vc0 instead: a
// sibling sequence's cache that holds the very same rows (best-of-n candidates' shared prompt), so that a batch
// of siblings reads them once; kc0 == nullptr or P0 == 0: none. The result is the same bits either way.
using AttentionOp = void (*)(const float* q, int G, const float* kc, const float* vc, int64_t L, int64_t hd,
                             float scale, float* scores, int64_t lds, float* out, int64_t P, const int32_t* extra,
                             const float* kc0, const float* vc0, int64_t P0);

// g[i] = silu(g[i]) * u[i] for i < n: the feed-forward's gated activation; each element's result depends only
// on (g[i], u[i]).
using GatedActOp = void (*)(float* g, const float* u, int64_t n);

// The path requested for the process: auto (the fastest this CPU runs), fp32 (quantized types stay on the
// fp32 kernels at 16 bits: AVX-512, else AVX2), avx2 (the AVX2 kernels even where AVX-512 exists: the integer ones
// where they take the type, else fp32), avx2-fp32 (the AVX2 kernels, fp32 ones at 16 bits) or scalar.
// force_scalar is kept apart for tests that toggle it alone.
enum class PathRequest : int { Auto = 0, Fp32 = 1, Scalar = 2, Avx2 = 3, Avx2Fp32 = 4 };
void request_path(PathRequest p);
void force_scalar(bool on);

const char* path_in_use();  // "vnni-int16", "avx512-fp32", "avx2-fp32" or "scalar": the quantized linears' path
bool avx512_in_use();       // the AVX-512 kernels (fp32 linears, attention) are in use
// The ops for a linear of GGML type qt (x8: int8 activations) under the path in force; nullptr when the
// type is unknown, or x8 is asked of a path without int8 activations.
const LinearOps* linear_ops(int qt, bool x8);
// Why linear_ops(qt, x8) gave nullptr, for the error message.
const char* no_linear_ops_why(int qt, bool x8);
// The layout made at load (qmm_repack_vnni) that the ops in force for a linear of file type qt read (x8: int8
// activations), or -1 where they read the file's bytes: every quantized type's on the VNNI kernels; Q4_K's pairs of
// super-blocks on the AVX2 integer ones.
int layout_in_use(int qt, bool x8);
AttentionOp attention_op(int64_t hd);
GatedActOp silu_mul_op();

}  // namespace ultrafast
