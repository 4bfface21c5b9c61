// Attention that reads Weir's paged KV cache in place (CPU).
//
// One call covers a whole step: decodes (one query) and prefill chunks (several queries, causal within the
// chunk, after any earlier context). Work is split into items of (sequence, KV head, up to kQueryTile
// queries), or for decodes in steps of many (sequence, every KV head); an item computes every query head of
// its KV heads for its queries, so each key and value row is read once for the whole group (grouped-query
// attention). Items are spread over torch's OpenMP threads, longest first.
//
// An item walks its sequence's keys with an online softmax over chunks of kChunk positions, reading each
// position's row where the block table puts it, kLanes rows at a time: the chunk's scores, then the running
// maximum and sum, then its values weighted into the accumulator, all in fp32 whatever the cache's dtype.
// A query at position p reads keys 0..p only. The chunk length and the rounding of the weights to the
// cache's dtype are those of torch's CPU SDPA, so bf16 results round as the reference path's do.
//
// An item takes one of three paths. An item with few query rows (a decode: one row per query head of the
// group) scores a tile of kLanes keys per row as kLanes dot products folded into one vector, and runs the
// softmax along the keys of each row; since a decode's KV comes from memory, it prefetches the next tile's
// rows into L1 and, while it scores keys, keys further ahead and the values of the keys ahead into L2, each
// spread over the rows' work. An item with many rows (a prefill chunk) holds its queries transposed,
// [head_dim][rows], and scores kLanes rows at once for each key, so every multiply-add fills a vector; its
// softmax state goes lane by lane. The code uses GCC/Clang vector types; head_dim is a compile-time
// constant so that a row of the accumulator stays in registers.
//
// On a CPU with the bf16 dot-product instruction (AVX512-BF16), a bf16 item with few rows takes the dot path
// instead, for head sizes of whole 512-bit vectors: it reads keys and values as the cache holds them and
// multiplies bf16 pairs into fp32 sums, where the generic path widens every row to fp32 first.
//
// On a CPU with bf16 matrix or dot-product instructions (AMX, AVX512-BF16), a bf16 item with many rows takes
// the matrix path instead, when oneDNN's small-matrix kernel (torch's `cpublas::brgemm`) answers a probe
// exactly: the item's rows times a block of kBlock keys is one bf16 matrix multiply with fp32 sums, and so
// is the block's weights times its values. Each block of keys and values is first copied from its slots
// into the pair-interleaved (VNNI) layout that kernel reads (with AVX-512 the keys' pairs are transposed 16
// by 16 in registers and each two value rows interleaved by a permute); the scores go through the decode path's
// softmax, row by row, with the same rounding of the weights to bf16. Its items hold kMatrixQueryTile
// queries, to spread each block's copy over more rows.

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AMX_BF16__) || defined(__AVX512BF16__)
#define WEIR_MATRIX_PATH 1
#endif
#if defined(__AVX512BF16__) || defined(__AVX512BW__)
#include <immintrin.h>
#endif
#ifdef __AVX512BF16__
#define WEIR_DOT_PATH 1
#endif

namespace {

constexpr int64_t kQueryTile = 16;  // queries per work item of a prefill chunk
constexpr int64_t kMatrixQueryTile = 64;  // the same on the matrix path, whose block copies it amortises
constexpr int64_t kLanes = 16;  // keys per tile, and query rows scored together
constexpr int64_t kManyRows = 8;  // from this many query rows, an item scores kLanes rows at once
constexpr int64_t kChunk = 512;  // keys per softmax step, as in torch's CPU flash attention (kvSplitSize)
constexpr int64_t kBlock = 64;  // keys per matrix multiply on the matrix path (kChunk is a multiple)
constexpr int64_t kAheadTiles = 1;  // tiles a decode prefetches ahead of the one it reads
constexpr int64_t kFarTiles = 1;  // how much further ahead a decode's keys go to L2
constexpr int64_t kWholeRowItemsPerThread = 2;  // decodes per thread from which they take whole-row items
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum class CacheLevel { kL1, kL2 };  // where a prefetch puts its lines

using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
using IntVec = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));
using Half = float __attribute__((vector_size(kLanes / 2 * sizeof(float))));
using Quarter = float __attribute__((vector_size(kLanes / 4 * sizeof(float))));
using Bits = uint32_t __attribute__((vector_size(kLanes * sizeof(uint32_t))));
using HalfBits = uint16_t __attribute__((vector_size(kLanes * sizeof(uint16_t))));
constexpr IntVec kLaneIndex = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

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

// acc = acc * rescale + the sum over the tile's keys j of weights[j * stride] * values[j][offset ..].
template <int64_t kDim>
inline void accumulate(float* acc, float rescale, const float* weights, int64_t stride, const float* const* values,
                       int64_t offset = 0) {
  constexpr int64_t kVectors = kDim / kLanes;
  Vec part[kVectors];
  for (int64_t c = 0; c < kVectors; ++c) part[c] = load(acc + c * kLanes) * rescale;
  for (int64_t j = 0; j < kLanes; ++j) {
    const float weight = weights[j * stride];
    for (int64_t c = 0; c < kVectors; ++c) part[c] += weight * load(values[j] + offset + c * kLanes);
  }
  for (int64_t c = 0; c < kVectors; ++c) store(acc + c * kLanes, part[c]);
}

struct WorkItem {
  int64_t seq;
  int64_t kv_head;  // the item's first KV head
  int64_t first_query;  // index of the item's first query within its sequence's step tokens
  int64_t num_queries;
  int64_t cost;  // queries times keys read, to schedule the longest items first
  int64_t heads = 1;  // KV heads covered: all of them for a whole-row decode (see whole_row_decodes)
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
  std::vector<int64_t> slots;  // a decode's chunk of cache rows, as element offsets
  std::vector<int32_t> positions;
  std::vector<uint16_t> halves;  // bf16 operands of the matrix path, as their bits
};

// An item's place in the problem: its query rows (row r is query r / per_query of the item, head
// kv_head * group + r % per_query, per_query being the group's query heads times the item's KV heads) and
// where each of its keys lives in the caches.
template <typename scalar_t, int64_t kDim>
struct ItemView {
  using Scalar = scalar_t;
  const Problem& p;
  const WorkItem& item;
  int64_t per_query;  // query rows per query token
  int64_t count;  // query rows
  int64_t first_row;  // the item's first query token in the flat batch
  int64_t first_pos;  // position of the item's first query
  int64_t num_keys;  // keys 0 .. num_keys - 1 are read
  const int32_t* table;

  ItemView(const Problem& problem, const WorkItem& work)
      : p(problem), item(work), per_query(problem.group * work.heads), count(work.num_queries * per_query) {
    const int32_t* seq = p.seqs + 3 * item.seq;
    first_row = seq[0] + item.first_query;
    first_pos = seq[2] - seq[1] + item.first_query;
    num_keys = first_pos + item.num_queries;
    table = p.block_tables + item.seq * p.table_stride;
  }

  int64_t head(int64_t row) const { return item.kv_head * p.group + row % per_query; }
  int64_t position(int64_t row) const { return first_pos + row / per_query; }
  // Where the KV head of `row` starts within a cache row of the item's first KV head.
  int64_t head_offset(int64_t row) const { return row % per_query / p.group * kDim; }

  const scalar_t* query(int64_t row) const {
    return static_cast<const scalar_t*>(p.q) + (first_row + row / per_query) * p.q_token_stride +
           head(row) * p.q_head_stride;
  }


  // A cursor over the cache rows of consecutive keys: it walks the block table (a division per key cost more
  // than the key's scores).
  struct Cursor {
    int64_t pos, block, offset;
  };

  Cursor cursor(int64_t pos) const { return {pos, pos / p.block_size, pos % p.block_size}; }

  // Where the cursor's cache row starts, in elements from the start of the cache (-1 past the last key); the
  // cursor moves to the next key.
  int64_t next_slot(Cursor& at) const {
    const int64_t slot = at.pos < num_keys ? (table[at.block] * p.block_size + at.offset) * p.kv_heads * kDim : -1;
    ++at.pos;
    if (++at.offset == p.block_size) {
      at.offset = 0;
      ++at.block;
    }
    return slot;
  }

  // The cursor's row of the cache whose item head starts at `base` (nullptr past the last key); the cursor
  // moves to the next key.
  const scalar_t* next_row(const scalar_t* base, Cursor& at) const {
    const int64_t slot = next_slot(at);
    return slot < 0 ? nullptr : base + slot;
  }

  // Where the item's first KV head starts in the cache's first row: a key's row is this plus its slot.
  const scalar_t* head_base(const void* cache) const {
    return static_cast<const scalar_t*>(cache) + item.kv_head * kDim;
  }

  // The cache rows of `kLanes` keys from `start` of one cache (past the last key: `past`).
  void rows_at(const void* cache, int64_t start, const scalar_t** tile, const scalar_t* past = nullptr) const {
    const scalar_t* base = head_base(cache);
    Cursor at = cursor(start);
    for (int64_t j = 0; j < kLanes; ++j) {
      const scalar_t* row = next_row(base, at);
      tile[j] = row == nullptr ? past : row;
    }
  }

  // Prefetches share `share` of `shares` of a tile's rows (from rows_at): keys share, share + shares, ...
  // Spread over the work on an earlier tile, the requests keep the memory busy without stalling it.
  void prefetch_share(const scalar_t* const* tile, int64_t share, int64_t shares,
                      CacheLevel to = CacheLevel::kL1) const {
    for (int64_t j = share; j < kLanes; j += shares) {
      if (tile[j] == nullptr) continue;
      for (int64_t d = 0; d < item.heads * kDim; d += 64 / sizeof(scalar_t)) {
        if (to == CacheLevel::kL1) {
          __builtin_prefetch(tile[j] + d);
        } else {
          __builtin_prefetch(tile[j] + d, 0, 2);
        }
      }
    }
  }

  // The cache rows of `kLanes` keys from `start` of one cache (keys past the last point at `zero_row`), with
  // a prefetch of the next tile's rows.
  void tile_rows(const void* cache, int64_t start, const scalar_t** tile, const scalar_t* zero_row) const {
    const scalar_t* next[kLanes];
    rows_at(cache, start + kLanes, next);
    prefetch_share(next, 0, 1);
    rows_at(cache, start, tile, zero_row);
  }

  // The same keys as fp32 rows of the item's heads (bf16 widened into `widened` [kLanes][heads][kDim]).
  void load_tile(const void* cache, int64_t start, const float** tile, float* widened, const float* zero_row) const {
    const scalar_t* rows[kLanes];
    tile_rows(cache, start, rows, nullptr);
    widen_tile(rows, tile, widened, zero_row);
  }

  // A tile's rows (from rows_at; nullptr past the last key: `zero_row`) as fp32 rows of the item's heads.
  void widen_tile(const scalar_t* const* rows, const float** tile, float* widened, const float* zero_row) const {
    for (int64_t j = 0; j < kLanes; ++j) {
      if (rows[j] == nullptr) {
        tile[j] = zero_row;
        continue;
      }
      float* dst = widened + j * item.heads * kDim;
      tile[j] = row_as_float<kDim>(rows[j], dst);
      for (int64_t h = 1; h < item.heads; ++h) row_as_float<kDim>(rows[j] + h * kDim, dst + h * kDim);
    }
  }

  // out[row] = acc[row] / sum[row], in the output's dtype.
  void write(const float* acc, const float* sum) const {
    auto* out = static_cast<scalar_t*>(p.out);
    const int64_t out_stride = p.kv_heads * p.group * kDim;
    for (int64_t row = 0; row < count; ++row) {
      const float inverse = 1.0f / sum[row];
      scalar_t* dst = out + (first_row + row / per_query) * out_stride + head(row) * kDim;
      for (int64_t d = 0; d < kDim; ++d) store(acc[row * kDim + d] * inverse, dst + d);
    }
  }
};

// Weights as the attention of torch's CPU SDPA uses them: rounded to the cache's dtype before they multiply
// the values (so that bf16 results round as the reference and transformers do).
inline Vec round_weights(Vec weights, float) { return weights; }

inline Vec round_weights(Vec weights, at::BFloat16) {
  const Bits bits = std::bit_cast<Bits>(weights);
  return std::bit_cast<Vec>((bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u);  // to nearest even
}

// Weights rounded by round_weights to bf16, stored as their bf16 bits.
inline void store_bf16_bits(uint16_t* dst, Vec weights) {
  const HalfBits bits = __builtin_convertvector(std::bit_cast<Bits>(weights) >> 16, HalfBits);
  std::memcpy(dst, &bits, sizeof(bits));
}

// One row's online-softmax step over a chunk's `length` keys (a multiple of kLanes), from their unscaled
// scores: keys after `last` (the row's own position, counted from the chunk's start) are masked. Updates the
// row's max and sum, hands each vector of weights, rounded as round_weights does, to `put(j, weights)`, and
// returns the factor on the row's earlier accumulator.
template <typename scalar_t, typename Put>
inline float softmax_row(float* scores, int64_t length, int64_t last, float scale, float& row_max, float& row_sum,
                         Put put) {
  Vec top = Vec{} + row_max;
  for (int64_t j = 0; j < length; j += kLanes) {
    const Vec masked = kLaneIndex + static_cast<int32_t>(j) <= static_cast<int32_t>(last)
                           ? load(scores + j) * scale
                           : Vec{} + kNegInf;
    store(scores + j, masked);
    top = max(top, masked);
  }
  float new_max = top[0];
  for (int64_t lane = 1; lane < kLanes; ++lane) new_max = std::max(new_max, top[lane]);
  Vec chunk_sum = {};
  for (int64_t j = 0; j < length; j += kLanes) {
    const Vec weight = exp_nonpositive(load(scores + j) - new_max);
    chunk_sum += weight;
    put(j, round_weights(weight, scalar_t{}));
  }
  const float rescale = row_max == kNegInf ? 0.0f : std::exp(row_max - new_max);
  row_sum = row_sum * rescale + horizontal_sum(chunk_sum);
  row_max = new_max;
  return rescale;
}

// Two vectors, each holding the partial sums of g keys (16 / g lanes per key, key by key), folded into one
// holding the partial sums of their 2g keys, half as many per key: kHalf = 8 / g.
template <int kHalf>
inline Vec fold(Vec a, Vec b) {
  if constexpr (kHalf == 8) {
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  } else if constexpr (kHalf == 4) {
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  } else if constexpr (kHalf == 2) {
    return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  } else {
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  }
}

// kLanes vectors of partial sums, one per key, folded into one vector whose lane j holds key j's sum.
inline Vec fold_tile(const Vec* parts) {
  Vec eighths[8], quarters[4], halves[2];
  for (int64_t k = 0; k < 8; ++k) eighths[k] = fold<8>(parts[2 * k], parts[2 * k + 1]);
  for (int64_t k = 0; k < 4; ++k) quarters[k] = fold<4>(eighths[2 * k], eighths[2 * k + 1]);
  for (int64_t k = 0; k < 2; ++k) halves[k] = fold<2>(quarters[2 * k], quarters[2 * k + 1]);
  return fold<1>(halves[0], halves[1]);
}

// The dot products of one query row with a tile of kLanes keys (each `offset` into its row), lane j holding
// key j's.
template <int64_t kDim>
inline Vec dot_tile(const float* query, const float* const* keys, int64_t offset) {
  Vec parts[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) {
    const float* key = keys[j] + offset;
    parts[j] = load(query) * load(key);
    for (int64_t c = kLanes; c < kDim; c += kLanes) parts[j] += load(query + c) * load(key + c);
  }
  return fold_tile(parts);
}

// A decode's walk over its keys, a chunk at a time: the chunk's tiles of keys, then of values. The chunk's
// cache rows are found once, by walking the block table (a key's row starts at the same element of the key
// and the value cache); reading a tile, or prefetching one, then only adds them to a base. Each tile goes
// to L1 kAheadTiles tiles before it is read, and while the keys are scored, the keys kFarTiles tiles
// further ahead and the values of the keys ahead go to L2, so that more reads from memory are in flight
// than the L1 prefetches alone keep. Each tile's prefetches are spread over the work on an earlier one, a
// share after each query row: a whole tile's lines requested at once fill the core's outstanding-miss
// slots and stall it. Its calls are forced inline: GCC left them calls, and a decode took 1.8x as long.
template <typename View>
class DecodeWalk {
 public:
  using Row = const typename View::Scalar*;

  DecodeWalk(const View& view, std::vector<int64_t>& slots)
      : view_(view),
        shares_(std::min(view.count, kLanes)),
        key_base_(view.head_base(view.p.key_cache)),
        value_base_(view.head_base(view.p.value_cache)) {
    slots.resize(kChunk);
    slots_ = slots.data();
  }

  // Starts the chunk of `length` keys (a multiple of kLanes) from key `chunk`.
  [[gnu::always_inline]] void start(int64_t chunk, int64_t length) {
    tiles_ = length / kLanes;
    auto at = view_.cursor(chunk);
    for (int64_t j = 0; j < length; ++j) slots_[j] = view_.next_slot(at);
    for (int64_t index = 0; index < kAheadTiles; ++index) {
      tile_at(index, ahead_, nullptr);
      view_.prefetch_share(ahead_, 0, 1);
    }
  }

  // The rows of the chunk's key tile `offset` (in keys; past the last key: `past`), and its prefetches.
  [[gnu::always_inline]] void keys(int64_t offset, Row* tile, Row past) {
    const int64_t next = offset / kLanes + kAheadTiles;
    tile_at(offset / kLanes, tile, past);
    tile_at(next, ahead_, nullptr);
    tile_at(next + kFarTiles, far_keys_, nullptr);
    tile_at(tiles_ + next, later_values_, nullptr);
    scoring_ = true;
  }

  // The same for the chunk's value tile `offset`.
  [[gnu::always_inline]] void values(int64_t offset, Row* tile, Row past) {
    tile_at(tiles_ + offset / kLanes, tile, past);
    tile_at(tiles_ + offset / kLanes + kAheadTiles, ahead_, nullptr);
    scoring_ = false;
  }

  // After query row `row`'s work on the tile: its share of the prefetches.
  [[gnu::always_inline]] void after_row(int64_t row) const {
    if (row >= shares_) return;
    view_.prefetch_share(ahead_, row, shares_);
    if (!scoring_) return;
    view_.prefetch_share(far_keys_, row, shares_, CacheLevel::kL2);
    view_.prefetch_share(later_values_, row, shares_, CacheLevel::kL2);
  }

 private:
  // The rows of the chunk's tile `index`: its tiles of keys, then of values, then none (all nullptr).
  [[gnu::always_inline]] void tile_at(int64_t index, Row* tile, Row past) const {
    const bool key = index < tiles_;
    if (!key && index >= 2 * tiles_) {
      std::fill(tile, tile + kLanes, nullptr);
      return;
    }
    const Row base = key ? key_base_ : value_base_;
    const int64_t* slots = slots_ + (key ? index : index - tiles_) * kLanes;
    for (int64_t j = 0; j < kLanes; ++j) tile[j] = slots[j] < 0 ? past : base + slots[j];
  }

  const View& view_;
  const int64_t shares_;
  const Row key_base_;
  const Row value_base_;
  int64_t* slots_;
  int64_t tiles_ = 0;
  bool scoring_ = true;
  Row ahead_[kLanes];
  Row far_keys_[kLanes];
  Row later_values_[kLanes];
};

// An item with few query rows (a decode: one row per query head of the group). Per tile of keys, each row's
// scores are its dot products with them, folded into one vector; the chunk's softmax then runs along the
// keys of each row, and the weights multiply the values into each row's accumulator.
template <typename scalar_t, int64_t kDim>
void attend_item_rows(const Problem& p, const WorkItem& item, Scratch& scratch) {
  const ItemView<scalar_t, kDim> view(p, item);
  const int64_t count = view.count, width = item.heads * kDim;  // width: a cache row of the item's heads
  // zeroed: acc, sum and a zero row; then queries, max, rescale, scores and the widened rows of a tile
  const int64_t zeroed = count * kDim + count + width;
  scratch.floats.resize(zeroed + count * kDim + 2 * count + count * kChunk + kLanes * width);
  std::fill(scratch.floats.begin(), scratch.floats.begin() + zeroed, 0.0f);
  float* acc = scratch.floats.data();
  float* row_sum = acc + count * kDim;
  const float* zero_row = row_sum + count;
  float* queries = row_sum + count + width;
  float* row_max = queries + count * kDim;
  float* rescale = row_max + count;  // this chunk's factor on each row's earlier accumulator
  float* scores = rescale + count;  // [count][kChunk]
  float* widened = scores + count * kChunk;
  std::fill(row_max, row_max + count, kNegInf);
  for (int64_t row = 0; row < count; ++row) {
    const scalar_t* src = view.query(row);
    for (int64_t d = 0; d < kDim; ++d) queries[row * kDim + d] = to_float(src[d]);
  }

  const scalar_t* rows[kLanes];
  const float* tile[kLanes];
  DecodeWalk walk(view, scratch.slots);
  for (int64_t chunk = 0; chunk < view.num_keys; chunk += kChunk) {
    const int64_t length = (std::min(kChunk, view.num_keys - chunk) + kLanes - 1) / kLanes * kLanes;
    walk.start(chunk, length);
    for (int64_t offset = 0; offset < length; offset += kLanes) {
      walk.keys(offset, rows, nullptr);
      view.widen_tile(rows, tile, widened, zero_row);
      for (int64_t row = 0; row < count; ++row) {
        store(scores + row * kChunk + offset, dot_tile<kDim>(queries + row * kDim, tile, view.head_offset(row)));
        walk.after_row(row);
      }
    }
    for (int64_t row = 0; row < count; ++row) {
      float* row_scores = scores + row * kChunk;
      rescale[row] = softmax_row<scalar_t>(row_scores, length, view.position(row) - chunk, p.scale, row_max[row],
                                           row_sum[row], [&](int64_t j, Vec w) { store(row_scores + j, w); });
    }
    for (int64_t offset = 0; offset < length; offset += kLanes) {
      walk.values(offset, rows, nullptr);
      view.widen_tile(rows, tile, widened, zero_row);
      for (int64_t row = 0; row < count; ++row) {
        const float factor = offset == 0 ? rescale[row] : 1.0f;
        accumulate<kDim>(acc + row * kDim, factor, scores + row * kChunk + offset, 1, tile, view.head_offset(row));
        walk.after_row(row);
      }
    }
  }
  view.write(acc, row_sum);
}

#ifdef WEIR_DOT_PATH
// A bf16 decode on a CPU with the bf16 dot-product instruction (vdpbf16ps: each fp32 lane adds the two
// products of a pair of bf16 lanes), for head sizes of whole 512-bit vectors: keys and values are read as
// the cache holds them, never widened. A key's score is kDim / 32 such instructions on the query row, the
// tile's folded as on the generic path. Values: each pair of a tile's value rows is interleaved once (the
// pairs the instruction reads; shared by the item's rows), and a row adds its pair of weights, broadcast,
// times them. Interleaving within 128-bit lanes leaves each accumulator vector's dims in a fixed order other
// than the natural one, which the item puts back when it writes its output.
constexpr int64_t kDotLanes = 32;  // bf16 lanes of a 512-bit vector

inline __m512bh load_bf16(const uint16_t* src) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(src)); }

// The dot products of one query row with a tile of kLanes keys (each `offset` into its cache row), lane j
// holding key j's.
template <int64_t kDim>
inline Vec dot_tile_bf16(const uint16_t* query, const uint16_t* const* keys, int64_t offset) {
  __m512bh q[kDim / kDotLanes];
  for (int64_t c = 0; c < kDim / kDotLanes; ++c) q[c] = load_bf16(query + c * kDotLanes);
  Vec parts[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) {
    const uint16_t* key = keys[j] + offset;
    __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], load_bf16(key));
    for (int64_t c = 1; c < kDim / kDotLanes; ++c) sum = _mm512_dpbf16_ps(sum, q[c], load_bf16(key + c * kDotLanes));
    parts[j] = reinterpret_cast<Vec>(sum);
  }
  return fold_tile(parts);
}

// The natural dim of lane `lane` of accumulator vector `vector`: vector 2c (2c + 1) holds the low (high)
// four dims of each 8-dim lane group of dims 32c .. 32c + 31.
constexpr int64_t interleaved_dim(int64_t vector, int64_t lane) {
  return (vector / 2) * kDotLanes + (lane / 4) * 8 + (vector % 2) * 4 + lane % 4;
}

// Each pair of a tile's value rows (`vectors` bf16 vectors of the item's heads), interleaved for the
// bf16 pair instructions: pair j / 2 of the tile at dst + j / 2 * pair_stride, vector c of the rows as
// vectors 2c and 2c + 1 there (each holding the pairs of its dims in interleaved_dim's order).
inline void interleave_pairs(const uint16_t* const* tile, int64_t vectors, int64_t pair_stride, uint16_t* dst) {
  for (int64_t j = 0; j < kLanes; j += 2) {
    uint16_t* pair = dst + j / 2 * pair_stride;
    for (int64_t c = 0; c < vectors; ++c) {
      const __m512i even = _mm512_loadu_si512(tile[j] + c * kDotLanes);
      const __m512i odd = _mm512_loadu_si512(tile[j + 1] + c * kDotLanes);
      _mm512_storeu_si512(pair + 2 * c * kDotLanes, _mm512_unpacklo_epi16(even, odd));
      _mm512_storeu_si512(pair + (2 * c + 1) * kDotLanes, _mm512_unpackhi_epi16(even, odd));
    }
  }
}

// The item's output from accumulators [count][kDim] whose dims are in interleaved_dim's order (put back
// in place first) and its rows' softmax sums.
template <int64_t kDim>
void write_interleaved(const Problem& p, const WorkItem& item, float* acc, const float* row_sum) {
  constexpr int64_t kSums = 2 * kDim / kDotLanes;
  const ItemView<at::BFloat16, kDim> view(p, item);
  for (int64_t row = 0; row < view.count; ++row) {
    float natural[kDim];
    for (int64_t v = 0; v < kSums; ++v) {
      for (int64_t lane = 0; lane < kLanes; ++lane) natural[interleaved_dim(v, lane)] = acc[row * kDim + v * kLanes + lane];
    }
    std::memcpy(acc + row * kDim, natural, sizeof(natural));
  }
  view.write(acc, row_sum);
}

template <int64_t kDim>
void attend_item_rows_dot(const Problem& p, const WorkItem& item, Scratch& scratch) {
  constexpr int64_t kVectors = kDim / kDotLanes;  // bf16 vectors in a row
  constexpr int64_t kSums = 2 * kVectors;  // fp32 accumulator vectors in a row
  const ItemView<uint16_t, kDim> view(p, item);
  const int64_t count = view.count;
  const int64_t pair_stride = item.heads * kSums * kDotLanes;  // one pair of keys' interleaved values
  scratch.floats.resize(count * (kDim + kChunk + 3));
  scratch.halves.resize(count * (kChunk + kDim) + kLanes / 2 * pair_stride + item.heads * kDim);
  float* acc = scratch.floats.data();  // [count][kDim], dims interleaved
  float* scores = acc + count * kDim;  // [count][kChunk]
  float* row_max = scores + count * kChunk;
  float* row_sum = row_max + count;
  float* rescale = row_sum + count;  // this chunk's factor on each row's earlier accumulator
  uint16_t* weights = scratch.halves.data();  // [count][kChunk], bf16 bits
  uint16_t* queries = weights + count * kChunk;  // [count][kDim]
  uint16_t* pairs = queries + count * kDim;  // a tile's values: [kLanes / 2][heads][kSums][kDotLanes]
  uint16_t* zero_row = pairs + kLanes / 2 * pair_stride;  // a cache row of the item's heads, past the last key
  std::fill(acc, acc + count * kDim, 0.0f);
  std::fill(row_max, row_max + count, kNegInf);
  std::fill(row_sum, row_sum + count, 0.0f);
  std::fill(zero_row, zero_row + item.heads * kDim, uint16_t{0});
  for (int64_t row = 0; row < count; ++row) std::memcpy(queries + row * kDim, view.query(row), kDim * sizeof(uint16_t));

  const uint16_t* tile[kLanes];
  DecodeWalk walk(view, scratch.slots);
  for (int64_t chunk = 0; chunk < view.num_keys; chunk += kChunk) {
    const int64_t length = (std::min(kChunk, view.num_keys - chunk) + kLanes - 1) / kLanes * kLanes;
    walk.start(chunk, length);
    for (int64_t offset = 0; offset < length; offset += kLanes) {
      walk.keys(offset, tile, zero_row);
      for (int64_t row = 0; row < count; ++row) {
        const Vec row_scores = dot_tile_bf16<kDim>(queries + row * kDim, tile, view.head_offset(row));
        store(scores + row * kChunk + offset, row_scores);
        walk.after_row(row);
      }
    }
    for (int64_t row = 0; row < count; ++row) {
      uint16_t* row_weights = weights + row * kChunk;
      rescale[row] = softmax_row<at::BFloat16>(scores + row * kChunk, length, view.position(row) - chunk, p.scale,
                                               row_max[row], row_sum[row],
                                               [&](int64_t j, Vec w) { store_bf16_bits(row_weights + j, w); });
    }
    for (int64_t offset = 0; offset < length; offset += kLanes) {
      walk.values(offset, tile, zero_row);
      interleave_pairs(tile, item.heads * kVectors, pair_stride, pairs);
      for (int64_t row = 0; row < count; ++row) {
        const __m512 factor = _mm512_set1_ps(offset == 0 ? rescale[row] : 1.0f);
        float* row_acc = acc + row * kDim;
        __m512 sums[kSums];
        for (int64_t v = 0; v < kSums; ++v) sums[v] = _mm512_mul_ps(_mm512_loadu_ps(row_acc + v * kLanes), factor);
        const uint16_t* row_weights = weights + row * kChunk + offset;
        const uint16_t* row_pairs = pairs + 2 * view.head_offset(row);  // its head's kSums vectors
        for (int64_t j = 0; j < kLanes; j += 2) {
          uint32_t weight_pair;
          std::memcpy(&weight_pair, row_weights + j, sizeof(weight_pair));
          const __m512bh broadcast = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(weight_pair)));
          const uint16_t* src = row_pairs + j / 2 * pair_stride;
          for (int64_t v = 0; v < kSums; ++v) {
            sums[v] = _mm512_dpbf16_ps(sums[v], broadcast, load_bf16(src + v * kDotLanes));
          }
        }
        for (int64_t v = 0; v < kSums; ++v) _mm512_storeu_ps(row_acc + v * kLanes, sums[v]);
        walk.after_row(row);
      }
    }
  }
  write_interleaved<kDim>(p, item, acc, row_sum);
}
#endif

// An item's many query rows (a prefill chunk's), padded to whole vectors of kLanes rows whose softmax state
// goes lane by lane.
struct Rows {
  int64_t count;
  int64_t padded;
  float* queries;  // [kDim][padded]
  float* acc;  // [count][kDim]
  float* max;  // [padded]
  float* sum;  // [padded]
  float* rescale;  // [padded], this chunk's factor on the earlier acc
  float* scores;  // [kChunk][padded]: scores, then weights, of the chunk's keys
  const int32_t* positions;  // [padded], each row's query position (padding: the largest int)
};

// Scores of many rows for a tile of keys, kLanes rows at a time: each query column times a key's element
// fills a vector.
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

// An item with many query rows on the vector path: queries held transposed, kLanes rows scored at once.
template <typename scalar_t, int64_t kDim>
void attend_item_lanes(const Problem& p, const WorkItem& item, Scratch& scratch) {
  const ItemView<scalar_t, kDim> view(p, item);
  const int64_t count = view.count;
  const int64_t padded = (count + kLanes - 1) / kLanes * kLanes;
  // zeroed: queries (padding rows included), acc, sum, a zero row for keys past the end; then max,
  // rescale, scores and the widened rows of a tile, all written before they are read
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
  for (int64_t row = 0; row < count; ++row) {
    const scalar_t* src = view.query(row);
    scratch.positions[row] = static_cast<int32_t>(view.position(row));
    for (int64_t d = 0; d < kDim; ++d) rows.queries[d * padded + row] = to_float(src[d]);
  }

  const float* tile[kLanes];
  for (int64_t chunk = 0; chunk < view.num_keys; chunk += kChunk) {
    const int64_t length = (std::min(kChunk, view.num_keys - chunk) + kLanes - 1) / kLanes * kLanes;
    for (int64_t offset = 0; offset < length; offset += kLanes) {
      view.load_tile(p.key_cache, chunk + offset, tile, widened, zero_row);
      score_lanes<kDim>(rows, tile, p.scale, rows.scores + offset * padded);
    }
    softmax_chunk<scalar_t>(rows, chunk, length);
    for (int64_t offset = 0; offset < length; offset += kLanes) {
      view.load_tile(p.value_cache, chunk + offset, tile, widened, zero_row);
      for (int64_t row = 0; row < count; ++row) {
        const float rescale = offset == 0 ? rows.rescale[row] : 1.0f;
        accumulate<kDim>(rows.acc + row * kDim, rescale, rows.scores + offset * padded + row, padded, tile);
      }
    }
  }
  view.write(rows.acc, rows.sum);
}

#if defined(WEIR_MATRIX_PATH) && defined(__AVX512BW__)
// Transposes a kLanes x kLanes matrix of 32-bit elements held a row per vector: afterwards vector i holds
// column i (pairs, then lanes of 64 bits, then the four 128-bit quarters of each vector change places).
inline void transpose_lanes(__m512i r[kLanes]) {
  __m512i t[kLanes];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// Indices that interleave two vectors of 32 bf16 (a's lane i, then b's): the low 16 lanes of each, the high.
const __m512i kInterleaveLow = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                                38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
const __m512i kInterleaveHigh = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55,
                                                 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
#endif

#ifdef WEIR_MATRIX_PATH
// The matrix path for a bf16 item with many rows (see the top of the file). Operands, as bf16 bits: the
// item's query rows [count][kDim]; a block's keys as the right operand of scores = queries x keys^T,
// pair-interleaved along head_dim: [kDim / 2][kBlock][2]; the chunk's weights [count][kChunk]; a block's
// values pair-interleaved along the keys: [kBlock / 2][kDim][2]. Positions past the last key are zeros
// (their scores are masked, their weights zero).
template <int64_t kDim>
void attend_item_matrix(const Problem& p, const WorkItem& item, Scratch& scratch) {
  using at::native::cpublas::brgemm;
  const ItemView<uint16_t, kDim> view(p, item);
  const int64_t count = view.count;
  scratch.floats.resize(count * (kChunk + kDim + 2));
  scratch.halves.resize(count * (kDim + kChunk) + kBlock * kDim + kDim);
  float* scores = scratch.floats.data();  // [count][kChunk]
  float* acc = scores + count * kChunk;  // [count][kDim]
  float* row_max = acc + count * kDim;
  float* row_sum = row_max + count;
  uint16_t* queries = scratch.halves.data();
  uint16_t* weights = queries + count * kDim;
  uint16_t* packed = weights + count * kChunk;  // one block of keys, or of values
  uint16_t* zero_row = packed + kBlock * kDim;  // the cache row of a position past the last key
  std::fill(zero_row, zero_row + kDim, uint16_t{0});
  std::fill(acc, acc + count * kDim, 0.0f);
  std::fill(row_max, row_max + count, kNegInf);
  std::fill(row_sum, row_sum + count, 0.0f);
  for (int64_t row = 0; row < count; ++row) std::memcpy(queries + row * kDim, view.query(row), kDim * sizeof(uint16_t));

  const uint16_t* rows[kBlock];  // a block's cache rows, past the last key a row of zeros
  auto block_rows = [&](const void* cache, int64_t start) {
    for (int64_t j = 0; j < kBlock; j += kLanes) view.tile_rows(cache, start + j, rows + j, zero_row);
  };
  auto pack_keys = [&](int64_t start) {
    auto* pairs = reinterpret_cast<uint32_t*>(packed);  // [kDim / 2][kBlock]
    block_rows(p.key_cache, start);
#ifdef __AVX512BW__
    if constexpr (kDim % (2 * kLanes) == 0) {
      for (int64_t j = 0; j < kBlock; j += kLanes) {
        for (int64_t d = 0; d < kDim / 2; d += kLanes) {
          __m512i tile[kLanes];  // kLanes keys' pairs d .. d + kLanes - 1, then those pairs' keys
          for (int64_t k = 0; k < kLanes; ++k) tile[k] = _mm512_loadu_si512(rows[j + k] + 2 * d);
          transpose_lanes(tile);
          for (int64_t k = 0; k < kLanes; ++k) _mm512_storeu_si512(pairs + (d + k) * kBlock + j, tile[k]);
        }
      }
      return;
    }
#endif
    for (int64_t j = 0; j < kBlock; ++j) {
      for (int64_t d = 0; d < kDim / 2; ++d) std::memcpy(pairs + d * kBlock + j, rows[j] + 2 * d, sizeof(uint32_t));
    }
  };
  auto pack_values = [&](int64_t start) {
    block_rows(p.value_cache, start);
    for (int64_t j = 0; j < kBlock; j += 2) {
      const uint16_t* even = rows[j];
      const uint16_t* odd = rows[j + 1];
      uint16_t* dst = packed + j * kDim;  // [kDim][2] for this pair of keys
#ifdef __AVX512BW__
      if constexpr (kDim % (2 * kLanes) == 0) {
        for (int64_t d = 0; d < kDim; d += 2 * kLanes) {
          const __m512i a = _mm512_loadu_si512(even + d), b = _mm512_loadu_si512(odd + d);
          _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(a, kInterleaveLow, b));
          _mm512_storeu_si512(dst + 2 * d + 2 * kLanes, _mm512_permutex2var_epi16(a, kInterleaveHigh, b));
        }
        continue;
      }
#endif
      for (int64_t d = 0; d < kDim; ++d) {
        dst[2 * d] = even[d];
        dst[2 * d + 1] = odd[d];
      }
    }
  };
  const auto* bf16_queries = reinterpret_cast<const at::BFloat16*>(queries);
  const auto* bf16_packed = reinterpret_cast<const at::BFloat16*>(packed);

  for (int64_t chunk = 0; chunk < view.num_keys; chunk += kChunk) {
    const int64_t length = (std::min(kChunk, view.num_keys - chunk) + kBlock - 1) / kBlock * kBlock;
    for (int64_t offset = 0; offset < length; offset += kBlock) {
      pack_keys(chunk + offset);
      brgemm(count, kBlock, kDim, kDim, kBlock, kChunk, false, bf16_queries, bf16_packed, scores + offset);
    }
    for (int64_t row = 0; row < count; ++row) {
      uint16_t* row_weights = weights + row * kChunk;
      const float rescale = softmax_row<at::BFloat16>(
          scores + row * kChunk, length, view.position(row) - chunk, p.scale, row_max[row], row_sum[row],
          [&](int64_t j, Vec w) { store_bf16_bits(row_weights + j, w); });
      for (int64_t d = 0; d < kDim; ++d) acc[row * kDim + d] *= rescale;
    }
    for (int64_t offset = 0; offset < length; offset += kBlock) {
      pack_values(chunk + offset);
      brgemm(count, kDim, kBlock, kChunk, kDim, kDim, true, reinterpret_cast<const at::BFloat16*>(weights + offset),
             bf16_packed, acc);
    }
  }
  ItemView<at::BFloat16, kDim>(p, item).write(acc, row_sum);
}
#endif

// The path an item takes, for the head sizes compiled (the Python side sends others to the reference path).
template <typename scalar_t, int64_t kDim>
void attend_sized(const Problem& p, bool matrix, const WorkItem& item, Scratch& scratch) {
  if (item.heads > 1 || item.num_queries * p.group < kManyRows) {  // a decode, or a chunk's few rows
#ifdef WEIR_DOT_PATH
    if constexpr (std::is_same_v<scalar_t, at::BFloat16> && kDim % kDotLanes == 0) {
      return attend_item_rows_dot<kDim>(p, item, scratch);
    }
#endif
    return attend_item_rows<scalar_t, kDim>(p, item, scratch);
  }
#ifdef WEIR_MATRIX_PATH
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (matrix) return attend_item_matrix<kDim>(p, item, scratch);
  }
#endif
  attend_item_lanes<scalar_t, kDim>(p, item, scratch);
}

template <typename scalar_t>
void attend(const Problem& p, int64_t head_dim, bool matrix, const WorkItem& item, Scratch& scratch) {
  switch (head_dim) {
    case 16:
      return attend_sized<scalar_t, 16>(p, matrix, item, scratch);
    case 32:
      return attend_sized<scalar_t, 32>(p, matrix, item, scratch);
    case 64:
      return attend_sized<scalar_t, 64>(p, matrix, item, scratch);
    case 128:
      return attend_sized<scalar_t, 128>(p, matrix, item, scratch);
    default:
      TORCH_CHECK(false, "paged_attention supports head_dim 16, 32, 64 and 128, not ", head_dim);
  }
}

#ifdef WEIR_MATRIX_PATH
// Whether oneDNN's small-matrix kernel multiplies a probe exactly (small integers are exact in bf16 and in
// fp32 sums). Asked only while oneDNN is enabled: when it is not, torch refuses the pair-interleaved layout.
bool brgemm_probe() {
  constexpr int64_t kRows = 3, kDepth = 16;
  auto b_value = [](int64_t k, int64_t n) { return static_cast<float>((k + 2 * n) % 5 - 2); };
  std::vector<at::BFloat16> a(kRows * kDepth), b(kDepth * kBlock);
  std::vector<float> c(kRows * kBlock, -1.0f);
  for (int64_t i = 0; i < kRows * kDepth; ++i) a[i] = static_cast<float>(i % 7 - 3);
  for (int64_t k = 0; k < kDepth; ++k) {
    for (int64_t n = 0; n < kBlock; ++n) b[(k / 2) * kBlock * 2 + n * 2 + k % 2] = b_value(k, n);
  }
  try {
    at::native::cpublas::brgemm(kRows, kBlock, kDepth, kDepth, kBlock, kBlock, false, a.data(), b.data(), c.data());
    at::native::cpublas::brgemm_release();
  } catch (const std::exception&) {
    return false;
  }
  for (int64_t m = 0; m < kRows; ++m) {
    for (int64_t n = 0; n < kBlock; ++n) {
      float expected = 0.0f;
      for (int64_t k = 0; k < kDepth; ++k) expected += static_cast<float>(a[m * kDepth + k]) * b_value(k, n);
      if (c[m * kBlock + n] != expected) return false;
    }
  }
  return true;
}
#endif

// Whether bf16 steps take the matrix path: compiled for this CPU, oneDNN enabled in torch (the switch
// `torch.backends.mkldnn` turns), and its kernel passing the probe.
bool matrix_path_works() {
#ifdef WEIR_MATRIX_PATH
  if (!at::globalContext().userEnabledMkldnn()) return false;
  static const bool works = brgemm_probe();
  return works;
#else
  return false;
#endif
}

// Whether the step's decodes take whole-row items: when it has decodes enough to keep every thread busy, a
// decode's item covers all its KV heads (every query head of the sequence) and reads each key's whole cache
// row at once. An item of one KV head reads a third of each row of SmolLM2's cache (128 of 384 bytes in
// bf16), and a core streams such strided parts at a third of the rate it streams whole rows (measured on
// the 2-core EPYC: 6-9 GB/s of useful bytes against 18-26), which is what bounds a decode step's attention.
bool whole_row_decodes(const at::Tensor& seqs) {
  const int32_t* info = seqs.data_ptr<int32_t>();
  int64_t decodes = 0;
  for (int64_t seq = 0; seq < seqs.size(0); ++seq) decodes += info[3 * seq + 1] == 1;
  return decodes >= kWholeRowItemsPerThread * at::get_num_threads();
}

std::vector<WorkItem> plan_items(const at::Tensor& seqs, int64_t kv_heads, int64_t query_tile) {
  std::vector<WorkItem> items;
  const int32_t* info = seqs.data_ptr<int32_t>();
  const bool whole_decodes = whole_row_decodes(seqs);
  for (int64_t seq = 0; seq < seqs.size(0); ++seq) {
    const int64_t query_len = info[3 * seq + 1], context_len = info[3 * seq + 2];
    if (whole_decodes && query_len == 1) {
      items.push_back({seq, 0, 0, 1, context_len * kv_heads, kv_heads});
      continue;
    }
    for (int64_t first = 0; first < query_len; first += query_tile) {
      const int64_t count = std::min(query_tile, query_len - first);
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
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || q.scalar_type() == at::kFloat, "paged_attention supports float32 and bfloat16");
  const bool matrix = bf16 && matrix_path_works();
  const std::vector<WorkItem> items = plan_items(seqs, kv_heads, matrix ? kMatrixQueryTile : kQueryTile);
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(num_items, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t index = next++; index < num_items; index = next++) {
      if (bf16) {
        attend<at::BFloat16>(problem, dim, matrix, items[index], scratch);
      } else {
        attend<float>(problem, dim, false, items[index], scratch);
      }
    }
    if (matrix) at::native::cpublas::brgemm_release();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(weir, m) {
  m.def(
      "paged_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seqs, "
      "int block_size, float scale) -> Tensor");
  m.def("paged_attention_matrix_path() -> bool", &matrix_path_works);
}

TORCH_LIBRARY_IMPL(weir, CPU, m) { m.impl("paged_attention", &paged_attention); }
