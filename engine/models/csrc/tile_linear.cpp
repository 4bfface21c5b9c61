// bf16 matrix products y = x W^T + b over weights stored in column tiles, by two kernels: oneDNN's
// small-matrix kernel (torch's `cpublas::brgemm`: AMX or AVX512-BF16) and, on a CPU with the AVX512-BF16
// dot-product instruction, our own register-tiled loop (`dot_linear`).
//
// The weight is stored once, at load, in column blocks of kColumns outputs, each pair-interleaved along the
// input (the VNNI layout the kernel reads): block b holds W[b * kColumns + n][k] at [b][k / 2][n][k % 2],
// with zero rows past the last output. A product splits the blocks over torch's OpenMP threads in
// contiguous ranges, so that each thread streams one stretch of the weight; each block is one multiply of
// every row of x by the block (fp32 sums), then the bias is added and the sums rounded to bf16 into the
// block's columns of y. Unlike oneDNN's linear primitive, nothing is compiled or cached per row count, so
// a step of any size runs without padding its rows.
//
// dot_linear multiplies up to kDotRows rows of x by one block at a time with every sum in a register: for
// each pair of inputs the block's two weight vectors (16 columns x 2 inputs each) are loaded once and
// multiplied into each row's two accumulators with the row's pair broadcast. More rows go in balanced
// groups of at most kDotRows, each reading the block again (from L2). Each output is summed pair by pair in
// input order, as oneDNN's AVX512-BF16 kernel sums it, so the two kernels agree bit for bit on that path.
// With every layer's weights coming from memory, as in a decode step, this loop ran SmolLM2's products
// 10-25 % faster than oneDNN's kernel at 8-64 rows and 3-6 % faster at 128-512 on an AVX512-BF16 EPYC.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kColumns = 32;  // outputs per block: two 16-column tiles; SmolLM2's widths split evenly
constexpr int64_t kRowChunk = 128;  // rows multiplied at a time: a chunk of x stays in cache across a group
constexpr int64_t kGroupBlocks = 8;  // blocks a chunk of rows goes through before the next chunk
constexpr int kDotRows = 10;  // rows a dot_linear register tile holds: 2 x 10 accumulators, 2 weight vectors

// Round fp32 sums (plus the bias, if any) to bf16, nearest even, as at::BFloat16 does.
void round_into(const float* sums, const float* bias, int64_t count, at::BFloat16* out) {
  int64_t n = 0;
#ifdef __AVX512BF16__
  for (; n + 16 <= count; n += 16) {
    __m512 v = _mm512_loadu_ps(sums + n);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + n), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
#endif
  for (; n < count; ++n) out[n] = at::BFloat16(bias != nullptr ? sums[n] + bias[n] : sums[n]);
}

at::Tensor tile_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "tile_pack takes a 2-D bf16 weight");
  TORCH_CHECK(weight.size(1) % 2 == 0, "tile_pack needs an even number of inputs, got ", weight.size(1));
  const at::Tensor w = weight.contiguous();
  const int64_t outputs = w.size(0), inputs = w.size(1), blocks = (outputs + kColumns - 1) / kColumns;
  at::Tensor packed = at::zeros({blocks, inputs / 2, kColumns, 2}, w.options());
  const auto* src = w.data_ptr<at::BFloat16>();
  auto* dst = packed.data_ptr<at::BFloat16>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t columns = std::min(kColumns, outputs - b * kColumns);
      for (int64_t n = 0; n < columns; ++n) {
        const at::BFloat16* row = src + (b * kColumns + n) * inputs;
        at::BFloat16* block = dst + b * inputs * kColumns;
        for (int64_t k = 0; k < inputs; ++k) block[(k / 2) * kColumns * 2 + n * 2 + k % 2] = row[k];
      }
    }
  });
  return packed;
}

// The checks and buffers every product shares; `multiply(x, bias, out)` fills `out` [rows, outputs] from the
// contiguous bf16 rows `x` and the bias widened to fp32 (nullptr where there is none).
template <typename Multiply>
at::Tensor product(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                   int64_t outputs, const Multiply& multiply) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "tile_linear takes bf16 inputs and weights");
  const int64_t inputs = packed.size(1) * 2, blocks = packed.size(0);
  TORCH_CHECK(input.size(-1) == inputs, "tile_linear: input has ", input.size(-1), " features, weight ", inputs);
  TORCH_CHECK(outputs > (blocks - 1) * kColumns && outputs <= blocks * kColumns, "tile_linear: bad output count");
  const at::Tensor x = input.reshape({-1, inputs}).contiguous();
  at::Tensor out = at::empty({x.size(0), outputs}, x.options());
  if (x.size(0) > 0) {
    at::Tensor bias32;
    if (bias.has_value()) bias32 = bias->to(at::kFloat).contiguous();
    multiply(x, bias.has_value() ? bias32.data_ptr<float>() : nullptr, out);
  }
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = outputs;
  return out.view(shape);
}

at::Tensor tile_linear(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t outputs) {
  return product(input, packed, bias, outputs, [&](const at::Tensor& x, const float* bias_data, at::Tensor& out) {
    const int64_t inputs = x.size(1), rows = x.size(0), blocks = packed.size(0);
    const auto* a = x.data_ptr<at::BFloat16>();
    const auto* w = packed.data_ptr<at::BFloat16>();
    auto* y = out.data_ptr<at::BFloat16>();
    const int64_t block_size = inputs * kColumns;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> sums(std::min(rows, kRowChunk) * kColumns);
      for (int64_t group = begin; group < end; group += kGroupBlocks) {
        const int64_t group_end = std::min(end, group + kGroupBlocks);
        for (int64_t row = 0; row < rows; row += kRowChunk) {
          const int64_t chunk = std::min(kRowChunk, rows - row);
          for (int64_t b = group; b < group_end; ++b) {
            at::native::cpublas::brgemm(chunk, kColumns, inputs, inputs, kColumns, kColumns, false, a + row * inputs,
                                        w + b * block_size, sums.data());
            const int64_t first = b * kColumns, columns = std::min(kColumns, outputs - first);
            for (int64_t r = 0; r < chunk; ++r) {
              round_into(sums.data() + r * kColumns, bias_data == nullptr ? nullptr : bias_data + first, columns,
                         y + (row + r) * outputs + first);
            }
          }
        }
      }
      at::native::cpublas::brgemm_release();
    });
  });
}

#ifdef __AVX512BF16__
// R rows of x (row stride lda) times one block of `pairs` input pairs, plus the bias (nullptr: none), rounded
// to bf16 into the block's `columns` (at most kColumns) columns of y (row stride ldy).
template <int R>
void dot_rows(const at::BFloat16* a, int64_t lda, const at::BFloat16* w, int64_t pairs, const float* bias,
              int64_t columns, at::BFloat16* y, int64_t ldy) {
  __m512 low[R], high[R];  // each row's sums of columns 0-15 and 16-31
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) low[r] = high[r] = _mm512_setzero_ps();
  const auto* a_pairs = reinterpret_cast<const int32_t*>(a);  // a row's inputs 2p and 2p + 1 as one int32
  for (int64_t p = 0; p < pairs; ++p) {
    const auto w_low = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + p * 2 * kColumns));
    const auto w_high = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + p * 2 * kColumns + kColumns));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const auto pair = reinterpret_cast<__m512bh>(_mm512_set1_epi32(a_pairs[r * (lda / 2) + p]));
      low[r] = _mm512_dpbf16_ps(low[r], pair, w_low);
      high[r] = _mm512_dpbf16_ps(high[r], pair, w_high);
    }
  }
  const auto mask = [](int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xffff : n <= 0 ? 0 : (1 << n) - 1); };
  const __mmask16 low_mask = mask(columns), high_mask = mask(columns - 16);
  const __m512 low_bias = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(low_mask, bias);
  const __m512 high_bias = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(high_mask, bias + 16);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    // with no bias the sums are rounded as they are (adding +0.0 would turn a -0.0 sum into +0.0)
    const __m512 l = bias == nullptr ? low[r] : _mm512_add_ps(low[r], low_bias);
    const __m512 h = bias == nullptr ? high[r] : _mm512_add_ps(high[r], high_bias);
    _mm256_mask_storeu_epi16(y + r * ldy, low_mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(l)));
    _mm256_mask_storeu_epi16(y + r * ldy + 16, high_mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(h)));
  }
}

using DotRows = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, const float*, int64_t,
                         at::BFloat16*, int64_t);
template <int... R>
constexpr std::array<DotRows, sizeof...(R) + 1> dot_table(std::integer_sequence<int, R...>) {
  return {nullptr, &dot_rows<R + 1>...};
}
constexpr auto kDotRowsFor = dot_table(std::make_integer_sequence<int, kDotRows>());  // [r]: r rows
#endif

at::Tensor dot_linear(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t outputs) {
#ifdef __AVX512BF16__
  return product(input, packed, bias, outputs, [&](const at::Tensor& x, const float* bias_data, at::Tensor& out) {
    const int64_t inputs = x.size(1), rows = x.size(0), blocks = packed.size(0);
    const int64_t groups = (rows + kDotRows - 1) / kDotRows;
    const auto* a = x.data_ptr<at::BFloat16>();
    const auto* w = packed.data_ptr<at::BFloat16>();
    auto* y = out.data_ptr<at::BFloat16>();
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t first = b * kColumns, columns = std::min(kColumns, outputs - first);
        for (int64_t g = 0, row = 0; g < groups; ++g) {
          const int64_t count = (rows - row) / (groups - g);  // balanced: 32 rows go as 8 + 8 + 8 + 8
          kDotRowsFor[count](a + row * inputs, inputs, w + b * inputs * kColumns, inputs / 2,
                             bias_data == nullptr ? nullptr : bias_data + first, columns, y + row * outputs + first,
                             outputs);
          row += count;
        }
      }
    });
  });
#else
  TORCH_CHECK(false, "dot_linear needs a CPU with AVX512-BF16 (this build has none)");
#endif
}

bool has_dot() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(weir_tiles, m) {
  m.def("tile_pack(Tensor weight) -> Tensor", &tile_pack);
  m.def("tile_linear(Tensor input, Tensor packed, Tensor? bias, int outputs) -> Tensor", &tile_linear);
  m.def("dot_linear(Tensor input, Tensor packed, Tensor? bias, int outputs) -> Tensor", &dot_linear);
  m.def("has_dot() -> bool", &has_dot);
}
