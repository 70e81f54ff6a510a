// Packed-integer GEMM for CPU: y[b, n] = sum_k x[b, k] * scale[n, g(k)] * (q[n, k] - zero[n, g(k)]).
//
// Layout ("cpu-rows", built and drawn in kernels/cpu.py): per row, chunks of 8 int32 words (one AVX2
// register) holding 32*P codes (P = 8/BITS codes per byte). Byte t of word i holds, in its P fields of
// BITS bits (field s at bits s*BITS), the columns k = 32*s + 4*i + t of the chunk. So
//   * shifting the chunk right by s*BITS and masking every byte gives 32 consecutive columns
//     32s..32s+31 as bytes (the int8-activation path: one u8 x s8 dot product per 32 weights);
//   * shifting by BITS*(t*P + s) and masking every int32 gives 8 columns 32s+t, 32s+4+t, ... as int32
//     (the fp32 path: x is given permuted to match, see cpu.py).
// Groups are powers of two >= 32 columns (or per-channel): every 32-column block lies in one group.
//   scales fp16 (N, Gp), zeros uint8 (N, Gp), xsum fp32 (B, Gp): per-group sums of x.
//   y = sum_g scale_g * dot(q_g, x_g) - sum_g (scale_g * zero_g) * xsum_g
// The AVX2/FMA path runs when compiled with AVX2 and `scalar` is false; the scalar path is the fallback.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>
#include <cmath>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int PREFETCH_WORDS = 256;  // AVX2 int8 path: prefetch this far ahead in each row (1 KiB)
constexpr int PREFETCH_ROWS = 8;  // int8 paths: prefetch the scales of the row this far ahead
constexpr int64_t PREFETCH_BYTES = 8192;  // deferred int8 paths: prefetch the codes this far ahead
constexpr int64_t META_AHEAD = 16 * 32;  // cpu-tiles: prefetch the scales / zeros of the group 32 groups ahead

struct Args {
  const uint32_t* words; const float* x; const int8_t* xq; const float* sx;
  const at::Half* scales; const uint8_t* zeros; const float* xsum; float* y;
  int64_t B, N, Kpad, Gp, W, Xb;  // Xb: x scale blocks per row (int8 path)
  int gshift;  // group of 32-column block `blk` is blk >> gshift
  int xshift;  // x scale block of `blk` is blk >> xshift (int8 path)
  bool pair_order = false;  // int8 path: xq's 32-column blocks are in chunk-pair order (AVX-512, ActInt8)
  const int32_t* xqsum = nullptr;  // int8 path: (B, Xb) sums of xq per x scale block (row_a8_deferred)
};

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

float zero_correction(const Args& a, int64_t n, int64_t b) {
  const at::Half* s = a.scales + n * a.Gp;
  const uint8_t* z = a.zeros + n * a.Gp;
  const float* xs = a.xsum + b * a.Gp;
  int64_t g = 0;
  float c = 0.f;
#ifdef __AVX512F__
  __m512 v = _mm512_setzero_ps();
  for (; g + 16 <= a.Gp; g += 16) {
    const __m512 zf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z + g))));
    const __m512 sf = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + g)));
    v = _mm512_fmadd_ps(_mm512_mul_ps(sf, zf), _mm512_loadu_ps(xs + g), v);
  }
  c = _mm512_reduce_add_ps(v);
#elif defined(__AVX2__) && defined(__F16C__)
  __m256 v = _mm256_setzero_ps();  // AVX2-only CPUs: 8 groups per step (scalar, this was most of int2 g64's time)
  for (; g + 8 <= a.Gp; g += 8) {
    const __m256 zf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(z + g))));
    const __m256 sf = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g)));
    v = _mm256_fmadd_ps(_mm256_mul_ps(sf, zf), _mm256_loadu_ps(xs + g), v);
  }
  c = hsum(v);
#endif
  for (; g < a.Gp; ++g) c += ((float)s[g] * (float)z[g]) * xs[g];
  return c;
}

template <int BITS>
void row_scalar(const Args& a, int64_t n) {
  constexpr int P = 8 / BITS;
  constexpr uint32_t M = (1u << BITS) - 1;
  const uint32_t* row = a.words + n * a.W;
  const at::Half* s = a.scales + n * a.Gp;
  const int64_t chunks = a.Kpad / (32 * P);
  for (int64_t b = 0; b < a.B; ++b) {
    float acc = 0.f;
    for (int64_t c = 0; c < chunks; ++c)
      for (int f = 0; f < P; ++f) {
        const int64_t blk = c * P + f;
        float part = 0.f;
        for (int i = 0; i < 8; ++i)
          for (int t = 0; t < 4; ++t) {
            const float q = (float)((row[c * 8 + i] >> (BITS * (t * P + f))) & M);
            if (a.xq) part += q * (float)a.xq[b * a.Kpad + blk * 32 + 4 * i + t];
            else part += q * a.x[b * a.Kpad + c * 32 * P + (t * P + f) * 8 + i];
          }
        const float xs = a.xq ? a.sx[b * a.Xb + (blk >> a.xshift)] : 1.f;
        acc += (float)s[blk >> a.gshift] * xs * part;
      }
    a.y[b * a.N + n] = acc - zero_correction(a, n, b);
  }
}

#ifdef __AVX2__
// fp32 activations: one row n, batch rows b0..b0+BT; x is permuted so field j, lane i is at chunk*32P + 8j + i.
template <int BITS, int BT>
void row_f32(const Args& a, int64_t n, int64_t b0) {
  constexpr int P = 8 / BITS, F = 4 * P;
  constexpr int NA = BT >= 4 ? 1 : 4 / BT;  // independent accumulators per batch row (hide FMA latency)
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  const uint32_t* row = a.words + n * a.W;
  const at::Half* s = a.scales + n * a.Gp;
  const float* x = a.x + b0 * a.Kpad;
  const int64_t chunks = a.Kpad / (32 * P), gmask = (int64_t(1) << a.gshift) - 1;
  __m256 racc[BT], ga[BT][NA];
  for (int b = 0; b < BT; ++b) {
    racc[b] = _mm256_setzero_ps();
    for (int u = 0; u < NA; ++u) ga[b][u] = _mm256_setzero_ps();
  }
  auto flush = [&](int64_t blk) {
    const __m256 sc = _mm256_set1_ps((float)s[blk >> a.gshift]);
    for (int b = 0; b < BT; ++b) {
      __m256 t = ga[b][0];
      for (int u = 1; u < NA; ++u) t = _mm256_add_ps(t, ga[b][u]);
      racc[b] = _mm256_fmadd_ps(t, sc, racc[b]);
      for (int u = 0; u < NA; ++u) ga[b][u] = _mm256_setzero_ps();
    }
  };
  for (int64_t c = 0; c < chunks; ++c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 8));
    _mm_prefetch(reinterpret_cast<const char*>(row + c * 8 + 128), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int f = 0; f < P; ++f) {
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const int j = t * P + f;
        __m256i q = j == 0 ? v : _mm256_srli_epi32(v, j * BITS);
        if (j != F - 1) q = _mm256_and_si256(q, mask);
        const __m256 w = _mm256_cvtepi32_ps(q);
        const float* xp = x + c * 32 * P + j * 8;
        for (int b = 0; b < BT; ++b)
          ga[b][t % NA] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xp + b * a.Kpad), ga[b][t % NA]);
      }
      const int64_t blk = c * P + f;
      if (((blk + 1) & gmask) == 0) flush(blk);
    }
  }
  if (chunks * P & gmask) flush(chunks * P - 1);  // per-channel, or a group cut by the padding
  for (int b = 0; b < BT; ++b) a.y[(b0 + b) * a.N + n] = hsum(racc[b]) - zero_correction(a, n, b0 + b);
}

// u8 weights x s8 activations, 4-way dot products accumulated in int32.
inline __m256i dot_u8s8(__m256i acc, __m256i w, __m256i x) {
#ifdef __AVXVNNI__
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
  const __m256i p16 = _mm256_maddubs_epi16(w, x);  // no saturation: weights < 16 here (int2, int4)
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
#endif
}

// int8 activations (xq, scale sx per 2^xshift 32-column blocks): rows n..n+R, batch rows b0..b0+BT.
// R*BT = 4 independent dot-product chains hide the latency; each activation load serves R rows.
template <int BITS, int R, int BT>
void rows_a8(const Args& a, int64_t n, int64_t b0) {
  constexpr int P = 8 / BITS;
  const __m256i mask = _mm256_set1_epi8((char)((1 << BITS) - 1));
  const int8_t* xq = a.xq + b0 * a.Kpad;
  const float* sx = a.sx + b0 * a.Xb;
  const int64_t chunks = a.Kpad / (32 * P), xmask = (int64_t(1) << a.xshift) - 1;
  __m256 racc[R][BT];
  __m256i acc[R][BT];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < BT; ++b) { racc[r][b] = _mm256_setzero_ps(); acc[r][b] = _mm256_setzero_si256(); }
  for (int64_t c = 0; c < chunks; ++c) {
    __m256i v[R];
    for (int r = 0; r < R; ++r) {
      const uint32_t* row = a.words + (n + r) * a.W + c * 8;
      v[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
      _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH_WORDS), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int f = 0; f < P; ++f) {
      const int64_t blk = c * P + f;
      __m256i xv[BT];
      for (int b = 0; b < BT; ++b)
        xv[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * a.Kpad + blk * 32));
      for (int r = 0; r < R; ++r) {
        const __m256i q = _mm256_and_si256(f == 0 ? v[r] : _mm256_srli_epi32(v[r], f * BITS), mask);
        for (int b = 0; b < BT; ++b) acc[r][b] = dot_u8s8(acc[r][b], q, xv[b]);
      }
      if (((blk + 1) & xmask) == 0) {
        for (int r = 0; r < R; ++r) {
          const float sw = (float)a.scales[(n + r) * a.Gp + (blk >> a.gshift)];
          for (int b = 0; b < BT; ++b) {
            const __m256 sc = _mm256_set1_ps(sw * sx[b * a.Xb + (blk >> a.xshift)]);
            racc[r][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][b]), sc, racc[r][b]);
            acc[r][b] = _mm256_setzero_si256();
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < BT; ++b)
      a.y[(b0 + b) * a.N + n + r] = hsum(racc[r][b]) - zero_correction(a, n + r, b0 + b);
}

// One batch row of int8 activations, row n, scale conversions deferred: each flush (one x-block of
// 2^XS 32-column blocks) is accumulated in its own register; eight flushes are reduced together into one
// vector of eight sums (x-blocks xb0..xb0+7, in order), converted once and multiplied by the eight
// combined scales scale_w * scale_x, instead of a conversion, a broadcast and an FMA per flush.
// The scales and zero points of a row advance one line per many lines of codes, too slowly for the
// hardware prefetcher: the int8 paths fetch those of the row PREFETCH_ROWS ahead (nothing past the end).
inline void prefetch_meta(const Args& a, int64_t n) {
  if (n >= a.N) return;
  for (int64_t g = 0; g < a.Gp; g += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(a.scales + n * a.Gp + g), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(a.zeros + n * a.Gp + g), _MM_HINT_T0);
  }
}

// Eight floats from p (fp32, or fp16 converted), zeros past `avail`.
inline __m256 load8(const float* p, int64_t avail) {
  if (avail >= 8) return _mm256_loadu_ps(p);
  alignas(32) float t[8] = {};
  std::copy_n(p, avail, t);
  return _mm256_load_ps(t);
}

inline __m256 load8(const at::Half* p, int64_t avail) {
  alignas(32) float t[8] = {};
#ifdef __F16C__
  if (avail >= 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
  for (int64_t i = 0; i < std::min<int64_t>(8, avail); ++i) t[i] = (float)p[i];
  return _mm256_load_ps(t);
}

// Eight int32 from p (int32, or uint8 widened), zeros past `avail`.
inline __m256i load8i(const int32_t* p, int64_t avail) {
  if (avail >= 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) int32_t t[8] = {};
  std::copy_n(p, std::max<int64_t>(avail, 0), t);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
}

inline __m256i load8i(const uint8_t* p, int64_t avail) {
  if (avail >= 8) return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint8_t t[16] = {};
  std::copy_n(p, std::max<int64_t>(avail, 0), t);
  return _mm256_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
}

inline __m256i reduce8_256(const __m256i* v) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  // u0 = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low and high 128-bit partial sums of v0..v3), u1 likewise for v4..v7
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// The same for eight vectors of 16 int16 sums (no VNNI, small codes): a transpose tree of 16-, 32- and 64-bit
// unpacks in int16 (no widening multiply-add per flush), then the two 128-bit halves widened and added.
// Each output is a sum of 16 lanes; the caller keeps 8 lanes' sum within int16.
inline __m256i reduce8_i16(const __m256i* v) {
  __m256i t[4], u[2];
  for (int i = 0; i < 4; ++i)  // per half: [a b a b a b a b], a = v[2i], b = v[2i+1], sums of 2 lanes
    t[i] = _mm256_add_epi16(_mm256_unpacklo_epi16(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_epi16(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // per half: [a b c d a b c d] of v[4i..4i+3], sums of 4 lanes
    u[i] = _mm256_add_epi16(_mm256_unpacklo_epi32(t[2 * i], t[2 * i + 1]), _mm256_unpackhi_epi32(t[2 * i], t[2 * i + 1]));
  const __m256i w = _mm256_add_epi16(_mm256_unpacklo_epi64(u[0], u[1]), _mm256_unpackhi_epi64(u[0], u[1]));
  return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(w)),
                          _mm256_cvtepi16_epi32(_mm256_extracti128_si256(w, 1)));
}

template <int BITS, int XS>
void row_a8_deferred(const Args& a, int64_t n, int64_t b) {
  constexpr int P = 8 / BITS, BX = 1 << XS;
  constexpr int CPF = BX > P ? BX / P : 1;  // chunks per flush
  constexpr int FPC = BX > P ? 1 : P / BX;  // flushes per chunk
  constexpr int CH8 = 8 * CPF / FPC;        // chunks per eight flushes
#ifdef __AVXVNNI__
  constexpr bool I16 = false;
#else
  // Flush sums kept in int16 when no lane can overflow in reduce8_i16: 8 lanes x BX fields x 2 products
  // x largest code x 128: int2 with activation blocks up to 128 columns (its compute-bound case) and int4 g32.
  constexpr bool I16 = 8 * BX * 2 * ((1 << BITS) - 1) * 128 <= 32767;
#endif
  const __m256i mask = _mm256_set1_epi8((char)((1 << BITS) - 1));
  const uint32_t* row = a.words + n * a.W;
  const int8_t* xq = a.xq + b * a.Kpad;
  const int64_t chunks = a.Kpad / (32 * P), D = std::min(a.gshift - XS, 31), xb_all = a.Xb;
  const __m256i lg = _mm256_srli_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), (int)D);  // group of x-block
  const int64_t pf = std::max<int64_t>(PREFETCH_BYTES / 4, a.W);  // codes about PREFETCH_BYTES ahead
  prefetch_meta(a, n + PREFETCH_ROWS);
  __m256 racc = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < chunks; c0 += CH8) {
    __m256i acc[8];
    for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int cc = 0; cc < CH8; ++cc) {
      const int64_t c = c0 + cc;
      if (c >= chunks) break;
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 8));
      _mm_prefetch(reinterpret_cast<const char*>(row + c * 8 + pf), _MM_HINT_T0);
#ifndef __AVXVNNI__
      // No VNNI: the 16-bit pair sums of the chunk's fields that share a flush add up before one widening
      // multiply-add (codes < 16, at most min(P, BX) <= 8 fields: <= 4 x 2 x 15 x 127 < 32767, no overflow).
      __m256i p16 = _mm256_setzero_si256();
#endif
#pragma GCC unroll 8
      for (int f = 0; f < P; ++f) {
        const int k = (cc * P + f) / BX;  // flush of block (c0 + cc) * P + f, relative to c0 * P / BX
        const __m256i q = _mm256_and_si256(f == 0 ? v : _mm256_srli_epi32(v, f * BITS), mask);
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (c * P + f) * 32));
#ifdef __AVXVNNI__
        acc[k] = dot_u8s8(acc[k], q, x);
#else
        const __m256i prod = _mm256_maddubs_epi16(q, x);  // no saturation: weights < 16 here
        if constexpr (I16) {
          acc[k] = _mm256_add_epi16(acc[k], prod);
          continue;
        }
        p16 = _mm256_add_epi16(p16, prod);
        if (f == P - 1 || (cc * P + f + 1) % BX == 0) {  // the last field of flush k in this chunk
          acc[k] = _mm256_add_epi32(acc[k], _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
          p16 = _mm256_setzero_si256();
        }
#endif
      }
    }
    // per x-block: (dot - zero * sum(xq)) in int32, then times scale_w * scale_x (the zero-point term
    // folded in here instead of a pass of zero_correction over the row's groups)
    const int64_t xb0 = c0 * P / BX, g0 = xb0 >> D;
    const __m256 swv = _mm256_permutevar8x32_ps(load8(a.scales + n * a.Gp + g0, a.Gp - g0), lg);
    const __m256 sxv = load8(a.sx + b * xb_all + xb0, xb_all - xb0);
    const __m256i zv = _mm256_permutevar8x32_epi32(load8i(a.zeros + n * a.Gp + g0, a.Gp - g0), lg);
    const __m256i dots = _mm256_sub_epi32(I16 ? reduce8_i16(acc) : reduce8_256(acc),
                                          _mm256_mullo_epi32(zv, load8i(a.xqsum + b * xb_all + xb0, xb_all - xb0)));
    racc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(swv, sxv), racc);
  }
  a.y[b * a.N + n] = hsum(racc);
}

// fn(std::integral_constant<int, XS>) for the activation-block shift: blocks of 32, 64 or 128 columns (XBLOCK)
template <class Fn>
void with_xshift(int xshift, Fn&& fn) {
  switch (xshift) {
    case 0: fn(std::integral_constant<int, 0>{}); break;
    case 1: fn(std::integral_constant<int, 1>{}); break;
    default: fn(std::integral_constant<int, 2>{}); break;
  }
}

// Rows [n, end) for int8 activations: batch tiles of 4 and 2 (4/BT rows at a time, each activation load
// serving them all), then a last single batch row with deferred scaling.
template <int BITS>
void rows_a8_all(const Args& a, int64_t n, int64_t end) {
  auto tile = [&](auto bt, int64_t b) {
    constexpr int BT = decltype(bt)::value, R = 4 / BT;
    int64_t m = n;
    for (; m + R <= end; m += R) rows_a8<BITS, R, BT>(a, m, b);
    for (; m < end; ++m) rows_a8<BITS, 1, BT>(a, m, b);
  };
  int64_t b = 0;
  for (; b + 4 <= a.B; b += 4) tile(std::integral_constant<int, 4>{}, b);
  if (b + 2 <= a.B) { tile(std::integral_constant<int, 2>{}, b); b += 2; }
  if (b < a.B)
    with_xshift(a.xshift, [&](auto xs) {
      for (int64_t m = n; m < end; ++m) row_a8_deferred<BITS, decltype(xs)::value>(a, m, b);
    });
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define COMPRESS_AVX512 1
// AVX-512 VNNI, int8 activations. One 64-byte load holds chunks 2c and 2c+1 of a row (a "pair"); after the
// shift and mask of field f, its low half is block 2cP + f and its high half block 2cP + P + f. The
// activations come in the same order (ActInt8, pair order), so one u8 x s8 dot product covers 64 weights.
// A "flush" is the run of fields over which both halves stay in one activation-scale block (x-block of
// 2^XS blocks): FPP = 2^XS fields when 2^XS <= P (the halves then lie in different x-blocks), else the
// whole pair (2^XS == 2P: both halves in one x-block). Rather than converting and scaling each flush's
// int32 sum on its own (a conversion, two broadcasts and an FMA per flush and row), eight flushes are
// accumulated in eight registers, reduced together into one vector of 16 half-sums (reduce8), converted
// once and multiplied by the matching combined scales scale_w * scale_x (two permutes of contiguous loads).
// Lane l of reduce8's result is half h = (l / 4) % 2 of flush v = 4 * (l / 8) + l % 4.
inline __m512i reduce8(const __m512i* v) {
  __m512i t[4], u[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: [v0 02, v1 02, v0 13, v1 13] (pair sums of 32-bit elements)
    t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // per 128-bit lane: the lane sums of v[4i..4i+3]
    u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
  // 128-bit lanes 0+1 are the low half, 2+3 the high half: [L(v0..3), H(v0..3), L(v4..7), H(v4..7)]
  return _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

template <int BITS, int XS>
struct Flush512 {
  static constexpr int P = 8 / BITS, BX = 1 << XS;
  static constexpr bool SAME = BX == 2 * P;  // both halves of a pair in one x-block
  static constexpr int FPP = SAME ? P : BX;  // fields per flush
  static constexpr int Q = P / FPP;          // flushes per pair
  static constexpr int SPAIRS = 8 / Q;       // pairs per eight flushes
  static constexpr int XSPAN = SAME ? 8 : 16;  // x-blocks per eight flushes
  static_assert(SAME || BX <= P, "activation blocks must tile a pair's fields");
  // x-block of lane l, relative to the first x-block of the eight flushes
  static __m512i lane_xblock() {
    alignas(64) int32_t idx[16];
    for (int l = 0; l < 16; ++l) {
      const int v = 4 * (l / 8) + l % 4, h = (l / 4) % 2, pair = v / Q, j = v % Q;
      idx[l] = SAME ? pair : 2 * pair * Q + h * Q + j;
    }
    return _mm512_load_si512(idx);
  }
};

// Rows n..n+R, batch rows b0..b0+BT; R * BT <= 2 so the 8 * R * BT accumulators stay in registers.
template <int BITS, int XS, int R, int BT>
void rows_a8_512(const Args& a, int64_t n, int64_t b0) {
  using F = Flush512<BITS, XS>;
  constexpr int P = F::P;
  const __m512i mask = _mm512_set1_epi8((char)((1 << BITS) - 1));
  const int8_t* xq = a.xq + b0 * a.Kpad;
  const int64_t pairs = a.Kpad / (64 * P);
  // prefetch the codes of the row tile about PREFETCH_BYTES ahead, at the same column
  const int64_t pf_words = std::max<int64_t>(1, (PREFETCH_BYTES / 4 + R * a.W - 1) / (R * a.W)) * R * a.W;
  const int D = std::min(a.gshift - XS, 31);  // weight group of x-block i: i >> D (D >= 31: one group)
  const __m512i lx = F::lane_xblock(), lg = _mm512_srli_epi32(lx, D);
  __m512 racc[R][BT];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < BT; ++b) racc[r][b] = _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) prefetch_meta(a, n + r + PREFETCH_ROWS);
  for (int64_t c0 = 0; c0 < pairs; c0 += F::SPAIRS) {
    const int64_t np = std::min<int64_t>(F::SPAIRS, pairs - c0);
    __m512i acc[R][BT][8];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < BT; ++b)
        for (int k = 0; k < 8; ++k) acc[r][b][k] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int pp = 0; pp < F::SPAIRS; ++pp) {
      if (pp >= np) break;
      const int64_t c = c0 + pp;
      __m512i v[R];
      for (int r = 0; r < R; ++r) {
        const uint32_t* row = a.words + (n + r) * a.W + c * 16;
        v[r] = _mm512_loadu_si512(row);
        _mm_prefetch(reinterpret_cast<const char*>(row + pf_words), _MM_HINT_T0);
      }
#pragma GCC unroll 8
      for (int f = 0; f < P; ++f) {
        const int k = pp * F::Q + f / F::FPP;
        __m512i xv[BT];
        for (int b = 0; b < BT; ++b) xv[b] = _mm512_loadu_si512(xq + b * a.Kpad + (2 * c * P + 2 * f) * 32);
        for (int r = 0; r < R; ++r) {
          const __m512i q = _mm512_and_si512(f == 0 ? v[r] : _mm512_srli_epi32(v[r], f * BITS), mask);
          for (int b = 0; b < BT; ++b) acc[r][b][k] = _mm512_dpbusd_epi32(acc[r][b][k], q, xv[b]);
        }
      }
    }
    // combined scales of the (up to) 16 x-blocks these flushes touch, in reduce8's lane order
    const int64_t xb0 = (2 * c0 * P) >> XS, g0 = xb0 >> D;
    const __mmask16 xm = (__mmask16)((1u << std::min<int64_t>(16, a.Xb - xb0)) - 1);
    const __mmask16 gm = (__mmask16)((1u << std::min<int64_t>(16, a.Gp - g0)) - 1);
    for (int b = 0; b < BT; ++b) {
      const __m512 sxv = _mm512_permutexvar_ps(lx, _mm512_maskz_loadu_ps(xm, a.sx + (b0 + b) * a.Xb + xb0));
      for (int r = 0; r < R; ++r) {
        const __m512 swv = _mm512_permutexvar_ps(
            lg, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gm, a.scales + (n + r) * a.Gp + g0)));
        racc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(reduce8(acc[r][b])), _mm512_mul_ps(swv, sxv), racc[r][b]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < BT; ++b)
      a.y[(b0 + b) * a.N + n + r] = _mm512_reduce_add_ps(racc[r][b]) - zero_correction(a, n + r, b0 + b);
}

template <int BITS, int XS>
void rows_a8_512_xs(const Args& a, int64_t n, int64_t end) {
  int64_t b = 0;
  for (; b + 2 <= a.B; b += 2)
    for (int64_t m = n; m < end; ++m) rows_a8_512<BITS, XS, 1, 2>(a, m, b);
  if (b < a.B) {
    int64_t m = n;
    for (; m + 2 <= end; m += 2) rows_a8_512<BITS, XS, 2, 1>(a, m, b);
    for (; m < end; ++m) rows_a8_512<BITS, XS, 1, 1>(a, m, b);
  }
}

template <int BITS>
void rows_a8_512_all(const Args& a, int64_t n, int64_t end) {
  with_xshift(a.xshift, [&](auto xs) { rows_a8_512_xs<BITS, decltype(xs)::value>(a, n, end); });
}
#endif

template <int BITS>
void rows_f32_all(const Args& a, int64_t n) {
  auto tile = [&](auto bt, int64_t b) { row_f32<BITS, decltype(bt)::value>(a, n, b); };
  int64_t b = 0;
  for (; b + 4 <= a.B; b += 4) tile(std::integral_constant<int, 4>{}, b);
  if (b + 2 <= a.B) { tile(std::integral_constant<int, 2>{}, b); b += 2; }
  if (b < a.B) tile(std::integral_constant<int, 1>{}, b);
}
#endif

// Rows (or row tiles) are handed out in chunks (64 by default) from a shared counter, so a thread the OS
// parks (the cores are shared) delays only its current chunk instead of a fixed half of the matrix.
template <class Fn>
void parallel_rows(int64_t N, Fn&& fn, int64_t chunk = 64) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (N + chunk - 1) / chunk));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t s; (s = next.fetch_add(chunk)) < N;) fn(s, std::min(N, s + chunk));
  });
}

template <int BITS>
void run(const Args& a, bool scalar) {
  parallel_rows(a.N, [&](int64_t begin, int64_t end) {
#ifdef __AVX2__
    if (!scalar && a.xq) {
#ifdef COMPRESS_AVX512
      if constexpr (BITS < 8) if (a.pair_order) { rows_a8_512_all<BITS>(a, begin, end); return; }
#endif
      if constexpr (BITS < 8) { rows_a8_all<BITS>(a, begin, end); return; }
    }
    if (!scalar && !a.xq) {
      for (int64_t n = begin; n < end; ++n) rows_f32_all<BITS>(a, n);
      return;
    }
#endif
    for (int64_t n = begin; n < end; ++n) row_scalar<BITS>(a, n);
  });
}

void dispatch(const Args& a, int64_t bits, bool scalar) {
  switch (bits) {
    case 1: run<1>(a, scalar); break;  // the high-bit plane of 3-bit weights (kernels/cpu.py::Packed3)
    case 2: run<2>(a, scalar); break;
    case 4: run<4>(a, scalar); break;
    case 8: run<8>(a, scalar); break;
    default: TORCH_CHECK(false, "cpu kernel supports bits 1, 2, 4, 8; got ", bits);
  }
}


// ---- The "cpu-tiles" layout: 2-bit codes, int8 activations (kernels/cpu.py::PackedTiles) ----
// Rows come in tiles of 16. Per tile, vector o (32 bytes) holds columns 8o..8o+7 of the 16 rows: byte 2r + j,
// field f (bits 2f, 2f+1) is the code of row r, column 8o + 2f + j. Shifting by 2f and masking gives, per
// row, the bytes of columns (8o + 2f, 8o + 2f + 1) side by side; one u8 x s8 multiply-add against that
// column pair of x (broadcast) leaves each row's partial dot product in its own int16 lane. The sums stay
// per row (no horizontal reduction), so a flush (one activation block) costs a widening, the zero-point
// term and one FMA per 8 rows. Without VNNI the int2 path of cpu-rows spends about a third of its vector
// operations on the horizontal sums of its groups; this layout does not need them.
// scales fp16 / zeros uint8 (T, Gp, 16); xp (B, Kpad/2, 2) int16: each column pair of the rounded
// activations twice (one 32-bit broadcast load per field; 16 KiB for 8192 columns, it stays in L1).
struct TileArgs {
  const uint8_t* words; const int16_t* xp; const float* sx; const int32_t* xqsum;
  const at::Half* scales; const uint8_t* zeros; float* y;
  int64_t B, T, N, Kpad, Gp, Xb;
  int gshift, xshift;
};

void tile_scalar(const TileArgs& a, int64_t t, int64_t b) {
  const int64_t V = a.Kpad / 8, bx = int64_t(32) << a.xshift;
  const int8_t* xq = reinterpret_cast<const int8_t*>(a.xp + b * a.Kpad);
  float acc[16] = {};
  for (int64_t xb = 0; xb < a.Xb; ++xb) {
    const int64_t g = (xb * bx / 32) >> a.gshift;
    for (int r = 0; r < 16; ++r) {
      int32_t dot = 0;
      for (int64_t k = xb * bx; k < (xb + 1) * bx; ++k) {
        const int64_t o = k / 8, f = (k % 8) / 2, j = k % 2;
        const int code = (a.words[(t * V + o) * 32 + 2 * r + j] >> (2 * f)) & 3;
        dot += code * xq[(k / 2) * 4 + j];  // pair k/2 starts with x[k & ~1], then x[k | 1]
      }
      dot -= (int32_t)a.zeros[(t * a.Gp + g) * 16 + r] * a.xqsum[b * a.Xb + xb];
      acc[r] += (float)dot * ((float)a.scales[(t * a.Gp + g) * 16 + r] * a.sx[b * a.Xb + xb]);
    }
  }
  for (int r = 0; r < 16 && t * 16 + r < a.N; ++r) a.y[b * a.N + t * 16 + r] = acc[r];
}

#ifdef __AVX2__
// An empty asm that takes v in a register: GCC otherwise reassociates a long chain of integer vector adds
// into a tree, holding every product at once (spilled to the stack, slower than the chain).
inline void in_register(__m256i& v) { asm("" : "+x"(v)); }

// Tile t, batch rows b0..b0+BT (BT <= 2; one tile at a time keeps the codes a single stream: two tiles per
// step did less arithmetic but streamed slower). Int16 lanes hold at most 64 columns of sums
// (64 x 3 x 127 < 32767); longer activation blocks add their 64-column parts in int32.
template <int XS, int BT>
void tiles_a8(const TileArgs& a, int64_t t, int64_t b0) {
  constexpr int VX = 4 << XS, SUB = VX < 8 ? VX : 8;  // vectors per activation block / per int16 run
  const __m256i mask = _mm256_set1_epi8(3), mask_hi = _mm256_set1_epi8(12);
  const int64_t xrow = a.Kpad, D = std::min(a.gshift - XS, 31);
  const uint8_t* codes = a.words + t * a.Kpad * 4;  // Kpad / 8 vectors of 32 bytes
  __m256 racc[BT][2];
  for (int b = 0; b < BT; ++b) racc[b][0] = racc[b][1] = _mm256_setzero_ps();
  for (int64_t xb = 0; xb < a.Xb; ++xb) {
    __m256i dots[BT][2];
    for (int b = 0; b < BT; ++b) dots[b][0] = dots[b][1] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int s = 0; s < VX; s += SUB) {
      // Fields 1 and 3 are masked in place, not shifted down: their products are 4x (exact multiples of 4, at
      // most 8 vectors x 2 x 12 x 127 = 24384 per chain) and are shifted back once per run; fields 0 and 2
      // share a chain. Three chains also keep the adds' latency hidden.
      __m256i acc[BT][3];
      for (int b = 0; b < BT; ++b)
        for (int c = 0; c < 3; ++c) acc[b][c] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int u = 0; u < SUB; ++u) {
        const int64_t o = xb * VX + s + u;
        const uint8_t* p = codes + o * 32;
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), hi = _mm256_srli_epi16(w, 4);
        if (u % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_BYTES), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int f = 0; f < 4; ++f) {
          const int c = f % 2 == 0 ? 0 : f == 1 ? 1 : 2;
          const __m256i q = _mm256_and_si256(f < 2 ? w : hi, f % 2 ? mask_hi : mask);
          for (int b = 0; b < BT; ++b) {
            const __m256i xv = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(a.xp + (b0 + b) * xrow + (4 * o + f) * 2));
            acc[b][c] = _mm256_add_epi16(acc[b][c], _mm256_maddubs_epi16(q, xv));
            in_register(acc[b][c]);
          }
        }
      }
      for (int b = 0; b < BT; ++b) {
        const __m256i sum = _mm256_add_epi16(acc[b][0], _mm256_add_epi16(_mm256_srai_epi16(acc[b][1], 2),
                                                                          _mm256_srai_epi16(acc[b][2], 2)));
        dots[b][0] = _mm256_add_epi32(dots[b][0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(sum)));
        dots[b][1] = _mm256_add_epi32(dots[b][1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(sum, 1)));
      }
    }
    const int64_t m = (t * a.Gp + (xb >> D)) * 16;
    if (m + META_AHEAD < a.T * a.Gp * 16) {  // the scales and zeros of a later group (the next tile's near the end)
      _mm_prefetch(reinterpret_cast<const char*>(a.scales + m + META_AHEAD), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(a.zeros + m + META_AHEAD), _MM_HINT_T0);
    }
    const __m128i z = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.zeros + m));
    const __m256i zl = _mm256_cvtepu8_epi32(z), zh = _mm256_cvtepu8_epi32(_mm_srli_si128(z, 8));
    const __m256 sl = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.scales + m)));
    const __m256 sh = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.scales + m + 8)));
    for (int b = 0; b < BT; ++b) {
      const __m256i xs = _mm256_set1_epi32(a.xqsum[(b0 + b) * a.Xb + xb]);
      const __m256 sx = _mm256_set1_ps(a.sx[(b0 + b) * a.Xb + xb]);
      racc[b][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dots[b][0], _mm256_mullo_epi32(zl, xs))),
                                   _mm256_mul_ps(sl, sx), racc[b][0]);
      racc[b][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dots[b][1], _mm256_mullo_epi32(zh, xs))),
                                   _mm256_mul_ps(sh, sx), racc[b][1]);
    }
  }
  for (int b = 0; b < BT; ++b) {
    alignas(32) float out[16];
    _mm256_store_ps(out, racc[b][0]);
    _mm256_store_ps(out + 8, racc[b][1]);
    std::copy_n(out, std::min<int64_t>(16, a.N - t * 16), a.y + (b0 + b) * a.N + t * 16);
  }
}

template <int XS>
void tiles_a8_all(const TileArgs& a, int64_t t, int64_t end) {
  int64_t b = 0;
  for (; b + 2 <= a.B; b += 2)
    for (int64_t m = t; m < end; ++m) tiles_a8<XS, 2>(a, m, b);
  if (b < a.B)
    for (int64_t m = t; m < end; ++m) tiles_a8<XS, 1>(a, m, b);
}
#endif

// A cpu-rows weight: int32 codes, fp16 scales and uint8 zeros shaped alike, all contiguous.
void check_rows(const torch::Tensor& words, const torch::Tensor& scales, const torch::Tensor& zeros) {
  TORCH_CHECK(words.scalar_type() == torch::kInt && words.is_contiguous(), "words: contiguous int32");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous(), "scales: contiguous fp16");
  TORCH_CHECK(zeros.scalar_type() == torch::kByte && zeros.is_contiguous() && zeros.sizes() == scales.sizes(),
              "zeros: contiguous uint8 shaped like scales");
}

// A cpu-tiles weight: int32 codes (T, W), fp16 scales (T, Gp, 16) and uint8 zeros shaped alike, all contiguous.
void check_tiles(const torch::Tensor& words, const torch::Tensor& scales, const torch::Tensor& zeros) {
  TORCH_CHECK(words.scalar_type() == torch::kInt && words.is_contiguous() && words.dim() == 2, "words: contiguous int32 (T, W)");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
              scales.size(0) == words.size(0) && scales.size(2) == 16, "scales: contiguous fp16 (T, Gp, 16)");
  TORCH_CHECK(zeros.scalar_type() == torch::kByte && zeros.is_contiguous() && zeros.sizes() == scales.sizes(),
              "zeros: contiguous uint8 shaped like scales");
}

void check_weight(const torch::Tensor& words, const torch::Tensor& scales, const torch::Tensor& zeros,
                  const torch::Tensor& xsum, int64_t kpad, int64_t bits) {
  check_rows(words, scales, zeros);
  TORCH_CHECK(xsum.scalar_type() == torch::kFloat && xsum.is_contiguous(), "xsum: contiguous fp32");
  TORCH_CHECK(words.size(1) * 32 == kpad * bits, "x width does not match the packed weight");
  TORCH_CHECK(scales.size(1) == xsum.size(1), "xsum needs one column per group");
}

// Activations for the int8 path, from fp32 x (B, K), K <= Kpad, zero padded: per block of 32 << xshift
// columns, symmetric int8 with scale max|x| / 127 (round half to even, as torch.round), and per weight
// group the sum of the rounded activations (the zero-point term). With AVX-512 VNNI (`pairs`) the 32-column
// blocks are written in chunk-pair order for rows_a8_512: per pair c and field f, block 2cP + f, then
// block (2c+1)P + f; otherwise in natural order.
struct ActInt8 {
  std::vector<int8_t> q;  // (B, Kpad)
  std::vector<float> sx, xsum;  // (B, Xb); (B, Gp)
  std::vector<int32_t> xqsum;  // (B, Xb): sum of q per x-block
  bool pair_order = false;
};

ActInt8 quantize_act(const torch::Tensor& x, int64_t kpad, int64_t gp, int64_t bits, int xshift, bool pairs) {
  const int64_t B = x.size(0), K = x.size(1), block = int64_t(32) << xshift, xb = kpad / block, gcols = kpad / gp;
  const int64_t P = 8 / bits;
  const float* xf = x.data_ptr<float>();
  ActInt8 r{std::vector<int8_t>(B * kpad, 0), std::vector<float>(B * xb), std::vector<float>(B * gp, 0.f),
            std::vector<int32_t>(B * xb)};
#ifdef COMPRESS_AVX512
  r.pair_order = pairs && bits < 8 && kpad % (64 * P) == 0;
#else
  (void)pairs;
#endif
  auto dst = [&](int64_t blk) {  // offset of 32-column block blk within its row of q
    return r.pair_order ? (2 * (blk / (2 * P)) * P + 2 * (blk % P) + (blk / P) % 2) * 32 : blk * 32;
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < xb; ++j) {
      const float* v = xf + b * K + j * block;
      const int64_t n = std::max<int64_t>(0, std::min(block, K - j * block));
      float m = 0.f;
      for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(v[i]));
      const float sc = std::max(m / 127.f, 1e-30f);
      int32_t sum = 0;
      for (int64_t i0 = 0; i0 < n; i0 += 32) {
        int8_t* q = r.q.data() + b * kpad + dst((j * block + i0) / 32);
        for (int64_t i = i0; i < std::min<int64_t>(n, i0 + 32); ++i) {
          q[i - i0] = (int8_t)std::min(127.f, std::max(-127.f, std::nearbyint(v[i] / sc)));
          sum += q[i - i0];
        }
      }
      r.sx[b * xb + j] = sc;
      r.xqsum[b * xb + j] = sum;
      r.xsum[b * gp + j * block / gcols] += (float)sum * sc;
    }
  return r;
}

}  // namespace

// fp32 activations, permuted per chunk (cpu.py::permute_x); xsum (B, Gp) from the unpermuted x.
torch::Tensor matmul_f32(torch::Tensor x, torch::Tensor xsum, torch::Tensor words, torch::Tensor scales,
                         torch::Tensor zeros, int64_t bits, int64_t gshift, bool scalar) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous fp32 (B, Kpad)");
  check_weight(words, scales, zeros, xsum, x.size(1), bits);
  auto y = torch::empty({x.size(0), words.size(0)}, x.options());
  Args a{reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()), x.data_ptr<float>(), nullptr, nullptr,
         scales.data_ptr<at::Half>(), zeros.data_ptr<uint8_t>(), xsum.data_ptr<float>(), y.data_ptr<float>(),
         x.size(0), words.size(0), x.size(1), scales.size(1), words.size(1), 0, (int)gshift, 0};
  dispatch(a, bits, scalar);
  return y;
}

// int8 activations: x fp32 (B, K), K <= Kpad, quantized here per block of 32 << xshift columns (see
// ActInt8); `avx512` false keeps the AVX2 path on machines that have AVX-512 (tests).
torch::Tensor matmul_a8(torch::Tensor x, torch::Tensor words, torch::Tensor scales, torch::Tensor zeros,
                        int64_t bits, int64_t gshift, int64_t xshift, bool scalar, bool avx512) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous fp32 (B, K)");
  const int64_t kpad = words.size(1) * 32 / bits, gp = scales.size(1);
  TORCH_CHECK(x.size(1) <= kpad, "x is wider than the packed weight");
  TORCH_CHECK(xshift <= gshift && kpad % 128 == 0 && kpad % (int64_t(32) << xshift) == 0,
              "x scale blocks must tile the row and not span weight groups");
  const ActInt8 act = quantize_act(x, kpad, gp, bits, (int)xshift, avx512 && !scalar);
  const torch::Tensor xsum = torch::from_blob(const_cast<float*>(act.xsum.data()), {x.size(0), gp}, x.options());
  check_weight(words, scales, zeros, xsum, kpad, bits);
  auto y = torch::empty({x.size(0), words.size(0)}, x.options());
  Args a{reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()), nullptr, act.q.data(), act.sx.data(),
         scales.data_ptr<at::Half>(), zeros.data_ptr<uint8_t>(), act.xsum.data(), y.data_ptr<float>(), x.size(0),
         words.size(0), kpad, gp, words.size(1), kpad / (int64_t(32) << xshift), (int)gshift, (int)xshift};
  a.pair_order = act.pair_order;
  a.xqsum = act.xqsum.data();
  dispatch(a, bits, scalar);
  return y;
}


// cpu-tiles (2-bit codes, kernels/cpu.py::PackedTiles), int8 activations rounded as matmul_a8 does.
torch::Tensor matmul_a8_tiles(torch::Tensor x, torch::Tensor words, torch::Tensor scales, torch::Tensor zeros,
                              int64_t n, int64_t gshift, int64_t xshift, bool scalar) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous fp32 (B, K)");
  check_tiles(words, scales, zeros);
  const int64_t kpad = words.size(1), gp = scales.size(1), T = words.size(0);
  TORCH_CHECK(n > (T - 1) * 16 && n <= T * 16, "n does not match the row tiles");
  TORCH_CHECK(x.size(1) <= kpad, "x is wider than the packed weight");
  TORCH_CHECK(xshift <= gshift && kpad % 128 == 0 && kpad % (int64_t(32) << xshift) == 0 && xshift <= 2,
              "x scale blocks must tile the row and not span weight groups");
  const ActInt8 act = quantize_act(x, kpad, gp, 2, (int)xshift, false);
  const int64_t B = x.size(0);
  std::vector<int16_t> xp(B * kpad);
  at::parallel_for(0, B * (kpad / 2), 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t lo = (uint8_t)act.q[2 * i], hi = (uint8_t)act.q[2 * i + 1];
      std::fill_n(xp.data() + i * 2, 2, (int16_t)(uint16_t)(lo | (uint16_t)hi << 8));
    }
  });
  auto y = torch::empty({B, n}, x.options());
  TileArgs a{reinterpret_cast<const uint8_t*>(words.data_ptr<int32_t>()), xp.data(), act.sx.data(), act.xqsum.data(),
             scales.data_ptr<at::Half>(), zeros.data_ptr<uint8_t>(), y.data_ptr<float>(),
             B, T, n, kpad, gp, kpad / (int64_t(32) << xshift), (int)gshift, (int)xshift};
  parallel_rows(T, [&](int64_t begin, int64_t end) {
#ifdef __AVX2__
    if (!scalar) {
      with_xshift(a.xshift, [&](auto xs) { tiles_a8_all<decltype(xs)::value>(a, begin, end); });
      return;
    }
#endif
    for (int64_t t = begin; t < end; ++t)
      for (int64_t b = 0; b < B; ++b) tile_scalar(a, t, b);
  }, 16);  // 256 rows per grab: the codes a thread streams stay contiguous for 16 x 4 x Kpad bytes
  return y;
}

// ---- Dequantization for prefill-sized inputs (kernels/cpu.py::matmul: many rows of x go to BLAS) ----
// Rows [n0, n0 + R) of a weight, columns [0, K), as fp32 into out (R, K): W = scale * (q - zero), the
// reference's rounding (scales are fp16 values). `accumulate` adds instead (the high plane of 3-bit weights).
// cpu-rows: byte b of chunk c holds, in field s, column 32 * (c * P + s) + b, so a 32-column block is one
// shift and mask of 32 consecutive bytes.
template <int BITS>
void dequant_rows_t(const uint8_t* bytes, const at::Half* scales, const uint8_t* zeros, float* out, int64_t n0,
                    int64_t R, int64_t K, int64_t rowbytes, int64_t Gp, int gshift, bool accumulate) {
  constexpr int P = 8 / BITS;
  constexpr int MASK = (1 << BITS) - 1;
  parallel_rows(R, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = n0 + r;
      const uint8_t* src = bytes + n * rowbytes;
      float* dst = out + r * K;
      for (int64_t blk = 0; blk * 32 < K; ++blk) {
        const uint8_t* cb = src + (blk / P) * 32;
        const int shift = BITS * (int)(blk % P);
        const int64_t g = blk >> gshift;
        const float sc = (float)scales[n * Gp + g];
        const int z = zeros[n * Gp + g];
        const int64_t cols = std::min<int64_t>(32, K - blk * 32);
        float* d = dst + blk * 32;
        if (accumulate) {
          for (int64_t i = 0; i < cols; ++i) d[i] += sc * (float)(((cb[i] >> shift) & MASK) - z);
        } else {
          for (int64_t i = 0; i < cols; ++i) d[i] = sc * (float)(((cb[i] >> shift) & MASK) - z);
        }
      }
    }
  }, 16);
}

void dequant_rows(torch::Tensor words, torch::Tensor scales, torch::Tensor zeros, int64_t bits, int64_t gshift,
                  int64_t n0, torch::Tensor out, bool accumulate) {
  check_rows(words, scales, zeros);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == torch::kFloat && out.is_contiguous(), "out: contiguous fp32");
  const int64_t R = out.size(0), K = out.size(1);
  TORCH_CHECK(n0 >= 0 && n0 + R <= words.size(0) && K <= words.size(1) * 32 / bits, "rows or columns out of range");
  const auto* b = reinterpret_cast<const uint8_t*>(words.data_ptr<int32_t>());
  const int64_t rowbytes = words.size(1) * 4, gp = scales.size(1);
  const at::Half* s = scales.data_ptr<at::Half>();
  const uint8_t* z = zeros.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  switch (bits) {
    case 1: dequant_rows_t<1>(b, s, z, o, n0, R, K, rowbytes, gp, (int)gshift, accumulate); break;
    case 2: dequant_rows_t<2>(b, s, z, o, n0, R, K, rowbytes, gp, (int)gshift, accumulate); break;
    case 4: dequant_rows_t<4>(b, s, z, o, n0, R, K, rowbytes, gp, (int)gshift, accumulate); break;
    case 8: dequant_rows_t<8>(b, s, z, o, n0, R, K, rowbytes, gp, (int)gshift, accumulate); break;
    default: TORCH_CHECK(false, "dequant_rows supports bits 1, 2, 4, 8; got ", bits);
  }
}

// cpu-tiles (2 bits): row n = 16 t + r, column k = 8 o + 2 f + j is field f of byte 2 r + j of vector (t, o);
// scales / zeros (T, Gp, 16).
void dequant_tiles(torch::Tensor words, torch::Tensor scales, torch::Tensor zeros, int64_t gshift, int64_t n0,
                   torch::Tensor out) {
  check_tiles(words, scales, zeros);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == torch::kFloat && out.is_contiguous(), "out: contiguous fp32");
  const int64_t R = out.size(0), K = out.size(1), kpad = words.size(1), gp = scales.size(1);
  TORCH_CHECK(n0 >= 0 && n0 + R <= words.size(0) * 16 && K <= kpad, "rows or columns out of range");
  const auto* bytes = reinterpret_cast<const uint8_t*>(words.data_ptr<int32_t>());
  const at::Half* s = scales.data_ptr<at::Half>();
  const uint8_t* z = zeros.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  parallel_rows(R, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = n0 + i, t = n / 16, r = n % 16;
      const uint8_t* tile = bytes + t * kpad * 4 + 2 * r;
      float* d = o + i * K;
      for (int64_t k0 = 0; k0 < K; k0 += 32) {
        const int64_t g = (k0 / 32) >> gshift;
        const float sc = (float)s[(t * gp + g) * 16 + r];
        const int zp = z[(t * gp + g) * 16 + r];
        for (int64_t k = k0; k < std::min(K, k0 + 32); ++k) {
          const int code = (tile[(k >> 3) * 32 + (k & 1)] >> (2 * ((k >> 1) & 3))) & 3;
          d[k] = sc * (float)(code - zp);
        }
      }
    }
  }, 16);
}

bool has_avx512() {
#ifdef COMPRESS_AVX512
  return true;
#else
  return false;
#endif
}

// The int8-activation path prefers 2-bit weights in cpu-tiles wherever its AVX2 code runs. Measured on an
// AVX-512 VNNI machine too: from memory (8192x8192, 2 threads) it beat the AVX-512 cpu-rows path at batch
// 1, 8 and 32, though that path does less arithmetic in cache. AVX-VNNI-only CPUs were not measured.
bool prefers_tiles() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

bool has_avx2() {
#ifdef __AVX2__
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("matmul_f32", &matmul_f32, "packed-integer matmul, fp32 activations (see kernels/cpu.py)");
  m.def("matmul_a8", &matmul_a8, "packed-integer matmul, int8 activations (see kernels/cpu.py)");
  m.def("matmul_a8_tiles", &matmul_a8_tiles, "2-bit cpu-tiles matmul, int8 activations (see kernels/cpu.py)");
  m.def("dequant_rows", &dequant_rows, "cpu-rows rows -> fp32 (prefill-sized inputs, see kernels/cpu.py)");
  m.def("dequant_tiles", &dequant_tiles, "cpu-tiles rows -> fp32 (prefill-sized inputs, see kernels/cpu.py)");
  m.def("has_avx2", &has_avx2);
  m.def("prefers_tiles", &prefers_tiles);
  m.def("has_avx512", &has_avx512);
}
