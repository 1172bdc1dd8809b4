/* The aggregator's state, shared by its two files: aggregator.c (the engine: reductions,
 * contributions, acknowledgements and credit, the clock, reading datagrams) and registry.c
 * (registration, sealing what it sends, creating and freeing it). Internal: the public contract
 * is aggregator.h, and so is the ownership: the engine owns everything here, freed in
 * oc_agg_free. */
#ifndef OC_AGG_STATE_H
#define OC_AGG_STATE_H

#include "aggregator.h"
#include "common/numbering.h"

#include <stdlib.h>
#include <string.h>

#include "common/bytes.h"
#include "common/grow.h"
#include "common/sums.h"
#include "common/udp.h"

#define NACK_SECONDS 0.02
#define MAX_BACKOFF 8
#define LONGEST_RESEND_WAIT (OC_RESEND_SECONDS * (1 << MAX_BACKOFF))
#define TICK_SECONDS 0.01
#define CREDIT_EVERY_DIVISOR 4 /* announce after a quarter of the window is released */
/* CONTRIB's: dtype u8, group u8, world u16, total u32 (chunks of every stripe), stripe u16,
 * stripes u16 */
#define PREFIX_BYTES 12


enum { EMPTY = 0, COLLECTING = 1, SUMMED = 2 };

typedef struct {
    uint32_t g, elems, count;  /* the chunk held, its elements, contributors in */
    uint32_t owner;
    uint32_t next;             /* folding reductions: the next rank the owner's row takes */
    uint8_t state, acked, hole;
    uint16_t resends;
    uint32_t sent;             /* the reduction's result sends when its last copy left */
    uint32_t hole_g;           /* a chunk with no slot yet, asked for at hole_asked */
    double first_seen, nacked, sent_at, hole_asked;
} slot_t;

/* A reduction as one endpoint (stripe) sees it: its own chunks, numbered 0 .. total - 1
 * (numbering.h); owners are found through the chunks' numbers in the whole reduction. */
typedef struct {
    double touched;               /* when a contribution or acknowledgement last came */
    uint32_t seq, world, total, k, window, released, announced, results_sent;
    uint32_t whole, stripes;      /* the chunks of every stripe, and how many stripes */
    uint32_t place;               /* this endpoint's place among the stripes, as the ranks'
                                   * contributions say: its registered stripe, or its place
                                   * among the endpoints left when others were lost */
    uint32_t lane;                /* the chunks of the whole that are its place's
                                   * (numbering.h): derived, kept for the hot path */
    uint8_t code, group;
    uint8_t folds;                /* sums in its own type: folded into the owner's row in rank
                                   * order as contributions come (16-bit floats, which
                                   * accumulate in float32, are summed once all are in) */
    size_t itemsize, row_bytes;   /* row_bytes: the pool's width per row */
    int64_t highest;              /* the highest chunk any contribution came for */
    int64_t *passed;              /* per rank: the highest chunk it sent */
    uint64_t *withdrawn;          /* words: the ranks that gave it up (WITHDRAW) */
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
    uint32_t stripe;              /* the endpoint it is: it sends as OC_AGGREGATOR - stripe */
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
    /* The largest pool one of its finished reductions left, for its next: a fresh pool of tens
     * of MiB comes from mmap, and faulting in and zeroing its pages took about a sixth of the
     * aggregator's CPU on loopback. Its own, so that its pools and its spare together stay
     * within OC_MAX_REDUCTIONS pools of its bound (oc_agg_comm_bytes): a new pool takes the
     * spare or frees it. */
    uint8_t *spare;
    size_t spare_cap;
} comm_t;

/* A chunk whose last contribution came in the run being read; a reduction that does not fold
 * sums that one from the datagram, not copied into the pool first. */
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
    size_t outbox_limit;          /* OC_OUTBOX_BYTES; lifted while the timer queues */
    uint64_t drops[OC_DROP_COUNT], stats[OC_STAT_COUNT];
    uint64_t pool_bytes, peak_pool_bytes;
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

/* Frees an array of *cap elements of `size` bytes if they pass `keep` bytes: what a burst made
 * it need is not held for good. */
static inline void trim(void **p, size_t *cap, size_t size, size_t keep) {
    if (*cap * size <= keep) return;
    free(*p);
    *p = NULL;
    *cap = 0;
}

/* An allocation failed: counted, and the caller drops what needed it. */
static inline void out_of_memory(oc_agg *a, uint64_t what) { a->drops[OC_DROP_out_of_memory] += what; }

static inline comm_t *comm_of(const oc_agg *a, int h) {
    return h >= 0 && h < a->ncomms ? a->comms[h] : NULL;
}

/* Local chunk h's number in the whole reduction. */
static inline uint32_t global_of(const reduction_t *r, uint32_t h) {
    return (uint32_t)oc_stripe_global(h, r->group, r->stripes, r->lane);
}

static inline uint32_t owner_of(const reduction_t *r, uint32_t h) {
    uint64_t c;
    return oc_chunk_place(global_of(r, h), r->world, r->k, r->group, &c);
}

/* The owner of the whole reduction's chunk g, and its chunks *first .. *end - 1 around g. */
static inline uint32_t owner_span(const reduction_t *r, uint32_t g, uint32_t *first, uint32_t *end) {
    return oc_owner_span(g, r->world, r->k, r->group, first, end);
}

static inline slot_t *slot_of(reduction_t *r, uint32_t g) {
    if (g < r->released || g - r->released >= r->window) return NULL;
    slot_t *s = &r->slots[g % r->window];
    return s->state != EMPTY && s->g == g ? s : NULL;
}

static inline uint64_t *have_of(reduction_t *r, uint32_t g) { return r->have + (size_t)(g % r->window) * r->words; }

/* Whether `rank` is among a slot's contributors (have_of). */
static inline int contributed(const uint64_t *have, uint32_t rank) {
    return (int)(have[rank >> 6] >> (rank & 63) & 1);
}

static inline uint8_t *row_of(reduction_t *r, uint32_t g, uint32_t rank) {
    return r->pool + ((size_t)(g % r->window) * r->world + rank) * r->row_bytes;
}

/* Shared by the two files (aggregator.c defines them). */
int agg_find_comm(oc_agg *a, uint32_t job, uint32_t comm);
reduction_t *agg_find_reduction(comm_t *c, uint32_t seq);
void agg_free_reduction(oc_agg *a, comm_t *c, reduction_t *r);
double agg_resend_timeout(const peer_t *p);

#endif
