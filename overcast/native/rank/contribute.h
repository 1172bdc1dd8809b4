/* The rank's side of in-network ReduceScatter, sans I/O (overcast.protocols.innetwork names the
 * protocol; docs/protocols.md describes it). The input's P blocks are cut into k chunks of one
 * datagram each, numbered as numbering.h says. The rank contributes every chunk not of its own
 * block, in increasing number, a batch at a time when the link budget holds the batch, never
 * more than `slots` chunks past the credit the aggregator has released; chunks the aggregator
 * asks for again go first. Each result (the sum of the other ranks' contributions to a chunk of
 * this rank's block) has the rank's own chunk added and lands in the output; results are
 * acknowledged with the next batch of contributions, after ACK_DELAY, or at once when ACK_BATCH
 * wait. A stalled credit is asked for. The reduction is drained when the whole block is in and
 * the credit says every chunk of every block is released.
 *
 * Ownership: `input` (world x count elements) and `output` (count elements) are the caller's and
 * must outlive the reducer and every message it queued (the outbox borrows the input's chunks
 * and the reducer's prefixes), and so must the budget. The reducer owns its bitmaps and queues (oc_reducer_free).
 *
 * Striped over `stripes` aggregator endpoints (numbering.h), it sends each chunk to its
 * endpoint in that endpoint's numbering, keeps each endpoint's credit, and is drained when
 * every endpoint has released all of its chunks; with one endpoint that is the whole. The
 * stripes are places: place e goes to registered endpoint endpoints[e] (e itself while every
 * aggregator serves; the endpoints left when one was lost), and its contributions say e. */
#ifndef OVERCAST_NATIVE_CONTRIBUTE_H
#define OVERCAST_NATIVE_CONTRIBUTE_H

#include <stddef.h>
#include <stdint.h>

#include "budget.h"
#include "outbox.h"

/* dtype u8, group u8, world u16, total u32, stripe u16, stripes u16 */
#define OC_CONTRIB_PREFIX_BYTES 12
#define OC_RETRY_SECONDS 0.05
#define OC_ACK_BATCH 64 /* acknowledgements a RESULT_ACK names at most, if its datagram holds */
#define OC_ACK_DELAY_SECONDS 0.005

enum { OC_REDUCER_SENDING, OC_REDUCER_RECEIVING, OC_REDUCER_DRAINED };


typedef struct {
    /* seq first: the plane looks collectives up by it (plane.c) */
    uint32_t seq, rank, world, k, total, group, slots, stripes;
    unsigned dtype;
    int avg;
    size_t itemsize;
    uint64_t count, chunk_elems;
    const uint8_t *input;
    uint8_t *output;
    oc_budget *budget;         /* borrowed: this host's uplink */
    uint8_t *prefixes;         /* per stripe, OC_CONTRIB_PREFIX_BYTES each */
    uint16_t *endpoint;        /* per stripe (place): the registered endpoint it goes to */
    int phase, counted;
    int reported;              /* the plane has told its owner it drained */
    uint32_t *credit;          /* per stripe: the chunks it released, in its numbering */
    uint32_t *stripe_total;    /* per stripe: its chunks */
    uint32_t cursor, results;
    uint32_t *resend;          /* a ring of chunks to send again */
    size_t resend_head, resend_n;
    uint64_t *pending;         /* bit g: g is in `resend` */
    uint64_t *have;            /* bit c: chunk c of the block is in the output */
    uint32_t acks[OC_ACK_BATCH];
    size_t nacks, ack_batch;   /* ack_batch: as many as a contribution's datagram holds */
    double pump_at, probe_at, ack_at; /* < 0: not set */
    uint64_t progress;         /* steps toward the result: data sent once, results, credit */
    double progress_at;        /* when the last step was taken (< 0: none yet) */
    uint64_t results_in, duplicate_results, contributions_resent, credit_probes;
} oc_reducer;

/* 0, or -1 (nothing to free) for an impossible shape or no memory. `endpoints` (`stripes` of
 * them, each below OC_MAX_STRIPES; copied) or NULL: stripe e to endpoint e. */
int oc_reducer_init(oc_reducer *r, uint32_t seq, uint32_t rank, uint32_t world, unsigned dtype,
                    int avg, uint64_t count, const uint8_t *input, uint8_t *output,
                    size_t chunk_bytes, uint32_t slots, uint32_t group, uint32_t stripes,
                    const uint16_t *endpoints, oc_budget *budget);
/* The stripe (place) of registered endpoint `endpoint` in this reduction, or -1: none. */
int oc_reducer_place(const oc_reducer *r, uint32_t endpoint);
void oc_reducer_free(oc_reducer *r);
void oc_reducer_start(oc_reducer *r, oc_outbox *o, double now);
/* A run of results from endpoint `stripe`: `count` payloads of `length` bytes at data + offset
 * + i * stride with chunks[i] (the endpoint's numbering). OC_FIT, or why the first that did not
 * fit did not (those before it are taken). */
int oc_reducer_results(oc_reducer *r, oc_outbox *o, uint32_t stripe, const uint32_t *chunks,
                       size_t count, const uint8_t *data, size_t offset, size_t stride,
                       size_t length, double now);
/* A CREDIT from endpoint `stripe`. */
int oc_reducer_credit(oc_reducer *r, oc_outbox *o, uint32_t stripe, const uint8_t *payload,
                      size_t len, double now);
double oc_reducer_timer(const oc_reducer *r);
void oc_reducer_handle_timer(oc_reducer *r, oc_outbox *o, double now);
/* Called once the reduction is let go (done or failed): it no longer counts as in flight. */
void oc_reducer_finish(oc_reducer *r);
/* Bytes of bookkeeping the reducer owns. */
size_t oc_reducer_bytes(const oc_reducer *r);

#endif
