/* Native kernels of the CPU engine, for decode passes and prefills: projections (up to MAX_ROWS token
 * rows), RoPE, KV appends and paged attention. Compiled on the user's machine by pie_engine_cpu.native
 * with -O3 -march=native.
 *
 * At a handful of rows a projection reads its whole weight for very little arithmetic: its speed is
 * the speed of streaming the weight from memory. Each thread here takes one contiguous block of
 * weight rows and reads it front to back, one row at a time, so every core runs a single sequential
 * stream that the hardware prefetchers follow. The vectors are GCC/Clang vector extensions of VEC
 * floats, exactly one register of the target: 16 with AVX-512, 8 with AVX2, else 4 (SSE, NEON).
 *
 * All arrays are row-major float32. x is [tokens, cols], a weight is [rows, cols], y is [tokens, rows].
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

/* One register, never more: GCC keeps a vector wider than the target's registers in memory, and an
 * AVX2 build of 16-float vectors ran decode attention and small projections many times slower than
 * the AVX-512 build. */
#if defined(__AVX512F__)
#define VEC 16
#elif defined(__AVX2__)
#define VEC 8
#else
#define VEC 4
#endif

typedef float vecf __attribute__((vector_size(VEC * 4)));
typedef float vecf_unaligned __attribute__((vector_size(VEC * 4), aligned(4)));
typedef int veci __attribute__((vector_size(VEC * 4)));

#define MAX_TOKENS 8 /* token rows one pass over the weight serves; more rows loop over token blocks */
#define PARALLEL_MIN_ELEMENTS 65536 /* below this many weight elements, one thread is faster */

static inline vecf vload(const float *p) { return *(const vecf_unaligned *)p; }
static inline void vstore(float *p, vecf v) { *(vecf_unaligned *)p = v; }

/* value in every lane. Subtracting zero is exact for every float (-0 included), so the compiler makes a
 * plain broadcast of it; adding zero is not (-0 + 0 is +0), and `(vecf){0} + value` cost a scalar add
 * before every broadcast. */
static inline vecf vsplat(float value) { return value - (vecf){0}; }

/* Lanes of a where mask is set (all ones), else of b. */
static inline vecf vselect(veci mask, vecf a, vecf b) {
    veci a_bits, b_bits, bits;
    memcpy(&a_bits, &a, sizeof a);
    memcpy(&b_bits, &b, sizeof b);
    bits = (a_bits & mask) | (b_bits & ~mask);
    vecf out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* e^x for VEC floats at once, to about 2 ulp: x = n ln2 + r with |r| <= ln2/2, e^r by its degree-6
 * Taylor polynomial, 2^n built in the exponent bits. Inputs are clamped to [-87, 88], where float's
 * e^x is normal, so softmax and SiLU never see an infinity or NaN from here. (libm's expf runs one
 * value at a time unless -ffast-math, which would change the rest of the arithmetic too.) */
static inline vecf vexp(vecf x) {
    const vecf round = vsplat(12582912.0f); /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    x = vselect(x < vsplat(-87.0f), vsplat(-87.0f), x);
    x = vselect(x > vsplat(88.0f), vsplat(88.0f), x);
    vecf n = (x * vsplat(1.44269504f) + round) - round;
    vecf r = x - n * vsplat(0.693145752f) - n * vsplat(1.42860677e-6f);
    vecf p = vsplat(1.0f / 720);
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    veci bits = (__builtin_convertvector(n, veci) + 127) << 23;
    vecf scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

typedef float vec8 __attribute__((vector_size(32)));
typedef float vec4 __attribute__((vector_size(16)));

#if defined(__clang__) || __GNUC__ >= 12
#define HAVE_SHUFFLES 1
#endif

/* The sum of a vector's halves. By shuffles where the compiler has them (clang, GCC 12+): taking the
 * halves by memcpy made GCC keep the vector, and every loop that adds into it, in memory, and the
 * attention's dot products waited a store-to-load round trip per vector. */
#if VEC == 16
static inline vec8 halves8(vecf v) {
#ifdef HAVE_SHUFFLES
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    vec8 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    return lo + hi;
#endif
}
#endif

static inline vec4 halves4(vec8 v) {
#ifdef HAVE_SHUFFLES
    return __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#else
    vec4 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    return lo + hi;
#endif
}

/* A pairwise sum by halves, in vector registers: log2(VEC) dependent additions deep instead of VEC. */
static inline float vsum(vecf v) {
#if VEC == 16
    vec4 s4 = halves4(halves8(v));
#elif VEC == 8
    vec4 s4 = halves4(v);
#else
    vec4 s4 = v;
#endif
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* values[i] = e^(values[i] - shift) for i < n; returns their sum. */
static float exp_shifted(float *values, long n, float shift) {
    vecf sums = {0};
    long i = 0;
    for (; i + VEC <= n; i += VEC) {
        vecf e = vexp(vload(values + i) - shift);
        vstore(values + i, e);
        sums += e;
    }
    float total = vsum(sums);
    for (; i < n; i++) total += values[i] = expf(values[i] - shift);
    return total;
}

/* The highest of x[0 .. n), -inf when n is 0: four vectors of running maxima. A scalar maximum, kept
 * while the scores were made, waited on the previous comparison at every score and slowed batch-1 decode
 * attention. One vector of them still waited on its last comparison, every VEC scores. */
static float peak_of(const float *x, long n) {
    vecf tops[4] = {vsplat(-INFINITY), vsplat(-INFINITY), vsplat(-INFINITY), vsplat(-INFINITY)};
    long i = 0;
    for (; i + 4 * VEC <= n; i += 4 * VEC)
        for (int c = 0; c < 4; c++) {
            vecf v = vload(x + i + c * VEC);
            tops[c] = vselect(v > tops[c], v, tops[c]);
        }
    for (; i + VEC <= n; i += VEC) {
        vecf v = vload(x + i);
        tops[0] = vselect(v > tops[0], v, tops[0]);
    }
    float top = -INFINITY;
    for (int c = 0; c < 4; c++)
        for (int u = 0; u < VEC; u++) top = tops[c][u] > top ? tops[c][u] : top;
    for (; i < n; i++) top = x[i] > top ? x[i] : top;
    return top;
}

/* Floats ahead of the read position that the single-row loop asks for, non-temporally: decode ran a
 * little faster than with the hardware prefetchers alone (512 and 2048 no better). */
#define PREFETCH_AHEAD 1024

/* Asks for the n floats from p on (n a multiple of 16: one 64-byte line each) into the outer caches
 * (locality 1: prefetcht2 on x86). The non-temporal hint (prefetchnta) filled only L1 on an Intel
 * Emerald Rapids VM, where the float32 and F16 decode steps then ran much slower
 * (benchmarks/native_ab.py); the Q4_1 step was unchanged. */
static inline void prefetch_floats(const float *p, int n) {
    for (int i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 1);
}

/* out[t] = dot(row, x[t]) for t < tokens (<= MAX_TOKENS), x rows `cols` apart. */
static inline void dot_tokens(const float *restrict row, const float *restrict x, long tokens, long cols,
                              float *restrict out) {
    if (tokens == 1) {
        vecf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        long i = 0;
        for (; i + 4 * VEC <= cols; i += 4 * VEC) {
            prefetch_floats(row + i + PREFETCH_AHEAD, 4 * VEC);
            a0 += vload(row + i) * vload(x + i);
            a1 += vload(row + i + VEC) * vload(x + i + VEC);
            a2 += vload(row + i + 2 * VEC) * vload(x + i + 2 * VEC);
            a3 += vload(row + i + 3 * VEC) * vload(x + i + 3 * VEC);
        }
        for (; i + VEC <= cols; i += VEC) a0 += vload(row + i) * vload(x + i);
        float s = vsum((a0 + a1) + (a2 + a3));
        for (; i < cols; i++) s += row[i] * x[i];
        out[0] = s;
        return;
    }
    vecf acc[MAX_TOKENS];
    for (long t = 0; t < tokens; t++) acc[t] = (vecf){0};
    long i = 0;
    for (; i + VEC <= cols; i += VEC) {
        vecf w = vload(row + i);
        for (long t = 0; t < tokens; t++) acc[t] += w * vload(x + t * cols + i);
    }
    for (long t = 0; t < tokens; t++) {
        float s = vsum(acc[t]);
        for (long j = i; j < cols; j++) s += row[j] * x[t * cols + j];
        out[t] = s;
    }
}

/* The projections' blocks: ROW_BLOCK weight rows by TOKEN_BLOCK tokens, whose sums, weight vectors and
 * token vector all stay in registers. With 32 vector registers (AVX-512, NEON), 4 x 6: 29 of them,
 * faster than blocks of four tokens in batched decode steps. With 16 (AVX2, SSE), 3 x 4: all 16 of them,
 * faster than 4 x 2 blocks, weights streamed from memory or hot.
 *
 * MAX_ROWS: token rows a native projection takes; the caller hands more to BLAS. Inside the engine the
 * native kernels beat numpy's OpenBLAS far past where a projection alone says they should (alone,
 * OpenBLAS's SkylakeX kernels win a 3072x576 projection from a few dozen rows): a pass that mixes the
 * two also mixes OpenBLAS's threads with this pool's, and a pass that stays native does not. In the
 * engine, native decode batches and prefills up to 2048 tokens (the prefill attention in tiles) beat
 * OpenBLAS's Haswell kernels and beat or matched its SkylakeX ones; at 4000 tokens SkylakeX's won: 2048
 * rows. NEON keeps 16, its count before the blocks (not measured). */
#if defined(__AVX512F__)
#define ROW_BLOCK 4
#define TOKEN_BLOCK 6
#define MAX_ROWS 2048
#elif defined(__aarch64__)
#define ROW_BLOCK 4
#define TOKEN_BLOCK 6
#define MAX_ROWS 16
#else
#define ROW_BLOCK 3
#define TOKEN_BLOCK 4
#define MAX_ROWS 2048
#endif

/* Keeps v in a register from here on: the compiler may no longer fold its load into the instructions
 * that use it. */
#if defined(__x86_64__) || defined(__i386__)
#define HOLD_IN_REGISTER(v) __asm__("" : "+v"(v))
#elif defined(__aarch64__)
#define HOLD_IN_REGISTER(v) __asm__("" : "+w"(v))
#else
#define HOLD_IN_REGISTER(v) ((void)0)
#endif

/* y[j, i] = dot(w[i], x[j]) for i < ROW_BLOCK weight rows and j < tokens <= TOKEN_BLOCK (w and x rows
 * `cols` apart, y rows `rows` apart); `tokens` is a constant where it is called, so the loops unroll.
 * Each weight vector loaded serves every token and each token vector every row of the block: the loop
 * is bound by multiply-adds, not loads (a row at a time loads a token vector per multiply-add). The
 * vectors are held in registers: GCC otherwise folds the token vector's load into each of the
 * multiply-adds (AVX-512), and with AVX2 it reloaded the weight vectors from the stack or the weight for
 * every token; held, both ran faster. The loop also asks for the next block of weight rows, ROW_BLOCK
 * vectors' worth per step. */
static inline void dot_block(const float *restrict w, const float *restrict x, long cols, float *restrict y,
                             long rows, const int tokens) {
    vecf a[TOKEN_BLOCK][ROW_BLOCK];
    for (int t = 0; t < tokens; t++)
        for (int r = 0; r < ROW_BLOCK; r++) a[t][r] = (vecf){0};
    long i = 0;
    for (; i + VEC <= cols; i += VEC) {
        prefetch_floats(w + ROW_BLOCK * cols + ROW_BLOCK * i, ROW_BLOCK * VEC);
        vecf weights[ROW_BLOCK];
        for (int r = 0; r < ROW_BLOCK; r++) {
            weights[r] = vload(w + r * cols + i);
            HOLD_IN_REGISTER(weights[r]);
        }
        for (int t = 0; t < tokens; t++) {
            vecf v = vload(x + t * cols + i);
            HOLD_IN_REGISTER(v);
            for (int r = 0; r < ROW_BLOCK; r++) a[t][r] += weights[r] * v;
        }
    }
    for (int t = 0; t < tokens; t++)
        for (int r = 0; r < ROW_BLOCK; r++) {
            float s = vsum(a[t][r]);
            for (long j = i; j < cols; j++) s += w[r * cols + j] * x[t * cols + j];
            y[t * rows + r] = s;
        }
}

/* y[t, r] = dot(w[r], x[t]) for rows [lo, hi) and every token, one row at a time, MAX_TOKENS tokens per pass. */
static void project_rows_singly(const float *restrict w, const float *restrict x, float *restrict y, long tokens,
                                long rows, long cols, long lo, long hi) {
    float out[MAX_TOKENS];
    for (long first = 0; first < tokens; first += MAX_TOKENS) {
        long n = tokens - first < MAX_TOKENS ? tokens - first : MAX_TOKENS;
        for (long r = lo; r < hi; r++) {
            dot_tokens(w + r * cols, x + first * cols, n, cols, out);
            for (long t = 0; t < n; t++) y[(first + t) * rows + r] = out[t];
        }
    }
}

/* A block's last tokens - t < TOKEN_BLOCK tokens, n of them: a constant count in each call, for the
 * unrolled loops. */
#define LAST_TOKENS(n)                                                                                             \
    case n:                                                                                                        \
        if (n < TOKEN_BLOCK) dot_block(block, rest, cols, out, rows, n);                                           \
        break

/* Bytes of token rows (x) that a chunk's weight blocks sweep at a time: half the L2 cache, where the tile
 * stays while every block of the chunk's weight rows passes over it; 256 KiB where the size is unknown.
 * All 512 tokens at once (1.2 MiB of x at 576 columns, 3 MiB at 1536), each block of rows reread them
 * from L3: projections and prefills ran slower than tiled. */
static long tile_bytes(void) {
    static atomic_long bytes;
    long known = atomic_load_explicit(&bytes, memory_order_relaxed);
    if (!known) {
#ifdef _SC_LEVEL2_CACHE_SIZE /* glibc's; macOS has no such name */
        long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#else
        long l2 = 0;
#endif
        known = l2 > 0 ? l2 / 2 : 256 * 1024;
        atomic_store_explicit(&bytes, known, memory_order_relaxed);
    }
    return known;
}

/* y[t, r] = dot(w[r], x[t]) for rows [lo, hi) and every token. From two tokens on, blocks of ROW_BLOCK
 * rows by TOKEN_BLOCK tokens, a tile of tokens (tile_bytes) at a time: each block of weight rows is read
 * from memory once per tile, the tile from L2; rows left over one at a time.
 * One token streams row by row (dot_tokens), as a batch-1 decode does. */
static void project_rows(const float *restrict w, const float *restrict x, float *restrict y, long tokens,
                         long rows, long cols, long lo, long hi) {
    long blocked = tokens > 1 ? lo + (hi - lo) / ROW_BLOCK * ROW_BLOCK : lo;
    if (blocked > lo) { /* one token never takes the blocks: no tile to size on the decode path */
        long tile = tile_bytes() / 4 / cols / TOKEN_BLOCK * TOKEN_BLOCK;
        if (tile < TOKEN_BLOCK) tile = TOKEN_BLOCK;
        for (long first = 0; first < tokens; first += tile) {
            long last = first + tile < tokens ? first + tile : tokens;
            for (long r = lo; r < blocked; r += ROW_BLOCK) {
                const float *block = w + r * cols;
                long t = first;
                for (; t + TOKEN_BLOCK <= last; t += TOKEN_BLOCK)
                    dot_block(block, x + t * cols, cols, y + t * rows + r, rows, TOKEN_BLOCK);
                const float *rest = x + t * cols;
                float *out = y + t * rows + r;
                switch (last - t) {
                    LAST_TOKENS(5);
                    LAST_TOKENS(4);
                    LAST_TOKENS(3);
                    LAST_TOKENS(2);
                    LAST_TOKENS(1);
                default: break;
                }
            }
        }
    }
    project_rows_singly(w, x, y, tokens, rows, cols, blocked, hi);
}

/* Token rows a native projection takes (MAX_ROWS says why so many). */
int pie_max_rows(void) { return MAX_ROWS; }

/* Weights in their stored types. A weight is `const void *` with a type code, GGML's numbering: a row of
 * a block type is cols / 32 blocks, each a float16 scale d (and for Q4_1 a float16 minimum m) then its
 * quants: Q8_0 32 int8 (x = d q), Q4_0 16 bytes of two nibbles (x = d (q - 8)), Q4_1 the same nibbles
 * (x = d q + m); the low nibbles are elements 0-15 of the block, the high ones 16-31. Q5_0 adds a fifth
 * bit to each nibble, bit i of a 32-bit word before the nibbles for element i (x = d (q - 16)). F16 rows
 * are float16, BF16 rows bfloat16 (float32's top 16 bits). The K-quants' rows are cols / 256 super-blocks of eight groups of 32 (k_block_factors and
 * k_group_source say how each is packed): Q4_K and Q5_K give each group a 6-bit scale and minimum under the
 * super-block's float16 d and dmin (x = d sc q - dmin m, q of 4 or 5 bits), Q6_K each half-group of 16 an
 * int8 scale (x = d sc (q - 32), q of 6 bits). An integer path takes a group as it takes a block of 32.
 *
 * Two ways to multiply them, as llama.cpp's and as a float kernel would:
 *  - int8 activations (W_ACT_INT8): each activation row is quantized per block of 32 to int8 with a float
 *    scale (and the block's scaled sum, for Q4_1's minimum and Q4_0's offset), and every block's dot
 *    product is an integer one: AVX2's maddubs (u8 x s8 pairs into s16) and madd (into s32), or VNNI's
 *    vpdpbusd in one step where the CPU has it (dot8), the sign of Q8_0's weights moved onto the activations
 *    first. About 4 instructions a block of 32.
 *  - int16 activations (W_ACT_INT16): the same per block with 16-bit steps (2^15 levels, finer than float16's
 *    mantissa) and madd (s16 x s16 pairs into s32; VNNI's vpdpwssd, dot16) on the weights widened to 16 bits: about twice the
 *    instructions of int8, and results that differ from float activations' by about 1e-5 relative. With AVX-512
 *    VNNI, batch 1 on Q8_0, Q5_0, Q4_0 and the K-quants splits each activation into two bytes instead (gemv_split).
 *  - float activations (W_ACT_FLOAT): a few weight rows at a time are dequantized into a buffer that stays
 *    in L1/L2 and the float kernels (project_rows) run over it, so results differ from the dequantized
 *    float32 model's only by summation order.
 * pie_quant_config picks one for later calls (and can force the scalar code, for tests); the default is
 * set by the engine (native.py says which and why). The integer GEMVs serve passes of at most
 * `integer_max_tokens` tokens; longer ones (batched decode, prefill) take the float path, where one
 * dequantized row serves every token and the float kernels' register blocks beat those GEMVs, or, with
 * int16 activations on AVX-512 VNNI, from MAX_TOKENS + 1 tokens on, the panels (takes_panels), whose
 * register blocks are integer ones. */
enum {
    W_F32 = 0, W_F16 = 1, W_Q4_0 = 2, W_Q4_1 = 3, W_Q5_0 = 6, W_Q8_0 = 8, W_Q4_K = 12, W_Q5_K = 13, W_Q6_K = 14,
    W_BF16 = 30
};
enum { W_ACT_FLOAT = 0, W_ACT_INT8 = 1, W_ACT_INT16 = 2 };
#define QBLOCK 32
#define KBLOCK 256 /* elements of a K-quant super-block: KBLOCK / QBLOCK groups */
static int quant_activations = W_ACT_FLOAT;
static int quant_scalar = 0; /* 1: the portable loops even where AVX2 is compiled in */
static long integer_max_tokens = 0;

int pie_quant_config(int activations, int scalar, long max_tokens) {
    quant_activations = activations;
    quant_scalar = scalar;
    integer_max_tokens = max_tokens;
#if defined(__AVX2__)
    return 1; /* the AVX2 kernels are in this build */
#elif defined(__aarch64__)
    return 1; /* the NEON kernels are */
#else
    return 0;
#endif
}

static inline long weight_row_bytes(int type, long cols) {
    switch (type) {
    case W_F16:
    case W_BF16: return 2 * cols;
    case W_Q8_0: return cols / QBLOCK * 34;
    case W_Q4_0: return cols / QBLOCK * 18;
    case W_Q4_1: return cols / QBLOCK * 20;
    case W_Q5_0: return cols / QBLOCK * 22;
    case W_Q4_K: return cols / KBLOCK * 144;
    case W_Q5_K: return cols / KBLOCK * 176;
    case W_Q6_K: return cols / KBLOCK * 210;
    default: return 4 * cols;
    }
}

static inline int is_k_quant(int type) { return type == W_Q4_K || type == W_Q5_K || type == W_Q6_K; }

static inline int is_half(int type) { return type == W_F16 || type == W_BF16; }

long pie_weight_row_bytes(int type, long cols) { return weight_row_bytes(type, cols); }

static inline float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | p[1] << 8);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#elif defined(__aarch64__)
    __fp16 half;
    memcpy(&half, &h, 2);
    return (float)half;
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0x1f)
        bits = sign | 0x7f800000u | mantissa << 13;
    else if (exponent)
        bits = sign | (exponent + 112) << 23 | mantissa << 13;
    else if (!mantissa)
        bits = sign;
    else { /* subnormal: normalise */
        exponent = 113;
        while (!(mantissa & 0x400)) mantissa <<= 1, exponent--;
        bits = sign | exponent << 23 | (mantissa & 0x3ff) << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline float bf16_to_float(const uint8_t *p) {
    uint32_t bits = (uint32_t)(p[0] | p[1] << 8) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The 6-bit scale and minimum of group g (0-7) of a Q4_K/Q5_K super-block, from its 12 bytes of them: groups
 * 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (minima); groups 4-7 in the nibbles of bytes 8-11,
 * their top two bits in the top bits of bytes 0-7. */
static inline void k_scale_min(const uint8_t *packed, int g, int *scale, int *min) {
    if (g < 4) {
        *scale = packed[g] & 63;
        *min = packed[g + 4] & 63;
    } else {
        *scale = (packed[g + 4] & 15) | (packed[g - 4] >> 6) << 4;
        *min = (packed[g + 4] >> 4) | (packed[g] >> 6) << 4;
    }
}

/* The factors of a super-block's eight groups, its float16 fields converted once: element i of group g is
 * x = scale[g][i / 16] q - min[g]. Q4_K is d, dmin, 12 bytes of scales, 128 of nibbles; Q5_K puts 32 bytes
 * of fifth bits before the nibbles; Q6_K is 128 bytes of low nibbles, 64 of top bit pairs, 16 int8 scales, d. */
struct k_factors {
    float scale[KBLOCK / QBLOCK][2], min[KBLOCK / QBLOCK];
};

#if defined(__AVX2__)
/* A Q4_K or Q5_K super-block's eight group scales (d times each 6-bit scale) and minima (dmin times each 6-bit
 * minimum). Its 6-bit fields are regrouped as 32-bit words, scales in the bytes of the first two, minima in the
 * last two (k_scale_min's layout, four fields a word). */
static inline void k_scales_minima_avx2(const uint8_t *block, __m256 *scale, __m256 *min) {
    uint32_t packed[3], fields[4];
    memcpy(packed, block + 4, 12);
    fields[0] = packed[0] & 0x3f3f3f3fu;
    fields[1] = (packed[2] & 0x0f0f0f0fu) | (packed[0] >> 6 & 0x03030303u) << 4;
    fields[2] = packed[1] & 0x3f3f3f3fu;
    fields[3] = (packed[2] >> 4 & 0x0f0f0f0fu) | (packed[1] >> 6 & 0x03030303u) << 4;
    __m128i bytes = _mm_loadu_si128((const __m128i *)fields);
    *scale = _mm256_mul_ps(_mm256_set1_ps(half_to_float(block)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
    *min = _mm256_mul_ps(_mm256_set1_ps(half_to_float(block + 2)),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))));
}
#endif

static inline void k_block_factors(int type, const uint8_t *block, struct k_factors *out) {
#if defined(__AVX2__)
    /* Eight groups at once (a K-quant GEMV spent about as long on these as on its dot products): Q6_K's 16
     * int8 scales are scale[][] in order; Q4_K/Q5_K's come from k_scales_minima_avx2. */
    if (type == W_Q6_K) {
        __m128i scales = _mm_loadu_si128((const __m128i *)(block + 192));
        __m256 d = _mm256_set1_ps(half_to_float(block + 208));
        _mm256_storeu_ps(out->scale[0], _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales))));
        _mm256_storeu_ps(out->scale[4], _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scales, 8)))));
        _mm256_storeu_ps(out->min, _mm256_setzero_ps());
        return;
    }
    __m256 scale, min;
    k_scales_minima_avx2(block, &scale, &min);
    __m256 low = _mm256_unpacklo_ps(scale, scale), high = _mm256_unpackhi_ps(scale, scale); /* each group's twice */
    _mm256_storeu_ps(out->scale[0], _mm256_permute2f128_ps(low, high, 0x20));
    _mm256_storeu_ps(out->scale[4], _mm256_permute2f128_ps(low, high, 0x31));
    _mm256_storeu_ps(out->min, min);
#else
    if (type == W_Q6_K) {
        float d = half_to_float(block + 208);
        const int8_t *scales = (const int8_t *)(block + 192);
        for (int g = 0; g < KBLOCK / QBLOCK; g++) {
            out->scale[g][0] = d * (float)scales[2 * g];
            out->scale[g][1] = d * (float)scales[2 * g + 1];
            out->min[g] = 0.0f;
        }
        return;
    }
    float d = half_to_float(block), dmin = half_to_float(block + 2);
    for (int g = 0; g < KBLOCK / QBLOCK; g++) {
        int scale, min;
        k_scale_min(block + 4, g, &scale, &min);
        out->scale[g][0] = out->scale[g][1] = d * (float)scale;
        out->min[g] = dmin * (float)min;
    }
#endif
}

/* Where group g's quants lie. Q4_K/Q5_K: the nibbles of 32 bytes shared by groups 2j and 2j+1 (low for the
 * even one), Q5_K's fifth bit bit g of 32 bytes. Q6_K: each half of 128 elements has 64 bytes of nibbles
 * (groups 0-1 the low nibbles of bytes 0-31 and 32-63, groups 2-3 the high ones) and 32 bytes of top bit
 * pairs (bits 2k and 2k+1 for group k of the half). */
struct k_group_source {
    const uint8_t *nibbles, *high;
    int nibble_shift, high_shift;
};

static inline struct k_group_source k_group_source(int type, const uint8_t *block, int g) {
    struct k_group_source at;
    if (type == W_Q6_K) {
        int half = g / 4, k = g % 4;
        at.nibbles = block + 64 * half + 32 * (k & 1);
        at.nibble_shift = k & 2 ? 4 : 0;
        at.high = block + 128 + 32 * half;
        at.high_shift = 2 * k;
    } else {
        at.nibbles = block + (type == W_Q5_K ? 48 : 16) + 32 * (g / 2);
        at.nibble_shift = g & 1 ? 4 : 0;
        at.high = type == W_Q5_K ? block + 16 : NULL;
        at.high_shift = g;
    }
    return at;
}

/* Group g's quants, portably. */
static inline void k_group_quants(int type, const uint8_t *block, int g, int8_t *out) {
    struct k_group_source at = k_group_source(type, block, g);
    for (int i = 0; i < QBLOCK; i++) {
        int q = at.nibbles[i] >> at.nibble_shift & 15;
        if (type == W_Q6_K)
            q = (q | (at.high[i] >> at.high_shift & 3) << 4) - 32;
        else if (at.high)
            q |= (at.high[i] >> at.high_shift & 1) << 4;
        out[i] = (int8_t)q;
    }
}

/* Bytes of one K-quant super-block. */
static inline long k_block_bytes(int type) { return weight_row_bytes(type, KBLOCK); }

#if defined(__AVX2__)
static void dequantize_groups_avx2(int type, const uint8_t *row, long cols, float *restrict out);
#endif
#if defined(__aarch64__)
static void dequantize_groups_neon(int type, const uint8_t *row, long cols, float *restrict out);
#endif

/* VEC elements of an F16 or BF16 row from p, as floats: by F16C's, AVX-512's or NEON's conversion, a bfloat16 by
 * widening it into the top half of a 32-bit lane. */
static inline vecf load_half(int type, const uint8_t *p) {
#if VEC == 16
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return (vecf)(type == W_F16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
#elif VEC == 8 && defined(__F16C__)
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return (vecf)(type == W_F16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
#elif defined(__aarch64__)
    uint16x4_t h = vreinterpret_u16_u8(vld1_u8(p));
    return (vecf)(type == W_F16 ? vcvt_f32_f16(vreinterpret_f16_u16(h)) : vreinterpretq_f32_u32(vshll_n_u16(h, 16)));
#else
    vecf out;
    for (int i = 0; i < VEC; i++) out[i] = type == W_F16 ? half_to_float(p + 2 * i) : bf16_to_float(p + 2 * i);
    return out;
#endif
}

/* Asks for the n bytes from p on (64-byte lines) into the outer caches, as prefetch_floats. */
static inline void prefetch_bytes(const uint8_t *p, int n) {
    for (int i = 0; i < n; i += 64) __builtin_prefetch(p + i, 0, 1);
}

/* Asks for the bytes of the block-quantized weight row that lies 4 * PREFETCH_AHEAD bytes (the float loops'
 * distance) past `row`. Those GEMVs compute long on each of a row's few lines, and the hardware prefetchers alone
 * left a core's streamed decode step far slower than the same weights hot (docs/perf-notes.md). */
static inline void prefetch_row_ahead(const uint8_t *row, long row_size) {
    prefetch_bytes(row + 4 * PREFETCH_AHEAD, (int)row_size);
}

/* y[r] = dot, an expression of `row` (weight row r of `base`), for rows lo..hi of a GEMV, each row's successors
 * asked for ahead. In a switch on the weight type, one use per case keeps each case's type a constant. */
#define GEMV_ROWS(dot)                                                                                             \
    for (long r = lo; r < hi; r++) {                                                                               \
        const uint8_t *row = base + r * row_size;                                                                  \
        prefetch_row_ahead(row, row_size);                                                                         \
        y[r] = (dot);                                                                                              \
    }

/* dot(row, x) on an F16 or BF16 row, each weight vector converted in registers: dot_tokens' single-token
 * loop, with half the bytes to stream and no row buffer to write and read back. For one token only: from
 * two on, a few rows converted into a buffer for the float kernels' register blocks ran faster. Inlined with
 * `type` a constant (dot_half_row). */
static inline __attribute__((always_inline)) float dot_half_row_of(int type, const uint8_t *restrict row,
                                                                  const float *restrict x, long cols) {
    vecf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    long i = 0;
    for (; i + 4 * VEC <= cols; i += 4 * VEC) {
        prefetch_bytes(row + 2 * i + 4 * PREFETCH_AHEAD, 8 * VEC); /* 4 KiB ahead, as the float loop */
        a0 += load_half(type, row + 2 * i) * vload(x + i);
        a1 += load_half(type, row + 2 * (i + VEC)) * vload(x + i + VEC);
        a2 += load_half(type, row + 2 * (i + 2 * VEC)) * vload(x + i + 2 * VEC);
        a3 += load_half(type, row + 2 * (i + 3 * VEC)) * vload(x + i + 3 * VEC);
    }
    for (; i + VEC <= cols; i += VEC) a0 += load_half(type, row + 2 * i) * vload(x + i);
    float s = vsum((a0 + a1) + (a2 + a3));
    for (; i < cols; i++) s += (type == W_F16 ? half_to_float(row + 2 * i) : bf16_to_float(row + 2 * i)) * x[i];
    return s;
}

static float dot_half_row(int type, const uint8_t *row, const float *x, long cols) {
    return type == W_F16 ? dot_half_row_of(W_F16, row, x, cols) : dot_half_row_of(W_BF16, row, x, cols);
}

/* out[0 .. cols) = row `row` of a weight of type `type`, as float32. */
static void dequantize_row(int type, const uint8_t *row, long cols, float *restrict out) {
    long blocks = cols / QBLOCK;
    switch (type) {
    case W_F16: {
        long i = 0;
#if defined(__F16C__) && defined(__AVX2__)
        for (; i + 8 <= cols; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i))));
#elif defined(__aarch64__)
        for (; i + VEC <= cols; i += VEC) vstore(out + i, load_half(W_F16, row + 2 * i));
#endif
        for (; i < cols; i++) out[i] = half_to_float(row + 2 * i);
        break;
    }
    case W_BF16: {
        long i = 0;
        for (; i + VEC <= cols; i += VEC) vstore(out + i, load_half(W_BF16, row + 2 * i));
        for (; i < cols; i++) out[i] = bf16_to_float(row + 2 * i);
        break;
    }
    case W_Q8_0:
#if defined(__AVX2__)
        dequantize_groups_avx2(type, row, cols, out);
        break;
#endif
        for (long b = 0; b < blocks; b++, row += 34, out += QBLOCK) {
            float d = half_to_float(row);
            const int8_t *q = (const int8_t *)(row + 2);
            for (int i = 0; i < QBLOCK; i++) out[i] = d * (float)q[i];
        }
        break;
    case W_Q4_0:
    case W_Q4_1:
#if defined(__AVX2__)
        dequantize_groups_avx2(type, row, cols, out);
        break;
#endif
        for (long b = 0; b < blocks; b++, out += QBLOCK) {
            float d = half_to_float(row), m = type == W_Q4_1 ? half_to_float(row + 2) : -8.0f * d;
            const uint8_t *q = row + (type == W_Q4_1 ? 4 : 2);
            for (int i = 0; i < QBLOCK / 2; i++) {
                out[i] = d * (float)(q[i] & 15) + m;
                out[i + QBLOCK / 2] = d * (float)(q[i] >> 4) + m;
            }
            row += type == W_Q4_1 ? 20 : 18;
        }
        break;
    case W_Q5_0:
#if defined(__AVX2__)
        dequantize_groups_avx2(type, row, cols, out);
        break;
#elif defined(__aarch64__)
        dequantize_groups_neon(type, row, cols, out);
        break;
#endif
        for (long b = 0; b < blocks; b++, row += 22, out += QBLOCK) {
            float d = half_to_float(row);
            uint32_t high = (uint32_t)row[2] | (uint32_t)row[3] << 8 | (uint32_t)row[4] << 16 | (uint32_t)row[5] << 24;
            for (int i = 0; i < QBLOCK / 2; i++) {
                out[i] = d * (float)((int)((row[6 + i] & 15) | (high >> i & 1) << 4) - 16);
                out[i + QBLOCK / 2] = d * (float)((int)((row[6 + i] >> 4) | (high >> (i + 16) & 1) << 4) - 16);
            }
        }
        break;
    case W_Q4_K:
    case W_Q5_K:
    case W_Q6_K:
#if defined(__AVX2__)
        dequantize_groups_avx2(type, row, cols, out);
        break;
#elif defined(__aarch64__)
        dequantize_groups_neon(type, row, cols, out);
        break;
#endif
        for (long first = 0; first < cols; first += KBLOCK, row += k_block_bytes(type)) {
            struct k_factors factors;
            k_block_factors(type, row, &factors);
            for (int g = 0; g < KBLOCK / QBLOCK; g++, out += QBLOCK) {
                int8_t q[QBLOCK];
                k_group_quants(type, row, g, q);
                for (int i = 0; i < QBLOCK; i++) out[i] = factors.scale[g][i / 16] * (float)q[i] - factors.min[g];
            }
        }
        break;
    default:
        memcpy(out, row, sizeof(float) * cols);
    }
}

/* One activation block quantized: x ~ d q, and s = d * sum(q); 8-bit steps (int8 activations) or 16-bit. */
struct block_q8 {
    float d, s;
    int8_t q[QBLOCK];
};

struct block_q16 {
    float d, s;
    int16_t q[QBLOCK];
};

/* name(x, tokens, cols, out): rows of x [tokens, cols] into blocks [tokens, cols / 32], each block's scale its
 * largest |x| / levels, rounded to nearest (127 levels as llama.cpp's Q8_0/Q8_1, or 32767). */
#define DEFINE_QUANTIZE_ROWS(name, block, element, levels)                                                         \
    static void name(const float *x, long tokens, long cols, struct block *out) {                                  \
        long blocks = cols / QBLOCK;                                                                               \
        for (long t = 0; t < tokens; t++)                                                                          \
            for (long b = 0; b < blocks; b++) {                                                                    \
                const float *v = x + t * cols + b * QBLOCK;                                                        \
                struct block *quantized = out + t * blocks + b;                                                    \
                float top = 0.0f;                                                                                  \
                for (int i = 0; i < QBLOCK; i++) top = fabsf(v[i]) > top ? fabsf(v[i]) : top;                      \
                float d = top / (levels), inverse = d ? 1.0f / d : 0.0f;                                           \
                int sum = 0;                                                                                       \
                for (int i = 0; i < QBLOCK; i++) {                                                                 \
                    int q = (int)lrintf(v[i] * inverse);                                                           \
                    quantized->q[i] = (element)q;                                                                  \
                    sum += q;                                                                                      \
                }                                                                                                  \
                quantized->d = d;                                                                                  \
                quantized->s = d * (float)sum;                                                                     \
            }                                                                                                      \
    }

DEFINE_QUANTIZE_ROWS(quantize_rows, block_q8, int8_t, 127.0f)
DEFINE_QUANTIZE_ROWS(quantize_rows16, block_q16, int16_t, 32767.0f)

/* name(type, row, x, blocks): dot(weight row, activation row) over `blocks` blocks, integer activations of
 * one width; portable loops. */
#define DEFINE_DOT_SCALAR(name, block)                                                                             \
    static float name(int type, const uint8_t *row, const struct block *x, long blocks) {                          \
        float total = 0.0f;                                                                                        \
        struct k_factors factors;                                                                                  \
        for (long b = 0; b < blocks; b++) {                                                                        \
            const struct block *xb = x + b;                                                                        \
            if (is_k_quant(type)) {                                                                                \
                const uint8_t *block = row + b / (KBLOCK / QBLOCK) * k_block_bytes(type);                          \
                int g = (int)(b % (KBLOCK / QBLOCK));                                                              \
                if (g == 0) k_block_factors(type, block, &factors);                                                \
                int8_t q[QBLOCK];                                                                                  \
                k_group_quants(type, block, g, q);                                                                 \
                long low = 0, high = 0;                                                                            \
                for (int i = 0; i < QBLOCK / 2; i++) {                                                             \
                    low += q[i] * xb->q[i];                                                                        \
                    high += q[i + QBLOCK / 2] * xb->q[i + QBLOCK / 2];                                             \
                }                                                                                                  \
                total += xb->d * (factors.scale[g][0] * (float)low + factors.scale[g][1] * (float)high) -          \
                         factors.min[g] * xb->s;                                                                   \
                continue;                                                                                          \
            }                                                                                                      \
            float d = half_to_float(row);                                                                          \
            long sum = 0;                                                                                          \
            if (type == W_Q8_0) {                                                                                  \
                const int8_t *q = (const int8_t *)(row + 2);                                                       \
                for (int i = 0; i < QBLOCK; i++) sum += q[i] * xb->q[i];                                           \
                total += d * xb->d * (float)sum;                                                                   \
                row += 34;                                                                                         \
            } else if (type == W_Q5_0) {                                                                           \
                uint32_t bits = (uint32_t)row[2] | (uint32_t)row[3] << 8 | (uint32_t)row[4] << 16 |                \
                                (uint32_t)row[5] << 24;                                                            \
                for (int i = 0; i < QBLOCK / 2; i++)                                                               \
                    sum += (int)((row[6 + i] & 15) | (bits >> i & 1) << 4) * xb->q[i] +                            \
                           (int)((row[6 + i] >> 4) | (bits >> (i + 16) & 1) << 4) * xb->q[i + QBLOCK / 2];         \
                total += d * xb->d * (float)sum - 16.0f * d * xb->s;                                               \
                row += 22;                                                                                         \
            } else {                                                                                               \
                const uint8_t *q = row + (type == W_Q4_1 ? 4 : 2);                                                 \
                for (int i = 0; i < QBLOCK / 2; i++)                                                               \
                    sum += (q[i] & 15) * xb->q[i] + (q[i] >> 4) * xb->q[i + QBLOCK / 2];                           \
                float m = type == W_Q4_1 ? half_to_float(row + 2) : -8.0f * d;                                     \
                total += d * xb->d * (float)sum + m * xb->s;                                                       \
                row += type == W_Q4_1 ? 20 : 18;                                                                   \
            }                                                                                                      \
        }                                                                                                          \
        return total;                                                                                              \
    }

DEFINE_DOT_SCALAR(dot_q8_scalar, block_q8)
DEFINE_DOT_SCALAR(dot_q16_scalar, block_q16)

/* Runs `call` with TOKENS a constant 1-4 (the integer paths' passes are at most INTEGER_MAX_TOKENS long) or,
 * above, the variable `tokens`: with a constant count every token's sums stay in registers, where with a
 * variable one they lived on the stack and each block's multiply-add waited on a store and a reload. */
#define WITH_CONSTANT_TOKENS(tokens, call)                                                                         \
    switch (tokens) {                                                                                              \
    case 1: { const long TOKENS = 1; call; } break;                                                                \
    case 2: { const long TOKENS = 2; call; } break;                                                                \
    case 3: { const long TOKENS = 3; call; } break;                                                                \
    case 4: { const long TOKENS = 4; call; } break;                                                                \
    default: { const long TOKENS = tokens; call; } break;                                                          \
    }

#if defined(__AVX2__)
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Where AVX-512 VNNI is compiled in, the 16-bit integer paths take a block of 32 int16 in one 512-bit vector. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GEMV_ZMM 1
#endif

/* Integer dot products of 32-bit lanes: pairs of int16 (dot16) or quads of u8 x s8 (dot8), each lane's products
 * summed. AVX-512 VNNI (with VL) and AVX-VNNI do it in one instruction (vpdpwssd, vpdpbusd); plain AVX2 needs
 * madd, and for bytes maddubs then madd, which saturates at int16 where vpdpbusd does not: the weights and
 * activations these kernels pass (|a| <= 128 unsigned, |b| <= 127) never reach it, so both give the same sums. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __m256i dot16(__m256i a, __m256i b) { return _mm256_dpwssd_epi32(_mm256_setzero_si256(), a, b); }
static inline __m256i dot16_add(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
static inline __m256i dot8(__m256i a, __m256i b) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b); }
#elif defined(__AVXVNNI__)
static inline __m256i dot16(__m256i a, __m256i b) { return _mm256_dpwssd_avx_epi32(_mm256_setzero_si256(), a, b); }
static inline __m256i dot16_add(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
static inline __m256i dot8(__m256i a, __m256i b) { return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b); }
#else
static inline __m256i dot16(__m256i a, __m256i b) { return _mm256_madd_epi16(a, b); }
static inline __m256i dot16_add(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
static inline __m256i dot8(__m256i a, __m256i b) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
}
#endif

/* The 32 nibbles of a Q4 block as bytes 0..15, elements in order. */
static inline __m256i unpack_nibbles(const uint8_t *q) {
    __m128i packed = _mm_loadu_si128((const __m128i *)q);
    __m128i low = _mm_and_si128(packed, _mm_set1_epi8(15));
    __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15));
    return _mm256_set_m128i(high, low);
}

/* The 32 quants of a Q5_0 block as bytes 0..31: its nibbles with bit i of its 32-bit word as bit 4 of
 * element i (each byte picks the word's byte i / 8 and tests its bit i % 8). */
static inline __m256i unpack_q5_0(const uint8_t *block) {
    uint32_t bits;
    memcpy(&bits, block + 2, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__) /* the word is a byte mask: 16 where its bit is set */
    return _mm256_or_si256(unpack_nibbles(block + 6), _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(16)));
#else
    const __m256i byte_of_element = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bit_of_element = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), byte_of_element);
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit_of_element), bit_of_element);
    return _mm256_or_si256(unpack_nibbles(block + 6), _mm256_and_si256(set, _mm256_set1_epi8(16)));
#endif
}

/* The 32 quants of group g of a K-quant super-block as bytes, elements in order (k_group_quants', vectorized):
 * 0..15 or 0..31 for Q4_K and Q5_K, -32..31 for Q6_K. */
static inline __m256i unpack_k_group(int type, const uint8_t *block, int g) {
    struct k_group_source at = k_group_source(type, block, g);
    const __m256i fifteen = _mm256_set1_epi8(15);
    __m256i q = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)at.nibbles),
                                                  _mm_cvtsi32_si128(at.nibble_shift)), fifteen);
    if (!at.high) return q;
    __m256i high = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)at.high), _mm_cvtsi32_si128(at.high_shift));
    if (type == W_Q5_K) return _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(high, _mm256_set1_epi8(1)), 4));
    q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(high, _mm256_set1_epi8(3)), 4));
    return _mm256_sub_epi8(q, _mm256_set1_epi8(32));
}

/* out[t] = dot(row, x[t]) for t < tokens (x rows `blocks` groups apart) on a K-quant row, AVX2, 16-bit
 * activations (`wide`: the group widened to two vectors of 16 int16, madd'ed, one per scale) or 8-bit
 * (maddubs; Q6_K's quants are signed, so their sign moves onto the activations as Q8_0's do, and the two
 * half-group scales sit in the halves of the factor vector). A super-block's factors are decoded once and
 * each group is unpacked once for every token. Inlined with `type` and `wide` constants (dot_k_avx2), so
 * the groups' offsets and shifts are too. */
static inline __attribute__((always_inline)) void dot_k_avx2_of(int type, int wide, const uint8_t *row,
                                                                const void *x, long blocks, long tokens,
                                                                float *out) {
    __m256 sums_of[2][MAX_TOKENS]; /* even and odd groups' sums apart: their multiply-adds do not wait on each other */
    float offsets[MAX_TOKENS] = {0};
    for (long t = 0; t < tokens; t++) sums_of[0][t] = sums_of[1][t] = _mm256_setzero_ps();
#if defined(GEMV_ZMM)
    __m512 wide_of[2][MAX_TOKENS];
    for (long t = 0; t < tokens; t++) wide_of[0][t] = wide_of[1][t] = _mm512_setzero_ps();
#endif
    long stride = k_block_bytes(type);
    for (long first = 0; first < blocks; first += KBLOCK / QBLOCK) {
        const uint8_t *block = row + first / (KBLOCK / QBLOCK) * stride;
        struct k_factors factors;
        k_block_factors(type, block, &factors);
#pragma GCC unroll 8
        for (int g = 0; g < KBLOCK / QBLOCK; g++) {
            long b = first + g;
            __m256i w = unpack_k_group(type, block, g);
            __m256 *acc = sums_of[g & 1];
#if defined(GEMV_ZMM)
            if (wide && type == W_Q6_K) { /* one 512-bit vector: lanes 0-7 hold elements 0-15, 8-15 the rest */
                __m512i w16 = _mm512_cvtepi8_epi16(w);
                __m512 halves = _mm512_insertf32x8(_mm512_set1_ps(factors.scale[g][0]),
                                                   _mm256_set1_ps(factors.scale[g][1]), 1);
                for (long t = 0; t < tokens; t++) {
                    const struct block_q16 *xb = (const struct block_q16 *)x + t * blocks + b;
                    __m512i sums = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w16, _mm512_loadu_si512(xb->q));
                    __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(xb->d));
                    wide_of[g & 1][t] = _mm512_fmadd_ps(halves, scaled, wide_of[g & 1][t]);
                    offsets[t] -= factors.min[g] * xb->s;
                }
                continue;
            }
#endif
            if (wide) {
                __m128i w_low = _mm256_castsi256_si128(w), w_high = _mm256_extracti128_si256(w, 1);
                __m256i w0 = type == W_Q6_K ? _mm256_cvtepi8_epi16(w_low) : _mm256_cvtepu8_epi16(w_low);
                __m256i w1 = type == W_Q6_K ? _mm256_cvtepi8_epi16(w_high) : _mm256_cvtepu8_epi16(w_high);
                for (long t = 0; t < tokens; t++) {
                    const struct block_q16 *xb = (const struct block_q16 *)x + t * blocks + b;
                    __m256i x0 = _mm256_loadu_si256((const __m256i *)xb->q);
                    __m256i x1 = _mm256_loadu_si256((const __m256i *)(xb->q + 16));
                    if (type == W_Q6_K) {
                        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(factors.scale[g][0] * xb->d), _mm256_cvtepi32_ps(dot16(w0, x0)), acc[t]);
                        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(factors.scale[g][1] * xb->d), _mm256_cvtepi32_ps(dot16(w1, x1)), acc[t]);
                    } else {
                        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(factors.scale[g][0] * xb->d),
                                                 _mm256_cvtepi32_ps(dot16_add(dot16(w0, x0), w1, x1)), acc[t]);
                    }
                    offsets[t] -= factors.min[g] * xb->s;
                }
            } else {
                __m256 scales = _mm256_set_m128(_mm_set1_ps(factors.scale[g][1]), _mm_set1_ps(factors.scale[g][0]));
                __m256i magnitude = type == W_Q6_K ? _mm256_sign_epi8(w, w) : w;
                for (long t = 0; t < tokens; t++) {
                    const struct block_q8 *xb = (const struct block_q8 *)x + t * blocks + b;
                    __m256i xq = _mm256_loadu_si256((const __m256i *)xb->q);
                    if (type == W_Q6_K) xq = _mm256_sign_epi8(xq, w);
                    __m256i sums = dot8(magnitude, xq);
                    acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(scales, _mm256_set1_ps(xb->d)), _mm256_cvtepi32_ps(sums), acc[t]);
                    offsets[t] -= factors.min[g] * xb->s;
                }
            }
        }
    }
    for (long t = 0; t < tokens; t++) out[t] = hsum256(_mm256_add_ps(sums_of[0][t], sums_of[1][t])) + offsets[t];
#if defined(GEMV_ZMM)
    if (wide && type == W_Q6_K)
        for (long t = 0; t < tokens; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(wide_of[0][t], wide_of[1][t])) + offsets[t];
#endif
}

/* The 32 quants q of a group as floats: out[i] = scale[i / 16] q[i] - min, q signed or not. */
static inline void store_group_avx2(__m256i q, int is_signed, float scale_low, float scale_high, float min,
                                    float *out) {
    __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    __m256 offset = _mm256_set1_ps(min);
    for (int h = 0; h < 2; h++) {
        __m256 scale = _mm256_set1_ps(h ? scale_high : scale_low);
        __m128i eights[2] = {halves[h], _mm_unpackhi_epi64(halves[h], halves[h])};
        for (int e = 0; e < 2; e++) {
            __m256i wide = is_signed ? _mm256_cvtepi8_epi32(eights[e]) : _mm256_cvtepu8_epi32(eights[e]);
            _mm256_storeu_ps(out + 16 * h + 8 * e, _mm256_fmsub_ps(scale, _mm256_cvtepi32_ps(wide), offset));
        }
    }
}

/* dequantize_row for the block types and the K-quants, each block or group unpacked as the integer kernels
 * unpack it. */
static void dequantize_groups_avx2(int type, const uint8_t *row, long cols, float *restrict out) {
    if (type == W_Q8_0 || type == W_Q4_0 || type == W_Q4_1) {
        long stride = weight_row_bytes(type, QBLOCK);
        for (long b = 0; b < cols / QBLOCK; b++, row += stride, out += QBLOCK) {
            float d = half_to_float(row);
            if (type == W_Q8_0)
                store_group_avx2(_mm256_loadu_si256((const __m256i *)(row + 2)), 1, d, d, 0.0f, out);
            else if (type == W_Q4_0)
                store_group_avx2(unpack_nibbles(row + 2), 0, d, d, 8.0f * d, out);
            else { /* d q, then + m: two roundings, as the reference takes them (a fused d q + m may differ) */
                store_group_avx2(unpack_nibbles(row + 4), 0, d, d, 0.0f, out);
                __m256 m = _mm256_set1_ps(half_to_float(row + 2));
                for (int i = 0; i < QBLOCK; i += 8) _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(out + i), m));
            }
        }
        return;
    }
    if (type == W_Q5_0) {
        for (long b = 0; b < cols / QBLOCK; b++, row += 22, out += QBLOCK) {
            float d = half_to_float(row);
            store_group_avx2(unpack_q5_0(row), 0, d, d, 16.0f * d, out);
        }
        return;
    }
    for (long first = 0; first < cols; first += KBLOCK, row += k_block_bytes(type)) {
        struct k_factors factors;
        k_block_factors(type, row, &factors);
        for (int g = 0; g < KBLOCK / QBLOCK; g++, out += QBLOCK)
            store_group_avx2(unpack_k_group(type, row, g), type == W_Q6_K, factors.scale[g][0], factors.scale[g][1],
                             factors.min[g], out);
    }
}

static void dot_k_avx2(int type, int wide, const uint8_t *row, const void *x, long blocks, long tokens, float *out) {
#define DOT_K_CASE(type_code)                                                                                      \
    case type_code:                                                                                                \
        if (wide)                                                                                                  \
            WITH_CONSTANT_TOKENS(tokens, dot_k_avx2_of(type_code, 1, row, x, blocks, TOKENS, out))                 \
        else                                                                                                       \
            WITH_CONSTANT_TOKENS(tokens, dot_k_avx2_of(type_code, 0, row, x, blocks, TOKENS, out))                 \
        break
    switch (type) {
        DOT_K_CASE(W_Q4_K);
        DOT_K_CASE(W_Q5_K);
        DOT_K_CASE(W_Q6_K);
    default: break;
    }
#undef DOT_K_CASE
}

/* out[t] = dot(row, x[t]) for t < tokens (x rows `blocks` blocks apart), int8 activations, AVX2. The
 * weight block is unpacked once and serves every token. */
static inline __attribute__((always_inline)) void dot_q8_avx2_of(int type, const uint8_t *row,
                                                                const struct block_q8 *x, long blocks, long tokens,
                                                                float *out) {
    __m256 acc[MAX_TOKENS];
    float offsets[MAX_TOKENS] = {0};
    for (long t = 0; t < tokens; t++) acc[t] = _mm256_setzero_ps();
    long stride = type == W_Q8_0 ? 34 : type == W_Q5_0 ? 22 : type == W_Q4_1 ? 20 : 18;
    for (long b = 0; b < blocks; b++, row += stride) {
        float d = half_to_float(row);
        if (type == W_Q8_0) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(row + 2));
            __m256i magnitude = _mm256_sign_epi8(w, w);
            for (long t = 0; t < tokens; t++) {
                const struct block_q8 *xb = x + t * blocks + b;
                __m256i signed_x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xb->q), w);
                __m256i sums = dot8(magnitude, signed_x);
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(sums), acc[t]);
            }
        } else {
            __m256i w = type == W_Q5_0 ? unpack_q5_0(row) : unpack_nibbles(row + (type == W_Q4_1 ? 4 : 2));
            float m = type == W_Q4_1 ? half_to_float(row + 2) : type == W_Q5_0 ? -16.0f * d : -8.0f * d;
            for (long t = 0; t < tokens; t++) {
                const struct block_q8 *xb = x + t * blocks + b;
                __m256i sums = dot8(w, _mm256_loadu_si256((const __m256i *)xb->q));
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(sums), acc[t]);
                offsets[t] += m * xb->s;
            }
        }
    }
    for (long t = 0; t < tokens; t++) out[t] = hsum256(acc[t]) + offsets[t];
}

static void dot_q8_avx2(int type, const uint8_t *row, const struct block_q8 *x, long blocks, long tokens,
                        float *out) {
    WITH_CONSTANT_TOKENS(tokens, dot_q8_avx2_of(type, row, x, blocks, TOKENS, out))
}

/* A weight block's 32 quants as two vectors of 16 int16 (elements 0-15, 16-31). Q4's 16 packed bytes widen to
 * int16 first, whose low and high nibbles are then the two halves. */
static inline __attribute__((always_inline)) void block_quants16(int type, const uint8_t *block, __m256i *w0,
                                                                __m256i *w1) {
    if (type == W_Q8_0) {
        *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 2)));
        *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 18)));
    } else if (type == W_Q5_0) {
        __m256i w = unpack_q5_0(block);
        *w0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(w));
        *w1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1));
    } else {
        __m256i packed = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(block + (type == W_Q4_1 ? 4 : 2))));
        *w0 = _mm256_and_si256(packed, _mm256_set1_epi16(15));
        *w1 = _mm256_srli_epi16(packed, 4);
    }
}

/* Weight block `row`'s quants widened to two vectors of 16 int16, with its scale d and offset m (x = d q + m). */
static inline __attribute__((always_inline)) void widen_block16(int type, const uint8_t *row, __m256i *w0, __m256i *w1,
                                                               float *d, float *m) {
    block_quants16(type, row, w0, w1);
    *d = half_to_float(row);
    *m = type == W_Q4_1 ? half_to_float(row + 2) : type == W_Q5_0 ? -16.0f * *d : type == W_Q4_0 ? -8.0f * *d : 0.0f;
}

/* Block b of `row` (at `block`) times block b of every token's activations, into acc[t] and offsets[t]. */
static inline __attribute__((always_inline)) void block16_into(int type, const uint8_t *block,
                                                              const struct block_q16 *x, long blocks, long b,
                                                              long tokens, __m256 *acc, float *offsets) {
    __m256i w0, w1;
    float d, m;
    widen_block16(type, block, &w0, &w1, &d, &m);
    for (long t = 0; t < tokens; t++) {
        const struct block_q16 *xb = x + t * blocks + b;
        __m256i sums = dot16_add(dot16(w0, _mm256_loadu_si256((const __m256i *)xb->q)), w1,
                                 _mm256_loadu_si256((const __m256i *)(xb->q + 16)));
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(sums), acc[t]);
        offsets[t] += m * xb->s;
    }
}

/* dot_q8_avx2 with 16-bit activations: each weight block widened to int16 and madd'ed. Even and odd blocks add into two sets of sums, so that consecutive
 * blocks' multiply-adds do not wait on each other. */
static inline __attribute__((always_inline)) void dot_q16_avx2_of(int type, const uint8_t *row,
                                                                 const struct block_q16 *x, long blocks, long tokens,
                                                                 float *out) {
    __m256 even[MAX_TOKENS], odd[MAX_TOKENS];
    float even_offsets[MAX_TOKENS] = {0}, odd_offsets[MAX_TOKENS] = {0};
    for (long t = 0; t < tokens; t++) even[t] = odd[t] = _mm256_setzero_ps();
    long stride = weight_row_bytes(type, QBLOCK), b = 0;
    for (; b + 2 <= blocks; b += 2, row += 2 * stride) {
        block16_into(type, row, x, blocks, b, tokens, even, even_offsets);
        block16_into(type, row + stride, x, blocks, b + 1, tokens, odd, odd_offsets);
    }
    if (b < blocks) block16_into(type, row, x, blocks, b, tokens, even, even_offsets);
    for (long t = 0; t < tokens; t++)
        out[t] = hsum256(_mm256_add_ps(even[t], odd[t])) + (even_offsets[t] + odd_offsets[t]);
}

static void dot_q16_avx2(int type, const uint8_t *row, const struct block_q16 *x, long blocks, long tokens,
                         float *out) {
    switch (type) {
    case W_Q8_0: WITH_CONSTANT_TOKENS(tokens, dot_q16_avx2_of(W_Q8_0, row, x, blocks, TOKENS, out)) break;
    case W_Q5_0: WITH_CONSTANT_TOKENS(tokens, dot_q16_avx2_of(W_Q5_0, row, x, blocks, TOKENS, out)) break;
    case W_Q4_1: WITH_CONSTANT_TOKENS(tokens, dot_q16_avx2_of(W_Q4_1, row, x, blocks, TOKENS, out)) break;
    default: WITH_CONSTANT_TOKENS(tokens, dot_q16_avx2_of(W_Q4_0, row, x, blocks, TOKENS, out)) break;
    }
}

/* One weight row times one token's 16-bit activations (a GEMV, batch 1), for Q8_0, Q4_0, Q4_1 and Q5_0.
 * Per block, the weight's scale and offset meet the activation's in one multiply: [d, m] (Q4_1's two halves in
 * one conversion; d twice for the types whose offset is a constant times d) times [x.d, x.s], whose first lane
 * scales the block's integer sums and whose second accumulates the offsets (AVX-512 VNNI builds take all but Q4_1
 * to gemv_split below). Even and odd blocks add into two sums, so that consecutive blocks' additions do not wait
 * on each other. */
static inline __attribute__((always_inline)) float dot_q16_row(int type, const uint8_t *row,
                                                               const struct block_q16 *x, long blocks) {
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    __m128 offsets = _mm_setzero_ps(); /* lane 1: the sum over blocks of [m or d] * x.s */
    long stride = weight_row_bytes(type, QBLOCK);
    for (long b = 0; b < blocks; b++, row += stride) {
        __m128 factors;
        if (type == W_Q4_1) {
            int32_t halves;
            memcpy(&halves, row, 4);
            factors = _mm_cvtph_ps(_mm_cvtsi32_si128(halves));
        } else {
            factors = _mm_set1_ps(half_to_float(row));
        }
        __m128 scaled = _mm_mul_ps(factors, _mm_castpd_ps(_mm_load_sd((const double *)&x[b].d)));
        if (type != W_Q8_0) offsets = _mm_add_ps(offsets, scaled);
        __m256i w0, w1;
        block_quants16(type, row, &w0, &w1);
        __m256i sums = dot16_add(dot16(w0, _mm256_loadu_si256((const __m256i *)x[b].q)), w1,
                                 _mm256_loadu_si256((const __m256i *)(x[b].q + 16)));
        __m256 scale = _mm256_broadcastss_ps(scaled);
        if (b & 1)
            odd = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), odd);
        else
            even = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), even);
    }
    float total = hsum256(_mm256_add_ps(even, odd));
    float offset = _mm_cvtss_f32(_mm_movehdup_ps(offsets));
    return total + (type == W_Q4_0 ? -8.0f * offset : type == W_Q5_0 ? -16.0f * offset : offset);
}

/* y[r] for rows lo..hi of a Q8_0, Q4_0, Q4_1 or Q5_0 weight times one token's 16-bit activations. */
static void gemv_q16_avx2(int type, const uint8_t *base, long row_size, const struct block_q16 *x, long blocks,
                          float *y, long lo, long hi) {
    switch (type) {
    case W_Q8_0: GEMV_ROWS(dot_q16_row(W_Q8_0, row, x, blocks)) break;
    case W_Q5_0: GEMV_ROWS(dot_q16_row(W_Q5_0, row, x, blocks)) break;
    case W_Q4_1: GEMV_ROWS(dot_q16_row(W_Q4_1, row, x, blocks)) break;
    case W_Q4_0: GEMV_ROWS(dot_q16_row(W_Q4_0, row, x, blocks)) break;
    }
}

#if defined(GEMV_ZMM)
/* The batch-1 GEMV of Q8_0, Q5_0, Q4_0 and the K-quants again, two blocks a 512-bit vector. A 16-bit activation
 * q is 256 h + l, h = q >> 8 signed and l = q & 255 unsigned, and vpdpbusd multiplies quads of unsigned by signed
 * bytes: l times a signed weight quant w are its own operands, and h times w is w times h where w is unsigned
 * (the 4- and 5-bit K-quants' quants), else (w + c) times h less c h, the weight moved into unsigned range (by
 * flipping its top bit, c = 128, or Q6_K's stored q + 32) and the correction the accumulator's starting value.
 * So the quants stay bytes where the GEMVs above widen them to int16, and the integer sums are the same, exactly
 * (at most 4 * 128 * 32768 a lane). Q4_0's offset of 8 (Q5_0's 16) comes off its quants first. The activations
 * are split once a pass (split_activations16), laid out as the weight's bytes arrive: two blocks (or K-quant
 * groups) one after the other, but for Q4_0 and Q5_0, whose low nibbles of both blocks (elements 0-15) come
 * before their high ones (16-31). Q4_1 keeps the GEMV above, as fast as this one once its minimum's products are added
 * (docs/perf-notes.md). */
struct __attribute__((aligned(64))) split_q16 {
    int8_t high[2 * QBLOCK];
    uint8_t low[2 * QBLOCK];
    int32_t start[16]; /* minus the weights' offset (128, or Q6_K's 32) times the sum of each lane's four h */
    float d[16];       /* the activation scale of each lane's block (zero past the last block) */
    float sums[16];    /* d times the sum of each lane's four q (Q4_K's minima meet these) */
};

static inline int takes_split_gemv(int type, long tokens) {
    return tokens == 1 && !quant_scalar && quant_activations == W_ACT_INT16 &&
           (type == W_Q8_0 || type == W_Q5_0 || type == W_Q4_0 || is_k_quant(type));
}

/* The byte of a pair that element i of block `half` (0 or 1) takes. */
static inline int split_position(int type, int half, int i) {
    if (type != W_Q4_0 && type != W_Q5_0) return half * QBLOCK + i;
    return (i >= QBLOCK / 2) * QBLOCK + half * (QBLOCK / 2) + i % (QBLOCK / 2);
}

/* x's 16-bit blocks as pairs for weights of `type`; an odd last block pairs with a zero one. */
static void split_blocks16(int type, const struct block_q16 *x, long blocks, struct split_q16 *pairs) {
    memset(pairs, 0, sizeof *pairs * ((blocks + 1) / 2));
    for (long b = 0; b < blocks; b++) {
        struct split_q16 *pair = pairs + b / 2;
        int half = (int)(b % 2);
        for (int i = 0; i < QBLOCK; i++) {
            int q = x[b].q[i], at = split_position(type, half, i);
            pair->high[at] = (int8_t)(q >> 8);
            pair->low[at] = (uint8_t)(q & 255);
            pair->start[at / 4] -= (type == W_Q6_K ? 32 : 128) * (q >> 8);
            pair->d[at / 4] = x[b].d;
            pair->sums[at / 4] += x[b].d * (float)q;
        }
    }
}

/* One token's row x quantized to 16 bits and split into pairs, or NULL when memory cannot be had. */
static struct split_q16 *split_activations16(int type, const float *x, long cols) {
    long blocks = cols / QBLOCK, pairs = (blocks + 1) / 2;
    struct split_q16 *split = aligned_alloc(64, sizeof *split * pairs);
    struct block_q16 *quantized = malloc(sizeof *quantized * blocks);
    if (split && quantized) {
        quantize_rows16(x, 1, cols, quantized);
        split_blocks16(type, quantized, blocks, split);
    } else {
        free(split);
        split = NULL;
    }
    free(quantized);
    return split;
}

static inline int16_t load_half_bits(const uint8_t *p) {
    int16_t bits;
    memcpy(&bits, p, 2);
    return bits;
}

/* A pair's (or, with `single`, one last block's) quants as signed bytes, laid out as a pair of activations is. */
static inline __attribute__((always_inline)) __m512i split_weight(int type, const uint8_t *row, int single) {
    long stride = weight_row_bytes(type, QBLOCK);
    if (type == W_Q8_0) {
        __m256i first = _mm256_loadu_si256((const __m256i *)(row + 2));
        return single ? _mm512_zextsi256_si512(first)
                      : _mm512_inserti64x4(_mm512_castsi256_si512(first),
                                           _mm256_loadu_si256((const __m256i *)(row + stride + 2)), 1);
    }
    long quants = type == W_Q5_0 ? 6 : 2;
    __m128i first = _mm_loadu_si128((const __m128i *)(row + quants));
    __m256i packed = single ? _mm256_zextsi128_si256(first)
                            : _mm256_inserti128_si256(_mm256_castsi128_si256(first),
                                                      _mm_loadu_si128((const __m128i *)(row + stride + quants)), 1);
    __m256i nibble = _mm256_set1_epi8(15);
    __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(packed, nibble)),
                                   _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble), 1);
    if (type == W_Q4_0) return _mm512_sub_epi8(w, _mm512_set1_epi8(8));
    /* Q5_0: bit i of a block's 32-bit word is bit 4 of its element i, here a byte mask in the nibbles' order */
    uint32_t bits[2] = {0, 0};
    memcpy(&bits[0], row + 2, 4);
    if (!single) memcpy(&bits[1], row + stride + 2, 4);
    __mmask64 fifth = (uint64_t)(bits[0] & 0xFFFF) | (uint64_t)(bits[1] & 0xFFFF) << 16 |
                      (uint64_t)(bits[0] >> 16) << 32 | (uint64_t)(bits[1] >> 16) << 48;
    return _mm512_sub_epi8(_mm512_mask_add_epi8(w, fifth, w, _mm512_set1_epi8(16)), _mm512_set1_epi8(16));
}

/* The float16 scale of each block of a pair (or of one last block) on its block's lanes. */
static inline __attribute__((always_inline)) __m512 split_scales(int type, const uint8_t *row, int single) {
    long stride = weight_row_bytes(type, QBLOCK);
    __mmask16 first_lanes = type == W_Q4_0 || type == W_Q5_0 ? 0x0F0F : 0x00FF;
    __m256i halves = single ? _mm256_maskz_set1_epi16(first_lanes, load_half_bits(row))
                            : _mm256_mask_set1_epi16(_mm256_set1_epi16(load_half_bits(row)), (__mmask16)~first_lanes,
                                                     load_half_bits(row + stride));
    return _mm512_cvtph_ps(halves);
}

/* acc plus a pair's (or, with `single`, a last block's) products, in each block's lanes. */
static inline __attribute__((always_inline)) __m512 split_pair_step(int type, __m512 acc, const uint8_t *row,
                                                                    const struct split_q16 *x, int single) {
    __m512i w = split_weight(type, row, single);
    __m512i sums = _mm512_dpbusd_epi32(_mm512_load_si512(x->start), _mm512_xor_si512(w, _mm512_set1_epi8(-128)),
                                       _mm512_load_si512(x->high));
    sums = _mm512_dpbusd_epi32(_mm512_slli_epi32(sums, 8), _mm512_load_si512(x->low), w);
    __m512 scale = _mm512_mul_ps(split_scales(type, row, single), _mm512_load_ps(x->d));
    return _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums), acc);
}

static inline __attribute__((always_inline)) float dot_split_row(int type, const uint8_t *row,
                                                                 const struct split_q16 *x, long blocks) {
    long pair_bytes = 2 * weight_row_bytes(type, QBLOCK), p = 0;
    __m512 acc = _mm512_setzero_ps();
    for (; 2 * p + 1 < blocks; p++, row += pair_bytes) acc = split_pair_step(type, acc, row, x + p, 0);
    if (blocks & 1) acc = split_pair_step(type, acc, row, x + p, 1);
    return _mm512_reduce_add_ps(acc);
}

/* The K-quants on the same pairs, two groups of 32 a vector: a super-block's scales (and Q4_K's minima) are
 * decoded once, and each pair's reach its lanes by one permute. Q4_K's 32-byte chunk of nibbles holds two
 * groups (low nibbles, then high ones), unpacked from one broadcast by shifting the upper half's words by 4;
 * its minima times the lanes' activation sums are subtracted as they go. Q6_K's quants are 6-bit, u = q + 32 in
 * [0, 64): two groups' low nibbles are one 64-byte run of ql, and their two high bits come from one broadcast of
 * qh shifted per half; its int8 scales each cover 16 elements, four lanes. */
static inline __attribute__((always_inline)) float dot_split_q4_k_row(int type, const uint8_t *row,
                                                                      const struct split_q16 *x, long blocks) {
    __m512 acc = _mm512_setzero_ps();
    const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    long quants = type == W_Q5_K ? 48 : 16;
    for (long group = 0; group < blocks; group += KBLOCK / QBLOCK, row += k_block_bytes(type)) {
        __m256 scale, min;
        k_scales_minima_avx2(row, &scale, &min);
        __m512 scales = _mm512_castps256_ps512(scale), minima = _mm512_castps256_ps512(min);
#pragma GCC unroll 4
        for (int chunk = 0; chunk < KBLOCK / (2 * QBLOCK); chunk++) {
            const struct split_q16 *pair = x + group / 2 + chunk;
            __m512i packed = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row + quants + 32 * chunk)));
            __m512i w = _mm512_and_si512(_mm512_srlv_epi16(packed, shifts), _mm512_set1_epi8(15));
            if (type == W_Q5_K) { /* bit g of qh[i] is group g's fifth bit: bits 2 chunk and 2 chunk + 1 here */
                __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row + 16)));
                int low_shift = 2 * chunk - 4; /* right, to bit 4 (left where negative); the high half's 1 more */
                __m512i by = _mm512_inserti64x4(_mm512_set1_epi16((short)abs(low_shift)),
                                                _mm256_set1_epi16((short)abs(low_shift + 1)), 1);
                high = low_shift < 0 ? _mm512_sllv_epi16(high, by) : _mm512_srlv_epi16(high, by);
                w = _mm512_or_si512(w, _mm512_and_si512(high, _mm512_set1_epi8(16)));
            }
            __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_load_si512(pair->high));
            sums = _mm512_dpbusd_epi32(_mm512_slli_epi32(sums, 8), _mm512_load_si512(pair->low), w);
            __m512i lanes = _mm512_inserti64x4(_mm512_set1_epi32(2 * chunk), _mm256_set1_epi32(2 * chunk + 1), 1);
            __m512 d = _mm512_mul_ps(_mm512_permutexvar_ps(lanes, scales), _mm512_load_ps(pair->d));
            acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sums), acc);
            acc = _mm512_fnmadd_ps(_mm512_permutexvar_ps(lanes, minima), _mm512_load_ps(pair->sums), acc);
        }
    }
    return _mm512_reduce_add_ps(acc);
}

static inline float dot_split_q6_k_row(const uint8_t *row, const struct split_q16 *x, long blocks) {
    __m512 acc = _mm512_setzero_ps();
    const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    for (long group = 0; group < blocks; group += KBLOCK / QBLOCK, row += k_block_bytes(W_Q6_K)) {
        __m128i packed_scales = _mm_loadu_si128((const __m128i *)(row + 192));
        __m512 scales = _mm512_mul_ps(_mm512_set1_ps(half_to_float(row + 208)),
                                      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(packed_scales)));
#pragma GCC unroll 4
        for (int p = 0; p < KBLOCK / (2 * QBLOCK); p++) { /* groups 2p, 2p + 1: half p / 2, k = 2 (p % 2) and k + 1 */
            const struct split_q16 *pair = x + group / 2 + p;
            __m512i nibbles = _mm512_loadu_si512(row + 64 * (p / 2));
            __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row + 128 + 32 * (p / 2))));
            high = p % 2 ? _mm512_srlv_epi16(high, right) : _mm512_sllv_epi16(high, left);
            if (p % 2) nibbles = _mm512_srli_epi16(nibbles, 4);
            __m512i u = _mm512_or_si512(_mm512_and_si512(nibbles, _mm512_set1_epi8(15)),
                                        _mm512_and_si512(high, _mm512_set1_epi8(0x30)));
            __m512i sums = _mm512_dpbusd_epi32(_mm512_load_si512(pair->start), u, _mm512_load_si512(pair->high));
            sums = _mm512_dpbusd_epi32(_mm512_slli_epi32(sums, 8), _mm512_load_si512(pair->low),
                                       _mm512_sub_epi8(u, _mm512_set1_epi8(32)));
            __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3); /* a scale per 16 */
            lanes = _mm512_add_epi32(lanes, _mm512_set1_epi32(4 * p));
            __m512 d = _mm512_mul_ps(_mm512_permutexvar_ps(lanes, scales), _mm512_load_ps(pair->d));
            acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sums), acc);
        }
    }
    return _mm512_reduce_add_ps(acc);
}

/* y[r] for rows lo..hi of a weight takes_split_gemv takes times one token's split activations. */
static void gemv_split(int type, const uint8_t *base, long row_size, const struct split_q16 *x, long blocks, float *y,
                       long lo, long hi) {
    switch (type) {
    case W_Q8_0: GEMV_ROWS(dot_split_row(W_Q8_0, row, x, blocks)) break;
    case W_Q5_0: GEMV_ROWS(dot_split_row(W_Q5_0, row, x, blocks)) break;
    case W_Q4_0: GEMV_ROWS(dot_split_row(W_Q4_0, row, x, blocks)) break;
    case W_Q4_K: GEMV_ROWS(dot_split_q4_k_row(W_Q4_K, row, x, blocks)) break;
    case W_Q5_K: GEMV_ROWS(dot_split_q4_k_row(W_Q5_K, row, x, blocks)) break;
    case W_Q6_K: GEMV_ROWS(dot_split_q6_k_row(row, x, blocks)) break;
    }
}
#endif
#endif

#if defined(__aarch64__)
/* The integer paths on ARM, the AVX2 kernels' counterparts. A weight block's 32 quants are unpacked once
 * into two vectors of 16 int8 (elements 0-15 and 16-31), every quant type's in int8 range (Q4 and Q5
 * unsigned, Q8_0 and Q6_K signed), and serve every token. int8 activations take sdot (vdotq_s32: four
 * int8 products summed into each int32 lane) where the target has it (armv8.2-a+dotprod and later), else
 * vmull_s8 (one product per int16 lane) and pairwise widening adds into int32 (vpadalq_s16); int16
 * activations take vmlal_s16 on the quants widened to 16 bits. Built and run here under qemu-user
 * (tests/test_native_neon.py); their speed is not measured on ARM hardware. */

/* acc + the products of w's and x's 16 int8 lanes, spread over its four int32 lanes (only their total is used:
 * the two ways spread them differently). */
static inline int32x4_t dot16_s8_neon(int32x4_t acc, int8x16_t w, int8x16_t x) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, w, x);
#else
    return vpadalq_s16(vpadalq_s16(acc, vmull_s8(vget_low_s8(w), vget_low_s8(x))), vmull_high_s8(w, x));
#endif
}

/* acc + the products of w's 16 int8 lanes, widened, and the 16 int16 activations at x. */
static inline int32x4_t dot16_s16_neon(int32x4_t acc, int8x16_t w, const int16_t *x) {
    int16x8_t low = vmovl_s8(vget_low_s8(w)), high = vmovl_high_s8(w), x0 = vld1q_s16(x), x1 = vld1q_s16(x + 8);
    acc = vmlal_s16(acc, vget_low_s16(low), vget_low_s16(x0));
    acc = vmlal_high_s16(acc, low, x0);
    acc = vmlal_s16(acc, vget_low_s16(high), vget_low_s16(x1));
    return vmlal_high_s16(acc, high, x1);
}

/* acc + a group's 16 quants w times activation block xb's elements from `first` on, at either width. */
static inline __attribute__((always_inline)) int32x4_t dot16_neon(int wide, int32x4_t acc, int8x16_t w,
                                                                  const void *xb, int first) {
    if (wide) return dot16_s16_neon(acc, w, ((const struct block_q16 *)xb)->q + first);
    return dot16_s8_neon(acc, w, vld1q_s8(((const struct block_q8 *)xb)->q + first));
}

/* Activation block `index` (token t's block b is t * blocks + b), at either width: its address, scale d and
 * scaled sum s. */
static inline __attribute__((always_inline)) const void *activation_block_neon(int wide, const void *x, long index,
                                                                              float *d, float *s) {
    if (wide) {
        const struct block_q16 *xb = (const struct block_q16 *)x + index;
        *d = xb->d, *s = xb->s;
        return xb;
    }
    const struct block_q8 *xb = (const struct block_q8 *)x + index;
    *d = xb->d, *s = xb->s;
    return xb;
}

/* The 32 quants of a Q8_0, Q4_0, Q4_1 or Q5_0 block, with its scale d and offset m (x = d q + m). Q5_0's
 * fifth bits: bit i of its 32-bit word for element i, each byte of the word tested against its eight bits. */
static inline __attribute__((always_inline)) int8x16x2_t unpack_block_neon(int type, const uint8_t *block, float *d,
                                                                           float *m) {
    *d = half_to_float(block);
    int8x16x2_t q;
    if (type == W_Q8_0) {
        q.val[0] = vld1q_s8((const int8_t *)(block + 2));
        q.val[1] = vld1q_s8((const int8_t *)(block + 18));
        *m = 0.0f;
        return q;
    }
    uint8x16_t packed = vld1q_u8(block + (type == W_Q4_1 ? 4 : type == W_Q5_0 ? 6 : 2));
    uint8x16_t low = vandq_u8(packed, vdupq_n_u8(15)), high = vshrq_n_u8(packed, 4);
    if (type == W_Q5_0) {
        const uint8x16_t bit_of_element = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
        const uint8x16_t sixteen = vdupq_n_u8(16);
        uint32_t bits;
        memcpy(&bits, block + 2, 4);
        uint8x16_t first = vcombine_u8(vdup_n_u8((uint8_t)bits), vdup_n_u8((uint8_t)(bits >> 8)));
        uint8x16_t second = vcombine_u8(vdup_n_u8((uint8_t)(bits >> 16)), vdup_n_u8((uint8_t)(bits >> 24)));
        low = vorrq_u8(low, vandq_u8(vtstq_u8(first, bit_of_element), sixteen));
        high = vorrq_u8(high, vandq_u8(vtstq_u8(second, bit_of_element), sixteen));
    }
    *m = type == W_Q4_1 ? half_to_float(block + 2) : type == W_Q5_0 ? -16.0f * *d : -8.0f * *d;
    q.val[0] = vreinterpretq_s8_u8(low);
    q.val[1] = vreinterpretq_s8_u8(high);
    return q;
}

/* The 32 quants of group g of a K-quant super-block (k_group_quants', vectorized): 0..15 or 0..31 for Q4_K
 * and Q5_K, -32..31 for Q6_K. */
static inline __attribute__((always_inline)) int8x16x2_t unpack_k_group_neon(int type, const uint8_t *block, int g) {
    struct k_group_source at = k_group_source(type, block, g);
    int8x16x2_t q;
    for (int h = 0; h < 2; h++) {
        uint8x16_t v = vandq_u8(vshlq_u8(vld1q_u8(at.nibbles + 16 * h), vdupq_n_s8((int8_t)-at.nibble_shift)),
                                vdupq_n_u8(15));
        if (at.high) {
            uint8x16_t high = vshlq_u8(vld1q_u8(at.high + 16 * h), vdupq_n_s8((int8_t)-at.high_shift));
            v = vorrq_u8(v, vshlq_n_u8(vandq_u8(high, vdupq_n_u8(type == W_Q6_K ? 3 : 1)), 4));
        }
        q.val[h] = type == W_Q6_K ? vsubq_s8(vreinterpretq_s8_u8(v), vdupq_n_s8(32)) : vreinterpretq_s8_u8(v);
    }
    return q;
}

/* A group's 32 quants q as floats: out[i] = scale[i / 16] q[i] - min. */
static inline void store_group_neon(int8x16x2_t q, float scale_low, float scale_high, float min, float *out) {
    float32x4_t offset = vdupq_n_f32(min);
    for (int h = 0; h < 2; h++) {
        float32x4_t scale = vdupq_n_f32(h ? scale_high : scale_low);
        int16x8_t eights[2] = {vmovl_s8(vget_low_s8(q.val[h])), vmovl_high_s8(q.val[h])};
        for (int e = 0; e < 2; e++) {
            float32x4_t low = vcvtq_f32_s32(vmovl_s16(vget_low_s16(eights[e])));
            float32x4_t high = vcvtq_f32_s32(vmovl_high_s16(eights[e]));
            vst1q_f32(out + 16 * h + 8 * e, vsubq_f32(vmulq_f32(scale, low), offset));
            vst1q_f32(out + 16 * h + 8 * e + 4, vsubq_f32(vmulq_f32(scale, high), offset));
        }
    }
}

/* dequantize_row for Q5_0 and the K-quants, each group unpacked as the integer kernels unpack it. */
static void dequantize_groups_neon(int type, const uint8_t *row, long cols, float *restrict out) {
    if (type == W_Q5_0) {
        for (long b = 0; b < cols / QBLOCK; b++, row += 22, out += QBLOCK) {
            float d, m;
            int8x16x2_t q = unpack_block_neon(W_Q5_0, row, &d, &m);
            store_group_neon(q, d, d, -m, out);
        }
        return;
    }
    for (long first = 0; first < cols; first += KBLOCK, row += k_block_bytes(type)) {
        struct k_factors factors;
        k_block_factors(type, row, &factors);
        for (int g = 0; g < KBLOCK / QBLOCK; g++, out += QBLOCK)
            store_group_neon(unpack_k_group_neon(type, row, g), factors.scale[g][0], factors.scale[g][1],
                             factors.min[g], out);
    }
}

/* out[t] = dot(row, x[t]) for t < tokens (x rows `blocks` blocks apart) on a Q8_0, Q4_0, Q4_1 or Q5_0 row,
 * 16-bit activations (`wide`) or 8-bit. Inlined with `type`, `wide` and `tokens` constants (dot_neon). */
static inline __attribute__((always_inline)) void dot_blocks_neon_of(int type, int wide, const uint8_t *row,
                                                                     const void *x, long blocks, long tokens,
                                                                     float *out) {
    float32x4_t acc[MAX_TOKENS];
    float offsets[MAX_TOKENS] = {0};
    for (long t = 0; t < tokens; t++) acc[t] = vdupq_n_f32(0.0f);
    long stride = weight_row_bytes(type, QBLOCK);
    for (long b = 0; b < blocks; b++, row += stride) {
        float d, m;
        int8x16x2_t w = unpack_block_neon(type, row, &d, &m);
        for (long t = 0; t < tokens; t++) {
            float xd, xs;
            const void *xb = activation_block_neon(wide, x, t * blocks + b, &xd, &xs);
            int32x4_t sums = dot16_neon(wide, dot16_neon(wide, vdupq_n_s32(0), w.val[0], xb, 0), w.val[1], xb, 16);
            acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(sums), d * xd);
            offsets[t] += m * xs;
        }
    }
    for (long t = 0; t < tokens; t++) out[t] = vaddvq_f32(acc[t]) + offsets[t];
}

/* dot_blocks_neon_of on a K-quant row: a super-block's factors decoded once, each group unpacked once for
 * every token; Q6_K's two half-group scales apply to the two halves' sums apart. */
static inline __attribute__((always_inline)) void dot_k_neon_of(int type, int wide, const uint8_t *row, const void *x,
                                                                long blocks, long tokens, float *out) {
    float32x4_t acc[MAX_TOKENS];
    float offsets[MAX_TOKENS] = {0};
    for (long t = 0; t < tokens; t++) acc[t] = vdupq_n_f32(0.0f);
    long stride = k_block_bytes(type);
    for (long first = 0; first < blocks; first += KBLOCK / QBLOCK) {
        const uint8_t *block = row + first / (KBLOCK / QBLOCK) * stride;
        struct k_factors factors;
        k_block_factors(type, block, &factors);
#pragma GCC unroll 8
        for (int g = 0; g < KBLOCK / QBLOCK; g++) {
            int8x16x2_t w = unpack_k_group_neon(type, block, g);
            for (long t = 0; t < tokens; t++) {
                float xd, xs;
                const void *xb = activation_block_neon(wide, x, t * blocks + first + g, &xd, &xs);
                int32x4_t low = dot16_neon(wide, vdupq_n_s32(0), w.val[0], xb, 0);
                if (type == W_Q6_K) {
                    int32x4_t high = dot16_neon(wide, vdupq_n_s32(0), w.val[1], xb, 16);
                    acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(low), factors.scale[g][0] * xd);
                    acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(high), factors.scale[g][1] * xd);
                } else {
                    int32x4_t sums = dot16_neon(wide, low, w.val[1], xb, 16);
                    acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(sums), factors.scale[g][0] * xd);
                }
                offsets[t] -= factors.min[g] * xs;
            }
        }
    }
    for (long t = 0; t < tokens; t++) out[t] = vaddvq_f32(acc[t]) + offsets[t];
}

/* out[t] = dot(row, x[t]) for t < tokens on a row of any block type, NEON, int8 or (`wide`) int16 activations. */
static void dot_neon(int type, int wide, const uint8_t *row, const void *x, long blocks, long tokens, float *out) {
#define DOT_NEON_WIDTHS(kernel, type_code)                                                                         \
    case type_code:                                                                                                \
        if (wide)                                                                                                  \
            WITH_CONSTANT_TOKENS(tokens, kernel(type_code, 1, row, x, blocks, TOKENS, out))                        \
        else                                                                                                       \
            WITH_CONSTANT_TOKENS(tokens, kernel(type_code, 0, row, x, blocks, TOKENS, out))                        \
        break
    switch (type) {
        DOT_NEON_WIDTHS(dot_blocks_neon_of, W_Q8_0);
        DOT_NEON_WIDTHS(dot_blocks_neon_of, W_Q4_0);
        DOT_NEON_WIDTHS(dot_blocks_neon_of, W_Q4_1);
        DOT_NEON_WIDTHS(dot_blocks_neon_of, W_Q5_0);
        DOT_NEON_WIDTHS(dot_k_neon_of, W_Q4_K);
        DOT_NEON_WIDTHS(dot_k_neon_of, W_Q5_K);
        DOT_NEON_WIDTHS(dot_k_neon_of, W_Q6_K);
    default: break;
    }
#undef DOT_NEON_WIDTHS
}
#endif

/* Weight rows a float-path buffer holds: about 16 KiB of floats, whole row blocks, at least one block. */
static long dequantized_rows(long cols) {
    long rows = 16384 / (4 * cols) / ROW_BLOCK * ROW_BLOCK;
    return rows > ROW_BLOCK ? rows : ROW_BLOCK;
}

/* Each thread's float-path buffer, grown as needed and kept. */
static __thread float *row_buffer;
static __thread long row_buffer_floats;

static float *thread_buffer(long floats) {
    if (floats > row_buffer_floats) {
        free(row_buffer);
        row_buffer = malloc(sizeof(float) * floats);
        row_buffer_floats = row_buffer ? floats : 0;
    }
    return row_buffer;
}

/* Batched passes on block-quantized weights with int16 activations, AVX-512 VNNI: tokens in the lanes.
 * The float path dequantizes each weight once a pass and then multiplies it in float32, 16 products a
 * vector instruction; vpdpwssd takes 32 int16 products an instruction, but the integer kernels above put
 * a block's 32 elements in the lanes and then spend a conversion and a multiply-add per block per token
 * turning each block's integer sums into float (more than the products themselves at 32 tokens). Here a
 * zmm lane is a token instead: the activations of 16 tokens are laid out once a pass (panel_activations)
 * so that one vector holds one pair of a block's elements for each of them, and a weight pair, broadcast,
 * multiplies all 16 at once. A block's sums land per token, already apart; their scales (the weight's
 * per row, the tokens' per lane) apply once per block for 16 tokens. The weight rows are widened to int16
 * once per tile of tokens, ROW_BLOCK at a time (widen_block16), so that cost falls with the batch. Same
 * quantization of the activations as quantize_rows16 and the same block sums as block16_into: only the
 * float summation order differs from the int16 GEMV. */
/* What the integer and the float panels share: a vector of PANEL_LANES tokens' floats (lane_floats), the
 * offsets of tokens' rows (lane_offsets), and moving tokens into lanes and back. AVX-512 holds 16 tokens a
 * vector, AVX2 8 (the float panels only: the integer ones need VNNI's vpdpwssd). */
#if defined(__AVX512F__)
#define PANEL_LANES 16
typedef __m512 lane_floats;
typedef __m512i lane_offsets;
static inline lane_floats lanes_zero(void) { return _mm512_setzero_ps(); }
static inline lane_floats lanes_load(const float *p) { return _mm512_load_ps(p); }
static inline void lanes_store(float *p, lane_floats v) { _mm512_store_ps(p, v); }
static inline lane_floats lanes_broadcast(float value) { return _mm512_set1_ps(value); }
static inline lane_floats lanes_fmadd(lane_floats a, lane_floats b, lane_floats c) { return _mm512_fmadd_ps(a, b, c); }

/* The lanes of a group whose first token has `left` tokens from it to the end of the pass. */
static inline __mmask16 live_lanes(long left) {
    return left >= PANEL_LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* Lane t's offset in floats: t rows of `stride` floats apart. */
static inline lane_offsets lane_rows(long stride) {
    return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                              _mm512_set1_epi32((int)stride));
}

/* base[at[t]] in lane t for the `left` live lanes, zero in the others. */
static inline lane_floats gather_lanes(const float *base, lane_offsets at, long left) {
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live_lanes(left), at, base, 4);
}

/* Column `column` of y [tokens, rows] for the 16 tokens from `first`: lane t's sum at y[first + t, column]. */
static inline void store_token_lanes(float *y, long rows, long tokens, long first, long column, lane_floats sums) {
    _mm512_mask_i32scatter_ps(y + first * rows + column, live_lanes(tokens - first), lane_rows(rows), sums, 4);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define PANEL_LANES 8
typedef __m256 lane_floats;
typedef __m256i lane_offsets;
static inline lane_floats lanes_zero(void) { return _mm256_setzero_ps(); }
static inline lane_floats lanes_load(const float *p) { return _mm256_load_ps(p); }
static inline void lanes_store(float *p, lane_floats v) { _mm256_store_ps(p, v); }
static inline lane_floats lanes_broadcast(float value) { return _mm256_set1_ps(value); }
static inline lane_floats lanes_fmadd(lane_floats a, lane_floats b, lane_floats c) { return _mm256_fmadd_ps(a, b, c); }

static inline lane_offsets lane_rows(long stride) {
    return _mm256_mullo_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_epi32((int)stride));
}

static inline lane_floats gather_lanes(const float *base, lane_offsets at, long left) {
    int live = left < PANEL_LANES ? (int)left : PANEL_LANES;
    __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(live), _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0));
    return _mm256_mask_i32gather_ps(_mm256_setzero_ps(), base, at, _mm256_castsi256_ps(mask), 4);
}

/* AVX2 has no scatter: the lanes go through memory. */
static inline void store_token_lanes(float *y, long rows, long tokens, long first, long column, lane_floats sums) {
    float lanes[PANEL_LANES];
    _mm256_storeu_ps(lanes, sums);
    long live = tokens - first < PANEL_LANES ? tokens - first : PANEL_LANES;
    for (long t = 0; t < live; t++) y[(first + t) * rows + column] = lanes[t];
}
#endif

#if defined(PANEL_LANES)
#define PANEL_GROUPS 2 /* groups of PANEL_LANES tokens one weight broadcast serves */

/* Groups of tokens a tile takes: about tile_bytes of activations at `group_bytes` a group, whole pairs. */
static inline long panel_tile_groups(long group_bytes) {
    long tile = tile_bytes() / group_bytes / PANEL_GROUPS * PANEL_GROUPS;
    return tile < PANEL_GROUPS ? PANEL_GROUPS : tile;
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_PANELS 1

/* x quantized per block of 32 to int16 (quantize_rows16) and laid out by groups of 16 tokens:
 * pairs[((b * 16 + p) * groups + g) * 16 + lane] holds elements 2p and 2p + 1 of block b of token
 * 16 g + lane as one int32 (a vpdpwssd lane's two int16), and d / s[(b * groups + g) * 16 + lane] its
 * scale and scaled sum; lanes past the last token are zero. */
struct panels {
    long groups, blocks;
    int32_t *pairs;
    float *d, *s;
};

/* From 9 tokens on: at 5-8 the float path or the int16 GEMV is as fast, with half the panels' lanes idle. */
static int takes_panels(int type, long tokens) {
    return !quant_scalar && quant_activations == W_ACT_INT16 && tokens > integer_max_tokens && tokens > MAX_TOKENS &&
           (type == W_Q8_0 || type == W_Q4_0 || type == W_Q4_1 || type == W_Q5_0 || is_k_quant(type));
}

static struct panels *panel_activations(const float *x, long tokens, long cols) {
    long blocks = cols / QBLOCK, groups = (tokens + PANEL_LANES - 1) / PANEL_LANES;
    long pair_count = blocks * (QBLOCK / 2) * groups * PANEL_LANES, scale_count = blocks * groups * PANEL_LANES;
    size_t header = 64, bytes = header + sizeof(int32_t) * pair_count + 2 * sizeof(float) * scale_count;
    struct block_q16 *rows = malloc(sizeof(struct block_q16) * tokens * blocks);
    void *memory = NULL;
    if (!rows || posix_memalign(&memory, 64, bytes)) {
        free(rows);
        return NULL;
    }
    struct panels *a = memory;
    a->groups = groups;
    a->blocks = blocks;
    a->pairs = (int32_t *)((char *)memory + header);
    a->d = (float *)(a->pairs + pair_count);
    a->s = a->d + scale_count;
    memset(a->pairs, 0, bytes - header);
    quantize_rows16(x, tokens, cols, rows);
    for (long t = 0; t < tokens; t++) {
        long g = t / PANEL_LANES, lane = t % PANEL_LANES;
        for (long b = 0; b < blocks; b++) {
            const struct block_q16 *block = rows + t * blocks + b;
            for (long p = 0; p < QBLOCK / 2; p++) {
                int32_t pair;
                memcpy(&pair, block->q + 2 * p, sizeof pair);
                a->pairs[((b * (QBLOCK / 2) + p) * groups + g) * PANEL_LANES + lane] = pair;
            }
            a->d[(b * groups + g) * PANEL_LANES + lane] = block->d;
            a->s[(b * groups + g) * PANEL_LANES + lane] = block->s;
        }
    }
    free(rows);
    return a;
}

/* Rows `count` <= ROW_BLOCK of a weight widened to int16 (q [count, cols]) with each block's (or K-quant
 * group's) offset m [count, blocks] and the scales of its two halves of 16, d [count, blocks, 2]:
 * x = d[i / 16] q + m (the halves' scales differ only in Q6_K). */
static void widen_rows16(int type, const uint8_t *rows, long row_size, int count, long blocks, int16_t *q, float *d,
                         float *m) {
    for (int r = 0; r < count; r++) {
        const uint8_t *row = rows + r * row_size;
        for (long b = 0; b < blocks; b++) {
            __m256i w0, w1;
            long at = r * blocks + b;
            if (is_k_quant(type)) {
                const uint8_t *block = row + b / (KBLOCK / QBLOCK) * k_block_bytes(type);
                int g = (int)(b % (KBLOCK / QBLOCK));
                struct k_factors factors;
                k_block_factors(type, block, &factors); /* once a group: the widening is not the batch's cost */
                __m256i w = unpack_k_group(type, block, g);
                __m128i low = _mm256_castsi256_si128(w), high = _mm256_extracti128_si256(w, 1);
                w0 = type == W_Q6_K ? _mm256_cvtepi8_epi16(low) : _mm256_cvtepu8_epi16(low);
                w1 = type == W_Q6_K ? _mm256_cvtepi8_epi16(high) : _mm256_cvtepu8_epi16(high);
                d[2 * at] = factors.scale[g][0];
                d[2 * at + 1] = factors.scale[g][1];
                m[at] = -factors.min[g];
            } else {
                widen_block16(type, row + b * weight_row_bytes(type, QBLOCK), &w0, &w1, d + 2 * at, m + at);
                d[2 * at + 1] = d[2 * at];
            }
            _mm256_storeu_si256((__m256i *)(q + r * blocks * QBLOCK + b * QBLOCK), w0);
            _mm256_storeu_si256((__m256i *)(q + r * blocks * QBLOCK + b * QBLOCK + 16), w1);
        }
    }
}

/* y[t, r0 + r] for r < ROWS widened rows and the tokens of groups g .. g + GROUPS - 1 (y rows `rows` apart);
 * HALVES 2 scales each half of a block apart (Q6_K), 1 the whole block. */
static inline __attribute__((always_inline)) void panel_tile_of(const struct panels *a, long g, const int16_t *q,
                                                               const float *d, const float *m, float *y, long r0,
                                                               long rows, long tokens, const int ROWS,
                                                               const int GROUPS, const int HALVES) {
    long blocks = a->blocks, groups = a->groups;
    __m512 sums[ROW_BLOCK][PANEL_GROUPS];
    for (int r = 0; r < ROWS; r++)
        for (int k = 0; k < GROUPS; k++) sums[r][k] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        const int32_t *pairs = a->pairs + (b * (QBLOCK / 2) * groups + g) * PANEL_LANES;
        for (int h = 0; h < HALVES; h++) {
            __m512i dots[ROW_BLOCK][PANEL_GROUPS];
            for (int r = 0; r < ROWS; r++)
                for (int k = 0; k < GROUPS; k++) dots[r][k] = _mm512_setzero_si512();
            for (long p = h * QBLOCK / 2 / HALVES; p < (h + 1) * QBLOCK / 2 / HALVES; p++) {
                __m512i x[PANEL_GROUPS];
                for (int k = 0; k < GROUPS; k++) x[k] = _mm512_load_si512(pairs + (p * groups + k) * PANEL_LANES);
                for (int r = 0; r < ROWS; r++) {
                    int32_t pair;
                    memcpy(&pair, q + r * blocks * QBLOCK + b * QBLOCK + 2 * p, sizeof pair);
                    __m512i w = _mm512_set1_epi32(pair);
                    for (int k = 0; k < GROUPS; k++) dots[r][k] = _mm512_dpwssd_epi32(dots[r][k], x[k], w);
                }
            }
            for (int k = 0; k < GROUPS; k++) {
                __m512 scale = _mm512_load_ps(a->d + (b * groups + g + k) * PANEL_LANES);
                for (int r = 0; r < ROWS; r++) {
                    __m512 products = _mm512_mul_ps(scale, _mm512_set1_ps(d[2 * (r * blocks + b) + h]));
                    sums[r][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][k]), products, sums[r][k]);
                }
            }
        }
        for (int k = 0; k < GROUPS; k++) {
            __m512 sum = _mm512_load_ps(a->s + (b * groups + g + k) * PANEL_LANES);
            for (int r = 0; r < ROWS; r++) sums[r][k] = _mm512_fmadd_ps(sum, _mm512_set1_ps(m[r * blocks + b]), sums[r][k]);
        }
    }
    for (int k = 0; k < GROUPS; k++)
        for (int r = 0; r < ROWS; r++) store_token_lanes(y, rows, tokens, (g + k) * PANEL_LANES, r0 + r, sums[r][k]);
}

static void panel_tile(const struct panels *a, long g, const int16_t *q, const float *d, const float *m, float *y,
                       long r0, long rows, long tokens, int count, int groups, int halves) {
#define PANEL_ROWS(n)                                                                                              \
    case n:                                                                                                        \
        if (halves == 2 && groups == PANEL_GROUPS) panel_tile_of(a, g, q, d, m, y, r0, rows, tokens, n, PANEL_GROUPS, 2); \
        else if (halves == 2) panel_tile_of(a, g, q, d, m, y, r0, rows, tokens, n, 1, 2);                         \
        else if (groups == PANEL_GROUPS) panel_tile_of(a, g, q, d, m, y, r0, rows, tokens, n, PANEL_GROUPS, 1);   \
        else panel_tile_of(a, g, q, d, m, y, r0, rows, tokens, n, 1, 1);                                          \
        break
    switch (count) {
        PANEL_ROWS(1);
        PANEL_ROWS(2);
        PANEL_ROWS(3);
        PANEL_ROWS(4);
    default: break;
    }
#undef PANEL_ROWS
}

/* y[t, r] = dot(w[r], x[t]) for rows [lo, hi) and every token, from x's panels: ROW_BLOCK rows widened at
 * a time, over a tile of token groups (about tile_bytes of activations) at a time. Returns -1 when the
 * thread's buffer cannot be had. */
static int project_rows_panels(const void *w, int type, const struct panels *a, float *y, long tokens, long rows,
                               long cols, long lo, long hi) {
    long blocks = a->blocks, row_size = weight_row_bytes(type, cols);
    long tile = panel_tile_groups(cols * 2 * PANEL_LANES);
    float *buffer = thread_buffer(ROW_BLOCK * cols / 2 + 3 * ROW_BLOCK * blocks);
    if (!buffer) return -1;
    int16_t *q = (int16_t *)buffer;
    float *d = buffer + ROW_BLOCK * cols / 2, *m = d + 2 * ROW_BLOCK * blocks;
    for (long first = 0; first < a->groups; first += tile) {
        long last = first + tile < a->groups ? first + tile : a->groups;
        for (long r = lo; r < hi; r += ROW_BLOCK) {
            int count = hi - r < ROW_BLOCK ? (int)(hi - r) : ROW_BLOCK;
            widen_rows16(type, (const uint8_t *)w + r * row_size, row_size, count, blocks, q, d, m);
            for (long g = first; g < last; g += PANEL_GROUPS)
                panel_tile(a, g, q, d, m, y, r, rows, tokens, count, last - g < PANEL_GROUPS ? 1 : PANEL_GROUPS,
                           type == W_Q6_K ? 2 : 1);
        }
    }
    return 0;
}
#endif

/* Float32 weights at batch and prefill sizes, AVX-512 or AVX2: the same layout as the integer panels, tokens in the
 * lanes. project_rows takes dot products, rows and tokens both along the columns, so its 4 x 6 register
 * block streams 4 weight rows and 6 token rows per multiply-add step, and from 1536 columns on their
 * 60 KB no longer stay in L1: each step waits on L2. Here one vector holds one column of 16 tokens
 * (float_panel_activations, a transposition once a pass) and a weight element, broadcast from memory,
 * multiplies all of them: 12 rows by 2 groups of 16 tokens keep 24 sums in registers, and each step reads
 * 2 token vectors and 12 weight floats for 24 multiply-adds. AVX2's 16 registers hold 6 rows by 2 groups
 * of 8 tokens (12 sums, 2 token vectors and the broadcast weight). */
#if defined(PANEL_LANES)
#define HAVE_FLOAT_PANELS 1
#define FLOAT_PANEL_ROWS (PANEL_LANES == 16 ? 12 : 6)
#define FLOAT_PANEL_MIN_TOKENS 16 /* below, half a group's lanes or more would idle */

/* x [tokens, cols] as columns of PANEL_LANES tokens, the groups a tile takes together (PANEL_GROUPS) side by
 * side and their columns in order, so that a tile reads one sequential stream:
 * x[((g / PANEL_GROUPS * cols + k) * PANEL_GROUPS + g % PANEL_GROUPS) * PANEL_LANES + lane] is column k of token
 * PANEL_LANES g + lane; lanes past the last token are zero. */
struct float_panels {
    long groups;
    float *x;
};

/* Every weight type at 16 tokens and more where neither integer path takes the pass (the panels, or the GEMV
 * up to integer_max_tokens): float32 weights as they are, the others dequantized FLOAT_PANEL_ROWS rows at a time. */
static int takes_float_panels(int type, long tokens) {
    if (tokens < FLOAT_PANEL_MIN_TOKENS) return 0;
    if (type == W_F32 || is_half(type)) return 1;
#if defined(HAVE_PANELS)
    if (takes_panels(type, tokens)) return 0;
#endif
    return quant_activations == W_ACT_FLOAT || tokens > integer_max_tokens;
}

static struct float_panels *float_panel_activations(const float *x, long tokens, long cols) {
    long groups = (tokens + PANEL_LANES - 1) / PANEL_LANES;
    long sets = (groups + PANEL_GROUPS - 1) / PANEL_GROUPS;
    size_t header = 64, bytes = header + sizeof(float) * cols * sets * PANEL_GROUPS * PANEL_LANES;
    void *memory = NULL;
    if (posix_memalign(&memory, 64, bytes)) return NULL;
    struct float_panels *a = memory;
    a->groups = groups;
    a->x = (float *)((char *)memory + header);
    const lane_offsets at = lane_rows(cols); /* lane t: row t of the group */
    for (long g = 0; g < groups; g++) {
        long first = g * PANEL_LANES;
        const float *rows = x + first * cols;
        for (long k = 0; k < cols; k++)
            lanes_store(a->x + ((g / PANEL_GROUPS * cols + k) * PANEL_GROUPS + g % PANEL_GROUPS) * PANEL_LANES,
                        gather_lanes(rows + k, at, tokens - first));
    }
    return a;
}

/* y[t, r0 + r] for r < ROWS weight rows from w (rows `cols` apart) and the tokens of groups g .. g + GROUPS - 1
 * (g a multiple of PANEL_GROUPS). */
static inline __attribute__((always_inline)) void float_panel_tile_of(const struct float_panels *a, long g,
                                                                     const float *w, long cols, float *y, long r0,
                                                                     long rows, long tokens, const int ROWS,
                                                                     const int GROUPS) {
    lane_floats sums[FLOAT_PANEL_ROWS][PANEL_GROUPS];
    for (int r = 0; r < ROWS; r++)
        for (int k = 0; k < GROUPS; k++) sums[r][k] = lanes_zero();
    const float *column = a->x + g / PANEL_GROUPS * cols * PANEL_GROUPS * PANEL_LANES;
    for (long i = 0; i < cols; i++, column += PANEL_GROUPS * PANEL_LANES) {
        lane_floats x[PANEL_GROUPS];
        for (int k = 0; k < GROUPS; k++) x[k] = lanes_load(column + k * PANEL_LANES);
        for (int r = 0; r < ROWS; r++) {
            lane_floats weight = lanes_broadcast(w[r * cols + i]);
            for (int k = 0; k < GROUPS; k++) sums[r][k] = lanes_fmadd(x[k], weight, sums[r][k]);
        }
    }
    for (int k = 0; k < GROUPS; k++)
        for (int r = 0; r < ROWS; r++) store_token_lanes(y, rows, tokens, (g + k) * PANEL_LANES, r0 + r, sums[r][k]);
}

static void float_panel_tile(const struct float_panels *a, long g, const float *w, long cols, float *y, long r0,
                             long rows, long tokens, int count, int groups) {
#define FLOAT_PANEL_ROWS_CASE(n)                                                                                   \
    case n:                                                                                                        \
        if (groups == PANEL_GROUPS) float_panel_tile_of(a, g, w, cols, y, r0, rows, tokens, n, PANEL_GROUPS);     \
        else float_panel_tile_of(a, g, w, cols, y, r0, rows, tokens, n, 1);                                       \
        break
    switch (count) {
        FLOAT_PANEL_ROWS_CASE(1);
        FLOAT_PANEL_ROWS_CASE(2);
        FLOAT_PANEL_ROWS_CASE(3);
        FLOAT_PANEL_ROWS_CASE(4);
        FLOAT_PANEL_ROWS_CASE(5);
        FLOAT_PANEL_ROWS_CASE(6);
#if PANEL_LANES == 16
        FLOAT_PANEL_ROWS_CASE(7);
        FLOAT_PANEL_ROWS_CASE(8);
        FLOAT_PANEL_ROWS_CASE(9);
        FLOAT_PANEL_ROWS_CASE(10);
        FLOAT_PANEL_ROWS_CASE(11);
        FLOAT_PANEL_ROWS_CASE(12);
#endif
    default: break;
    }
#undef FLOAT_PANEL_ROWS_CASE
}

/* y[t, r] = dot(w[r], x[t]) for rows [lo, hi) and every token, from x's float panels: FLOAT_PANEL_ROWS rows
 * at a time over a tile of token groups (about tile_bytes of columns) at a time. */
static void project_rows_float_panels(const float *w, const struct float_panels *a, float *y, long tokens, long rows,
                                      long cols, long lo, long hi) {
    long tile = panel_tile_groups(cols * 4 * PANEL_LANES);
    for (long first = 0; first < a->groups; first += tile) {
        long last = first + tile < a->groups ? first + tile : a->groups;
        for (long r = lo; r < hi; r += FLOAT_PANEL_ROWS) {
            int count = hi - r < FLOAT_PANEL_ROWS ? (int)(hi - r) : FLOAT_PANEL_ROWS;
            for (long g = first; g < last; g += PANEL_GROUPS)
                float_panel_tile(a, g, w + r * cols, cols, y, r, rows, tokens, count,
                                 last - g < PANEL_GROUPS ? 1 : PANEL_GROUPS);
        }
    }
}
#endif

/* Whether batched passes on block-quantized and K-quant weights with int16 activations take the panels (AVX-512
 * VNNI builds). */
int pie_has_panels(void) {
#if defined(HAVE_PANELS)
    return 1;
#else
    return 0;
#endif
}

/* y[t, r] = dot(w[r], x[t]) for rows [lo, hi) and every token, w of any type; xq is x quantized
 * (quantize_rows) when the int8 path runs, else NULL. Returns -1 when a buffer cannot be had. */
static int project_rows_typed(const void *w, int type, const float *restrict x, const void *xq,
                              float *restrict y, long tokens, long rows, long cols, long lo, long hi) {
    int float_panels = 0; /* xq is x's float panels */
#if defined(HAVE_FLOAT_PANELS)
    float_panels = xq && takes_float_panels(type, tokens);
#endif
    if (type == W_F32) {
#if defined(HAVE_FLOAT_PANELS)
        if (float_panels) {
            project_rows_float_panels(w, xq, y, tokens, rows, cols, lo, hi);
            return 0;
        }
#endif
        project_rows(w, x, y, tokens, rows, cols, lo, hi);
        return 0;
    }
    long row_size = weight_row_bytes(type, cols);
    const uint8_t *base = w;
    if (is_half(type) && tokens == 1) {
        for (long r = lo; r < hi; r++) y[r] = dot_half_row(type, base + r * row_size, x, cols);
        return 0;
    }
#if defined(HAVE_PANELS)
    if (xq && takes_panels(type, tokens)) return project_rows_panels(w, type, xq, y, tokens, rows, cols, lo, hi);
#endif
    if (xq && !float_panels) {
        long blocks = cols / QBLOCK;
#if defined(GEMV_ZMM)
        if (takes_split_gemv(type, tokens)) {
            gemv_split(type, base, row_size, xq, blocks, y, lo, hi);
            return 0;
        }
#endif
#if defined(__AVX2__)
        if (tokens == 1 && !quant_scalar && quant_activations == W_ACT_INT16 && !is_k_quant(type)) {
            gemv_q16_avx2(type, base, row_size, xq, blocks, y, lo, hi);
            return 0;
        }
#endif
        float out[MAX_TOKENS];
        for (long first = 0; first < tokens; first += MAX_TOKENS) {
            long n = tokens - first < MAX_TOKENS ? tokens - first : MAX_TOKENS;
            for (long r = lo; r < hi; r++) {
                const uint8_t *row = base + r * row_size;
                prefetch_row_ahead(row, row_size);
                const struct block_q8 *x8 = xq;
                const struct block_q16 *x16 = xq;
                int wide = quant_activations == W_ACT_INT16;
#if defined(__AVX2__)
                if (!quant_scalar && is_k_quant(type))
                    dot_k_avx2(type, wide, row, wide ? (const void *)(x16 + first * blocks) : (const void *)(x8 + first * blocks),
                               blocks, n, out);
                else if (!quant_scalar && wide)
                    dot_q16_avx2(type, row, x16 + first * blocks, blocks, n, out);
                else if (!quant_scalar)
                    dot_q8_avx2(type, row, x8 + first * blocks, blocks, n, out);
                else
#elif defined(__aarch64__)
                if (!quant_scalar)
                    dot_neon(type, wide, row,
                             wide ? (const void *)(x16 + first * blocks) : (const void *)(x8 + first * blocks),
                             blocks, n, out);
                else
#endif
                    for (long t = 0; t < n; t++)
                        out[t] = wide ? dot_q16_scalar(type, row, x16 + (first + t) * blocks, blocks)
                                      : dot_q8_scalar(type, row, x8 + (first + t) * blocks, blocks);
                for (long t = 0; t < n; t++) y[(first + t) * rows + r] = out[t];
            }
        }
        return 0;
    }
    long piece = dequantized_rows(cols);
#if defined(HAVE_FLOAT_PANELS)
    if (float_panels) piece = FLOAT_PANEL_ROWS;
#endif
    float *buffer = thread_buffer(piece * cols);
    if (!buffer) return -1;
    for (long r = lo; r < hi; r += piece) {
        long n = hi - r < piece ? hi - r : piece;
        for (long i = 0; i < n; i++) {
            prefetch_row_ahead(base + (r + i) * row_size, row_size);
            dequantize_row(type, base + (r + i) * row_size, cols, buffer + i * cols);
        }
#if defined(HAVE_FLOAT_PANELS)
        if (float_panels) {
            project_rows_float_panels(buffer, xq, y + r, tokens, rows, cols, 0, n);
            continue;
        }
#endif
        project_rows(buffer, x, y + r, tokens, rows, cols, 0, n);
    }
    return 0;
}

/* x quantized for an integer path (panels for a batch that takes them), or NULL (float weights, the float
 * path, another pass of more than integer_max_tokens tokens, or no memory: *failed set). */
static void *quantized_activations(int type, const float *x, long tokens, long cols, int *failed) {
#if defined(HAVE_FLOAT_PANELS)
    if (takes_float_panels(type, tokens)) {
        void *panels = float_panel_activations(x, tokens, cols);
        *failed = !panels;
        return panels;
    }
#endif
    if (type == W_F32 || is_half(type) || quant_activations == W_ACT_FLOAT || cols % QBLOCK) return NULL;
#if defined(HAVE_PANELS)
    if (takes_panels(type, tokens)) {
        void *panels = panel_activations(x, tokens, cols);
        *failed = !panels;
        return panels;
    }
#endif
    if (tokens > integer_max_tokens) return NULL;
#if defined(GEMV_ZMM)
    if (takes_split_gemv(type, tokens)) {
        void *split = split_activations16(type, x, cols);
        *failed = !split;
        return split;
    }
#endif
    int wide = quant_activations == W_ACT_INT16;
    void *xq = malloc((wide ? sizeof(struct block_q16) : sizeof(struct block_q8)) * tokens * (cols / QBLOCK));
    if (!xq) {
        *failed = 1;
        return NULL;
    }
    if (wide)
        quantize_rows16(x, tokens, cols, xq);
    else
        quantize_rows(x, tokens, cols, xq);
    return xq;
}

/* out [len(ids), cols] = the rows `ids` of a table of type `type`, as float32 (an embedding lookup). */
void pie_dequantize_rows(const void *table, int type, const int *ids, long count, long cols, float *out) {
    long row_size = weight_row_bytes(type, cols);
    for (long i = 0; i < count; i++)
        dequantize_row(type, (const uint8_t *)table + ids[i] * row_size, cols, out + i * cols);
}

static void block_of(long rows, long *lo, long *hi, int chunk, int chunks) {
    *lo = rows * chunk / chunks;
    *hi = rows * (chunk + 1) / chunks;
}

/* Chunk sizes falling linearly from first to last (chunks, chunks - 1, ..., 1 parts): the threads
 * claim the large ones first, and whichever finishes last waits on a small one. With another process
 * decoding on the same cores, a batch-1 forward ran faster than with equal chunks; alone, even. */
static long falling_parts_before(long chunk, long chunks) { return chunk * chunks - chunk * (chunk - 1) / 2; }

static void falling_block_of(long rows, long *lo, long *hi, int chunk, int chunks) {
    long parts = falling_parts_before(chunks, chunks);
    *lo = rows * falling_parts_before(chunk, chunks) / parts;
    *hi = rows * falling_parts_before(chunk + 1, chunks) / parts;
}

/* Threads. numpy's OpenBLAS keeps its own workers, which poll for their next call a while after
 * each one (pie sets OPENBLAS_THREAD_TIMEOUT to keep that short). OpenMP's workers poll too, without
 * yielding the core: alternating OpenBLAS and OpenMP calls ran slower, at worst many times. So
 * this pool polls the polite way (sched_yield) and sleeps after POLL_NS without work, and a task is
 * cut into chunks that whichever thread is running claims: when a worker is not scheduled (another
 * process, or OpenBLAS's poller, holds its core), the caller does its chunks instead of waiting a
 * scheduler time slice for it. Chunks are claimed in order, so each is read front to back. */
#define POLL_NS 2000000L
#define MAX_THREADS 256
#define CHUNKS_PER_THREAD 4

typedef void (*task_fn)(const void *task, int chunk, int chunks);

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_mutex_t dispatch;        /* one task at a time: a caller that finds it taken runs alone */
    atomic_long generation;          /* bumped when a task is published */
    atomic_ullong next;              /* generation << 32 | next unclaimed chunk */
    atomic_int finished;             /* chunks of the current task done */
    _Atomic(task_fn) fn;
    _Atomic(const void *) task;
    atomic_int chunks;
    atomic_int sleeping;
    int threads;                     /* the caller's thread included */
    int started;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER, .dispatch = PTHREAD_MUTEX_INITIALIZER};

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Runs chunks of the task published as `generation` until none is left unclaimed. A claim names
 * the generation, so a thread that read a finished task's function never runs a later task's chunk. */
static void claim_chunks(long generation, task_fn fn, const void *task, int chunks) {
    unsigned long long tag = (unsigned long long)generation << 32;
    unsigned long long seen = atomic_load(&pool.next);
    while ((seen >> 32) == (tag >> 32) && (int)(seen & 0xffffffffu) < chunks) {
        if (atomic_compare_exchange_weak(&pool.next, &seen, seen + 1)) {
            fn(task, (int)(seen & 0xffffffffu), chunks);
            atomic_fetch_add(&pool.finished, 1);
            seen = atomic_load(&pool.next);
        }
    }
}

static void *worker(void *unused) {
    (void)unused;
    long seen = 0; /* workers start before the first task */
    for (;;) {
        long generation, idle_since = 0;
        for (int polls = 0; (generation = atomic_load(&pool.generation)) == seen; polls++) {
            if (polls < 64) {
                relax();
                continue;
            }
            sched_yield();
            if (!idle_since) idle_since = now_ns();
            if (now_ns() - idle_since > POLL_NS) {
                pthread_mutex_lock(&pool.lock);
                atomic_fetch_add(&pool.sleeping, 1);
                while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
                atomic_fetch_sub(&pool.sleeping, 1);
                pthread_mutex_unlock(&pool.lock);
                idle_since = 0;
            }
        }
        seen = generation;
        claim_chunks(generation, atomic_load(&pool.fn), atomic_load(&pool.task), atomic_load(&pool.chunks));
    }
    return NULL;
}

static void forget_workers(void) { pool.started = 0; } /* a forked child has none of them */

/* Sets the thread count (the caller's included) for later tasks; returns the count in effect.
 * Workers are started once, on the first call, and only that call may raise the count. */
int pie_set_threads(int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (pool.started) return pool.threads = threads < pool.started ? threads : pool.started;
    pthread_atfork(NULL, NULL, forget_workers);
    int started = 1;
    for (; started < threads; started++) {
        pthread_t thread;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attributes, worker, NULL);
        pthread_attr_destroy(&attributes);
        if (failed) break;
    }
    pool.started = started;
    return pool.threads = started;
}

/* Runs fn(task, chunk, chunks) for every chunk, on this thread and the pool's workers, or on this
 * thread alone (as one chunk) when `parallel` is false or no workers were started. */
static void run_parallel(task_fn fn, const void *task, int parallel) {
    if (!parallel || pool.started < 2 || pool.threads < 2 || pthread_mutex_trylock(&pool.dispatch) != 0) {
        fn(task, 0, 1);
        return;
    }
    int chunks = pool.threads * CHUNKS_PER_THREAD;
    long generation = atomic_load(&pool.generation) + 1;
    atomic_store(&pool.next, (unsigned long long)generation << 32);
    atomic_store(&pool.finished, 0);
    atomic_store(&pool.fn, fn);
    atomic_store(&pool.task, task);
    atomic_store(&pool.chunks, chunks);
    atomic_store(&pool.generation, generation);
    if (atomic_load(&pool.sleeping)) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    claim_chunks(generation, fn, task, chunks);
    for (int polls = 0; atomic_load(&pool.finished) < chunks; polls++) {
        if (polls < 256)
            relax();
        else
            sched_yield();
    }
    pthread_mutex_unlock(&pool.dispatch);
}

struct projection {
    const void *w;
    int type;
    const float *x, *bias, *residual;
    const void *xq;
    float *y;
    long tokens, rows, cols;
    atomic_int failed;
};

static void projection_task(const void *task, int chunk, int chunks) {
    struct projection *p = (struct projection *)task;
    long lo, hi;
    falling_block_of(p->rows, &lo, &hi, chunk, chunks);
    if (project_rows_typed(p->w, p->type, p->x, p->xq, p->y, p->tokens, p->rows, p->cols, lo, hi))
        atomic_store(&p->failed, 1);
    for (long t = 0; t < p->tokens; t++) {
        float *out = p->y + t * p->rows;
        if (p->bias)
            for (long r = lo; r < hi; r++) out[r] += p->bias[r];
        if (p->residual)
            for (long r = lo; r < hi; r++) out[r] += p->residual[t * p->rows + r];
    }
}

/* y = x @ w.T (+ bias) (+ residual); bias [rows] and residual [tokens, rows] may be NULL; w of type `type`.
 * Returns -1 when scratch memory cannot be had. */
int pie_linear(const void *w, int type, const float *x, const float *bias, const float *residual, float *y,
               long tokens, long rows, long cols) {
    int failed = 0;
    void *xq = quantized_activations(type, x, tokens, cols, &failed);
    if (failed) return -1;
    struct projection task = {w, type, x, bias, residual, xq, y, tokens, rows, cols, 0};
    run_parallel(projection_task, &task, rows * cols >= PARALLEL_MIN_ELEMENTS);
    free(xq);
    return atomic_load(&task.failed) ? -1 : 0;
}

/* normed[t] = x[t] * norm_weight / sqrt(mean(x[t]^2) + eps), the squares summed in 2 VEC float lanes.
 * Summed one by one in double, a row took many times as long: the decode step runs this twice a layer
 * on one thread, the other waiting. */
static void rms_norm(const float *x, const float *norm_weight, float eps, float *normed, long tokens, long cols) {
    for (long t = 0; t < tokens; t++) {
        const float *row = x + t * cols;
        vecf s0 = {0}, s1 = {0};
        long i = 0;
        for (; i + 2 * VEC <= cols; i += 2 * VEC) {
            vecf a = vload(row + i), b = vload(row + i + VEC);
            s0 += a * a;
            s1 += b * b;
        }
        float square = vsum(s0 + s1);
        for (; i < cols; i++) square += row[i] * row[i];
        float scale = 1.0f / sqrtf(square / (float)cols + eps);
        for (i = 0; i < cols; i++) normed[t * cols + i] = row[i] * (norm_weight[i] * scale);
    }
}

/* y = rms_norm(x) @ w.T (+ bias). Returns -1 when scratch memory cannot be had. */
int pie_rms_norm_linear(const float *x, const float *norm_weight, float eps, const void *w, int type,
                        const float *bias, float *y, long tokens, long rows, long cols) {
    float *normed = malloc(sizeof(float) * tokens * cols);
    if (!normed) return -1;
    rms_norm(x, norm_weight, eps, normed, tokens, cols);
    int status = pie_linear(w, type, normed, bias, NULL, y, tokens, rows, cols);
    free(normed);
    return status;
}

/* The gate activations of a gated MLP (DecoderLayerBlock.activation). */
enum { GATE_SILU = 0, GATE_GELU_TANH = 1 };

struct gated {
    const void *w;
    int type, activation;
    const float *normed;
    const void *xq;
    float *up, *y;
    long tokens, inter, cols;
    atomic_int failed;
};

/* gate[r] = act(gate[r]) * up[r] for r in [lo, hi). Both activations are g * sigmoid(s): s = g for SiLU, and
 * s = 2 sqrt(2/pi) (g + 0.044715 g^3) for tanh-approximate GELU, 0.5 (1 + tanh(z)) being sigmoid(2z). */
static void gate_rows(float *restrict gate, const float *restrict up, long lo, long hi, int activation) {
    const float two_sqrt_2_over_pi = 1.5957691216057308f, cubic = 0.044715f;
    long r = lo;
    if (activation == GATE_SILU) {
        for (; r + VEC <= hi; r += VEC) {
            vecf g = vload(gate + r);
            vstore(gate + r, g / (1.0f + vexp(-g)) * vload(up + r));
        }
        for (; r < hi; r++) gate[r] = gate[r] / (1.0f + expf(-gate[r])) * up[r];
        return;
    }
    for (; r + VEC <= hi; r += VEC) {
        vecf g = vload(gate + r);
        vecf s = two_sqrt_2_over_pi * (g + cubic * g * g * g);
        vstore(gate + r, g / (1.0f + vexp(-s)) * vload(up + r));
    }
    for (; r < hi; r++) {
        float g = gate[r];
        gate[r] = g / (1.0f + expf(-two_sqrt_2_over_pi * (g + cubic * g * g * g))) * up[r];
    }
}

static void gated_task(const void *task, int chunk, int chunks) {
    struct gated *g = (struct gated *)task;
    long lo, hi, inter = g->inter;
    falling_block_of(inter, &lo, &hi, chunk, chunks);
    const void *up_rows = (const char *)g->w + inter * weight_row_bytes(g->type, g->cols);
    if (project_rows_typed(g->w, g->type, g->normed, g->xq, g->y, g->tokens, inter, g->cols, lo, hi) ||
        project_rows_typed(up_rows, g->type, g->normed, g->xq, g->up, g->tokens, inter, g->cols, lo, hi)) {
        atomic_store(&g->failed, 1);
        return;
    }
    for (long t = 0; t < g->tokens; t++) gate_rows(g->y + t * inter, g->up + t * inter, lo, hi, g->activation);
}

/* y = act(g) * u where [g | u] = rms_norm(x) @ w.T and w stacks gate [inter, cols] over up [inter, cols];
 * act is a GATE_* activation; normed [tokens, cols] and up [tokens, inter] are scratch. */
static int norm_gate_up(const float *x, const float *norm_weight, float eps, const void *w, int type, int activation,
                        float *y, long tokens, long inter, long cols, float *normed, float *up) {
    rms_norm(x, norm_weight, eps, normed, tokens, cols);
    int failed = 0;
    void *xq = quantized_activations(type, normed, tokens, cols, &failed);
    if (failed) return -1;
    struct gated task = {w, type, activation, normed, xq, up, y, tokens, inter, cols, 0};
    run_parallel(gated_task, &task, 2 * inter * cols >= PARALLEL_MIN_ELEMENTS);
    free(xq);
    return atomic_load(&task.failed) ? -1 : 0;
}

/* norm_gate_up with SiLU and its own scratch. Returns -1 when scratch memory cannot be had. */
int pie_rms_norm_gate_up_silu(const float *x, const float *norm_weight, float eps, const void *w, int type, float *y,
                              long tokens, long inter, long cols) {
    float *scratch = malloc(sizeof(float) * tokens * (cols + inter));
    if (!scratch) return -1;
    int status = norm_gate_up(x, norm_weight, eps, w, type, GATE_SILU, y, tokens, inter, cols, scratch,
                              scratch + tokens * cols);
    free(scratch);
    return status;
}

/* Rotary embedding of x [tokens, heads * dim] into out of the same shape, each with element strides
 * (row, column): out = x * cos + rotate_half(x) * signed_sin, the tables built once per forward pass
 * by the caller (signed_sin holds -sin in its first half), both [tokens, dim] and [dim, tokens].
 * Token-major arrays are walked token by token, feature-major ones (a BLAS projection's column-major
 * result) feature by feature, so arrays and tables are all read and written front to back. */
void pie_rope(const float *x, long x_row, long x_column, const float *cos, const float *signed_sin,
              const float *cos_by_feature, const float *sin_by_feature, float *out, long out_row, long out_column,
              long tokens, long heads, long dim) {
    long half = dim / 2;
    if (x_column == 1 || tokens == 1) {
        for (long t = 0; t < tokens; t++) {
            const float *c = cos + t * dim, *s = signed_sin + t * dim;
            for (long h = 0; h < heads; h++) {
                const float *in = x + t * x_row + h * dim * x_column;
                float *o = out + t * out_row + h * dim * out_column;
                for (long i = 0; i < half; i++) {
                    float lo = in[i * x_column], hi = in[(i + half) * x_column];
                    o[i * out_column] = lo * c[i] + hi * s[i];
                    o[(i + half) * out_column] = hi * c[i + half] + lo * s[i + half];
                }
            }
        }
        return;
    }
    for (long h = 0; h < heads; h++)
        for (long i = 0; i < half; i++) {
            const float *lo = x + (h * dim + i) * x_column, *hi = lo + half * x_column;
            float *out_lo = out + (h * dim + i) * out_column, *out_hi = out_lo + half * out_column;
            const float *c_lo = cos_by_feature + i * tokens, *c_hi = c_lo + half * tokens;
            const float *s_lo = sin_by_feature + i * tokens, *s_hi = s_lo + half * tokens;
            for (long t = 0; t < tokens; t++) {
                float a = lo[t * x_row], b = hi[t * x_row];
                out_lo[t * out_row] = a * c_lo[t] + b * s_lo[t];
                out_hi[t * out_row] = b * c_hi[t] + a * s_hi[t];
            }
        }
}

/* A decoder layer's attention input: [q | k | v] = rms_norm(x) @ w.T (+ bias), then q and k in rotary
 * form (token-major tables, as pie_rope), into row-major q [tokens, q_width], k and v [tokens, kv_width];
 * normed [tokens, cols] and qkv [tokens, q_width + 2 kv_width] are scratch. */
static int norm_qkv_rope(const float *x, const float *norm_weight, float eps, const void *w, int type,
                         const float *bias, const float *q_norm, const float *k_norm, const float *cos,
                         const float *signed_sin, float *q, float *k, float *v, long tokens, long q_width,
                         long kv_width, long cols, long dim, float *normed, float *qkv) {
    long width = q_width + 2 * kv_width;
    rms_norm(x, norm_weight, eps, normed, tokens, cols);
    if (pie_linear(w, type, normed, bias, NULL, qkv, tokens, width, cols)) return -1;
    for (long t = 0; q_norm && t < tokens; t++) { /* per-head norms of q and k, in place, before the rotation */
        rms_norm(qkv + t * width, q_norm, eps, qkv + t * width, q_width / dim, dim);
        rms_norm(qkv + t * width + q_width, k_norm, eps, qkv + t * width + q_width, kv_width / dim, dim);
    }
    pie_rope(qkv, width, 1, cos, signed_sin, NULL, NULL, q, q_width, 1, tokens, q_width / dim, dim);
    pie_rope(qkv + q_width, width, 1, cos, signed_sin, NULL, NULL, k, kv_width, 1, tokens, kv_width / dim, dim);
    for (long t = 0; t < tokens; t++)
        memcpy(v + t * kv_width, qkv + t * width + q_width + kv_width, sizeof(float) * kv_width);
    return 0;
}

/* norm_qkv_rope with its own scratch; q_norm and k_norm [dim] (both or neither) are per-head norms of q and k.
 * Returns -1 when scratch memory cannot be had. */
int pie_rms_norm_qkv_rope(const float *x, const float *norm_weight, float eps, const void *w, int type,
                          const float *bias, const float *q_norm, const float *k_norm, const float *cos,
                          const float *signed_sin, float *q, float *k, float *v, long tokens, long q_width,
                          long kv_width, long cols, long dim) {
    float *scratch = malloc(sizeof(float) * tokens * (cols + q_width + 2 * kv_width));
    if (!scratch) return -1;
    int status = norm_qkv_rope(x, norm_weight, eps, w, type, bias, q_norm, k_norm, cos, signed_sin, q, k, v, tokens,
                               q_width, kv_width, cols, dim, scratch, scratch + tokens * cols);
    free(scratch);
    return status;
}

/* KV page element types (PageLayout.dtype). A narrow pool holds keys and values rounded to nearest even
 * as they are appended; attention widens them to float32 as it reads them and accumulates in float32. */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

static inline long kv_bytes(int type) { return type == KV_F32 ? 4 : 2; }

/* Where element `index` of a KV array of `type` lies. */
static inline const char *kv_at(const void *base, long index, int type) {
    return (const char *)base + index * kv_bytes(type);
}

static inline uint16_t float_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(bits >> 16 | 0x40); /* a NaN stays a (quiet) NaN */
    return (uint16_t)((bits + 0x7fffu + (bits >> 16 & 1)) >> 16);
}

static inline uint16_t float_to_half(float x) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    uint32_t bits, sign;
    memcpy(&bits, &x, 4);
    sign = bits >> 16 & 0x8000;
    bits &= 0x7fffffffu;
    if (bits >= 0x47800000u) /* 2^16 and up, infinities and NaNs (65520 up to 2^16 round to infinity below) */
        return (uint16_t)(sign | (bits > 0x7f800000u ? 0x7e00 : 0x7c00));
    if (bits < 0x38800000u) { /* under 2^-14: a subnormal half; adding 0.5 lets the FPU round the low bits off */
        float f, magic = 0.5f;
        uint32_t magic_bits;
        memcpy(&f, &bits, 4);
        f += magic;
        memcpy(&bits, &f, 4);
        memcpy(&magic_bits, &magic, 4);
        return (uint16_t)(sign | (bits - magic_bits));
    }
    /* rebias the exponent, then round the 13 dropped bits to nearest even (a carry may reach infinity) */
    bits += 0xc8000fffu + (bits >> 13 & 1);
    return (uint16_t)(sign | bits >> 13);
#endif
}

static inline float kv_scalar(const char *p, long i, int type) {
    if (type == KV_F32) return ((const float *)p)[i];
    if (type == KV_F16) return half_to_float((const uint8_t *)p + 2 * i);
    uint32_t bits = (uint32_t)((const uint8_t *)p)[2 * i] << 16 | (uint32_t)((const uint8_t *)p)[2 * i + 1] << 24;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* VEC elements of a KV array of `type` at p, widened to float32: F16C / AVX-512 conversion for float16,
 * a 16-bit shift for bfloat16. */
static inline __attribute__((always_inline)) vecf kv_load(const char *p, int type) {
    if (type == KV_F32) return vload((const float *)p);
#if VEC == 16
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (type == KV_F16) return (vecf)_mm512_cvtph_ps(h);
    return (vecf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif VEC == 8 && defined(__F16C__)
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (type == KV_F16) return (vecf)_mm256_cvtph_ps(h);
    return (vecf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
    vecf v;
    for (int i = 0; i < VEC; i++) v[i] = kv_scalar(p, i, type);
    return v;
#endif
}

static inline void kv_store(char *p, long i, float x, int type) {
    if (type == KV_F32) {
        ((float *)p)[i] = x;
    } else {
        uint16_t h = type == KV_F16 ? float_to_half(x) : float_to_bf16(x);
        memcpy(p + 2 * i, &h, 2);
    }
}

/* Writes each token's key and value rows (element strides *_row_stride, *_column_stride) into its
 * KV slot of one layer's pages [pages, 2, page_size, kv_heads * dim] of element type kv_type. */
static void append_kv(void *layer_pool, int kv_type, const float *k, long k_row_stride, long k_column_stride,
                      const float *v, long v_row_stride, long v_column_stride, const int *slots, long tokens,
                      long width, long page_size) {
    for (long t = 0; t < tokens; t++) {
        long page = slots[t] / page_size, offset = slots[t] % page_size;
        char *key = (char *)kv_at(layer_pool, ((page * 2) * page_size + offset) * width, kv_type);
        char *value = key + page_size * width * kv_bytes(kv_type);
        for (long i = 0; i < width; i++) {
            kv_store(key, i, k[t * k_row_stride + i * k_column_stride], kv_type);
            kv_store(value, i, v[t * v_row_stride + i * v_column_stride], kv_type);
        }
    }
}

/* Whether every slot lies in a pool of num_pages pages of page_size tokens. */
static int slots_fit(const int *slots, long tokens, long num_pages, long page_size) {
    long capacity = num_pages * page_size;
    for (long t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= capacity) return 0;
    return 1;
}

/* append_kv into a pool of num_pages pages; returns -4, having written nothing, when a slot lies outside it. */
int pie_append_kv(void *layer_pool, int kv_type, const float *k, long k_row_stride, long k_column_stride,
                  const float *v, long v_row_stride, long v_column_stride, const int *slots, long tokens, long width,
                  long page_size, long num_pages) {
    if (!slots_fit(slots, tokens, num_pages, page_size)) return -4;
    append_kv(layer_pool, kv_type, k, k_row_stride, k_column_stride, v, v_row_stride, v_column_stride, slots, tokens,
              width, page_size);
    return 0;
}

#ifdef HAVE_SHUFFLES
/* The sums of VEC vectors, as one vector (lane j: the sum of v[j]): pairs of vectors add their halves
 * side by side, log2(VEC) levels deep, VEC - 1 vector additions instead of VEC vsum reductions. The
 * lanes come out in bit-reversed order, and one last shuffle puts them back. */
static inline vecf vsums(const vecf v[VEC]) {
#if VEC == 16
    vecf h[8], q[4], e[2];
    for (int k = 0; k < 8; k++)
        h[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * k], v[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    for (int k = 0; k < 4; k++)
        q[k] = __builtin_shufflevector(h[2 * k], h[2 * k + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26,
                                       27) +
               __builtin_shufflevector(h[2 * k], h[2 * k + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30,
                                       31);
    for (int k = 0; k < 2; k++)
        e[k] = __builtin_shufflevector(q[2 * k], q[2 * k + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28,
                                       29) +
               __builtin_shufflevector(q[2 * k], q[2 * k + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                                       31);
    vecf z = __builtin_shufflevector(e[0], e[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
             __builtin_shufflevector(e[0], e[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    return __builtin_shufflevector(z, z, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
#elif VEC == 8
    vecf h[4], q[2];
    for (int k = 0; k < 4; k++)
        h[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(v[2 * k], v[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int k = 0; k < 2; k++)
        q[k] = __builtin_shufflevector(h[2 * k], h[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(h[2 * k], h[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    vecf z = __builtin_shufflevector(q[0], q[1], 0, 8, 2, 10, 4, 12, 6, 14) +
             __builtin_shufflevector(q[0], q[1], 1, 9, 3, 11, 5, 13, 7, 15);
    return __builtin_shufflevector(z, z, 0, 4, 2, 6, 1, 5, 3, 7);
#else
    vecf h[2];
    for (int k = 0; k < 2; k++)
        h[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 1, 4, 5) +
               __builtin_shufflevector(v[2 * k], v[2 * k + 1], 2, 3, 6, 7);
    vecf z = __builtin_shufflevector(h[0], h[1], 0, 4, 2, 6) + __builtin_shufflevector(h[0], h[1], 1, 5, 3, 7);
    return __builtin_shufflevector(z, z, 0, 2, 1, 3);
#endif
}
#endif

/* a . b, b a KV array of `type`. */
static inline __attribute__((always_inline)) float kv_dot(const float *restrict a, const char *b, long n, int type) {
    long i = 0;
    vecf acc = {0};
    for (; i + VEC <= n; i += VEC) acc += vload(a + i) * kv_load(kv_at(b, i, type), type);
    float s = vsum(acc);
    for (; i < n; i++) s += a[i] * kv_scalar(b, i, type);
    return s;
}

/* Causal attention over paged KV: sequence b has query rows q[qo_indptr[b] .. qo_indptr[b+1]] ([heads *
 * dim] each, already in rotary form), the newest of its KV tokens, in order: pages page_indices[page_indptr[b]
 * .. page_indptr[b+1]] of one layer's pages [pages, 2, page_size, kv_heads, dim], the last page holding
 * last_lens[b] tokens. A query row sees the keys up to its own position (with a window, only the last
 * `window` of them); query head h reads KV head h / (heads / kv_heads). With softcap, each score s becomes
 * softcap * tanh(s / softcap). A decode pass has one row per sequence, a prefill many: each row is
 * attended as a decode row would be. */
struct paged_attention {
    const float *q;
    const void *layer_pool;
    const int *qo_indptr, *page_indices, *page_indptr, *last_lens;
    const int *row_sequence; /* the sequence of each query row */
    const int *row_list;     /* the rows attended one at a time (attend), work / kv_heads / splits of them */
    float *out;
    long heads, kv_heads, dim, page_size, longest, work;
    float scale;
    atomic_int failed;
    long splits;     /* key ranges each (sequence, KV head) is cut into; 1: the whole of it at once */
    float *partials; /* with splits: per (query row, head, range), the unnormalized context, peak and total */
    int kv_type;     /* the pages' element type (KV_*) */
    long window;     /* keys a row sees at most; 0: every key up to its own */
    float softcap;   /* 0: scores as they are */
};

/* The first key a row that sees `length` keys attends to under a window of `window` keys (0: none). */
static inline long window_start(long length, long window) {
    return window > 0 && length > window ? length - window : 0;
}

/* scores[i] = softcap * tanh(scores[i] / softcap) for i < n. */
static void soft_cap(float *scores, long n, float softcap) {
    float inverse = 1.0f / softcap;
    for (long i = 0; i < n; i++) scores[i] = softcap * tanhf(scores[i] * inverse);
}

/* Floats of one range's partial result: the context's dim sums, then the peak score and the total of
 * e^(score - peak). */
static inline long partial_size(long dim) { return dim + 2; }

/* Keys sequence b holds: whole pages, then last_lens[b] on the last. */
static inline long kv_length(const int *page_indptr, const int *last_lens, long page_size, long b) {
    return (page_indptr[b + 1] - page_indptr[b] - 1) * page_size + last_lens[b];
}

/* One (query row, KV head, key range) item's keys and values: whole pages of the keys the row sees. */
struct item_keys {
    const char *keys, *values; /* page 0's keys and values of the item's KV head; a page's are page_stride on */
    const int *pages;          /* the row's pages */
    long first_page, begin, end, width, page_size, page_stride;
    int type; /* the elements' type (KV_*) */
};

static inline const char *page_keys(const struct item_keys *k, long page, int type) {
    return kv_at(k->keys, k->pages[page] * k->page_stride, type);
}

static inline const char *page_values(const struct item_keys *k, long page, int type) {
    return kv_at(k->values, k->pages[page] * k->page_stride, type);
}

/* scores[h][key] = scale * query[h] . key, for `count` (1 or 2, a constant where called) query heads over
 * the item's keys. Two heads share each key's loads: half a block of VEC keys for each, in one vsums. */
static inline __attribute__((always_inline)) void score_heads_of(const struct item_keys *k,
                                                                const float *const *query, const int count,
                                                                long dim, float scale, float *const *scores,
                                                                const int type) {
    long width = k->width;
    for (long first = k->begin, page = k->first_page; first < k->end; first += k->page_size, page++) {
        const char *keys = page_keys(k, page, type);
        long stop = k->end - first < k->page_size ? k->end - first : k->page_size;
        long j = 0;
#ifdef HAVE_SHUFFLES
        /* VEC dot products, a vector of each key at a time, reduced together. Key by key (each key's
         * whole dot product, then the next key's) the attention was slower: each key waited on its own
         * chain of multiply-adds. */
        const long block = VEC / count;
        if (dim % VEC == 0)
            for (; j + block <= stop; j += block) {
                vecf partial[VEC], part[2];
                const char *key = kv_at(keys, j * width, type);
                for (int h = 0; h < count; h++) part[h] = vload(query[h]);
                for (int u = 0; u < block; u++) {
                    vecf row = kv_load(kv_at(key, u * width, type), type);
                    for (int h = 0; h < count; h++) partial[h * block + u] = part[h] * row;
                }
                for (long i = VEC; i < dim; i += VEC) {
                    for (int h = 0; h < count; h++) part[h] = vload(query[h] + i);
                    for (int u = 0; u < block; u++) {
                        vecf row = kv_load(kv_at(key, u * width + i, type), type);
                        for (int h = 0; h < count; h++) partial[h * block + u] += part[h] * row;
                    }
                }
                float lanes[VEC];
                vstore(lanes, vsums(partial) * scale);
                for (int h = 0; h < count; h++) memcpy(scores[h] + first + j, lanes + h * block, sizeof(float) * block);
            }
#endif
        for (; j < stop; j++)
            for (int h = 0; h < count; h++)
                scores[h][first + j] = kv_dot(query[h], kv_at(keys, j * width, type), dim, type) * scale;
    }
}

static inline void score_heads(const struct item_keys *k, const float *const *query, const int count, long dim,
                               float scale, float *const *scores) {
    switch (k->type) {
    case KV_F16: score_heads_of(k, query, count, dim, scale, scores, KV_F16); break;
    case KV_BF16: score_heads_of(k, query, count, dim, scale, scores, KV_BF16); break;
    default: score_heads_of(k, query, count, dim, scale, scores, KV_F32);
    }
}

/* context[h] = inverse[h] * sum over the item's keys of weights[h][key] * value, for `count` (1 or 2, a
 * constant where called) heads; two heads share each value's loads. Four VEC features at a time, in sums
 * held in registers across all keys: a sum kept in memory made every key wait for the last key's store,
 * and one sum in a register made every key wait for the last key's add (both much slower than four). */
static inline __attribute__((always_inline)) void add_values_of_heads_of(const struct item_keys *k,
                                                                        const float *const *weights, const int count,
                                                                        long dim, const float *inverse,
                                                                        float *const *context, const int type) {
    long width = k->width, i = 0;
    for (; i + 4 * VEC <= dim; i += 4 * VEC) {
        vecf sums[2][4] = {{{0}}};
        for (long first = k->begin, page = k->first_page; first < k->end; first += k->page_size, page++) {
            const char *values = kv_at(page_values(k, page, type), i, type);
            long stop = k->end - first < k->page_size ? k->end - first : k->page_size;
            for (long j = 0; j < stop; j++) {
                const char *value = kv_at(values, j * width, type);
                vecf v0 = kv_load(value, type), v1 = kv_load(kv_at(value, VEC, type), type);
                vecf v2 = kv_load(kv_at(value, 2 * VEC, type), type), v3 = kv_load(kv_at(value, 3 * VEC, type), type);
                for (int h = 0; h < count; h++) {
                    vecf p = vsplat(weights[h][first + j]);
                    sums[h][0] += p * v0;
                    sums[h][1] += p * v1;
                    sums[h][2] += p * v2;
                    sums[h][3] += p * v3;
                }
            }
        }
        for (int h = 0; h < count; h++)
            for (int c = 0; c < 4; c++) vstore(context[h] + i + c * VEC, sums[h][c] * inverse[h]);
    }
    for (; i + VEC <= dim; i += VEC) {
        vecf sums[2] = {{0}};
        for (long first = k->begin, page = k->first_page; first < k->end; first += k->page_size, page++) {
            const char *values = kv_at(page_values(k, page, type), i, type);
            long stop = k->end - first < k->page_size ? k->end - first : k->page_size;
            for (long j = 0; j < stop; j++) {
                vecf value = kv_load(kv_at(values, j * width, type), type);
                for (int h = 0; h < count; h++) sums[h] += weights[h][first + j] * value;
            }
        }
        for (int h = 0; h < count; h++) vstore(context[h] + i, sums[h] * inverse[h]);
    }
    for (; i < dim; i++)
        for (int h = 0; h < count; h++) {
            float sum = 0.0f;
            for (long j = k->begin; j < k->end; j++)
                sum += weights[h][j] *
                       kv_scalar(page_values(k, j / k->page_size, type), (j % k->page_size) * width + i, type);
            context[h][i] = sum * inverse[h];
        }
}

static inline void add_values_of_heads(const struct item_keys *k, const float *const *weights, const int count,
                                       long dim, const float *inverse, float *const *context) {
    switch (k->type) {
    case KV_F16: add_values_of_heads_of(k, weights, count, dim, inverse, context, KV_F16); break;
    case KV_BF16: add_values_of_heads_of(k, weights, count, dim, inverse, context, KV_BF16); break;
    default: add_values_of_heads_of(k, weights, count, dim, inverse, context, KV_F32);
    }
}

/* One (query row, KV head, key range) item: the query heads of its group over the range's keys, which
 * are whole pages of the keys the row sees. The first head alone, then the others two at a time. The
 * first head's passes read the keys and values from memory, and they run at the rate their own loads in
 * flight allow: arithmetic of more heads between those loads slowed them by more than it saved (as
 * every head of the group at once did). The later heads read them from L2, and a pair shares each
 * load: against each head on its own, batch-1 decode attention took less time at long contexts, the
 * same at short ones. Unsplit, the context is written normalized; split, the range's partial result,
 * which pie_paged_attention combines. Under a window, the ranges cut the pages the window touches; the
 * keys of its first page before the window are scored and weighed 0. scores holds 2 * longest floats. */
static void attend(const struct paged_attention *a, long item, float *scores) {
    long split = item % a->splits, kv_head = item / a->splits % a->kv_heads;
    long row = a->row_list[item / a->splits / a->kv_heads];
    long heads = a->heads, dim = a->dim, page_size = a->page_size, group = heads / a->kv_heads;
    long width = a->kv_heads * dim, b = a->row_sequence[row];
    long length = kv_length(a->page_indptr, a->last_lens, page_size, b) - (a->qo_indptr[b + 1] - 1 - row);
    long page_count = (length + page_size - 1) / page_size, seen = window_start(length, a->window);
    long window_page = seen / page_size, window_pages = page_count - window_page;
    long first_page = window_page + window_pages * split / a->splits;
    long end_page = window_page + window_pages * (split + 1) / a->splits;
    long begin = first_page * page_size, end = end_page * page_size < length ? end_page * page_size : length;
    long from = seen < begin ? begin : seen < end ? seen : end; /* the range's first key in the window */
    const char *keys = kv_at(a->layer_pool, kv_head * dim, a->kv_type);
    struct item_keys k = {keys,  kv_at(keys, page_size * width, a->kv_type), a->page_indices + a->page_indptr[b],
                          first_page, begin, end, width, page_size, 2 * page_size * width, a->kv_type};
    for (long g = 0; g < group;) {
        int count = g > 0 && g + 1 < group ? 2 : 1;
        const float *query[2];
        float *weights[2] = {scores, scores + a->longest}, *context[2], peak[2], total[2], inverse[2];
        for (int h = 0; h < count; h++) {
            long head = kv_head * group + g + h;
            query[h] = a->q + (row * heads + head) * dim;
            context[h] = a->splits > 1 ? a->partials + ((row * heads + head) * a->splits + split) * partial_size(dim)
                                       : a->out + (row * heads + head) * dim;
        }
        if (count == 2)
            score_heads(&k, query, 2, dim, a->scale, weights);
        else
            score_heads(&k, query, 1, dim, a->scale, weights);
        for (int h = 0; h < count; h++) {
            if (a->softcap > 0.0f) soft_cap(weights[h] + from, end - from, a->softcap);
            peak[h] = peak_of(weights[h] + from, end - from);
            total[h] = exp_shifted(weights[h] + from, end - from, peak[h]);
            inverse[h] = a->splits > 1 ? 1.0f : 1.0f / total[h];
            for (long j = begin; j < from; j++) weights[h][j] = 0.0f;
        }
        if (count == 2)
            add_values_of_heads(&k, (const float *const *)weights, 2, dim, inverse, context);
        else
            add_values_of_heads(&k, (const float *const *)weights, 1, dim, inverse, context);
        for (int h = 0; h < count && a->splits > 1; h++) {
            context[h][dim] = peak[h];
            context[h][dim + 1] = total[h];
        }
        g += count;
    }
}

/* out[row, head] from the key ranges' partial results: each range's sums and total scaled by
 * e^(its peak - the highest peak), summed, and divided (a range without keys has peak -inf: weight 0). */
static void combine_ranges(const struct paged_attention *a, long rows) {
    long dim = a->dim, splits = a->splits, size = partial_size(dim);
    for (long head = 0; head < rows * a->heads; head++) {
        const float *parts = a->partials + head * splits * size;
        float peak = -INFINITY, total = 0.0f;
        for (long s = 0; s < splits; s++) peak = parts[s * size + dim] > peak ? parts[s * size + dim] : peak;
        float *context = a->out + head * dim;
        for (long i = 0; i < dim; i++) context[i] = 0.0f;
        for (long s = 0; s < splits; s++) {
            float weight = expf(parts[s * size + dim] - peak);
            total += weight * parts[s * size + dim + 1];
            for (long i = 0; i < dim; i++) context[i] += weight * parts[s * size + i];
        }
        float inverse = 1.0f / total;
        for (long i = 0; i < dim; i++) context[i] *= inverse;
    }
}

/* Prefill tiles. A sequence with several query rows is attended TILE_QUERIES query vectors at a time:
 * consecutive rows times the heads of one KV head's group, which see nearly the same keys. Its keys
 * are first copied transposed, VEC keys to a block ([blocks][dim][VEC], zeros past the last key), so
 * that a block's scores for a query vector are dim multiply-adds of one broadcast query element by one
 * vector of VEC keys, each key vector loaded once for the whole tile; the values are read once per
 * tile likewise. One row at a time, every row and head reloaded every key; tiled, prefills ran faster,
 * the more so the longer they were (native_ab.py --prefill). */
#define TILE_QUERIES 6
#define TILE_KEY_BLOCKS 2 /* key vectors a query element multiplies: 6 x 2 sums, 2 keys and a query in 16 registers */
#if defined(__AVX512F__) || defined(__aarch64__)
#define TILE_DIM_VECTORS 4 /* value vectors a tile sums at once: 6 x 4 sums and 4 values in 32 registers */
#else
#define TILE_DIM_VECTORS 2 /* 6 x 2 sums and 2 values in 16 registers */
#endif

struct tiled_attention {
    const struct paged_attention *a;
    const int *tile_first, *tile_rows; /* each tile's first query row and its row count */
    const int *sequences;              /* the tiled sequences, `count` of them */
    const long *packed_at;             /* per sequence: where its transposed keys start in packed */
    float *packed;
    long tiles, count, longest;
    atomic_int failed;
};

static inline long key_blocks(long length) { return (length + VEC - 1) / VEC; }

/* Where sequence b's transposed keys of one KV head start. */
static inline float *packed_keys(const struct tiled_attention *t, long b, long kv_head) {
    const struct paged_attention *a = t->a;
    long length = kv_length(a->page_indptr, a->last_lens, a->page_size, b);
    return t->packed + t->packed_at[b] + kv_head * key_blocks(length) * a->dim * VEC;
}

/* One (tiled sequence, KV head) item: its keys transposed into blocks of VEC. */
static void pack_task(const void *task, int chunk, int chunks) {
    const struct tiled_attention *t = task;
    const struct paged_attention *a = t->a;
    long dim = a->dim, page_size = a->page_size, width = a->kv_heads * dim;
    for (long item = chunk; item < t->count * a->kv_heads; item += chunks) {
        long b = t->sequences[item / a->kv_heads], kv_head = item % a->kv_heads;
        long length = kv_length(a->page_indptr, a->last_lens, page_size, b);
        const int *pages = a->page_indices + a->page_indptr[b];
        float *packed = packed_keys(t, b, kv_head);
        memset(packed, 0, sizeof(float) * key_blocks(length) * dim * VEC);
        for (long k = 0; k < length; k++) {
            long at = (pages[k / page_size] * 2L * page_size + k % page_size) * width + kv_head * dim;
            const char *key = kv_at(a->layer_pool, at, a->kv_type);
            float *column = packed + (k / VEC) * dim * VEC + k % VEC;
            for (long d = 0; d < dim; d++) column[d * VEC] = kv_scalar(key, d, a->kv_type);
        }
    }
}

/* scores[v][k] for v < count and the keys of transposed blocks block .. block + BLOCKS - 1 (count and BLOCKS
 * constants where it is called): each query element, broadcast once, multiplies BLOCKS key vectors. */
static inline __attribute__((always_inline)) void tile_score_blocks(const float *packed, const float *const *queries,
                                                                   const int count, long dim, long block,
                                                                   float scale, float *scores, long stride,
                                                                   const int BLOCKS) {
    const float *keys = packed + block * dim * VEC;
    vecf sums[TILE_QUERIES][TILE_KEY_BLOCKS];
    for (int v = 0; v < count; v++)
        for (int j = 0; j < BLOCKS; j++) sums[v][j] = (vecf){0};
    for (long d = 0; d < dim; d++) {
        vecf columns[TILE_KEY_BLOCKS];
        for (int j = 0; j < BLOCKS; j++) columns[j] = vload(keys + (j * dim + d) * VEC);
        for (int v = 0; v < count; v++) {
            vecf query = vsplat(queries[v][d]);
            for (int j = 0; j < BLOCKS; j++) sums[v][j] += query * columns[j];
        }
    }
    for (int v = 0; v < count; v++)
        for (int j = 0; j < BLOCKS; j++) vstore(scores + v * stride + (block + j) * VEC, sums[v][j] * scale);
}

/* scores[v][k] = scale * dot(queries[v], key k) for v < count (a constant where it is called) and the
 * keys of `blocks` transposed blocks, TILE_KEY_BLOCKS at a time: one key block a step took a load per
 * multiply-add (its key vector and each query's broadcast element). */
static inline void tile_scores(const float *packed, const float *const *queries, const int count, long dim,
                               long blocks, float scale, float *scores, long stride) {
    long block = 0;
    for (; block + TILE_KEY_BLOCKS <= blocks; block += TILE_KEY_BLOCKS)
        tile_score_blocks(packed, queries, count, dim, block, scale, scores, stride, TILE_KEY_BLOCKS);
    for (; block < blocks; block++) tile_score_blocks(packed, queries, count, dim, block, scale, scores, stride, 1);
}

/* contexts[v] = sum over keys k < length of weights[v][k] * value k, for v < count (a constant where it
 * is called); a tile's weights are zero past each query's own keys. */
static inline __attribute__((always_inline)) void tile_values_of(const struct paged_attention *a, long b,
                                                                long kv_head, long length, const float *weights,
                                                                long stride, const int count,
                                                                float *const *contexts, const int type) {
    long dim = a->dim, page_size = a->page_size, width = a->kv_heads * dim;
    const int *pages = a->page_indices + a->page_indptr[b];
    for (long i = 0; i < dim; i += TILE_DIM_VECTORS * VEC) {
        vecf sums[TILE_QUERIES][TILE_DIM_VECTORS];
        for (int v = 0; v < count; v++)
            for (int c = 0; c < TILE_DIM_VECTORS; c++) sums[v][c] = (vecf){0};
        for (long k = 0; k < length; k++) {
            long slot = (pages[k / page_size] * 2L + 1) * page_size + k % page_size;
            const char *value = kv_at(a->layer_pool, slot * width + kv_head * dim + i, type);
            vecf values[TILE_DIM_VECTORS];
            for (int c = 0; c < TILE_DIM_VECTORS; c++) values[c] = kv_load(kv_at(value, c * VEC, type), type);
            for (int v = 0; v < count; v++) {
                vecf weight = vsplat(weights[v * stride + k]);
                for (int c = 0; c < TILE_DIM_VECTORS; c++) sums[v][c] += weight * values[c];
            }
        }
        for (int v = 0; v < count; v++)
            for (int c = 0; c < TILE_DIM_VECTORS; c++) vstore(contexts[v] + i + c * VEC, sums[v][c]);
    }
}

static inline void tile_values(const struct paged_attention *a, long b, long kv_head, long length,
                               const float *weights, long stride, const int count, float *const *contexts) {
    switch (a->kv_type) {
    case KV_F16: tile_values_of(a, b, kv_head, length, weights, stride, count, contexts, KV_F16); break;
    case KV_BF16: tile_values_of(a, b, kv_head, length, weights, stride, count, contexts, KV_BF16); break;
    default: tile_values_of(a, b, kv_head, length, weights, stride, count, contexts, KV_F32);
    }
}

#define TILE_COUNT(n)                                                                                              \
    case n:                                                                                                        \
        tile_scores(packed, queries, n, dim, blocks, a->scale, scores, stride);                                   \
        break
#define TILE_VALUES(n)                                                                                             \
    case n:                                                                                                        \
        tile_values(a, b, kv_head, longest, scores, stride, n, contexts);                                          \
        break

/* One (tile, KV head) item: scores for every query vector of the tile, each row's own softmax over the
 * keys up to its position (in its window), then the values. scores holds TILE_QUERIES x (t->longest rounded up to VEC). */
static void attend_tile(const struct tiled_attention *t, long tile, long kv_head, float *scores) {
    const struct paged_attention *a = t->a;
    long heads = a->heads, dim = a->dim, group = heads / a->kv_heads;
    long first = t->tile_first[tile], rows = t->tile_rows[tile], b = a->row_sequence[first];
    long total = kv_length(a->page_indptr, a->last_lens, a->page_size, b), last = a->qo_indptr[b + 1] - 1;
    long longest = total - (last - (first + rows - 1)), blocks = key_blocks(longest);
    long stride = key_blocks(t->longest) * VEC;
    const float *queries[TILE_QUERIES];
    float *contexts[TILE_QUERIES];
    long lengths[TILE_QUERIES];
    int count = 0;
    for (long r = 0; r < rows; r++)
        for (long g = 0; g < group; g++, count++) {
            long head = kv_head * group + g;
            queries[count] = a->q + (first + r) * heads * dim + head * dim;
            contexts[count] = a->out + (first + r) * heads * dim + head * dim;
            lengths[count] = total - (last - (first + r));
        }
    const float *packed = packed_keys(t, b, kv_head);
    switch (count) {
        TILE_COUNT(1);
        TILE_COUNT(2);
        TILE_COUNT(3);
        TILE_COUNT(4);
        TILE_COUNT(5);
        TILE_COUNT(6);
    default: break;
    }
    float inverse[TILE_QUERIES];
    for (int v = 0; v < count; v++) {
        float *row = scores + v * stride;
        long seen = window_start(lengths[v], a->window);
        if (a->softcap > 0.0f) soft_cap(row + seen, lengths[v] - seen, a->softcap);
        inverse[v] = 1.0f / exp_shifted(row + seen, lengths[v] - seen, peak_of(row + seen, lengths[v] - seen));
        for (long k = 0; k < seen; k++) row[k] = 0.0f;
        for (long k = lengths[v]; k < longest; k++) row[k] = 0.0f;
    }
    switch (count) {
        TILE_VALUES(1);
        TILE_VALUES(2);
        TILE_VALUES(3);
        TILE_VALUES(4);
        TILE_VALUES(5);
        TILE_VALUES(6);
    default: break;
    }
    for (int v = 0; v < count; v++)
        for (long i = 0; i < dim; i += VEC) vstore(contexts[v] + i, vload(contexts[v] + i) * inverse[v]);
}

static void tile_task(const void *task, int chunk, int chunks) {
    struct tiled_attention *t = (struct tiled_attention *)task;
    float *scores = malloc(sizeof(float) * TILE_QUERIES * key_blocks(t->longest > 0 ? t->longest : 1) * VEC);
    if (!scores) {
        atomic_store(&t->failed, 1);
        return;
    }
    for (long item = chunk; item < t->tiles * t->a->kv_heads; item += chunks)
        attend_tile(t, item / t->a->kv_heads, item % t->a->kv_heads, scores);
    free(scores);
}

/* Always on the pool's threads when there are two items: a layer's pages come from memory (a pass
 * of weights has gone through the caches since they were read), and two cores wait on them in
 * parallel, faster even at batch 1 and 70 keys, where the arithmetic alone would not pay for the
 * dispatch. A chunk takes every chunks-th item: a prefill's later rows see more keys, and
 * contiguous runs of rows left the last chunk the heaviest. */
static void attention_task(const void *task, int chunk, int chunks) {
    struct paged_attention *a = (struct paged_attention *)task;
    if (chunk >= a->work) return; /* no item: no scratch to make */
    float *scores = malloc(sizeof(float) * 2 * (a->longest > 0 ? a->longest : 1));
    if (!scores) {
        atomic_store(&a->failed, 1);
        return;
    }
    for (long item = chunk; item < a->work; item += chunks) attend(a, item, scores);
    free(scores);
}

/* Key ranges each (sequence, KV head) item is cut into: as many as give every thread two items, when
 * there are fewer (a batch-1 decode has as many items as KV heads), each range at least a page. With
 * three items on two threads, one thread attended two and the other waited: cut in two, a batch-1
 * decode step ran faster at long contexts, as fast at short ones (benchmarks/native_ab.py). And at least
 * as many as keep a range's keys and values (page_bytes a page) within a quarter of the L2 cache, half a
 * projection's token tile, where the later heads of a group find them again: at a long context, both
 * larger and smaller ranges made batch-1 attention slower. Those ranges' partial results (partial_floats
 * a range, over every row and head) stay within PARTIALS_FLOATS: 2048 prefill rows of 32 heads of 80 (not
 * tiled) at 8000 tokens of context would otherwise take 430 MB of them. */
#define PARTIALS_FLOATS (16L << 20)
static long attention_splits(long items, long most_pages, long page_bytes, long partial_floats) {
    long threads = pool.started < pool.threads ? pool.started : pool.threads;
    long splits = threads < 2 || items >= 2 * threads ? 1 : (2 * threads + items - 1) / items;
    long fitting = (2 * most_pages * page_bytes + tile_bytes() - 1) / tile_bytes();
    long affordable = PARTIALS_FLOATS / (partial_floats > 0 ? partial_floats : 1); /* a pass's partials at most */
    if (fitting > affordable) fitting = affordable;
    if (fitting > splits) splits = fitting;
    return splits < most_pages ? splits : most_pages > 0 ? most_pages : 1;
}

/* Whether every sequence of a pass has at most one query row (a decode pass). */
static int decode_rows(const int *qo_indptr, long batch) {
    for (long b = 0; b < batch; b++)
        if (qo_indptr[b + 1] - qo_indptr[b] > 1) return 0;
    return 1;
}

/* Whether a batch's page tables describe `rows` query rows over a pool of num_pages pages: qo_indptr and
 * page_indptr start at 0 and never decrease, qo_indptr ends at rows and page_indptr within the num_indices page
 * indices, every page index read lies in the pool, a sequence with pages has a last page length in
 * 1..page_size, and no sequence has more query rows than tokens in its pages. The attention reads the pages
 * unbounded: a damaged table is refused, never followed. */
static int page_tables_fit(const int *qo_indptr, const int *page_indices, const int *page_indptr,
                           const int *last_lens, long batch, long rows, long num_indices, long num_pages,
                           long page_size) {
    if (batch < 0 || qo_indptr[0] != 0 || page_indptr[0] != 0 || qo_indptr[batch] != rows ||
        page_indptr[batch] > num_indices)
        return 0;
    for (long b = 0; b < batch; b++) {
        long pages = page_indptr[b + 1] - page_indptr[b];
        if (qo_indptr[b + 1] < qo_indptr[b] || pages < 0) return 0;
        if (pages > 0 && (last_lens[b] < 1 || last_lens[b] > page_size)) return 0;
        if (qo_indptr[b + 1] - qo_indptr[b] > (pages > 0 ? (pages - 1) * page_size + last_lens[b] : 0)) return 0;
    }
    for (long i = 0; i < page_indptr[batch]; i++)
        if (page_indices[i] < 0 || page_indices[i] >= num_pages) return 0;
    return 1;
}

static int paged_attention(const float *q, const void *layer_pool, int kv_type, const int *qo_indptr,
                           const int *page_indices, const int *page_indptr, const int *last_lens, float *out,
                           long batch, long heads, long kv_heads, long dim, long page_size, float scale, long window,
                           float softcap) {
    /* Sequences of several rows go in tiles, where a tile's sums fit the registers: packed_at[b] is where
     * a tiled sequence's transposed keys start, -1 for a sequence attended a row at a time. */
    long group = heads / kv_heads;
    long rows_per_tile = group <= TILE_QUERIES && dim % (TILE_DIM_VECTORS * VEC) == 0 ? TILE_QUERIES / group : 0;
    long *packed_at = malloc(sizeof(long) * (batch > 0 ? batch : 1));
    if (!packed_at) return -1;
    long rows = qo_indptr[batch], longest = 0, most_pages = 0, tiles = 0, tiled = 0, single = 0, packed_floats = 0;
    for (long b = 0; b < batch; b++) {
        long length = kv_length(page_indptr, last_lens, page_size, b), n = qo_indptr[b + 1] - qo_indptr[b];
        if (length > longest) longest = length;
        if (page_indptr[b + 1] - page_indptr[b] > most_pages) most_pages = page_indptr[b + 1] - page_indptr[b];
        packed_at[b] = -1;
        if (rows_per_tile && n > 1) {
            tiles += (n + rows_per_tile - 1) / rows_per_tile;
            tiled++;
            packed_at[b] = packed_floats;
            packed_floats += kv_heads * key_blocks(length) * dim * VEC;
        } else
            single += n;
    }
    int *row_sequence = malloc(sizeof(int) * (rows + single + 2 * tiles + tiled + 1));
    float *packed = malloc(sizeof(float) * (packed_floats + 1));
    if (!row_sequence || !packed) {
        free(row_sequence);
        free(packed_at);
        free(packed);
        return -1;
    }
    int *row_list = row_sequence + rows, *tile_first = row_list + single, *tile_rows = tile_first + tiles;
    int *sequences = tile_rows + tiles;
    long listed = 0, tile = 0, sequence = 0;
    for (long b = 0; b < batch; b++) {
        for (long row = qo_indptr[b]; row < qo_indptr[b + 1]; row++) row_sequence[row] = (int)b;
        if (packed_at[b] >= 0) {
            for (long row = qo_indptr[b]; row < qo_indptr[b + 1]; row += rows_per_tile, tile++) {
                tile_first[tile] = (int)row;
                long left = qo_indptr[b + 1] - row;
                tile_rows[tile] = (int)(left < rows_per_tile ? left : rows_per_tile);
            }
            sequences[sequence++] = (int)b;
        } else
            for (long row = qo_indptr[b]; row < qo_indptr[b + 1]; row++) row_list[listed++] = (int)row;
    }
    struct paged_attention task = {q,     layer_pool, qo_indptr, page_indices, page_indptr, last_lens, row_sequence,
                                   row_list, out,     heads,     kv_heads,     dim,         page_size, longest,
                                   single * kv_heads, scale,   0,           1,            NULL,      kv_type,
                                   window,   softcap};
    if (!tiled)
        task.splits = attention_splits(task.work, most_pages, 2 * page_size * dim * kv_bytes(kv_type),
                                       rows * heads * partial_size(dim));
    int failed = 0;
    if (task.splits > 1) {
        task.work *= task.splits;
        task.partials = malloc(sizeof(float) * rows * heads * task.splits * partial_size(dim));
        failed = !task.partials;
    }
    if (!failed && task.work) {
        run_parallel(attention_task, &task, task.work > 1);
        if (task.splits > 1 && !atomic_load(&task.failed)) combine_ranges(&task, rows);
        failed = atomic_load(&task.failed);
    }
    if (!failed && tiled) {
        struct tiled_attention tiling = {&task, tile_first, tile_rows, sequences, packed_at, packed,
                                         tiles, tiled,      longest,   0};
        run_parallel(pack_task, &tiling, tiled * kv_heads > 1);
        run_parallel(tile_task, &tiling, tiles * kv_heads > 1);
        failed = atomic_load(&tiling.failed);
    }
    free(task.partials);
    free(row_sequence);
    free(packed_at);
    free(packed);
    return failed ? -1 : 0;
}

/* Attention of `rows` query rows over one layer's pages of a pool of num_pages pages, through page tables of
 * num_indices page indices. Returns -4, having read nothing, when the tables do not fit the pool
 * (page_tables_fit), -1 when scratch memory cannot be had, else 0. */
int pie_paged_attention(const float *q, const void *layer_pool, int kv_type, const int *qo_indptr,
                        const int *page_indices, const int *page_indptr, const int *last_lens, float *out, long batch,
                        long heads, long kv_heads, long dim, long page_size, float scale, long window, float softcap,
                        long rows, long num_indices, long num_pages) {
    if (!page_tables_fit(qo_indptr, page_indices, page_indptr, last_lens, batch, rows, num_indices, num_pages,
                         page_size))
        return -4;
    return paged_attention(q, layer_pool, kv_type, qo_indptr, page_indices, page_indptr, last_lens, out, batch, heads,
                           kv_heads, dim, page_size, scale, window, softcap);
}

/* One decoder layer's weights, options and shapes, and its pages of the pool [pages, 2, page_size, kv_heads * dim]. */
struct decoder_layer {
    const float *attn_norm;
    const void *qkv;
    const float *qkv_bias;
    const void *o;
    const float *o_bias, *mlp_norm;
    const void *gate_up, *down;
    const float *q_norm, *k_norm; /* per-head norms of q and k [dim], or both NULL */
    const float *attn_post_norm, *mlp_post_norm; /* of the attention's and the MLP's outputs [hidden], or NULL */
    const float *inv_freq;                       /* the rotary inverse frequencies [dim / 2] */
    void *layer_pool;
    float attn_eps, mlp_eps, scale;
    float softcap; /* scores pass through softcap * tanh(s / softcap); 0: as they are */
    long hidden, q_width, kv_width, inter, heads, kv_heads, dim, page_size;
    long window;     /* keys a row sees at most; 0: every key up to its own */
    long activation; /* the MLP's gate activation (GATE_*) */
    long qkv_type, o_type, gate_up_type, down_type; /* the four matrices' weight types (W_*) */
    long kv_type;                                   /* the pages' element type (KV_*) */
};

/* What every layer of one decode pass reads: its positions (the rotary tables are made from them, once
 * per call and table of inverse frequencies) and its page tables. */
struct decode_pass {
    const int *positions;
    const int *slots, *qo_indptr, *page_indices, *page_indptr, *last_lens;
    long batch, tokens;
    long num_indices, num_pages; /* the length of page_indices, and the pages of the pool */
};

/* Token-major rotary tables [tokens, dim] as pie_rope reads them: cos of each angle twice, and the sin
 * negated in the first half. The angle is formed in float32, as the model's reference does. */
static void rope_tables(const int *positions, const float *inv_freq, long tokens, long dim, float *cos,
                        float *signed_sin) {
    long half = dim / 2;
    for (long t = 0; t < tokens; t++)
        for (long i = 0; i < half; i++) {
            float angle = (float)positions[t] * inv_freq[i];
            float c = cosf(angle), s = sinf(angle);
            cos[t * dim + i] = cos[t * dim + half + i] = c;
            signed_sin[t * dim + i] = -s;
            signed_sin[t * dim + half + i] = s;
        }
}

/* Floats of scratch one layer of a pass of `tokens` rows uses. */
static long layer_scratch(const struct decoder_layer *layer, long tokens) {
    return tokens * (2 * layer->hidden + 3 * layer->q_width + 4 * layer->kv_width + 2 * layer->inter);
}

/* out = residual + rms_norm(y, norm_weight), all [tokens, cols]. */
static void add_rms_norm(const float *y, const float *norm_weight, float eps, const float *residual, float *out,
                         long tokens, long cols) {
    rms_norm(y, norm_weight, eps, out, tokens, cols);
    for (long i = 0; i < tokens * cols; i++) out[i] += residual[i];
}

/* A whole decoder layer of a decode pass, out = the layer applied to x [tokens, hidden]:
 *   q, k, v = rms_norm(x) @ qkv.T + qkv_bias;  q, k = rope(per-head rms_norm(q, k)), the norms where given;
 *   append k, v to the layer's pages;  a = attention(q), in the layer's window, its scores soft-capped;
 *   h = x + attn_post_norm(a @ o.T + o_bias);  out = h + mlp_post_norm(act(g) * u @ down.T),
 *   [g | u] = rms_norm(h) @ gate_up.T, each post-norm an RMS norm where given (else none).
 * Without a post-norm the residual is added inside the projection. scratch holds layer_scratch floats. Every
 * sequence has one query row (the caller checked). Returns paged_attention's status, having stopped after
 * the attention if that is not 0. */
static int decoder_layer(const struct decoder_layer *layer, const struct decode_pass *pass, const float *cos,
                         const float *signed_sin, const float *x, float *out, float *scratch) {
    void *layer_pool = layer->layer_pool;
    int kv_type = (int)layer->kv_type;
    long tokens = pass->tokens, hidden = layer->hidden, q_width = layer->q_width, kv_width = layer->kv_width;
    float *normed = scratch, *qkv = normed + tokens * hidden, *q = qkv + tokens * (q_width + 2 * kv_width);
    float *k = q + tokens * q_width, *v = k + tokens * kv_width, *attn = v + tokens * kv_width;
    float *h = attn + tokens * q_width, *up = h + tokens * hidden, *gated = up + tokens * layer->inter;
    if (norm_qkv_rope(x, layer->attn_norm, layer->attn_eps, layer->qkv, (int)layer->qkv_type, layer->qkv_bias,
                      layer->q_norm, layer->k_norm, cos, signed_sin, q, k, v, tokens, q_width, kv_width, hidden,
                      layer->dim, normed, qkv))
        return -1;
    append_kv(layer_pool, kv_type, k, kv_width, 1, v, kv_width, 1, pass->slots, tokens, kv_width, layer->page_size);
    int status = paged_attention(q, layer_pool, kv_type, pass->qo_indptr, pass->page_indices, pass->page_indptr,
                                 pass->last_lens, attn, pass->batch, layer->heads, layer->kv_heads, layer->dim,
                                 layer->page_size, layer->scale, layer->window, layer->softcap);
    if (status) return status;
    const float *attn_post_norm = layer->attn_post_norm, *mlp_post_norm = layer->mlp_post_norm;
    /* before a post-norm a projection writes into normed, free after the attention input and after the gate */
    if (pie_linear(layer->o, (int)layer->o_type, attn, layer->o_bias, attn_post_norm ? NULL : x,
                   attn_post_norm ? normed : h, tokens, hidden, q_width))
        return -1;
    if (attn_post_norm) add_rms_norm(normed, attn_post_norm, layer->attn_eps, x, h, tokens, hidden);
    if (norm_gate_up(h, layer->mlp_norm, layer->mlp_eps, layer->gate_up, (int)layer->gate_up_type,
                     (int)layer->activation, gated, tokens, layer->inter, hidden, normed, up) ||
        pie_linear(layer->down, (int)layer->down_type, gated, NULL, mlp_post_norm ? NULL : h,
                   mlp_post_norm ? normed : out, tokens, hidden, layer->inter))
        return -1;
    if (mlp_post_norm) add_rms_norm(normed, mlp_post_norm, layer->mlp_eps, h, out, tokens, hidden);
    return 0;
}

/* out = layers[count - 1](... layers[0](x)) for a decode pass, x and out [tokens, hidden], each layer
 * reading the one before's output. One call for all of a model's layers: at batch 1 the Python of a
 * launch per layer, run with caches the weights had just swept, was a measurable share of a decode
 * step. The rotary tables are made once per table of inverse frequencies the layers point at
 * (alternating sliding-window and global layers may point at two). Returns -2, having written nothing,
 * when a sequence has more than one query row (a prefill: the caller runs the layers' kernels one by
 * one), -4, having written nothing, when the pass's page tables or slots do not fit the pool (page_tables_fit,
 * slots_fit), -1 when scratch memory cannot be had, else 0. */
int pie_decoder_layers(const struct decoder_layer *layers, long count, const struct decode_pass *pass,
                       const float *x, float *out) {
    long tokens = pass->tokens, hidden = layers[0].hidden, scratch_size = 0, table_floats = 0;
    if (!page_tables_fit(pass->qo_indptr, pass->page_indices, pass->page_indptr, pass->last_lens, pass->batch, tokens,
                         pass->num_indices, pass->num_pages, layers[0].page_size) ||
        !slots_fit(pass->slots, tokens, pass->num_pages, layers[0].page_size))
        return -4;
    if (!decode_rows(pass->qo_indptr, pass->batch)) return -2;
    long *table_of = malloc(sizeof(long) * count); /* where in the tables each layer's pair starts */
    if (!table_of) return -1;
    for (long i = 0; i < count; i++) {
        if (layer_scratch(&layers[i], tokens) > scratch_size) scratch_size = layer_scratch(&layers[i], tokens);
        table_of[i] = -1;
        for (long j = 0; j < i && table_of[i] < 0; j++)
            if (layers[j].inv_freq == layers[i].inv_freq && layers[j].dim == layers[i].dim) table_of[i] = table_of[j];
        if (table_of[i] < 0) {
            table_of[i] = table_floats;
            table_floats += 2 * tokens * layers[i].dim;
        }
    }
    long between = count > 1 ? tokens * hidden : 0; /* the outputs of layers before the last, two in turn */
    float *scratch = malloc(sizeof(float) * (scratch_size + 2 * between + table_floats));
    if (!scratch) {
        free(table_of);
        return -1;
    }
    float *outputs = scratch + scratch_size, *tables = outputs + 2 * between;
    for (long i = 0, made = 0; i < count; i++)
        if (table_of[i] == made) { /* the first layer of this table */
            float *cos = tables + table_of[i];
            rope_tables(pass->positions, layers[i].inv_freq, tokens, layers[i].dim, cos, cos + tokens * layers[i].dim);
            made += 2 * tokens * layers[i].dim;
        }
    const float *in = x;
    int status = 0;
    for (long i = 0; i < count && status == 0; i++) {
        float *result = i == count - 1 ? out : outputs + (i % 2) * between, *cos = tables + table_of[i];
        status = decoder_layer(&layers[i], pass, cos, cos + tokens * layers[i].dim, in, result, scratch);
        in = result;
    }
    free(scratch);
    free(table_of);
    return status;
}

struct stream_read {
    const float *x;
    long n;
    float *sums; /* one per chunk */
};

static void stream_read_task(const void *task, int chunk, int chunks) {
    const struct stream_read *s = task;
    long lo, hi;
    block_of(s->n / 64, &lo, &hi, chunk, chunks);
    vecf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (long i = lo * 64; i < hi * 64; i += 4 * VEC) {
        prefetch_floats(s->x + i + PREFETCH_AHEAD, 4 * VEC); /* as the projections do: faster than without */
        a0 += vload(s->x + i);
        a1 += vload(s->x + i + VEC);
        a2 += vload(s->x + i + 2 * VEC);
        a3 += vload(s->x + i + 3 * VEC);
    }
    s->sums[chunk] = vsum((a0 + a1) + (a2 + a3));
}

/* The sum of x[0 .. n - n % 64], read by every thread one block each: a pass of the memory at the
 * speed the projections' weight streams could at best reach (the decode roofline). */
float pie_stream_read(const float *x, long n) {
    float sums[MAX_THREADS * CHUNKS_PER_THREAD] = {0};
    struct stream_read task = {x, n, sums};
    run_parallel(stream_read_task, &task, 1);
    float total = 0.0f;
    for (int i = 0; i < MAX_THREADS * CHUNKS_PER_THREAD; i++) total += sums[i];
    return total;
}
