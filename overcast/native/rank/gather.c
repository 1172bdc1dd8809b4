#include "gather.h"

#include <stdlib.h>
#include <string.h>

#include "common/grow.h"

int oc_gather_init(oc_gather *g, uint32_t seq, uint32_t world, uint8_t *buffer, uint32_t nseg,
                   const uint32_t *roots, const uint64_t *offsets, uint64_t segment_bytes,
                   uint32_t chunk_bytes, int mine, uint32_t concurrent, oc_budget *budget) {
    memset(g, 0, sizeof *g);
    if (nseg == 0 || chunk_bytes == 0 || budget == NULL || concurrent == 0 || concurrent > world ||
        mine >= (int)nseg || segment_bytes / chunk_bytes >= UINT32_MAX / nseg)
        return -1;
    g->seq = seq;
    g->world = world;
    g->nseg = nseg;
    g->buffer = buffer;
    g->segment_bytes = segment_bytes;
    g->chunk_bytes = chunk_bytes;
    g->k = (uint32_t)((segment_bytes + chunk_bytes - 1) / chunk_bytes);
    g->mine = mine;
    g->concurrent = concurrent;
    g->budget = budget; /* counted in flight from here until its streams end or it is freed */
    budget->gathers_in_flight++;
    g->pacing = 1;
    g->progress_at = -1;
    g->roots = malloc(nseg * sizeof *g->roots);
    g->offsets = malloc(nseg * sizeof *g->offsets);
    g->state = calloc((size_t)nseg * g->k + 1, 1);
    g->missing = malloc(nseg * sizeof *g->missing);
    g->newest = malloc(nseg * sizeof *g->newest);
    g->gap_head = calloc(nseg, sizeof *g->gap_head);
    g->gap_n = calloc(nseg, sizeof *g->gap_n);
    /* a gap waits only until OC_REORDER_SLACK chunks past it came: a few wait at once */
    g->gap_cap = OC_GAPS;
    g->gaps = malloc(nseg * g->gap_cap * sizeof *g->gaps);
    if (!g->roots || !g->offsets || !g->state || !g->missing || !g->newest || !g->gap_head ||
        !g->gap_n || !g->gaps) {
        oc_gather_free(g);
        return -1;
    }
    for (uint32_t s = 0; s < nseg; s++) {
        g->roots[s] = roots[s];
        g->offsets[s] = offsets[s];
        g->missing[s] = g->k;
        g->newest[s] = -1;
    }
    if (mine >= 0) {
        memset(g->state + (size_t)mine * g->k, OC_CHUNK_HAVE, g->k);
        g->missing[mine] = 0;
    }
    return 0;
}

static void stop_pacing(oc_gather *g) {
    if (g->pacing) g->budget->gathers_in_flight--;
    g->pacing = 0;
}

int oc_gather_streams_ended(oc_gather *g) {
    if (g->mine >= 0 && !g->sent_all) return 0; /* its own stream has not ended */
    stop_pacing(g);
    return 1;
}

void oc_gather_free(oc_gather *g) {
    stop_pacing(g);
    free(g->roots);
    free(g->offsets);
    free(g->state);
    free(g->missing);
    free(g->newest);
    free(g->gap_head);
    free(g->gap_n);
    free(g->gaps);
    free(g->requests);
    memset(g, 0, sizeof *g);
}

size_t oc_gather_bytes(const oc_gather *g) {
    return sizeof *g + g->nseg * (4 + 8 + 4 + 8 + 2 * sizeof(size_t) + g->gap_cap * 8) +
           (size_t)g->nseg * g->k + g->requests_cap * sizeof(oc_range);
}

int oc_gather_complete(const oc_gather *g) {
    for (uint32_t s = 0; s < g->nseg; s++)
        if (g->missing[s]) return 0;
    return 1;
}

/* Bytes [*start, *end) of the buffer that chunks gid .. gid + count - 1 (one segment) cover. */
static void span(const oc_gather *g, uint32_t gid, uint32_t count, uint64_t *start, uint64_t *end) {
    uint32_t s = gid / g->k, c = gid % g->k;
    uint64_t from = (uint64_t)c * g->chunk_bytes, to = (uint64_t)(c + count) * g->chunk_bytes;
    if (to > g->segment_bytes) to = g->segment_bytes;
    *start = g->offsets[s] + from;
    *end = g->offsets[s] + to;
}

static void stepped(oc_gather *g, uint64_t steps, double now) {
    g->progress += steps;
    g->progress_at = now;
}

static void note_complete(oc_gather *g) {
    if (!g->told_complete && oc_gather_complete(g)) {
        g->told_complete = 1;
        g->news = 1;
    }
}

int oc_gather_request(oc_gather *g, uint32_t s, uint32_t lo, uint32_t hi) {
    if (s >= g->nseg || hi > g->k) return 0;
    uint8_t *state = g->state + (size_t)s * g->k;
    for (uint32_t c = lo; c < hi;) {
        if (state[c] != OC_CHUNK_MISSING) {
            c++;
            continue;
        }
        /* room first: a chunk marked requested is never asked for again */
        if (oc_grow((void **)&g->requests, &g->requests_cap, g->nrequests + 1, sizeof(oc_range)))
            return -1; /* no memory: still missing, for a later gap or the tail timer again */
        uint32_t from = c;
        while (c < hi && state[c] == OC_CHUNK_MISSING) state[c++] = OC_CHUNK_REQUESTED;
        g->requests[g->nrequests++] = (oc_range){s * g->k + from, c - from};
        g->news = 1;
    }
    return 0;
}

/* Chunks first .. last of segment s came: a skip before them is a gap, and a gap far enough
 * behind the newest chunk is requested. */
static void advance(oc_gather *g, uint32_t s, uint32_t first, uint32_t last) {
    int64_t newest = g->newest[s];
    if ((int64_t)last <= newest) return;
    oc_range *ring = g->gaps + (size_t)s * g->gap_cap;
    if ((int64_t)first > newest + 1) {
        if (g->gap_n[s] == g->gap_cap) { /* full (reordering past reason): the oldest is lost */
            oc_range oldest = ring[g->gap_head[s]];
            g->gap_head[s] = (g->gap_head[s] + 1) % g->gap_cap;
            g->gap_n[s]--;
            oc_gather_request(g, s, oldest.first, oldest.first + oldest.count);
        }
        ring[(g->gap_head[s] + g->gap_n[s]) % g->gap_cap] =
            (oc_range){(uint32_t)(newest + 1), first - (uint32_t)(newest + 1)};
        g->gap_n[s]++;
    }
    g->newest[s] = last;
    while (g->gap_n[s]) {
        oc_range gap = ring[g->gap_head[s]];
        if ((uint64_t)gap.first + gap.count - 1 + OC_REORDER_SLACK > last) break;
        g->gap_head[s] = (g->gap_head[s] + 1) % g->gap_cap;
        g->gap_n[s]--;
        oc_gather_request(g, s, gap.first, gap.first + gap.count);
    }
}

/* Put chunk gid in place from `len` bytes: 1 if new, 0 if it was here, -1 if the wrong length. */
static int store(oc_gather *g, uint32_t gid, const uint8_t *p, size_t len) {
    uint64_t start, end;
    span(g, gid, 1, &start, &end);
    if (len != end - start) return -1;
    if (g->state[gid] == OC_CHUNK_HAVE) return 0;
    memcpy(g->buffer + start, p, len);
    g->state[gid] = OC_CHUNK_HAVE;
    g->missing[gid / g->k]--;
    return 1;
}

int oc_gather_chunks(oc_gather *g, uint16_t src, const uint32_t *chunks, size_t count,
                     const uint8_t *data, size_t offset, size_t stride, size_t length,
                     double now) {
    uint32_t s = 0;
    while (s < g->nseg && g->roots[s] != src) s++;
    if (s == g->nseg || (int)s == g->mine) return OC_MISFIT_WRONG_SENDER;
    if (!count) return OC_FIT;
    uint32_t lo = s * g->k, hi = lo + g->k;
    if (chunks[0] < lo || chunks[count - 1] >= hi) return OC_MISFIT_OUT_OF_RANGE;
    int misfit = OC_FIT;
    uint64_t fresh = 0;
    for (size_t i = 0; i < count; i++) {
        if (chunks[i] < lo || chunks[i] >= hi) { /* a run rises: only a forged one gets here */
            misfit = OC_MISFIT_OUT_OF_RANGE;
            break;
        }
        int r = store(g, chunks[i], data + offset + i * stride, length);
        if (r < 0) {
            misfit = OC_MISFIT_WRONG_LENGTH;
            break;
        }
        fresh += (uint64_t)r;
        g->multicast_chunks += (uint64_t)r;
        g->duplicate_chunks += (uint64_t)(r == 0);
        advance(g, s, chunks[i] - lo, chunks[i] - lo);
    }
    if (fresh) stepped(g, fresh, now);
    note_complete(g);
    return misfit;
}

int oc_gather_store(oc_gather *g, uint32_t first, const uint8_t *payload, size_t len,
                    double now, uint32_t *fresh) {
    *fresh = 0;
    if (!len) return OC_MISFIT_WRONG_LENGTH;
    uint64_t count = (len + g->chunk_bytes - 1) / g->chunk_bytes;
    if (g->k == 0 || first >= g->nseg * g->k || count > g->k ||
        first / g->k != (first + count - 1) / g->k)
        return OC_MISFIT_OUT_OF_RANGE;
    uint64_t start, end;
    span(g, first, (uint32_t)count, &start, &end);
    if (end - start != len) return OC_MISFIT_WRONG_LENGTH;
    for (uint32_t i = 0; i < count; i++) {
        uint64_t a, b;
        span(g, first + i, 1, &a, &b);
        *fresh += (uint32_t)store(g, first + i, payload + (a - start), b - a);
    }
    g->repaired_chunks += *fresh;
    if (*fresh) stepped(g, *fresh, now);
    note_complete(g);
    return OC_FIT;
}

int oc_gather_have(const oc_gather *g, uint32_t first, uint32_t count) {
    if (count == 0 || g->k == 0 || first >= g->nseg * g->k || count > g->k ||
        first / g->k != ((uint64_t)first + count - 1) / g->k)
        return -1;
    for (uint32_t i = 0; i < count; i++)
        if (g->state[first + i] != OC_CHUNK_HAVE) return 0;
    return 1;
}

/* Gathers in flight at once: their streams reach the same receivers' links. */
static uint32_t gathers(const oc_gather *g) {
    return g->budget->gathers_in_flight > 1 ? (uint32_t)g->budget->gathers_in_flight : 1;
}

/* Link bytes per second of this rank's stream: what receivers can take, shared among the
 * streams they take at once and among the gathers in flight, less the results'
 * share while reductions run (overcast.schedules.chains.stream_rate gives one gather's). */
static double stream_rate(const oc_gather *g) {
    double share = g->budget->reductions_in_flight ? (double)(g->world - 1) / g->world : 1.0;
    return g->budget->rate * share / g->concurrent / gathers(g);
}

static void pump(oc_gather *g, oc_outbox *o, double now) {
    if (!g->sending) return;
    double rate = stream_rate(g);
    double full = OC_LINK_BYTES(g->chunk_bytes);
    uint32_t first = g->next_chunk, last = g->k - 1, end = first;
    double shortest = OC_LINK_BYTES(g->segment_bytes - (uint64_t)last * g->chunk_bytes);
    double next_send = g->next_send > now - OC_MAX_BURST_SECONDS ? g->next_send
                                                                  : now - OC_MAX_BURST_SECONDS;
    /* each chunk is due at its own time; those due within a batch's time leave together. The
     * link's batch is shared by the streams a receiver takes in at once, so what reaches a
     * receiver's switch port at once stays near one link batch, whatever the number of roots
     * and gathers; but never fewer than OC_STREAM_BATCH, each a wake-up of every receiver. */
    uint64_t streams = (uint64_t)g->concurrent * gathers(g);
    uint32_t batch = (uint32_t)((g->budget->batch + streams - 1) / streams);
    if (batch < OC_STREAM_BATCH) batch = OC_STREAM_BATCH;
    double due = rate > 0 ? now + (batch - 1) * full / rate : now;
    double wire = 0;
    while (end <= last && (rate <= 0 || next_send <= due)) {
        double spent = end < last ? full : shortest;
        wire += spent;
        if (rate > 0) next_send += spent / rate;
        end++;
    }
    g->next_send = next_send;
    if (end > first) {
        uint32_t base = (uint32_t)g->mine * g->k;
        for (uint32_t c = first; c < end; c++) {
            uint64_t a, b;
            span(g, base + c, 1, &a, &b);
            oc_outbox_add(o, OC_ROUTE_GROUP, OC_ANY, OC_MCAST_DATA, g->seq, base + c, NULL, 0,
                          g->buffer + a, b - a);
        }
        oc_budget_take(g->budget, wire, now);
        g->next_chunk = end;
        stepped(g, end - first, now);
    }
    if (g->next_chunk == g->k) {
        g->sending = 0;
        g->sent_all = 1;
        g->news = 1;
    }
}

void oc_gather_activate(oc_gather *g, oc_outbox *o, double now) {
    if (g->mine < 0 || g->sending || g->sent_all) return;
    if (g->k == 0) { /* nothing to send */
        g->sent_all = g->news = 1;
        return;
    }
    g->sending = 1;
    g->next_send = now;
    pump(g, o, now);
}

double oc_gather_timer(const oc_gather *g) { return g->sending ? g->next_send : -1; }

void oc_gather_handle_timer(oc_gather *g, oc_outbox *o, double now) { pump(g, o, now); }
