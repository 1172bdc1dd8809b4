/* The aggregator's reduction engine, sans I/O: what a switch that sums does, for many
 * communicators at once. Fed authentic messages or sealed datagrams and the clock; it leaves
 * what it wants sent in its outbox and says when to wake it. No socket, thread or clock here
 * (service.h serves its socket, shards.h runs its threads, common/clock.h reads the time), so
 * tests drive it on an in-memory fabric with a fake clock.
 *
 * Protocol (docs/protocols.md): a reduction may be striped over several endpoints (numbering.h);
 * each engine sees its own stripe's chunks, numbered g = 0, 1, ... Per reduction a window of
 * `slots` slots; chunk g may occupy slot
 * g mod window once every chunk below g - window is released. A slot keeps one row per rank and
 * a bitmap of contributors (each counted once). The owner's row (the owner contributes nothing)
 * becomes the result, the sum in rank order: the same bits whatever the arrival order. A
 * contribution that comes in rank order is added to it straight from its datagram, with every
 * one held for the ranks after it; one that comes early is copied into its sender's row until
 * its turn. 16-bit floats, which accumulate in float32, are kept in their rows and summed once
 * all P-1 are in (the last read from its datagram). The result goes to the owner;
 * its acknowledgement releases the slot; releases are announced to every rank as credit now and
 * then, and to an owner after every batch of results. Slots waiting on contributors ask them
 * again (NACK); unacknowledged results go again at once when their owner acknowledges one sent
 * after them (the path keeps order), else after the round trip's timeout (RFC 6298, measured
 * per owner), doubling per resend. Whatever does not fit is dropped and counted by reason, never raised.
 *
 * Memory and lifetime: the engine owns everything it points to. A reduction's pool (window x
 * world x widest row) is allocated with its first contribution and freed when the reduction
 * finishes, when its communicator is unregistered or registered again with another world, and
 * in oc_agg_free; the largest pool a communicator's reductions freed is kept for its next
 * reduction to take (not counted in the pool's bytes) until it is unregistered, and a new pool
 * takes it or frees it. So what a communicator makes the engine hold (its ranks' state, replay
 * windows made with each rank's first authentic datagram, reductions, pools and spare, and its
 * share of what the timer queues and of scratch) stays within oc_agg_comm_bytes, whatever its
 * ranks send, but for a fixed part per communicator (its keys' contexts); what datagrams make
 * it queue to send is held to OC_OUTBOX_BYTES in all, whoever sends them, and the outbox's
 * arrays are freed when sent if a burst made them larger. Payloads are copied into the engine
 * (rows, outbox), so the caller's buffers may be freed or reused as soon as a call returns; the
 * outbox holds its own copies until oc_agg_flush or oc_agg_outbox_clear, but for results, which
 * it names by slot and seals from the pool. A rank that dies mid-reduction leaves its slots
 * incomplete: they ask again (bounded by the window) until the reduction expires (no
 * contribution or acknowledgement for the expiry) or the communicator is unregistered (its last
 * connection closes), which frees them. A rank whose call was refused on another rank (that
 * rank never contributes) WITHDRAWs the reduction: once every rank that contributed has, it is
 * given up, its pool freed, and remembered as finished, so that contributions still on their way
 * do not start it again. Every allocation that fails is counted (out_of_memory)
 * and drops what needed it. The engine is not thread-safe: one thread at
 * a time, which in the service is the one running oc_serve. */
#ifndef OVERCAST_NATIVE_AGGREGATOR_H
#define OVERCAST_NATIVE_AGGREGATOR_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>

#include "common/wire.h"

/* Reductions of one communicator in flight at once; contributions for more wait for a retry. */
#define OC_MAX_REDUCTIONS 4
/* A result's resend timeout stays within these, whatever the round trip (seconds). */
#define OC_RESEND_SECONDS 0.05
#define OC_MAX_RESEND_SECONDS 1.0
#define OC_TOMBSTONES 64
/* A reduction with no contribution or acknowledgement for this long is given up (seconds). */
#define OC_EXPIRY_SECONDS 300.0
#define OC_REPLAY_WIDTH (1u << 14)
/* What the outbox may hold (its messages and the payloads copied for them) of what datagrams
 * made the engine queue: past it a message is dropped (outbox_full), as a lost datagram would
 * be, and asked for again. A CREDIT probe's answer names up to a window of chunks, so without
 * it a keyed member's probes would pile MiB of answers into the reads between two flushes. The
 * timer's messages are not held to it: they are within oc_agg_comm_bytes. */
#define OC_OUTBOX_BYTES (256u << 10)

/* Counters, by the names overcast's reports use. */
#define OC_DROPS(X) X(malformed) X(foreign) X(bad_mac) X(replayed) X(truncated)            \
    X(unregistered) X(misdirected) X(wrong_sender) X(unexpected_kind) X(stale)              \
    X(inconsistent) X(out_of_range) X(beyond_window) X(wrong_length) X(stray_acks)          \
    X(send_error) X(send_buffer_full) X(out_of_memory) X(outbox_full)
#define OC_STATS(X) X(contributions) X(results) X(results_resent) X(results_resent_early)    \
    X(nacks) X(refused) X(late_contributions) X(duplicate_contributions) X(reductions)        \
    X(pools_reused) X(expired) X(withdrawn) X(held)
#define OC_ENUM_DROP(name) OC_DROP_##name,
#define OC_ENUM_STAT(name) OC_STAT_##name,
enum { OC_DROPS(OC_ENUM_DROP) OC_DROP_COUNT };
enum { OC_STATS(OC_ENUM_STAT) OC_STAT_COUNT };
extern const char *const oc_drop_names[OC_DROP_COUNT];
extern const char *const oc_stat_names[OC_STAT_COUNT];

typedef struct oc_agg oc_agg;

/* A message waiting to be sent. Its payload (oc_agg_payload) lies in the engine's arena, or
 * for a result in its reduction's pool, read when it is sent: a result whose slot was released
 * in the meantime (its owner acknowledged an earlier copy) is not sent. */
typedef struct {
    int handle;           /* the communicator */
    uint16_t dst;         /* a rank, or OC_ANY for every rank */
    uint8_t kind;
    uint8_t in_pool;      /* the payload is the result in slot `chunk` of reduction `seq` */
    uint32_t seq, chunk;
    size_t offset, len;
} oc_out;

oc_agg *oc_agg_new(uint32_t slots);
/* How long a reduction may go without a contribution or acknowledgement before it is given up
 * (default OC_EXPIRY_SECONDS). */
void oc_agg_set_expiry(oc_agg *a, double seconds);
void oc_agg_free(oc_agg *a);

/* Take a communicator of `world` ranks (job, comm: its ids on the wire) as its endpoint
 * `stripe` (numbering.h: the chunks it reduces; it is addressed as and sends as
 * OC_AGGREGATOR - stripe), its reductions getting at most `slots` slots (0: the aggregator's
 * own) and contributions of at most `max_row` bytes (after their prefix): a reduction's pool is
 * at most slots x world x max_row bytes, and a communicator has at most OC_MAX_REDUCTIONS. With
 * `key`, it also opens and seals datagrams, its own counter starting after `counter`. Returns a
 * handle (>= 0) and the slots granted, or -1 for a world outside 1..OC_MAX_WORLD, a stripe of
 * OC_MAX_STRIPES or more, or if memory ran out. Registering the same ids again keeps the
 * communicator unless its world or stripe differs. */
int oc_agg_register(oc_agg *a, uint32_t job, uint32_t comm, uint32_t world, uint32_t stripe,
                    uint32_t slots, uint32_t max_row, const uint8_t *key, uint64_t counter,
                    uint32_t *granted);
void oc_agg_unregister(oc_agg *a, int handle);
/* The most bytes a communicator of `world` ranks, its reductions `slots` slots of rows of at
 * most `max_row` bytes, can make one engine hold, its keys' contexts aside: a bound, linear in
 * `slots`, for a service to set aside when it registers one. */
uint64_t oc_agg_comm_bytes(uint32_t world, uint32_t slots, uint32_t max_row);
/* The communicators registered. */
uint32_t oc_agg_communicators(const oc_agg *a);
/* Where a rank's datagrams go (network byte order), and whether it hears the communicator's
 * multicast group; messages for every rank go to the group once all ranks hear it. */
int oc_agg_set_address(oc_agg *a, int handle, uint32_t rank, uint32_t ip, uint16_t port,
                       int hears_group);
int oc_agg_set_group(oc_agg *a, int handle, uint32_t ip, uint16_t port);
/* Call `to` with each address a message to `dst` goes to: the rank's, or for OC_ANY the
 * group's if every rank hears it, else every rank's that has one. */
typedef void (*oc_to)(void *ctx, const struct sockaddr_in *address);
void oc_agg_each_destination(const oc_agg *a, int handle, uint16_t dst, oc_to to, void *ctx);

/* Authentic messages from one sender (a run, overcast.wire.runs): same header but for the
 * chunk, `count` payloads of `length` bytes at data + offset + i * stride. handle -1: a
 * communicator not registered here. */
void oc_agg_receive_run(oc_agg *a, int handle, const oc_header *first, const uint32_t *chunks,
                        size_t count, const uint8_t *data, size_t offset, size_t stride,
                        double now);
/* Sealed datagrams as one read brings them: `n` bytes, every datagram `segment` bytes but the
 * last. Each is checked (shape, communicator, tag, replay window) and the authentic ones go on
 * in runs. */
void oc_agg_feed(oc_agg *a, const uint8_t *data, size_t n, size_t segment, double now);

/* When to call oc_agg_handle_timer next (a time on the caller's clock), or < 0 for never. */
double oc_agg_timer(const oc_agg *a);
void oc_agg_handle_timer(oc_agg *a, double now);

size_t oc_agg_outbox_count(const oc_agg *a);
/* What the outbox holds: its messages and the payloads copied for them (bytes). */
size_t oc_agg_outbox_bytes(const oc_agg *a);
const oc_out *oc_agg_outbox(const oc_agg *a, size_t i);
/* A message's payload, valid until the next call that changes the engine; NULL for a result
 * that is no longer to be sent. */
const uint8_t *oc_agg_payload(const oc_agg *a, const oc_out *o);
void oc_agg_outbox_clear(oc_agg *a);

/* Seal the outbox, per destination in order, into batches of equal-sized datagrams (one GSO
 * send each; the last may be shorter) and hand each to `emit`; messages of unkeyed
 * communicators are dropped. The batch is valid during the call only. Empties the outbox, and
 * frees its arrays if a timer's burst made them larger than OC_OUTBOX_BYTES needs. */
typedef void (*oc_emit)(void *ctx, int handle, uint16_t dst, const uint8_t *data, size_t len,
                        size_t segment);
void oc_agg_flush(oc_agg *a, oc_emit emit, void *ctx);

const uint64_t *oc_agg_drops(const oc_agg *a);
uint64_t *oc_agg_drops_mut(oc_agg *a);
const uint64_t *oc_agg_stats(const oc_agg *a);
uint64_t oc_agg_pool_bytes(const oc_agg *a);
uint64_t oc_agg_peak_pool_bytes(const oc_agg *a);
uint64_t oc_agg_kept_pool_bytes(const oc_agg *a); /* the communicators' spare pools */
uint32_t oc_agg_slots(const oc_agg *a);
/* How long a result to `owner` now waits for its acknowledgement before it is sent again
 * (seconds; -1 for no such communicator or rank), and a communicator's reductions in flight:
 * up to `max` of (seq, chunks released); their count, or -1 for no such handle. */
double oc_agg_resend_timeout(const oc_agg *a, int handle, uint32_t owner);
int oc_agg_reductions(const oc_agg *a, int handle, uint32_t *seqs, uint32_t *released,
                      int max);

#endif
