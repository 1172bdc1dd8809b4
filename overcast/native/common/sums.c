#include "sums.h"

#include <string.h>

size_t oc_dtype_size(unsigned code) {
    static const size_t sizes[OC_DTYPES] = {2, 2, 4, 8, 4, 8, 1, 1};
    return code < OC_DTYPES ? sizes[code] : 0;
}

static uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float oc_bfloat_to_float(uint16_t b) { return float_of((uint32_t)b << 16); }

uint16_t oc_float_to_bfloat(float f) {
    uint32_t u = bits_of(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(u >> 16 | 0x40); /* NaN stays NaN */
    u += 0x7fffu + (u >> 16 & 1);
    return (uint16_t)(u >> 16);
}

float oc_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = h >> 10 & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return float_of(sign | 0x7f800000u | man << 13);
    if (exp) return float_of(sign | (exp + 112) << 23 | man << 13);
    if (!man) return float_of(sign);
    /* subnormal: man * 2^-24, exact in float32 */
    float v = (float)man * 0x1p-24f;
    return sign ? -v : v;
}

uint16_t oc_float_to_half(float f) {
    uint32_t u = bits_of(f), sign = u >> 16 & 0x8000, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | (a >> 13 & 0x3ff)); /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds to infinity */
    if (a >= 0x38800000u) { /* normal: rebias and round to nearest even */
        uint32_t r = a - 0x38000000u;
        r += 0xfffu + (r >> 13 & 1);
        return (uint16_t)(sign | r >> 13);
    }
    if (a < 0x33000000u) return (uint16_t)sign; /* below half the smallest subnormal */
    /* subnormal: the value in units of 2^-24, rounded to nearest even */
    uint32_t e = a >> 23, man = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;
    uint32_t q = man >> shift, rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (q & 1))) q++;
    return (uint16_t)(sign | q);
}

/* Each plain loop below vectorizes; built for AVX2 and the baseline, picked at load (not under
 * ThreadSanitizer, whose runtime is not up yet when the loader runs the pickers). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(OC_NO_CLONES) && \
    !defined(__SANITIZE_THREAD__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* Row r's bytes: in the pool, or where row `late` was read (a datagram's payload). */
static const uint8_t *row_at(const uint8_t *rows, size_t stride, unsigned r, unsigned late,
                             const uint8_t *late_row) {
    return r == late ? late_row : rows + r * stride;
}

/* Rows are read in place through memcpy (a late row lies in a datagram, at any alignment: the
 * compiler makes unaligned vector loads of it). A block of sums stays in L1 while every row's
 * block is added to it. */
#define SUM_SAME_TYPE(name, type, utype)                                                        \
    CLONES static void name(uint8_t *out, const uint8_t *rows, size_t stride, unsigned nrows,   \
                            unsigned skip, size_t elems, unsigned late,                         \
                            const uint8_t *late_row) {                                          \
        utype acc[256];                                                                         \
        for (size_t at = 0; at < elems; at += 256) {                                            \
            size_t n = elems - at < 256 ? elems - at : 256;                                     \
            int first = 1;                                                                      \
            for (unsigned r = 0; r < nrows; r++) {                                              \
                if (r == skip) continue;                                                        \
                const uint8_t *v = row_at(rows, stride, r, late, late_row) + at * sizeof(type); \
                for (size_t i = 0; i < n; i++) {                                                \
                    utype x;                                                                    \
                    memcpy(&x, v + i * sizeof x, sizeof x);                                     \
                    acc[i] = first ? x : (utype)(acc[i] + x);                                   \
                }                                                                               \
                first = 0;                                                                      \
            }                                                                                   \
            if (first) memset(acc, 0, sizeof acc);                                              \
            memcpy(out + at * sizeof(type), acc, n * sizeof(type));                             \
        }                                                                                       \
    }

/* Integers are added as unsigned: wrapping is defined there, and the bits are those of the
 * two's complement sum numpy gives. */
SUM_SAME_TYPE(sum_f32, float, float)
SUM_SAME_TYPE(sum_f64, double, double)
SUM_SAME_TYPE(sum_i32, int32_t, uint32_t)
SUM_SAME_TYPE(sum_i64, int64_t, uint64_t)
SUM_SAME_TYPE(sum_i8, int8_t, uint8_t)

CLONES static void sum_16(uint8_t *out, const uint8_t *rows, size_t stride, unsigned nrows,
                          unsigned skip, size_t elems, unsigned late, const uint8_t *late_row,
                          int brain) {
    float acc[256];
    for (size_t at = 0; at < elems; at += 256) {
        size_t n = elems - at < 256 ? elems - at : 256;
        int first = 1;
        for (unsigned r = 0; r < nrows; r++) {
            if (r == skip) continue;
            const uint8_t *v = row_at(rows, stride, r, late, late_row) + at * 2;
            for (size_t i = 0; i < n; i++) {
                uint16_t h;
                memcpy(&h, v + 2 * i, 2);
                float x = brain ? oc_bfloat_to_float(h) : oc_half_to_float(h);
                acc[i] = first ? x : acc[i] + x;
            }
            first = 0;
        }
        if (first) memset(acc, 0, sizeof acc);
        uint16_t o[256];
        for (size_t i = 0; i < n; i++)
            o[i] = brain ? oc_float_to_bfloat(acc[i]) : oc_float_to_half(acc[i]);
        memcpy(out + at * 2, o, n * 2);
    }
}

void oc_sum_rows(unsigned code, uint8_t *out, const uint8_t *rows, size_t stride,
                 unsigned nrows, unsigned skip, size_t elems, unsigned late,
                 const uint8_t *late_row) {
    switch (code) {
    case OC_FLOAT32: sum_f32(out, rows, stride, nrows, skip, elems, late, late_row); break;
    case OC_FLOAT64: sum_f64(out, rows, stride, nrows, skip, elems, late, late_row); break;
    case OC_INT32: sum_i32(out, rows, stride, nrows, skip, elems, late, late_row); break;
    case OC_INT64: sum_i64(out, rows, stride, nrows, skip, elems, late, late_row); break;
    case OC_INT8: case OC_UINT8: sum_i8(out, rows, stride, nrows, skip, elems, late, late_row); break;
    case OC_BFLOAT16: sum_16(out, rows, stride, nrows, skip, elems, late, late_row, 1); break;
    case OC_FLOAT16: sum_16(out, rows, stride, nrows, skip, elems, late, late_row, 0); break;
    default: break;
    }
}

/* Element by element through memcpy: the compiler turns these into unaligned vector loads. */
#define ADD_SAME_TYPE(name, utype)                                                              \
    CLONES static void name(uint8_t *out, const uint8_t *a, const uint8_t *b, size_t elems) {   \
        for (size_t i = 0; i < elems; i++) {                                                    \
            utype x, y;                                                                         \
            memcpy(&x, a + i * sizeof x, sizeof x);                                             \
            memcpy(&y, b + i * sizeof y, sizeof y);                                             \
            x = (utype)(x + y);                                                                 \
            memcpy(out + i * sizeof x, &x, sizeof x);                                           \
        }                                                                                       \
    }

ADD_SAME_TYPE(add_f32, float)
ADD_SAME_TYPE(add_f64, double)
ADD_SAME_TYPE(add_u32, uint32_t)
ADD_SAME_TYPE(add_u64, uint64_t)
ADD_SAME_TYPE(add_u8, uint8_t)

CLONES static void add_16(uint8_t *out, const uint8_t *a, const uint8_t *b, size_t elems,
                          int brain) {
    for (size_t i = 0; i < elems; i++) {
        uint16_t x, y;
        memcpy(&x, a + 2 * i, 2);
        memcpy(&y, b + 2 * i, 2);
        float s = brain ? oc_bfloat_to_float(x) + oc_bfloat_to_float(y)
                        : oc_half_to_float(x) + oc_half_to_float(y);
        x = brain ? oc_float_to_bfloat(s) : oc_float_to_half(s);
        memcpy(out + 2 * i, &x, 2);
    }
}

void oc_add_pair(unsigned code, uint8_t *out, const uint8_t *a, const uint8_t *b, size_t elems) {
    switch (code) {
    case OC_FLOAT32: add_f32(out, a, b, elems); break;
    case OC_FLOAT64: add_f64(out, a, b, elems); break;
    case OC_INT32: add_u32(out, a, b, elems); break;
    case OC_INT64: add_u64(out, a, b, elems); break;
    case OC_INT8: case OC_UINT8: add_u8(out, a, b, elems); break;
    case OC_BFLOAT16: add_16(out, a, b, elems, 1); break;
    case OC_FLOAT16: add_16(out, a, b, elems, 0); break;
    default: break;
    }
}

/* x / divisor truncated toward zero, as C divides (NCCL's average of integers). */
#define DIVIDE_INTS(type)                                                                       \
    for (size_t i = 0; i < elems; i++) {                                                        \
        type x;                                                                                 \
        memcpy(&x, out + sizeof(type) * i, sizeof(type));                                       \
        x = (type)((int64_t)x / (int64_t)divisor);                                              \
        memcpy(out + sizeof(type) * i, &x, sizeof(type));                                       \
    }

void oc_divide(unsigned code, uint8_t *out, size_t elems, unsigned divisor) {
    switch (code) {
    case OC_INT32: DIVIDE_INTS(int32_t) return;
    case OC_INT64: DIVIDE_INTS(int64_t) return;
    case OC_INT8: DIVIDE_INTS(int8_t) return;
    case OC_UINT8: DIVIDE_INTS(uint8_t) return;
    default: break;
    }
    for (size_t i = 0; i < elems; i++) {
        if (code == OC_FLOAT32) {
            float x;
            memcpy(&x, out + 4 * i, 4);
            x /= (float)divisor;
            memcpy(out + 4 * i, &x, 4);
        } else if (code == OC_FLOAT64) {
            double x;
            memcpy(&x, out + 8 * i, 8);
            x /= (double)divisor;
            memcpy(out + 8 * i, &x, 8);
        } else if (code == OC_FLOAT16 || code == OC_BFLOAT16) {
            uint16_t h;
            memcpy(&h, out + 2 * i, 2);
            float x = code == OC_BFLOAT16 ? oc_bfloat_to_float(h) : oc_half_to_float(h);
            x /= (float)divisor;
            h = code == OC_BFLOAT16 ? oc_float_to_bfloat(x) : oc_float_to_half(x);
            memcpy(out + 2 * i, &h, 2);
        } else {
            return;
        }
    }
}
