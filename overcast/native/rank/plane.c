#include "plane.h"

#include <stdlib.h>
#include <string.h>

#include "common/grow.h"

#define NAME(name) #name,
const char *const oc_plane_drop_names[OC_PLANE_DROP_COUNT] = {OC_PLANE_DROPS(NAME)};
const char *const oc_plane_stat_names[OC_PLANE_STAT_COUNT] = {OC_PLANE_STATS(NAME)};

typedef struct {
    double enter, stay;
    uint64_t state;
    int bad, on;
} loss_t;

struct oc_plane {
    uint16_t rank;
    uint32_t world, job, comm;
    oc_gmac opener;
    int keyed;
    oc_sealer *sealer;
    oc_replay *windows;          /* world + stripes: the ranks', then the aggregator endpoints' */
    uint32_t stripes;            /* aggregator endpoints its reductions are striped over */
    double heard[OC_MAX_STRIPES]; /* when each endpoint was last heard; -1: never */
    uint16_t lanes[OC_MAX_STRIPES]; /* the endpoints new reductions are striped over */
    uint32_t nlanes;
    loss_t loss;
    struct sockaddr_in group, *ranks, *aggregators;
    oc_reducer **reducers;
    size_t nreducers, reducers_cap;
    oc_gather **gathers;
    size_t ngathers, gathers_cap;
    oc_outbox outbox;
    oc_trace trace;
    oc_run *runs;
    size_t nruns, runs_cap;
    uint32_t *chunks;
    size_t nchunks, chunks_cap;
    uint64_t drops[OC_PLANE_DROP_COUNT];
    uint64_t stats[OC_PLANE_STAT_COUNT];
};

oc_plane *oc_plane_new(uint16_t rank, uint32_t world, uint32_t job, uint32_t comm,
                       const uint8_t *key, oc_sealer *sealer) {
    if (world == 0 || world > OC_MAX_WORLD || rank >= world) return NULL;
    oc_plane *p = calloc(1, sizeof *p);
    if (p == NULL) return NULL;
    p->rank = rank;
    p->world = world;
    p->job = job;
    p->comm = comm;
    p->sealer = sealer;
    for (uint32_t e = 0; e < OC_MAX_STRIPES; e++) p->heard[e] = -1;
    p->windows = calloc(world + OC_MAX_STRIPES, sizeof(oc_replay));
    p->ranks = calloc(world, sizeof(struct sockaddr_in));
    p->aggregators = calloc(OC_MAX_STRIPES, sizeof(struct sockaddr_in));
    int failed = p->windows == NULL || p->ranks == NULL || p->aggregators == NULL;
    for (uint32_t i = 0; i < world && !failed; i++)
        failed = oc_replay_init(&p->windows[i], OC_PLANE_REPLAY_WIDTH) != 0;
    if (!failed) failed = oc_plane_set_stripes(p, 1) != 0;
    if (!failed && key) {
        failed = oc_gmac_init(&p->opener, key, 0) != 0;
        p->keyed = !failed;
    }
    if (failed) {
        oc_plane_free(p);
        return NULL;
    }
    return p;
}

void oc_plane_free(oc_plane *p) {
    if (p == NULL) return;
    if (p->keyed) oc_gmac_free(&p->opener);
    for (uint32_t i = 0; p->windows && i < p->world + OC_MAX_STRIPES; i++)
        oc_replay_free(&p->windows[i]);
    free(p->windows);
    free(p->ranks);
    free(p->aggregators);
    for (size_t i = 0; i < p->nreducers; i++) {
        oc_reducer_finish(p->reducers[i]);
        oc_reducer_free(p->reducers[i]);
        free(p->reducers[i]);
    }
    free(p->reducers);
    for (size_t i = 0; i < p->ngathers; i++) {
        oc_gather_free(p->gathers[i]);
        free(p->gathers[i]);
    }
    free(p->gathers);
    oc_outbox_free(&p->outbox);
    oc_trace_free(&p->trace);
    free(p->runs);
    free(p->chunks);
    free(p);
}

/* -- injected loss -------------------------------------------------------------------------- */

void oc_plane_set_loss(oc_plane *p, double rate, double burst, uint64_t seed) {
    loss_t *l = &p->loss;
    memset(l, 0, sizeof *l);
    if (rate <= 0) return;
    if (burst < 1) burst = 1;
    l->on = 1;
    l->enter = rate >= 1 ? 1.0 : rate / (burst * (1 - rate));
    l->stay = rate >= 1 ? 1.0 : 1 - 1 / burst;
    l->state = seed * 1000003u + p->rank;
}

/* splitmix64: a seeded stream of uniform doubles in [0, 1). */
static double uniform(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15u);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9u;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBu;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1p-53;
}

static int lost(loss_t *l) {
    if (!l->on) return 0;
    l->bad = uniform(&l->state) < (l->bad ? l->stay : l->enter);
    return l->bad;
}

/* -- addresses ------------------------------------------------------------------------------ */

int oc_plane_set_stripes(oc_plane *p, uint32_t stripes) {
    if (stripes == 0 || stripes > OC_MAX_STRIPES || p->nreducers) return -1;
    for (uint32_t e = 0; e < stripes; e++) /* a window is made once and kept */
        if (p->windows[p->world + e].nwords == 0 &&
            oc_replay_init(&p->windows[p->world + e], OC_PLANE_REPLAY_WIDTH))
            return -1;
    p->stripes = stripes;
    for (uint32_t e = 0; e < stripes; e++) p->lanes[e] = (uint16_t)e;
    p->nlanes = stripes;
    return 0;
}

int oc_plane_set_lanes(oc_plane *p, const uint16_t *endpoints, uint32_t n) {
    uint8_t seen[OC_MAX_STRIPES] = {0};
    if (n == 0 || n > p->stripes) return -1;
    for (uint32_t i = 0; i < n; i++) {
        if (endpoints[i] >= p->stripes || seen[endpoints[i]]) return -1;
        seen[endpoints[i]] = 1;
    }
    memcpy(p->lanes, endpoints, n * sizeof(uint16_t));
    p->nlanes = n;
    return 0;
}

int oc_plane_set_address(oc_plane *p, uint8_t route, uint32_t rank, uint32_t ip, uint16_t port) {
    struct sockaddr_in *a = route == OC_ROUTE_AGGREGATOR && rank < p->stripes ? &p->aggregators[rank]
                          : route == OC_ROUTE_GROUP ? &p->group
                          : route == OC_ROUTE_RANK && rank < p->world ? &p->ranks[rank] : NULL;
    if (a == NULL) return -1;
    memset(a, 0, sizeof *a);
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = ip;
    a->sin_port = port;
    return 0;
}

const struct sockaddr_in *oc_plane_address(const oc_plane *p, uint8_t route, uint16_t dst) {
    int e = route == OC_ROUTE_AGGREGATOR ? oc_endpoint_of(dst, p->stripes) : -1;
    const struct sockaddr_in *a = route == OC_ROUTE_AGGREGATOR ? (e < 0 ? NULL : &p->aggregators[e])
                                : route == OC_ROUTE_GROUP ? &p->group
                                : dst < p->world ? &p->ranks[dst] : NULL;
    return a && a->sin_family == AF_INET ? a : NULL;
}

/* -- reductions ----------------------------------------------------------------------------- */

/* The collective of `seq` among `n` of one kind; each kind's struct starts with its seq. */
static void *lookup(void *const *items, size_t n, uint32_t seq, size_t *index) {
    for (size_t i = 0; i < n; i++)
        if (*(const uint32_t *)items[i] == seq) {
            if (index) *index = i;
            return items[i];
        }
    return NULL;
}

static oc_reducer *find(const oc_plane *p, uint32_t seq, size_t *index) {
    return lookup((void *const *)p->reducers, p->nreducers, seq, index);
}

static oc_gather *find_gather(const oc_plane *p, uint32_t seq, size_t *index) {
    return lookup((void *const *)p->gathers, p->ngathers, seq, index);
}

int oc_plane_gather(oc_plane *p, uint32_t seq, uint8_t *buffer, uint32_t nseg,
                    const uint32_t *roots, const uint64_t *offsets, uint64_t segment_bytes,
                    uint32_t chunk_bytes, int mine, uint32_t concurrent, oc_budget *budget) {
    if (find(p, seq, NULL) || find_gather(p, seq, NULL) ||
        oc_grow((void **)&p->gathers, &p->gathers_cap, p->ngathers + 1, sizeof(oc_gather *)))
        return -1;
    oc_gather *g = malloc(sizeof *g);
    if (g == NULL) return -1;
    if (oc_gather_init(g, seq, p->world, buffer, nseg, roots, offsets, segment_bytes,
                       chunk_bytes, mine, concurrent, budget)) {
        free(g);
        return -1;
    }
    p->gathers[p->ngathers++] = g;
    return 0;
}

oc_gather *oc_plane_gatherer(oc_plane *p, uint32_t seq) { return find_gather(p, seq, NULL); }

int oc_plane_reduce(oc_plane *p, uint32_t seq, unsigned dtype, int avg, uint64_t count,
                    const uint8_t *input, uint8_t *output, size_t chunk_bytes, uint32_t slots,
                    uint32_t group, oc_budget *budget, double now) {
    if (find(p, seq, NULL) || find_gather(p, seq, NULL) ||
        oc_grow((void **)&p->reducers, &p->reducers_cap, p->nreducers + 1, sizeof(oc_reducer *)))
        return -1;
    oc_reducer *r = malloc(sizeof *r);
    if (r == NULL) return -1;
    if (oc_reducer_init(r, seq, p->rank, p->world, dtype, avg, count, input, output, chunk_bytes,
                        slots, group, p->nlanes, p->lanes, budget)) {
        free(r);
        return -1;
    }
    p->reducers[p->nreducers++] = r;
    oc_reducer_start(r, &p->outbox, now);
    return 0;
}

const oc_reducer *oc_plane_reducer(const oc_plane *p, uint32_t seq) { return find(p, seq, NULL); }

int oc_plane_drained(const oc_plane *p, uint32_t seq) {
    const oc_reducer *r = find(p, seq, NULL);
    if (r == NULL || r->phase != OC_REDUCER_DRAINED) return 0;
    for (size_t i = 0; i < p->outbox.n; i++)
        if (p->outbox.msgs[i].seq == seq) return 0;
    return 1;
}

int oc_plane_has_news(const oc_plane *p) {
    for (size_t i = 0; i < p->nreducers; i++)
        if (!p->reducers[i]->reported && oc_plane_drained(p, p->reducers[i]->seq)) return 1;
    for (size_t i = 0; i < p->ngathers; i++)
        if (p->gathers[i]->news) return 1;
    return 0;
}

size_t oc_plane_news(oc_plane *p, uint32_t *seqs, size_t max) {
    size_t n = 0;
    for (size_t i = 0; i < p->nreducers && n < max; i++) {
        oc_reducer *r = p->reducers[i];
        if (!r->reported && oc_plane_drained(p, r->seq)) {
            r->reported = 1;
            seqs[n++] = r->seq;
        }
    }
    for (size_t i = 0; i < p->ngathers && n < max; i++)
        if (p->gathers[i]->news) {
            p->gathers[i]->news = 0;
            seqs[n++] = p->gathers[i]->seq;
        }
    return n;
}

void oc_plane_release(oc_plane *p, uint32_t seq) {
    size_t i;
    oc_gather *g = find_gather(p, seq, &i);
    if (g) {
        oc_outbox_drop_seq(&p->outbox, seq);
        oc_gather_free(g);
        free(g);
        p->gathers[i] = p->gathers[--p->ngathers];
        return;
    }
    oc_reducer *r = find(p, seq, &i);
    if (r == NULL) return;
    oc_outbox_drop_seq(&p->outbox, seq);
    oc_reducer_finish(r);
    oc_reducer_free(r);
    free(r);
    p->reducers[i] = p->reducers[--p->nreducers];
}

double oc_plane_heard(const oc_plane *p, uint32_t endpoint) {
    return endpoint < OC_MAX_STRIPES ? p->heard[endpoint] : -1;
}

/* -- receiving ------------------------------------------------------------------------------ */

static void misfit(oc_plane *p, int why) {
    if (why == OC_MISFIT_OUT_OF_RANGE) p->drops[OC_PLANE_DROP_out_of_range]++;
    else if (why == OC_MISFIT_WRONG_LENGTH) p->drops[OC_PLANE_DROP_wrong_length]++;
    else if (why == OC_MISFIT_MALFORMED) p->drops[OC_PLANE_DROP_malformed]++;
    else if (why == OC_MISFIT_WRONG_SENDER) p->drops[OC_PLANE_DROP_wrong_sender]++;
}

int oc_plane_receive_run(oc_plane *p, const oc_header *first, const uint32_t *chunks,
                         size_t count, const uint8_t *data, size_t offset, size_t stride,
                         double now) {
    int from = oc_endpoint_of(first->src, p->stripes);
    if (from >= 0 && now > p->heard[from]) p->heard[from] = now;
    if (first->kind == OC_MCAST_DATA) {
        oc_gather *g = find_gather(p, first->seq, NULL);
        if (g == NULL) return 0;
        if (first->dst != p->rank && first->dst != OC_ANY)
            p->drops[OC_PLANE_DROP_misdirected]++;
        else
            misfit(p, oc_gather_chunks(g, first->src, chunks, count, data, offset, stride,
                                       first->length, now));
        return 1;
    }
    if (first->kind != OC_RESULT && first->kind != OC_CREDIT) return 0;
    oc_reducer *r = find(p, first->seq, NULL);
    if (r == NULL) return 0;
    int stripe = from < 0 ? -1 : oc_reducer_place(r, (uint32_t)from);
    if (stripe < 0) {
        p->drops[OC_PLANE_DROP_wrong_sender]++;
        return 1;
    }
    if (first->dst != p->rank && first->dst != OC_ANY) {
        p->drops[OC_PLANE_DROP_misdirected]++;
        return 1;
    }
    if (first->kind == OC_RESULT) {
        misfit(p, oc_reducer_results(r, &p->outbox, (uint32_t)stripe, chunks, count, data,
                                     offset, stride, first->length, now));
    } else {
        for (size_t i = 0; i < count; i++) {
            int why = oc_reducer_credit(r, &p->outbox, (uint32_t)stripe,
                                        data + offset + i * stride, first->length, now);
            if (why != OC_FIT) {
                misfit(p, why);
                break;
            }
        }
    }
    return 1;
}

size_t oc_plane_runs(const oc_plane *p, const oc_run **runs, const uint32_t **chunks) {
    *runs = p->runs;
    *chunks = p->chunks;
    return p->nruns;
}

void oc_plane_clear_runs(oc_plane *p) {
    p->nruns = 0;
    p->nchunks = 0;
}

/* One datagram's header if it is authentic and new, else count why not and return -1. */
static int open_one(oc_plane *p, const uint8_t *d, size_t len, oc_header *h) {
    if (len < OC_OVERHEAD_BYTES || oc_header_parse(d, len, h) ||
        (size_t)h->length + OC_OVERHEAD_BYTES != len) {
        p->drops[OC_PLANE_DROP_malformed]++;
        return -1;
    }
    if (h->job != p->job || h->comm != p->comm) {
        p->drops[OC_PLANE_DROP_foreign]++;
        return -1;
    }
    /* its own multicast, looped back: not news, and common enough to spare the tag check */
    if (h->src == p->rank) return -1;
    if (!p->keyed || !oc_gmac_check(&p->opener, h->src, h->counter, d, OC_HEADER_BYTES + h->length,
                                    d + OC_HEADER_BYTES + h->length)) {
        p->drops[OC_PLANE_DROP_bad_mac]++;
        return -1;
    }
    int stripe = oc_endpoint_of(h->src, p->stripes);
    uint32_t w = h->src < p->world ? h->src : p->world + (uint32_t)stripe;
    if (h->src >= p->world && stripe < 0) { /* authentic, but no rank or endpoint of its world */
        p->drops[OC_PLANE_DROP_wrong_sender]++;
        return -1;
    }
    if (!oc_replay_accept(&p->windows[w], h->counter)) {
        p->drops[OC_PLANE_DROP_replayed]++;
        return -1;
    }
    return 0;
}

static int same_run(const oc_header *a, const oc_header *b) {
    return a->kind == b->kind && a->seq == b->seq && a->src == b->src && a->dst == b->dst &&
           a->length == b->length;
}

void oc_plane_feed(oc_plane *p, const uint8_t *data, size_t n, size_t segment, double now) {
    oc_plane_clear_runs(p);
    if (segment == 0) segment = n;
    size_t open_run = (size_t)-1; /* the run a datagram may join; -1: none */
    uint32_t last = 0;
    for (size_t start = 0; start < n; start += segment) {
        size_t len = n - start < segment ? n - start : segment;
        oc_header h;
        if (lost(&p->loss)) {
            p->stats[OC_PLANE_STAT_injected_losses]++;
            open_run = (size_t)-1;
            continue;
        }
        if (open_one(p, data + start, len, &h)) {
            open_run = (size_t)-1;
            continue;
        }
        if (oc_grow((void **)&p->chunks, &p->chunks_cap, p->nchunks + 1, sizeof(uint32_t))) break;
        if (open_run != (size_t)-1 && same_run(&p->runs[open_run].hdr, &h) && h.chunk > last) {
            p->runs[open_run].count++;
        } else {
            if (oc_grow((void **)&p->runs, &p->runs_cap, p->nruns + 1, sizeof(oc_run))) break;
            open_run = p->nruns++;
            oc_run *r = &p->runs[open_run];
            r->hdr = h;
            r->first = p->nchunks;
            r->count = 1;
            r->offset = start + OC_HEADER_BYTES;
            r->stride = segment;
        }
        p->chunks[p->nchunks++] = h.chunk;
        last = h.chunk;
    }
    /* the plane's own runs are taken now; the rest stay for Python */
    size_t kept = 0;
    for (size_t i = 0; i < p->nruns; i++) {
        oc_run *r = &p->runs[i];
        if (!oc_plane_receive_run(p, &r->hdr, p->chunks + r->first, r->count, data, r->offset,
                                  r->stride, now))
            p->runs[kept++] = *r;
        else
            oc_trace_count(&p->trace, 0, r->hdr.seq, r->count, r->hdr.length, now);
    }
    p->nruns = kept;
}

/* -- timers and the rest -------------------------------------------------------------------- */

double oc_plane_timer(const oc_plane *p) {
    double t = -1;
    for (size_t i = 0; i < p->nreducers; i++) {
        double r = oc_reducer_timer(p->reducers[i]);
        if (r >= 0 && (t < 0 || r < t)) t = r;
    }
    for (size_t i = 0; i < p->ngathers; i++) {
        double g = oc_gather_timer(p->gathers[i]);
        if (g >= 0 && (t < 0 || g < t)) t = g;
    }
    return t;
}

void oc_plane_handle_timer(oc_plane *p, double now) {
    for (size_t i = 0; i < p->nreducers; i++) {
        double t = oc_reducer_timer(p->reducers[i]);
        if (t >= 0 && now >= t) oc_reducer_handle_timer(p->reducers[i], &p->outbox, now);
    }
    for (size_t i = 0; i < p->ngathers; i++) {
        double t = oc_gather_timer(p->gathers[i]);
        if (t >= 0 && now >= t) oc_gather_handle_timer(p->gathers[i], &p->outbox, now);
    }
}

uint32_t oc_plane_world(const oc_plane *p) { return p->world; }
oc_outbox *oc_plane_outbox(oc_plane *p) { return &p->outbox; }
oc_trace *oc_plane_trace(oc_plane *p) { return &p->trace; }
const uint64_t *oc_plane_drops(const oc_plane *p) { return p->drops; }
uint64_t *oc_plane_drops_mut(oc_plane *p) { return p->drops; }
uint64_t *oc_plane_stats(oc_plane *p) { return p->stats; }
oc_sealer *oc_plane_sealer(oc_plane *p) { return p->sealer; }

size_t oc_plane_bytes(const oc_plane *p) {
    size_t n = sizeof *p + (p->world + 1) * (sizeof(oc_replay) + 8 * p->windows[0].nwords) +
               p->outbox.cap * sizeof(oc_msg) + p->outbox.arena_cap + p->runs_cap * sizeof(oc_run) +
               p->chunks_cap * 4;
    for (size_t i = 0; i < p->nreducers; i++) n += oc_reducer_bytes(p->reducers[i]);
    for (size_t i = 0; i < p->ngathers; i++) n += oc_gather_bytes(p->gathers[i]);
    return n;
}
