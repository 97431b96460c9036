/* The portable engine's optimizer update in one pass over the flat vectors (loaded by
 * ondevice/engines/update_kernel.py with ctypes; built for each platform by _build/kernels.py).
 *
 * Each function computes what the optimizer graph (artifacts/portable_optimizer.py) computes, in the
 * same float32 operations in the same order, so the results are the graph's bit for bit: built with
 * -ffp-contract=off (no fused multiply-add) and -fno-math-errno (sqrt is the instruction, which IEEE 754
 * rounds exactly, like ONNX Runtime's Sqrt). The graph makes twelve passes over the vectors; this makes one.
 *
 * No libc call: the library loads on any glibc. On x86_64 the loop is compiled three times (AVX-512,
 * AVX2, SSE2) and the widest the CPU has runs (the same operations on more lanes: the same bits).
 */
#include <stddef.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#define ODT_KERNEL_ABI 1

int odt_abi(void) { return ODT_KERNEL_ABI; }

/* AdamW as ORT's AdamWOptimizer (adam_mode 1), with the gradient scaled by `clip` (1 without clipping):
 *   g' = g clip;  m = m b1 + g' c1;  v = v b2 + (g' c2) g'
 *   w = w - (m lr_corrected) / (sqrt(v) + eps);  w = w - w lr_decay   (only when lr_decay != 0) */
static inline __attribute__((always_inline)) void adamw_loop(
    float *restrict w, const float *restrict g, float *restrict m, float *restrict v, size_t n, float b1, float c1,
    float b2, float c2, float eps, float lr_corrected, float lr_decay, float clip) {
    if (lr_decay != 0.0f) {
        for (size_t i = 0; i < n; i++) {
            float gi = g[i] * clip; /* clip 1: g exactly */
            float mi = m[i] * b1 + gi * c1;
            float vi = v[i] * b2 + (gi * c2) * gi;
            float moved = w[i] - (mi * lr_corrected) / (__builtin_sqrtf(vi) + eps);
            m[i] = mi;
            v[i] = vi;
            w[i] = moved - moved * lr_decay;
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            float gi = g[i] * clip; /* clip 1: g exactly */
            float mi = m[i] * b1 + gi * c1;
            float vi = v[i] * b2 + (gi * c2) * gi;
            m[i] = mi;
            v[i] = vi;
            w[i] = w[i] - (mi * lr_corrected) / (__builtin_sqrtf(vi) + eps);
        }
    }
}

/* SGD as ORT's SGDOptimizerV2: w = w - (g clip) lr */
static inline __attribute__((always_inline)) void sgd_loop(float *restrict w, const float *restrict g, size_t n,
                                                           float lr, float clip) {
    for (size_t i = 0; i < n; i++) {
        float gi = g[i] * clip; /* clip 1: g exactly */
        w[i] = w[i] - gi * lr;
    }
}

#define ADAMW_ARGS                                                                                                    \
    float *restrict w, const float *restrict g, float *restrict m, float *restrict v, size_t n, float b1, float c1,   \
        float b2, float c2, float eps, float lr_corrected, float lr_decay, float clip
#define ADAMW_CALL w, g, m, v, n, b1, c1, b2, c2, eps, lr_corrected, lr_decay, clip
#define SGD_ARGS float *restrict w, const float *restrict g, size_t n, float lr, float clip
#define SGD_CALL w, g, n, lr, clip

#if defined(__x86_64__)
__attribute__((target("avx512f"))) static void adamw_avx512(ADAMW_ARGS) { adamw_loop(ADAMW_CALL); }
__attribute__((target("avx2"))) static void adamw_avx2(ADAMW_ARGS) { adamw_loop(ADAMW_CALL); }
__attribute__((target("avx512f"))) static void sgd_avx512(SGD_ARGS) { sgd_loop(SGD_CALL); }
__attribute__((target("avx2"))) static void sgd_avx2(SGD_ARGS) { sgd_loop(SGD_CALL); }

static int limit = 2;

/* What the CPU and the OS offer (CPUID and XCR0: the OS saves the wide registers), read once; at most `limit`. */
static int widest(void) {
    static int found = -1;
    if (found < 0) {
        unsigned a, b, c, d, xcr0 = 0;
        int level = 0;
        if (__get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 27)) && (c & (1u << 28))) { /* OSXSAVE, AVX */
            __asm__("xgetbv" : "=a"(xcr0), "=d"(d) : "c"(0));
            if ((xcr0 & 0x6) == 0x6 && __get_cpuid_count(7, 0, &a, &b, &c, &d)) { /* XMM and YMM state */
                level = (b & (1u << 16)) && (xcr0 & 0xE6) == 0xE6 ? 2 : (b & (1u << 5)) ? 1 : 0;
            }
        }
        found = level;
    }
    return found < limit ? found : limit;
}
#else
static int widest(void) { return 0; }
#endif

/* The instruction set the update runs on: 0 the baseline (SSE2 on x86_64, NEON on aarch64), 1 AVX2, 2 AVX-512. */
int odt_isa(void) { return widest(); }

/* Run on at most `level` (tests run every variant the CPU has; 2 lifts the limit). */
void odt_limit_isa(int level) {
#if defined(__x86_64__)
    limit = level;
#else
    (void)level;
#endif
}

void odt_adamw(ADAMW_ARGS) {
#if defined(__x86_64__)
    switch (widest()) {
    case 2: adamw_avx512(ADAMW_CALL); return;
    case 1: adamw_avx2(ADAMW_CALL); return;
    }
#endif
    adamw_loop(ADAMW_CALL);
}

void odt_sgd(SGD_ARGS) {
#if defined(__x86_64__)
    switch (widest()) {
    case 2: sgd_avx512(SGD_CALL); return;
    case 1: sgd_avx2(SGD_CALL); return;
    }
#endif
    sgd_loop(SGD_CALL);
}

/* The sum of the squares of g, accumulated in double (clipping's norm; the graph's ReduceSumSquare sums
 * float32 in its own order, so the clipping coefficient may differ from the graph's in its last bit). */
double odt_sum_squares(const float *g, size_t n) {
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        for (size_t k = 0; k < 4; k++) acc[k] += (double)g[i + k] * (double)g[i + k];
    }
    for (; i < n; i++) acc[0] += (double)g[i] * (double)g[i];
    return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}
