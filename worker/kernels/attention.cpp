// Paged decode attention with the KV write fused in, and a plain paged KV write.
//
// Cache layout (worker/kv/cache.py): [num_blocks, kv_heads, block_size, head_dim], head-major, so
// one block's rows of consecutive KV heads are one contiguous run. Blocks need not be adjacent:
// the block stride may exceed one block (Seesaw's block-major buffer, where a block of every
// layer lies in one slab: policies/seesaw/rank_hook.py DeviceKV); inside a block everything is
// contiguous. A task is one sequence (all of its KV heads when the batch has enough sequences to
// keep every thread busy, else one head): it writes the sequence's new key/value, then streams
// the sequence's blocks once, tile by tile, scoring every query head of a KV head against each
// key row it loads (GQA), with an online softmax across tiles. Scores, softmax and the weighted
// sum stay in fp32; only the output is rounded to the storage dtype. Decode attention reads its
// whole KV from memory every step, so the kernel prefetches ahead, into the next task's blocks too.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <numeric>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "simd.h"

namespace gearshift {
namespace {

constexpr int64_t kTile = 128;  // positions scored before each online-softmax update

struct CacheGeometry {
  int64_t num_blocks, kv_heads, block_size, dim, block_stride;

  // Element offset of (block, head, offset-in-block, 0).
  inline int64_t at(int64_t block, int64_t head, int64_t off) const {
    return block * block_stride + (head * block_size + off) * dim;
  }
};

template <typename T>
inline void copy_row(const T* src, T* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(T));
}

template <typename T>
void write_slot(
    const at::Tensor& k, const at::Tensor& v, T* kc, T* vc, const CacheGeometry& g, int64_t token,
    int64_t head, int64_t slot) {
  const int64_t block = slot / g.block_size, off = slot % g.block_size;
  const int64_t dst = g.at(block, head, off);
  copy_row(k.const_data_ptr<T>() + token * k.stride(0) + head * k.stride(1), kc + dst, g.dim);
  copy_row(v.const_data_ptr<T>() + token * v.stride(0) + head * v.stride(1), vc + dst, g.dim);
}

// Calls fn(t, element offset of position t0 + t, run) for each run of consecutive positions of
// [t0, t0 + n) that lie in one cache block of ``head``.
template <typename Fn>
inline void for_each_run(const CacheGeometry& g, const int64_t* table, int64_t head, int64_t t0,
                         int64_t n, Fn&& fn) {
  for (int64_t t = 0; t < n;) {
    const int64_t pos = t0 + t, off = pos % g.block_size;
    const int64_t run = std::min(g.block_size - off, n - t);
    fn(t, g.at(table[pos / g.block_size], head, off), run);
    t += run;
  }
}

// Blocks sit anywhere in the cache, so the hardware prefetcher restarts at every block: request
// the rows of heads [h0, h1) of block ``index`` of a sequence ahead of use (one contiguous run).
template <typename T>
inline void prefetch_block(const T* cache, const CacheGeometry& g, const int64_t* table, int64_t h0,
                           int64_t h1, int64_t index, int64_t len) {
  const int64_t first = index * g.block_size;
  if (first >= len) {
    return;
  }
  const char* p = reinterpret_cast<const char*>(cache + g.at(table[index], h0, 0));
  const int64_t rows = (h1 - h0 - 1) * g.block_size + std::min(g.block_size, len - first);
  const int64_t bytes = rows * g.dim * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < bytes; b += 64) {
    __builtin_prefetch(p + b, 0, 2);  // into L2 (prefetcht1): measured ~10% faster than L1
  }
}

// One KV head of one sequence, as the tile kernels see it. Query rows are fp32 copies in ``qf``
// [group, dim]; ``acc`` [group, dim] is the unnormalised output, ``sc`` [group, kTile] one tile's
// scores. The task's first head prefetches for all of its heads [first_head, end_head).
struct Work {
  const CacheGeometry& g;
  const int64_t* table;
  int64_t head;
  int64_t len;
  int64_t group;
  float scale;
  float* qf;
  float* acc;
  float* sc;
  float* row;  // [dim] scratch for the portable path
  int64_t first_head;
  int64_t end_head;
  // The task this thread runs next (none: next_table == nullptr), prefetched near our end.
  const int64_t* next_table;
  int64_t next_len;
  int64_t next_first_head;
  int64_t next_end_head;
};

// Called as scoring reaches position ``pos``: K ~32 positions ahead (running into the next
// task's first blocks near the end of this sequence, so a task never starts cold), and V of
// this block, which is read once the tile has been scored.
template <typename T>
inline void prefetch_ahead(const Work& w, const T* kc, const T* vc, int64_t pos) {
  if (w.head != w.first_head) {
    return;  // the first head's pass already asked for every head's rows
  }
  const CacheGeometry& g = w.g;
  const int64_t ahead = std::max<int64_t>(2, 32 / g.block_size);
  const int64_t block = pos / g.block_size, blocks = (w.len + g.block_size - 1) / g.block_size;
  if (block + ahead < blocks) {
    prefetch_block(kc, g, w.table, w.first_head, w.end_head, block + ahead, w.len);
  } else if (w.next_table != nullptr) {
    const int64_t index = block + ahead - blocks;
    prefetch_block(kc, g, w.next_table, w.next_first_head, w.next_end_head, index, w.next_len);
    prefetch_block(vc, g, w.next_table, w.next_first_head, w.next_end_head, index, w.next_len);
  }
  prefetch_block(vc, g, w.table, w.first_head, w.end_head, block, w.len);
}

// Portable path: loops the compiler vectorises over head_dim.
template <typename T>
struct PortableTile {
  static void scores(const Work& w, const T* kc, const T* vc, int64_t t0, int64_t n) {
    const int64_t dim = w.g.dim;
    for_each_run(w.g, w.table, w.head, t0, n, [&](int64_t t, int64_t base, int64_t run) {
      prefetch_ahead(w, kc, vc, t0 + t);
      for (int64_t i = 0; i < run; ++i) {
        const T* kr = kc + base + i * dim;
        for (int64_t d = 0; d < dim; ++d) {
          w.row[d] = Io<T>::load(kr[d]);
        }
        for (int64_t j = 0; j < w.group; ++j) {
          const float* qj = w.qf + j * dim;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) {
            s = std::fma(qj[d], w.row[d], s);
          }
          w.sc[j * kTile + t + i] = s * w.scale;
        }
      }
    });
  }

  static void values(const Work& w, const T* vc, int64_t t0, int64_t n) {
    const int64_t dim = w.g.dim;
    for_each_run(w.g, w.table, w.head, t0, n, [&](int64_t t, int64_t base, int64_t run) {
      for (int64_t i = 0; i < run; ++i) {
        const T* vr = vc + base + i * dim;
        for (int64_t d = 0; d < dim; ++d) {
          w.row[d] = Io<T>::load(vr[d]);
        }
        for (int64_t j = 0; j < w.group; ++j) {
          const float p = w.sc[j * kTile + t + i];
          float* a = w.acc + j * dim;
          for (int64_t d = 0; d < dim; ++d) {
            a[d] = std::fma(p, w.row[d], a[d]);
          }
        }
      }
    });
  }
};

#if defined(__AVX512F__)
// Sums of each of four vectors, as the four lanes of one 128-bit vector (a transpose-and-add
// tree: ~3 instructions per sum instead of ~8 for four separate horizontal reductions).
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  // Per 128-bit lane: [a, b, c, d] partial sums.
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                        _mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// AVX-512 path for head_dim % 16 == 0 and G query heads per KV head (a template parameter so
// the per-head accumulators live in registers). Scores: four positions at a time, each K row
// loaded once for all G heads. Values: one 16-wide column chunk at a time over the whole tile,
// with U independent accumulators per head so the FMA latency chain does not bound the loop.
template <typename T, int G>
struct Avx512Tile {
  static constexpr int P = G <= 4 ? 4 : 1;  // positions per score step (register budget)
  static constexpr int U = G <= 4 ? 4 : 2;  // accumulator sets per value chunk

  static void scores(const Work& w, const T* kc, const T* vc, int64_t t0, int64_t n) {
    const int64_t dim = w.g.dim, chunks = dim / 16;
    const __m128 scale4 = _mm_set1_ps(w.scale);
    for_each_run(w.g, w.table, w.head, t0, n, [&](int64_t t, int64_t base, int64_t run) {
      prefetch_ahead(w, kc, vc, t0 + t);
      int64_t i = 0;
      if constexpr (P == 4) {
        for (; i + 4 <= run; i += 4) {
          const T* kr = kc + base + i * dim;
          __m512 s[G][4];
          for (int j = 0; j < G; ++j) {
            for (int p = 0; p < 4; ++p) {
              s[j][p] = _mm512_setzero_ps();
            }
          }
          for (int64_t c = 0; c < chunks; ++c) {
            __m512 k[4];
            for (int p = 0; p < 4; ++p) {
              k[p] = simd::load16(kr + p * dim + 16 * c);
            }
            for (int j = 0; j < G; ++j) {
              const __m512 qv = _mm512_loadu_ps(w.qf + j * dim + 16 * c);
              for (int p = 0; p < 4; ++p) {
                s[j][p] = _mm512_fmadd_ps(qv, k[p], s[j][p]);
              }
            }
          }
          for (int j = 0; j < G; ++j) {
            const __m128 r = reduce4(s[j][0], s[j][1], s[j][2], s[j][3]);
            _mm_storeu_ps(w.sc + j * kTile + t + i, _mm_mul_ps(r, scale4));
          }
        }
      }
      for (; i < run; ++i) {
        const T* kr = kc + base + i * dim;
        __m512 s[G];
        for (int j = 0; j < G; ++j) {
          s[j] = _mm512_setzero_ps();
        }
        for (int64_t c = 0; c < chunks; ++c) {
          const __m512 k = simd::load16(kr + 16 * c);
          for (int j = 0; j < G; ++j) {
            s[j] = _mm512_fmadd_ps(_mm512_loadu_ps(w.qf + j * dim + 16 * c), k, s[j]);
          }
        }
        for (int j = 0; j < G; ++j) {
          w.sc[j * kTile + t + i] = _mm512_reduce_add_ps(s[j]) * w.scale;
        }
      }
    });
  }

  static void values(const Work& w, const T* vc, int64_t t0, int64_t n) {
    const int64_t dim = w.g.dim, chunks = dim / 16;
    for (int64_t c = 0; c < chunks; ++c) {
      __m512 a[U][G];
      for (int j = 0; j < G; ++j) {
        a[0][j] = _mm512_loadu_ps(w.acc + j * dim + 16 * c);
        for (int u = 1; u < U; ++u) {
          a[u][j] = _mm512_setzero_ps();
        }
      }
      for_each_run(w.g, w.table, w.head, t0, n, [&](int64_t t, int64_t base, int64_t run) {
        const T* vb = vc + base + 16 * c;
        const float* p = w.sc + t;
        int64_t i = 0;
        for (; i + U <= run; i += U) {
          for (int u = 0; u < U; ++u) {
            const __m512 v = simd::load16(vb + (i + u) * dim);
            for (int j = 0; j < G; ++j) {
              a[u][j] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * kTile + i + u]), v, a[u][j]);
            }
          }
        }
        for (; i < run; ++i) {
          const __m512 v = simd::load16(vb + i * dim);
          for (int j = 0; j < G; ++j) {
            a[0][j] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * kTile + i]), v, a[0][j]);
          }
        }
      });
      for (int j = 0; j < G; ++j) {
        __m512 total = a[0][j];
        for (int u = 1; u < U; ++u) {
          total = _mm512_add_ps(total, a[u][j]);
        }
        _mm512_storeu_ps(w.acc + j * dim + 16 * c, total);
      }
    }
  }
};
#endif

// Online-softmax update of one head's accumulator with a scored tile (scores become weights).
inline void softmax_update(const Work& w, float* m, float* l, bool first_tile, int64_t n) {
  const int64_t dim = w.g.dim;
  // Scores are padded to whole 16-lane vectors with -inf (exp → 0) so that these loops have no
  // scalar remainder; the padding is never read by the values pass.
  const int64_t padded = std::min(kTile, (n + 15) / 16 * 16);
  for (int64_t j = 0; j < w.group; ++j) {
    float* s = w.sc + j * kTile;
    for (int64_t t = n; t < padded; ++t) {
      s[t] = -std::numeric_limits<float>::infinity();
    }
    float tile_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : tile_max)
    for (int64_t t = 0; t < padded; ++t) {
      tile_max = s[t] > tile_max ? s[t] : tile_max;
    }
    const float new_max = std::max(m[j], tile_max);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < padded; ++t) {
      s[t] = t < n ? exp_f32(s[t] - new_max) : 0.0f;
      sum += s[t];
    }
    if (first_tile) {
      l[j] = sum;
    } else {
      // Earlier tiles were weighted against a smaller maximum: rescale them to the new one.
      const float correction = exp_f32(m[j] - new_max);
      l[j] = l[j] * correction + sum;
      float* a = w.acc + j * dim;
      for (int64_t d = 0; d < dim; ++d) {
        a[d] *= correction;
      }
    }
    m[j] = new_max;
  }
}

// Per-task scratch: fp32 queries and accumulators for every head of the task, one tile of
// scores, running max and sum per query head.
struct Scratch {
  std::vector<float> qf, acc, sc, row, m, l;

  Scratch(int64_t heads, int64_t group, int64_t dim)
      : qf(heads * group * dim),
        acc(heads * group * dim),
        sc(group * kTile),
        row(dim),
        m(heads * group),
        l(heads * group) {}
};

// KV heads [h0, h1) of one sequence: q rows [(h1 - h0) * group, dim] → out rows, tile by tile
// with every head inside a tile, so each tile's blocks are read while they are in cache.
template <typename T, typename Tile>
void attend(Work w, Scratch& ws, int64_t h0, int64_t h1, const T* q, int64_t q_head_stride,
            const T* kc, const T* vc, T* out, int64_t out_head_stride) {
  const int64_t dim = w.g.dim, rows = (h1 - h0) * w.group;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < dim; ++d) {
      ws.qf[r * dim + d] = Io<T>::load(q[r * q_head_stride + d]);
      ws.acc[r * dim + d] = 0.0f;
    }
    ws.m[r] = -std::numeric_limits<float>::infinity();
    ws.l[r] = 0.0f;
  }
  w.first_head = h0;
  w.end_head = h1;
  w.sc = ws.sc.data();
  w.row = ws.row.data();
  // A thread's first task starts cold; later ones were prefetched by the task before (cheap
  // no-ops then).
  for (int64_t b = 0, ahead = std::max<int64_t>(2, 32 / w.g.block_size); b < ahead; ++b) {
    prefetch_block(kc, w.g, w.table, h0, h1, b, w.len);
  }
  for (int64_t t0 = 0; t0 < w.len; t0 += kTile) {
    const int64_t n = std::min(kTile, w.len - t0);
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t r0 = (h - h0) * w.group;
      w.head = h;
      w.qf = ws.qf.data() + r0 * dim;
      w.acc = ws.acc.data() + r0 * dim;
      Tile::scores(w, kc, vc, t0, n);
      softmax_update(w, ws.m.data() + r0, ws.l.data() + r0, t0 == 0, n);
      Tile::values(w, vc, t0, n);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = ws.l[r] > 0.0f ? 1.0f / ws.l[r] : 0.0f;
    for (int64_t d = 0; d < dim; ++d) {
      out[r * out_head_stride + d] = Io<T>::store(ws.acc[r * dim + d] * inv);
    }
  }
}

template <typename T>
using AttendFn = void (*)(Work, Scratch&, int64_t, int64_t, const T*, int64_t, const T*,
                          const T*, T*, int64_t);

template <typename T>
AttendFn<T> pick_attend(int64_t dim, int64_t group) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    switch (group) {
      case 1: return &attend<T, Avx512Tile<T, 1>>;
      case 2: return &attend<T, Avx512Tile<T, 2>>;
      case 3: return &attend<T, Avx512Tile<T, 3>>;
      case 4: return &attend<T, Avx512Tile<T, 4>>;
      case 5: return &attend<T, Avx512Tile<T, 5>>;
      case 6: return &attend<T, Avx512Tile<T, 6>>;
      case 7: return &attend<T, Avx512Tile<T, 7>>;
      case 8: return &attend<T, Avx512Tile<T, 8>>;
      default: break;
    }
  }
#endif
  return &attend<T, PortableTile<T>>;
}

void check_kv_args(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache/v_cache must both be [blocks, kv_heads, block_size, head_dim], got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  // Each block contiguous ([kv_heads, block_size, head_dim] row-major); blocks may be strided.
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    const int64_t row = c->size(3), block = c->size(1) * c->size(2) * row;
    TORCH_CHECK((row <= 1 || c->stride(3) == 1) && (c->size(2) <= 1 || c->stride(2) == row) &&
                    (c->size(1) <= 1 || c->stride(1) == c->size(2) * row) &&
                    (c->size(0) <= 1 || c->stride(0) >= block),
                "KV caches must be contiguous within each block (block stride >= one block), "
                "got strides ", c->strides(), " for sizes ", c->sizes());
  }
  TORCH_CHECK(k_cache.size(0) <= 1 || k_cache.stride(0) == v_cache.stride(0),
              "k_cache/v_cache block strides differ: ", k_cache.stride(0), " and ",
              v_cache.stride(0));
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes(), "k/v must both be [tokens, kv_heads, ",
              "head_dim], got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(3),
              "k/v heads and head_dim ", k.sizes(), " do not match the cache ", k_cache.sizes());
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k/v head_dim must be contiguous");
  for (const at::Tensor* t : {&k, &v, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == k_cache.scalar_type(), "dtype ", t->scalar_type(),
                " != cache dtype ", k_cache.scalar_type());
  }
  for (const at::Tensor* t : {&k, &v, &k_cache, &v_cache, &slot_mapping}) {
    TORCH_CHECK(t->device().is_cpu(), "paged attention: CPU tensors only");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == k.size(0),
              "slot_mapping must be int64 [", k.size(0), "], got ", slot_mapping.scalar_type(),
              " ", slot_mapping.sizes());
}

CacheGeometry geometry(const at::Tensor& cache) {
  return {cache.size(0), cache.size(1), cache.size(2), cache.size(3), cache.stride(0)};
}

void check_slot(int64_t slot, const CacheGeometry& g) {
  TORCH_CHECK(slot < g.num_blocks * g.block_size, "slot ", slot, " is outside the cache (",
              g.num_blocks, " blocks of ", g.block_size, ")");
}

}  // namespace

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  check_kv_args(k, v, k_cache, v_cache, slot_mapping);
  const at::Tensor slots = slot_mapping.contiguous();
  const CacheGeometry g = geometry(k_cache);
  const int64_t tokens = k.size(0);
  GEARSHIFT_DISPATCH_FLOATING(k.scalar_type(), "write_kv", [&] {
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const int64_t* sp = slots.const_data_ptr<int64_t>();
    at::parallel_for(0, tokens, row_grain(2 * g.kv_heads * g.dim), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        if (sp[t] < 0) {
          continue;  // padding
        }
        check_slot(sp[t], g);
        for (int64_t h = 0; h < g.kv_heads; ++h) {
          write_slot<scalar_t>(k, v, kc, vc, g, t, h, sp[t]);
        }
      }
    });
  });
}

void paged_decode_attention(
    at::Tensor& out,
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    at::Tensor& k_cache,
    at::Tensor& v_cache,
    const at::Tensor& slot_mapping,
    const at::Tensor& block_tables,
    const at::Tensor& seq_lens,
    double scale) {
  check_kv_args(k, v, k_cache, v_cache, slot_mapping);
  const CacheGeometry g = geometry(k_cache);
  const int64_t batch = q.size(0);
  TORCH_CHECK(q.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == g.dim,
              "q must be [batch, q_heads, head_dim] matching k ", k.sizes(), ", got ", q.sizes());
  const int64_t q_heads = q.size(1);
  TORCH_CHECK(q_heads % g.kv_heads == 0, "q heads (", q_heads, ") must be a multiple of KV heads (",
              g.kv_heads, ")");
  const int64_t group = q_heads / g.kv_heads;
  TORCH_CHECK(q.stride(2) == 1 && q.scalar_type() == k_cache.scalar_type() && q.device().is_cpu(),
              "q must be a CPU tensor of the cache dtype with contiguous head_dim");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() &&
                  out.stride(2) == 1 && out.device().is_cpu(),
              "out must be like q ", q.sizes(), ", got ", out.sizes());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.size(0) >= batch,
              "block_tables must be int64 [>= ", batch, ", W], got ", block_tables.sizes());
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.dim() == 1 &&
                  seq_lens.size(0) >= batch,
              "seq_lens must be int64 [>= ", batch, "], got ", seq_lens.sizes());
  if (batch == 0) {
    return;
  }
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens_t = seq_lens.contiguous();
  const at::Tensor slots_t = slot_mapping.contiguous();
  const int64_t width = tables.size(1);
  const int64_t* lens = lens_t.const_data_ptr<int64_t>();
  const int64_t* slots = slots_t.const_data_ptr<int64_t>();
  const int64_t* tab = tables.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= width * g.block_size, "sequence ", b, " has length ",
                lens[b], " beyond its block table (", width, " x ", g.block_size, ")");
    for (int64_t i = 0, n = (lens[b] + g.block_size - 1) / g.block_size; i < n; ++i) {
      const int64_t block = tab[b * width + i];
      TORCH_CHECK(block >= 0 && block < g.num_blocks, "sequence ", b, " uses block ", block,
                  " outside the cache (", g.num_blocks, " blocks)");
    }
    if (slots[b] >= 0) {
      check_slot(slots[b], g);
    }
  }
  // Longest sequences first, handed out one task at a time: threads finish together even when
  // context lengths differ by orders of magnitude.
  std::vector<int64_t> order(batch);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
  // A task is one sequence's KV heads [h0, h0 + heads_per_task): all of them when there are
  // enough sequences to keep every thread busy (its blocks are then read front to back, head
  // after head), else one head, so that a few long sequences still spread over the threads.
  const int64_t heads_per_task = batch >= 4 * at::get_num_threads() ? g.kv_heads : 1;
  const int64_t tasks_per_seq = g.kv_heads / heads_per_task;
  const int64_t tasks = batch * tasks_per_seq;
  std::atomic<int64_t> next{0};
  const float fscale = static_cast<float>(scale);
  GEARSHIFT_DISPATCH_FLOATING(q.scalar_type(), "paged_decode_attention", [&] {
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const scalar_t* qp = q.const_data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const AttendFn<scalar_t> attend = pick_attend<scalar_t>(g.dim, group);
    at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
      Scratch ws(heads_per_task, group, g.dim);
      // Tasks are claimed one ahead so that the current one can prefetch the next one's blocks.
      int64_t task = next.fetch_add(1);
      while (task < tasks) {
        const int64_t following = next.fetch_add(1);
        const int64_t b = order[task / tasks_per_seq];
        const int64_t h0 = (task % tasks_per_seq) * heads_per_task, h1 = h0 + heads_per_task;
        // The new token's KV first: it is the last position this sequence attends to.
        if (slots[b] >= 0) {
          for (int64_t h = h0; h < h1; ++h) {
            write_slot<scalar_t>(k, v, kc, vc, g, b, h, slots[b]);
          }
        }
        Work w{g, tab + b * width, h0, lens[b], group, fscale, nullptr, nullptr, nullptr,
               nullptr, h0, h1, nullptr, 0, 0, 0};
        if (following < tasks) {
          const int64_t nb = order[following / tasks_per_seq];
          w.next_table = tab + nb * width;
          w.next_len = lens[nb];
          w.next_first_head = (following % tasks_per_seq) * heads_per_task;
          w.next_end_head = w.next_first_head + heads_per_task;
        }
        attend(w, ws, h0, h1, qp + b * q.stride(0) + h0 * group * q.stride(1), q.stride(1), kc,
               vc, op + b * out.stride(0) + h0 * group * out.stride(1), out.stride(1));
        task = following;
      }
    });
  });
}

}  // namespace gearshift
