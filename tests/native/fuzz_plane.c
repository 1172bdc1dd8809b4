/* Fuzz target: what a hostile network could bring a rank's datagram plane. The input is a script
 * of reads (1-8 datagrams from one sender: the aggregator, a rank, or one outside the world; any
 * kind, sequence, destination, chunk and payload, sealed under the communicator's key, some
 * replayed, some with a flipped bit, some raw bytes), repairs and requests as Python's side of
 * the multicast would make them from what came over the streams, and clock steps, into a plane
 * with two reductions posted (int32 and bfloat16, one averaged) and a multicast gather. It checks
 * after every step that nothing crashed or leaked (the sanitizers), that each collective's state
 * stays within its shape, and that whatever the plane sends seals and opens. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "script.h"
#include "rank/plane.h"
#include "common/sums.h"

enum { WORLD = 4, RANK = 1, COUNT = 150, CHUNK = 64, GATHER_BYTES = 300 };
static const uint8_t KEY[16] = {2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5};
static const uint8_t KINDS[] = {OC_RESULT, OC_RESULT, OC_RESULT, OC_CREDIT, OC_CREDIT,
                                OC_MCAST_DATA, OC_CONTRIB, OC_RESULT_ACK};

static oc_gmac opener;

static void check_sealed(void *ctx, uint8_t route, uint16_t dst, const uint8_t *data,
                         size_t len, size_t segment) {
    (void)ctx;
    (void)route;
    (void)dst;
    for (size_t at = 0; at < len; at += segment) {
        size_t n = len - at < segment ? len - at : segment;
        oc_header h;
        if (n < OC_OVERHEAD_BYTES || oc_header_parse(data + at, n, &h) ||
            h.length + OC_OVERHEAD_BYTES != n || h.src != RANK ||
            !oc_gmac_check(&opener, h.src, h.counter, data + at, n - OC_TAG_BYTES,
                           data + at + n - OC_TAG_BYTES)) {
            fprintf(stderr, "the plane sent a datagram that does not open\n");
            abort();
        }
    }
}

static void check_state(oc_plane *p, uint32_t seq) {
    const oc_reducer *r = oc_plane_reducer(p, seq);
    uint64_t stripe_chunks = 0;
    for (uint32_t e = 0; r && e < r->stripes; e++) {
        stripe_chunks += r->stripe_total[e];
        if (r->credit[e] > r->stripe_total[e]) {
            fprintf(stderr, "reduction %u: endpoint %u's credit past its chunks\n", seq, e);
            abort();
        }
    }
    if (r && (r->results > r->k || r->cursor > r->total || r->resend_n > r->total ||
              stripe_chunks != r->total)) {
        fprintf(stderr, "reduction %u out of its shape\n", seq);
        abort();
    }
    const oc_gather *g = oc_plane_gatherer(p, seq);
    uint64_t held = 0;
    for (uint32_t s = 0; g && s < g->nseg; s++) {
        held += g->k - g->missing[s];
        if (g->missing[s] > g->k || g->gap_n[s] > g->gap_cap) {
            fprintf(stderr, "gather %u out of its shape\n", seq);
            abort();
        }
    }
    for (uint32_t i = 0; g && i < g->nseg * g->k; i++) held -= g->state[i] == OC_CHUNK_HAVE;
    if (held) {
        fprintf(stderr, "gather %u: its counts and its states disagree\n", seq);
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!oc_gmac_keyed(&opener)) oc_gmac_init(&opener, KEY, 0);
    oc_sealer own = {.job = 1, .comm = 1, .src = RANK};
    /* two aggregator endpoints (its reductions striped over them), a rank, a stranger */
    oc_sealer senders[4] = {{.job = 1, .comm = 1, .src = OC_AGGREGATOR},
                            {.job = 1, .comm = 1, .src = OC_AGGREGATOR - 1},
                            {.job = 1, .comm = 1, .src = 2},
                            {.job = 1, .comm = 1, .src = 9}};
    oc_gmac_init(&own.gmac, KEY, 1);
    for (int i = 0; i < 4; i++) oc_gmac_init(&senders[i].gmac, KEY, 1);
    oc_budget budget;
    oc_budget_init(&budget, 1e6, 0.005, 2, CHUNK + 100, 4);
    static int32_t in32[WORLD * COUNT], out32[COUNT];
    static uint8_t gathered[WORLD * GATHER_BYTES];
    static uint16_t in16[WORLD * COUNT], out16[COUNT];
    oc_plane *p = oc_plane_new(RANK, WORLD, 1, 1, KEY, &own);
    oc_plane_set_stripes(p, 2);
    oc_plane_reduce(p, 0, OC_INT32, 0, COUNT, (uint8_t *)in32, (uint8_t *)out32, CHUNK, 8, 2,
                    &budget, 0);
    oc_plane_reduce(p, 1, OC_BFLOAT16, 1, COUNT, (uint8_t *)in16, (uint8_t *)out16, CHUNK, 8, 3,
                    &budget, 0);
    uint32_t roots[WORLD];
    uint64_t offsets[WORLD];
    for (uint32_t r = 0; r < WORLD; r++) {
        roots[r] = r;
        offsets[r] = (uint64_t)r * GATHER_BYTES;
    }
    oc_plane_gather(p, 2, gathered, WORLD, roots, offsets, GATHER_BYTES, CHUNK, RANK, WORLD - 1,
                    &budget);
    oc_gather *g = oc_plane_gatherer(p, 2);
    oc_gather_activate(g, oc_plane_outbox(p), 0);
    script s = {data, size};
    double now = 0;
    static uint8_t batch[65536], payload[512];
    while (s.left) {
        unsigned op = take(&s, 1);
        if (op % 8 == 7) { /* the clock moves on */
            now += take(&s, 1) * 0.002;
            double t = oc_plane_timer(p);
            if (t >= 0 && now >= t) oc_plane_handle_timer(p, now);
        } else if (op % 16 == 5) { /* a repair, as a successor's frame brings it */
            uint32_t first = take(&s, 1) % (WORLD * 5 + 2), fresh;
            size_t len = take(&s, 2) % sizeof payload;
            for (size_t i = 0; i < len; i++) payload[i] = (uint8_t)take(&s, 1);
            oc_gather_store(g, first, payload, len, now, &fresh);
            oc_gather_have(g, first, take(&s, 1) % 8);
        } else if (op % 16 == 13) {
            if (take(&s, 1) % 4 == 0) { /* every root's end of multicast heard */
                oc_gather_streams_ended(g);
            } else { /* a tail timer's request of what is still missing */
                oc_gather_request(g, take(&s, 1) % (WORLD + 1), take(&s, 1) % 8,
                                  take(&s, 1) % 8);
                g->nrequests = 0;
            }
        } else if (op % 8 == 6) { /* raw bytes as one read */
            size_t len = take(&s, 1) + 1, segment = 1 + take(&s, 1) % len;
            for (size_t i = 0; i < len; i++) batch[i] = (uint8_t)take(&s, 1);
            oc_plane_feed(p, batch, len, segment, now);
        } else { /* a read of 1-8 sealed datagrams from one sender */
            unsigned count = 1 + (op >> 3) % 8;
            oc_sealer *from = &senders[take(&s, 1) % 8 ? take(&s, 1) % 2 : 2 + take(&s, 1) % 2];
            uint8_t kind = KINDS[take(&s, 1) % sizeof KINDS];
            uint32_t seq = take(&s, 1) % 3, chunk = take(&s, 1) % (WORLD * 4);
            uint16_t dst = take(&s, 1) % 16 ? RANK : (uint16_t)(take(&s, 1) % 5);
            size_t len = take(&s, 1) % 2 ? (size_t)CHUNK : take(&s, 2) % sizeof payload;
            size_t at = 0, segment = 0;
            for (size_t i = 0; i < len; i++) payload[i] = (uint8_t)take(&s, 1);
            if (kind == OC_CREDIT && len >= 4 && take(&s, 1) % 2) len -= len % 4;
            for (unsigned i = 0; i < count; i++) {
                if (take(&s, 1) % 16 == 0 && from->counter) from->counter--; /* a replay */
                size_t n = oc_seal_into(from, batch + at, sizeof batch - at, kind, seq, dst,
                                        chunk + i, payload, len);
                if (n == 0) break;
                if (take(&s, 1) % 32 == 0) batch[at + take(&s, 2) % n] ^= 1; /* forged */
                segment = n;
                at += n;
            }
            if (at) oc_plane_feed(p, batch, at, segment, now);
        }
        check_state(p, 0);
        check_state(p, 1);
        check_state(p, 2);
        if (budget.gathers_in_flight != g->pacing) abort(); /* counted while it paces, once */
        uint32_t seqs[3];
        oc_plane_news(p, seqs, 3);
        oc_outbox_seal(oc_plane_outbox(p), &own, check_sealed, NULL);
    }
    oc_plane_free(p);
    oc_gmac_free(&own.gmac);
    for (int i = 0; i < 4; i++) oc_gmac_free(&senders[i].gmac);
    return 0;
}
