// Attention that reads Weir's paged KV cache in place (CPU).
//
// One call covers a whole step: decodes (one query) and prefill chunks (several queries, causal within the
// chunk, after any earlier context). Work is split into items of (sequence, KV head, up to kQueryTile
// queries); an item computes every query head of its KV head for its queries, so each key and value row is
// read once for the whole group (grouped-query attention). Items are spread over torch's OpenMP threads,
// longest first.
//
// An item walks its sequence's keys with an online softmax over chunks of kChunk positions, reading each
// position's row where the block table puts it, kLanes rows at a time: the chunk's scores, then the running
// maximum and sum, then its values weighted into the accumulator, all in fp32 whatever the cache's dtype.
// A query at position p reads keys 0..p only. The chunk length and the rounding of the weights to the
// cache's dtype are those of torch's CPU SDPA, so bf16 results round as the reference path's do.
//
// Scores are computed one of two ways. An item with few query rows (a decode: one row per query head of
// the group) takes the dot product of each row with each key. An item with many rows (a prefill chunk)
// holds its queries transposed, [head_dim][rows], and scores kLanes rows at once for each key, so every
// multiply-add fills a vector. The code uses GCC/Clang vector types; head_dim is a compile-time constant
// so that a row of the accumulator stays in registers.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kQueryTile = 16;  // queries per work item of a prefill chunk
constexpr int64_t kLanes = 16;  // keys per tile, and query rows scored together
constexpr int64_t kManyRows = 8;  // from this many query rows, an item scores kLanes rows at once
constexpr int64_t kChunk = 512;  // keys per softmax step, as in torch's CPU flash attention (kvSplitSize)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
using IntVec = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));
using Half = float __attribute__((vector_size(kLanes / 2 * sizeof(float))));
using Quarter = float __attribute__((vector_size(kLanes / 4 * sizeof(float))));

inline Vec load(const float* src) {
  Vec v;
  std::memcpy(&v, src, sizeof(v));
  return v;
}

inline void store(float* dst, const Vec& v) { std::memcpy(dst, &v, sizeof(v)); }

inline Vec max(Vec a, Vec b) { return a > b ? a : b; }

// The sum of a vector's lanes, halving it.
inline float horizontal_sum(Vec v) {
  const Half half = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Quarter quarter =
      __builtin_shufflevector(half, half, 0, 1, 2, 3) + __builtin_shufflevector(half, half, 4, 5, 6, 7);
  return (quarter[0] + quarter[1]) + (quarter[2] + quarter[3]);
}

// exp(x) for x <= 0 (-inf included): x = n ln2 + r with |r| <= ln2/2, exp(r) by its Taylor polynomial of
// degree 6 (relative error below 1e-7), 2^n put into the exponent bits; 0 below -87.
inline Vec exp_nonpositive(Vec x) {
  const Vec clamped = max(x, Vec{} - 87.0f);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const Vec n = (clamped * 1.44269504088896341f + kRound) - kRound;
  const Vec r = (clamped - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  Vec p = Vec{} + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const Vec power = std::bit_cast<Vec>((__builtin_convertvector(n, IntVec) + 127) << 23);
  return x < -87.0f ? Vec{} : p * power;
}

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, at::BFloat16* dst) { *dst = at::BFloat16(x); }  // round to nearest even

// A cache row as fp32: the row itself for an fp32 cache; for bf16, widened into `scratch` (a bf16 is the
// upper half of the fp32 of the same value).
template <int64_t kDim>
inline const float* row_as_float(const float* src, float*) {
  return src;
}

template <int64_t kDim>
inline const float* row_as_float(const at::BFloat16* src, float* scratch) {
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t d = 0; d < kDim; ++d) scratch[d] = std::bit_cast<float>(static_cast<uint32_t>(bits[d]) << 16);
  return scratch;
}

template <int64_t kDim>
inline float dot(const float* a, const float* b) {
  Vec sum = load(a) * load(b);
  for (int64_t c = kLanes; c < kDim; c += kLanes) sum += load(a + c) * load(b + c);
  return horizontal_sum(sum);
}

// acc = acc * rescale + the sum over the tile's keys j of weights[j * stride] * values[j].
template <int64_t kDim>
inline void accumulate(float* acc, float rescale, const float* weights, int64_t stride, const float* const* values) {
  constexpr int64_t kVectors = kDim / kLanes;
  Vec part[kVectors];
  for (int64_t c = 0; c < kVectors; ++c) part[c] = load(acc + c * kLanes) * rescale;
  for (int64_t j = 0; j < kLanes; ++j) {
    const float weight = weights[j * stride];
    for (int64_t c = 0; c < kVectors; ++c) part[c] += weight * load(values[j] + c * kLanes);
  }
  for (int64_t c = 0; c < kVectors; ++c) store(acc + c * kLanes, part[c]);
}

struct WorkItem {
  int64_t seq;
  int64_t kv_head;
  int64_t first_query;  // index of the item's first query within its sequence's step tokens
  int64_t num_queries;
  int64_t cost;  // queries times keys read, to schedule the longest items first
};

struct Problem {
  const void* q;
  int64_t q_token_stride;
  int64_t q_head_stride;
  const void* key_cache;
  const void* value_cache;
  void* out;
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* seqs;  // per sequence: first query row, query length, context length
  int64_t block_size;
  int64_t kv_heads;
  int64_t group;  // query heads per KV head
  float scale;
};

// Memory an item works in, kept by each thread across its items.
struct Scratch {
  std::vector<float> floats;
  std::vector<int32_t> positions;
};

// Weights as the attention of torch's CPU SDPA uses them: rounded to the cache's dtype before they multiply
// the values (so that bf16 results round as the reference and transformers do).
inline Vec round_weights(Vec weights, float) { return weights; }

inline Vec round_weights(Vec weights, at::BFloat16) {
  using Bits = uint32_t __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  const Bits bits = std::bit_cast<Bits>(weights);
  return std::bit_cast<Vec>((bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u);  // to nearest even
}

// An item's query rows: padded to whole vectors of kLanes rows, whose state goes lane by lane.
struct Rows {
  int64_t count;
  int64_t padded;
  float* queries;  // [count][kDim], or [kDim][padded] when scored by lanes
  float* acc;  // [count][kDim]
  float* max;  // [padded]
  float* sum;  // [padded]
  float* rescale;  // [padded], this chunk's factor on the earlier acc
  float* scores;  // [kChunk][padded]: scores, then weights, of the chunk's keys
  const int32_t* positions;  // [padded], each row's query position (padding: the largest int)
};

// Scores of a few rows (a decode's) for a tile of keys: dot products.
template <int64_t kDim>
inline void score_rows(const Rows& rows, const float* const* keys, float scale, float* scores) {
  for (int64_t j = 0; j < kLanes; ++j) {
    alignas(64) float lanes[kLanes] = {};
    for (int64_t row = 0; row < rows.count; ++row) lanes[row] = dot<kDim>(rows.queries + row * kDim, keys[j]);
    store(scores + j * rows.padded, load(lanes) * scale);
  }
}

// Scores of many rows (a prefill chunk's) for a tile of keys, kLanes rows at a time: each query column
// times a key's element fills a vector.
template <int64_t kDim>
inline void score_lanes(const Rows& rows, const float* const* keys, float scale, float* scores) {
  constexpr int64_t kKeysAtOnce = 8;  // independent sums in flight
  for (int64_t first = 0; first < rows.padded; first += kLanes) {
    for (int64_t j0 = 0; j0 < kLanes; j0 += kKeysAtOnce) {
      Vec part[kKeysAtOnce] = {};
      for (int64_t d = 0; d < kDim; ++d) {
        const Vec query = load(rows.queries + d * rows.padded + first);
        for (int64_t k = 0; k < kKeysAtOnce; ++k) part[k] += keys[j0 + k][d] * query;
      }
      for (int64_t k = 0; k < kKeysAtOnce; ++k) store(scores + (j0 + k) * rows.padded + first, part[k] * scale);
    }
  }
}

// Softmax step over a chunk of `length` scored keys from position `start` (a multiple of kLanes long):
// masks keys after each row's position, updates max and sum, and leaves the weights in scores.
template <typename scalar_t>
inline void softmax_chunk(Rows& rows, int64_t start, int64_t length) {
  for (int64_t first = 0; first < rows.padded; first += kLanes) {
    IntVec positions;
    std::memcpy(&positions, rows.positions + first, sizeof(positions));
    const Vec old_max = load(rows.max + first);
    Vec new_max = old_max;
    for (int64_t j = 0; j < length; ++j) {
      float* score = rows.scores + j * rows.padded + first;
      const Vec masked = static_cast<int32_t>(start + j) <= positions ? load(score) : Vec{} + kNegInf;
      store(score, masked);
      new_max = max(new_max, masked);
    }
    Vec chunk_sum = {};
    for (int64_t j = 0; j < length; ++j) {
      float* score = rows.scores + j * rows.padded + first;
      const Vec weight = exp_nonpositive(load(score) - new_max);
      chunk_sum += weight;
      store(score, round_weights(weight, scalar_t{}));
    }
    const Vec rescale = exp_nonpositive(old_max - new_max);
    store(rows.rescale + first, rescale);
    store(rows.sum + first, load(rows.sum + first) * rescale + chunk_sum);
    store(rows.max + first, new_max);
  }
}

template <typename scalar_t, int64_t kDim>
void attend_item(const Problem& p, const WorkItem& item, Scratch& scratch) {
  const int64_t group = p.group, block_size = p.block_size;
  const int64_t count = item.num_queries * group;
  const int64_t padded = (count + kLanes - 1) / kLanes * kLanes;
  const bool lanes = count >= kManyRows;
  // zeroed: queries (padding rows included), acc, sum, a zero row for keys past the end; then max,
  // rescale, scores and the widened bf16 rows of a tile, all written before they are read
  const int64_t zeroed = 2 * padded * kDim + padded + kDim;
  scratch.floats.resize(zeroed + 2 * padded + kChunk * padded + kLanes * kDim);
  std::fill(scratch.floats.begin(), scratch.floats.begin() + zeroed, 0.0f);
  scratch.positions.assign(padded, std::numeric_limits<int32_t>::max());
  Rows rows{count, padded, scratch.floats.data()};
  rows.acc = rows.queries + padded * kDim;
  rows.sum = rows.acc + padded * kDim;
  const float* zero_row = rows.sum + padded;
  rows.max = rows.sum + padded + kDim;
  rows.rescale = rows.max + padded;
  rows.scores = rows.rescale + padded;
  rows.positions = scratch.positions.data();
  float* widened = rows.scores + kChunk * padded;
  std::fill(rows.max, rows.max + padded, kNegInf);

  const int32_t* seq = p.seqs + 3 * item.seq;
  const int64_t first_row = seq[0] + item.first_query;
  const int64_t first_pos = seq[2] - seq[1] + item.first_query;  // position of the item's first query
  const auto* q = static_cast<const scalar_t*>(p.q);
  for (int64_t row = 0; row < count; ++row) {
    const int64_t query = row / group, head = item.kv_head * group + row % group;
    const scalar_t* src = q + (first_row + query) * p.q_token_stride + head * p.q_head_stride;
    scratch.positions[row] = static_cast<int32_t>(first_pos + query);
    for (int64_t d = 0; d < kDim; ++d) rows.queries[lanes ? d * padded + row : row * kDim + d] = to_float(src[d]);
  }

  const int64_t row_stride = p.kv_heads * kDim;  // between consecutive slots of one KV head
  const int32_t* table = p.block_tables + item.seq * p.table_stride;
  const int64_t num_keys = first_pos + item.num_queries;
  // the tile's rows of one cache, as fp32 (keys past the last query are masked out and read as zeros)
  const float* tile[kLanes];
  auto load_tile = [&](const scalar_t* cache, int64_t start) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const int64_t pos = start + j;
      if (pos >= num_keys) {
        tile[j] = zero_row;
        continue;
      }
      const int64_t slot = static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
      tile[j] = row_as_float<kDim>(cache + slot * row_stride + item.kv_head * kDim, widened + j * kDim);
    }
  };
  for (int64_t chunk = 0; chunk < num_keys; chunk += kChunk) {
    const int64_t length = (std::min(kChunk, num_keys - chunk) + kLanes - 1) / kLanes * kLanes;
    for (int64_t offset = 0; offset < length; offset += kLanes) {
      load_tile(static_cast<const scalar_t*>(p.key_cache), chunk + offset);
      float* scores = rows.scores + offset * padded;
      lanes ? score_lanes<kDim>(rows, tile, p.scale, scores) : score_rows<kDim>(rows, tile, p.scale, scores);
    }
    softmax_chunk<scalar_t>(rows, chunk, length);
    for (int64_t offset = 0; offset < length; offset += kLanes) {
      load_tile(static_cast<const scalar_t*>(p.value_cache), chunk + offset);
      for (int64_t row = 0; row < count; ++row) {
        const float rescale = offset == 0 ? rows.rescale[row] : 1.0f;
        accumulate<kDim>(rows.acc + row * kDim, rescale, rows.scores + offset * padded + row, padded, tile);
      }
    }
  }

  auto* out = static_cast<scalar_t*>(p.out);
  const int64_t out_stride = p.kv_heads * group * kDim;
  for (int64_t row = 0; row < count; ++row) {
    const int64_t query = row / group, head = item.kv_head * group + row % group;
    const float inverse = 1.0f / rows.sum[row];
    scalar_t* dst = out + (first_row + query) * out_stride + head * kDim;
    for (int64_t d = 0; d < kDim; ++d) store(rows.acc[row * kDim + d] * inverse, dst + d);
  }
}

// The head sizes compiled (the Python side sends other sizes to the reference path).
template <typename scalar_t>
void attend(const Problem& p, int64_t head_dim, const WorkItem& item, Scratch& scratch) {
  switch (head_dim) {
    case 16:
      return attend_item<scalar_t, 16>(p, item, scratch);
    case 32:
      return attend_item<scalar_t, 32>(p, item, scratch);
    case 64:
      return attend_item<scalar_t, 64>(p, item, scratch);
    case 128:
      return attend_item<scalar_t, 128>(p, item, scratch);
    default:
      TORCH_CHECK(false, "paged_attention supports head_dim 16, 32, 64 and 128, not ", head_dim);
  }
}

std::vector<WorkItem> plan_items(const at::Tensor& seqs, int64_t kv_heads) {
  std::vector<WorkItem> items;
  const int32_t* info = seqs.data_ptr<int32_t>();
  for (int64_t seq = 0; seq < seqs.size(0); ++seq) {
    const int64_t query_len = info[3 * seq + 1], context_len = info[3 * seq + 2];
    for (int64_t first = 0; first < query_len; first += kQueryTile) {
      const int64_t count = std::min(kQueryTile, query_len - first);
      const int64_t keys = context_len - query_len + first + count;
      for (int64_t head = 0; head < kv_heads; ++head) items.push_back({seq, head, first, count, count * keys});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

void check_inputs(
    const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_tables, const at::Tensor& seqs, int64_t block_size) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [tokens, heads, head_dim] with unit stride in head_dim");
  TORCH_CHECK(key_cache.dim() == 3 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes(),
              "key and value caches must be contiguous [slots, kv_heads, head_dim] of one shape");
  TORCH_CHECK(key_cache.scalar_type() == q.scalar_type() && value_cache.scalar_type() == q.scalar_type(),
              "q and the caches must have one dtype");
  TORCH_CHECK(key_cache.size(2) == q.size(2) && q.size(1) % key_cache.size(1) == 0,
              "head_dim must match and heads must be a multiple of kv_heads");
  TORCH_CHECK(block_size > 0 && key_cache.size(0) % block_size == 0, "slots must be whole blocks");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables must be contiguous int32 [seqs, max_blocks]");
  TORCH_CHECK(seqs.scalar_type() == at::kInt && seqs.dim() == 2 && seqs.size(1) == 3 && seqs.is_contiguous() &&
                  seqs.size(0) == block_tables.size(0),
              "seqs must be contiguous int32 [seqs, 3] (first row, query length, context length)");
  const int64_t num_blocks = key_cache.size(0) / block_size;
  const int32_t* info = seqs.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t seq = 0; seq < seqs.size(0); ++seq) {
    const int64_t first = info[3 * seq], query_len = info[3 * seq + 1], context_len = info[3 * seq + 2];
    TORCH_CHECK(query_len >= 1 && context_len >= query_len && first >= 0 && first + query_len <= q.size(0),
                "sequence ", seq, ": rows or lengths out of range");
    const int64_t blocks = (context_len + block_size - 1) / block_size;
    TORCH_CHECK(blocks <= block_tables.size(1), "sequence ", seq, ": block table too short");
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t block = tables[seq * block_tables.size(1) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", seq, ": block id ", block, " out of range");
    }
  }
}

// Attention output [tokens, heads * head_dim] in q's dtype; rows no sequence covers are left uninitialised.
at::Tensor paged_attention(
    const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_tables, const at::Tensor& seqs, int64_t block_size, double scale) {
  check_inputs(q, key_cache, value_cache, block_tables, seqs, block_size);
  const int64_t heads = q.size(1), kv_heads = key_cache.size(1), dim = q.size(2);
  at::Tensor out = at::empty({q.size(0), heads * dim}, q.options());
  const Problem problem{q.data_ptr(), q.stride(0), q.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
                        out.data_ptr(), block_tables.data_ptr<int32_t>(), block_tables.size(1),
                        seqs.data_ptr<int32_t>(), block_size, kv_heads, heads / kv_heads,
                        static_cast<float>(scale)};
  const std::vector<WorkItem> items = plan_items(seqs, kv_heads);
  const int64_t num_items = static_cast<int64_t>(items.size());
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || q.scalar_type() == at::kFloat, "paged_attention supports float32 and bfloat16");
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(num_items, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t index = next++; index < num_items; index = next++) {
      if (bf16) {
        attend<at::BFloat16>(problem, dim, items[index], scratch);
      } else {
        attend<float>(problem, dim, items[index], scratch);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(weir, m) {
  m.def(
      "paged_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seqs, "
      "int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(weir, CPU, m) { m.impl("paged_attention", &paged_attention); }
