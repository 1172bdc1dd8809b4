/* The per-datagram part of a rank's reliable multicast (overcast.protocols.multicast describes
 * the protocol; docs/protocols.md the messages), sans I/O: this rank's own segment multicast in
 * chunks of one datagram, paced at its stream's rate from the link budget, batches released
 * together; chunks from the other roots written straight to their place in the buffer and
 * marked in a per-chunk state; gaps noticed (a chunk well past a skipped one, from the same
 * root) and marked requested. The rest stays in Python and its streams: repair requests and
 * the repairs (written in place through oc_gather_store), activation, end-of-multicast notices
 * and the FIN round. The gather tells its owner, through the plane, when there is news: ranges
 * to ask the successor for, its own multicast all sent, every chunk in place.
 *
 * Ownership: the buffer (every segment, in place) and the budget are the caller's and must
 * outlive the gather and every message it queued (the outbox borrows the own segment's chunks).
 * The gather owns its state, gaps and requests (oc_gather_free). */
#ifndef OVERCAST_NATIVE_GATHER_H
#define OVERCAST_NATIVE_GATHER_H

#include <stddef.h>
#include <stdint.h>

#include "budget.h"
#include "outbox.h"

enum { OC_CHUNK_MISSING = 0, OC_CHUNK_REQUESTED = 1, OC_CHUNK_HAVE = 2 };
/* A gap this many chunks behind the newest chunk seen from its root is taken as lost. */
#define OC_REORDER_SLACK 4
/* The fewest datagrams a paced stream releases at once. */
#define OC_STREAM_BATCH 4
/* Gaps a segment keeps waiting at once; one more and the oldest is taken as lost. */
#define OC_GAPS 16
/* After a stall, a sender catches up by at most this much time's worth of datagrams at once. */
#define OC_MAX_BURST_SECONDS 0.005

typedef struct {
    uint32_t first, count; /* chunks first .. first + count - 1, numbered across segments */
} oc_range;

typedef struct {
    /* seq first: the plane looks collectives up by it (plane.c) */
    uint32_t seq, world, nseg, k, chunk_bytes;
    uint8_t *buffer;
    uint64_t segment_bytes;
    uint32_t *roots;           /* segment -> its root */
    uint64_t *offsets;         /* segment -> its byte offset in the buffer */
    int mine;                  /* this rank's segment, or -1 */
    uint32_t concurrent;       /* streams a receiver takes in at once */
    oc_budget *budget;
    uint8_t *state;            /* nseg * k */
    uint32_t *missing;         /* per segment */
    int64_t *newest;           /* per segment: the highest chunk seen (-1: none) */
    oc_range *gaps;            /* skipped ranges, not yet lost: a ring per segment */
    size_t *gap_head, *gap_n, gap_cap;
    oc_range *requests;        /* ranges marked requested, for the owner to ask for */
    size_t nrequests, requests_cap;
    int sending, sent_all, told_sent, told_complete, news;
    int pacing;                /* counted in the budget's gathers in flight */
    uint32_t next_chunk;
    double next_send;
    uint64_t progress;
    double progress_at;
    uint64_t multicast_chunks, duplicate_chunks, repaired_chunks;
} oc_gather;

/* segments: nseg (root, byte offset) pairs of segment_bytes each; `mine` this rank's segment
 * (already in place in the buffer) or -1; `concurrent` 1..world. 0, or -1 (nothing to free) for
 * a shape it cannot take or no memory. */
int oc_gather_init(oc_gather *g, uint32_t seq, uint32_t world, uint8_t *buffer, uint32_t nseg,
                   const uint32_t *roots, const uint64_t *offsets, uint64_t segment_bytes,
                   uint32_t chunk_bytes, int mine, uint32_t concurrent, oc_budget *budget);
void oc_gather_free(oc_gather *g);
/* Every root has ended its multicast (this rank's own all sent, the others' end-of-multicast
 * notices in): the gather sends nothing more into the receivers' links, so it stops dividing
 * the other gathers' pace. Each rank comes to it within a notice's latency of the others, and
 * only once the streams have stopped, so no receiver is asked for more than its link. 1, or 0
 * (and nothing done) while this rank's own segment is not all sent. */
int oc_gather_streams_ended(oc_gather *g);
/* Start multicasting this rank's segment (at once for a chain's head, else on activation). */
void oc_gather_activate(oc_gather *g, oc_outbox *o, double now);
/* A run of multicast chunks from `src`: OC_FIT, or why the first that did not fit did not. */
int oc_gather_chunks(oc_gather *g, uint16_t src, const uint32_t *chunks, size_t count,
                     const uint8_t *data, size_t offset, size_t stride, size_t length, double now);
/* A repair of chunks first .. (payload `len` bytes, whole chunks of one segment): OC_FIT with
 * *fresh the chunks it put in place, or why it does not fit. */
int oc_gather_store(oc_gather *g, uint32_t first, const uint8_t *payload, size_t len,
                    double now, uint32_t *fresh);
/* Whether chunks first .. first + count - 1 (one segment) are all here; -1 if not a range. */
int oc_gather_have(const oc_gather *g, uint32_t first, uint32_t count);
/* Mark the chunks of segment s in [lo, hi) still missing as requested, adding their ranges to
 * the requests: 0, or -1 if the request list could not grow (the rest stay missing, for the
 * caller to ask again). */
int oc_gather_request(oc_gather *g, uint32_t s, uint32_t lo, uint32_t hi);
int oc_gather_complete(const oc_gather *g);
double oc_gather_timer(const oc_gather *g);
void oc_gather_handle_timer(oc_gather *g, oc_outbox *o, double now);
size_t oc_gather_bytes(const oc_gather *g);

#endif
