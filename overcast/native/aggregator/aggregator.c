#include "state.h"

#define NAME(name) #name,
const char *const oc_drop_names[OC_DROP_COUNT] = {OC_DROPS(NAME)};
const char *const oc_stat_names[OC_STAT_COUNT] = {OC_STATS(NAME)};

/* -- the outbox ---------------------------------------------------------------------------- */

/* Whether the outbox takes one more message with `copied` bytes of payload; counted if not. */
static int outbox_takes(oc_agg *a, size_t copied) {
    if (oc_agg_outbox_bytes(a) + sizeof(oc_out) + copied <= a->outbox_limit) return 1;
    a->drops[OC_DROP_outbox_full]++;
    return 0;
}

static oc_out *queue_header(oc_agg *a, int h, uint16_t dst, uint8_t kind, uint32_t seq,
                           uint32_t chunk, size_t len) {
    if (!outbox_takes(a, 0)) return NULL;
    if (oc_grow((void **)&a->out, &a->out_cap, a->nout + 1, sizeof(oc_out))) {
        out_of_memory(a, 1);
        return NULL;
    }
    oc_out *o = &a->out[a->nout++];
    *o = (oc_out){.handle = h, .dst = dst, .kind = kind, .seq = seq, .chunk = chunk, .len = len};
    return o;
}

/* A message whose payload is copied into the arena: where to write it, or NULL. */
static uint8_t *queue(oc_agg *a, int h, uint16_t dst, uint8_t kind, uint32_t seq, uint32_t chunk,
                      size_t len) {
    if (!outbox_takes(a, len)) return NULL;
    if (oc_grow((void **)&a->arena, &a->arena_cap, a->arena_len + len, 1)) {
        out_of_memory(a, 1);
        return NULL;
    }
    oc_out *o = queue_header(a, h, dst, kind, seq, chunk, len);
    if (o == NULL) return NULL;
    o->offset = a->arena_len;
    a->arena_len += len;
    return a->arena + o->offset;
}

/* CREDIT: `released`, then chunks to send again, in messages that each fit the datagrams of
 * the communicator's path: no larger a payload than its widest contribution's. */
static void credit(oc_agg *a, int h, uint16_t dst, uint32_t seq, uint32_t released,
                   const uint32_t *again, size_t n) {
    size_t most = (a->comms[h]->max_row + PREFIX_BYTES) / 4 - 1; /* >= 2 */
    size_t done = 0; /* `again` may be NULL when n is 0: it is only indexed, never moved */
    do {
        size_t part = n - done < most ? n - done : most;
        uint8_t *p = queue(a, h, dst, OC_CREDIT, seq, 0, 4 + 4 * part);
        if (p == NULL) return;
        oc_put32(p, released);
        for (size_t i = 0; i < part; i++) oc_put32(p + 4 + 4 * i, again[done + i]);
        done += part;
    } while (done < n);
}

/* -- reductions ---------------------------------------------------------------------------- */

/* The pool goes back: kept as its communicator's spare if larger than the one it has. */
static void free_pool(oc_agg *a, comm_t *c, reduction_t *r) {
    if (r->pool == NULL) return;
    a->pool_bytes -= (uint64_t)r->window * r->world * r->row_bytes;
    if (r->pool_cap > c->spare_cap) {
        free(c->spare);
        c->spare = r->pool;
        c->spare_cap = r->pool_cap;
    } else {
        free(r->pool);
    }
    r->pool = NULL;
}

void agg_free_reduction(oc_agg *a, comm_t *c, reduction_t *r) {
    free_pool(a, c, r);
    free(r->passed);
    free(r->withdrawn);
    free(r->slots);
    free(r->have);
    free(r);
}

reduction_t *agg_find_reduction(comm_t *c, uint32_t seq) {
    for (int i = 0; i < c->nreductions; i++)
        if (c->reductions[i]->seq == seq) return c->reductions[i];
    return NULL;
}

static int finished_index(const comm_t *c, uint32_t seq) {
    for (int i = 0; i < c->nfinished; i++)
        if (c->finished_seq[i] == seq) return i;
    return -1;
}

static reduction_t *new_reduction(oc_agg *a, comm_t *c, uint32_t seq, uint8_t code,
                                  uint8_t group, uint32_t whole, uint32_t place,
                                  uint32_t stripes) {
    reduction_t *r = calloc(1, sizeof *r);
    if (r == NULL) return NULL;
    r->seq = seq;
    r->world = c->world;
    r->whole = whole;
    r->stripes = stripes;
    r->place = place;
    r->lane = oc_stripe_lane(place, seq, stripes);
    r->total = (uint32_t)oc_stripe_count(whole, group, stripes, r->lane);
    r->k = whole / c->world;
    r->window = c->slots;
    r->code = code;
    r->group = group;
    r->itemsize = oc_dtype_size(code);
    r->folds = code != OC_BFLOAT16 && code != OC_FLOAT16;
    r->highest = -1;
    r->words = (c->world + 63) / 64;
    r->passed = malloc(sizeof(int64_t) * c->world);
    r->withdrawn = calloc(r->words, sizeof(uint64_t));
    r->slots = calloc(r->window, sizeof(slot_t));
    r->have = calloc((size_t)r->window * r->words, sizeof(uint64_t));
    if (r->passed == NULL || r->withdrawn == NULL || r->slots == NULL || r->have == NULL) {
        agg_free_reduction(a, c, r);
        return NULL;
    }
    for (uint32_t i = 0; i < c->world; i++) r->passed[i] = -1;
    return r;
}

/* The pool, wide enough for rows of `bytes`: made as wide as the first contribution, made wider
 * (its rows kept, moved in place) if a wider one comes (ranks send their widest chunks first:
 * rare). A new pool takes its communicator's spare if it is wide enough, else frees it: the
 * communicator's pools and spare never pass OC_MAX_REDUCTIONS pools of its bound. */
static int widen_pool(oc_agg *a, comm_t *c, reduction_t *r, size_t bytes) {
    if (r->pool && r->row_bytes >= bytes) return 0;
    size_t rows = (size_t)r->window * r->world, need = rows * bytes > 0 ? rows * bytes : 1;
    if (r->pool == NULL && c->spare_cap >= need) {
        r->pool = c->spare;
        r->pool_cap = c->spare_cap;
        c->spare = NULL;
        c->spare_cap = 0;
        a->stats[OC_STAT_pools_reused]++;
    } else if (r->pool == NULL) {
        free(c->spare);
        c->spare = NULL;
        c->spare_cap = 0;
        if ((r->pool = malloc(need)) == NULL) return -1;
        r->pool_cap = need;
    } else if (r->pool_cap < need) {
        uint8_t *wider = realloc(r->pool, need);
        if (wider == NULL) return -1;
        r->pool = wider;
        r->pool_cap = need;
    }
    if (r->row_bytes) { /* last row first: a row never lands on one not moved yet */
        for (size_t i = rows; i-- > 0;)
            memmove(r->pool + i * bytes, r->pool + i * r->row_bytes, r->row_bytes);
        a->pool_bytes -= (uint64_t)rows * r->row_bytes;
    }
    r->row_bytes = bytes;
    a->pool_bytes += (uint64_t)rows * bytes;
    if (a->pool_bytes > a->peak_pool_bytes) a->peak_pool_bytes = a->pool_bytes;
    return 0;
}

/* The result is sealed from the owner's row when the outbox is flushed (oc_agg_payload). */
static void send_result(oc_agg *a, int h, reduction_t *r, slot_t *s, double now) {
    s->sent_at = now;
    s->sent = ++r->results_sent;
    oc_out *o = queue_header(a, h, (uint16_t)s->owner, OC_RESULT, r->seq, s->g,
                             (size_t)s->elems * r->itemsize);
    if (o) o->in_pool = 1;
}

static void announce(oc_agg *a, int h, reduction_t *r) {
    r->announced = r->released;
    credit(a, h, OC_ANY, r->seq, r->released, NULL, 0);
}

static void answer_credit(oc_agg *a, int h, comm_t *c, uint32_t seq, uint16_t rank,
                          const uint32_t *again, size_t n) {
    reduction_t *r = agg_find_reduction(c, seq);
    int i;
    if (r) credit(a, h, rank, seq, r->released, again, n);
    else if ((i = finished_index(c, seq)) >= 0) credit(a, h, rank, seq, c->finished_total[i], NULL, 0);
}

/* Take `r` out of its communicator, remembering it as finished: contributions that come for it
 * later are answered with credit, not taken as a new reduction. Frees it. */
/* Remember reduction `seq` as finished with `total` chunks (the oldest forgotten past
 * OC_TOMBSTONES). */
static void remember_finished(comm_t *c, uint32_t seq, uint32_t total) {
    int i = finished_index(c, seq);
    if (i >= 0) {
        c->finished_total[i] = total;
        return;
    }
    if (c->nfinished == OC_TOMBSTONES) {
        memmove(c->finished_seq, c->finished_seq + 1, sizeof(uint32_t) * (OC_TOMBSTONES - 1));
        memmove(c->finished_total, c->finished_total + 1, sizeof(uint32_t) * (OC_TOMBSTONES - 1));
        c->nfinished--;
    }
    c->finished_seq[c->nfinished] = seq;
    c->finished_total[c->nfinished++] = total;
}

static void retire(oc_agg *a, comm_t *c, reduction_t *r) {
    int i = 0;
    while (c->reductions[i] != r) i++;
    memmove(&c->reductions[i], &c->reductions[i + 1], sizeof(r) * (size_t)(c->nreductions - i - 1));
    c->nreductions--;
    remember_finished(c, r->seq, r->total);
    agg_free_reduction(a, c, r);
}

/* Rank `src` gives reduction `seq` up (its call was refused on another rank). Once every rank
 * that contributed to it has, it is freed, not held until its expiry, and remembered as
 * finished: its ranks have all stopped, and contributions still on their way start nothing. A
 * rank's WITHDRAW alone (a buggy member's) does not end a reduction the others go on with; one
 * for a reduction not begun here names nothing to free, and is let go (stale). */
static void withdraw(oc_agg *a, comm_t *c, uint32_t seq, uint16_t src) {
    reduction_t *r = agg_find_reduction(c, seq);
    if (r == NULL) {
        a->drops[OC_DROP_stale]++;
        return;
    }
    r->withdrawn[src / 64] |= (uint64_t)1 << (src % 64);
    for (uint32_t i = 0; i < r->world; i++)
        if (r->passed[i] >= 0 && !(r->withdrawn[i / 64] >> (i % 64) & 1)) return;
    retire(a, c, r);
    a->stats[OC_STAT_withdrawn]++;
}

static void finish(oc_agg *a, int h, comm_t *c, reduction_t *r) {
    announce(a, h, r);
    retire(a, c, r);
    a->stats[OC_STAT_reductions]++;
}

/* RFC 6298's estimator over the round trip from a result to its owner's acknowledgement, one
 * per owner: a rank slowed by its CPU has its own, and does not slow the others' resends. */
static void sample_rtt(peer_t *p, double seconds) {
    if (!p->has_rtt) {
        p->srtt = seconds;
        p->rttvar = seconds / 2;
        p->has_rtt = 1;
    } else {
        double d = p->srtt - seconds;
        p->rttvar += ((d < 0 ? -d : d) - p->rttvar) / 4;
        p->srtt += (seconds - p->srtt) / 8;
    }
}

double agg_resend_timeout(const peer_t *p) {
    if (!p->has_rtt) return OC_RESEND_SECONDS;
    double t = p->srtt + 4 * p->rttvar;
    return t < OC_RESEND_SECONDS ? OC_RESEND_SECONDS : t > OC_MAX_RESEND_SECONDS ? OC_MAX_RESEND_SECONDS : t;
}

/* -- contributions ------------------------------------------------------------------------- */

/* Rank s->next's contribution, read from `payload`, goes into the owner's row, and after it every
 * contribution already held for the ranks that follow: the row is the sum of the ranks below
 * s->next in rank order, the bits oc_sum_rows gives, and only contributions that came out of
 * order are copied into the pool and read back. */
static void fold(reduction_t *r, slot_t *s, const uint8_t *payload) {
    uint8_t *sum = row_of(r, s->g, s->owner);
    const uint64_t *have = have_of(r, s->g);
    size_t nbytes = (size_t)s->elems * r->itemsize;
    if (s->next == (s->owner == 0)) memcpy(sum, payload, nbytes);
    else oc_add_pair(r->code, sum, sum, payload, s->elems);
    for (;;) {
        if (++s->next == s->owner) s->next++;
        if (s->next >= r->world || !contributed(have, s->next)) return;
        oc_add_pair(r->code, sum, sum, row_of(r, s->g, s->next), s->elems);
    }
}

static void on_contributions(oc_agg *a, int h, comm_t *c, const oc_header *hdr,
                             const uint32_t *chunks, size_t count, const uint8_t *data,
                             size_t offset, size_t stride, double now) {
    size_t length = hdr->length;
    if (length < PREFIX_BYTES) {
        a->drops[OC_DROP_malformed] += count;
        return;
    }
    const uint8_t *prefix = data + offset;
    for (size_t i = 1; i < count; i++)
        if (memcmp(data + offset + i * stride, prefix, PREFIX_BYTES)) {
            a->drops[OC_DROP_inconsistent] += count; /* one collective, one prefix */
            return;
        }
    uint8_t code = prefix[0], group = prefix[1];
    uint32_t world = oc_get16(prefix + 2), whole = oc_get32(prefix + 4);
    uint32_t stripe = oc_get16(prefix + 8), stripes = oc_get16(prefix + 10);
    size_t nbytes = length - PREFIX_BYTES;
    if (nbytes > c->max_row) {
        a->drops[OC_DROP_wrong_length] += count;
        return;
    }
    reduction_t *r = agg_find_reduction(c, hdr->seq);
    if (r == NULL) {
        if (finished_index(c, hdr->seq) >= 0) {
            answer_credit(a, h, c, hdr->seq, hdr->src, NULL, 0);
            return;
        }
        if (oc_dtype_size(code) == 0) {
            a->drops[OC_DROP_malformed] += count;
            return;
        }
        if (world != c->world || whole == 0 || whole % world || !group ||
            nbytes % oc_dtype_size(code) || stripes == 0 || stripes > OC_MAX_STRIPES ||
            stripe >= stripes) {
            a->drops[OC_DROP_inconsistent] += count;
            return;
        }
        /* a reduction is made only for a chunk it could take: in range, in the first window */
        uint32_t total = (uint32_t)oc_endpoint_count(whole, group, stripes, stripe, hdr->seq);
        size_t fits = 0;
        while (fits < count && (chunks[fits] >= total || chunks[fits] >= c->slots)) fits++;
        if (fits == count) {
            a->drops[chunks[0] >= total ? OC_DROP_out_of_range : OC_DROP_beyond_window] += count;
            return;
        }
        if (c->nreductions >= OC_MAX_REDUCTIONS) { /* sent again when the rank's credit stalls */
            a->stats[OC_STAT_refused] += count;
            return;
        }
        if ((r = new_reduction(a, c, hdr->seq, code, group, whole, stripe, stripes)) == NULL) {
            out_of_memory(a, count);
            return;
        }
        r->touched = now;
        c->reductions[c->nreductions++] = r;
    }
    if (world != r->world || whole != r->whole || code != r->code || group != r->group ||
        stripe != r->place || stripes != r->stripes || nbytes % r->itemsize) {
        a->drops[OC_DROP_inconsistent] += count;
        return;
    }
    uint32_t elems = (uint32_t)(nbytes / r->itemsize);
    int pooled = 0; /* the pool is made wide enough once a chunk passes every check */
    uint32_t src = hdr->src, owner = 0, first = 1, end = 0;
    uint64_t bit = (uint64_t)1 << (src & 63);
    int late = 0;
    /* the chunks this run completes, in order: at most `count` */
    if (oc_grow((void **)&a->completed, &a->completed_cap, count, sizeof(completion))) {
        out_of_memory(a, count);
        return;
    }
    completion *complete = a->completed;
    size_t ncomplete = 0;
    for (size_t i = 0; i < count; i++) {
        uint32_t g = chunks[i];
        if (g >= r->total) {
            a->drops[OC_DROP_out_of_range]++;
            continue;
        }
        uint32_t in_whole = global_of(r, g);
        if (!(first <= in_whole && in_whole < end)) owner = owner_span(r, in_whole, &first, &end);
        if (owner == src) {
            a->drops[OC_DROP_wrong_sender]++;
            continue;
        }
        if (g < r->released) { /* done already: the sender missed the credit */
            a->stats[OC_STAT_late_contributions]++;
            late = 1;
            continue;
        }
        if (g - r->released >= r->window) {
            a->drops[OC_DROP_beyond_window]++;
            continue;
        }
        if (!pooled) {
            if (widen_pool(a, c, r, nbytes)) {
                out_of_memory(a, count - i);
                break;
            }
            pooled = 1;
        }
        if ((int64_t)g > r->passed[src]) r->passed[src] = g;
        slot_t *s = &r->slots[g % r->window];
        uint64_t *have = have_of(r, g);
        if (s->state == EMPTY || s->g != g) {
            memset(s, 0, sizeof *s);
            memset(have, 0, sizeof(uint64_t) * r->words);
            s->g = g;
            s->elems = elems;
            s->owner = owner;
            s->next = owner == 0;
            s->state = COLLECTING;
            s->first_seen = now;
            if ((int64_t)g > r->highest) r->highest = g;
        }
        if ((have[src >> 6] & bit) || s->state == SUMMED) {
            a->stats[OC_STAT_duplicate_contributions]++;
            continue;
        }
        if (s->elems != elems) {
            a->drops[OC_DROP_wrong_length]++;
            continue;
        }
        have[src >> 6] |= bit;
        s->count++;
        const uint8_t *payload = data + offset + i * stride + PREFIX_BYTES;
        a->stats[OC_STAT_contributions]++;
        if (r->folds && src == s->next) {
            fold(r, s, payload);
        } else if (r->folds || s->count < r->world - 1) {
            memcpy(row_of(r, g, src), payload, nbytes);
            a->stats[OC_STAT_held]++; /* copied into the pool to wait its turn */
        }
        if (s->count == r->world - 1) complete[ncomplete++] = (completion){g, payload};
    }
    if (pooled) r->touched = now; /* a chunk passed every check: the reduction is alive */
    if (late) answer_credit(a, h, c, hdr->seq, (uint16_t)src, NULL, 0);
    for (size_t i = 0; i < ncomplete; i++) {
        slot_t *s = &r->slots[complete[i].g % r->window];
        if (!r->folds)
            oc_sum_rows(r->code, row_of(r, s->g, s->owner), row_of(r, s->g, 0), r->row_bytes,
                        r->world, s->owner, s->elems, src, complete[i].last);
        s->state = SUMMED;
        a->stats[OC_STAT_results]++;
        send_result(a, h, r, s, now);
    }
    /* each owner of a completed slot hears the credit once, in the order they came */
    for (size_t i = 0; i < ncomplete; i++) {
        uint32_t o = r->slots[complete[i].g % r->window].owner;
        int told = 0;
        for (size_t j = 0; j < i && !told; j++) told = r->slots[complete[j].g % r->window].owner == o;
        if (!told) credit(a, h, (uint16_t)o, r->seq, r->released, NULL, 0);
    }
}

/* -- acknowledgements and credit ------------------------------------------------------------ */

/* When the acknowledged result left (the reduction's sends so far) if this is the first
 * acknowledgement of a result sent once, else 0. Sets *gone if the reduction finished. */
static uint32_t on_ack(oc_agg *a, int h, comm_t *c, reduction_t *r, uint32_t src, uint32_t g,
                       double now, int *gone) {
    slot_t *s = slot_of(r, g);
    if (s == NULL || s->state != SUMMED || s->owner != src) {
        a->drops[OC_DROP_stray_acks]++;
        return 0;
    }
    uint32_t sent = 0;
    r->touched = now;
    if (!s->acked && !s->resends) {
        sample_rtt(&c->peers[src], now - s->sent_at);
        sent = s->sent;
    }
    s->acked = 1;
    while ((s = slot_of(r, r->released)) != NULL && s->acked) {
        s->state = EMPTY;
        s->hole = 0;
        r->released++;
    }
    if (r->released == r->total) {
        finish(a, h, c, r);
        *gone = 1;
    } else {
        uint32_t every = r->window / CREDIT_EVERY_DIVISOR;
        if (r->released - r->announced >= (every ? every : 1)) announce(a, h, r);
    }
    return sent;
}

/* Results to `owner` not acknowledged that left before the one sent `newest`, which it has
 * acknowledged: the path to an owner keeps order and an owner acknowledges every result it
 * takes, so these were lost. They go again at once, oldest first (TCP's fast retransmit), not
 * after the resend timeout, which would hold the window's head and every rank's credit. */
static void resend_overtaken(oc_agg *a, int h, reduction_t *r, uint32_t owner, uint32_t newest,
                             double now) {
    for (;;) {
        slot_t *oldest = NULL;
        for (uint32_t i = 0; i < r->window; i++) {
            slot_t *s = &r->slots[i];
            if (s->state == SUMMED && !s->acked && s->owner == owner && s->sent < newest &&
                (oldest == NULL || s->sent < oldest->sent))
                oldest = s;
        }
        if (oldest == NULL) return;
        oldest->resends++;
        send_result(a, h, r, oldest, now); /* its `sent` is now past `newest` */
        a->stats[OC_STAT_results_resent_early]++;
    }
}

static void on_acks(oc_agg *a, int h, comm_t *c, const oc_header *hdr, const uint8_t *p,
                    size_t len, double now) {
    reduction_t *r = agg_find_reduction(c, hdr->seq);
    if (r == NULL) {
        a->drops[OC_DROP_stale]++;
        return;
    }
    uint32_t newest = 0;
    int gone = 0;
    for (size_t i = 0; i + 4 <= len; i += 4) {
        if (gone) { /* the reduction finished: what is left acknowledges nothing */
            a->drops[OC_DROP_stray_acks]++;
            continue;
        }
        uint32_t sent = on_ack(a, h, c, r, hdr->src, oc_get32(p + i), now, &gone);
        if (sent > newest) newest = sent;
    }
    if (newest && !gone) resend_overtaken(a, h, r, hdr->src, newest, now);
}

/* Chunks in the window below `sent_below` that `rank` sent and that never came. */
static size_t owed(reduction_t *r, uint32_t rank, uint32_t sent_below, uint32_t *out) {
    size_t n = 0;
    uint64_t limit = (uint64_t)r->released + r->window;
    if (sent_below < limit) limit = sent_below;
    if (r->total < limit) limit = r->total; /* a probe may name chunks past the last */
    for (uint64_t g = r->released; g < limit; g++) {
        if (owner_of(r, (uint32_t)g) == rank) continue;
        slot_t *s = slot_of(r, (uint32_t)g);
        if (s && (contributed(have_of(r, (uint32_t)g), rank) || s->state == SUMMED))
            continue;
        out[n++] = (uint32_t)g;
    }
    return n;
}

/* A rank's credit has stalled: say what it still owes. A reduction neither in flight nor
 * finished was refused: the rank sends its first window again, taken once there is room. */
static void on_credit_probe(oc_agg *a, int h, comm_t *c, const oc_header *hdr, uint32_t sent_below) {
    reduction_t *r = agg_find_reduction(c, hdr->seq);
    size_t n = 0;
    if (oc_grow((void **)&a->nacked, &a->nacked_cap, c->slots, sizeof(uint32_t))) {
        out_of_memory(a, 1);
        return;
    }
    uint32_t *list = a->nacked;
    if (r == NULL && finished_index(c, hdr->seq) < 0) {
        uint32_t upto = sent_below < c->slots ? sent_below : c->slots;
        for (uint32_t g = 0; g < upto; g++) list[n++] = g; /* the rank skips its own */
        credit(a, h, hdr->src, hdr->seq, 0, list, n);
    } else {
        if (r) n = owed(r, hdr->src, sent_below, list);
        answer_credit(a, h, c, hdr->seq, hdr->src, list, n);
    }
    a->stats[OC_STAT_nacks] += n;
}

void oc_agg_receive_run(oc_agg *a, int h, const oc_header *hdr, const uint32_t *chunks,
                        size_t count, const uint8_t *data, size_t offset, size_t stride,
                        double now) {
    comm_t *c = comm_of(a, h);
    if (c == NULL) {
        a->drops[OC_DROP_unregistered] += count;
    } else if (hdr->dst != OC_AGGREGATOR - c->stripe) {
        a->drops[OC_DROP_misdirected] += count;
    } else if (hdr->src >= c->world) {
        a->drops[OC_DROP_wrong_sender] += count;
    } else if (hdr->kind == OC_CONTRIB) {
        on_contributions(a, h, c, hdr, chunks, count, data, offset, stride, now);
    } else if (hdr->kind == OC_WITHDRAW) {
        if (hdr->length) a->drops[OC_DROP_malformed] += count;
        else withdraw(a, c, hdr->seq, hdr->src);
    } else if (hdr->kind == OC_RESULT_ACK || hdr->kind == OC_CREDIT) {
        for (size_t i = 0; i < count; i++) {
            const uint8_t *p = data + offset + i * stride;
            if (hdr->kind == OC_RESULT_ACK) {
                if (hdr->length % 4) a->drops[OC_DROP_malformed]++;
                else on_acks(a, h, c, hdr, p, hdr->length, now);
            } else {
                if (hdr->length != 4) a->drops[OC_DROP_malformed]++;
                else on_credit_probe(a, h, c, hdr, oc_get32(p));
            }
            /* a CREDIT or acknowledgement may finish the communicator's last reduction, never
             * the communicator itself: c stays valid */
        }
    } else {
        a->drops[OC_DROP_unexpected_kind] += count;
    }
}

/* -- the clock ----------------------------------------------------------------------------- */

static int busy(const oc_agg *a) {
    for (int h = 0; h < a->ncomms; h++)
        if (a->comms[h] && a->comms[h]->nreductions) return 1;
    return 0;
}

double oc_agg_timer(const oc_agg *a) {
    if (a->next_tick < 0 && busy(a)) return 0.0;
    return a->next_tick;
}

static void nack(oc_agg *a, uint32_t rank, uint32_t g) {
    if (oc_grow((void **)&a->pairs, &a->pairs_cap, a->pairs_len + 1, sizeof(uint64_t))) {
        out_of_memory(a, 1); /* a NACK not sent: the slot asks again at the next tick */
        return;
    }
    a->pairs[a->pairs_len++] = (uint64_t)rank << 32 | g;
}

/* Contributors to chunk g not in `have` (NULL: none) that have sent chunks past g: ranks send
 * in order, so theirs was lost (or is very late). Ranks not there yet are left alone. */
static void nack_missing(oc_agg *a, reduction_t *r, uint32_t g, const uint64_t *have) {
    uint32_t owner = owner_of(r, g);
    for (uint32_t rank = 0; rank < r->world; rank++)
        if (rank != owner && !(have && contributed(have, rank)) &&
            r->passed[rank] > (int64_t)g)
            nack(a, rank, g);
}

static int by_pair(const void *x, const void *y) {
    uint64_t p = *(const uint64_t *)x, q = *(const uint64_t *)y;
    return p < q ? -1 : p > q;
}

/* Each reduction's expiry, resends and requests to send again. */
static void handle_reductions(oc_agg *a, double now) {
    a->next_tick = busy(a) ? now + TICK_SECONDS : -1.0;
    for (int h = 0; h < a->ncomms; h++) {
        comm_t *c = a->comms[h];
        if (c == NULL) continue;
        for (int i = 0; i < c->nreductions; i++) {
            reduction_t *r = c->reductions[i];
            if (now >= r->touched + a->expiry) {
                /* no contribution or acknowledgement for that long: a rank died, or a member
                 * is buggy. Its slot and pool go to others; its ranks time out. */
                retire(a, c, r);
                a->stats[OC_STAT_expired]++;
                i--;
                continue;
            }
            a->pairs_len = 0;
            for (uint32_t j = 0; j < r->window; j++) {
                uint32_t g = r->released + j;
                if (g >= r->total) break;
                slot_t *s = slot_of(r, g);
                if (s && s->state == SUMMED) {
                    unsigned shift = s->resends < MAX_BACKOFF ? s->resends : MAX_BACKOFF;
                    double wait = agg_resend_timeout(&c->peers[s->owner]) * (double)(1u << shift);
                    if (wait > LONGEST_RESEND_WAIT) wait = LONGEST_RESEND_WAIT;
                    if (!s->acked && now >= s->sent_at + wait) {
                        s->resends++;
                        send_result(a, h, r, s, now);
                        a->stats[OC_STAT_results_resent]++;
                    }
                } else if (s) {
                    double since = s->first_seen > s->nacked ? s->first_seen : s->nacked;
                    if (now >= since + NACK_SECONDS) {
                        s->nacked = now;
                        nack_missing(a, r, g, have_of(r, g));
                    }
                } else if ((int64_t)g < r->highest) {
                    /* no slot below the highest chunk seen: every contribution may be lost */
                    slot_t *hole = &r->slots[g % r->window];
                    if (!hole->hole || hole->hole_g != g) {
                        hole->hole = 1;
                        hole->hole_g = g;
                        hole->hole_asked = now;
                    }
                    if (now >= hole->hole_asked + NACK_SECONDS) {
                        hole->hole_asked = now;
                        nack_missing(a, r, g, NULL);
                    }
                }
            }
            /* one CREDIT per rank, naming its chunks in rising order */
            if (a->pairs_len) qsort(a->pairs, a->pairs_len, sizeof(uint64_t), by_pair);
            for (size_t p = 0; p < a->pairs_len;) {
                uint32_t rank = (uint32_t)(a->pairs[p] >> 32);
                size_t q = p;
                while (q < a->pairs_len && (uint32_t)(a->pairs[q] >> 32) == rank) q++;
                if (oc_grow((void **)&a->nacked, &a->nacked_cap, q - p, sizeof(uint32_t))) {
                    out_of_memory(a, q - p);
                    return;
                }
                for (size_t m = p; m < q; m++) a->nacked[m - p] = (uint32_t)a->pairs[m];
                credit(a, h, (uint16_t)rank, r->seq, r->released, a->nacked, q - p);
                a->stats[OC_STAT_nacks] += q - p;
                p = q;
            }
        }
    }
}

void oc_agg_handle_timer(oc_agg *a, double now) {
    a->outbox_limit = SIZE_MAX; /* what it queues is within its communicators' bounds */
    handle_reductions(a, now);
    a->outbox_limit = OC_OUTBOX_BYTES;
    trim((void **)&a->pairs, &a->pairs_cap, sizeof(uint64_t), OC_OUTBOX_BYTES);
}

/* -- datagrams ----------------------------------------------------------------------------- */

int agg_find_comm(oc_agg *a, uint32_t job, uint32_t comm) {
    comm_t *c = comm_of(a, a->last);
    if (c && c->job == job && c->comm == comm) return a->last;
    for (int h = 0; h < a->ncomms; h++)
        if ((c = a->comms[h]) && c->job == job && c->comm == comm) return a->last = h;
    return -1;
}

/* Open one datagram of `len` bytes: its header into *h and its communicator's handle into
 * *handle, or the reason it is dropped (an OC_DROP_ index). */
static int open_datagram(oc_agg *a, const uint8_t *d, size_t len, oc_header *h, int *handle) {
    if (len < OC_OVERHEAD_BYTES || oc_header_parse(d, len, h) ||
        (size_t)h->length + OC_OVERHEAD_BYTES != len)
        return OC_DROP_malformed;
    comm_t *c = comm_of(a, *handle = agg_find_comm(a, h->job, h->comm));
    if (c == NULL || !c->keyed) return OC_DROP_foreign;
    if (!oc_gmac_check(&c->opener, h->src, h->counter, d, len - OC_TAG_BYTES,
                       d + len - OC_TAG_BYTES))
        return OC_DROP_bad_mac;
    if (h->src >= c->world) return OC_DROP_wrong_sender; /* authentic, but no rank of its world */
    oc_replay *w = &c->peers[h->src].window;
    if (w->nwords == 0 && oc_replay_init(w, OC_REPLAY_WIDTH))
        return OC_DROP_out_of_memory; /* no window to check it against */
    return oc_replay_accept(w, h->counter) ? -1 : OC_DROP_replayed;
}

void oc_agg_feed(oc_agg *a, const uint8_t *data, size_t n, size_t segment, double now) {
    if (n == 0 || segment == 0) {
        a->drops[OC_DROP_malformed]++;
        return;
    }
    if (oc_grow((void **)&a->chunks, &a->chunks_cap, n / segment + 1, sizeof(uint32_t))) {
        out_of_memory(a, (n + segment - 1) / segment);
        return;
    }
    oc_header run, h;
    size_t count = 0, run_offset = 0;
    int run_handle = -1, handle;
    uint32_t last = 0;
    for (size_t start = 0; start < n; start += segment) {
        size_t len = n - start < segment ? n - start : segment;
        int dropped = open_datagram(a, data + start, len, &h, &handle);
        /* a datagram that fails ends the run; one that does not fit the run starts another */
        if (count && (dropped >= 0 || h.kind != run.kind || h.job != run.job ||
                      h.comm != run.comm || h.seq != run.seq || h.src != run.src ||
                      h.dst != run.dst || h.length != run.length || h.chunk <= last)) {
            oc_agg_receive_run(a, run_handle, &run, a->chunks, count, data, run_offset, segment,
                               now);
            count = 0;
        }
        if (dropped >= 0) {
            a->drops[dropped]++;
            continue;
        }
        if (count == 0) {
            run = h;
            run_handle = handle;
            run_offset = start + OC_HEADER_BYTES;
        }
        a->chunks[count++] = last = h.chunk;
    }
    if (count)
        oc_agg_receive_run(a, run_handle, &run, a->chunks, count, data, run_offset, segment, now);
}
