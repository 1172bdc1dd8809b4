/* Fuzz target: what a keyed rank gone wrong could send the aggregator. The input is a script of
 * messages (any kind, sequence, sender, destination, chunk and payload, with consistent or
 * arbitrary contribution prefixes) and clock steps; the harness seals each under the
 * communicator's key, so every one is authentic and reaches the engine's parsing and state. It
 * checks after every step that nothing crashed or leaked (the sanitizers), that the pool stays
 * within its bound, and that whatever the engine sends seals and opens. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "script.h"
#include "aggregator/aggregator.h"

enum { WORLD = 4, SLOTS = 8 };
static const uint8_t KEY[16] = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3};
static const uint8_t KINDS[] = {OC_CONTRIB, OC_CONTRIB, OC_CONTRIB, OC_RESULT_ACK, OC_CREDIT,
                                OC_RESULT, OC_MCAST_DATA, OC_HELLO};

static oc_gmac opener;

static void check_sealed(void *ctx, int handle, uint16_t dst, const uint8_t *data, size_t len,
                         size_t segment) {
    (void)ctx;
    (void)handle;
    (void)dst;
    for (size_t at = 0; at < len; at += segment) {
        size_t n = len - at < segment ? len - at : segment;
        oc_header h;
        if (n < OC_OVERHEAD_BYTES || oc_header_parse(data + at, n, &h) ||
            h.length + OC_OVERHEAD_BYTES != n ||
            !oc_gmac_check(&opener, h.src, h.counter, data + at, n - OC_TAG_BYTES,
                           data + at + n - OC_TAG_BYTES)) {
            fprintf(stderr, "the aggregator sent a datagram that does not open\n");
            abort();
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!oc_gmac_keyed(&opener)) oc_gmac_init(&opener, KEY, 0);
    oc_agg *a = oc_agg_new(SLOTS);
    uint32_t granted;
    int h = oc_agg_register(a, 1, 1, WORLD, 0, 0, OC_MAX_DATAGRAM, KEY, 0, &granted);
    oc_agg_set_address(a, h, 0, 0x0100007f, 1, 0);
    oc_sealer ranks[WORLD + 1]; /* the last: a sender outside the world */
    for (int r = 0; r <= WORLD; r++) {
        ranks[r] = (oc_sealer){.job = 1, .comm = 1, .src = (uint16_t)r};
        oc_gmac_init(&ranks[r].gmac, KEY, 1);
    }
    script s = {data, size};
    double now = 0;
    static uint8_t batch[65536], payload[9000];
    while (s.left) {
        unsigned op = take(&s, 1);
        if (op % 8 == 7) { /* the clock moves on */
            now += take(&s, 1) * 0.002;
            if (oc_agg_timer(a) >= 0 && now >= oc_agg_timer(a)) oc_agg_handle_timer(a, now);
        } else { /* a batch of 1-8 messages from one sender, one read */
            unsigned count = 1 + (op >> 3) % 8, r = take(&s, 1) % (WORLD + 1);
            uint8_t kind = KINDS[take(&s, 1) % sizeof KINDS];
            uint32_t seq = take(&s, 1) % 3, chunk = take(&s, 1) % 48;
            uint16_t dst = take(&s, 1) % 16 ? OC_AGGREGATOR : (uint16_t)(take(&s, 1) % 5);
            size_t len = take(&s, 1), at = 0, segment = 0;
            if (kind == OC_CONTRIB && len % 4) { /* a prefix that fits the world, or not */
                unsigned total = WORLD * (1 + take(&s, 1) % 12);
                uint8_t prefix[12] = {(uint8_t)(take(&s, 1) % 9), (uint8_t)(1 + take(&s, 1) % 3),
                                      WORLD, 0, (uint8_t)total, 0, 0, 0, 0, 0,
                                      (uint8_t)(1 + take(&s, 1) % 3), 0};
                if (take(&s, 1) % 8 == 0) prefix[2] = (uint8_t)take(&s, 1);
                if (take(&s, 1) % 8 == 0) prefix[8] = (uint8_t)take(&s, 1);
                len = 12 + (len % 16) * 4;
                memcpy(payload, prefix, 12);
                for (size_t i = 12; i < len; i++) payload[i] = (uint8_t)take(&s, 1);
            } else {
                for (size_t i = 0; i < len; i++) payload[i] = (uint8_t)take(&s, 1);
            }
            for (unsigned i = 0; i < count; i++) {
                if (take(&s, 1) % 16 == 0 && ranks[r].counter) ranks[r].counter--; /* a replay */
                size_t n = oc_seal_into(&ranks[r], batch + at, sizeof batch - at, kind, seq, dst,
                                        chunk + i, payload, len);
                if (n == 0) break;
                segment = n;
                at += n;
            }
            if (at) oc_agg_feed(a, batch, at, segment, now);
            if (oc_agg_outbox_bytes(a) > OC_OUTBOX_BYTES) { /* flushed after every step */
                fprintf(stderr, "outbox %zu bytes\n", oc_agg_outbox_bytes(a));
                abort();
            }
        }
        /* a pool never holds more than its reductions' windows of the widest rows */
        if (oc_agg_pool_bytes(a) > (uint64_t)OC_MAX_REDUCTIONS * SLOTS * WORLD * 8 * 64) {
            fprintf(stderr, "pool %llu bytes\n", (unsigned long long)oc_agg_pool_bytes(a));
            abort();
        }
        oc_agg_flush(a, check_sealed, NULL);
    }
    for (int r = 0; r <= WORLD; r++) oc_gmac_free(&ranks[r].gmac);
    oc_agg_free(a);
    return 0;
}
