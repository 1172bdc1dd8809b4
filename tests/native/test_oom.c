/* Out of memory at each allocation in turn: the aggregator's whole life (register, contributions
 * of every rank, results sealed, acknowledgements, the timer, unregister, free) runs once for
 * every allocation it makes, that allocation failing. It must neither crash nor leak (built with
 * AddressSanitizer and LeakSanitizer), count what it dropped, and finish the run with nothing
 * failed. Then a rank's gather whose request list cannot grow. Linked with
 * -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc (tests/test_native.py). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "aggregator/aggregator.h"
#include "rank/gather.h"
#include "common/sums.h"

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);

static long allocations, fail_at; /* fail the fail_at-th allocation (1-based); 0: none */

static int fails(void) { return ++allocations == fail_at; }
void *__wrap_malloc(size_t n) { return fails() ? NULL : __real_malloc(n); }
void *__wrap_calloc(size_t n, size_t size) { return fails() ? NULL : __real_calloc(n, size); }
void *__wrap_realloc(void *p, size_t n) { return fails() ? NULL : __real_realloc(p, n); }

enum { WORLD = 4, CHUNKS = 8, ELEMS = 16 };
static const uint8_t KEY[16] = {9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1, 2, 3, 4, 5, 6};

static size_t contribution(oc_sealer *s, uint8_t *buf, uint32_t g) {
    uint8_t payload[12 + 4 * ELEMS] = {OC_INT32, 1, WORLD, 0, WORLD * CHUNKS, 0, 0, 0, 0, 0, 1, 0};
    for (int i = 0; i < ELEMS; i++) payload[12 + 4 * i] = (uint8_t)(g + s->src);
    return oc_seal_into(s, buf, 512, OC_CONTRIB, 0, OC_AGGREGATOR, g, payload, sizeof payload);
}

static void drop_all(void *ctx, int handle, uint16_t dst, const uint8_t *data, size_t len,
                     size_t segment) {
    (void)handle, (void)dst, (void)data, (void)segment;
    *(size_t *)ctx += len;
}

/* The aggregator's life: how many results it summed, or -1 if it or the communicator could not
 * be made; *lost, what it counted as lost to memory. */
static long life(oc_sealer ranks[WORLD], uint64_t *lost) {
    *lost = 0;
    oc_agg *a = oc_agg_new(64); /* a window past every chunk */
    if (a == NULL) return -1;
    uint32_t granted;
    int h = oc_agg_register(a, 1, 2, WORLD, 0, 0, 64, KEY, 7, &granted);
    size_t sealed = 0;
    if (h >= 0) {
        for (int r = 0; r < WORLD; r++) oc_agg_set_address(a, h, (uint32_t)r, 0x0100007f, 9, 0);
        for (int r = 0; r < WORLD; r++) {
            uint8_t batch[WORLD * CHUNKS * 512];
            size_t len = 0, segment = 0;
            for (uint32_t g = 0; g < WORLD * CHUNKS; g++)
                if (g % WORLD != (uint32_t)r) len += segment = contribution(&ranks[r], batch + len, g);
            oc_agg_feed(a, batch, len, segment, 1.0);
        }
        oc_agg_handle_timer(a, 1.5);
        oc_agg_flush(a, drop_all, &sealed);
        oc_agg_handle_timer(a, 400.0); /* past the expiry: whatever is left is given up */
        oc_agg_flush(a, drop_all, &sealed);
        oc_agg_unregister(a, h);
    }
    long results = h >= 0 ? (long)oc_agg_stats(a)[OC_STAT_results] : -1;
    *lost = oc_agg_drops(a)[OC_DROP_out_of_memory];
    oc_agg_free(a);
    return results;
}

/* A gather whose request list cannot grow: the chunks it could not list stay missing, so the
 * next request (a later gap, the tail timer) asks for them. 0, or 1 if that failed. */
static int gather_request_out_of_memory(void) {
    enum { K = 8, SEGMENT = K * 16 };
    static uint8_t buffer[2 * SEGMENT];
    const uint32_t roots[2] = {0, 1};
    const uint64_t offsets[2] = {0, SEGMENT};
    oc_budget budget;
    oc_budget_init(&budget, 0, 0.005, 1, 100, 1);
    fail_at = 0;
    oc_gather g;
    if (oc_gather_init(&g, 1, 2, buffer, 2, roots, offsets, SEGMENT, 16, 0, 1, &budget)) {
        printf("FAIL: a gather could not be made\n");
        return 1;
    }
    allocations = 0;
    fail_at = 1; /* the request list's first growth */
    int said = oc_gather_request(&g, 1, 2, 5);
    fail_at = 0;
    int bad = g.nrequests != 0 || said != -1; /* the tail timer asks again when told so */
    for (uint32_t c = 0; c < K; c++) bad |= g.state[K + c] != OC_CHUNK_MISSING;
    said = oc_gather_request(&g, 1, 0, K); /* what the tail timer asks */
    bad |= said != 0 || g.nrequests != 1 || g.requests[0].first != K || g.requests[0].count != K;
    if (bad)
        printf("FAIL: a request without memory left %zu ranges, chunks 2-4 %d %d %d\n",
               g.nrequests, g.state[K + 2], g.state[K + 3], g.state[K + 4]);
    oc_gather_free(&g);
    return bad;
}

int main(void) {
    oc_sealer ranks[WORLD];
    for (int r = 0; r < WORLD; r++) {
        ranks[r] = (oc_sealer){.job = 1, .comm = 2, .src = (uint16_t)r};
        if (oc_gmac_init(&ranks[r].gmac, KEY, 1)) return 2;
    }
    uint64_t lost;
    long whole = life(ranks, &lost), total = allocations, failed = 0;
    if (whole != WORLD * CHUNKS) {
        printf("FAIL: without failures, %ld results of %d\n", whole, WORLD * CHUNKS);
        failed++;
    }
    for (fail_at = 1; fail_at <= total; fail_at++) {
        allocations = 0;
        long results = life(ranks, &lost); /* must not crash or leak */
        /* made, it took every contribution, or counted what it lost */
        if (results > WORLD * CHUNKS || (results >= 0 && results < WORLD * CHUNKS && !lost)) {
            printf("FAIL: allocation %ld failing: %ld results, %llu lost to memory\n", fail_at,
                   results, (unsigned long long)lost);
            failed++;
        }
    }
    for (int r = 0; r < WORLD; r++) oc_gmac_free(&ranks[r].gmac);
    failed += gather_request_out_of_memory();
    printf("%ld allocations failed in turn, %ld failed\n", total, failed);
    return failed != 0;
}
