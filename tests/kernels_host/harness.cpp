// Runs one kernel of kernels.cu on the host (shim.h): `harness OP DTYPE IN OUT`. IN holds the
// op's sizes (u32), then its operands (f32, or u32 for indices) in the order of the kernel's
// arguments; OUT receives the result as f32. The launch shapes are cuda.rs's.
#include "kernels.cu"

#include <cstdio>
#include <string>

namespace {

FILE *in_file;

uint32_t read_u32() {
  uint32_t x;
  if (fread(&x, 4, 1, in_file) != 1) throw std::string("short input");
  return x;
}

std::vector<uint32_t> read_u32s(size_t n) {
  std::vector<uint32_t> v(n);
  if (n && fread(v.data(), 4, n, in_file) != n) throw std::string("short input");
  return v;
}

template <typename T> T convert(float x);
template <> float convert<float>(float x) { return x; }
template <> __nv_bfloat16 convert<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __half convert<__half>(float x) { return __float2half_rn(x); }

template <typename T> std::vector<T> read(size_t n) {
  std::vector<float> f(n);
  if (n && fread(f.data(), 4, n, in_file) != n) throw std::string("short input");
  std::vector<T> v;
  for (float x : f) v.push_back(convert<T>(x));
  return v;
}

template <typename T> std::vector<float> widen(const std::vector<T> &v) {
  std::vector<float> f;
  for (T x : v) f.push_back(to_f32(x));
  return f;
}

Dim3 elementwise(size_t n) {
  size_t blocks = std::clamp<size_t>((n + 255) / 256, 1, 65535);
  return {unsigned(blocks), 1, 1};
}

template <typename T> std::vector<float> run(const std::string &op) {
  if (op == "decode_attention") {
    const int rows = read_u32(), heads = read_u32(), kv = read_u32(), cache_rows = read_u32(),
              dim = read_u32();
    const uint32_t scale_bits = read_u32();
    float scale;
    memcpy(&scale, &scale_bits, 4);
    auto q = read<T>(size_t(heads) * rows * dim);
    auto keys = read<T>(size_t(kv) * cache_rows * dim);
    auto values = read<T>(size_t(kv) * cache_rows * dim);
    auto k_step = read<T>(size_t(kv) * rows * dim), v_step = read<T>(size_t(kv) * rows * dim);
    auto spans = read_u32s(size_t(rows) * 3);
    std::vector<T> out(size_t(rows) * heads * dim);
    launch({unsigned(rows), unsigned(heads), 1}, {THREADS, 1, 1}, [&] {
      decode_attention<T>(q.data(), keys.data(), values.data(), k_step.data(), v_step.data(),
                          spans.data(), out.data(), rows, heads, kv, cache_rows, dim, scale);
    });
    return widen(out);
  }
  if (op == "rope_split") {
    const int rows = read_u32(), heads = read_u32(), kv = read_u32(), dim = read_u32();
    auto q = read<T>(size_t(rows) * heads * dim);
    auto k = read<T>(size_t(rows) * kv * dim), v = read<T>(size_t(rows) * kv * dim);
    auto cos = read<T>(size_t(rows) * dim / 2), sin = read<T>(size_t(rows) * dim / 2);
    std::vector<T> out(size_t(heads + 2 * kv) * rows * dim);
    launch(elementwise(out.size() / 2), {256, 1, 1}, [&] {
      rope_split<T>(q.data(), k.data(), v.data(), cos.data(), sin.data(), out.data(), rows,
                    heads, kv, dim);
    });
    return widen(out);
  }
  if (op == "write_rows") {
    const int rows = read_u32(), kv = read_u32(), cache_rows = read_u32(), dim = read_u32();
    auto cache = read<T>(size_t(kv) * cache_rows * dim);
    auto src = read<T>(size_t(kv) * rows * dim);
    auto to = read_u32s(rows);
    launch(elementwise(src.size()), {256, 1, 1}, [&] {
      write_rows<T>(cache.data(), src.data(), to.data(), rows, kv, cache_rows, dim);
    });
    return widen(cache);
  }
  if (op == "silu_mul") {
    const size_t n = read_u32();
    auto gate = read<T>(n), up = read<T>(n);
    std::vector<T> out(n);
    launch(elementwise(n), {256, 1, 1}, [&] { silu_mul<T>(gate.data(), up.data(), out.data(), n); });
    return widen(out);
  }
  throw "unknown op " + op;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: harness OP f32|bf16|f16 IN OUT\n");
    return 2;
  }
  try {
    const std::string op = argv[1], dtype = argv[2];
    in_file = fopen(argv[3], "rb");
    if (!in_file) throw std::string("cannot open ") + argv[3];
    std::vector<float> out = dtype == "bf16"  ? run<__nv_bfloat16>(op)
                             : dtype == "f16" ? run<__half>(op)
                                              : run<float>(op);
    FILE *out_file = fopen(argv[4], "wb");
    if (!out_file || fwrite(out.data(), 4, out.size(), out_file) != out.size()) {
      throw std::string("cannot write ") + argv[4];
    }
    fclose(out_file);
  } catch (const std::string &e) {
    fprintf(stderr, "harness: %s\n", e.c_str());
    return 1;
  }
  return 0;
}
