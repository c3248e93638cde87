// The kernel variants behind the seam of kernel_variant.h, and the choice between them: the fastest the
// CPU runs unless the process asked for another (ULTRAFAST_KERNELS_PATH, set_kernels_path). Compiled for the
// baseline ISA; each variant's own unit checks nothing, so a variant is only handed out after the runtime
// CPU check that its ISA needs.
#include "kernel_variant.h"

#include <atomic>

#include "qmatmul_kernels.h"

namespace ultrafast {
namespace {

// The process-wide request (a path is a property of the process, like the thread count).
std::atomic<bool> g_force_scalar{false};
std::atomic<bool> g_force_fp32{false};
std::atomic<bool> g_force_avx2{false};

constexpr LinearOps kScalar{"scalar", qmm_prep_bytes_scalar, qmm_prep_units_scalar, qmm_prep_scalar,
                            qmm_rows_scalar};
constexpr LinearOps kAvx512{"avx512-fp32", qmm_prep_bytes_avx512, qmm_prep_units_avx512, qmm_prep_avx512,
                            qmm_rows_avx512};
constexpr LinearOps kAvx2{"avx2-fp32", qmm_prep_bytes_avx2, qmm_prep_units_avx2, qmm_prep_avx2, qmm_rows_avx2};
constexpr LinearOps kAvx2Int8{"avx2-int8", qmm_prep_bytes_avx2_int8, qmm_prep_units_avx2_int8, qmm_prep_avx2_int8,
                              qmm_rows_avx2_int8};
// the same kernels with 16-bit activations (their x8 argument false), for the types they multiply so
constexpr LinearOps kAvx2Int16{"avx2-int16", qmm_prep_bytes_avx2_int8, qmm_prep_units_avx2_int8, qmm_prep_avx2_int8,
                               qmm_rows_avx2_int8};
constexpr LinearOps kVnni{"vnni-int16", qmm_prep_bytes_vnni, qmm_prep_units_vnni, qmm_prep_vnni, qmm_rows_vnni};
// the same kernels with int8 activations: a table of its own, as the AVX2 ones, so that the ops name their width
constexpr LinearOps kVnni8{"vnni-int8", qmm_prep_bytes_vnni, qmm_prep_units_vnni, qmm_prep_vnni, qmm_rows_vnni};
const LinearOps* vnni_ops(bool x8) { return x8 ? &kVnni8 : &kVnni; }

bool avx512_cpu() {
  static const bool ok = avx512_usable();
  return ok;
}

bool vnni_cpu() {
  static const bool ok = avx512_usable() && vnni_usable();
  return ok;
}

bool avx2_cpu() {
  static const bool ok = avx2_usable();
  return ok;
}

bool vnni_in_use() {
  return vnni_cpu() && !g_force_scalar.load(std::memory_order_relaxed) &&
         !g_force_fp32.load(std::memory_order_relaxed) && !g_force_avx2.load(std::memory_order_relaxed);
}

// The fp32 linears of the path in force: AVX-512, else AVX2, else none (scalar).
const LinearOps* fp32_ops() {
  if (g_force_scalar.load(std::memory_order_relaxed)) return nullptr;
  if (avx512_cpu() && !g_force_avx2.load(std::memory_order_relaxed)) return &kAvx512;
  return avx2_cpu() ? &kAvx2 : nullptr;
}

// The AVX2 integer kernels for qt: with int8 activations (x8) where this CPU has AVX2, the path in force is not the
// scalar one and they multiply qt; with 16-bit ones where, besides, the fp32 linears in force are AVX2's (not AVX-512's)
// and the process did not ask for the fp32 kernels (`fp32`, `avx2-fp32`); else none.
const LinearOps* avx2_int_ops(int qt, bool x8) {
  if (fp32_ops() == nullptr || !avx2_cpu()) return nullptr;
  if (x8) return qmm_avx2_int8_supports(qt) ? &kAvx2Int8 : nullptr;
  return fp32_ops() == &kAvx2 && !g_force_fp32.load(std::memory_order_relaxed) && qmm_avx2_int16_supports(qt)
             ? &kAvx2Int16 : nullptr;
}

}  // namespace

void request_path(PathRequest p) {
  g_force_scalar.store(p == PathRequest::Scalar);
  g_force_fp32.store(p == PathRequest::Fp32 || p == PathRequest::Avx2Fp32);
  g_force_avx2.store(p == PathRequest::Avx2 || p == PathRequest::Avx2Fp32);
}

void force_scalar(bool on) { g_force_scalar.store(on); }

bool avx512_in_use() { return fp32_ops() == &kAvx512; }

const char* path_in_use() {
  if (vnni_in_use()) return kVnni.name;
  const LinearOps* f = fp32_ops();
  return f != nullptr ? f->name : kScalar.name;
}

const LinearOps* linear_ops(int qt, bool x8) {
  TypeInfo ti;
  if (!type_info(qt, &ti)) return nullptr;
  if (is_vnni_layout(qt)) {  // the layouts made at load: the VNNI kernels read them all, the AVX2 integer ones some
    return vnni_in_use() ? vnni_ops(x8) : avx2_int_ops(qt, x8);
  }
  if (qmm_vnni_supports(qt) && vnni_in_use()) return vnni_ops(x8);
  if (x8 && qmm_vnni_supports(qt)) return avx2_int_ops(qt, x8);  // int8 activations: the VNNI kernels, else AVX2's
  if (const LinearOps* i16 = avx2_int_ops(qt, x8)) return i16;  // 16-bit: AVX2's integer kernels where they take qt
  const LinearOps* f = fp32_ops();
  return f != nullptr ? f : &kScalar;
}

const char* no_linear_ops_why(int qt, bool x8) {
  TypeInfo ti;
  if (!type_info(qt, &ti)) return "unsupported GGML type";
  if (is_vnni_layout(qt))
    return "the kernels' own layouts (Q4_K_R2, *_R16) are read by the VNNI kernels and, where they take them, the AVX2 "
           "integer kernels, not by the path in use";
  return x8 ? "int8 activations need the AVX512-VNNI or the AVX2 integer kernels" : "no kernels for this type";
}

int layout_in_use(int qt, bool x8) {
  const int layout = vnni_layout(qt);
  if (layout < 0) return -1;
  const LinearOps* ops = linear_ops(layout, x8);
  // where the kernels in force for qt read the layout too; and Q6_K_R16 on avx2-int16, which does not take Q6_K's file
  // layout (its lanes would need an fp32 step per group there: Q6_K's own file layout stays on the fp32 kernels)
  return ops != nullptr && (ops == linear_ops(qt, x8) || ops == &kAvx2Int16) ? layout : -1;
}

AttentionOp attention_op(int64_t hd) {
  const LinearOps* f = fp32_ops();
  if (f == &kAvx512 && hd % 16 == 0) return attn_group_avx512;
  if (f == &kAvx2 && hd % 8 == 0) return attn_group_avx2;
  return attn_group_scalar;
}

GatedActOp silu_mul_op() {
  const LinearOps* f = fp32_ops();
  if (f == &kAvx512) return silu_mul_avx512;
  if (f == &kAvx2) return silu_mul_avx2;
  return silu_mul_scalar;
}

}  // namespace ultrafast
