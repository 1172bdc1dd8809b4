#include "trace.h"

#include "common/grow.h"
#include "common/wire.h"

#define MERGE_BACK 4

void oc_trace_count(oc_trace *t, int tx, uint32_t seq, uint64_t datagrams, size_t payload,
                    double now) {
    double at = now / t->bin_seconds;
    if (t->bin_seconds <= 0 || datagrams == 0 || !(at >= 0 && at < 0x1p62)) return; /* a clock */
    int64_t bin = (int64_t)at; /* as Python bins */
    uint64_t bytes = datagrams * (uint64_t)OC_LINK_BYTES(payload);
    /* a flush or a read interleaves a few collectives at most: merge with one of the last few */
    for (size_t i = t->n; i > 0 && t->n - i < MERGE_BACK; i--) {
        oc_trace_bin *b = &t->bins[i - 1];
        if (b->seq == seq && b->tx == (uint8_t)tx && b->bin == bin) {
            b->bytes += bytes;
            return;
        }
    }
    if (oc_grow((void **)&t->bins, &t->cap, t->n + 1, sizeof(oc_trace_bin))) return;
    t->bins[t->n++] = (oc_trace_bin){.seq = seq, .tx = (uint8_t)tx, .bin = bin, .bytes = bytes};
}

void oc_trace_clear(oc_trace *t) { t->n = 0; }

void oc_trace_free(oc_trace *t) {
    free(t->bins);
    t->bins = NULL;
    t->n = t->cap = 0;
}
