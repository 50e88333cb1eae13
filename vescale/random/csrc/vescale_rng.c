/* vescale_rng.c: the compiled kernel of vescale.random (see vescale/random/kernel.py).
 *
 * Fills a block of a global random tensor the way PyTorch's CUDA distribution kernels fill the whole
 * tensor: element j of a launch of T threads is drawn by thread j % T at step j / T; step m uses word
 * m % U of Philox4x32-10 call m / U of that thread's stream (key = seed, counter = (c + m / U, t)).
 * Every number transform repeats vescale/random/philox.py operation for operation: the two
 * implementations must give identical bits. Hence:
 *   - build with -ffp-contract=off and without -ffast-math (no fused or reassociated arithmetic);
 *   - no libm except nearbyint (exact); even sqrt is our own (det_sqrt), as torch.sqrt may differ;
 *   - fused multiply-adds are emulated exactly, never taken from the hardware.
 * Plain C, no Python or torch headers: Python passes raw pointers through ctypes (vrng_job).
 * Parallelism: worker pthreads that live only for one call (no OpenMP runtime next to torch's own,
 * nothing left running across a fork of the process); tasks are handed out through an atomic counter.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <pthread.h>
#include <string.h>

#define VRNG_ABI_VERSION 2

enum { OP_UNIFORM = 0, OP_NORMAL = 1, OP_BERNOULLI = 2, OP_RANDOM = 3, OP_BERNOULLI_TENSOR = 4 };
enum { DT_F32 = 0, DT_F64, DT_F16, DT_BF16, DT_BOOL, DT_U8, DT_I8, DT_I16, DT_I32, DT_I64 };

/* Mirrors kernel.py's _NativeJob (ctypes.Structure): keep the field order in sync. */
typedef struct {
    int64_t op, dtype, wide, unroll;
    uint64_t seed;
    int64_t nlaunch;
    const int64_t *launch_start;    /* nlaunch + 1 entries, the last one is the global numel */
    const int64_t *launch_threads;  /* T of each launch */
    const uint64_t *launch_counter; /* first Philox counter (offset / 4) of each launch */
    /* local layout: element e = (r * ninner + p) * run + c is global j = row_base[r] + inner_off[p] + c */
    int64_t nrows, ninner, run;
    const int64_t *row_base, *inner_off;
    double a, b, c;   /* uniform: from, range, to; normal: mean, std; bernoulli: p */
    uint64_t modulus; /* random: (bits % modulus) + base, modulus 0 meaning 2**64 */
    int64_t base;
    const void *prob; /* bernoulli with a tensor p: float32 (float64 for a float64 result), out's layout */
    void *out;
    int64_t num_threads;
} vrng_job;

/* ---- Philox4x32-10, BATCH counters at a time ---- */

#define BATCH 64
#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

typedef struct {
    uint32_t c0[BATCH], c1[BATCH], c2[BATCH], c3[BATCH]; /* counters */
    uint32_t w0[BATCH], w1[BATCH], w2[BATCH], w3[BATCH]; /* output words */
    uint8_t ii[BATCH];                                   /* which word (pair) each lane's element uses */
} lanes_t;

static void philox_scalar(lanes_t *L, int first, int n, uint32_t key0, uint32_t key1) {
    for (int i = first; i < n; i++) {
        uint32_t x0 = L->c0[i], x1 = L->c1[i], x2 = L->c2[i], x3 = L->c3[i];
        uint32_t k0 = key0, k1 = key1;
        for (int round = 0; round < 10; round++) {
            uint64_t p0 = (uint64_t)PHILOX_M0 * x0;
            uint64_t p1 = (uint64_t)PHILOX_M1 * x2;
            uint32_t y0 = (uint32_t)(p1 >> 32) ^ x1 ^ k0;
            uint32_t y2 = (uint32_t)(p0 >> 32) ^ x3 ^ k1;
            x1 = (uint32_t)p1;
            x3 = (uint32_t)p0;
            x0 = y0;
            x2 = y2;
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        L->w0[i] = x0;
        L->w1[i] = x1;
        L->w2[i] = x2;
        L->w3[i] = x3;
    }
}

#if defined(__AVX2__)
#include <immintrin.h>

/* (high, low) 32-bit halves of x * m for 8 lanes: even lanes multiply in place, odd lanes shifted down. */
static inline void mulhilo8(__m256i x, __m256i m, __m256i *hi, __m256i *lo) {
    __m256i even = _mm256_mul_epu32(x, m);
    __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), m);
    *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

/* Philox of 8 * groups lanes from lane `first`: up to 4 independent 8-lane groups advanced round by round
 * in lockstep, so that one group's multiplies overlap another's (one group alone waits on its own latency).
 * Always inlined with a constant `groups`, so the group loops unroll into straight-line code. */
static inline __attribute__((always_inline)) void philox_groups(lanes_t *L, int first, int groups, uint32_t key0,
                                                                 uint32_t key1) {
    const __m256i m0 = _mm256_set1_epi64x(PHILOX_M0), m1 = _mm256_set1_epi64x(PHILOX_M1);
    __m256i x0[4], x1[4], x2[4], x3[4];
    for (int g = 0; g < groups; g++) {
        x0[g] = _mm256_loadu_si256((const __m256i *)(L->c0 + first + 8 * g));
        x1[g] = _mm256_loadu_si256((const __m256i *)(L->c1 + first + 8 * g));
        x2[g] = _mm256_loadu_si256((const __m256i *)(L->c2 + first + 8 * g));
        x3[g] = _mm256_loadu_si256((const __m256i *)(L->c3 + first + 8 * g));
    }
    uint32_t k0 = key0, k1 = key1;
    for (int round = 0; round < 10; round++) {
        const __m256i round_k0 = _mm256_set1_epi32((int)k0), round_k1 = _mm256_set1_epi32((int)k1);
        for (int g = 0; g < groups; g++) {
            __m256i hi0, lo0, hi1, lo1;
            mulhilo8(x0[g], m0, &hi0, &lo0);
            mulhilo8(x2[g], m1, &hi1, &lo1);
            x0[g] = _mm256_xor_si256(_mm256_xor_si256(hi1, x1[g]), round_k0);
            x2[g] = _mm256_xor_si256(_mm256_xor_si256(hi0, x3[g]), round_k1);
            x1[g] = lo1;
            x3[g] = lo0;
        }
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    for (int g = 0; g < groups; g++) {
        _mm256_storeu_si256((__m256i *)(L->w0 + first + 8 * g), x0[g]);
        _mm256_storeu_si256((__m256i *)(L->w1 + first + 8 * g), x1[g]);
        _mm256_storeu_si256((__m256i *)(L->w2 + first + 8 * g), x2[g]);
        _mm256_storeu_si256((__m256i *)(L->w3 + first + 8 * g), x3[g]);
    }
}

static void philox_lanes(lanes_t *L, int n, uint32_t key0, uint32_t key1) {
    int i = 0;
    for (; i + 32 <= n; i += 32) philox_groups(L, i, 4, key0, key1);
    for (; i + 8 <= n; i += 8) philox_groups(L, i, 1, key0, key1);
    philox_scalar(L, i, n, key0, key1);
}
#else
static void philox_lanes(lanes_t *L, int n, uint32_t key0, uint32_t key1) { philox_scalar(L, 0, n, key0, key1); }
#endif

/* ---- exact arithmetic helpers (philox.py: fma_float, fma_double, det_log, ...) ---- */

static inline uint64_t bits_of(double x) { uint64_t b; memcpy(&b, &x, 8); return b; }
static inline double from_bits(uint64_t b) { double x; memcpy(&x, &b, 8); return x; }

/* Written branch-free (selects, 32-bit exponents) so that loops over lanes vectorise. */

/* Small integers <-> doubles through the bits of 2**52 + 2**51 (exact; avoids conversions AVX2 lacks). */
#define MAGIC 0x1.8p52
static inline double small_int_to_double(int64_t k) { return from_bits(bits_of(MAGIC) + (uint64_t)k) - MAGIC; }
static inline int64_t integral_double_to_int(double q) { return (int64_t)(bits_of(q + MAGIC) - bits_of(MAGIC)); }

static inline double add_round_to_odd(double a, double b) {
    double s = a + b;
    double bv = s - a;
    double err = (a - (s - bv)) + (b - bv);
    /* fix = err != 0 && last bit of s even && s finite; step = +1 ulp in magnitude if err has the sign of s,
     * else -1. Pure integer arithmetic (no comparisons), which is what lets compilers vectorise it. */
    uint64_t bits = bits_of(s), err_bits = bits_of(err), err_magnitude = err_bits << 1;
    uint64_t nonzero = (err_magnitude | (0 - err_magnitude)) >> 63;
    uint64_t finite = 1 - ((((bits >> 52) & 0x7FF) + 1) >> 11);
    uint64_t fix = nonzero & (~bits & 1) & finite;
    uint64_t step = 1 - 2 * ((err_bits ^ bits) >> 63);
    return from_bits(bits + (step & (0 - fix)));
}

static inline float fma_float(float a, float b, float c) {
    return (float)add_round_to_odd((double)a * (double)b, (double)c);
}

static inline double fma_double(double a, double b, double c) {
    const double splitter = 134217729.0;
    double p = a * b;
    double t = a * splitter, ah = t - (t - a), al = a - ah;
    t = b * splitter;
    double bh = t - (t - b), bl = b - bh;
    double pl = ((ah * bh - p) + ah * bl + al * bh) + al * bl;
    double th = c + p, bv = th - c;
    double tl = (c - (th - bv)) + (p - bv);
    return th + add_round_to_odd(tl, pl);
}

#define LN2_HI 0x1.62e42fefa3800p-1
#define LN2_LO 0x1.ef35793c76730p-45
#define SQRT2 0x1.6a09e667f3bcdp+0
#define PIO2_HI 0x1.921fb54400000p+0
#define PIO2_LO 0x1.0b4611a626331p-34
#define TWO_OVER_PI 0x1.45f306dc9c883p-1
#define PI_D 0x1.921fb54442d18p+1
#define RSQRT_C3 -0x1.380d65752d772p-6
#define RSQRT_C2 0x1.8ea094fca27b8p-3
#define RSQRT_C1 -0x1.7a3ae019f9bc3p-1
#define RSQRT_C0 0x1.8e5a731d0807bp+0

/* Horner with the coefficients of philox.py (LOG_COEFFS, SIN_COEFFS, COS_COEFFS), highest first */
static inline double log_poly(double z) {
    double acc = 0x1.8618618618618p-4;
    acc = acc * z + 0x1.af286bca1af28p-4;
    acc = acc * z + 0x1.e1e1e1e1e1e1ep-4;
    acc = acc * z + 0x1.1111111111111p-3;
    acc = acc * z + 0x1.3b13b13b13b14p-3;
    acc = acc * z + 0x1.745d1745d1746p-3;
    acc = acc * z + 0x1.c71c71c71c71cp-3;
    acc = acc * z + 0x1.2492492492492p-2;
    acc = acc * z + 0x1.999999999999ap-2;
    return acc * z + 0x1.5555555555555p-1;
}

static inline double sin_poly(double z) {
    double acc = 0x1.952c77030ad4ap-49;
    acc = acc * z + -0x1.ae7f3e733b81fp-41;
    acc = acc * z + 0x1.6124613a86d09p-33;
    acc = acc * z + -0x1.ae64567f544e4p-26;
    acc = acc * z + 0x1.71de3a556c734p-19;
    acc = acc * z + -0x1.a01a01a01a01ap-13;
    acc = acc * z + 0x1.1111111111111p-7;
    return acc * z + -0x1.5555555555555p-3;
}

static inline double cos_poly(double z) {
    double acc = -0x1.6827863b97d97p-53;
    acc = acc * z + 0x1.ae7f3e733b81fp-45;
    acc = acc * z + -0x1.93974a8c07c9dp-37;
    acc = acc * z + 0x1.1eed8eff8d898p-29;
    acc = acc * z + -0x1.27e4fb7789f5cp-22;
    acc = acc * z + 0x1.a01a01a01a01ap-16;
    acc = acc * z + -0x1.6c16c16c16c17p-10;
    acc = acc * z + 0x1.5555555555555p-5;
    return acc * z + -0x1.0000000000000p-1;
}

static inline double det_log(double x) { /* positive normal x */
    uint64_t bits = bits_of(x);
    int64_t exponent = (int64_t)(bits >> 52) - 1023;
    double f = from_bits((bits & ((1ull << 52) - 1)) | (1023ull << 52)); /* [1, 2) */
    int64_t big = f > SQRT2;
    f = big ? f * 0.5 : f;
    exponent += big;
    double s = (f - 1.0) / (f + 1.0);
    double z = s * s;
    double log_f = 2.0 * s + s * (z * log_poly(z));
    double e = small_int_to_double(exponent);
    return e * LN2_HI + (e * LN2_LO + log_f);
}

static inline double det_sqrt(double x) { /* x == 0 or 2**-1000 <= x <= 2**1000 */
    int64_t half_exponent = ((int64_t)(bits_of(x) >> 52) - 1023) >> 1; /* floor(e / 2) */
    double m = x * from_bits((uint64_t)(1023 - 2 * half_exponent) << 52);
    m = x == 0.0 ? 1.0 : m;
    double y = ((RSQRT_C3 * m + RSQRT_C2) * m + RSQRT_C1) * m + RSQRT_C0; /* philox.RSQRT_SEED */
    for (int i = 0; i < 3; i++) y = y * (1.5 - 0.5 * (m * y * y));
    double root = (m * y) * from_bits((uint64_t)(1023 + half_exponent) << 52);
    return x == 0.0 ? x : root;
}

static inline double by_quadrant(int64_t quadrant, double r, int64_t want_cos) {
    double z = r * r;
    double sin_r = r + r * (z * sin_poly(z));
    double cos_r = 1.0 + z * cos_poly(z);
    int64_t q = (quadrant + want_cos) & 3;
    double value = (q & 1) ? cos_r : sin_r;
    return q >= 2 ? -value : value;
}

/* Both sin and cos of quadrant * pi/2 + r: the same values by_quadrant selects one of. */
static inline void sincos_by_quadrant(int64_t quadrant, double r, double *sin_out, double *cos_out) {
    double z = r * r;
    double sin_r = r + r * (z * sin_poly(z));
    double cos_r = 1.0 + z * cos_poly(z);
    int64_t q = quadrant & 3;
    double s = (q & 1) ? cos_r : sin_r, c = (q & 1) ? sin_r : cos_r;
    *sin_out = q >= 2 ? -s : s;
    *cos_out = (q == 1 || q == 2) ? -c : c;
}

static inline double det_sin_or_cos(double v, int64_t want_cos) { /* 0 <= v < 8 */
    double q = nearbyint(v * TWO_OVER_PI);
    double r = (v - q * PIO2_HI) - q * PIO2_LO;
    return by_quadrant(integral_double_to_int(q), r, want_cos);
}

static inline double det_sinpi_or_cospi(double v, int64_t want_cos) { /* 0 <= v <= 2 */
    double q = nearbyint(v * 2.0);
    double r = (v - q * 0.5) * PI_D;
    return by_quadrant(integral_double_to_int(q), r, want_cos);
}

static inline float uniform_float(uint32_t w) { return (float)w * 0x1p-32f + 0x1p-33f; }

/* (double)z for z < 2**53, exactly, as two 26/27-bit halves through the bits of 2**52 (AVX2 has no
 * 64-bit integer -> double conversion; this keeps loops vectorisable). */
static inline double u53_to_double(uint64_t z) {
    double high = from_bits(0x4330000000000000ull | (z >> 26)) - 0x1p52;
    double low = from_bits(0x4330000000000000ull | (z & ((1ull << 26) - 1))) - 0x1p52;
    return high * 0x1p26 + low;
}

static inline double uniform_double(uint32_t lo, uint32_t hi) {
    return u53_to_double((uint64_t)lo ^ ((uint64_t)hi << 21)) * 0x1p-53 + 0x1p-54;
}

#define V_SCALE 0x1.921fb6p-30f /* 2**-32 * float32(2 pi), curand's CURAND_2POW32_INV_2PI */

/* Box-Muller's angle fma_float(float32(w), V_SCALE, V_SCALE / 2), specialised: the product p is exact and at
 * least the addend c (or 0), so Fast2Sum gives the sum's rounding error, and the sum is positive and
 * finite, so add_round_to_odd's fix-up reduces to a step towards the error. Same bits, fewer operations. */
static inline float angle_float(uint32_t w) {
    double p = (double)(float)w * (double)V_SCALE, c = (double)(V_SCALE / 2);
    double s = p + c;
    double err = c - (s - p);
    uint64_t bits = bits_of(s);
    uint64_t fix = (uint64_t)(err != 0.0) & ~bits & 1; /* inexact and even: make it odd */
    uint64_t down = err < 0.0;
    return (float)from_bits(bits + fix - 2 * (fix & down));
}

/* ---- float32 -> float16 / bfloat16, round to nearest even (as torch's conversions) ---- */

static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);      /* NaN */
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);     /* rounds to inf (>= 65520) */
    if (ax < 0x38800000u) {                                        /* below 2**-14: subnormal half */
        float t = fabsf(f) + 0.5f; /* the addition rounds |f| to a multiple of 2**-24, ties to even */
        uint32_t tb;
        memcpy(&tb, &t, 4);
        return (uint16_t)(sign | (tb - 0x3F000000u));
    }
    uint32_t odd = (ax >> 13) & 1u;
    return (uint16_t)(sign | ((ax - (112u << 23) + 0xFFFu + odd) >> 13));
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u; /* NaN, as c10::BFloat16 */
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

static inline int half_bits_equal(uint16_t x, uint16_t y) { /* == for non-NaN halves: +0 == -0 */
    return x == y || ((x & 0x7FFFu) == 0 && (y & 0x7FFFu) == 0);
}

/* ---- per-lane transforms: words -> value, written straight into the output dtype ---- */

static void store_float32_values(const vrng_job *J, const float *v, int n, int64_t e0) {
    int uniform = J->op == OP_UNIFORM;
    float from = (float)J->a, to = (float)J->c;
    switch (J->dtype) {
    case DT_F32: {
        float *out = (float *)J->out + e0;
        for (int i = 0; i < n; i++) out[i] = (uniform && v[i] == to) ? from : v[i];
        break;
    }
    case DT_F16: {
        uint16_t *out = (uint16_t *)J->out + e0, h_from = f32_to_f16(from), h_to = f32_to_f16(to);
        for (int i = 0; i < n; i++) {
            uint16_t h = f32_to_f16(v[i]);
            out[i] = (uniform && half_bits_equal(h, h_to)) ? h_from : h;
        }
        break;
    }
    case DT_BF16: {
        uint16_t *out = (uint16_t *)J->out + e0, b_from = f32_to_bf16(from), b_to = f32_to_bf16(to);
        for (int i = 0; i < n; i++) {
            uint16_t h = f32_to_bf16(v[i]);
            out[i] = (uniform && half_bits_equal(h, b_to)) ? b_from : h;
        }
        break;
    }
    }
}

static void store_int64_values(const vrng_job *J, const int64_t *v, int n, int64_t e0) {
    switch (J->dtype) {
    case DT_F32: for (int i = 0; i < n; i++) ((float *)J->out)[e0 + i] = (float)v[i]; break;
    case DT_F64: for (int i = 0; i < n; i++) ((double *)J->out)[e0 + i] = (double)v[i]; break;
    case DT_F16: for (int i = 0; i < n; i++) ((uint16_t *)J->out)[e0 + i] = f32_to_f16((float)v[i]); break;
    case DT_BF16: for (int i = 0; i < n; i++) ((uint16_t *)J->out)[e0 + i] = f32_to_bf16((float)v[i]); break;
    case DT_BOOL: for (int i = 0; i < n; i++) ((uint8_t *)J->out)[e0 + i] = v[i] != 0; break;
    case DT_U8: for (int i = 0; i < n; i++) ((uint8_t *)J->out)[e0 + i] = (uint8_t)v[i]; break;
    case DT_I8: for (int i = 0; i < n; i++) ((int8_t *)J->out)[e0 + i] = (int8_t)v[i]; break;
    case DT_I16: for (int i = 0; i < n; i++) ((int16_t *)J->out)[e0 + i] = (int16_t)v[i]; break;
    case DT_I32: for (int i = 0; i < n; i++) ((int32_t *)J->out)[e0 + i] = (int32_t)v[i]; break;
    case DT_I64: for (int i = 0; i < n; i++) ((int64_t *)J->out)[e0 + i] = v[i]; break;
    }
}

/* Lanes [first, first + n) of a lanes_t, as emit reads them. */
typedef struct {
    const uint32_t *w0, *w1, *w2, *w3;
    const uint8_t *ii;
} words_t;

static inline words_t lanes_from(const lanes_t *L, int first) {
    words_t W = {L->w0 + first, L->w1 + first, L->w2 + first, L->w3 + first, L->ii + first};
    return W;
}

/* Each lane's word (U = 4: word ii) or word pair (U = 2: words 2ii, 2ii + 1). */
static void select_word(const words_t *L, int n, uint32_t *x) {
    for (int i = 0; i < n; i++) {
        int k = L->ii[i];
        x[i] = k == 0 ? L->w0[i] : k == 1 ? L->w1[i] : k == 2 ? L->w2[i] : L->w3[i];
    }
}

static void select_pair(const words_t *L, int n, uint32_t *x, uint32_t *y) {
    for (int i = 0; i < n; i++) {
        int second = L->ii[i] != 0;
        x[i] = second ? L->w2[i] : L->w0[i];
        y[i] = second ? L->w3[i] : L->w1[i];
    }
}

/* Asks the compiler to vectorise a loop (only with -fopenmp-simd: no OpenMP runtime is involved). */
#define SIMD _Pragma("omp simd")

/* mean + std * z for standard normals z, rounded as CUDA's transformation::normal, stored from out[e0]. */
static void finish_normal_float(const vrng_job *J, const float *z, int n, int64_t e0) {
    float vf[BATCH];
    const int identity = bits_of(J->a) == 0 && J->b == 1.0; /* fma(z, 1, +0) is exactly z + 0 */
    const float af = (float)J->a, bf = (float)J->b;
    SIMD for (int i = 0; i < n; i++) vf[i] = identity ? z[i] + 0.0f : fma_float(z[i], bf, af);
    store_float32_values(J, vf, n, e0);
}

static void finish_normal_double(const vrng_job *J, const double *z, int n, int64_t e0) {
    double *out = (double *)J->out + e0;
    const int identity = bits_of(J->a) == 0 && J->b == 1.0;
    const double a = J->a, b = J->b; /* locals: out may alias *J as far as the compiler knows */
    SIMD for (int i = 0; i < n; i++) out[i] = identity ? z[i] + 0.0 : fma_double(z[i], b, a);
}

/* Box-Muller pair `pair` of n whole calls, both of its elements at once (one log, sqrt and reduction for
 * the sine and the cosine element): zs / zc get elements 2 pair and 2 pair + 1 (float32), or for float64
 * (one pair per call, U = 2) elements 0 and 1. */
static void normal_pair(const vrng_job *J, const lanes_t *L, int n, int pair, void *zs_out, void *zc_out) {
    double radius[BATCH], angle[BATCH];
    if (!J->wide) { /* curand_normal4: (w0, w1) -> elements 0 (sin), 1 (cos); (w2, w3) -> 2, 3 */
        const uint32_t *uw = pair ? L->w2 : L->w0, *vw = pair ? L->w3 : L->w1;
        float *zs = (float *)zs_out, *zc = (float *)zc_out;
        SIMD for (int i = 0; i < n; i++) radius[i] = -2.0 * det_log((double)uniform_float(uw[i]));
        SIMD for (int i = 0; i < n; i++) radius[i] = det_sqrt(radius[i]); /* own loop: see emit_normal */
        SIMD for (int i = 0; i < n; i++) angle[i] = (double)angle_float(vw[i]);
        SIMD for (int i = 0; i < n; i++) {
            double q = nearbyint(angle[i] * TWO_OVER_PI), sn, cs;
            sincos_by_quadrant(integral_double_to_int(q), (angle[i] - q * PIO2_HI) - q * PIO2_LO, &sn, &cs);
            zs[i] = (float)(radius[i] * sn);
            zc[i] = (float)(radius[i] * cs);
        }
    } else { /* curand_normal2_double: u from (w0, w1), v from (w2, w3); element 0 sin, 1 cos */
        double *zs = (double *)zs_out, *zc = (double *)zc_out;
        SIMD for (int i = 0; i < n; i++) radius[i] = -2.0 * det_log(uniform_double(L->w0[i], L->w1[i]));
        SIMD for (int i = 0; i < n; i++) radius[i] = det_sqrt(radius[i]);
        SIMD for (int i = 0; i < n; i++) {
            uint64_t z = (uint64_t)L->w2[i] ^ ((uint64_t)L->w3[i] << 21);
            angle[i] = u53_to_double(z) * 0x1p-52 + 0x1p-53;
        }
        SIMD for (int i = 0; i < n; i++) {
            double q = nearbyint(angle[i] * 2.0), sn, cs;
            sincos_by_quadrant(integral_double_to_int(q), (angle[i] - q * 0.5) * PI_D, &sn, &cs);
            zs[i] = radius[i] * sn;
            zc[i] = radius[i] * cs;
        }
    }
}

/* emit for normal: n standard normals from the lanes' words (each element its half of a Box-Muller pair),
 * then mean + std * z. `word` >= 0: every lane's element uses word (pair) `word`, as in a run of consecutive
 * threads at one step; -1: each lane's own L->ii. Each stage is its own loop: a loop through log, sqrt and
 * sin at once is one long dependency chain per lane, which the CPU overlaps across lanes much less well. */
static void emit_normal(const vrng_job *J, const words_t *L, int n, int64_t e0, int word) {
    int64_t odd[BATCH]; /* 1: the cosine element of its pair */
    double radius[BATCH], angle[BATCH];
    for (int i = 0; i < n; i++) odd[i] = (word >= 0 ? word : L->ii[i]) & 1;
    if (!J->wide) { /* curand_normal4: words (0, 1) feed elements 0 (sin) and 1 (cos), (2, 3) 2 and 3 */
        uint32_t x[BATCH], y[BATCH];
        const uint32_t *uw = x, *vw = y;
        if (word >= 0) {
            uw = word & 2 ? L->w2 : L->w0;
            vw = word & 2 ? L->w3 : L->w1;
        } else {
            for (int i = 0; i < n; i++) {
                int second = (L->ii[i] & 2) != 0;
                x[i] = second ? L->w2[i] : L->w0[i];
                y[i] = second ? L->w3[i] : L->w1[i];
            }
        }
        float z[BATCH];
        SIMD for (int i = 0; i < n; i++) radius[i] = -2.0 * det_log((double)uniform_float(uw[i]));
        SIMD for (int i = 0; i < n; i++) radius[i] = det_sqrt(radius[i]);
        SIMD for (int i = 0; i < n; i++) angle[i] = (double)angle_float(vw[i]);
        SIMD for (int i = 0; i < n; i++) z[i] = (float)(radius[i] * det_sin_or_cos(angle[i], odd[i]));
        finish_normal_float(J, z, n, e0);
    } else { /* curand_normal2_double: u from words (0, 1), v from (2, 3); element 0 sin, 1 cos */
        double z[BATCH];
        SIMD for (int i = 0; i < n; i++) radius[i] = -2.0 * det_log(uniform_double(L->w0[i], L->w1[i]));
        SIMD for (int i = 0; i < n; i++) radius[i] = det_sqrt(radius[i]);
        SIMD for (int i = 0; i < n; i++) {
            uint64_t bits = (uint64_t)L->w2[i] ^ ((uint64_t)L->w3[i] << 21);
            angle[i] = u53_to_double(bits) * 0x1p-52 + 0x1p-53;
        }
        SIMD for (int i = 0; i < n; i++) z[i] = radius[i] * det_sinpi_or_cospi(angle[i], odd[i]);
        finish_normal_double(J, z, n, e0);
    }
}

/* Turn the lanes' Philox words into n consecutive output elements starting at local element e0.
 * Loops are split by stage so that each one vectorises. */
static void emit(const vrng_job *J, const words_t *L, int n, int64_t e0) {
    uint32_t x[BATCH], y[BATCH];
    float vf[BATCH];
    int64_t vi[BATCH];
    /* uniform(0, 1) / normal(0, 1): fma(x, 1, +0) is exactly x + 0 (which only turns -0 into +0) */
    const int identity = bits_of(J->a) == 0 && J->b == 1.0;
    const float af = (float)J->a, bf = (float)J->b;
    switch (J->op) {
    case OP_UNIFORM:
        if (!J->wide) {
            select_word(L, n, x);
            for (int i = 0; i < n; i++) {
                float u = uniform_float(x[i]);
                vf[i] = identity ? u : fma_float(u, bf, af);
            }
            store_float32_values(J, vf, n, e0);
        } else {
            double *out = (double *)J->out + e0;
            const double a = J->a, b = J->b, c = J->c;
            select_pair(L, n, x, y);
            SIMD for (int i = 0; i < n; i++) {
                double u = uniform_double(x[i], y[i]);
                double v = identity ? u : fma_double(u, b, a);
                out[i] = v == c ? a : v;
            }
        }
        return;
    case OP_NORMAL:
        emit_normal(J, L, n, e0, -1);
        return;
    case OP_BERNOULLI:
        if (!J->wide) {
            select_word(L, n, x);
            for (int i = 0; i < n; i++) vi[i] = uniform_float(x[i]) < af;
        } else {
            select_pair(L, n, x, y);
            for (int i = 0; i < n; i++) vi[i] = uniform_double(x[i], y[i]) < J->a;
        }
        store_int64_values(J, vi, n, e0);
        return;
    case OP_BERNOULLI_TENSOR: /* CUDA compares u <= p in the probabilities' type (float64 for a float64 result) */
        select_word(L, n, x);
        if (J->dtype == DT_F64)
            for (int i = 0; i < n; i++) vi[i] = (double)uniform_float(x[i]) <= ((const double *)J->prob)[e0 + i];
        else
            for (int i = 0; i < n; i++) vi[i] = uniform_float(x[i]) <= ((const float *)J->prob)[e0 + i];
        store_int64_values(J, vi, n, e0);
        return;
    case OP_RANDOM:
        if (!J->wide) {
            select_word(L, n, x);
            for (int i = 0; i < n; i++) vi[i] = (int64_t)(x[i] % J->modulus + (uint64_t)J->base);
        } else { /* random_from_to's 64-bit draw: the first word of the pair is the high half */
            select_pair(L, n, x, y);
            for (int i = 0; i < n; i++) {
                uint64_t bits = ((uint64_t)x[i] << 32) | y[i];
                vi[i] = (int64_t)((J->modulus ? bits % J->modulus : bits) + (uint64_t)J->base);
            }
        }
        store_int64_values(J, vi, n, e0);
        return;
    }
}

/* ---- iteration ----
 * A "piece" is a contiguous range of global flat indices whose elements are consecutive in out.
 * Inside one launch, the elements of call k of thread t are flat indices (kU + ii) T + t, ii < U, so
 * for a piece [lo, hi) each word ii covers a range of t; calls are computed once for the union and
 * every word that falls in the piece is used (U elements per call once the piece spans T * U). */

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Calls k, threads [t_begin, t_end) of launch s, for the launch-local piece [lo, hi); the element at
 * launch-local index x goes to out[x + out_shift]. */
static void fill_calls(const vrng_job *J, int s, int64_t k, int64_t t_begin, int64_t t_end, int64_t lo, int64_t hi,
                       int64_t out_shift) {
    lanes_t L;
    double zs[BATCH], zc[BATCH]; /* a Box-Muller pair's sine and cosine elements (as float or double) */
    const uint32_t key0 = (uint32_t)J->seed, key1 = (uint32_t)(J->seed >> 32);
    const int64_t T = J->launch_threads[s], U = J->unroll;
    const uint64_t counter = J->launch_counter[s] + (uint64_t)k;
    for (int64_t t0 = t_begin; t0 < t_end; t0 += BATCH) {
        int n = (int)min64(BATCH, t_end - t0);
        for (int i = 0; i < n; i++) {
            L.c0[i] = (uint32_t)counter;
            L.c1[i] = (uint32_t)(counter >> 32);
            L.c2[i] = (uint32_t)(t0 + i);
            L.c3[i] = 0;
        }
        philox_lanes(&L, n, key0, key1);
        int64_t a[4], b[4]; /* lanes [a - t0, b - t0) of word ii lie in the piece */
        for (int64_t ii = 0; ii < U; ii++) {
            int64_t base = (k * U + ii) * T; /* launch-local index of (k, ii, t = 0) */
            a[ii] = max64(t0, lo - base);
            b[ii] = min64(t0 + n, hi - base);
        }
        for (int64_t ii = 0; ii < U; ii++) {
            if (a[ii] >= b[ii]) continue;
            int64_t out_at = (k * U + ii) * T + a[ii] + out_shift;
            int64_t partner = ii ^ 1; /* the other element of its Box-Muller pair */
            if (J->op == OP_NORMAL && a[partner] < b[partner]) { /* both elements wanted: share the pair */
                if (ii & 1) continue;                               /* written with its partner */
                normal_pair(J, &L, n, J->wide ? 0 : (int)(ii >> 1), zs, zc);
                for (int64_t e = ii; e <= partner; e++) {
                    const void *z = e == ii ? (const void *)zs : (const void *)zc;
                    int64_t at = (k * U + e) * T + a[e] + out_shift;
                    if (J->wide)
                        finish_normal_double(J, (const double *)z + (a[e] - t0), (int)(b[e] - a[e]), at);
                    else
                        finish_normal_float(J, (const float *)z + (a[e] - t0), (int)(b[e] - a[e]), at);
                }
            } else if (J->op == OP_NORMAL) { /* alone in its pair (Shard(1)-like blocks): one element per call */
                words_t W = lanes_from(&L, (int)(a[ii] - t0));
                emit_normal(J, &W, (int)(b[ii] - a[ii]), out_at, (int)ii);
            } else {
                memset(L.ii + (a[ii] - t0), (int)ii, (size_t)(b[ii] - a[ii]));
                words_t W = lanes_from(&L, (int)(a[ii] - t0));
                emit(J, &W, (int)(b[ii] - a[ii]), out_at);
            }
        }
    }
}

/* The thread ranges that call k needs for the launch-local piece [lo, hi): the per-word ranges,
 * merged where they overlap (a short piece that crosses a step boundary needs two disjoint ones). */
static int call_ranges(const vrng_job *J, int s, int64_t k, int64_t lo, int64_t hi, int64_t ranges[][2]) {
    const int64_t T = J->launch_threads[s], U = J->unroll;
    int count = 0;
    for (int64_t ii = U - 1; ii >= 0; ii--) { /* higher ii: lower t, so ranges come sorted by start */
        int64_t base = (k * U + ii) * T;
        int64_t a = max64(0, lo - base), b = min64(T, hi - base);
        if (a >= b) continue;
        if (count && a <= ranges[count - 1][1])
            ranges[count - 1][1] = max64(ranges[count - 1][1], b);
        else {
            ranges[count][0] = a;
            ranges[count][1] = b;
            count++;
        }
    }
    return count;
}

static int find_launch(const vrng_job *J, int64_t j) {
    int lo = 0, hi = (int)J->nlaunch - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (J->launch_start[mid] <= j) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Global piece [j_lo, j_hi) into out[e_lo ...], in the calling thread. */
static void fill_piece(const vrng_job *J, int64_t j_lo, int64_t j_hi, int64_t e_lo) {
    for (int s = find_launch(J, j_lo); s < J->nlaunch && J->launch_start[s] < j_hi; s++) {
        int64_t start = J->launch_start[s];
        int64_t lo = max64(j_lo, start) - start, hi = min64(j_hi, J->launch_start[s + 1]) - start;
        int64_t block = J->launch_threads[s] * J->unroll;
        for (int64_t k = lo / block; k * block < hi; k++) {
            int64_t ranges[4][2];
            int count = call_ranges(J, s, k, lo, hi, ranges);
            for (int r = 0; r < count; r++) fill_calls(J, s, k, ranges[r][0], ranges[r][1], lo, hi, start - j_lo + e_lo);
        }
    }
}

#define LONG_PIECE 32 /* shorter pieces are batched element by element across pieces */

/* Local elements [e_begin, e_end) of any layout. */
static void fill_elements(const vrng_job *J, int64_t e_begin, int64_t e_end) {
    lanes_t L;
    const uint32_t key0 = (uint32_t)J->seed, key1 = (uint32_t)(J->seed >> 32);
    const int64_t U = J->unroll, per_row = J->ninner * J->run;
    const int apply4 = J->op == OP_BERNOULLI_TENSOR; /* thread j / 4 takes four consecutive elements */
    int64_t r = e_begin / per_row, p = (e_begin % per_row) / J->run, c = e_begin % J->run;
    int64_t e = e_begin, batch_e0 = e_begin;
    int n = 0, cached_launch = -1;
    double inverse_threads = 0.0;
    while (e < e_end) {
        int64_t j = J->row_base[r] + J->inner_off[p] + c;
        int64_t count = min64(J->run - c, e_end - e);
        if (!apply4 && count >= LONG_PIECE) {
            if (n) { /* keep out positions consecutive: flush what is batched first */
                philox_lanes(&L, n, key0, key1);
                words_t W = lanes_from(&L, 0);
                emit(J, &W, n, batch_e0);
                n = 0;
            }
            fill_piece(J, j, j + count, e);
            e += count;
            batch_e0 = e;
        } else {
            while (count > 0) {
                int64_t here, t, ii, T = 0;
                uint64_t counter;
                if (apply4) {
                    here = count;
                    t = j >> 2;
                    ii = j & 3;
                    counter = J->launch_counter[0];
                } else { /* (t, step) once per piece, then advance without dividing */
                    int s = J->nlaunch == 1 ? 0 : find_launch(J, j);
                    if (s != cached_launch) { /* a floating reciprocal makes the per-piece division cheap */
                        cached_launch = s;
                        inverse_threads = 1.0 / (double)J->launch_threads[s];
                    }
                    int64_t local = j - J->launch_start[s];
                    T = J->launch_threads[s];
                    here = min64(J->launch_start[s + 1] - j, count);
                    int64_t step = (int64_t)((double)local * inverse_threads); /* off by at most one: fix */
                    t = local - step * T;
                    if (t < 0) { step--; t += T; }
                    if (t >= T) { step++; t -= T; }
                    ii = step & (U - 1); /* U is 2 or 4 */
                    counter = J->launch_counter[s] + (uint64_t)(step >> (U == 4 ? 2 : 1));
                }
                for (int64_t q = 0; q < here; q++) {
                    L.c0[n] = (uint32_t)counter;
                    L.c1[n] = (uint32_t)(counter >> 32);
                    L.c2[n] = (uint32_t)t;
                    L.c3[n] = (uint32_t)((uint64_t)t >> 32);
                    L.ii[n] = (uint8_t)ii;
                    if (++n == BATCH) {
                        philox_lanes(&L, n, key0, key1);
                        words_t W = lanes_from(&L, 0);
                        emit(J, &W, n, batch_e0);
                        batch_e0 += n;
                        n = 0;
                    }
                    if (apply4) {
                        if (++ii == 4) { ii = 0; t++; }
                    } else if (++t == T) { /* next step of the grid-stride loop */
                        t = 0;
                        if (++ii == U) { ii = 0; counter++; }
                    }
                }
                j += here;
                count -= here;
                e += here;
            }
        }
        c = 0;
        if (++p == J->ninner) { p = 0; r++; }
    }
    if (n) {
        philox_lanes(&L, n, key0, key1);
        words_t W = lanes_from(&L, 0);
        emit(J, &W, n, batch_e0);
    }
}

/* ---- parallel plan: tasks taken by worker threads through an atomic counter ---- */

typedef struct {
    int64_t launch; /* -1: local elements [a, b); else: call k = a of this launch, threads [b, c) */
    int64_t a, b, c;
} task_t;

#define ELEMENTS_PER_TASK 16384
#define CALLS_PER_TASK 4096

typedef struct {
    task_t *tasks;
    int64_t count, capacity;
} task_list;

static int push(task_list *list, int64_t launch, int64_t a, int64_t b, int64_t c) {
    if (list->count == list->capacity) {
        int64_t capacity = list->capacity ? 2 * list->capacity : 256;
        task_t *grown = (task_t *)realloc(list->tasks, (size_t)capacity * sizeof(task_t));
        if (!grown) return -1;
        list->tasks = grown;
        list->capacity = capacity;
    }
    list->tasks[list->count++] = (task_t){launch, a, b, c};
    return 0;
}

/* One contiguous run: split by calls (not by elements), so that each call is computed once even when its
 * U elements lie T apart. */
static int plan_single_run(const vrng_job *J, task_list *list) {
    const int64_t j0 = J->row_base[0] + J->inner_off[0], j1 = j0 + J->run;
    for (int s = find_launch(J, j0); s < J->nlaunch && J->launch_start[s] < j1; s++) {
        int64_t start = J->launch_start[s];
        int64_t lo = max64(j0, start) - start, hi = min64(j1, J->launch_start[s + 1]) - start;
        int64_t block = J->launch_threads[s] * J->unroll;
        for (int64_t k = lo / block; k * block < hi; k++) {
            int64_t ranges[4][2];
            int count = call_ranges(J, s, k, lo, hi, ranges);
            for (int r = 0; r < count; r++)
                for (int64_t t = ranges[r][0]; t < ranges[r][1]; t += CALLS_PER_TASK)
                    if (push(list, s, k, t, min64(t + CALLS_PER_TASK, ranges[r][1]))) return -1;
        }
    }
    return 0;
}

static int plan_elements(const vrng_job *J, task_list *list, int64_t total) {
    (void)J;
    for (int64_t e = 0; e < total; e += ELEMENTS_PER_TASK)
        if (push(list, -1, e, min64(e + ELEMENTS_PER_TASK, total), 0)) return -1;
    return 0;
}

typedef struct {
    const vrng_job *job;
    const task_list *list;
    int64_t next; /* next task to take (atomic) */
} pool_t;

static void *work(void *arg) {
    pool_t *pool = (pool_t *)arg;
    const vrng_job *J = pool->job;
    const int64_t j0 = J->row_base[0] + J->inner_off[0], j1 = j0 + J->run; /* the run, for call tasks */
    for (;;) {
        int64_t i = __atomic_fetch_add(&pool->next, 1, __ATOMIC_RELAXED);
        if (i >= pool->list->count) return NULL;
        const task_t *task = &pool->list->tasks[i];
        if (task->launch < 0) {
            fill_elements(J, task->a, task->b);
        } else {
            int s = (int)task->launch;
            int64_t start = J->launch_start[s];
            int64_t lo = max64(j0, start) - start, hi = min64(j1, J->launch_start[s + 1]) - start;
            fill_calls(J, s, task->a, task->b, task->c, lo, hi, start - j0);
        }
    }
}

#define MAX_WORKERS 256

int64_t vrng_abi_version(void) { return VRNG_ABI_VERSION; }

/* Returns 0 on success, -1 when memory for the task list could not be allocated. */
int64_t vrng_fill(const vrng_job *J) {
    const int64_t total = J->nrows * J->ninner * J->run;
    if (total <= 0) return 0;
    task_list list = {0, 0, 0};
    int single_run = J->nrows == 1 && J->ninner == 1 && J->op != OP_BERNOULLI_TENSOR;
    if (single_run ? plan_single_run(J, &list) : plan_elements(J, &list, total)) {
        free(list.tasks);
        return -1;
    }
    pool_t pool = {J, &list, 0};
    int64_t workers = min64(min64(J->num_threads, list.count), MAX_WORKERS);
    pthread_t helpers[MAX_WORKERS];
    int64_t started = 0;
    while (started + 1 < workers && pthread_create(&helpers[started], NULL, work, &pool) == 0) started++;
    work(&pool); /* the calling thread works too; if a helper failed to start, the others take its share */
    for (int64_t i = 0; i < started; i++) pthread_join(helpers[i], NULL);
    free(list.tasks);
    return 0;
}

/* One pass over an index tensor: min and max (for bounds checks) and whether it is a step-1 range. */
int64_t vrng_scan_index(const int64_t *index, int64_t n, int64_t *min_max) {
    int64_t lo = n ? index[0] : 0, hi = lo, step_one = n >= 1;
    for (int64_t i = 1; i < n; i++) {
        lo = index[i] < lo ? index[i] : lo;
        hi = index[i] > hi ? index[i] : hi;
        step_one &= index[i] == index[i - 1] + 1;
    }
    min_max[0] = lo;
    min_max[1] = hi;
    return step_one;
}

/* Philox4x32-10 of n counters (for known-answer tests): out holds 4 words per counter. */
void vrng_philox(int64_t n, const uint32_t *c0, const uint32_t *c1, const uint32_t *c2, const uint32_t *c3,
                 uint32_t key0, uint32_t key1, uint32_t *out) {
    lanes_t L;
    for (int64_t i0 = 0; i0 < n; i0 += BATCH) {
        int m = n - i0 < BATCH ? (int)(n - i0) : BATCH;
        memcpy(L.c0, c0 + i0, 4 * (size_t)m);
        memcpy(L.c1, c1 + i0, 4 * (size_t)m);
        memcpy(L.c2, c2 + i0, 4 * (size_t)m);
        memcpy(L.c3, c3 + i0, 4 * (size_t)m);
        philox_lanes(&L, m, key0, key1);
        for (int i = 0; i < m; i++) {
            out[4 * (i0 + i) + 0] = L.w0[i];
            out[4 * (i0 + i) + 1] = L.w1[i];
            out[4 * (i0 + i) + 2] = L.w2[i];
            out[4 * (i0 + i) + 3] = L.w3[i];
        }
    }
}
