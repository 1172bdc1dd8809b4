#include "aggregator.h"
#include "numbering.h"

#include <stdlib.h>
#include <string.h>

#include "grow.h"
#include "sums.h"
#include "udp.h"

#define NACK_SECONDS 0.02
#define MAX_BACKOFF 8
#define LONGEST_RESEND_WAIT (OC_RESEND_SECONDS * (1 << MAX_BACKOFF))
#define TICK_SECONDS 0.01
#define CREDIT_EVERY_DIVISOR 4 /* announce after a quarter of the window is released */
#define PREFIX_BYTES 8         /* CONTRIB's: dtype u8, group u8, world u16, total u32 */
/* The most chunks one CREDIT names to send again: its payload stays one datagram. */
#define CREDIT_MAX_RESEND ((OC_MAX_DATAGRAM - OC_OVERHEAD_BYTES - 4) / 4)

#define NAME(name) #name,
const char *const oc_drop_names[OC_DROP_COUNT] = {OC_DROPS(NAME)};
const char *const oc_stat_names[OC_STAT_COUNT] = {OC_STATS(NAME)};

enum { EMPTY = 0, COLLECTING = 1, SUMMED = 2 };

typedef struct {
    uint32_t g, elems, count;  /* the chunk held, its elements, contributors in */
    uint32_t owner;
    uint8_t state, acked, hole;
    uint16_t resends;
    uint32_t sent;             /* the reduction's result sends when its last copy left */
    uint32_t hole_g;           /* a chunk with no slot yet, asked for at hole_asked */
    double first_seen, nacked, sent_at, hole_asked;
} slot_t;

typedef struct {
    double touched;               /* when a contribution or acknowledgement last came */
    uint32_t seq, world, total, k, window, released, announced, results_sent;
    uint8_t code, group;
    size_t itemsize, row_bytes;   /* row_bytes: the pool's width per row */
    int64_t highest;              /* the highest chunk any contribution came for */
    int64_t *passed;              /* per rank: the highest chunk it sent */
    slot_t *slots;                /* window */
    uint64_t *have;               /* window x words: contributors per slot */
    uint32_t words;
    uint8_t *pool;                /* window x world x row_bytes, within pool_cap bytes */
    size_t pool_cap;
} reduction_t;

/* What the aggregator knows of one rank of a communicator. */
typedef struct {
    oc_replay window;             /* its datagrams' counters, made with its first authentic one */
    struct sockaddr_in address;   /* where its datagrams go */
    uint8_t has_address, hears_group, has_rtt;
    double srtt, rttvar;          /* the round trip from a result to its acknowledgement */
} peer_t;

typedef struct {
    uint32_t job, comm, world, slots;
    uint32_t max_row;             /* the widest contribution taken (bytes after the prefix) */
    reduction_t *reductions[OC_MAX_REDUCTIONS]; /* in the order they began */
    int nreductions;
    uint32_t finished_seq[OC_TOMBSTONES], finished_total[OC_TOMBSTONES];
    int nfinished;                /* oldest first */
    int keyed;
    oc_sealer sealer;
    oc_gmac opener;
    peer_t *peers;                /* world of them */
    struct sockaddr_in group;
    int has_group;
} comm_t;

/* A chunk whose last contribution came in the run being read: that one is summed from the
 * datagram, not copied into the pool first. */
typedef struct {
    uint32_t g;
    const uint8_t *last;
} completion;

struct oc_agg {
    uint32_t slots;
    double expiry;                /* a reduction idle this long is given up (seconds) */
    comm_t **comms;
    int ncomms;
    int last;                     /* the handle found last, tried first */
    oc_out *out;
    size_t nout, out_cap;
    uint8_t *arena;
    size_t arena_len, arena_cap;
    uint64_t drops[OC_DROP_COUNT], stats[OC_STAT_COUNT];
    uint64_t pool_bytes, peak_pool_bytes;
    /* The largest pool a finished reduction left, for the next one: a fresh pool of tens of MiB
     * comes from mmap, and faulting in and zeroing its pages took about a sixth of the
     * aggregator's CPU on loopback. Freed when no communicator is left. */
    uint8_t *spare;
    size_t spare_cap;
    double next_tick;             /* < 0: none */
    uint32_t *chunks;             /* scratch: a run's chunks (oc_agg_feed) */
    size_t chunks_cap;
    uint64_t *pairs;              /* scratch: (rank, chunk) of NACKs (handle_timer) */
    size_t pairs_len, pairs_cap;
    uint32_t *nacked;             /* scratch: one rank's chunks to send again */
    size_t nacked_cap;
    completion *completed;        /* scratch: the chunks a run of contributions completes */
    size_t completed_cap;
    uint8_t *sealed;              /* scratch: one GSO batch (oc_agg_flush) */
    uint8_t *done;                /* scratch: outbox entries flushed */
    size_t done_cap;
};

/* -- small helpers ------------------------------------------------------------------------ */

/* An allocation failed: counted, and the caller drops what needed it. */
static void out_of_memory(oc_agg *a, uint64_t what) { a->drops[OC_DROP_out_of_memory] += what; }

static uint32_t get32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static comm_t *comm_of(const oc_agg *a, int h) {
    return h >= 0 && h < a->ncomms ? a->comms[h] : NULL;
}

static uint32_t owner_of(const reduction_t *r, uint32_t g) {
    uint64_t c;
    return oc_chunk_place(g, r->world, r->k, r->group, &c);
}

static uint32_t owner_span(const reduction_t *r, uint32_t g, uint32_t *first, uint32_t *end) {
    return oc_owner_span(g, r->world, r->k, r->group, first, end);
}

/* -- the outbox ---------------------------------------------------------------------------- */

static oc_out *queue_header(oc_agg *a, int h, uint16_t dst, uint8_t kind, uint32_t seq,
                           uint32_t chunk, size_t len) {
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

/* CREDIT: `released`, then chunks to send again, in messages that each fit a datagram. */
static void credit(oc_agg *a, int h, uint16_t dst, uint32_t seq, uint32_t released,
                   const uint32_t *again, size_t n) {
    size_t done = 0; /* `again` may be NULL when n is 0: it is only indexed, never moved */
    do {
        size_t part = n - done < CREDIT_MAX_RESEND ? n - done : CREDIT_MAX_RESEND;
        uint8_t *p = queue(a, h, dst, OC_CREDIT, seq, 0, 4 + 4 * part);
        if (p == NULL) return;
        put32(p, released);
        for (size_t i = 0; i < part; i++) put32(p + 4 + 4 * i, again[done + i]);
        done += part;
    } while (done < n);
}

/* -- reductions ---------------------------------------------------------------------------- */

static slot_t *slot_of(reduction_t *r, uint32_t g) {
    if (g < r->released || g - r->released >= r->window) return NULL;
    slot_t *s = &r->slots[g % r->window];
    return s->state != EMPTY && s->g == g ? s : NULL;
}

static uint64_t *have_of(reduction_t *r, uint32_t g) { return r->have + (size_t)(g % r->window) * r->words; }

static uint8_t *row_of(reduction_t *r, uint32_t g, uint32_t rank) {
    return r->pool + ((size_t)(g % r->window) * r->world + rank) * r->row_bytes;
}

static void free_pool(oc_agg *a, reduction_t *r) {
    if (r->pool == NULL) return;
    a->pool_bytes -= (uint64_t)r->window * r->world * r->row_bytes;
    if (r->pool_cap > a->spare_cap) {
        free(a->spare);
        a->spare = r->pool;
        a->spare_cap = r->pool_cap;
    } else {
        free(r->pool);
    }
    r->pool = NULL;
}

static void free_reduction(oc_agg *a, reduction_t *r) {
    free_pool(a, r);
    free(r->passed);
    free(r->slots);
    free(r->have);
    free(r);
}

static reduction_t *find_reduction(comm_t *c, uint32_t seq) {
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
                                  uint8_t group, uint32_t total) {
    reduction_t *r = calloc(1, sizeof *r);
    if (r == NULL) return NULL;
    r->seq = seq;
    r->world = c->world;
    r->total = total;
    r->k = total / c->world;
    r->window = c->slots;
    r->code = code;
    r->group = group;
    r->itemsize = oc_dtype_size(code);
    r->highest = -1;
    r->words = (c->world + 63) / 64;
    r->passed = malloc(sizeof(int64_t) * c->world);
    r->slots = calloc(r->window, sizeof(slot_t));
    r->have = calloc((size_t)r->window * r->words, sizeof(uint64_t));
    if (r->passed == NULL || r->slots == NULL || r->have == NULL) {
        free_reduction(a, r);
        return NULL;
    }
    for (uint32_t i = 0; i < c->world; i++) r->passed[i] = -1;
    return r;
}

/* The pool, wide enough for rows of `bytes`: made as wide as the first contribution, made wider
 * (its rows kept) if a wider one comes (ranks send their widest chunks first: rare). */
static int widen_pool(oc_agg *a, reduction_t *r, size_t bytes) {
    if (r->pool && r->row_bytes >= bytes) return 0;
    size_t rows = (size_t)r->window * r->world, need = rows * bytes > 0 ? rows * bytes : 1;
    uint8_t *wider;
    size_t cap = need;
    if (r->pool == NULL && a->spare_cap >= need) {
        wider = a->spare;
        cap = a->spare_cap;
        a->spare = NULL;
        a->spare_cap = 0;
        a->stats[OC_STAT_pools_reused]++;
    } else if ((wider = malloc(need)) == NULL) {
        return -1;
    }
    if (r->pool)
        for (size_t i = 0; i < rows; i++) memcpy(wider + i * bytes, r->pool + i * r->row_bytes, r->row_bytes);
    free_pool(a, r);
    r->pool = wider;
    r->pool_cap = cap;
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
    reduction_t *r = find_reduction(c, seq);
    int i;
    if (r) credit(a, h, rank, seq, r->released, again, n);
    else if ((i = finished_index(c, seq)) >= 0) credit(a, h, rank, seq, c->finished_total[i], NULL, 0);
}

/* Take `r` out of its communicator, remembering it as finished: contributions that come for it
 * later are answered with credit, not taken as a new reduction. Frees it. */
static void retire(oc_agg *a, comm_t *c, reduction_t *r) {
    int i = 0;
    while (c->reductions[i] != r) i++;
    memmove(&c->reductions[i], &c->reductions[i + 1], sizeof(r) * (size_t)(c->nreductions - i - 1));
    c->nreductions--;
    if ((i = finished_index(c, r->seq)) >= 0) {
        c->finished_total[i] = r->total;
    } else {
        if (c->nfinished == OC_TOMBSTONES) {
            memmove(c->finished_seq, c->finished_seq + 1, sizeof(uint32_t) * (OC_TOMBSTONES - 1));
            memmove(c->finished_total, c->finished_total + 1, sizeof(uint32_t) * (OC_TOMBSTONES - 1));
            c->nfinished--;
        }
        c->finished_seq[c->nfinished] = r->seq;
        c->finished_total[c->nfinished++] = r->total;
    }
    free_reduction(a, r);
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

static double resend_timeout(const peer_t *p) {
    if (!p->has_rtt) return OC_RESEND_SECONDS;
    double t = p->srtt + 4 * p->rttvar;
    return t < OC_RESEND_SECONDS ? OC_RESEND_SECONDS : t > OC_MAX_RESEND_SECONDS ? OC_MAX_RESEND_SECONDS : t;
}

/* -- contributions ------------------------------------------------------------------------- */

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
    uint32_t world = (uint32_t)prefix[2] | (uint32_t)prefix[3] << 8, total = get32(prefix + 4);
    size_t nbytes = length - PREFIX_BYTES;
    if (nbytes > c->max_row) {
        a->drops[OC_DROP_wrong_length] += count;
        return;
    }
    reduction_t *r = find_reduction(c, hdr->seq);
    if (r == NULL) {
        if (finished_index(c, hdr->seq) >= 0) {
            answer_credit(a, h, c, hdr->seq, hdr->src, NULL, 0);
            return;
        }
        if (oc_dtype_size(code) == 0) {
            a->drops[OC_DROP_malformed] += count;
            return;
        }
        if (world != c->world || total == 0 || total % world || !group ||
            nbytes % oc_dtype_size(code)) {
            a->drops[OC_DROP_inconsistent] += count;
            return;
        }
        /* a reduction is made only for a chunk it could take: in range, in the first window */
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
        if ((r = new_reduction(a, c, hdr->seq, code, group, total)) == NULL) {
            out_of_memory(a, count);
            return;
        }
        r->touched = now;
        c->reductions[c->nreductions++] = r;
    }
    if (world != r->world || total != r->total || code != r->code || group != r->group ||
        nbytes % r->itemsize) {
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
        if (!(first <= g && g < end)) owner = owner_span(r, g, &first, &end);
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
            if (widen_pool(a, r, nbytes)) {
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
        if (s->count == r->world - 1) complete[ncomplete++] = (completion){g, payload};
        else memcpy(row_of(r, g, src), payload, nbytes);
    }
    if (pooled) r->touched = now; /* a chunk passed every check: the reduction is alive */
    if (late) answer_credit(a, h, c, hdr->seq, (uint16_t)src, NULL, 0);
    for (size_t i = 0; i < ncomplete; i++) {
        slot_t *s = &r->slots[complete[i].g % r->window];
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
    reduction_t *r = find_reduction(c, hdr->seq);
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
        uint32_t sent = on_ack(a, h, c, r, hdr->src, get32(p + i), now, &gone);
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
        if (s && ((have_of(r, (uint32_t)g)[rank >> 6] >> (rank & 63) & 1) || s->state == SUMMED))
            continue;
        out[n++] = (uint32_t)g;
    }
    return n;
}

/* A rank's credit has stalled: say what it still owes. A reduction neither in flight nor
 * finished was refused: the rank sends its first window again, taken once there is room. */
static void on_credit_probe(oc_agg *a, int h, comm_t *c, const oc_header *hdr, uint32_t sent_below) {
    reduction_t *r = find_reduction(c, hdr->seq);
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
    } else if (hdr->dst != OC_AGGREGATOR) {
        a->drops[OC_DROP_misdirected] += count;
    } else if (hdr->src >= c->world) {
        a->drops[OC_DROP_wrong_sender] += count;
    } else if (hdr->kind == OC_CONTRIB) {
        on_contributions(a, h, c, hdr, chunks, count, data, offset, stride, now);
    } else if (hdr->kind == OC_RESULT_ACK || hdr->kind == OC_CREDIT) {
        for (size_t i = 0; i < count; i++) {
            const uint8_t *p = data + offset + i * stride;
            if (hdr->kind == OC_RESULT_ACK) {
                if (hdr->length % 4) a->drops[OC_DROP_malformed]++;
                else on_acks(a, h, c, hdr, p, hdr->length, now);
            } else {
                if (hdr->length != 4) a->drops[OC_DROP_malformed]++;
                else on_credit_probe(a, h, c, hdr, get32(p));
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
        if (rank != owner && !(have && (have[rank >> 6] >> (rank & 63) & 1)) &&
            r->passed[rank] > (int64_t)g)
            nack(a, rank, g);
}

static int by_pair(const void *x, const void *y) {
    uint64_t p = *(const uint64_t *)x, q = *(const uint64_t *)y;
    return p < q ? -1 : p > q;
}

void oc_agg_handle_timer(oc_agg *a, double now) {
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
                    double wait = resend_timeout(&c->peers[s->owner]) * (double)(1u << shift);
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

/* -- datagrams ----------------------------------------------------------------------------- */

static int find_comm(oc_agg *a, uint32_t job, uint32_t comm) {
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
    comm_t *c = comm_of(a, *handle = find_comm(a, h->job, h->comm));
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

/* -- registration -------------------------------------------------------------------------- */

static void free_comm(oc_agg *a, comm_t *c) {
    for (int i = 0; i < c->nreductions; i++) free_reduction(a, c->reductions[i]);
    if (c->keyed) {
        oc_gmac_free(&c->sealer.gmac);
        oc_gmac_free(&c->opener);
    }
    if (c->peers)
        for (uint32_t r = 0; r < c->world; r++) oc_replay_free(&c->peers[r].window);
    free(c->peers);
    free(c);
}

int oc_agg_register(oc_agg *a, uint32_t job, uint32_t comm, uint32_t world, uint32_t slots,
                    uint32_t max_row, const uint8_t *key, uint64_t counter, uint32_t *granted) {
    int h = find_comm(a, job, comm);
    comm_t *c = comm_of(a, h);
    if (c && c->world == world) {
        *granted = c->slots;
        return h;
    }
    if (world == 0 || world > 0xFFFD) return -1;
    comm_t *fresh = calloc(1, sizeof *fresh);
    if (fresh == NULL) return -1;
    fresh->job = job;
    fresh->comm = comm;
    fresh->world = world;
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
        fresh->sealer.src = OC_AGGREGATOR;
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
    for (h = 0; h < a->ncomms && a->comms[h] == NULL; h++) {}
    if (h == a->ncomms) {
        free(a->spare);
        a->spare = NULL;
        a->spare_cap = 0;
    }
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

/* -- sealing ------------------------------------------------------------------------------- */

size_t oc_agg_seal(oc_agg *a, int h, uint8_t kind, uint32_t seq, uint16_t dst, uint32_t chunk,
                   const uint8_t *payload, size_t len, uint8_t *out, size_t cap) {
    comm_t *c = comm_of(a, h);
    if (c == NULL || !c->keyed) return 0;
    return oc_seal_into(&c->sealer, out, cap, kind, seq, dst, chunk, payload, len);
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
    free(a->spare);
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
const oc_out *oc_agg_outbox(const oc_agg *a, size_t i) { return i < a->nout ? &a->out[i] : NULL; }
const uint8_t *oc_agg_payload(const oc_agg *a, const oc_out *o) {
    if (!o->in_pool) return a->arena + o->offset;
    comm_t *c = comm_of(a, o->handle);
    reduction_t *r = c ? find_reduction(c, o->seq) : NULL;
    slot_t *s = r ? slot_of(r, o->chunk) : NULL;
    /* a slot summed for this chunk is the one queued: its owner and length are the message's */
    if (s == NULL || s->state != SUMMED) return NULL;
    return row_of(r, o->chunk, s->owner);
}
void oc_agg_outbox_clear(oc_agg *a) {
    a->nout = 0;
    a->arena_len = 0;
}
const uint64_t *oc_agg_drops(const oc_agg *a) { return a->drops; }
uint64_t *oc_agg_drops_mut(oc_agg *a) { return a->drops; }
const uint64_t *oc_agg_stats(const oc_agg *a) { return a->stats; }
uint64_t oc_agg_pool_bytes(const oc_agg *a) { return a->pool_bytes; }
uint64_t oc_agg_peak_pool_bytes(const oc_agg *a) { return a->peak_pool_bytes; }
uint64_t oc_agg_kept_pool_bytes(const oc_agg *a) { return a->spare_cap; }
uint32_t oc_agg_slots(const oc_agg *a) { return a->slots; }

double oc_agg_resend_timeout(const oc_agg *a, int h, uint32_t owner) {
    const comm_t *c = comm_of(a, h);
    return c && owner < c->world ? resend_timeout(&c->peers[owner]) : -1.0;
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
