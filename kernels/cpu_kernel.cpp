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
//   scales fp32 (N, Gp), sz = scale*zero fp32 (N, Gp), xsum fp32 (B, Gp): per-group sums of x.
//   y = sum_g scale_g * dot(q_g, x_g) - sum_g sz_g * xsum_g
// The AVX2/FMA path runs when compiled with AVX2 and `scalar` is false; the scalar path is the fallback.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

struct Args {
  const uint32_t* words; const float* x; const int8_t* xq; const float* sx;
  const float* scales; const float* sz; const float* xsum; float* y;
  int64_t B, N, Kpad, Gp, W, Xb;  // Xb: x scale blocks per row (int8 path)
  int gshift;  // group of 32-column block `blk` is blk >> gshift
  int xshift;  // x scale block of `blk` is blk >> xshift (int8 path)
};

float zero_correction(const Args& a, int64_t n, int64_t b) {
  const float* sz = a.sz + n * a.Gp;
  const float* xs = a.xsum + b * a.Gp;
  float c = 0.f;
  for (int64_t g = 0; g < a.Gp; ++g) c += sz[g] * xs[g];
  return c;
}

template <int BITS>
void row_scalar(const Args& a, int64_t n) {
  constexpr int P = 8 / BITS;
  constexpr uint32_t M = (1u << BITS) - 1;
  const uint32_t* row = a.words + n * a.W;
  const float* s = a.scales + n * a.Gp;
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
        acc += s[blk >> a.gshift] * xs * part;
      }
    a.y[b * a.N + n] = acc - zero_correction(a, n, b);
  }
}

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// fp32 activations: one row n, batch rows b0..b0+BT; x is permuted so field j, lane i is at chunk*32P + 8j + i.
template <int BITS, int BT>
void row_f32(const Args& a, int64_t n, int64_t b0) {
  constexpr int P = 8 / BITS, F = 4 * P;
  constexpr int NA = BT >= 4 ? 1 : 4 / BT;  // independent accumulators per batch row (hide FMA latency)
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  const uint32_t* row = a.words + n * a.W;
  const float* s = a.scales + n * a.Gp;
  const float* x = a.x + b0 * a.Kpad;
  const int64_t chunks = a.Kpad / (32 * P), gmask = (int64_t(1) << a.gshift) - 1;
  __m256 racc[BT], ga[BT][NA];
  for (int b = 0; b < BT; ++b) {
    racc[b] = _mm256_setzero_ps();
    for (int u = 0; u < NA; ++u) ga[b][u] = _mm256_setzero_ps();
  }
  auto flush = [&](int64_t blk) {
    const __m256 sc = _mm256_set1_ps(s[blk >> a.gshift]);
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
      _mm_prefetch(reinterpret_cast<const char*>(row + 256), _MM_HINT_T0);
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
          const float sw = a.scales[(n + r) * a.Gp + (blk >> a.gshift)];
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

// Rows [n, end) for int8 activations: batch tiles of 4, 2, 1, each with 4/BT rows at a time.
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
  if (b < a.B) tile(std::integral_constant<int, 1>{}, b);
}

template <int BITS>
void rows_f32_all(const Args& a, int64_t n) {
  auto tile = [&](auto bt, int64_t b) { row_f32<BITS, decltype(bt)::value>(a, n, b); };
  int64_t b = 0;
  for (; b + 4 <= a.B; b += 4) tile(std::integral_constant<int, 4>{}, b);
  if (b + 2 <= a.B) { tile(std::integral_constant<int, 2>{}, b); b += 2; }
  if (b < a.B) tile(std::integral_constant<int, 1>{}, b);
}
#endif

// Rows are handed out in chunks of 64 from a shared counter, so a thread the OS parks (the cores are
// shared) delays only its current chunk instead of a fixed half of the matrix.
template <class Fn>
void parallel_rows(int64_t N, Fn&& fn) {
  constexpr int64_t chunk = 64;
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

void check_weight(const torch::Tensor& words, const torch::Tensor& scales, const torch::Tensor& sz,
                  const torch::Tensor& xsum, int64_t kpad, int64_t bits) {
  TORCH_CHECK(words.scalar_type() == torch::kInt && words.is_contiguous(), "words: contiguous int32");
  for (const auto* t : {&scales, &sz, &xsum})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous(), "scales, sz, xsum: contiguous fp32");
  TORCH_CHECK(words.size(1) * 32 == kpad * bits, "x width does not match the packed weight");
  TORCH_CHECK(scales.size(1) == xsum.size(1), "xsum needs one column per group");
}

}  // namespace

// fp32 activations, permuted per chunk (cpu.py::permute_x); xsum (B, Gp) from the unpermuted x.
torch::Tensor matmul_f32(torch::Tensor x, torch::Tensor xsum, torch::Tensor words, torch::Tensor scales,
                         torch::Tensor sz, int64_t bits, int64_t gshift, bool scalar) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous fp32 (B, Kpad)");
  check_weight(words, scales, sz, xsum, x.size(1), bits);
  auto y = torch::empty({x.size(0), words.size(0)}, x.options());
  Args a{reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()), x.data_ptr<float>(), nullptr, nullptr,
         scales.data_ptr<float>(), sz.data_ptr<float>(), xsum.data_ptr<float>(), y.data_ptr<float>(),
         x.size(0), words.size(0), x.size(1), scales.size(1), words.size(1), 0, (int)gshift, 0};
  dispatch(a, bits, scalar);
  return y;
}

// int8 activations xq (B, Kpad) in natural column order with scales sx (B, Xb), one per 32 << xshift columns.
torch::Tensor matmul_a8(torch::Tensor xq, torch::Tensor sx, torch::Tensor xsum, torch::Tensor words,
                        torch::Tensor scales, torch::Tensor sz, int64_t bits, int64_t gshift, int64_t xshift,
                        bool scalar) {
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == torch::kChar && xq.is_contiguous(), "xq: contiguous int8");
  TORCH_CHECK(sx.scalar_type() == torch::kFloat && sx.is_contiguous(), "sx: contiguous fp32");
  TORCH_CHECK(xshift <= gshift && xq.size(1) % 128 == 0 && xq.size(1) % (int64_t(32) << xshift) == 0 &&
                  sx.size(1) == xq.size(1) / (32 << xshift),
              "x scale blocks must tile the row and not span weight groups");
  check_weight(words, scales, sz, xsum, xq.size(1), bits);
  auto y = torch::empty({xq.size(0), words.size(0)}, sx.options());
  Args a{reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()), nullptr, xq.data_ptr<int8_t>(),
         sx.data_ptr<float>(), scales.data_ptr<float>(), sz.data_ptr<float>(), xsum.data_ptr<float>(),
         y.data_ptr<float>(), xq.size(0), words.size(0), xq.size(1), scales.size(1), words.size(1), sx.size(1),
         (int)gshift, (int)xshift};
  dispatch(a, bits, scalar);
  return y;
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
  m.def("has_avx2", &has_avx2);
}
