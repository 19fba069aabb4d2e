// The decode attention's body for one (row, KV head) with AVX2 and FMA, D % 8 == 0; compiled
// with -mavx2 -mfma and chosen at run time (decode_attention.cc). The portable body's steps,
// shaped for the vector units: scores four keys at a time (four independent FMA chains, the
// key rows kept in L1 across the G heads), the softmax eight scores at a time with a
// polynomial exp, and p·V in blocks of keys with each head's accumulators in registers; K and
// the next block of V prefetched ahead of their reads.
// No standard-library templates here: their out-of-line copies, compiled for AVX2, could be
// the ones the linker keeps for the baseline code.
#include <immintrin.h>

#include "decode_attention.h"

namespace lrjax_cpu {
namespace {

// The four dot products held lane-wise in c0..c3, as [s0, s1, s2, s3].
inline __m128 Sum4(__m256 c0, __m256 c1, __m256 c2, __m256 c3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(c0, c1), _mm256_hadd_ps(c2, c3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

inline float Sum1(__m256 c) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline float Max1(__m256 c) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// exp(x0) for x0 <= 0 as Cephes' expf (2^k · p(r), r = x - k ln 2, about 1 ulp); 0 below
// ln(FLT_MIN), as under XLA's flush-to-zero; a NaN stays NaN (max_ps returns its second
// operand when one is NaN).
inline __m256 Exp(__m256 x0) {
  const __m256 lo = _mm256_set1_ps(-87.3365447505f);
  const __m256 x = _mm256_max_ps(lo, x0);
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  // 2^k for k in [-126, 0]: the exponent field k + 127 (a NaN's k converts to INT_MIN: its
  // scale is garbage, but y is NaN and so is the product)
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  const __m256 out = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(_mm256_cmp_ps(x0, lo, _CMP_LT_OQ), out);  // x0 < lo: 0
}

// Key rows prefetched this far ahead of the scores (for caches past the L3, where the
// hardware prefetchers alone fall behind).
constexpr int64_t kKeyAhead = 16;

// Scores of the G heads against keys [0, n): each four-key group's rows stay in L1 while
// every head reads them.
void Scores(const float* qh, const float* kh, int64_t G, int64_t D, int64_t n, float* scores) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const float *k0 = kh + t * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
    if (t + kKeyAhead + 4 <= n)  // the key rows kKeyAhead on, a 64-byte line at a time
      for (int64_t off = kKeyAhead * D; off < (kKeyAhead + 4) * D; off += 16)
        _mm_prefetch(reinterpret_cast<const char*>(k0 + off), _MM_HINT_T0);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qh + g * D;
      __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + d);
        c0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), c0);
        c1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), c1);
        c2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), c2);
        c3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), c3);
      }
      _mm_storeu_ps(scores + g * n + t, Sum4(c0, c1, c2, c3));
    }
  }
  for (; t < n; ++t)
    for (int64_t g = 0; g < G; ++g) {
      __m256 c = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8)
        c = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * D + d), _mm256_loadu_ps(kh + t * D + d), c);
      scores[g * n + t] = Sum1(c);
    }
}

// s[t] = softmax(s / root)[t] over t < n; the scalar tail as the vector lanes compute it.
void Softmax(float* s, int64_t n, float root) {
  const __m256 rv = _mm256_set1_ps(root);
  __m256 mv = _mm256_set1_ps(-__builtin_inff());
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 x = _mm256_div_ps(_mm256_loadu_ps(s + t), rv);
    _mm256_storeu_ps(s + t, x);
    mv = _mm256_max_ps(x, mv);  // a NaN score never wins, as in the portable body
  }
  float m = Max1(mv);
  for (; t < n; ++t) {
    s[t] /= root;
    m = s[t] > m ? s[t] : m;
  }
  const __m256 m8 = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (t = 0; t + 8 <= n; t += 8) {
    const __m256 e = Exp(_mm256_sub_ps(_mm256_loadu_ps(s + t), m8));
    _mm256_storeu_ps(s + t, e);
    sv = _mm256_add_ps(sv, e);
  }
  if (t < n) {  // the last n - t scores, padded with -inf (exp: 0)
    float tail[8];
    for (int j = 0; j < 8; ++j) tail[j] = t + j < n ? s[t + j] - m : -__builtin_inff();
    const __m256 e = Exp(_mm256_loadu_ps(tail));
    _mm256_storeu_ps(tail, e);
    sv = _mm256_add_ps(sv, e);
    for (int64_t j = 0; t + j < n; ++j) s[t + j] = tail[j];
  }
  const __m256 sum = _mm256_set1_ps(Sum1(sv));
  for (t = 0; t + 8 <= n; t += 8) _mm256_storeu_ps(s + t, _mm256_div_ps(_mm256_loadu_ps(s + t), sum));
  for (; t < n; ++t) s[t] /= _mm256_cvtss_f32(sum);
}

// acc[0 : 8C] += sum over t in [t0, t1) of w[t] * v[t * D + 0 : 8C], in C registers.
template <int C>
void Accumulate(const float* w, const float* v, int64_t D, int64_t t0, int64_t t1, float* acc) {
  __m256 a[C];
  for (int c = 0; c < C; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t t = t0; t < t1; ++t) {
    const __m256 wt = _mm256_broadcast_ss(w + t);
    for (int c = 0; c < C; ++c) a[c] = _mm256_fmadd_ps(wt, _mm256_loadu_ps(v + t * D + 8 * c), a[c]);
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}

constexpr int64_t kKeyBlock = 64;  // value rows kept in L1 while every head reads them

}  // namespace

void AttendHeadAvx2(const AttendArgs& a, int64_t b, int64_t h, float* scratch) {
  const Head x = HeadOf(a, b, h, scratch);
  const int64_t G = x.G, D = a.D, n = x.n;
  if (x.none) {
    for (int64_t i = 0; i < G * n; ++i) x.scores[i] = 0.f;
  } else {
    Scores(x.q, x.k, G, D, n, x.scores);
  }
  for (int64_t g = 0; g < G; ++g) Softmax(x.scores + g * n, n, a.root);
  for (int64_t i = 0; i < G * D; ++i) x.acc[i] = 0.f;
  for (int64_t t0 = 0; t0 < n; t0 += kKeyBlock) {
    const int64_t t1 = t0 + kKeyBlock < n ? t0 + kKeyBlock : n;
    if (t1 < n) {  // the next block's value rows, while the heads read this one
      const int64_t e = (t1 + kKeyBlock < n ? t1 + kKeyBlock : n) * D;
      for (int64_t off = t1 * D; off < e; off += 16)
        _mm_prefetch(reinterpret_cast<const char*>(x.v + off), _MM_HINT_T0);
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; d += 32) {
        const float* w = x.scores + g * n;
        float* ag = x.acc + g * D + d;
        switch (D - d >= 32 ? 4 : (D - d) / 8) {
          case 4: Accumulate<4>(w, x.v + d, D, t0, t1, ag); break;
          case 3: Accumulate<3>(w, x.v + d, D, t0, t1, ag); break;
          case 2: Accumulate<2>(w, x.v + d, D, t0, t1, ag); break;
          default: Accumulate<1>(w, x.v + d, D, t0, t1, ag); break;
        }
      }
  }
  for (int64_t i = 0; i < G * D; ++i) x.out[i] = x.acc[i];
}

}  // namespace lrjax_cpu
