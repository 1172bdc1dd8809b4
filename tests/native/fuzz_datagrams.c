/* Fuzz target: any bytes as one read of datagrams, into an aggregator with a keyed
 * communicator. The fuzzer does not know the key, so no datagram it makes is authentic: each
 * must be dropped and counted exactly once, and none may reach the engine. A datagram that does
 * is a forgery accepted, and aborts. The first byte picks the read's segment size. The input is
 * also tagged by ghash.h and by OpenSSL's EVP, cut in three where its bytes say: the tags must
 * agree. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "aggregator/aggregator.h"
#include "evp_gmac.h"
#include "common/ghash.h"

static const uint8_t KEY[16] = {9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1, 2, 3, 4, 5, 6};

/* ghash.h's tag of the input under KEY against OpenSSL's. */
static void tags_agree(const uint8_t *data, size_t size) {
    static oc_fast_gmac fast;
    static int keyed;
    if (!oc_fast_gmac_usable()) return;
    if (!keyed) oc_fast_gmac_init(&fast, KEY), keyed = 1;
    uint8_t iv[12] = {0}, want[16], got[16];
    memcpy(iv, data, size < 12 ? size : 12);
    size_t a = size ? data[size - 1] * size / 256 : 0, b = size > 1 ? data[size - 2] * size / 256 : 0;
    if (a > b) { size_t t = a; a = b; b = t; }
    const uint8_t *pieces[3] = {data, data + a, data + b};
    size_t lens[3] = {a, b - a, size - b};
    oc_fast_gmac_tag(&fast, iv, pieces, lens, 3, got);
    evp_gmac(KEY, iv, data, size, want);
    if (memcmp(want, got, 16)) {
        fprintf(stderr, "the tags disagree on %zu bytes cut at %zu and %zu\n", size, a, b);
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static oc_agg *a;
    tags_agree(data, size);
    static const uint32_t JOB = 0x4f43, COMM = 0x1234;
    if (a == NULL) {
        uint32_t granted;
        a = oc_agg_new(16);
        oc_agg_register(a, JOB, COMM, 4, 0, 0, OC_MAX_DATAGRAM, KEY, 0, &granted);
    }
    if (size < 1) return 0;
    static const size_t segments[] = {52, 53, 60, 64, 100, 512, 1500, 9000, 65507};
    size_t segment = segments[data[0] % (sizeof segments / sizeof segments[0])];
    data++;
    size--;
    /* Half the datagrams are given a well-formed header for the registered communicator (the
     * kind and sender the input's, the length the datagram's), so the tag is what stops them;
     * the others are left as the input has them. */
    static const uint8_t kinds[] = {OC_CONTRIB, OC_RESULT_ACK, OC_CREDIT, OC_RESULT};
    uint8_t *copy = malloc(size ? size : 1);
    if (size) memcpy(copy, data, size);
    for (size_t at = 0; at + OC_OVERHEAD_BYTES <= size; at += segment) {
        if (!(copy[at] & 1)) continue;
        size_t n = size - at < segment ? size - at : segment;
        uint32_t length = (uint32_t)(n - OC_OVERHEAD_BYTES);
        uint16_t src = copy[at + 16] % 5, dst = OC_AGGREGATOR;
        copy[at + 3] = kinds[copy[at + 3] % sizeof kinds];
        memcpy(copy + at, "OC\x01", 3);
        memcpy(copy + at + 4, &JOB, 4);
        memcpy(copy + at + 8, &COMM, 4);
        memcpy(copy + at + 16, &src, 2);
        memcpy(copy + at + 18, &dst, 2);
        memcpy(copy + at + 24, &length, 4);
    }
    uint64_t before = 0, after = 0, stats_before = 0, stats_after = 0;
    for (int i = 0; i < OC_DROP_COUNT; i++) before += oc_agg_drops(a)[i];
    for (int i = 0; i < OC_STAT_COUNT; i++) stats_before += oc_agg_stats(a)[i];
    oc_agg_feed(a, copy, size, segment, 0.0);
    for (int i = 0; i < OC_DROP_COUNT; i++) after += oc_agg_drops(a)[i];
    for (int i = 0; i < OC_STAT_COUNT; i++) stats_after += oc_agg_stats(a)[i];
    size_t datagrams = size ? (size + segment - 1) / segment : 1;
    if (after - before != datagrams || stats_after != stats_before || oc_agg_outbox_count(a)) {
        fprintf(stderr, "forgery accepted: %zu datagrams, %llu dropped\n", datagrams,
                (unsigned long long)(after - before));
        abort();
    }
    free(copy);
    return 0;
}
