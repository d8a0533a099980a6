// spex's device-step kernels, compiled to PTX by build.rs (feature `cuda`) and launched by
// cuda.rs beside it; attention.rs and elementwise.rs hold each one's CPU twin, the same
// algorithm in Rust. Every kernel computes in f32 and rounds once, and every output element
// depends on its own row's inputs alone (batch invariance: engine::pipeline, "Exactness").
//
// decode_attention: one launch per layer for every row of a device step, each (row, head)
// reduced over its own pass's span from column 0 in a fixed order.
//
// Why one kernel: candle's composed attention (gather the spans, Q·Kᵀ, scale, mask, softmax,
// P·V) is about ten launches per layer, and it sums a row's scores over the spans of every
// pass present, so where the row's own span starts (and the GPU's reduction grouping with it)
// depends on the rows beside it. Here a row's arithmetic depends on nothing but its own query,
// span and optional extra column, so a token's pass has the same bits whether it ran alone
// (the baseline) or in a speculative step: batch invariance (engine::pipeline, "Exactness").
//
// Layout (all contiguous):
//   q       [heads, rows, head_dim]      this step's queries, after RoPE
//   keys    [kv_heads, cache_rows, head_dim], values alike: the layer's cache
//   k_step  [kv_heads, rows, head_dim], v_step alike: this step's own K/V
//   meta    [rows, 3] u32: span start (cache row), span length, extra column (a row of k_step
//           that follows the span, for a second candidate; 0xffffffff: none)
//   out     [rows, heads, head_dim]
// Grid (rows, heads), THREADS threads. The softmax is online over CHUNK columns at a time,
// chunks counted from the span's column 0, so a row's sums never depend on its span's place.

// Without nvcc (tests/device_ops.rs compiles this file as C++ with
// tests/kernels_host/shim.h, which defines the few CUDA names used here) the CUDA headers are
// not read.
#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif
#include <stdint.h>

#define THREADS 128
#define CHUNK 1024
#define MAX_HEAD_DIM 256
#define PER_THREAD (MAX_HEAD_DIM / THREADS)
#define NO_EXTRA 0xffffffffu

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float x) {
  return __float2half_rn(x);
}

// A fixed tree over the block's THREADS values: the same grouping for every row.
__device__ __forceinline__ float block_max(float v, float *scratch) {
  const int t = threadIdx.x;
  scratch[t] = v;
  __syncthreads();
  for (int s = THREADS / 2; s > 0; s >>= 1) {
    if (t < s) scratch[t] = fmaxf(scratch[t], scratch[t + s]);
    __syncthreads();
  }
  const float r = scratch[0];
  __syncthreads();
  return r;
}

__device__ __forceinline__ float block_sum(float v, float *scratch) {
  const int t = threadIdx.x;
  scratch[t] = v;
  __syncthreads();
  for (int s = THREADS / 2; s > 0; s >>= 1) {
    if (t < s) scratch[t] = scratch[t] + scratch[t + s];
    __syncthreads();
  }
  const float r = scratch[0];
  __syncthreads();
  return r;
}

template <typename T>
__device__ void decode_attention(const T *__restrict__ q, const T *__restrict__ keys,
                                 const T *__restrict__ values, const T *__restrict__ k_step,
                                 const T *__restrict__ v_step, const uint32_t *__restrict__ meta,
                                 T *__restrict__ out, int rows, int heads, int kv_heads,
                                 int cache_rows, int head_dim, float scale) {
  __shared__ float qs[MAX_HEAD_DIM];
  __shared__ float p[CHUNK];
  __shared__ float scratch[THREADS];
  const int row = blockIdx.x, head = blockIdx.y, t = threadIdx.x;
  const int kv = head / (heads / kv_heads);
  const uint32_t start = meta[row * 3], len = meta[row * 3 + 1], extra = meta[row * 3 + 2];
  const int total = (int)len + (extra != NO_EXTRA ? 1 : 0);
  const size_t cache_base = (size_t)kv * cache_rows + start;
  const size_t step_base = ((size_t)kv * rows + (extra != NO_EXTRA ? extra : 0)) * head_dim;
  for (int d = t; d < head_dim; d += THREADS) {
    qs[d] = to_f32(q[((size_t)head * rows + row) * head_dim + d]);
  }
  __syncthreads();
  float acc[PER_THREAD];
  for (int i = 0; i < PER_THREAD; ++i) acc[i] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int c0 = 0; c0 < total; c0 += CHUNK) {
    const int n = min(CHUNK, total - c0);
    float local_max = -INFINITY;
    for (int j = t; j < n; j += THREADS) {
      const int col = c0 + j;
      const T *k = col < (int)len ? keys + (cache_base + col) * head_dim : k_step + step_base;
      float s = 0.0f;
      for (int d = 0; d < head_dim; ++d) s += qs[d] * to_f32(k[d]);
      s *= scale;
      p[j] = s;
      local_max = fmaxf(local_max, s);
    }
    const float m_new = fmaxf(m, block_max(local_max, scratch));
    float local_sum = 0.0f;
    for (int j = t; j < n; j += THREADS) {
      const float e = expf(p[j] - m_new);
      p[j] = e;
      local_sum += e;
    }
    const float chunk_sum = block_sum(local_sum, scratch);  // also publishes p
    const float rescale = expf(m - m_new);                  // 0 on the first chunk
    l = l * rescale + chunk_sum;
    for (int i = 0; i < PER_THREAD; ++i) {
      const int d = t + i * THREADS;
      if (d >= head_dim) break;
      float a = acc[i] * rescale;
      for (int j = 0; j < n; ++j) {
        const int col = c0 + j;
        const T *v = col < (int)len ? values + (cache_base + col) * head_dim : v_step + step_base;
        a += p[j] * to_f32(v[d]);
      }
      acc[i] = a;
    }
    m = m_new;
    __syncthreads();  // every thread is done with p before the next chunk overwrites it
  }
  for (int i = 0; i < PER_THREAD; ++i) {
    const int d = t + i * THREADS;
    if (d >= head_dim) break;
    out[((size_t)row * heads + head) * head_dim + d] = from_f32<T>(total > 0 ? acc[i] / l : 0.0f);
  }
}

#define DECODE_ATTENTION(NAME, T)                                                              \
  extern "C" __global__ void NAME(const T *q, const T *keys, const T *values, const T *k_step, \
                                  const T *v_step, const uint32_t *meta, T *out, int rows,     \
                                  int heads, int kv_heads, int cache_rows, int head_dim,       \
                                  float scale) {                                               \
    decode_attention<T>(q, keys, values, k_step, v_step, meta, out, rows, heads, kv_heads,     \
                        cache_rows, head_dim, scale);                                          \
  }

DECODE_ATTENTION(decode_attention_f32, float)
DECODE_ATTENTION(decode_attention_bf16, __nv_bfloat16)
DECODE_ATTENTION(decode_attention_f16, __half)

// RoPE and the head-major split of a step's projections (was a copy and a rope for each of Q
// and K, and a copy for V): q [rows, heads * head_dim], k and v [rows, kv_heads * head_dim],
// cos and sin [rows, head_dim / 2] -> out [heads + 2 * kv_heads, rows, head_dim]: Q rotated,
// K rotated, V as it is. One thread per (head, row, pair of a head's halves).
template <typename T>
__device__ void rope_split(const T *__restrict__ q, const T *__restrict__ k,
                           const T *__restrict__ v, const T *__restrict__ cos,
                           const T *__restrict__ sin, T *__restrict__ out, int rows, int heads,
                           int kv_heads, int head_dim) {
  const int half = head_dim / 2;
  const size_t n = (size_t)(heads + 2 * kv_heads) * rows * half;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)blockDim.x * gridDim.x) {
    const int d = (int)(i % half);
    const int row = (int)((i / half) % rows);
    const int h = (int)(i / ((size_t)half * rows));
    const T *src = q;
    int width = heads, head = h;
    if (h >= heads + kv_heads) {
      src = v, width = kv_heads, head = h - heads - kv_heads;
    } else if (h >= heads) {
      src = k, width = kv_heads, head = h - heads;
    }
    const T *x = src + ((size_t)row * width + head) * head_dim;
    T *o = out + ((size_t)h * rows + row) * head_dim;
    if (h >= heads + kv_heads) {
      o[d] = x[d];
      o[d + half] = x[d + half];
      continue;
    }
    const float x1 = to_f32(x[d]), x2 = to_f32(x[d + half]);
    const float c = to_f32(cos[(size_t)row * half + d]), s = to_f32(sin[(size_t)row * half + d]);
    o[d] = from_f32<T>(x1 * c - x2 * s);
    o[d + half] = from_f32<T>(x1 * s + x2 * c);
  }
}

// A step's K or V rows into the layer's cache: src [kv_heads, rows, head_dim] row r to cache
// [kv_heads, cache_rows, head_dim] row to[r]; NO_ROW (a second candidate's, or padding) and
// rows past the cache are not written.
template <typename T>
__device__ void write_rows(T *__restrict__ cache, const T *__restrict__ src,
                           const uint32_t *__restrict__ to, int rows, int kv_heads,
                           int cache_rows, int head_dim) {
  const size_t n = (size_t)kv_heads * rows * head_dim;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)blockDim.x * gridDim.x) {
    const int d = (int)(i % head_dim);
    const int row = (int)((i / head_dim) % rows);
    const int h = (int)(i / ((size_t)head_dim * rows));
    const uint32_t at = to[row];
    if (at == NO_EXTRA || at >= (uint32_t)cache_rows) continue;
    cache[((size_t)h * cache_rows + at) * head_dim + d] = src[i];
  }
}

// SiLU(gate) * up, elementwise (was two launches).
template <typename T>
__device__ void silu_mul(const T *__restrict__ gate, const T *__restrict__ up,
                         T *__restrict__ out, unsigned long long n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)blockDim.x * gridDim.x) {
    const float g = to_f32(gate[i]);
    out[i] = from_f32<T>(g / (1.0f + expf(-g)) * to_f32(up[i]));
  }
}

#define ELEMENTWISE(T, SUFFIX)                                                                   \
  extern "C" __global__ void rope_split_##SUFFIX(const T *q, const T *k, const T *v,           \
                                                  const T *cos, const T *sin, T *out, int rows, \
                                                  int heads, int kv_heads, int head_dim) {     \
    rope_split<T>(q, k, v, cos, sin, out, rows, heads, kv_heads, head_dim);                     \
  }                                                                                              \
  extern "C" __global__ void write_rows_##SUFFIX(T *cache, const T *src, const uint32_t *to,   \
                                                  int rows, int kv_heads, int cache_rows,        \
                                                  int head_dim) {                                \
    write_rows<T>(cache, src, to, rows, kv_heads, cache_rows, head_dim);                        \
  }                                                                                              \
  extern "C" __global__ void silu_mul_##SUFFIX(const T *gate, const T *up, T *out,             \
                                                unsigned long long n) {                          \
    silu_mul<T>(gate, up, out, n);                                                               \
  }

ELEMENTWISE(float, f32)
ELEMENTWISE(__nv_bfloat16, bf16)
ELEMENTWISE(__half, f16)
