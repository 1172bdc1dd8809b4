/* The aggregator's registration of communicators, the sealing of what it sends, and its
 * creation and freeing (the engine is aggregator.c; the state both share, state.h). */
#include "state.h"

/* -- registration -------------------------------------------------------------------------- */

static void free_comm(oc_agg *a, comm_t *c) {
    for (int i = 0; i < c->nreductions; i++) agg_free_reduction(a, c, c->reductions[i]);
    free(c->spare);
    if (c->keyed) {
        oc_gmac_free(&c->sealer.gmac);
        oc_gmac_free(&c->opener);
    }
    if (c->peers)
        for (uint32_t r = 0; r < c->world; r++) oc_replay_free(&c->peers[r].window);
    free(c->peers);
    free(c);
}

int oc_agg_register(oc_agg *a, uint32_t job, uint32_t comm, uint32_t world, uint32_t stripe,
                    uint32_t slots, uint32_t max_row, const uint8_t *key, uint64_t counter,
                    uint32_t *granted) {
    int h = agg_find_comm(a, job, comm);
    comm_t *c = comm_of(a, h);
    if (c && c->world == world && c->stripe == stripe) {
        *granted = c->slots;
        return h;
    }
    if (world == 0 || world > OC_MAX_WORLD || stripe >= OC_MAX_STRIPES) return -1;
    comm_t *fresh = calloc(1, sizeof *fresh);
    if (fresh == NULL) return -1;
    fresh->job = job;
    fresh->comm = comm;
    fresh->world = world;
    fresh->stripe = stripe;
    fresh->slots = slots == 0 ? a->slots : slots < a->slots ? slots : a->slots;
    fresh->max_row = max_row;
    fresh->peers = calloc(world, sizeof(peer_t));
    if (fresh->peers == NULL) {
        free_comm(a, fresh);
        return -1;
    }
    if (key) {
        if (oc_gmac_init(&fresh->sealer.gmac, key, 1)) {
            free_comm(a, fresh);
            return -1;
        }
        if (oc_gmac_init(&fresh->opener, key, 0)) {
            oc_gmac_free(&fresh->sealer.gmac);
            free_comm(a, fresh);
            return -1;
        }
        fresh->keyed = 1;
        fresh->sealer.job = job;
        fresh->sealer.comm = comm;
        fresh->sealer.src = (uint16_t)(OC_AGGREGATOR - stripe);
        fresh->sealer.counter = counter;
    }
    if (c) { /* the same ids with another world: a new communicator in its place */
        free_comm(a, c);
        a->comms[h] = fresh;
    } else {
        for (h = 0; h < a->ncomms && a->comms[h]; h++) {}
        if (h == a->ncomms) {
            comm_t **more = realloc(a->comms, sizeof(comm_t *) * (size_t)(a->ncomms + 1));
            if (more == NULL) {
                free_comm(a, fresh);
                return -1;
            }
            a->comms = more;
            a->ncomms++;
        }
        a->comms[h] = fresh;
    }
    *granted = fresh->slots;
    return h;
}

void oc_agg_unregister(oc_agg *a, int h) {
    comm_t *c = comm_of(a, h);
    if (c == NULL) return;
    /* its messages still in the outbox go nowhere */
    for (size_t i = 0; i < a->nout; i++)
        if (a->out[i].handle == h) a->out[i].handle = -1;
    free_comm(a, c);
    a->comms[h] = NULL;
}

uint64_t oc_agg_comm_bytes(uint32_t world, uint32_t slots, uint32_t max_row) {
    uint64_t words = (world + 63) / 64;
    /* a timer's requests to send again name (rank, chunk) pairs of 8 bytes, then 4 bytes a
     * chunk in a rank's CREDIT; each CREDIT and result is an outbox entry */
    uint64_t per_slot = (uint64_t)world * max_row + sizeof(slot_t) + words * sizeof(uint64_t) +
                        (uint64_t)world * (8 + 4 + 4) + sizeof(oc_out);
    uint64_t per_reduction = sizeof(reduction_t) + (uint64_t)world * sizeof(int64_t) +
                             (uint64_t)world * sizeof(oc_out) + (uint64_t)slots * per_slot;
    return sizeof(comm_t) +
           (uint64_t)world * (sizeof(peer_t) + oc_replay_bytes(OC_REPLAY_WIDTH)) +
           OC_MAX_REDUCTIONS * per_reduction;
}

int oc_agg_set_address(oc_agg *a, int h, uint32_t rank, uint32_t ip, uint16_t port,
                       int hears_group) {
    comm_t *c = comm_of(a, h);
    if (c == NULL || rank >= c->world) return -1;
    peer_t *p = &c->peers[rank];
    p->address.sin_family = AF_INET;
    p->address.sin_addr.s_addr = ip;
    p->address.sin_port = port;
    p->has_address = 1;
    p->hears_group = hears_group != 0;
    return 0;
}

int oc_agg_set_group(oc_agg *a, int h, uint32_t ip, uint16_t port) {
    comm_t *c = comm_of(a, h);
    if (c == NULL) return -1;
    c->group.sin_family = AF_INET;
    c->group.sin_addr.s_addr = ip;
    c->group.sin_port = port;
    c->has_group = 1;
    return 0;
}

void oc_agg_each_destination(const oc_agg *a, int h, uint16_t dst, oc_to to, void *ctx) {
    const comm_t *c = comm_of(a, h);
    if (c == NULL) return;
    if (dst != OC_ANY) {
        if (dst < c->world && c->peers[dst].has_address) to(ctx, &c->peers[dst].address);
        return;
    }
    int all = c->has_group;
    for (uint32_t r = 0; r < c->world && all; r++)
        all = c->peers[r].has_address && c->peers[r].hears_group;
    if (all) {
        to(ctx, &c->group);
        return;
    }
    for (uint32_t r = 0; r < c->world; r++)
        if (c->peers[r].has_address) to(ctx, &c->peers[r].address);
}

void oc_agg_flush(oc_agg *a, oc_emit emit, void *ctx) {
    if (a->nout == 0) return;
    if (oc_grow((void **)&a->done, &a->done_cap, a->nout, 1)) {
        out_of_memory(a, 1); /* the outbox waits for the next flush */
        return;
    }
    memset(a->done, 0, a->nout);
    for (size_t i = 0; i < a->nout; i++) {
        if (a->done[i]) continue;
        int h = a->out[i].handle;
        uint16_t dst = a->out[i].dst;
        comm_t *c = comm_of(a, h);
        size_t end = 0, size = 0;
        for (size_t j = i; j < a->nout; j++) {
            const oc_out *o = &a->out[j];
            if (a->done[j] || o->handle != h || o->dst != dst) continue;
            a->done[j] = 1;
            if (c == NULL || !c->keyed) continue;
            size_t length = OC_OVERHEAD_BYTES + o->len;
            if (length > OC_MAX_DATAGRAM) continue; /* never made: payloads are bounded */
            const uint8_t *payload = oc_agg_payload(a, o);
            if (payload == NULL) continue;
            if (!oc_gso_joins(end, size, length)) {
                emit(ctx, h, dst, a->sealed, end, size);
                end = 0;
            }
            size_t n = oc_seal_into(&c->sealer, a->sealed + end, OC_MAX_DATAGRAM - end, o->kind,
                                    o->seq, dst, o->chunk, payload, o->len);
            if (n == 0) continue;
            if (end == 0) size = n;
            end += n;
        }
        if (end) emit(ctx, h, dst, a->sealed, end, size);
    }
    oc_agg_outbox_clear(a);
}

/* -- the rest of the contract -------------------------------------------------------------- */

oc_agg *oc_agg_new(uint32_t slots) {
    oc_agg *a = calloc(1, sizeof *a);
    if (a == NULL) return NULL;
    a->slots = slots ? slots : 1;
    a->expiry = OC_EXPIRY_SECONDS;
    a->next_tick = -1.0;
    a->last = -1;
    a->outbox_limit = OC_OUTBOX_BYTES;
    a->sealed = malloc(OC_MAX_DATAGRAM);
    if (a->sealed == NULL) {
        free(a);
        return NULL;
    }
    return a;
}

void oc_agg_free(oc_agg *a) {
    if (a == NULL) return;
    for (int h = 0; h < a->ncomms; h++)
        if (a->comms[h]) free_comm(a, a->comms[h]);
    free(a->comms);
    free(a->out);
    free(a->arena);
    free(a->chunks);
    free(a->pairs);
    free(a->nacked);
    free(a->completed);
    free(a->sealed);
    free(a->done);
    free(a);
}

void oc_agg_set_expiry(oc_agg *a, double seconds) { a->expiry = seconds; }

size_t oc_agg_outbox_count(const oc_agg *a) { return a->nout; }
size_t oc_agg_outbox_bytes(const oc_agg *a) { return a->nout * sizeof(oc_out) + a->arena_len; }
const oc_out *oc_agg_outbox(const oc_agg *a, size_t i) { return i < a->nout ? &a->out[i] : NULL; }
const uint8_t *oc_agg_payload(const oc_agg *a, const oc_out *o) {
    if (!o->in_pool) return a->arena + o->offset;
    comm_t *c = comm_of(a, o->handle);
    reduction_t *r = c ? agg_find_reduction(c, o->seq) : NULL;
    slot_t *s = r ? slot_of(r, o->chunk) : NULL;
    /* a slot summed for this chunk is the one queued: its owner and length are the message's */
    if (s == NULL || s->state != SUMMED) return NULL;
    return row_of(r, o->chunk, s->owner);
}
void oc_agg_outbox_clear(oc_agg *a) {
    a->nout = 0;
    a->arena_len = 0;
    /* what datagrams queue fills at most OC_OUTBOX_BYTES: more was a timer's burst (`done`
     * keeps a byte for each message `out` keeps) */
    size_t keep = 2 * OC_OUTBOX_BYTES;
    trim((void **)&a->out, &a->out_cap, sizeof(oc_out), keep);
    trim((void **)&a->arena, &a->arena_cap, 1, keep);
    trim((void **)&a->done, &a->done_cap, 1, keep / sizeof(oc_out));
}
const uint64_t *oc_agg_drops(const oc_agg *a) { return a->drops; }
uint64_t *oc_agg_drops_mut(oc_agg *a) { return a->drops; }
const uint64_t *oc_agg_stats(const oc_agg *a) { return a->stats; }
uint64_t oc_agg_pool_bytes(const oc_agg *a) { return a->pool_bytes; }
uint64_t oc_agg_peak_pool_bytes(const oc_agg *a) { return a->peak_pool_bytes; }
uint64_t oc_agg_kept_pool_bytes(const oc_agg *a) {
    uint64_t kept = 0;
    for (int h = 0; h < a->ncomms; h++)
        if (a->comms[h]) kept += a->comms[h]->spare_cap;
    return kept;
}
uint32_t oc_agg_communicators(const oc_agg *a) {
    uint32_t n = 0;
    for (int h = 0; h < a->ncomms; h++) n += a->comms[h] != NULL;
    return n;
}
uint32_t oc_agg_slots(const oc_agg *a) { return a->slots; }

double oc_agg_resend_timeout(const oc_agg *a, int h, uint32_t owner) {
    const comm_t *c = comm_of(a, h);
    return c && owner < c->world ? agg_resend_timeout(&c->peers[owner]) : -1.0;
}

int oc_agg_reductions(const oc_agg *a, int h, uint32_t *seqs, uint32_t *released, int max) {
    const comm_t *c = comm_of(a, h);
    if (c == NULL) return -1;
    for (int i = 0; i < c->nreductions && i < max; i++) {
        seqs[i] = c->reductions[i]->seq;
        released[i] = c->reductions[i]->released;
    }
    return c->nreductions;
}
