#include "ghash.h"

#include <pthread.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define TARGET __attribute__((target("aes,pclmul,ssse3,sse4.1,avx2,vpclmulqdq")))

static int usable;
static void check_cpu(void) {
    __builtin_cpu_init();
    usable = __builtin_cpu_supports("aes") && __builtin_cpu_supports("pclmul") &&
             __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq");
}

int oc_fast_gmac_usable(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT; /* planes of several threads may ask first */
    pthread_once(&once, check_cpu);
    return usable;
}

/* GHASH reads a block's bytes as one big-endian number with its bits reflected: reversing the
 * bytes lets the multiplies (Gueron and Kounavis, Intel's carry-less multiplication white paper)
 * work on it as on any 128-bit value. */
TARGET static __m128i reversed(__m128i x) {
    return _mm_shuffle_epi8(x, _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

/* The product hi:lo (with mid, the cross terms, straddling them) shifted left a bit, for the
 * reflection, and reduced modulo x^128 + x^7 + x^2 + x + 1. Both steps are linear, so the
 * products of several blocks may be added (xor) before one reduction. */
TARGET static __m128i reduce(__m128i lo, __m128i mid, __m128i hi) {
    lo = _mm_xor_si128(lo, _mm_slli_si128(mid, 8));
    hi = _mm_xor_si128(hi, _mm_srli_si128(mid, 8));
    __m128i lo_carry = _mm_srli_epi32(lo, 31), hi_carry = _mm_srli_epi32(hi, 31);
    lo = _mm_slli_epi32(lo, 1);
    hi = _mm_slli_epi32(hi, 1);
    __m128i across = _mm_srli_si128(lo_carry, 12);
    lo = _mm_or_si128(lo, _mm_slli_si128(lo_carry, 4));
    hi = _mm_or_si128(_mm_or_si128(hi, _mm_slli_si128(hi_carry, 4)), across);
    __m128i a = _mm_xor_si128(_mm_xor_si128(_mm_slli_epi32(lo, 31), _mm_slli_epi32(lo, 30)),
                              _mm_slli_epi32(lo, 25));
    __m128i rest = _mm_srli_si128(a, 4);
    lo = _mm_xor_si128(lo, _mm_slli_si128(a, 12));
    __m128i b = _mm_xor_si128(_mm_xor_si128(_mm_srli_epi32(lo, 1), _mm_srli_epi32(lo, 2)),
                              _mm_xor_si128(_mm_srli_epi32(lo, 7), rest));
    return _mm_xor_si128(hi, _mm_xor_si128(lo, b));
}

TARGET static __m128i multiply(__m128i a, __m128i b) {
    __m128i mid = _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x10), _mm_clmulepi64_si128(a, b, 0x01));
    return reduce(_mm_clmulepi64_si128(a, b, 0x00), mid, _mm_clmulepi64_si128(a, b, 0x11));
}

TARGET static __m128i expand(__m128i key, __m128i assist) {
    assist = _mm_shuffle_epi32(assist, 0xff);
    key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
    key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
    key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
    return _mm_xor_si128(key, assist);
}

TARGET static __m128i encrypt(const oc_fast_gmac *k, __m128i x) {
    x = _mm_xor_si128(x, _mm_loadu_si128((const __m128i *)k->round_keys[0]));
    for (int i = 1; i < 10; i++) x = _mm_aesenc_si128(x, _mm_loadu_si128((const __m128i *)k->round_keys[i]));
    return _mm_aesenclast_si128(x, _mm_loadu_si128((const __m128i *)k->round_keys[10]));
}

TARGET void oc_fast_gmac_init(oc_fast_gmac *k, const uint8_t key[16]) {
    __m128i rk[11];
    rk[0] = _mm_loadu_si128((const __m128i *)key);
    /* the round constants must be immediates */
    rk[1] = expand(rk[0], _mm_aeskeygenassist_si128(rk[0], 0x01));
    rk[2] = expand(rk[1], _mm_aeskeygenassist_si128(rk[1], 0x02));
    rk[3] = expand(rk[2], _mm_aeskeygenassist_si128(rk[2], 0x04));
    rk[4] = expand(rk[3], _mm_aeskeygenassist_si128(rk[3], 0x08));
    rk[5] = expand(rk[4], _mm_aeskeygenassist_si128(rk[4], 0x10));
    rk[6] = expand(rk[5], _mm_aeskeygenassist_si128(rk[5], 0x20));
    rk[7] = expand(rk[6], _mm_aeskeygenassist_si128(rk[6], 0x40));
    rk[8] = expand(rk[7], _mm_aeskeygenassist_si128(rk[7], 0x80));
    rk[9] = expand(rk[8], _mm_aeskeygenassist_si128(rk[8], 0x1b));
    rk[10] = expand(rk[9], _mm_aeskeygenassist_si128(rk[9], 0x36));
    for (int i = 0; i < 11; i++) _mm_storeu_si128((__m128i *)k->round_keys[i], rk[i]);
    __m128i h = reversed(encrypt(k, _mm_setzero_si128())), power = h;
    for (int i = OC_GHASH_STRIDE - 1; i >= 0; i--) {
        _mm_storeu_si128((__m128i *)k->powers[i], power);
        __m128i swapped = _mm_shuffle_epi32(power, 0x4e);
        _mm_storeu_si128((__m128i *)k->halves[i], _mm_xor_si128(power, swapped));
        power = multiply(power, h);
    }
}

/* y folded with OC_GHASH_STRIDE blocks at p: (y + X1) H^16 + X2 H^15 + ... + X16 H, reduced
 * once (the reduction is the chain from one stride to the next). Lane 0 of each 256-bit load
 * is the earlier block, so powers[2j] and powers[2j + 1] pair with load j. Karatsuba: three
 * multiplies per pair of blocks, the cross terms from the halves' sums. */
TARGET static __m128i stride_of_blocks(const oc_fast_gmac *k, __m128i y, const uint8_t *p) {
    const __m256i order = _mm256_broadcastsi128_si256(
        _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __m256i lo = _mm256_setzero_si256(), cross = lo, hi = lo;
    for (int j = 0; j < OC_GHASH_STRIDE / 2; j++) {
        __m256i d = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(p + 32 * j)), order);
        if (j == 0) d = _mm256_xor_si256(d, _mm256_zextsi128_si256(y));
        __m256i h = _mm256_loadu_si256((const __m256i *)k->powers[2 * j]);
        lo = _mm256_xor_si256(lo, _mm256_clmulepi64_epi128(d, h, 0x00));
        hi = _mm256_xor_si256(hi, _mm256_clmulepi64_epi128(d, h, 0x11));
        __m256i dh = _mm256_xor_si256(d, _mm256_shuffle_epi32(d, 0x4e));
        __m256i hh = _mm256_loadu_si256((const __m256i *)k->halves[2 * j]);
        cross = _mm256_xor_si256(cross, _mm256_clmulepi64_epi128(dh, hh, 0x00));
    }
    __m256i mid = _mm256_xor_si256(cross, _mm256_xor_si256(lo, hi));
#define LANES(v) _mm_xor_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1))
    return reduce(LANES(lo), LANES(mid), LANES(hi));
#undef LANES
}

TARGET static __m128i blocks(const oc_fast_gmac *k, __m128i y, const uint8_t *p, size_t n) {
    for (; n >= OC_GHASH_STRIDE; n -= OC_GHASH_STRIDE, p += 16 * OC_GHASH_STRIDE)
        y = stride_of_blocks(k, y, p);
    __m128i h = _mm_loadu_si128((const __m128i *)k->powers[OC_GHASH_STRIDE - 1]);
    for (; n; n--, p += 16) y = multiply(_mm_xor_si128(y, reversed(_mm_loadu_si128((const __m128i *)p))), h);
    return y;
}

TARGET void oc_fast_gmac_tag(const oc_fast_gmac *k, const uint8_t iv[12], const uint8_t *const *data,
                             const size_t *len, int n, uint8_t tag[16]) {
    __m128i y = _mm_setzero_si128();
    uint8_t partial[16];
    size_t held = 0, total = 0; /* bytes in `partial`, a block begun in one piece */
    for (int i = 0; i < n; i++) {
        const uint8_t *p = data[i];
        size_t left = len[i];
        if (left == 0) continue; /* an empty piece may have no pointer */
        total += left;
        if (held) {
            size_t take = left < 16 - held ? left : 16 - held;
            memcpy(partial + held, p, take);
            held += take, p += take, left -= take;
            if (held < 16) continue;
            y = blocks(k, y, partial, 1);
            held = 0;
        }
        y = blocks(k, y, p, left / 16);
        held = left % 16;
        if (held) memcpy(partial, p + left - held, held);
    }
    if (held) {
        memset(partial + held, 0, 16 - held);
        y = blocks(k, y, partial, 1);
    }
    /* the lengths' block: the associated data's in bits, big-endian, then the ciphertext's (0) */
    uint8_t lengths[16] = {0};
    uint64_t bits = (uint64_t)total * 8;
    for (int i = 0; i < 8; i++) lengths[i] = (uint8_t)(bits >> (56 - 8 * i));
    y = blocks(k, y, lengths, 1);
    uint8_t counter0[16] = {0};
    memcpy(counter0, iv, 12);
    counter0[15] = 1;
    __m128i mask = encrypt(k, _mm_loadu_si128((const __m128i *)counter0));
    _mm_storeu_si128((__m128i *)tag, _mm_xor_si128(reversed(y), mask));
}

#else

int oc_fast_gmac_usable(void) { return 0; }
void oc_fast_gmac_init(oc_fast_gmac *k, const uint8_t key[16]) { (void)k, (void)key; }
void oc_fast_gmac_tag(const oc_fast_gmac *k, const uint8_t iv[12], const uint8_t *const *data,
                      const size_t *len, int n, uint8_t tag[16]) {
    (void)k, (void)iv, (void)data, (void)len, (void)n;
    memset(tag, 0, 16);
}

#endif
