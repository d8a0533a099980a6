// The CUDA names kernels.cu uses, for a host C++ compiler: each block's threads are real
// threads meeting at a std::barrier for __syncthreads, blocks run one at a time (so a
// __shared__ array can be a static), and bf16/f16 convert with round-to-nearest-even as the
// device's __float2bfloat16_rn / __float2half_rn do. tests/device_ops.rs compiles
// kernels.cu with it (harness.cpp) and compares every kernel with spex's CPU twin.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <barrier>
#include <functional>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local Dim3 threadIdx, blockIdx;
inline Dim3 blockDim, gridDim;
inline std::barrier<> *block_barrier = nullptr;
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
using std::min;

struct __nv_bfloat16 {
  uint16_t bits;
};
struct __half {
  uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 x) {
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40)};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return {uint16_t(u >> 16)};
}
inline float __half2float(__half x) {
  _Float16 h;
  memcpy(&h, &x.bits, 2);
  return float(h);
}
inline __half __float2half_rn(float f) {
  _Float16 h = _Float16(f);  // IEEE round-to-nearest-even
  __half x;
  memcpy(&x.bits, &h, 2);
  return x;
}

// Runs `kernel` over a grid of blocks, one block at a time, each block's threads at once.
inline void launch(Dim3 grid, Dim3 block, const std::function<void()> &kernel) {
  gridDim = grid;
  blockDim = block;
  for (unsigned by = 0; by < grid.y; ++by) {
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      std::barrier<> barrier(block.x);
      block_barrier = &barrier;
      std::vector<std::thread> threads;
      for (unsigned t = 0; t < block.x; ++t) {
        threads.emplace_back([&, t] {
          blockIdx = {bx, by, 0};
          threadIdx = {t, 0, 0};
          kernel();
        });
      }
      for (auto &thread : threads) thread.join();
    }
  }
}
