#include "contribute.h"

#include <stdlib.h>
#include <string.h>

#include "common/bytes.h"
#include "common/numbering.h"
#include "common/sums.h"

static int test_bit(const uint64_t *bits, uint64_t i) { return bits[i >> 6] >> (i & 63) & 1; }
static void set_bit(uint64_t *bits, uint64_t i) { bits[i >> 6] |= (uint64_t)1 << (i & 63); }
static void clear_bit(uint64_t *bits, uint64_t i) { bits[i >> 6] &= ~((uint64_t)1 << (i & 63)); }
static size_t words(uint64_t n) { return (size_t)((n + 63) / 64); }

int oc_reducer_init(oc_reducer *r, uint32_t seq, uint32_t rank, uint32_t world, unsigned dtype,
                    int avg, uint64_t count, const uint8_t *input, uint8_t *output,
                    size_t chunk_bytes, uint32_t slots, uint32_t group, uint32_t stripes,
                    const uint16_t *endpoints, oc_budget *budget) {
    memset(r, 0, sizeof *r);
    size_t itemsize = oc_dtype_size(dtype);
    if (!itemsize || world == 0 || world > OC_MAX_WORLD || rank >= world ||
        chunk_bytes < itemsize || group == 0 || group > 255 || slots == 0 || stripes == 0 ||
        stripes > OC_MAX_STRIPES || budget == NULL)
        return -1;
    uint64_t chunk_elems = chunk_bytes / itemsize;
    uint64_t k = (count + chunk_elems - 1) / chunk_elems;
    if (k * world >= UINT32_MAX) return -1; /* the resend ring holds total + 1 */
    r->seq = seq;
    r->rank = rank;
    r->world = world;
    r->dtype = dtype;
    r->avg = avg;
    r->itemsize = itemsize;
    r->count = count;
    r->chunk_elems = chunk_elems;
    r->k = (uint32_t)k;
    r->total = (uint32_t)(k * world);
    r->group = group;
    r->slots = slots;
    r->stripes = stripes;
    r->input = input;
    r->budget = budget;
    r->output = output;
    r->pump_at = r->probe_at = r->ack_at = r->progress_at = -1;
    /* a RESULT_ACK's payload, 4 bytes an acknowledgement, fits where a contribution's does */
    r->ack_batch = (chunk_bytes + OC_CONTRIB_PREFIX_BYTES) / 4;
    if (r->ack_batch > OC_ACK_BATCH) r->ack_batch = OC_ACK_BATCH;
    r->resend = malloc(((size_t)r->total + 1) * sizeof(uint32_t));
    r->pending = calloc(words(r->total) + 1, sizeof(uint64_t));
    r->have = calloc(words(r->k) + 1, sizeof(uint64_t));
    r->credit = calloc(2 * (size_t)stripes, sizeof(uint32_t));
    r->prefixes = malloc((size_t)stripes * OC_CONTRIB_PREFIX_BYTES);
    r->endpoint = malloc((size_t)stripes * sizeof(uint16_t));
    if (!r->resend || !r->pending || !r->have || !r->credit || !r->prefixes || !r->endpoint) {
        oc_reducer_free(r);
        return -1;
    }
    r->stripe_total = r->credit + stripes;
    for (uint32_t e = 0; e < stripes; e++) {
        r->endpoint[e] = endpoints ? endpoints[e] : (uint16_t)e;
        uint8_t *prefix = r->prefixes + (size_t)e * OC_CONTRIB_PREFIX_BYTES;
        const uint32_t fields[] = {dtype, group, world, world >> 8, r->total, r->total >> 8,
                                   r->total >> 16, r->total >> 24, e, e >> 8, stripes,
                                   stripes >> 8};
        for (int i = 0; i < OC_CONTRIB_PREFIX_BYTES; i++) prefix[i] = (uint8_t)fields[i];
        r->stripe_total[e] = (uint32_t)oc_endpoint_count(r->total, group, stripes, e, seq);
    }
    return 0;
}

void oc_reducer_free(oc_reducer *r) {
    free(r->resend);
    free(r->pending);
    free(r->have);
    free(r->credit);
    free(r->prefixes);
    free(r->endpoint);
    r->resend = r->credit = r->stripe_total = NULL;
    r->pending = r->have = NULL;
    r->prefixes = NULL;
    r->endpoint = NULL;
}

int oc_reducer_place(const oc_reducer *r, uint32_t endpoint) {
    for (uint32_t e = 0; e < r->stripes; e++)
        if (r->endpoint[e] == endpoint) return (int)e;
    return -1;
}

/* Where stripe e's datagrams go. */
static uint16_t dst_of(const oc_reducer *r, uint32_t e) {
    return (uint16_t)(OC_AGGREGATOR - r->endpoint[e]);
}

size_t oc_reducer_bytes(const oc_reducer *r) {
    return sizeof *r + ((size_t)r->total + 1) * 4 + (words(r->total) + words(r->k) + 2) * 8 +
           (size_t)r->stripes * (10 + OC_CONTRIB_PREFIX_BYTES);
}

/* The endpoint chunk g goes to. */
static uint32_t stripe_of(const oc_reducer *r, uint32_t g) {
    return oc_endpoint_of_chunk(g, r->group, r->stripes, r->seq);
}

/* Endpoint e's chunk h in the whole. */
static uint32_t global_of(const oc_reducer *r, uint32_t e, uint32_t h) {
    return (uint32_t)oc_endpoint_global(h, r->group, r->stripes, e, r->seq);
}

static uint32_t local_of(const oc_reducer *r, uint32_t g) {
    return (uint32_t)oc_stripe_local(g, r->group, r->stripes);
}

/* Elements [*start, *stop) of the input that chunk g covers; its block and place. */
static uint32_t elements(const oc_reducer *r, uint32_t g, uint64_t *start, uint64_t *stop,
                         uint64_t *c) {
    uint32_t block = oc_chunk_place(g, r->world, r->k, r->group, c);
    *start = block * r->count + *c * r->chunk_elems;
    *stop = *start + r->chunk_elems;
    if (*stop > (uint64_t)(block + 1) * r->count) *stop = (uint64_t)(block + 1) * r->count;
    return block;
}

/* The first chunk from g on that is not of this rank's own block. */
static uint32_t next_to_send(const oc_reducer *r, uint32_t g) {
    while (g < r->total) {
        uint32_t first, end;
        if (oc_owner_span(g, r->world, r->k, r->group, &first, &end) != r->rank) return g;
        g = end;
    }
    return g;
}

/* One RESULT_ACK per endpoint, naming its chunks in its numbering. */
static void flush_acks(oc_reducer *r, oc_outbox *o) {
    uint32_t endpoint[OC_ACK_BATCH];
    uint8_t told[OC_ACK_BATCH] = {0};
    for (size_t i = 0; i < r->nacks; i++) endpoint[i] = stripe_of(r, r->acks[i]);
    for (size_t i = 0; i < r->nacks; i++) {
        if (told[i]) continue;
        uint32_t e = endpoint[i], n = 0;
        for (size_t j = i; j < r->nacks; j++) n += !told[j] && endpoint[j] == e;
        uint8_t *p = oc_outbox_add_copy(o, OC_ROUTE_AGGREGATOR, dst_of(r, e),
                                        OC_RESULT_ACK, r->seq, n, 4 * (size_t)n);
        for (size_t j = i, m = 0; j < r->nacks; j++)
            if (!told[j] && endpoint[j] == e) {
                told[j] = 1;
                if (p) oc_put32(p + 4 * m++, local_of(r, r->acks[j]));
            }
    }
    r->nacks = 0; /* lost with no memory: the aggregator sends the results again */
    r->ack_at = -1;
}

static void acknowledge(oc_reducer *r, oc_outbox *o, uint32_t g, double now) {
    r->acks[r->nacks++] = g;
    if (r->nacks >= r->ack_batch) flush_acks(r, o);
    else if (r->ack_at < 0) r->ack_at = now + OC_ACK_DELAY_SECONDS;
}

/* Send what the credit window and the budget allow, a batch at a time: the batch leaves
 * together or waits until the budget holds it all. */
static void pump(oc_reducer *r, oc_outbox *o, double now) {
    if (r->pump_at >= 0 && now < r->pump_at) return;
    r->pump_at = -1;
    uint32_t chunks[256];
    uint64_t starts[256], stops[256]; /* each chunk's elements, worked out once */
    uint32_t group = r->group;
    for (;;) {
        size_t n = 0, resends = r->resend_n < group ? r->resend_n : group;
        for (size_t i = 0; i < resends; i++) chunks[n++] = r->resend[(r->resend_head + i) % (r->total + 1)];
        uint32_t after = r->cursor;
        while (n < group && after < r->total) {
            uint32_t first, end;
            oc_owner_span(after, r->world, r->k, r->group, &first, &end);
            uint64_t take = end;
            if (take > (uint64_t)after + group - n) take = (uint64_t)after + group - n;
            if (r->stripes > 1 && take > ((uint64_t)after / group + 1) * group)
                take = ((uint64_t)after / group + 1) * group; /* one endpoint's run */
            /* never more than `slots` past the endpoint's credit */
            uint32_t e = stripe_of(r, after);
            uint64_t here = local_of(r, after), limit = (uint64_t)r->credit[e] + r->slots;
            if (here >= limit) break;
            if (take - after > limit - here) take = after + (limit - here);
            for (uint32_t g = after; g < take; g++) chunks[n++] = g;
            after = take < end ? (uint32_t)take : next_to_send(r, end);
        }
        if (!n) return;
        double wire = 0;
        for (size_t i = 0; i < n; i++) {
            uint64_t c;
            elements(r, chunks[i], &starts[i], &stops[i], &c);
            wire += OC_LINK_BYTES(OC_CONTRIB_PREFIX_BYTES + (stops[i] - starts[i]) * r->itemsize);
        }
        if (!oc_budget_try_take(r->budget, wire, now)) {
            r->pump_at = oc_budget_ready_at(r->budget, wire, now);
            return;
        }
        for (size_t i = 0; i < n; i++) {
            uint32_t e = stripe_of(r, chunks[i]);
            oc_outbox_add(o, OC_ROUTE_AGGREGATOR, dst_of(r, e), OC_CONTRIB,
                          r->seq, local_of(r, chunks[i]),
                          r->prefixes + (size_t)e * OC_CONTRIB_PREFIX_BYTES,
                          OC_CONTRIB_PREFIX_BYTES, r->input + starts[i] * r->itemsize,
                          (stops[i] - starts[i]) * r->itemsize);
        }
        flush_acks(r, o);
        for (size_t i = 0; i < resends; i++) {
            clear_bit(r->pending, r->resend[r->resend_head]);
            r->resend_head = (r->resend_head + 1) % (r->total + 1);
            r->resend_n--;
        }
        if (n > resends) {
            r->progress += n - resends;
            r->progress_at = now;
        }
        r->cursor = after;
        if (r->cursor >= r->total && r->phase == OC_REDUCER_SENDING)
            r->phase = OC_REDUCER_RECEIVING;
    }
}

void oc_reducer_start(oc_reducer *r, oc_outbox *o, double now) {
    if (r->world == 1 || r->k == 0) {
        uint8_t *own = r->output;
        memmove(own, r->input, r->count * r->itemsize);
        if (r->avg) oc_divide(r->dtype, own, r->count, r->world);
        r->phase = OC_REDUCER_DRAINED;
        return;
    }
    r->budget->reductions_in_flight++;
    r->counted = 1;
    r->phase = OC_REDUCER_SENDING;
    r->cursor = next_to_send(r, 0);
    r->probe_at = now + OC_RETRY_SECONDS;
    pump(r, o, now);
}

void oc_reducer_finish(oc_reducer *r) {
    if (r->counted) {
        r->counted = 0;
        r->budget->reductions_in_flight--;
    }
}

static int all_released(const oc_reducer *r) {
    for (uint32_t e = 0; e < r->stripes; e++)
        if (r->credit[e] < r->stripe_total[e]) return 0;
    return 1;
}

/* After every message: send what may go; drained once the block is in and all is released. */
static void after_receive(oc_reducer *r, oc_outbox *o, double now) {
    pump(r, o, now);
    if (r->results == r->k) {
        flush_acks(r, o);
        if (r->phase == OC_REDUCER_RECEIVING && all_released(r)) {
            r->phase = OC_REDUCER_DRAINED;
            r->probe_at = r->pump_at = -1;
        }
    }
}

int oc_reducer_results(oc_reducer *r, oc_outbox *o, uint32_t stripe, const uint32_t *chunks,
                       size_t count, const uint8_t *data, size_t offset, size_t stride,
                       size_t length, double now) {
    int misfit = OC_FIT;
    for (size_t i = 0; i < count && misfit == OC_FIT; i++) {
        uint64_t start, stop, c;
        if (stripe >= r->stripes || chunks[i] >= r->stripe_total[stripe]) {
            misfit = OC_MISFIT_OUT_OF_RANGE;
            break;
        }
        uint32_t g = global_of(r, stripe, chunks[i]);
        if (elements(r, g, &start, &stop, &c) != r->rank) {
            misfit = OC_MISFIT_OUT_OF_RANGE;
            break;
        }
        if (length != (stop - start) * r->itemsize) {
            misfit = OC_MISFIT_WRONG_LENGTH;
            break;
        }
        if (!test_bit(r->have, c)) {
            uint8_t *out = r->output + c * r->chunk_elems * r->itemsize;
            size_t n = (size_t)(stop - start);
            oc_add_pair(r->dtype, out, data + offset + i * stride, r->input + start * r->itemsize,
                        n);
            if (r->avg) oc_divide(r->dtype, out, n, r->world);
            set_bit(r->have, c);
            r->results++;
            r->progress++;
            r->progress_at = now;
            r->results_in++;
        } else {
            r->duplicate_results++;
        }
        acknowledge(r, o, g, now);
    }
    after_receive(r, o, now);
    return misfit;
}

int oc_reducer_credit(oc_reducer *r, oc_outbox *o, uint32_t stripe, const uint8_t *payload,
                      size_t len, double now) {
    if (len < 4 || len % 4) return OC_MISFIT_MALFORMED;
    uint32_t released = oc_get32(payload);
    if (stripe >= r->stripes || released > r->stripe_total[stripe]) return OC_MISFIT_OUT_OF_RANGE;
    if (released > r->credit[stripe]) {
        r->credit[stripe] = released;
        r->progress++;
        r->progress_at = now;
        r->probe_at = now + OC_RETRY_SECONDS;
    }
    for (size_t at = 4; at < len; at += 4) {
        uint32_t h = oc_get32(payload + at);
        uint64_t c;
        if (h >= r->stripe_total[stripe]) continue;
        uint32_t g = global_of(r, stripe, h);
        if (g >= r->cursor || oc_chunk_place(g, r->world, r->k, r->group, &c) == r->rank)
            continue; /* not sent yet anyway, or not ours to send */
        if (!test_bit(r->pending, g)) {
            r->resend[(r->resend_head + r->resend_n) % (r->total + 1)] = g;
            r->resend_n++;
            set_bit(r->pending, g);
            r->contributions_resent++;
        }
    }
    after_receive(r, o, now);
    return OC_FIT;
}

double oc_reducer_timer(const oc_reducer *r) {
    double t = -1;
    const double times[3] = {r->pump_at, r->probe_at, r->ack_at};
    for (int i = 0; i < 3; i++)
        if (times[i] >= 0 && (t < 0 || times[i] < t)) t = times[i];
    return t;
}

void oc_reducer_handle_timer(oc_reducer *r, oc_outbox *o, double now) {
    if (r->ack_at >= 0 && now >= r->ack_at) flush_acks(r, o);
    if (r->probe_at >= 0 && now >= r->probe_at) {
        /* the credit has stalled: ask every endpoint for it, saying how far this rank has sent
         * there (the answer carries any resend requests too) */
        for (uint32_t e = 0; e < r->stripes; e++) {
            uint8_t *p = oc_outbox_add_copy(o, OC_ROUTE_AGGREGATOR, dst_of(r, e),
                                            OC_CREDIT, r->seq, 0, 4);
            if (p) oc_put32(p, (uint32_t)oc_endpoint_count(r->cursor, r->group, r->stripes, e,
                                                        r->seq));
        }
        r->credit_probes++;
        r->probe_at = now + OC_RETRY_SECONDS;
    }
    pump(r, o, now);
}
