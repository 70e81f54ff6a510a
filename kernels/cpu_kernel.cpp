// Packed-integer GEMM for CPU: y[b, n] = sum_k x[b, k] * scale[n, g(k)] * (q[n, k] - zero[n, g(k)]).
//
// Layout ("cpu-rows", built by kernels/cpu.py::pack; see its docstring for the picture):
//   words  int32 (N, Kpad*BITS/32)  per row, chunks of 8 words = 8*F codes (F = 32/BITS fields per word);
//                                    word i, field j of chunk c holds k = c*8*F + j*8 + i, so one shift+mask of
//                                    the 8-word vector yields 8 consecutive k: one AVX2 register, no shuffles.
//   scales fp32  (N, Gp)   scale per (row, group), zero for padded groups
//   sz     fp32  (N, Gp)   scale * zero, so y = sum_g scale_g * (q . x)_g - sum_g sz_g * xsum[b, g]
//   x      fp32  (B, Kpad) zero padded;  xsum fp32 (B, Gp): per-group sums of x
// Group g(k) = (k / 8) >> gshift (gshift = log2(group / 8); a large value for per-channel).
// The AVX2/FMA path is used when compiled with AVX2 and `scalar` is false; the scalar path is the fallback.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

struct Args {
  const uint32_t* words; const float* x; const float* scales; const float* sz; const float* xsum; float* y;
  int64_t B, N, Kpad, Gp, W; int gshift;
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
  constexpr int F = 32 / BITS;
  constexpr uint32_t M = (1u << BITS) - 1;
  const uint32_t* row = a.words + n * a.W;
  const float* s = a.scales + n * a.Gp;
  const int64_t steps = a.Kpad / 8;
  for (int64_t b = 0; b < a.B; ++b) {
    const float* x = a.x + b * a.Kpad;
    float acc = 0.f, gacc = 0.f;
    int64_t cur = 0;
    for (int64_t t = 0; t < steps; ++t) {
      const int64_t g = t >> a.gshift;
      if (g != cur) { acc += s[cur] * gacc; gacc = 0.f; cur = g; }
      const uint32_t* w = row + (t / F) * 8;
      const int sh = (int)(t % F) * BITS;
      for (int i = 0; i < 8; ++i) gacc += (float)((w[i] >> sh) & M) * x[t * 8 + i];
    }
    acc += s[cur] * gacc;
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

// One row n, batch rows b0..b0+BT. SUB groups per 8-word chunk (1 when a group spans whole chunks).
template <int BITS, int BT, int SUB>
void row_avx2(const Args& a, int64_t n, int64_t b0) {
  constexpr int F = 32 / BITS, FS = F / SUB;
  constexpr int NA = BT >= 4 ? 1 : 4 / BT;  // independent accumulators per batch row (hides FMA latency)
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  const uint32_t* row = a.words + n * a.W;
  const float* s = a.scales + n * a.Gp;
  const float* x = a.x + b0 * a.Kpad;
  const int64_t chunks = a.Kpad / (8 * F);
  __m256 racc[BT];
  for (int b = 0; b < BT; ++b) racc[b] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 8));
    _mm_prefetch(reinterpret_cast<const char*>(row + c * 8 + 64), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int sub = 0; sub < SUB; ++sub) {
      __m256 ga[BT][NA];
      for (int b = 0; b < BT; ++b)
        for (int u = 0; u < NA; ++u) ga[b][u] = _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int jj = 0; jj < FS; ++jj) {
        const int j = sub * FS + jj;
        __m256i q = j == 0 ? v : _mm256_srli_epi32(v, j * BITS);
        if (j != F - 1) q = _mm256_and_si256(q, mask);
        const __m256 w = _mm256_cvtepi32_ps(q);
        const float* xp = x + (c * F + j) * 8;
        for (int b = 0; b < BT; ++b)
          ga[b][jj % NA] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xp + b * a.Kpad), ga[b][jj % NA]);
      }
      const __m256 sc = _mm256_set1_ps(s[(c * F + sub * FS) >> a.gshift]);
      for (int b = 0; b < BT; ++b) {
        __m256 t = ga[b][0];
        for (int u = 1; u < NA; ++u) t = _mm256_add_ps(t, ga[b][u]);
        racc[b] = _mm256_fmadd_ps(t, sc, racc[b]);
      }
    }
  }
  for (int b = 0; b < BT; ++b) a.y[(b0 + b) * a.N + n] = hsum(racc[b]) - zero_correction(a, n, b0 + b);
}

template <int BITS, int SUB>
void row_avx2_all(const Args& a, int64_t n) {
  int64_t b = 0;
  for (; b + 4 <= a.B; b += 4) row_avx2<BITS, 4, SUB>(a, n, b);
  if (b + 2 <= a.B) { row_avx2<BITS, 2, SUB>(a, n, b); b += 2; }
  if (b < a.B) row_avx2<BITS, 1, SUB>(a, n, b);
}

template <int BITS>
void row_avx2_dispatch(const Args& a, int64_t n, int sub) {
  if constexpr (BITS == 8) { row_avx2_all<BITS, 1>(a, n); return; }
  switch (sub) {
    case 1: row_avx2_all<BITS, 1>(a, n); break;
    case 2: row_avx2_all<BITS, 2>(a, n); break;
    default:
      if constexpr (BITS == 2) row_avx2_all<BITS, 4>(a, n);
      else TORCH_CHECK(false, "unsupported groups per chunk: ", sub);
  }
}
#endif

template <int BITS>
void run(const Args& a, bool scalar) {
  constexpr int F = 32 / BITS;
  const int64_t gsteps = a.gshift >= 40 ? (int64_t(1) << 40) : (int64_t(1) << a.gshift);
  const int sub = gsteps >= F ? 1 : int(F / gsteps);
  TORCH_CHECK(sub <= 4, "group too small for the cpu kernel: at least 32 columns per group");
  at::parallel_for(0, a.N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
#ifdef __AVX2__
      if (!scalar) { row_avx2_dispatch<BITS>(a, n, sub); continue; }
#endif
      row_scalar<BITS>(a, n);
    }
  });
}

}  // namespace

torch::Tensor matmul(torch::Tensor x, torch::Tensor words, torch::Tensor scales, torch::Tensor sz, int64_t bits,
                     int64_t gshift, bool scalar) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous fp32 (B, Kpad)");
  TORCH_CHECK(words.scalar_type() == torch::kInt && words.is_contiguous(), "words: contiguous int32");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && sz.scalar_type() == torch::kFloat && scales.is_contiguous() &&
              sz.is_contiguous(), "scales, sz: contiguous fp32 (N, Gp)");
  const int64_t B = x.size(0), Kpad = x.size(1), N = words.size(0), Gp = scales.size(1);
  TORCH_CHECK(words.size(1) * 32 == Kpad * bits, "x width does not match the packed weight");
  auto xsum = x.view({B, Gp, Kpad / Gp}).sum(2).contiguous();
  auto y = torch::empty({B, N}, x.options());
  Args a{reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()), x.data_ptr<float>(),
         scales.data_ptr<float>(), sz.data_ptr<float>(), xsum.data_ptr<float>(),
         y.data_ptr<float>(), B, N, Kpad, Gp, words.size(1), (int)gshift};
  switch (bits) {
    case 2: run<2>(a, scalar); break;
    case 4: run<4>(a, scalar); break;
    case 8: run<8>(a, scalar); break;
    default: TORCH_CHECK(false, "cpu kernel supports bits 2, 4, 8; got ", bits);
  }
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
  m.def("matmul", &matmul, "packed-integer matmul (see kernels/cpu.py)");
  m.def("has_avx2", &has_avx2);
}
