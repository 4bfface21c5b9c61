// A decoder layer's element-wise steps in bf16, fused, each rounded where Hugging Face's Llama rounds it
// (so that they give the tokens of the unfused torch ops they replace):
//
//   rms_norm(x, w, eps):   out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))), the mean and x in fp32.
//   add_rms_norm(h, d, w, eps): h = bf16(h + d) in place (the residual add), then rms_norm(h, w, eps).
//   silu_mul(gate_up):     from the fused gate|up projection [T, 2I], bf16(bf16(silu(gate)) * up), with
//                          silu(g) = g / (1 + exp(-g)) in fp32 and exp as torch's vectorized CPU kernel
//                          computes it (SLEEF's 1-ulp exp, which torch exports; on a CPU without AVX-512
//                          the op is not offered and the model keeps torch's silu and mul).
//   rope_and_cache(...):   from a step's fused q|k|v projection [T, (H + 2 * Hkv) * D], q and k rotated
//                          (rotate-half layout: bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), ``sin``
//                          signed), and k and v written to the paged caches at the step's slots; returns
//                          the rotated q [T, H, D] and k [T, Hkv, D].
//
// A step of a few tokens runs each op as one call instead of the ten-odd torch ops it replaces, whose
// dispatch costs more than their arithmetic. Tokens are spread over torch's threads for large steps.
// With AVX-512, SiLU and RoPE run 16 values to a vector (the roundings as above, in the same order).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#ifdef __AVX512F__
#include <immintrin.h>
#include <sleef.h>
#define WEIR_AVX512 1
#else
#define WEIR_AVX512 0
#endif

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kGrainElements = 32768;  // elements per thread before a step is split
constexpr int kLanes = 16;  // partial sums of a norm's squares

int64_t grain(int64_t per_token) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, per_token)); }

inline bf16 round_product(float a, float b) { return bf16(a * b); }

#if WEIR_AVX512
// 16 bf16 values widened to fp32 (bf16 is the upper half of an fp32).
inline __m512 widen(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 fp32 values rounded to bf16 (to nearest, ties to even; NaN to a quiet NaN), still as fp32.
inline __m512 round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i biased = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  __m512i rounded = _mm512_and_si512(biased, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(rounded);
}

// 16 fp32 values, already rounded to bf16 by round_bf16, stored as bf16.
inline void store_bf16(__m512 rounded, bf16* out) {
  const __m256i halves = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), halves);
}
#endif

// Normalize `rows` rows of `cols` values from xp into op; with dp, first add dp's rows into xp (in place).
void norm_rows(bf16* xp, const bf16* dp, const bf16* wp, int64_t rows, int64_t cols, float epsilon, bf16* op) {
  at::parallel_for(0, rows, grain(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      bf16* row = xp + r * cols;
      if (dp != nullptr) {
        const bf16* delta = dp + r * cols;
        for (int64_t i = 0; i < cols; ++i) row[i] = bf16(static_cast<float>(row[i]) + static_cast<float>(delta[i]));
      }
      float lanes[kLanes] = {};  // independent partial sums, so that the compiler vectorizes the loop
      int64_t i = 0;
      for (; i + kLanes <= cols; i += kLanes) {
        for (int l = 0; l < kLanes; ++l) {
          const float v = static_cast<float>(row[i + l]);
          lanes[l] += v * v;
        }
      }
      for (; i < cols; ++i) {
        const float v = static_cast<float>(row[i]);
        lanes[0] += v * v;
      }
      float squares = 0.0f;
      for (const float lane : lanes) squares += lane;
      const float mean = squares / static_cast<float>(cols);
      const float inverse = 1.0f / std::sqrt(mean + epsilon);
      bf16* dst = op + r * cols;
      for (int64_t i = 0; i < cols; ++i) {
        const bf16 normed = round_product(static_cast<float>(row[i]), inverse);
        dst[i] = round_product(static_cast<float>(wp[i]), static_cast<float>(normed));
      }
    }
  });
}

void check_bf16_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.device().is_cpu(), name,
              " must be a 2-D bf16 CPU tensor");
}

void check_norm_weight(const at::Tensor& w, int64_t cols) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.numel() == cols, "weight must be bf16 [", cols, "]");
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  check_bf16_rows(x_in, "x");
  check_norm_weight(w_in, x_in.size(1));
  at::Tensor x = x_in.contiguous();
  const at::Tensor w = w_in.contiguous();
  at::Tensor out = at::empty_like(x);
  norm_rows(x.data_ptr<bf16>(), nullptr, w.data_ptr<bf16>(), x.size(0), x.size(1), static_cast<float>(eps),
            out.data_ptr<bf16>());
  return out;
}

at::Tensor add_rms_norm(at::Tensor hidden, const at::Tensor& delta_in, const at::Tensor& w_in, double eps) {
  check_bf16_rows(hidden, "hidden");
  TORCH_CHECK(hidden.is_contiguous(), "hidden must be contiguous (it is updated in place)");
  check_bf16_rows(delta_in, "delta");
  TORCH_CHECK(delta_in.sizes() == hidden.sizes(), "delta must be shaped like hidden");
  check_norm_weight(w_in, hidden.size(1));
  const at::Tensor delta = delta_in.contiguous(), w = w_in.contiguous();
  at::Tensor out = at::empty_like(hidden);
  norm_rows(hidden.data_ptr<bf16>(), delta.data_ptr<bf16>(), w.data_ptr<bf16>(), hidden.size(0), hidden.size(1),
            static_cast<float>(eps), out.data_ptr<bf16>());
  return out;
}

#if WEIR_AVX512
// silu(g) * u for 16 values, each rounded to bf16 as torch's silu then mul round them.
inline void silu_mul16(const bf16* g, const bf16* u, bf16* out) {
  const __m512 x = widen(g);
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 silu = round_bf16(_mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
  store_bf16(round_bf16(_mm512_mul_ps(silu, widen(u))), out);
}
#endif

at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  check_bf16_rows(gate_up_in, "gate_up");
  TORCH_CHECK(WEIR_AVX512, "silu_mul needs AVX-512");
  TORCH_CHECK(gate_up_in.size(1) % 32 == 0, "gate_up must have a multiple of 32 columns");
  const at::Tensor gate_up = gate_up_in.contiguous();
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
#if WEIR_AVX512
  const bf16* src = gate_up.data_ptr<bf16>();
  bf16* dst = out.data_ptr<bf16>();
  at::parallel_for(0, rows, grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16* gate = src + r * 2 * width;
      for (int64_t i = 0; i < width; i += 16) silu_mul16(gate + i, gate + width + i, dst + r * width + i);
    }
  });
#endif
  return out;
}

bool has_silu_mul() { return WEIR_AVX512 != 0; }

// Rotate one head of `dim` values from `src` into `dst` with the token's cos and signed sin.
inline void rotate(const bf16* src, const bf16* cos, const bf16* sin, int64_t dim, bf16* dst) {
  const int64_t half = dim / 2;
#if WEIR_AVX512
  if (half % 16 == 0) {
    for (int64_t i = 0; i < dim; i += 16) {
      const __m512 direct = round_bf16(_mm512_mul_ps(widen(src + i), widen(cos + i)));
      const __m512 crossed = round_bf16(_mm512_mul_ps(widen(src + (i < half ? i + half : i - half)), widen(sin + i)));
      store_bf16(round_bf16(_mm512_add_ps(direct, crossed)), dst + i);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < dim; ++i) {
    const float swapped = static_cast<float>(src[i < half ? i + half : i - half]);
    const float direct = static_cast<float>(round_product(static_cast<float>(src[i]), static_cast<float>(cos[i])));
    const float crossed = static_cast<float>(round_product(swapped, static_cast<float>(sin[i])));
    dst[i] = bf16(direct + crossed);
  }
}

std::tuple<at::Tensor, at::Tensor> rope_and_cache(const at::Tensor& qkv_in, const at::Tensor& cos_in,
                                                  const at::Tensor& sin_in, at::Tensor key_cache,
                                                  at::Tensor value_cache, const at::Tensor& slots_in, int64_t heads,
                                                  int64_t kv_heads) {
  TORCH_CHECK(qkv_in.scalar_type() == at::kBFloat16 && qkv_in.dim() == 2 && qkv_in.device().is_cpu(),
              "qkv must be a 2-D bf16 CPU tensor");
  TORCH_CHECK(key_cache.scalar_type() == at::kBFloat16 && value_cache.scalar_type() == at::kBFloat16 &&
                  key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 3 &&
                  key_cache.sizes() == value_cache.sizes() && key_cache.size(1) == kv_heads,
              "the caches must be contiguous bf16 [slots, kv_heads, head_dim] of one shape");
  const int64_t tokens = qkv_in.size(0), dim = key_cache.size(2), cache_slots = key_cache.size(0);
  TORCH_CHECK(dim % 2 == 0 && qkv_in.size(1) == (heads + 2 * kv_heads) * dim, "qkv must be [T, (H + 2 Hkv) * D]");
  const at::Tensor qkv = qkv_in.contiguous();
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 &&
                  cos.numel() == tokens * dim && sin.numel() == tokens * dim,
              "cos and sin must be bf16 with head_dim values per token");
  const at::Tensor slots = slots_in.contiguous();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == tokens, "slots must be int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < cache_slots, "slot ", sp[t], " is outside the cache");
  }
  at::Tensor q = at::empty({tokens, heads, dim}, qkv.options());
  at::Tensor k = at::empty({tokens, kv_heads, dim}, qkv.options());
  const int64_t width = qkv.size(1);
  const bf16* src = qkv.data_ptr<bf16>();
  const bf16* cp = cos.data_ptr<bf16>();
  const bf16* sn = sin.data_ptr<bf16>();
  bf16* qp = q.data_ptr<bf16>();
  bf16* kp = k.data_ptr<bf16>();
  bf16* kc = key_cache.data_ptr<bf16>();
  bf16* vc = value_cache.data_ptr<bf16>();
  at::parallel_for(0, tokens, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bf16* row = src + t * width;
      const bf16* c = cp + t * dim;
      const bf16* s = sn + t * dim;
      for (int64_t h = 0; h < heads; ++h) rotate(row + h * dim, c, s, dim, qp + (t * heads + h) * dim);
      const int64_t kv_width = kv_heads * dim;
      bf16* k_row = kp + t * kv_width;
      for (int64_t h = 0; h < kv_heads; ++h) rotate(row + (heads + h) * dim, c, s, dim, k_row + h * dim);
      std::copy(k_row, k_row + kv_width, kc + sp[t] * kv_width);
      const bf16* v_row = row + (heads + kv_heads) * dim;
      std::copy(v_row, v_row + kv_width, vc + sp[t] * kv_width);
    }
  });
  return {q, k};
}

}  // namespace

TORCH_LIBRARY(weir_layer, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) hidden, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("has_silu_mul() -> bool", &has_silu_mul);
  m.def(
      "rope_and_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slots, int heads, int kv_heads) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(weir_layer, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_and_cache", &rope_and_cache);
}
