/* A rank's datagram plane, sans I/O: everything a rank does per datagram, for one communicator.
 * It opens what a read brings (injected loss first, then shape, communicator, sender, tag and
 * the sender's replay window), runs the in-network reductions (contribute.h) and multicast
 * gathers (gather.h) posted to it on the messages meant for them, and hands every other
 * authentic message to Python in runs
 * (overcast.wire.runs), which stay valid until the next read. It keeps what it wants sent in
 * its outbox (outbox.h) and says when to wake it. No socket, thread or clock here: port.h runs
 * it on the rank's sockets; tests drive it on the in-memory fabric with a fake clock, giving it
 * authentic messages (oc_plane_receive_run) and taking its outbox unsealed.
 *
 * What does not fit is dropped and counted by reason, never raised: a datagram proves only
 * that some rank of the job sent it once, to someone.
 *
 * Ownership and lifetime: the plane owns its windows, collectives, outbox and run lists. The
 * sealer is borrowed (its owner outlives the plane); so are a reduction's input, output and
 * budget, and a gather's buffer and budget, until oc_plane_release (which also drops their
 * queued messages). Runs point into the data given to the last oc_plane_feed. Not
 * thread-safe: one thread at a time. */
#ifndef OVERCAST_NATIVE_PLANE_H
#define OVERCAST_NATIVE_PLANE_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>

#include "contribute.h"
#include "gather.h"
#include "outbox.h"
#include "trace.h"
#include "common/wire.h"

#define OC_PLANE_REPLAY_WIDTH (1u << 14)

/* Counters, by the names overcast's reports use. */
#define OC_PLANE_DROPS(X) X(malformed) X(foreign) X(bad_mac) X(replayed) X(truncated)       \
    X(wrong_sender) X(misdirected) X(out_of_range) X(wrong_length) X(send_error) X(unsealable) \
    X(send_buffer_full)
#define OC_PLANE_STATS(X) X(injected_losses) X(datagram_sends) X(datagram_bytes_out)
#define OC_PLANE_ENUM_DROP(name) OC_PLANE_DROP_##name,
#define OC_PLANE_ENUM_STAT(name) OC_PLANE_STAT_##name,
enum { OC_PLANE_DROPS(OC_PLANE_ENUM_DROP) OC_PLANE_DROP_COUNT };
enum { OC_PLANE_STATS(OC_PLANE_ENUM_STAT) OC_PLANE_STAT_COUNT };
extern const char *const oc_plane_drop_names[OC_PLANE_DROP_COUNT];
extern const char *const oc_plane_stat_names[OC_PLANE_STAT_COUNT];

/* Authentic messages for Python: `count` chunks from chunks[first], payloads of hdr.length bytes
 * at offset + i * stride in the data of the last feed. */
typedef struct {
    oc_header hdr;
    size_t first, count, offset, stride;
} oc_run;

typedef struct oc_plane oc_plane;

/* The plane of rank `rank` of `world`; with `key` it opens datagrams, with `sealer` it seals its
 * outbox (both may be NULL on the in-memory fabric). */
oc_plane *oc_plane_new(uint16_t rank, uint32_t world, uint32_t job, uint32_t comm,
                       const uint8_t *key, oc_sealer *sealer);
void oc_plane_free(oc_plane *p);
/* Injected loss of received datagrams: a Gilbert-Elliott channel with mean loss `rate` and
 * mean burst `burst`, seeded. */
void oc_plane_set_loss(oc_plane *p, double rate, double burst, uint64_t seed);
/* The aggregator endpoints its in-network reductions are striped over (numbering.h), 1 to
 * OC_MAX_STRIPES (1 at first); endpoint e is addressed as and sends as OC_AGGREGATOR - e.
 * 0, or -1 for a count outside that, with a reduction posted, or if memory ran out. */
int oc_plane_set_stripes(oc_plane *p, uint32_t stripes);
/* The endpoints reductions posted from now on are striped over, in order (`n` of them, each
 * below the stripes set, none twice): those left when an aggregator was lost. Every endpoint
 * until set, and again after oc_plane_set_stripes. 0, or -1 for a list that does not fit. */
int oc_plane_set_lanes(oc_plane *p, const uint16_t *endpoints, uint32_t n);
/* Where a route's datagrams go (network byte order; rank for OC_ROUTE_RANK, the endpoint for
 * OC_ROUTE_AGGREGATOR). */
int oc_plane_set_address(oc_plane *p, uint8_t route, uint32_t rank, uint32_t ip, uint16_t port);
const struct sockaddr_in *oc_plane_address(const oc_plane *p, uint8_t route, uint16_t dst);

/* Sealed datagrams as one read brings them: `n` bytes, each `segment` bytes but the last. */
void oc_plane_feed(oc_plane *p, const uint8_t *data, size_t n, size_t segment, double now);
/* Authentic messages from one sender (a run): 1 if a collective here took it (fitting or not),
 * 0 if it is not one of the plane's (Python's to handle). */
int oc_plane_receive_run(oc_plane *p, const oc_header *first, const uint32_t *chunks,
                         size_t count, const uint8_t *data, size_t offset, size_t stride,
                         double now);
size_t oc_plane_runs(const oc_plane *p, const oc_run **runs, const uint32_t **chunks);
void oc_plane_clear_runs(oc_plane *p);

/* Post an in-network reduction (see contribute.h): 0, or -1 for a shape it cannot take, a
 * sequence number already posted, or no memory. */
int oc_plane_reduce(oc_plane *p, uint32_t seq, unsigned dtype, int avg, uint64_t count,
                    const uint8_t *input, uint8_t *output, size_t chunk_bytes, uint32_t slots,
                    uint32_t group, oc_budget *budget, double now);
/* The reduction of `seq`, or NULL. */
const oc_reducer *oc_plane_reducer(const oc_plane *p, uint32_t seq);
/* Drained: every result in and every chunk released, and nothing of it left to send. */
int oc_plane_drained(const oc_plane *p, uint32_t seq);
/* Post a multicast gather (see gather.h): 0, or -1 for a shape it cannot take, a sequence
 * number already posted, or no memory. */
int oc_plane_gather(oc_plane *p, uint32_t seq, uint8_t *buffer, uint32_t nseg,
                    const uint32_t *roots, const uint64_t *offsets, uint64_t segment_bytes,
                    uint32_t chunk_bytes, int mine, uint32_t concurrent, oc_budget *budget);
/* The gather of `seq`, or NULL. */
oc_gather *oc_plane_gatherer(oc_plane *p, uint32_t seq);
/* Up to `max` collectives with news since last asked: a reduction drained (told once), a
 * gather with ranges to request, its own multicast all sent, or every chunk in place. */
size_t oc_plane_news(oc_plane *p, uint32_t *seqs, size_t max);
/* Whether oc_plane_news has anything to tell. */
int oc_plane_has_news(const oc_plane *p);
/* Let the collective go (done or failed): its messages still queued are dropped. A reduction
 * let go takes nothing more (results and credit for it are Python's to drop) and acknowledges
 * nothing more: a rank freezes a reduction this way when an aggregator is lost. */
void oc_plane_release(oc_plane *p, uint32_t seq);
/* When the last authentic datagram from aggregator endpoint `endpoint` came (the `now` of the
 * feed or run that brought it), or -1: never, or an endpoint past OC_MAX_STRIPES. A rank judges
 * an aggregator silent by it. */
double oc_plane_heard(const oc_plane *p, uint32_t endpoint);

double oc_plane_timer(const oc_plane *p);
void oc_plane_handle_timer(oc_plane *p, double now);

uint32_t oc_plane_world(const oc_plane *p);
oc_outbox *oc_plane_outbox(oc_plane *p);
/* The link bytes of the plane's own datagrams in (counted as they are fed) and out (counted by
 * whoever sends its outbox, port.h), per collective: off until its bin width is set. */
oc_trace *oc_plane_trace(oc_plane *p);
const uint64_t *oc_plane_drops(const oc_plane *p);
uint64_t *oc_plane_drops_mut(oc_plane *p);
uint64_t *oc_plane_stats(oc_plane *p);
size_t oc_plane_bytes(const oc_plane *p);
oc_sealer *oc_plane_sealer(oc_plane *p);

#endif
