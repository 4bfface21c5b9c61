// bf16 matrix products y = x W^T + b by oneDNN's small-matrix kernel (torch's `cpublas::brgemm`), for the
// decode-sized steps where a product is bound by reading its weight.
//
// The weight is stored once, at load, in column blocks of kColumns outputs, each pair-interleaved along the
// input (the VNNI layout the kernel reads): block b holds W[b * kColumns + n][k] at [b][k / 2][n][k % 2],
// with zero rows past the last output. A product splits the blocks over torch's OpenMP threads in
// contiguous ranges, so that each thread streams one stretch of the weight; each block is one multiply of
// every row of x by the block (fp32 sums), then the bias is added and the sums rounded to bf16 into the
// block's columns of y. Unlike oneDNN's linear primitive, nothing is compiled or cached per row count, so
// a step of any size runs without padding its rows.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kColumns = 32;  // outputs per block: two 16-column tiles; SmolLM2's widths split evenly
constexpr int64_t kRowChunk = 128;  // rows multiplied at a time: a chunk of x stays in cache across a group
constexpr int64_t kGroupBlocks = 8;  // blocks a chunk of rows goes through before the next chunk

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

at::Tensor tile_linear(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t outputs) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "tile_linear takes bf16 inputs and weights");
  const int64_t inputs = packed.size(1) * 2, blocks = packed.size(0);
  TORCH_CHECK(input.size(-1) == inputs, "tile_linear: input has ", input.size(-1), " features, weight ", inputs);
  TORCH_CHECK(outputs > (blocks - 1) * kColumns && outputs <= blocks * kColumns, "tile_linear: bad output count");
  const at::Tensor x = input.reshape({-1, inputs}).contiguous();
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, outputs}, x.options());
  if (rows == 0) return out;
  at::Tensor bias32;
  if (bias.has_value()) bias32 = bias->to(at::kFloat).contiguous();
  const float* bias_data = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
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
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = outputs;
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY(weir_tiles, m) {
  m.def("tile_pack(Tensor weight) -> Tensor", &tile_pack);
  m.def("tile_linear(Tensor input, Tensor packed, Tensor? bias, int outputs) -> Tensor", &tile_linear);
}
