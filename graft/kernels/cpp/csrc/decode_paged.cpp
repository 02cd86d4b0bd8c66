// attention.decode_paged for the CPU: one task per (sequence, kv head), reading the keys and
// values where they lie in their pages (through the block table, no gather into a batch),
// the query heads that share a kv head together so that each key/value row is loaded and
// converted once. fp32 math as the op's reference: scores q.k * scale, softmax over the
// visible tokens, probabilities times values. Registered as torch.ops.graft_cpp.decode_paged
// (torch/library.h only: no pybind, so the build takes seconds, not half a minute).
//
// Semantics shared with the reference (graft/ops/attention.py):
// * a seq_len outside [0, capacity] is clamped into it;
// * tokens of a block-table entry outside [0, num_blocks) take no part in the softmax;
// * a row with no visible token (or whose scores are all -inf) is zeros; a NaN or +inf
//   score makes its row NaN, as torch.softmax does.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// ATen's vector type for the ISA this library is built for (graft/kernels/cpp/_build.py
// defines CPU_CAPABILITY as torch's own dispatch picks it here): its exp is Sleef's, as in
// torch.softmax, and its reductions are shuffle trees.
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kWidth = Vec::size();

// A cache row as fp32 in ``dst``: bf16/fp16 converted, fp8 codes (bytes) looked up in the
// 256-entry table of their values times the scale. fp32 rows are read in place (row()).
template <typename C>
struct RowLoader {
  const float* table;  // fp8 codes only
  inline const float* row(const C* src, float* dst, int64_t n) const {
    for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
    return dst;
  }
};

template <>
struct RowLoader<float> {
  const float* table;
  inline const float* row(const float* src, float*, int64_t) const { return src; }
};

template <>
struct RowLoader<uint8_t> {
  const float* table;
  inline const float* row(const uint8_t* src, float* dst, int64_t n) const {
    for (int64_t d = 0; d < n; ++d) dst[d] = table[src[d]];
    return dst;
  }
};

// Strides in elements; the caches' last dimension is contiguous (checked).
struct Layout {
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, num_blocks, block_size, blocks_per_seq;
  int64_t q_seq, q_head, q_dim;
  int64_t k_block, k_slot, k_head, v_block, v_slot, v_head;
  int64_t t_seq, t_block;
  float scale;
};

// Softmax of ``p[0:n]`` in place (fp32, as torch.softmax: NaN or +inf anywhere makes the row
// NaN); false, leaving ``p`` as it is, when every score is -inf (no visible key: a zero row).
inline bool softmax(float* p, int64_t n) {
  Vec top(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + kWidth <= n; t += kWidth) top = at::vec::maximum(top, Vec::loadu(p + t));  // NaN-propagating
  if (t < n) {
    Vec tail = Vec::loadu(p + t, n - t);  // the lanes past n are 0: blend them to -inf
    tail = Vec::set(Vec(-std::numeric_limits<float>::infinity()), tail, n - t);
    top = at::vec::maximum(top, tail);
  }
  const float m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, top);
  if (m == -std::numeric_limits<float>::infinity()) return false;
  const Vec shift(m);
  Vec total(0.f);
  for (t = 0; t + kWidth <= n; t += kWidth) {
    const Vec e = (Vec::loadu(p + t) - shift).exp();
    e.store(p + t);
    total = total + e;
  }
  float sum = at::vec::vec_reduce_all<float>(std::plus<Vec>(), total);
  for (; t < n; ++t) {
    p[t] = std::exp(p[t] - m);
    sum += p[t];
  }
  const Vec inv(1.f / sum);
  for (t = 0; t + kWidth <= n; t += kWidth) (Vec::loadu(p + t) * inv).store(p + t);
  for (; t < n; ++t) p[t] *= 1.f / sum;
  return true;
}

constexpr int64_t kTile = 32;  // value rows per tile: converted once, then read from L1

// acc[j] += sum_i p[j][i] * rows[i] for kHeads query heads, a vector of each head's
// accumulator held in registers across the tile (accumulating in memory instead chains each
// token's store to the next token's load: most of the time at head_dim 64).
template <int kHeads>
void accumulate(const float* const* rows, int64_t count, const float* p, int64_t p_stride, float* acc,
                int64_t acc_stride, int64_t dim) {
  for (int64_t c = 0; c < dim; c += kWidth) {
    const int64_t lanes = std::min(kWidth, dim - c);
    Vec a[kHeads];
    for (int j = 0; j < kHeads; ++j) a[j] = Vec::loadu(acc + j * acc_stride + c);
    for (int64_t i = 0; i < count; ++i) {
      const Vec v = Vec::loadu(rows[i] + c, lanes);
      for (int j = 0; j < kHeads; ++j) a[j] = at::vec::fmadd(Vec(p[j * p_stride + i]), v, a[j]);
    }
    for (int j = 0; j < kHeads; ++j) a[j].store(acc + j * acc_stride + c);
  }
}

template <typename Q, typename C, typename I, typename L>
void decode(const Layout& s, const Q* query, const C* keys, const C* values, const I* tables, const L* lens,
            RowLoader<C> key_rows, RowLoader<C> value_rows, Q* out) {
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t capacity = s.blocks_per_seq * s.block_size;
  const int64_t dim = s.head_dim;
  const int64_t padded = (dim + kWidth - 1) / kWidth * kWidth;
  at::parallel_for(0, s.num_seqs * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    // q and acc rows are zero-padded to whole vectors, so full-width loads stay inside them.
    std::vector<float> q(group * padded), acc(group * padded), tile(kTile * padded), scores;
    std::vector<int64_t> key_at, value_at;  // the visible tokens' row offsets
    const float* rows[kTile];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / s.num_kv_heads, h = task % s.num_kv_heads;
      const int64_t len = std::min<int64_t>(std::max<int64_t>(static_cast<int64_t>(lens[n]), 0), capacity);
      key_at.clear();
      value_at.clear();
      for (int64_t b = 0; b * s.block_size < len; ++b) {
        const int64_t block = static_cast<int64_t>(tables[n * s.t_seq + b * s.t_block]);
        if (block < 0 || block >= s.num_blocks) continue;  // an out-of-range entry: its tokens are skipped
        const int64_t slots = std::min(s.block_size, len - b * s.block_size);
        for (int64_t slot = 0; slot < slots; ++slot) {
          key_at.push_back(block * s.k_block + slot * s.k_slot + h * s.k_head);
          value_at.push_back(block * s.v_block + slot * s.v_slot + h * s.v_head);
        }
      }
      const int64_t visible = static_cast<int64_t>(key_at.size());
      for (int64_t g = 0; g < group; ++g) {
        const Q* src = query + n * s.q_seq + (h * group + g) * s.q_head;
        for (int64_t d = 0; d < dim; ++d) q[g * padded + d] = static_cast<float>(src[d * s.q_dim]);
      }
      // Scores: each key row loaded once for the group's query heads.
      scores.resize(group * visible);
      for (int64_t t = 0; t < visible; ++t) {
        const float* k = key_rows.row(keys + key_at[t], tile.data(), dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = &q[g * padded];
          Vec sum(0.f);
          for (int64_t c = 0; c < dim; c += kWidth) {
            sum = at::vec::fmadd(Vec::loadu(qg + c), Vec::loadu(k + c, std::min(kWidth, dim - c)), sum);
          }
          scores[g * visible + t] = at::vec::vec_reduce_all<float>(std::plus<Vec>(), sum) * s.scale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* p = &scores[g * visible];
        if (!softmax(p, visible)) std::fill(p, p + visible, 0.f);  // no visible key: a zero row
      }
      // Probabilities times values, a tile of value rows at a time.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < visible; t0 += kTile) {
        const int64_t count = std::min(kTile, visible - t0);
        for (int64_t i = 0; i < count; ++i) rows[i] = value_rows.row(values + value_at[t0 + i], &tile[i * padded], dim);
        int64_t g = 0;
        for (; g + 4 <= group; g += 4) accumulate<4>(rows, count, &scores[g * visible + t0], visible, &acc[g * padded], padded, dim);
        for (; g + 2 <= group; g += 2) accumulate<2>(rows, count, &scores[g * visible + t0], visible, &acc[g * padded], padded, dim);
        for (; g < group; ++g) accumulate<1>(rows, count, &scores[g * visible + t0], visible, &acc[g * padded], padded, dim);
      }
      Q* o = out + (n * s.num_heads + h * group) * dim;  // out is contiguous [N, H, D]
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t d = 0; d < dim; ++d) o[g * dim + d] = static_cast<Q>(acc[g * padded + d]);
      }
    }
  });
}

template <typename Q, typename C>
void dispatch_index(const Layout& s, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                    const float* key_table, const float* value_table, at::Tensor& out) {
  auto run = [&](auto* tables, auto* lens) {
    decode<Q, C>(s, query.const_data_ptr<Q>(), key_cache.const_data_ptr<C>(), value_cache.const_data_ptr<C>(),
                 tables, lens, RowLoader<C>{key_table}, RowLoader<C>{value_table}, out.mutable_data_ptr<Q>());
  };
  const bool table32 = block_tables.scalar_type() == at::kInt, lens32 = seq_lens.scalar_type() == at::kInt;
  if (table32 && lens32) run(block_tables.const_data_ptr<int32_t>(), seq_lens.const_data_ptr<int32_t>());
  else if (table32) run(block_tables.const_data_ptr<int32_t>(), seq_lens.const_data_ptr<int64_t>());
  else if (lens32) run(block_tables.const_data_ptr<int64_t>(), seq_lens.const_data_ptr<int32_t>());
  else run(block_tables.const_data_ptr<int64_t>(), seq_lens.const_data_ptr<int64_t>());
}

template <typename Q>
void dispatch_cache(const Layout& s, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                    const float* key_table, const float* value_table, at::Tensor& out) {
  if (key_cache.scalar_type() == at::kByte) {
    dispatch_index<Q, uint8_t>(s, query, key_cache, value_cache, block_tables, seq_lens, key_table, value_table, out);
  } else {
    dispatch_index<Q, Q>(s, query, key_cache, value_cache, block_tables, seq_lens, nullptr, nullptr, out);
  }
}

at::Tensor decode_paged(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        const std::optional<at::Tensor>& key_values, const std::optional<at::Tensor>& value_values) {
  // The Python side (graft/kernels/cpp/decode_paged.py) validated the call; these guard memory.
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4, "graft_cpp.decode_paged: ranks");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "graft_cpp.decode_paged: caches must have one shape and a contiguous last dimension");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(1) % key_cache.size(2) == 0,
              "graft_cpp.decode_paged: head_dim / head counts");
  TORCH_CHECK(block_tables.dim() == 2 && seq_lens.dim() == 1 && block_tables.size(0) == query.size(0) &&
                  seq_lens.size(0) == query.size(0) && seq_lens.is_contiguous(),
              "graft_cpp.decode_paged: block_tables / seq_lens shapes");
  const bool codes = key_cache.scalar_type() == at::kByte;
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type() &&
                  (codes || key_cache.scalar_type() == query.scalar_type()),
              "graft_cpp.decode_paged: caches in the query's dtype, or fp8 codes as bytes");
  TORCH_CHECK(!codes || (key_values && value_values && key_values->numel() == 256 && value_values->numel() == 256 &&
                         key_values->scalar_type() == at::kFloat && value_values->scalar_type() == at::kFloat &&
                         key_values->is_contiguous() && value_values->is_contiguous()),
              "graft_cpp.decode_paged: fp8 codes need the two 256-entry fp32 value tables");
  Layout s{query.size(0), query.size(1), key_cache.size(2), query.size(2), key_cache.size(0), key_cache.size(1),
           block_tables.size(1), query.stride(0), query.stride(1), query.stride(2), key_cache.stride(0),
           key_cache.stride(1), key_cache.stride(2), value_cache.stride(0), value_cache.stride(1),
           value_cache.stride(2), block_tables.stride(0), block_tables.stride(1), static_cast<float>(scale)};
  at::Tensor out = at::empty({s.num_seqs, s.num_heads, s.head_dim}, query.options());
  if (out.numel() == 0) return out;
  const float* key_table = codes ? key_values->const_data_ptr<float>() : nullptr;
  const float* value_table = codes ? value_values->const_data_ptr<float>() : nullptr;
  switch (query.scalar_type()) {
    case at::kFloat:
      dispatch_cache<float>(s, query, key_cache, value_cache, block_tables, seq_lens, key_table, value_table, out);
      break;
    case at::kBFloat16:
      dispatch_cache<c10::BFloat16>(s, query, key_cache, value_cache, block_tables, seq_lens, key_table, value_table,
                                    out);
      break;
    case at::kHalf:
      dispatch_cache<c10::Half>(s, query, key_cache, value_cache, block_tables, seq_lens, key_table, value_table, out);
      break;
    default:
      TORCH_CHECK(false, "graft_cpp.decode_paged: query dtype ", query.scalar_type(), " (float32/bfloat16/float16)");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(graft_cpp, m) {
  m.def("decode_paged(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, Tensor? key_values, Tensor? value_values) -> Tensor");
}

TORCH_LIBRARY_IMPL(graft_cpp, CPU, m) { m.impl("decode_paged", &decode_paged); }
