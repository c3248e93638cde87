// The decoder layer in one OpenMP parallel region (decoder_layer.cpp); plain pointers, no torch.
#pragma once
#include <stdint.h>

#include "kernel_variant.h"

namespace ultrafast {

struct LayerArgs {
  int64_t T, d, f, n_heads, n_kv_heads, hd;
  float eps, scale;
  float* x;  // [T, d], updated in place
  const float *attn_norm, *ffn_norm;
  const uint8_t* w[7];  // wq, wk, wv, wo, w1 (gate), w3 (up), w2 (down): raw GGUF rows
  int64_t rb[7];        // row strides in bytes
  int qt[7];
  const LinearOps* ops[7];  // each linear's kernel variant (kernel_variant.h)
  AttentionOp attn;
  GatedActOp silu_mul;  // g = silu(g) * up
  const float *bq, *bk, *bv;  // or null
  int64_t nseg;
  const int64_t *starts, *lens;
  float *const *kc, *const *vc;  // per sequence: [n_kv_heads, max_len, hd] caches, rows contiguous
  const int64_t *ks0, *vs0;
  // Or null: sequence s may read its cache rows r < share_rows[s] from sequence share_src[s]'s caches (-1: its own),
  // which hold the very same rows (best-of-n candidates' shared prompt): the batch then reads them once.
  const int64_t *share_src, *share_rows;
  const float *cos, *sin;  // [T, hd]
  // A token tree (one sequence): row r attends cache rows 0..tree_keys[2r]-1, then the tree_keys[2r+1] rows
  // listed at tree_extra + tree_off[r] (its ancestors and itself). Null: causal, rows 0..position.
  const int64_t* tree_keys;
  const int32_t* tree_extra;
  const int64_t* tree_off;
  int nthreads;
  bool x8;  // int8 activations in the linears (else int16)
  // Tensor parallelism's all-reduce points: 0 runs the whole layer; 1 runs the attention half and writes wo's
  // output (this rank's partial sum) to `out` instead of adding it to x; 2 runs the feed-forward half on x (the
  // residual stream, already reduced) and writes down's output to `out`. x is left alone by 1 and 2.
  int part;
  float* out;  // [T, d], with part 1 or 2
};

// Runs the layer; false if a kernel ran out of memory.
bool decoder_layer(const LayerArgs& a);

}  // namespace ultrafast
