// y[N, f] = x[N, d] @ w[layer] for the target's stacked layer weights, read in place (hsd_jax.cpu_kernels).
// XLA:CPU copies a layer's weights out of the [L, d, f] stack before its GEMM when N > 1 (BENCHMARKS.md,
// "Why the CPU kernels"); this XLA FFI handler reads them where they are, each weight once for all N rows, from
// the plain [L, d, f] layout or, streamed in order, from [L, f / 32, d, 32] (f32, or bf16 widened exactly: a bf16
// model's layers and LM head; a bf16 prefill's wide rows through AVX-512 BF16 dot products, the pairs made in
// registers), or from [L, f / 32, d / 2, 64]: bf16 pairs along d for AMX tiles or AVX-512 BF16 dot products
// (the f32 LM head's screen, whose inputs are bf16 values). Threads: XLA's intra-op pool.
// Rows whose `active` flag is 0 are skipped and come out 0 (a verify narrower than its static shape).
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) || (defined(__AMX_TILE__) && defined(__AMX_BF16__))
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HSD_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t vu16 __attribute__((vector_size(64)));
// Register tiles: up to kRows rows by 32 columns; a forward of at most kWideRows rows (a verify) in one tile of all
// its rows (2 x 12 accumulators of AVX-512's 32 registers), so each weight is loaded once for all of them: 9-12
// rows as 8 + the rest re-read each tile from L2 with no memory traffic beside (12 rows 1.55x one row's time,
// now 1.38x: verify_cost.py). Wider forwards keep 8-row tiles (12-row tiles were 4-10% slower at 64-512 rows).
constexpr int64_t kCols = 32, kRows = 8, kWideRows = 12;
#ifndef HSD_AHEAD
#define HSD_AHEAD 128
#endif
constexpr int64_t kAhead = HSD_AHEAD;   // software prefetch distance in tile rows (bf16 tiles: 64 bytes a row, 8 KB ahead)
#ifndef HSD_F32_AHEAD
#define HSD_F32_AHEAD 64
#endif
// f32 tiles' (128 bytes a row: both cache lines prefetched, 8 KB ahead). On a Zen 5 VM the 30 layers' matmuls
// at 4-16 rows took 0.75-0.96x the time without it (paired runs; one row, and one line a row: no gain).
constexpr int64_t kF32Ahead = HSD_F32_AHEAD;
#ifndef HSD_PREFETCH_LOCALITY
#define HSD_PREFETCH_LOCALITY 0
#endif
// The prefetches' cache level (`kernel_build.prefetch_locality`, by CPU vendor): 0 (prefetchnta) on AMD, 2
// (prefetcht1) on Intel. On an Intel Xeon (2 cores, AVX-512) prefetchnta made 2-8 rows 1.8-2.4x slower than one
// (the lines it fetches are evicted before their FMAs read them); prefetcht1 puts them at 1.0-1.3x.
constexpr int kLocality = HSD_PREFETCH_LOCALITY;
#ifndef HSD_PREFETCH_MIN_ROWS
#define HSD_PREFETCH_MIN_ROWS 2
#endif
// The fewest rows whose tiles prefetch (`kernel_build.prefetch_min_rows`, by CPU vendor): 1 on Intel, where a
// decode step's matmuls (one row) took 0.70x (bf16) and 0.93x (f32) the time with it; 2 on AMD (one row: no gain).
constexpr int kPrefetchMinRows = HSD_PREFETCH_MIN_ROWS;
#ifndef HSD_F32_L2_MIN_ROWS
#define HSD_F32_L2_MIN_ROWS 0
#endif
// The fewest rows whose f32 tiles prefetch into L2 (prefetcht1) whatever kLocality says; 0: none
// (`kernel_build.f32_l2_min_rows`, by CPU vendor). On an AMD Zen 4 VM (in one process, 30 layers' weights), the
// MLP's matmuls at 5 / 8 / 11 rows took 0.87-0.90 / 0.72-0.97 / 0.60-0.85x the time with prefetcht1, 2-4 rows the
// same: the FMAs of 5+ rows outlast a line fetched with prefetchnta.
constexpr int kF32L2MinRows = HSD_F32_L2_MIN_ROWS;
#ifndef HSD_BF16_ROW1_AHEAD
#define HSD_BF16_ROW1_AHEAD 0
#endif
// One-row bf16 tiles' own prefetch (`kernel_build.bf16_row1_ahead`, by CPU vendor), in tile rows, into every
// cache level: 256 (16 KB ahead) on AMD, where a bf16 decode step took 0.964-0.984x the time with it (four
// paired runs, Zen 5; 8 KB ahead, or into L2 only: 0.99x); 0 on Intel, whose one row prefetches as 2+ rows do.
constexpr int64_t kBF16Row1Ahead = HSD_BF16_ROW1_AHEAD;
#ifndef HSD_PAIRS_AHEAD
#define HSD_PAIRS_AHEAD 0
#endif
#ifndef HSD_PAIRS_MIN_ROWS
#define HSD_PAIRS_MIN_ROWS 2
#endif
// The pairs layout's (the head screen), in pair rows of 128 bytes (both lines, into L2), from kPairsMinRows rows
// (`kernel_build.pairs_ahead`, by CPU vendor): 64 (8 KB) from 4 rows on AMD, where the screen at 4 / 8 / 11 rows
// took 0.85 / 0.60-0.71 / 0.60-0.70x the time with it (Zen 4 VM, in one process); none on Intel, where on a Xeon with
// AVX-512 BF16 (2 cores) the screen at 2-16 rows took 0.65-0.93x the time without it (benchmarks/verify_cost.py).
constexpr int64_t kPairsAhead = HSD_PAIRS_AHEAD;
constexpr int kPairsMinRows = HSD_PAIRS_MIN_ROWS;

// 32 consecutive weights as two f32 vectors (columns 0-15 and 16-31 of the tile): f32 as stored; bf16 widened
// exactly, stored with the two halves interleaved (columns 0, 16, 1, 17, ...: `cpu_kernels.pack`) so that each
// 32-bit lane holds column i in its low half and column i + 16 in its high half: one load, a shift and a mask.
static inline void LoadW(const float* w, v16& w0, v16& w1) {
  __builtin_memcpy(&w0, w, sizeof(v16));
  __builtin_memcpy(&w1, w + 16, sizeof(v16));
}
static inline void LoadW(const uint16_t* w, v16& w0, v16& w1) {
  vu16 u;
  __builtin_memcpy(&u, w, sizeof(vu16));
  const vu16 lo = u << 16, hi = u & 0xFFFF0000u;
  __builtin_memcpy(&w0, &lo, sizeof(v16));
  __builtin_memcpy(&w1, &hi, sizeof(v16));
}

// y[r0 : r0 + R, j : j + 32] over all of d, in 2R AVX-512 registers (R fixed: fully unrolled);
// W points at the tile's first row, ws is the step between its rows.
template <int R, typename T>
static void Tile(const float* X, const T* W, int64_t ws, float* Y, int64_t d, int64_t f, int64_t r0, int64_t j) {
  v16 acc[R][2] = {};
  for (int64_t k = 0; k < d; ++k) {
    // Prefetch the tile's rows ahead (past its end: the next tile's, contiguous when packed): bf16 at 4-8 rows
    // 1.4-1.8x faster (benchmarks/verify_cost.py --dtype bfloat16), f32 at 8 rows 1.1-1.3x, where the FMAs slow
    // the stream and the hardware prefetcher falls behind; one row too where kPrefetchMinRows says so.
    if (sizeof(T) == 2 && R == 1 && kBF16Row1Ahead > 0) __builtin_prefetch(W + (k + kBF16Row1Ahead) * ws, 0, 3);
    else if (sizeof(T) == 2 && R >= kPrefetchMinRows && kAhead > 0) __builtin_prefetch(W + (k + kAhead) * ws, 0, kLocality);
    if (sizeof(T) == 4 && R >= kPrefetchMinRows && kF32Ahead > 0) {
      constexpr int kLevel = kF32L2MinRows > 0 && R >= kF32L2MinRows ? 2 : kLocality;
      __builtin_prefetch(W + (k + kF32Ahead) * ws, 0, kLevel);
      __builtin_prefetch(W + (k + kF32Ahead) * ws + 16, 0, kLevel);
    }
    v16 w0, w1;
    LoadW(W + k * ws, w0, w1);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const float a = X[(r0 + r) * d + k];
      acc[r][0] += a * w0;
      acc[r][1] += a * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    __builtin_memcpy(Y + (r0 + r) * f + j, &acc[r][0], sizeof(v16));
    __builtin_memcpy(Y + (r0 + r) * f + j + 16, &acc[r][1], sizeof(v16));
  }
}

// The pairs layout: each 32-column tile stores d / 2 rows of 64 bf16, row p holding, for columns c = 0-15 then
// 16-31, the pair (w[2p][c], w[2p + 1][c]) in one 32-bit lane (low half: the even k), as AVX-512 BF16's dot
// product (and AMX's VNNI tiles) read them; XP holds each row's inputs as the same bf16 pairs. With AVX-512 BF16
// one instruction does two multiply-adds per lane (bf16 x bf16 products are exact in f32; f32 sums, denormals
// flushed); without it the pairs are widened exactly and summed with FMAs (same products, another order).
template <int R>
static void TilePairs(const uint32_t* XP, const uint16_t* W, float* Y, int64_t dp, int64_t f, int64_t r0, int64_t j) {
  v16 acc[R][2] = {};
  for (int64_t p = 0; p < dp; ++p) {
    if (R >= kPairsMinRows && kPairsAhead > 0) {
      __builtin_prefetch(W + (p + kPairsAhead) * 2 * kCols, 0, 2);
      __builtin_prefetch(W + (p + kPairsAhead) * 2 * kCols + kCols, 0, 2);
    }
    const uint16_t* wp = W + p * 2 * kCols;
#if defined(__AVX512BF16__)
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + kCols);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(XP[(r0 + r) * dp + p]));
      acc[r][0] = (v16)_mm512_dpbf16_ps((__m512)acc[r][0], w0, xb);
      acc[r][1] = (v16)_mm512_dpbf16_ps((__m512)acc[r][1], w1, xb);
    }
#else
    v16 e0, o0, e1, o1;
    LoadW(wp, e0, o0);
    LoadW(wp + kCols, e1, o1);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const uint32_t u = XP[(r0 + r) * dp + p];
      const uint32_t lo = u << 16, hi = u & 0xFFFF0000u;
      float xe, xo;
      __builtin_memcpy(&xe, &lo, 4);
      __builtin_memcpy(&xo, &hi, 4);
      acc[r][0] += xe * e0 + xo * o0;
      acc[r][1] += xe * e1 + xo * o1;
    }
#endif
  }
  for (int r = 0; r < R; ++r) {
    __builtin_memcpy(Y + (r0 + r) * f + j, &acc[r][0], sizeof(v16));
    __builtin_memcpy(Y + (r0 + r) * f + j + 16, &acc[r][1], sizeof(v16));
  }
}

#if defined(__AVX512BF16__)
// The packed bf16 layout (rows of 32 weights, columns 0, 16, 1, 17, ...) through AVX-512 BF16 dot products: rows 2p
// and 2p + 1 make each lane's pair (w[2p][c], w[2p + 1][c]) in registers (two mask-and-shift ops per half), so a
// bf16 prefill gets the pairs layout's dot products without a second copy of the weights. XP holds the inputs as
// bf16 pairs (exact for a bf16 model's inputs, all bf16 values). Products exact in f32, sums f32 (another order
// than the widening Tile's: a prefill's rows, never a decode or verify row).
template <int R>
static void TilePackedDot(const uint32_t* XP, const uint16_t* W, float* Y, int64_t d, int64_t f, int64_t r0, int64_t j) {
  const int64_t dp = (d + 1) / 2;
  v16 acc[R][2] = {};
  for (int64_t p = 0; p < dp; ++p) {
    vu16 a, b = {};
    __builtin_memcpy(&a, W + 2 * p * kCols, sizeof(vu16));
    if (2 * p + 1 < d) __builtin_memcpy(&b, W + (2 * p + 1) * kCols, sizeof(vu16));
    const vu16 lo = (a & 0xFFFFu) | (b << 16), hi = (a >> 16) | (b & 0xFFFF0000u);   // columns 0-15, 16-31
    const __m512bh w0 = (__m512bh)(__m512i)lo, w1 = (__m512bh)(__m512i)hi;
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(XP[(r0 + r) * dp + p]));
      acc[r][0] = (v16)_mm512_dpbf16_ps((__m512)acc[r][0], w0, xb);
      acc[r][1] = (v16)_mm512_dpbf16_ps((__m512)acc[r][1], w1, xb);
    }
  }
  for (int r = 0; r < R; ++r) {
    __builtin_memcpy(Y + (r0 + r) * f + j, &acc[r][0], sizeof(v16));
    __builtin_memcpy(Y + (r0 + r) * f + j + 16, &acc[r][1], sizeof(v16));
  }
}
#endif

#ifdef HSD_AMX
// AMX (Intel Sapphire Rapids and later): the pairs layout's products as tile dot products, 16 pairs (32 of d) by
// 16 columns by up to 16 rows an instruction. The same bf16 products, exact in f32, summed in f32 in another
// order (denormals flushed, as AVX-512 BF16 does); the head screen's bound covers any order
// (`llama.screened_argmax`). At 8 rows the screen's dot products were ~half its time on AVX-512 BF16.
// Linux grants a process the tile state only when asked (arch_prctl); refused, the AVX-512 path runs.
static bool AmxGranted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// y[r0 : r0 + rows, columns of tiles t0 .. t1) for rows <= 16, XP's rows (bf16 pairs) dp apart, dp % 16 == 0:
// tmm0, tmm1 the two 16-column halves' sums, tmm2 the inputs' 16 pairs, tmm3 and tmm4 the weights' (each pair
// row is 128 bytes: the halves 64 bytes apart).
static void TilesPairsAmx(const uint32_t* XP, const uint16_t* W, int64_t tile_size, float* Y, int64_t dp, int64_t f,
                          int64_t r0, int64_t rows, int64_t t0, int64_t t1) {
  TileConfig cfg;
  for (int i = 0; i < 5; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = static_cast<uint8_t>(i < 3 ? rows : 16);
  }
  _tile_loadconfig(&cfg);
  for (int64_t t = t0; t < t1; ++t) {
    const uint16_t* tile = W + t * tile_size;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t p = 0; p < dp; p += 16) {
      _tile_loadd(2, XP + r0 * dp + p, dp * 4);
      _tile_loadd(3, tile + p * 2 * kCols, 4 * kCols);
      _tile_loadd(4, tile + p * 2 * kCols + kCols, 4 * kCols);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, Y + r0 * f + t * kCols, f * 4);
    _tile_stored(1, Y + r0 * f + t * kCols + 16, f * 4);
  }
  _tile_release();
}
#endif

// f32 -> bf16 bits, rounded to nearest even (exact for an input that is already a bf16 value)
static inline uint32_t ToBF16(float v) {
  uint32_t u;
  __builtin_memcpy(&u, &v, 4);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

// Calls fn(std::integral_constant<int, R>) for a register tile of R = min(kWideRows, n) rows.
template <typename F>
static inline void ForRows(int64_t n, const F& fn) {
  switch (std::min(kWideRows, n)) {
    case 1: fn(std::integral_constant<int, 1>()); break;
    case 2: fn(std::integral_constant<int, 2>()); break;
    case 3: fn(std::integral_constant<int, 3>()); break;
    case 4: fn(std::integral_constant<int, 4>()); break;
    case 5: fn(std::integral_constant<int, 5>()); break;
    case 6: fn(std::integral_constant<int, 6>()); break;
    case 7: fn(std::integral_constant<int, 7>()); break;
    case 8: fn(std::integral_constant<int, 8>()); break;
    case 9: fn(std::integral_constant<int, 9>()); break;
    case 10: fn(std::integral_constant<int, 10>()); break;
    case 11: fn(std::integral_constant<int, 11>()); break;
    default: fn(std::integral_constant<int, 12>()); break;
  }
}

enum Layout { kPlain, kPacked, kPairs, kPackedDot };
// The fewest rows the packed bf16 layout's dot products serve: 30 layers' MLP matmuls (Zen 5, 2 threads) at 8 / 16
// / 32 / 128 / 512 rows took 1.25 / 1.08 / 0.87 / 0.77 / 0.66x the widening kernel's time
constexpr int64_t kDotMinRows = 24;

template <Layout kL, ffi::DataType kW, typename T>
static ffi::Error StackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kW> w, ffi::Buffer<ffi::S32> layer,
                                    ffi::Buffer<ffi::S32> active, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  // plain: w [L, d, f]; packed: w [L, f / 32, d, 32] (each column tile contiguous); pairs: [L, f / 32, ceil(d / 2), 64]
  constexpr bool kPackedTiles = kL != kPlain;
  bool ok = xd.size() == 2 && wd.size() == (kPackedTiles ? 4u : 3u);
  if (ok && kL == kPlain) ok = xd[1] == wd[1];
  if (ok && (kL == kPacked || kL == kPackedDot)) ok = wd[3] == kCols && xd[1] == wd[2];
  if (ok && kL == kPairs) ok = wd[3] == 2 * kCols && (xd[1] + 1) / 2 == wd[2];
  if (!ok || active.element_count() != xd[0]) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "stacked_matmul: bad shapes");
  const int64_t d = xd[1], f = kPackedTiles ? wd[1] * kCols : wd[2], dp = (d + 1) / 2;
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error(ffi::ErrorCode::kOutOfRange, "stacked_matmul: layer out of range");
  const int64_t tile_size = kL == kPairs ? dp * 2 * kCols : d * kCols;   // weights per packed column tile
  const T* W = reinterpret_cast<const T*>(w.untyped_data()) + l * (f / kCols) * tile_size;
  const int64_t ws = kPackedTiles ? kCols : f;
  // the active rows, gathered into a contiguous block when some are not
  const int32_t* act = active.typed_data();
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < xd[0]; ++r)
    if (act[r]) rows.push_back(r);
  const int64_t n = static_cast<int64_t>(rows.size());
  const bool all = n == xd[0];
  std::vector<float> xa, ya;
  if (!all) {
    xa.resize(n * d);
    ya.resize(n * f);
    for (int64_t i = 0; i < n; ++i) std::copy_n(x.typed_data() + rows[i] * d, d, xa.data() + i * d);
  }
  const float* X = all ? x.typed_data() : xa.data();
  float* Y = all ? y->typed_data() : ya.data();
  // dot products from kDotMinRows rows (fewer: the widening Tile, faster there); without AVX-512 BF16, always it
#if defined(__AVX512BF16__)
  const bool dot = kL == kPackedDot && n >= kDotMinRows;
#else
  const bool dot = false;
#endif
  const bool pair_inputs = kL == kPairs || dot;
  std::vector<uint32_t> xp(pair_inputs ? n * dp : 0);   // the inputs as bf16 pairs (pairs layout, dot products)
  for (int64_t r = 0; pair_inputs && r < n; ++r)
    for (int64_t p = 0; p < dp; ++p)
      xp[r * dp + p] = ToBF16(X[r * d + 2 * p]) | (2 * p + 1 < d ? ToBF16(X[r * d + 2 * p + 1]) << 16 : 0u);
  // Register tiles of up to 8 rows (12 in a verify-sized forward) x 32 columns; each w tile (d x 32) is
  // streamed from memory once.
  // The column tiles are split over XLA's intra-op thread pool (parallel.h).
  const int64_t tiles = f / kCols, step = n <= kWideRows ? kWideRows : kRows;
#ifdef HSD_AMX
  const bool amx = kL == kPairs && dp % 16 == 0 && n > 0 && AmxGranted();
#endif
  auto run = [&](int64_t t0, int64_t t1) {
#ifdef HSD_AMX
    if constexpr (kL == kPairs) {
      if (amx) {
        for (int64_t r0 = 0; r0 < n; r0 += 16)
          TilesPairsAmx(xp.data(), W, tile_size, Y, dp, f, r0, std::min<int64_t>(16, n - r0), t0, t1);
        return;
      }
    }
#endif
    for (int64_t t = t0; t < t1; ++t) {
      const T* tile = kPackedTiles ? W + t * tile_size : W + t * kCols;
      for (int64_t r0 = 0; r0 < n; r0 += step) {
        ForRows(std::min(step, n - r0), [&](auto rows) {
          if constexpr (kL == kPairs) {
            TilePairs<decltype(rows)::value>(xp.data(), tile, Y, dp, f, r0, t * kCols);
            return;
          }
#if defined(__AVX512BF16__)
          if constexpr (kL == kPackedDot) {
            if (dot) return TilePackedDot<decltype(rows)::value>(xp.data(), tile, Y, d, f, r0, t * kCols);
          }
#endif
          Tile<decltype(rows)::value>(X, tile, ws, Y, d, f, r0, t * kCols);
        });
      }
    }
  };
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), tiles));
  ParallelFor(pool, parts, parts - 1, [&](int64_t p) { run(p * tiles / parts, (p + 1) * tiles / parts); });
  for (int64_t j = tiles * kCols; kL == kPlain && j < f; ++j) {      // columns past the last full tile (plain layout only)
    for (int64_t r = 0; r < n; ++r) {
      float s = 0.0f;
      for (int64_t k = 0; k < d; ++k) s += X[r * d + k] * static_cast<float>(W[k * f + j]);
      Y[r * f + j] = s;
    }
  }
  if (!all) {
    float* out = y->typed_data();
    std::fill_n(out, xd[0] * f, 0.0f);
    for (int64_t i = 0; i < n; ++i) std::copy_n(ya.data() + i * f, f, out + rows[i] * f);
  }
  return ffi::Error::Success();
}

#define HSD_BIND(W)                               \
  ffi::Ffi::Bind()                                \
      .Ctx<ffi::ThreadPool>()                     \
      .Arg<ffi::Buffer<ffi::F32>>()               \
      .Arg<ffi::Buffer<W>>()                      \
      .Arg<ffi::Buffer<ffi::S32>>()               \
      .Arg<ffi::Buffer<ffi::S32>>()               \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(StackedMatmul, (StackedMatmulImpl<kPlain, ffi::F32, float>), HSD_BIND(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(StackedMatmulPacked, (StackedMatmulImpl<kPacked, ffi::F32, float>), HSD_BIND(ffi::F32));
// bf16 weights (a bf16 model's layers and head): half the bytes, widened in registers
XLA_FFI_DEFINE_HANDLER_SYMBOL(StackedMatmulPackedBF16, (StackedMatmulImpl<kPacked, ffi::BF16, uint16_t>), HSD_BIND(ffi::BF16));
// packed bf16 weights, bf16 inputs (a bf16 model's prefill): AVX-512 BF16 dot products, pairs made in registers
XLA_FFI_DEFINE_HANDLER_SYMBOL(StackedMatmulPackedDotBF16, (StackedMatmulImpl<kPackedDot, ffi::BF16, uint16_t>), HSD_BIND(ffi::BF16));
// bf16 weights in pairs, bf16 inputs (the f32 head's screen, `llama.screened_argmax`): AVX-512 BF16 dot products
XLA_FFI_DEFINE_HANDLER_SYMBOL(StackedMatmulPairsBF16, (StackedMatmulImpl<kPairs, ffi::BF16, uint16_t>), HSD_BIND(ffi::BF16));

// 1 when this build has AVX-512 BF16 dot products (the pairs layout's fast path), else 0
extern "C" int HsdBF16DotProducts() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// 1 when the pairs layout runs on AMX tiles here (built with AMX, and Linux granted this process the tile state)
extern "C" int HsdAmxTiles() {
#ifdef HSD_AMX
  return AmxGranted() ? 1 : 0;
#else
  return 0;
#endif
}
