// y = x @ W^T + bias for activations x [rows, k] and a weight matrix W [n, k] packed in one of GGUF's
// block formats (blocks of 32 weights along k, scales in fp16):
//
//   Q4_1: w = d * q + m, q in 0..15, two per byte: byte i of a block holds element i (low nibble) and
//         element i + 16 (high nibble); q [n, k / 2] uint8, d and m [n, k / 32] fp16.
//   Q8_0: w = d * q, q int8; q [n, k] int8, d [n, k / 32] fp16.
//
// d * q is exact in fp32 (an 11-bit significand times a 4- or 8-bit integer), so decoding with one
// fused multiply-add, d * q + m, rounds once, exactly as the fp32 product then sum that produced the
// checkpoint's weights: a decoded block is the fp32 weight bit for bit. Accumulation is in fp32; bf16
// activations (and bias) are widened to fp32 first and the product is rounded back to bf16.
//
// Output rows are spread over torch's threads. For each output row the kernel walks the blocks, decodes
// each once into vector registers (two of 16 lanes with AVX-512, four of 8 with AVX2) and multiplies it into
// up to kRowTile activation rows, so a decode step reads each weight from memory once whatever the row count.
// With few rows, each row keeps several accumulators (over pairs of blocks where one block fills fewer) so
// that the multiply-adds do not wait on each other. bf16 activations are widened into a buffer of the call
// and the sums rounded straight into the bf16 output. Compiled for AVX-512 (F) or AVX2 + FMA, with F16C,
// when the compiler targets them (``-march=native``); otherwise a scalar loop computes the same thing slowly
// and ``weir_quant::simd()`` says so, so that the engine keeps its dense path.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_to_copy.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>
#define WEIR_PACKED_SIMD 1
#define WEIR_PACKED_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define WEIR_PACKED_SIMD 1
#define WEIR_PACKED_AVX512 0
#else
#define WEIR_PACKED_SIMD 0
#endif

namespace {

constexpr int64_t kBlock = 32;  // weights per block
constexpr int kRowTile = 8;  // activation rows multiplied by one decoded block

#if WEIR_PACKED_SIMD
// The vector type of the build and the few operations the kernel needs on it.
#if WEIR_PACKED_AVX512
using VecF = __m512;
constexpr int kWidth = 16;
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vset(float v) { return _mm512_set1_ps(v); }
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF vadd(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline void vstore(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline float vsum(VecF v) { return _mm512_reduce_add_ps(v); }
#else
using VecF = __m256;
constexpr int kWidth = 8;
inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vset(float v) { return _mm256_set1_ps(v); }
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF vadd(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, VecF v) { _mm256_storeu_ps(p, v); }
inline float vsum(VecF v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
#endif
constexpr int kVecs = kBlock / kWidth;  // registers per decoded block
#endif

// One packed matrix: q, the scales d and (Q4_1 only) the minimums m, row by row.
struct Packed {
  const uint8_t* q;
  const at::Half* d;
  const at::Half* m;  // nullptr for Q8_0
  int64_t blocks;  // per row
  int64_t q_row;  // bytes of q per row

  // Block b of row j as 32 floats.
  void decode_scalar(int64_t j, int64_t b, float* out) const {
    const int64_t at = j * blocks + b;
    const float scale = static_cast<float>(d[at]);
    if (m == nullptr) {
      const auto* qs = reinterpret_cast<const int8_t*>(q + j * q_row + b * kBlock);
      for (int i = 0; i < kBlock; ++i) out[i] = scale * static_cast<float>(qs[i]);
      return;
    }
    const float min = static_cast<float>(m[at]);
    const uint8_t* qs = q + j * q_row + b * (kBlock / 2);
    for (int i = 0; i < kBlock / 2; ++i) {
      out[i] = scale * static_cast<float>(qs[i] & 0x0F) + min;
      out[i + kBlock / 2] = scale * static_cast<float>(qs[i] >> 4) + min;
    }
  }

#if WEIR_PACKED_SIMD
  // Block b of row j as kVecs registers of consecutive elements.
  template <bool kQ41>
  inline void decode(int64_t j, int64_t b, VecF w[kVecs]) const {
    const int64_t at = j * blocks + b;
    const VecF scale = vset(_cvtsh_ss(d[at].x));
    if constexpr (kQ41) {
      const VecF min = vset(_cvtsh_ss(m[at].x));
      const __m128i bytes =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * q_row + b * (kBlock / 2)));
      const __m128i low_mask = _mm_set1_epi8(0x0F);
      const __m128i lo = _mm_and_si128(bytes, low_mask);  // elements 0-15
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);  // elements 16-31
#if WEIR_PACKED_AVX512
      w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), scale, min);
      w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), scale, min);
#else
      const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      for (int s = 0; s < 4; ++s) {
        w[s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[s])), scale, min);
      }
#endif
    } else {
      const uint8_t* qs = q + j * q_row + b * kBlock;
      for (int s = 0; s < kVecs; ++s) {
#if WEIR_PACKED_AVX512
        const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + kWidth * s));
        w[s] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), scale);
#else
        const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + kWidth * s));
        w[s] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), scale);
#endif
      }
    }
  }
#endif
};

inline void store(float* y, float v) { *y = v; }
inline void store(c10::BFloat16* y, float v) { *y = c10::BFloat16(v); }

#if WEIR_PACKED_SIMD
// Output row j for kRows activation rows starting at x (row stride ldx), written to y (row stride ldy).
template <bool kQ41, int kRows, typename Out>
void row_tile(const Packed& w, int64_t j, const float* x, int64_t ldx, Out* y, int64_t ldy, float bias) {
  constexpr int kAcc = kRows <= 2 ? 4 : (kRows <= 4 ? 2 : 1);  // accumulators per row
  constexpr int kStride = kAcc > kVecs ? kAcc / kVecs : 1;  // blocks per iteration
  VecF acc[kRows][kAcc];
  for (int r = 0; r < kRows; ++r) {
    for (int a = 0; a < kAcc; ++a) acc[r][a] = vzero();
  }
  const auto add_block = [&](int64_t b, int slot) {
    VecF decoded[kVecs];
    w.decode<kQ41>(j, b, decoded);
    const float* xb = x + b * kBlock;
    for (int s = 0; s < kVecs; ++s) {
      const int a = (slot * kVecs + s) % kAcc;
      for (int r = 0; r < kRows; ++r) acc[r][a] = vfma(decoded[s], vload(xb + r * ldx + kWidth * s), acc[r][a]);
    }
  };
  int64_t b = 0;
  for (; b + kStride <= w.blocks; b += kStride) {
    for (int slot = 0; slot < kStride; ++slot) add_block(b + slot, slot);
  }
  for (; b < w.blocks; ++b) add_block(b, 0);
  for (int r = 0; r < kRows; ++r) {
    VecF total = acc[r][0];
    for (int a = 1; a < kAcc; ++a) total = vadd(total, acc[r][a]);
    store(y + r * ldy + j, vsum(total) + bias);
  }
}

template <bool kQ41, typename Out>
void tile_dispatch(int rows, const Packed& w, int64_t j, const float* x, int64_t ldx, Out* y, int64_t ldy,
                   float bias) {
  switch (rows) {
    case 1: return row_tile<kQ41, 1>(w, j, x, ldx, y, ldy, bias);
    case 2: return row_tile<kQ41, 2>(w, j, x, ldx, y, ldy, bias);
    case 3: return row_tile<kQ41, 3>(w, j, x, ldx, y, ldy, bias);
    case 4: return row_tile<kQ41, 4>(w, j, x, ldx, y, ldy, bias);
    case 5: return row_tile<kQ41, 5>(w, j, x, ldx, y, ldy, bias);
    case 6: return row_tile<kQ41, 6>(w, j, x, ldx, y, ldy, bias);
    case 7: return row_tile<kQ41, 7>(w, j, x, ldx, y, ldy, bias);
    default: return row_tile<kQ41, kRowTile>(w, j, x, ldx, y, ldy, bias);
  }
}
#endif

// The same product without SIMD: each block decoded to floats, then one dot product per row.
template <typename Out>
void rows_scalar(const Packed& w, int64_t j, const float* x, int64_t rows, int64_t k, Out* y, int64_t n,
                 float bias) {
  float block[kBlock];
  std::vector<float> sums(rows, bias);
  for (int64_t b = 0; b < w.blocks; ++b) {
    w.decode_scalar(j, b, block);
    for (int64_t r = 0; r < rows; ++r) {
      float sum = 0.0f;
      for (int i = 0; i < kBlock; ++i) sum += block[i] * x[r * k + b * kBlock + i];
      sums[r] += sum;
    }
  }
  for (int64_t r = 0; r < rows; ++r) store(y + r * n + j, sums[r]);
}

Packed check_packed(const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.is_contiguous(), "q must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.dim() == 2 && d.size(0) == q.size(0),
              "d must be contiguous fp16 [n, k / 32]");
  const int64_t blocks = d.size(1);
  if (m.has_value()) {
    TORCH_CHECK(q.scalar_type() == at::kByte && q.size(1) == blocks * kBlock / 2, "Q4_1 q must be uint8 [n, k / 2]");
    TORCH_CHECK(m->scalar_type() == at::kHalf && m->is_contiguous() && m->sizes() == d.sizes(),
                "m must be contiguous fp16 shaped like d");
  } else {
    TORCH_CHECK(q.scalar_type() == at::kChar && q.size(1) == blocks * kBlock, "Q8_0 q must be int8 [n, k]");
  }
  return Packed{static_cast<const uint8_t*>(q.data_ptr()), d.data_ptr<at::Half>(),
                m.has_value() ? m->data_ptr<at::Half>() : nullptr, blocks, q.size(1)};
}

// Every output row j of y [rows, n] from fp32 activations x [rows, k].
template <typename Out>
void product(const Packed& w, const float* x, int64_t rows, int64_t k, const float* bias, Out* y, int64_t n) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const float b = bias != nullptr ? bias[j] : 0.0f;
#if WEIR_PACKED_SIMD
      for (int64_t r = 0; r < rows; r += kRowTile) {
        const int tile = static_cast<int>(std::min<int64_t>(kRowTile, rows - r));
        if (w.m != nullptr) {
          tile_dispatch<true>(tile, w, j, x + r * k, k, y + r * n, n, b);
        } else {
          tile_dispatch<false>(tile, w, j, x + r * k, k, y + r * n, n, b);
        }
      }
#else
      rows_scalar(w, j, x, rows, k, y, n, b);
#endif
    }
  });
}

at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& d,
                         const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& bias_in) {
  const Packed w = check_packed(q, d, m);
  const int64_t n = q.size(0), k = w.blocks * kBlock;
  const bool widened = x_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK((x_in.scalar_type() == at::kFloat || widened) && x_in.device().is_cpu() && x_in.dim() == 2 &&
                  x_in.size(1) == k,
              "x must be a 2-D fp32 or bf16 CPU tensor of ", k, " columns");
  const at::Tensor x = x_in.contiguous();
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->to(at::kFloat).contiguous();
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == n, "bias must be fp32 [n]");
  }
  const int64_t rows = x.size(0);
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  if (!widened) {
    product(w, x.data_ptr<float>(), rows, k, bp, y.data_ptr<float>(), n);
    return y;
  }
  std::vector<float> wide(rows * k);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < rows * k; ++i) wide[i] = static_cast<float>(xp[i]);
  product(w, wide.data(), rows, k, bp, y.data_ptr<c10::BFloat16>(), n);
  return y;
}

// The packed matrix as fp32 [n, k], decoded by the same code as packed_linear's.
at::Tensor packed_dequantize(const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m) {
  const Packed w = check_packed(q, d, m);
  const int64_t n = q.size(0), k = w.blocks * kBlock;
  at::Tensor out = at::empty({n, k}, d.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t b = 0; b < w.blocks; ++b) {
        float* dst = op + j * k + b * kBlock;
#if WEIR_PACKED_SIMD
        VecF decoded[kVecs];
        if (w.m != nullptr) {
          w.decode<true>(j, b, decoded);
        } else {
          w.decode<false>(j, b, decoded);
        }
        for (int s = 0; s < kVecs; ++s) vstore(dst + kWidth * s, decoded[s]);
#else
        w.decode_scalar(j, b, dst);
#endif
      }
    }
  });
  return out;
}

bool simd() { return WEIR_PACKED_SIMD != 0; }

}  // namespace

TORCH_LIBRARY(weir_quant, m) {
  m.def("packed_linear(Tensor x, Tensor q, Tensor d, Tensor? m, Tensor? bias) -> Tensor");
  m.def("packed_dequantize(Tensor q, Tensor d, Tensor? m) -> Tensor");
  m.def("simd() -> bool", &simd);
}

TORCH_LIBRARY_IMPL(weir_quant, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("packed_dequantize", &packed_dequantize);
}
