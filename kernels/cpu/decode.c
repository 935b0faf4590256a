/* hisparse CPU decode kernels: one token through a Llama-family decoder layer, in float32
 * arithmetic over weights kept in their checkpoint's 16-bit format (or float32).
 *
 * Built at run time by kernels/cpu_native.py (the C compiler of the machine, -O3
 * -march=native, OpenMP) and called through ctypes; the torch reference of every function
 * is in kernels/cpu_native.py and tests/test_cpu_native.py compares them.
 *
 * Weights: a linear [out, in] is stored tiled, [ceil(out/8)][in/16][8][16]: each group of 8
 * output rows is one contiguous run of memory that the product reads front to back (one
 * sequential stream per thread; the hardware prefetcher keeps up), rows past `out` are zero.
 * Element types: W_F32, W_F16 (IEEE half), W_BF16. A checkpoint stored in float16 or bfloat16
 * loses nothing in its own 16-bit format: the products are the float32 products of the
 * checkpoint's values, accumulated in float32 (only the summation order differs from a
 * float32 GEMV), and read half the bytes.
 *
 * Two more formats hold a checkpoint that came from a GGUF Q4_1 / Q8_0 file without loss:
 * W_Q4: per row and group of 32 inputs an fp16 scale d and offset m and 4-bit q, the weight
 * being the float16 rounding of d*q + m (float32 multiply, then add): exactly how the GGUF
 * dequantization and the float16 conversion made the checkpoint's values; W_Q8: an fp16 d
 * and an int8 q, the weight fp16(d*q). hs_pack_q4 / hs_pack_q8 find d, m and q from the
 * float32 weights and verify every value (any group that does not reproduce exactly: the
 * tensor keeps a 16-bit format). Tile step (8 rows x 32 inputs): W_Q4 [8][16 bytes: byte b
 * holds input b in its low and b+16 in its high nibble] [8] d [8] m; W_Q8 [8][32] q [8] d.
 *
 * Versions of the one-row product (the hot loop): AVX-512F (+F16C), AVX2 + FMA + F16C, and
 * portable C (any other CPU). The rest is portable C that the compiler vectorizes.
 * Compiled with -ffp-contract=off: RoPE, RMSNorm and the residual adds round like the torch
 * reference's separate operations; the products use explicit fused multiply-adds.
 *
 * Threads: OpenMP regions of `nth` threads (the caller's thread count; small products run on
 * one thread).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>
#define HS_ISA 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HS_ISA 1
#else
#define HS_ISA 0
#endif

enum { W_F32 = 0, W_F16 = 1, W_BF16 = 2, W_Q4 = 3, W_Q8 = 4 };
#define QG 32                        /* inputs per quantization group (W_Q4, W_Q8) */
#define Q4_STEP (TR * (QG / 2 + 4))  /* bytes per 8-row tile step of 32 inputs: 160 */
#define Q8_STEP (TR * (QG + 2))      /* 272 */
#define TR 8             /* output rows per tile */
#define TK 16            /* inputs per tile step */
#define TILE (TR * TK)   /* elements per tile step */
#define SMALL (1L << 16) /* products of fewer weights run on one thread */
#define CH 256           /* keys per attention work unit */

int hs_isa(void) { return HS_ISA; }

int hs_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* ---- scalar conversions (portable path, and tails) --------------------------------------- */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal half: normalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            u = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | man << 13;
    } else {
        u = sign | (exp + 127 - 15) << 23 | man << 13;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_f16(float f) { /* round to nearest even, like vcvtps2ph */
#if HS_ISA >= 1
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000;
    int32_t exp = (int32_t)((u >> 23) & 0xff) - 127 + 15;
    uint32_t man = u & 0x7fffff;
    if (((u >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) { /* subnormal half (or zero) */
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000;
        int shift = 14 - exp;
        uint32_t h = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = (uint32_t)exp << 10 | man >> 13, rem = man & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
#endif
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- the tile product: 8 rows of a tiled weight against x[in] ---------------------------- */
static void tile_dot(const void *w, int wt, const float *x, long steps, float out[TR]) {
#if HS_ISA == 2
    __m512 a[TR];
    for (int j = 0; j < TR; j++) a[j] = _mm512_setzero_ps();
    if (wt == W_F32) {
        const float *p = (const float *)w;
        for (long k = 0; k < steps; k++, p += TILE) {
            __m512 xv = _mm512_loadu_ps(x + TK * k);
            _mm_prefetch((const char *)(p + 4 * TILE), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + 4 * TILE + 64), _MM_HINT_T0);
            for (int j = 0; j < TR; j++) a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(p + TK * j), xv, a[j]);
        }
    } else {
        const uint16_t *p = (const uint16_t *)w;
        for (long k = 0; k < steps; k++, p += TILE) {
            __m512 xv = _mm512_loadu_ps(x + TK * k);
            _mm_prefetch((const char *)(p + 8 * TILE), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + 8 * TILE + 64), _MM_HINT_T0);
            for (int j = 0; j < TR; j++) {
                __m256i h = _mm256_loadu_si256((const __m256i *)(p + TK * j));
                __m512 wf = wt == W_F16 ? _mm512_cvtph_ps(h)
                    : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                a[j] = _mm512_fmadd_ps(wf, xv, a[j]);
            }
        }
    }
    for (int j = 0; j < TR; j++) out[j] = _mm512_reduce_add_ps(a[j]);
#elif HS_ISA == 1
    __m256 a[TR];
    for (int j = 0; j < TR; j++) a[j] = _mm256_setzero_ps();
    for (long k = 0; k < steps; k++) {
        __m256 x0 = _mm256_loadu_ps(x + TK * k), x1 = _mm256_loadu_ps(x + TK * k + 8);
        for (int j = 0; j < TR; j++) {
            __m256 w0, w1;
            if (wt == W_F32) {
                const float *p = (const float *)w + TILE * k + TK * j;
                w0 = _mm256_loadu_ps(p);
                w1 = _mm256_loadu_ps(p + 8);
            } else {
                const uint16_t *p = (const uint16_t *)w + TILE * k + TK * j;
                __m128i h0 = _mm_loadu_si128((const __m128i *)p), h1 = _mm_loadu_si128((const __m128i *)(p + 8));
                if (wt == W_F16) {
                    w0 = _mm256_cvtph_ps(h0);
                    w1 = _mm256_cvtph_ps(h1);
                } else {
                    w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h0), 16));
                    w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h1), 16));
                }
            }
            a[j] = _mm256_fmadd_ps(w0, x0, a[j]);
            a[j] = _mm256_fmadd_ps(w1, x1, a[j]);
        }
    }
    for (int j = 0; j < TR; j++) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(a[j]), _mm256_extractf128_ps(a[j], 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        out[j] = _mm_cvtss_f32(s);
    }
#else
    float a[TR][TK];
    memset(a, 0, sizeof a);
    for (long k = 0; k < steps; k++) {
        const float *xv = x + TK * k;
        for (int j = 0; j < TR; j++)
            for (int l = 0; l < TK; l++) {
                long i = TILE * k + TK * j + l;
                float wf = wt == W_F32 ? ((const float *)w)[i]
                    : wt == W_F16 ? f16_to_f32(((const uint16_t *)w)[i])
                                  : bf16_to_f32(((const uint16_t *)w)[i]);
                a[j][l] = fmaf(wf, xv[l], a[j][l]);
            }
    }
    for (int j = 0; j < TR; j++) {
        float s = 0.f;
        for (int l = 0; l < TK; l++) s += a[j][l];
        out[j] = s;
    }
#endif
}

/* the 8 rows of a W_Q4 / W_Q8 tile group against x[in] (steps = in / 32) */
static void tile_dot_q(const uint8_t *w, int wt, const float *x, long steps, float out[TR]) {
#if HS_ISA == 2
    __m512 a[TR];
    for (int j = 0; j < TR; j++) a[j] = _mm512_setzero_ps();
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i low = _mm512_set1_epi32(15);
    for (long k = 0; k < steps; k++) {
        __m512 x0 = _mm512_loadu_ps(x + QG * k), x1 = _mm512_loadu_ps(x + QG * k + 16);
        if (wt == W_Q4) {
            const uint8_t *p = w + k * Q4_STEP;
            const uint16_t *dv = (const uint16_t *)(p + TR * 16), *mv = dv + TR;
            _mm_prefetch((const char *)(p + 4 * Q4_STEP), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + 4 * Q4_STEP + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + 4 * Q4_STEP + 128), _MM_HINT_T0);
            for (int j = 0; j < TR; j++) {
                __m512 d = _mm512_set1_ps(f16_to_f32(dv[j])), m = _mm512_set1_ps(f16_to_f32(mv[j]));
                __m512 lut = _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_add_ps(_mm512_mul_ps(d, iota), m),
                                                             _MM_FROUND_TO_NEAREST_INT));
                __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * j)));
                a[j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_and_si512(q, low), lut), x0, a[j]);
                a[j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut), x1, a[j]);
            }
        } else {
            const uint8_t *p = w + k * Q8_STEP;
            const uint16_t *dv = (const uint16_t *)(p + TR * QG);
            _mm_prefetch((const char *)(p + 4 * Q8_STEP), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + 4 * Q8_STEP + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + 4 * Q8_STEP + 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + 4 * Q8_STEP + 192), _MM_HINT_T0);
            for (int j = 0; j < TR; j++) {
                __m512 d = _mm512_set1_ps(f16_to_f32(dv[j]));
                const int8_t *q = (const int8_t *)(p + QG * j);
                __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
                __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
                __m512 w0 = _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_mul_ps(d, q0), _MM_FROUND_TO_NEAREST_INT));
                __m512 w1 = _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_mul_ps(d, q1), _MM_FROUND_TO_NEAREST_INT));
                a[j] = _mm512_fmadd_ps(w0, x0, a[j]);
                a[j] = _mm512_fmadd_ps(w1, x1, a[j]);
            }
        }
    }
    for (int j = 0; j < TR; j++) out[j] = _mm512_reduce_add_ps(a[j]);
#else
    for (int j = 0; j < TR; j++) out[j] = 0.f;
    float acc[TR][QG];
    memset(acc, 0, sizeof acc);
    for (long k = 0; k < steps; k++) {
        const float *xv = x + QG * k;
        for (int j = 0; j < TR; j++) {
            float wv[QG];
            if (wt == W_Q4) {
                const uint8_t *p = w + k * Q4_STEP;
                const uint16_t *dv = (const uint16_t *)(p + TR * 16), *mv = dv + TR;
                float d = f16_to_f32(dv[j]), m = f16_to_f32(mv[j]);
                for (int b = 0; b < 16; b++) {
                    uint8_t byte = p[16 * j + b];
                    wv[b] = f16_to_f32(f32_to_f16(d * (float)(byte & 15) + m));
                    wv[b + 16] = f16_to_f32(f32_to_f16(d * (float)(byte >> 4) + m));
                }
            } else {
                const uint8_t *p = w + k * Q8_STEP;
                float d = f16_to_f32(((const uint16_t *)(p + TR * QG))[j]);
                for (int b = 0; b < QG; b++)
                    wv[b] = f16_to_f32(f32_to_f16(d * (float)((const int8_t *)p)[QG * j + b]));
            }
            for (int b = 0; b < QG; b++) acc[j][b] = fmaf(wv[b], xv[b], acc[j][b]);
        }
    }
    for (int j = 0; j < TR; j++) {
        float s = 0.f;
        for (int b = 0; b < QG; b++) s += acc[j][b];
        out[j] = s;
    }
#endif
}

/* bytes of one 8-row tile group of a [?, in] weight in format wt */
static inline size_t group_bytes(int wt, long in) {
    if (wt == W_Q4) return (size_t)(in / QG) * Q4_STEP;
    if (wt == W_Q8) return (size_t)(in / QG) * Q8_STEP;
    return (size_t)(in / TK) * TILE * (wt == W_F32 ? 4 : 2);
}

long hs_weight_bytes(int wt, long out, long in) { return (long)group_bytes(wt, in) * ((out + TR - 1) / TR); }

/* y[out] = W x (+ bias); x holds `in` floats (in a multiple of 16; of 32 for W_Q4/W_Q8). */
void hs_linear(const void *w, int wt, const float *bias, const float *x, float *y, long out,
               long in, int nth) {
    long groups = (out + TR - 1) / TR;
    size_t gbytes = group_bytes(wt, in);
    int quant = wt == W_Q4 || wt == W_Q8;
    if (out * in < SMALL) nth = 1;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (long g = 0; g < groups; g++) {
        float o[TR];
        if (quant)
            tile_dot_q((const uint8_t *)w + g * gbytes, wt, x, in / QG, o);
        else
            tile_dot((const char *)w + g * gbytes, wt, x, in / TK, o);
        for (int j = 0; j < TR; j++) {
            long r = g * TR + j;
            if (r < out) y[r] = bias ? o[j] + bias[r] : o[j];
        }
    }
}

/* y = weight * (x * rsqrt(mean(x^2) + eps)), the reference's order of operations. */
void hs_rms_norm(const float *x, const float *weight, float eps, float *y, long n) {
    float acc[16] = {0};
    long i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += x[i + l] * x[i + l];
    float s = 0.f;
    for (int l = 0; l < 16; l++) s += acc[l];
    for (; i < n; i++) s += x[i] * x[i];
    float r = 1.0f / sqrtf(s / (float)n + eps);
    for (i = 0; i < n; i++) y[i] = weight[i] * (x[i] * r);
}

/* Rotate-half RoPE of `heads` heads of x [heads, d] in place (cos, sin: [d]). */
static void rope(float *x, int heads, int d, const float *cos_, const float *sin_) {
    int half = d / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + (long)h * d;
        for (int i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos_[i] + b * (-sin_[i]);
            v[i + half] = b * cos_[i + half] + a * sin_[i + half];
        }
    }
}

/* One decoder layer's weights, tiled (see the top of this file). */
typedef struct {
    int hidden, hq, hkv, d, inter, wt_qkv, wt_o, wt_gate_up, wt_down; /* formats per linear */
    float eps;
    const float *in_norm, *post_norm, *q_norm, *k_norm; /* q/k norms: NULL unless qk_norm */
    const void *qkv, *o, *gate_up, *down;
    const float *qkv_b, *o_b, *gate_up_b, *down_b; /* NULL: no bias */
} hs_layer;

/* xn = norm(x); qkv = W_qkv xn (+b); q/k norms; RoPE on the q and k heads. */
void hs_pre_attn(const hs_layer *L, const float *x, const float *cos_, const float *sin_,
                 float *xn, float *qkv, int nth) {
    int qd = L->hq * L->d, kd = L->hkv * L->d;
    hs_rms_norm(x, L->in_norm, L->eps, xn, L->hidden);
    hs_linear(L->qkv, L->wt_qkv, L->qkv_b, xn, qkv, qd + 2 * kd, L->hidden, nth);
    if (L->q_norm) {
        for (int h = 0; h < L->hq; h++) hs_rms_norm(qkv + h * L->d, L->q_norm, L->eps, qkv + h * L->d, L->d);
        for (int h = 0; h < L->hkv; h++)
            hs_rms_norm(qkv + qd + h * L->d, L->k_norm, L->eps, qkv + qd + h * L->d, L->d);
    }
    rope(qkv, L->hq + L->hkv, L->d, cos_, sin_);
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* x += W_o attn (+b); xn = norm(x); h = silu(gate) * up; x += W_down h (+b).
 * gu: [2 * inter] scratch, h: [inter] scratch. */
void hs_post_attn(const hs_layer *L, float *x, const float *attn, float *xn, float *gu,
                  float *h, int nth) {
    int hs = L->hidden, im = L->inter;
    hs_linear(L->o, L->wt_o, L->o_b, attn, xn, hs, L->hq * L->d, nth);
    for (int i = 0; i < hs; i++) x[i] = x[i] + xn[i];
    hs_rms_norm(x, L->post_norm, L->eps, xn, hs);
    hs_linear(L->gate_up, L->wt_gate_up, L->gate_up_b, xn, gu, 2L * im, hs, nth);
    for (int i = 0; i < im; i++) h[i] = silu(gu[i]) * gu[im + i];
    hs_linear(L->down, L->wt_down, L->down_b, h, xn, hs, im, nth);
    for (int i = 0; i < hs; i++) x[i] = x[i] + xn[i];
}

/* exp for x <= 0 (softmax after the max is taken), vectorizable: 2^n * p(r), |rel err| < 2e-7 */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

/* One work unit of the split-key attention: grp query heads q [grp, d] over m keys K, V
 * [m, d] -> s [grp][CH] probabilities (unnormalised), o [grp][d] = sum p v, ml [grp][2] =
 * (max score, sum of p). */
static void attn_unit_c(const float *q, const float *K, const float *V, long m, int grp, int d,
                        float scale, float *s, float *o, float *ml) {
    for (int h = 0; h < grp; h++) {
        const float *qh = q + (long)h * d;
        float *sh = s + (long)h * CH;
        for (long j = 0; j < m; j++) {
            const float *kj = K + j * d;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int i = 0; i < d; i++) acc += qh[i] * kj[i];
            sh[j] = acc * scale;
        }
        float mx = -INFINITY;
        for (long j = 0; j < m; j++) mx = sh[j] > mx ? sh[j] : mx;
        float sum = 0.f;
        for (long j = 0; j < m; j++) {
            sh[j] = exp_neg(sh[j] - mx);
            sum += sh[j];
        }
        ml[2 * h] = mx;
        ml[2 * h + 1] = sum;
        float *oh = o + (long)h * d;
        for (int i = 0; i < d; i++) oh[i] = 0.f;
        for (long j = 0; j < m; j++) {
            const float *vj = V + j * d;
            float p = sh[j];
#pragma omp simd
            for (int i = 0; i < d; i++) oh[i] += p * vj[i];
        }
    }
}

#if HS_ISA == 2
static inline __m512 exp_neg16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* the 16 horizontal sums of a[0..15], as one vector (lane j: sum of a[j]) */
static inline __m512 hsum16(__m512 a[16]) {
    __m512 b[8], c[4];
    for (int k = 0; k < 8; k++)
        b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]),
                             _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int k = 0; k < 4; k++) {
        __m512d x = _mm512_castps_pd(b[2 * k]), y = _mm512_castps_pd(b[2 * k + 1]);
        c[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}

/* attn_unit_c for d a multiple of 16 up to 128: scores 16 keys at a time */
static void attn_unit_avx512(const float *q, const float *K, const float *V, long m, int grp,
                             int d, float scale, float *s, float *o, float *ml) {
    int dv = d / 16;
    __m512 vs = _mm512_set1_ps(scale);
    for (int h = 0; h < grp; h++) {
        __m512 qv[8];
        for (int i = 0; i < dv; i++) qv[i] = _mm512_loadu_ps(q + (long)h * d + 16 * i);
        float *sh = s + (long)h * CH;
        __m512 mxv = _mm512_set1_ps(-INFINITY);
        for (long j0 = 0; j0 < m; j0 += 16) {
            int cnt = m - j0 < 16 ? (int)(m - j0) : 16;
            __m512 a[16];
            for (int jj = 0; jj < 16; jj++) {
                __m512 acc = _mm512_setzero_ps();
                if (jj < cnt) {
                    const float *kj = K + (j0 + jj) * d;
                    for (int i = 0; i < dv; i++) acc = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kj + 16 * i), acc);
                }
                a[jj] = acc;
            }
            __mmask16 mk = (__mmask16)((1u << cnt) - 1);
            __m512 sv = _mm512_mul_ps(hsum16(a), vs);
            _mm512_mask_storeu_ps(sh + j0, mk, sv);
            mxv = _mm512_mask_max_ps(mxv, mk, mxv, sv);
        }
        float mx = _mm512_reduce_max_ps(mxv);
        __m512 mv = _mm512_set1_ps(mx), sumv = _mm512_setzero_ps();
        for (long j0 = 0; j0 < m; j0 += 16) {
            int cnt = m - j0 < 16 ? (int)(m - j0) : 16;
            __mmask16 mk = (__mmask16)((1u << cnt) - 1);
            __m512 p = exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sh + j0), mv));
            _mm512_mask_storeu_ps(sh + j0, mk, p);
            sumv = _mm512_mask_add_ps(sumv, mk, sumv, p);
        }
        ml[2 * h] = mx;
        ml[2 * h + 1] = _mm512_reduce_add_ps(sumv);
        __m512 ov[8];
        for (int i = 0; i < dv; i++) ov[i] = _mm512_setzero_ps();
        for (long j = 0; j < m; j++) {
            __m512 p = _mm512_set1_ps(sh[j]);
            const float *vj = V + j * d;
            for (int i = 0; i < dv; i++) ov[i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj + 16 * i), ov[i]);
        }
        for (int i = 0; i < dv; i++) _mm512_storeu_ps(o + (long)h * d + 16 * i, ov[i]);
    }
}
#endif

static void attn_unit(const float *q, const float *K, const float *V, long m, int grp, int d,
                      float scale, float *s, float *o, float *ml) {
#if HS_ISA == 2
    if (d % 16 == 0 && d <= 128) {
        attn_unit_avx512(q, K, V, m, grp, d, scale, s, o, ml);
        return;
    }
#endif
    attn_unit_c(q, K, V, m, grp, d, scale, s, o, ml);
}

/* Dense decode attention of one query over a layer's head-major KV storage.
 * kc, vc: the layer's storage, head g's slot s at kc[g * head_stride + s * d];
 * the new token's k/v (k_new, v_new [hkv, d]) are stored at slot `slot0 + n - 1` first,
 * then every query head attends over the n consecutive slots from slot0.
 * q: [hq, d] (after RoPE); out: [hq, d]; scratch: hs_attn_scratch(...) floats. */
long hs_attn_scratch(long n, int hq, int hkv, int d) {
    long chunks = (n + CH - 1) / CH;
    int grp = hq / hkv;
    return (long)hkv * chunks * grp * (CH + d + 2);
}

void hs_attn_dense(const float *q, const float *k_new, const float *v_new, float *kc, float *vc,
                   long head_stride, long slot0, long n, int hq, int hkv, int d, float scale,
                   float *out, float *scratch, int nth) {
    int grp = hq / hkv;
    long chunks = (n + CH - 1) / CH, units = hkv * chunks, per = (long)grp * (CH + d + 2);
    for (int g = 0; g < hkv; g++) {
        memcpy(kc + g * head_stride + (slot0 + n - 1) * d, k_new + (long)g * d, sizeof(float) * d);
        memcpy(vc + g * head_stride + (slot0 + n - 1) * d, v_new + (long)g * d, sizeof(float) * d);
    }
    if (n * hq * d < SMALL) nth = 1;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (long u = 0; u < units; u++) {
        int g = (int)(u / chunks);
        long c = u % chunks, j0 = c * CH, m = (j0 + CH < n ? j0 + CH : n) - j0;
        float *su = scratch + u * per;
        attn_unit(q + (long)g * grp * d, kc + g * head_stride + (slot0 + j0) * d,
                  vc + g * head_stride + (slot0 + j0) * d, m, grp, d, scale, su,
                  su + (long)grp * CH, su + (long)grp * (CH + d));
    }
    /* merge the chunks of each query head */
    for (int g = 0; g < hkv; g++)
        for (int h = 0; h < grp; h++) {
            float mx = -INFINITY, sum = 0.f;
            for (long c = 0; c < chunks; c++) {
                float cm = scratch[(g * chunks + c) * per + (long)grp * (CH + d) + 2 * h];
                mx = cm > mx ? cm : mx;
            }
            float *oq = out + (long)(g * grp + h) * d;
            for (int i = 0; i < d; i++) oq[i] = 0.f;
            for (long c = 0; c < chunks; c++) {
                const float *base = scratch + (g * chunks + c) * per;
                const float *ml = base + (long)grp * (CH + d) + 2 * h;
                float f = exp_neg(ml[0] - mx);
                sum += ml[1] * f;
                const float *oh = base + (long)grp * CH + (long)h * d;
                for (int i = 0; i < d; i++) oq[i] += oh[i] * f;
            }
            float inv = 1.0f / sum;
            for (int i = 0; i < d; i++) oq[i] *= inv;
        }
}

/* Tile a row-major [out, in] matrix of element size `esize` into `dst` (the tiled layout;
 * dst holds ceil(out/8) * 8 * in elements, the padding rows zero). */
void hs_tile(const void *src, long row_stride, long col_stride, int esize, void *dst, long out,
             long in) {
    long groups = (out + TR - 1) / TR, steps = in / TK;
#pragma omp parallel for schedule(static)
    for (long g = 0; g < groups; g++)
        for (long k = 0; k < steps; k++)
            for (int j = 0; j < TR; j++) {
                long r = g * TR + j;
                char *d = (char *)dst + ((g * steps + k) * TILE + (long)j * TK) * esize;
                if (r >= out) {
                    memset(d, 0, (size_t)TK * esize);
                    continue;
                }
                const char *s = (const char *)src + (r * row_stride + k * TK * col_stride) * esize;
                if (col_stride == 1) {
                    memcpy(d, s, (size_t)TK * esize);
                } else {
                    for (int l = 0; l < TK; l++) memcpy(d + l * esize, s + l * col_stride * esize, esize);
                }
            }
}

/* Find the W_Q4 form of one group of 32 values (module comment): 1 and fills q[32], *d16,
 * *m16 when every value is reproduced exactly, else 0. */
static int group_q4(const float *v, long cs, uint8_t q[QG], uint16_t *d16, uint16_t *m16) {
    float mn = v[0], mx = v[0];
    for (int i = 1; i < QG; i++) {
        float x = v[i * cs];
        mn = x < mn ? x : mn;
        mx = x > mx ? x : mx;
    }
    uint16_t m = f32_to_f16(mn);
    if (f16_to_f32(m) != mn) return 0;
    uint16_t d0 = f32_to_f16((mx - mn) / 15.0f);
    static const int tries[] = {0, -1, 1, -2, 2, -3, 3};
    for (int t = 0; t < 7; t++) {
        int db = (int)d0 + tries[t];
        if (db < 0 || (db & 0x7fff) >= 0x7c00) continue;
        float d = f16_to_f32((uint16_t)db), lut[16];
        for (int k = 0; k < 16; k++) lut[k] = f16_to_f32(f32_to_f16(d * (float)k + mn));
        int ok = 1;
        float inv = d > 0.f ? 1.0f / d : 0.f;
        for (int i = 0; i < QG && ok; i++) {
            float x = v[i * cs];
            int k = (int)nearbyintf((x - mn) * inv); /* the grid point, or one beside it */
            k = k < 0 ? 0 : k > 15 ? 15 : k;
            if (lut[k] != x) {
                if (k > 0 && lut[k - 1] == x) k--;
                else if (k < 15 && lut[k + 1] == x) k++;
                else ok = 0;
            }
            q[i] = (uint8_t)k;
        }
        if (ok) {
            *d16 = (uint16_t)db;
            *m16 = m;
            return 1;
        }
    }
    return 0;
}

static int group_q8(const float *v, long cs, int8_t q[QG], uint16_t *d16) {
    float amax = 0.f;
    for (int i = 0; i < QG; i++) {
        float x = fabsf(v[i * cs]);
        amax = x > amax ? x : amax;
    }
    uint16_t d0 = f32_to_f16(amax / 127.0f);
    static const int tries[] = {0, -1, 1, -2, 2, -3, 3};
    for (int t = 0; t < 7; t++) {
        int db = (int)d0 + tries[t];
        if (db < 0 || (db & 0x7fff) >= 0x7c00) continue;
        float d = f16_to_f32((uint16_t)db);
        int ok = 1;
        for (int i = 0; i < QG && ok; i++) {
            float x = v[i * cs];
            float r = d == 0.f ? 0.f : nearbyintf(x / d);
            if (r < -128.f || r > 127.f) { ok = 0; break; }
            if (f16_to_f32(f32_to_f16(d * r)) != x) ok = 0;
            else q[i] = (int8_t)r;
        }
        if (ok) {
            *d16 = (uint16_t)db;
            return 1;
        }
    }
    return 0;
}

/* Pack the float32 matrix src [out, in] (element strides rs, cs) into W_Q4 (wt 3) or W_Q8
 * (wt 4) tiles at dst (hs_weight_bytes(wt, out, in) bytes; in a multiple of 32). Returns 0
 * when dst holds the matrix without loss, else a positive count of groups that could not
 * be reproduced (the search stops soon after the first). */
long hs_pack(const float *src, long rs, long cs, long out, long in, int wt, uint8_t *dst) {
    long groups = (out + TR - 1) / TR, steps = in / QG, failed = 0;
    size_t step = wt == W_Q4 ? Q4_STEP : Q8_STEP;
    volatile int stop = 0; /* the first failure ends the search (the caller falls back) */
#pragma omp parallel for schedule(static) reduction(+ : failed)
    for (long g = 0; g < groups; g++)
        for (long k = 0; k < steps && !stop; k++) {
            uint8_t *p = dst + (g * steps + k) * step;
            memset(p, 0, step);
            for (int j = 0; j < TR; j++) {
                long r = g * TR + j;
                if (r >= out) continue;
                const float *v = src + r * rs + k * QG * cs;
                if (wt == W_Q4) {
                    uint8_t q[QG];
                    uint16_t *dv = (uint16_t *)(p + TR * 16);
                    if (!group_q4(v, cs, q, dv + j, dv + TR + j)) { failed++; stop = 1; continue; }
                    for (int b = 0; b < 16; b++) p[16 * j + b] = (uint8_t)(q[b] | q[b + 16] << 4);
                } else {
                    uint16_t *dv = (uint16_t *)(p + TR * QG);
                    if (!group_q8(v, cs, (int8_t *)(p + QG * j), dv + j)) { failed++; stop = 1; }
                }
            }
        }
    return failed;
}
