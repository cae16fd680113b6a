// Decode and verify attention over the target's stacked KV cache, read in place (hsd_jax.cpu_kernels).
// XLA:CPU copies a layer's [B, Hkv, S, Dh] cache out of the [L, ...] stack, transposes it and scores all
// S slots (BENCHMARKS.md, "Why the CPU kernels"); this XLA FFI handler
// reads only the slots a query can see: the committed prefix [0, lengths[b]) and the new tokens
// [lengths[b], lengths[b] + N) that are its ancestors (or itself) in the draft tree. A chain (N = 1
// included) is causal attention. A task is one sequence's kv head, or a chunk of its rows for a wide verify: its
// K and V streamed once for the N rows of every query head that shares them (grouped-query attention), with
// software prefetch ahead of the loads. A row that is not
// its own ancestor is skipped and outputs 0 (a verify narrower than its static shape). The cache is f32, or bf16
// (a bf16 model's) widened exactly in registers; q, scores, softmax and sums are f32 either way.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

typedef float v16 __attribute__((vector_size(64)));

static inline v16 Load(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof(v16));
  return v;
}

typedef uint16_t vh16 __attribute__((vector_size(32)));
typedef uint32_t vu16 __attribute__((vector_size(64)));

// 16 bf16 cache entries (uint16 bits) widened exactly to f32
static inline v16 Load(const uint16_t* p) {
  vh16 h;
  __builtin_memcpy(&h, p, sizeof(vh16));
  const vu16 u = __builtin_convertvector(h, vu16) << 16;
  v16 v;
  __builtin_memcpy(&v, &u, sizeof(v16));
  return v;
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t vi16 __attribute__((vector_size(64)));
constexpr float kInf = std::numeric_limits<float>::infinity();

static inline v16 Splat(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }   // a broadcast

#if defined(__clang__) || __GNUC__ >= 12
#define HSD_SHUFFLE 1      // __builtin_shufflevector: horizontal sums as shuffle trees
#endif

static inline float Sum(v16 v) {
#ifdef HSD_SHUFFLE
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
#else
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
#endif
}

static inline float Max(v16 v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, v[i]);
  return m;
}

// exp(x) for x <= 0 (Cephes' single-precision polynomial, ~1 ulp), exactly 0 where x is -inf (hidden slots)
static inline v16 Exp(v16 x) {
  const v16 xc = x < Splat(-87.0f) ? Splat(-87.0f) : x;
  const v16 n = (xc * Splat(1.44269504088896341f) + Splat(12582912.0f)) - Splat(12582912.0f);
  const v16 r = xc - n * Splat(0.693359375f) - n * Splat(-2.12194440e-4f);
  v16 p = Splat(1.9875691500e-4f);
  p = p * r + Splat(1.3981999507e-3f);
  p = p * r + Splat(8.3334519073e-3f);
  p = p * r + Splat(4.1665795894e-2f);
  p = p * r + Splat(1.6666665459e-1f);
  p = p * r + Splat(5.0000001201e-1f);
  p = p * r * r + r + Splat(1.0f);
  const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
  v16 two_n;
  __builtin_memcpy(&two_n, &bits, sizeof(v16));
  return x == Splat(-kInf) ? Splat(0.0f) : p * two_n;
}

// The 16 dot products of 16 slot accumulators (acc[j] holds slot j's products lane by lane), in slot order.
static inline v16 Reduce16(const v16* acc) {
#ifdef HSD_SHUFFLE
  v16 t[8], u[4], w[2];
  for (int p = 0; p < 8; ++p)
    t[p] = __builtin_shufflevector(acc[2 * p], acc[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(acc[2 * p], acc[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int p = 0; p < 4; ++p)
    u[p] = __builtin_shufflevector(t[2 * p], t[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(t[2 * p], t[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int p = 0; p < 2; ++p)
    w[p] = __builtin_shufflevector(u[2 * p], u[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(u[2 * p], u[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  v16 r;
  for (int j = 0; j < 16; ++j) r[j] = Sum(acc[j]);
  return r;
#endif
}

// Attention of a kv head's query rows over its K, V [s, dh] (dh = 16 VECS): the `count` rows from `first` of its
// group's query heads (n tree rows each: row i is tree row i % n of the group's head i / n, at offset
// (i % n) * st + (i / n) * sg from q and out, which point at the group's first row). Scores of slots
// [0, end) 16 at a time, hidden ones set to -inf, softmax numerators per row, then the weighted sum of V with up to
// 4 rows' outputs in registers. Slots past `end` are never read (the last block repeats slot end - 1).
// The denominator is summed slot by slot in that same
// loop: its visible terms come in slot order wherever the row's slots lie (hidden ones add exact zeros), so a row of a
// tree verify gives, bit for bit, what the decode step of its accepted path gives (a bf16 model rounds any difference
// up to a bf16 ulp: tokens would differ). How a task splits its rows never changes a row's arithmetic.
// K and V are prefetched a few KB ahead: the hardware prefetcher alone left the FMAs waiting on DRAM (a 1536-slot,
// 8-row task 98 us from memory, 41 us from L2).
constexpr int64_t kMaxHeadDim = 128;
constexpr int64_t kPrefetchBlocks = 4;        // K: 16-slot blocks ahead of the one being scored
constexpr int64_t kPrefetchSlots = 32;        // V: slots ahead of the one being summed

struct Scratch {                              // per thread, reused across calls: no allocation per head
  std::vector<float> sc;                      // scores, then softmax numerators [count, stride], 64-byte aligned
  std::vector<int64_t> live;                  // rows that are their own ancestor; the others are skipped, output 0
};

template <typename T>
static inline void Prefetch(const T* p, int64_t count) {    // `count` elements from p into every cache level
  const char* b = reinterpret_cast<const char*>(p);
  for (int64_t o = 0; o < count * static_cast<int64_t>(sizeof(T)); o += 64) __builtin_prefetch(b + o, 0, 3);
}

// The 16 scores (unscaled) of row qi against the 16 consecutive slots of K at kb
template <int VECS, typename T>
static inline v16 Scores16(const float* qi, const T* kb, int vecs) {
  const int nv = VECS ? VECS : vecs;
  const int64_t dh = 16 * nv;
  v16 acc[16] = {};
  for (int c = 0; c < nv; ++c) {
    const v16 qc = Load(qi + 16 * c);
    for (int jj = 0; jj < 16; ++jj) acc[jj] += qc * Load(kb + jj * dh + 16 * c);
  }
  return Reduce16(acc);
}

// out[r] = the softmax-weighted sum of V's slots [0, end) for R rows of numerators e[r] (R in 1..4, one
// instantiation each: the rows' accumulators stay in registers)
template <int R, int VECS, typename T>
static inline void Weighted(const float* const* e, const T* V, int64_t end, int vecs, float* const* out) {
  constexpr int kVecs = VECS ? VECS : kMaxHeadDim / 16;
  const int nv = VECS ? VECS : vecs;
  const int64_t dh = 16 * nv;
  v16 acc[R][kVecs] = {};
  float den[R] = {};
  for (int64_t j = 0; j < end; ++j) {
    if (j + kPrefetchSlots < end) Prefetch(V + (j + kPrefetchSlots) * dh, dh);
    v16 v[kVecs];
    for (int c = 0; c < nv; ++c) v[c] = Load(V + j * dh + 16 * c);
    for (int r = 0; r < R; ++r) {
      const float x = e[r][j];
      den[r] += x;
      const v16 p = Splat(x);
      for (int c = 0; c < nv; ++c) acc[r][c] += p * v[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < nv; ++c) {
      const v16 o = acc[r][c] * Splat(den[r] > 0.0f ? 1.0f / den[r] : 0.0f);   // a row that sees nothing: 0
      __builtin_memcpy(out[r] + 16 * c, &o, sizeof(v16));
    }
}

// VECS: the head size in 16-float vectors, unrolled at compile time for the common sizes (64, 128); 0 for any
// other multiple of 16 up to kMaxHeadDim (`vecs` at run time).
template <int VECS, typename T>
static void Head(const float* q, const T* K, const T* V, const int32_t* anc, const int32_t* seen, int64_t n,
                 int64_t first, int64_t count, int64_t len, int64_t end, float scale, float* out, Scratch& scratch,
                 int vecs, int64_t st, int64_t sg) {
  const int nv = VECS ? VECS : vecs;
  const int64_t dh = 16 * nv;
  const auto at = [&](int64_t i) { return (i % n) * st + (i / n) * sg; };
  const int64_t stride = (end + 15) / 16 * 16;
  std::vector<float>& buf = scratch.sc;
  std::vector<int64_t>& live = scratch.live;
  buf.resize(count * stride + 16);
  float* sc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  live.clear();
  for (int64_t i = first; i < first + count; ++i) {
    if (anc[(i % n) * n + i % n]) {
      live.push_back(i);
    } else {
      std::fill_n(out + at(i), dh, 0.0f);
    }
  }
  // row i sees no slot from its_end(i) on: later blocks are skipped (numerators 0 there), as is the rest of a
  // causal prefill's row, where every row would otherwise score every slot of the prompt
  const auto its_end = [&](int64_t i) { return std::min<int64_t>(end, len + seen[i % n]); };
  const int64_t full = end / 16 * 16;         // slots in whole blocks; the rest go through `tail`
  T tail[16 * kMaxHeadDim];
  for (int64_t j0 = 0; j0 < end; j0 += 16) {
    const T* kb = K + j0 * dh;
    if (j0 >= full) {
      for (int jj = 0; jj < 16; ++jj) std::copy_n(K + std::min(j0 + jj, end - 1) * dh, dh, tail + jj * dh);
      kb = tail;
    } else if (j0 + (kPrefetchBlocks + 1) * 16 <= full) {
      Prefetch(kb + kPrefetchBlocks * 16 * dh, 16 * dh);
    }
    for (const int64_t i : live) {
      if (j0 >= its_end(i)) {
        std::fill_n(sc + (i - first) * stride + j0, 16, 0.0f);
        continue;
      }
      v16 scores = Scores16<VECS, T>(q + at(i), kb, vecs) * Splat(scale);
      if (j0 + 16 > len) {                    // the block holds new tokens (or slots past end): hide the others
        for (int jj = 0; jj < 16; ++jj) {
          const int64_t j = j0 + jj;
          if (j >= end || (j >= len && !anc[(i % n) * n + (j - len)])) scores[jj] = -kInf;
        }
      }
      __builtin_memcpy(sc + (i - first) * stride + j0, &scores, sizeof(v16));
    }
  }
  for (const int64_t i : live) {              // softmax numerators per row
    float* row = sc + (i - first) * stride;
    const int64_t seen_stride = (its_end(i) + 15) / 16 * 16;
    v16 vm = Splat(-kInf);
    for (int64_t j = 0; j < seen_stride; j += 16) {
      const v16 x = Load(row + j);
      vm = x > vm ? x : vm;
    }
    const float top = Max(vm);
    if (top == -kInf) {                       // a token written past the capacity: sees nothing, outputs 0
      std::fill(row, row + seen_stride, 0.0f);
      continue;
    }
    for (int64_t j = 0; j < seen_stride; j += 16) {
      const v16 e = Exp(Load(row + j) - Splat(top));
      __builtin_memcpy(row + j, &e, sizeof(v16));
    }
  }
  const int64_t m = static_cast<int64_t>(live.size());
  for (int64_t i0 = 0; i0 < m; i0 += 4) {
    const float* e[4];
    float* o[4];
    const int rows = static_cast<int>(std::min<int64_t>(4, m - i0));
    int64_t upto = 0;                         // the rows' last seen slot + 1: numerators past a row's own are 0
    for (int r = 0; r < rows; ++r) {
      e[r] = sc + (live[i0 + r] - first) * stride;
      o[r] = out + at(live[i0 + r]);
      upto = std::max(upto, its_end(live[i0 + r]));
    }
    if (rows == 4) Weighted<4, VECS, T>(e, V, upto, vecs, o);
    else if (rows == 3) Weighted<3, VECS, T>(e, V, upto, vecs, o);
    else if (rows == 2) Weighted<2, VECS, T>(e, V, upto, vecs, o);
    else Weighted<1, VECS, T>(e, V, upto, vecs, o);
  }
}

// The Head for `vecs` (head size / 16): unrolled for 64 and 128 only, since every instantiation costs a first
// process ~0.3 s of the compiler (all eight took 6 s, quiet)
template <typename T>
static void AnyHead(const float* q, const T* K, const T* V, const int32_t* anc, const int32_t* seen, int64_t n,
                    int64_t first, int64_t count, int64_t len, int64_t end, float scale, float* out, Scratch& scratch,
                    int vecs, int64_t st, int64_t sg) {
  if (vecs == 4) return Head<4, T>(q, K, V, anc, seen, n, first, count, len, end, scale, out, scratch, vecs, st, sg);
  if (vecs == 8) return Head<8, T>(q, K, V, anc, seen, n, first, count, len, end, scale, out, scratch, vecs, st, sg);
  Head<0, T>(q, K, V, anc, seen, n, first, count, len, end, scale, out, scratch, vecs, st, sg);
}
constexpr int64_t kGroupRows = 8;    // a kv group with at most this many rows is one task (below)
constexpr int64_t kChunkRows = 24;   // the most rows of a task when a group is split

// T: the cache's element type (float, or bf16 as uint16 bits widened exactly); q and out are f32
template <ffi::DataType kKV, typename T>
static ffi::Error TreeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<kKV> k,
                                    ffi::Buffer<kKV> v, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lengths,
                                    ffi::Buffer<ffi::S32> ancestors, float scale, int32_t token_major,
                                    ffi::ResultBuffer<ffi::F32> out) {
  // q and out [B, Hq, N, Dh], or [B, N, Hq, Dh] with token_major (as the projections make them: no transposes
  // around the call); k, v [L, B, Hkv, S, Dh]; lengths [B]; ancestors [B, N, N] (nonzero: a is i's ancestor or i)
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  const auto ad = ancestors.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || ad.size() != 3)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "tree_attention: bad shapes");
  const int64_t b = qd[0], hq = token_major ? qd[2] : qd[1], n = token_major ? qd[1] : qd[2], dh = qd[3];
  if (kd[1] != b || kd[4] != dh || dh % 16 != 0 || dh > kMaxHeadDim || hq % kd[2] != 0 || ad[0] != b || ad[1] != n ||
      ad[2] != n || lengths.element_count() != b)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "tree_attention: bad shapes");
  const int64_t hkv = kd[2], s = kd[3], group = hq / hkv;
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= kd[0]) return ffi::Error(ffi::ErrorCode::kOutOfRange, "tree_attention: layer out of range");
  const float* Q = q.typed_data();
  const T* Kl = reinterpret_cast<const T*>(k.untyped_data()) + l * b * hkv * s * dh;
  const T* Vl = reinterpret_cast<const T*>(v.untyped_data()) + l * b * hkv * s * dh;
  const int32_t* lens = lengths.typed_data();
  const int32_t* anc = ancestors.typed_data();
  float* O = out->typed_data();
  // A task is one kv head's rows, or a contiguous chunk of them: its K and V are streamed once for every query
  // head of the group (grouped-query attention), not once per head. A group of at most kGroupRows rows (a decode
  // step: memory-bound) is one task; a wider verify (compute-bound) splits into chunks of about kChunkRows rows,
  // as many as make the tasks a multiple of the threads (SmolLM2's 3 kv heads on 2 threads: 6 or 12 tasks).
  const int64_t rows = group * n;
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  int64_t chunks = 1;
  if (rows > kGroupRows) {
    chunks = (rows + kChunkRows - 1) / kChunkRows;
    while (chunks < rows && (b * hkv * chunks) % workers != 0) ++chunks;
  }
  const int64_t tasks = b * hkv * chunks;
  std::vector<int32_t> seen(b * n, 0);        // per tree row: 1 + its last visible new token (0: none)
  for (int64_t r = 0; r < b * n; ++r)
    for (int64_t a = n - 1; a >= 0; --a)
      if (anc[r * n + a]) {
        seen[r] = static_cast<int32_t>(a + 1);
        break;
      }
  const int64_t helpers = std::max<int64_t>(0, std::min<int64_t>(workers, tasks) - 1);
  ParallelFor(pool, tasks, helpers, [&](int64_t t) {
    thread_local Scratch sc;
    const int64_t c = t % chunks, bh = t / chunks, bi = bh / hkv;
    const int64_t len = std::clamp<int64_t>(lens[bi], 0, s), end = std::min<int64_t>(len + n, s);
    const int64_t kv = bh * s * dh;
    const int64_t base = token_major ? (bi * n * hq + bh % hkv * group) * dh : bh * rows * dh;
    const int64_t first = c * rows / chunks, count = (c + 1) * rows / chunks - first;
    AnyHead<T>(Q + base, Kl + kv, Vl + kv, anc + bi * n * n, seen.data() + bi * n, n, first, count, len, end, scale,
               O + base, sc, dh / 16, token_major ? hq * dh : dh, token_major ? dh : n * dh);
  });
  return ffi::Error::Success();
}

#define HSD_ATTENTION_BIND(KV)         \
  ffi::Ffi::Bind()                     \
      .Ctx<ffi::ThreadPool>()          \
      .Arg<ffi::Buffer<ffi::F32>>()    \
      .Arg<ffi::Buffer<KV>>()          \
      .Arg<ffi::Buffer<KV>>()          \
      .Arg<ffi::Buffer<ffi::S32>>()    \
      .Arg<ffi::Buffer<ffi::S32>>()    \
      .Arg<ffi::Buffer<ffi::S32>>()    \
      .Attr<float>("scale")            \
      .Attr<int32_t>("token_major")    \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(TreeAttention, (TreeAttentionImpl<ffi::F32, float>), HSD_ATTENTION_BIND(ffi::F32));
// a bf16 model's cache (half the bytes; its entries widened exactly, f32 scores and sums)
XLA_FFI_DEFINE_HANDLER_SYMBOL(TreeAttentionBF16, (TreeAttentionImpl<ffi::BF16, uint16_t>), HSD_ATTENTION_BIND(ffi::BF16));
