// Per-thread scratch for the baseline units (qmatmul.cpp, decoder_layer.cpp): 64-byte aligned, grown on
// demand, never shrunk, reused by every call of the thread (a decode step would otherwise allocate and zero
// buffers per layer and per matmul). Not for the AVX-512 units (see qmatmul_kernels.h).
#pragma once
#include <stdint.h>
#include <stdlib.h>

namespace ultrafast {

struct Scratch {
  uint8_t* p = nullptr;
  size_t n = 0;
  ~Scratch() { free(p); }
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  // at least `bytes` bytes, or nullptr when the allocation failed
  uint8_t* get(size_t bytes) {
    if (bytes > n) {
      free(p);
      n = (bytes + 63) / 64 * 64;
      p = static_cast<uint8_t*>(aligned_alloc(64, n));
      if (!p) n = 0;
    }
    return p;
  }
};

}  // namespace ultrafast
