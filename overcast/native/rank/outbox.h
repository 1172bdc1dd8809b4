/* What a rank's datagram plane wants sent, in order, until it is sealed: each message names its
 * route and header and carries up to two payload parts, each either borrowed (a pointer into a
 * buffer that outlives the message: a reduction's input, its prefix) or copied into the outbox's
 * own arena (acknowledgements, credit probes). Sealing lays the messages of one route back to
 * back in batches of equal-sized datagrams, one GSO send each.
 *
 * Ownership: the outbox owns its message array and arena; borrowed parts must stay valid until
 * the message is sealed or dropped (oc_outbox_drop_seq drops a finished collective's). */
#ifndef OVERCAST_NATIVE_OUTBOX_H
#define OVERCAST_NATIVE_OUTBOX_H

#include <stddef.h>
#include <stdint.h>

#include "common/wire.h"

/* Where a message goes: the aggregator, the communicator's multicast group, or one rank. */
enum { OC_ROUTE_AGGREGATOR = 0, OC_ROUTE_GROUP = 1, OC_ROUTE_RANK = 2 };

typedef struct {
    uint8_t kind, route;
    uint16_t dst;            /* the header's destination (a rank, OC_AGGREGATOR or OC_ANY) */
    uint32_t seq, chunk;
    const uint8_t *head;     /* borrowed, may be NULL */
    size_t head_len;
    const uint8_t *body;     /* borrowed; NULL: body_len bytes of the arena at `offset` */
    size_t body_len, offset;
} oc_msg;

typedef struct {
    oc_msg *msgs;
    size_t n, cap;
    uint8_t *arena;
    size_t arena_len, arena_cap;
} oc_outbox;

void oc_outbox_free(oc_outbox *o);
/* Queue a message whose parts are borrowed: 0, or -1 if memory ran out. */
int oc_outbox_add(oc_outbox *o, uint8_t route, uint16_t dst, uint8_t kind, uint32_t seq,
                  uint32_t chunk, const uint8_t *head, size_t head_len, const uint8_t *body,
                  size_t body_len);
/* Queue a message with `len` bytes of its own: where to write them (valid until the next add),
 * or NULL if memory ran out. */
uint8_t *oc_outbox_add_copy(oc_outbox *o, uint8_t route, uint16_t dst, uint8_t kind,
                            uint32_t seq, uint32_t chunk, size_t len);
/* The payload parts of message i. */
const uint8_t *oc_outbox_body(const oc_outbox *o, const oc_msg *m);
void oc_outbox_drop_seq(oc_outbox *o, uint32_t seq);
void oc_outbox_clear(oc_outbox *o);

/* Seal every message under `s` and hand each batch to `emit`: datagrams of one route and
 * destination laid back to back, all `segment` bytes but the last, at most a GSO send. The batch
 * is valid during the call only. Empties the outbox. Returns the messages that could not be
 * sealed (too large): dropped. */
typedef void (*oc_batch_fn)(void *ctx, uint8_t route, uint16_t dst, const uint8_t *data,
                            size_t len, size_t segment);
size_t oc_outbox_seal(oc_outbox *o, oc_sealer *s, oc_batch_fn emit, void *ctx);

#endif
