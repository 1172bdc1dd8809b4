#include "outbox.h"

#include <stdlib.h>
#include <string.h>

#include "common/grow.h"
#include "common/udp.h"

void oc_outbox_free(oc_outbox *o) {
    free(o->msgs);
    free(o->arena);
    memset(o, 0, sizeof *o);
}

static oc_msg *push(oc_outbox *o, uint8_t route, uint16_t dst, uint8_t kind, uint32_t seq,
                    uint32_t chunk) {
    if (oc_grow((void **)&o->msgs, &o->cap, o->n + 1, sizeof(oc_msg))) return NULL;
    oc_msg *m = &o->msgs[o->n++];
    memset(m, 0, sizeof *m);
    m->route = route;
    m->dst = dst;
    m->kind = kind;
    m->seq = seq;
    m->chunk = chunk;
    return m;
}

int oc_outbox_add(oc_outbox *o, uint8_t route, uint16_t dst, uint8_t kind, uint32_t seq,
                  uint32_t chunk, const uint8_t *head, size_t head_len, const uint8_t *body,
                  size_t body_len) {
    oc_msg *m = push(o, route, dst, kind, seq, chunk);
    if (m == NULL) return -1;
    m->head = head;
    m->head_len = head ? head_len : 0;
    m->body = body ? body : (const uint8_t *)"";
    m->body_len = body ? body_len : 0;
    return 0;
}

uint8_t *oc_outbox_add_copy(oc_outbox *o, uint8_t route, uint16_t dst, uint8_t kind,
                            uint32_t seq, uint32_t chunk, size_t len) {
    if (oc_grow((void **)&o->arena, &o->arena_cap, o->arena_len + len + 1, 1)) return NULL;
    oc_msg *m = push(o, route, dst, kind, seq, chunk);
    if (m == NULL) return NULL;
    m->offset = o->arena_len;
    m->body_len = len;
    o->arena_len += len;
    return o->arena + m->offset;
}

const uint8_t *oc_outbox_body(const oc_outbox *o, const oc_msg *m) {
    return m->body ? m->body : o->arena + m->offset;
}

void oc_outbox_drop_seq(oc_outbox *o, uint32_t seq) {
    size_t kept = 0;
    for (size_t i = 0; i < o->n; i++)
        if (o->msgs[i].seq != seq) o->msgs[kept++] = o->msgs[i];
    o->n = kept;
    if (!kept) o->arena_len = 0;
}

void oc_outbox_clear(oc_outbox *o) {
    o->n = 0;
    o->arena_len = 0;
}

size_t oc_outbox_seal(oc_outbox *o, oc_sealer *s, oc_batch_fn emit, void *ctx) {
    static _Thread_local uint8_t batch[OC_MAX_DATAGRAM];
    size_t end = 0, segment = 0, dropped = 0;
    const oc_msg *first = NULL;
    for (size_t i = 0; i < o->n; i++) {
        const oc_msg *m = &o->msgs[i];
        size_t len = OC_OVERHEAD_BYTES + m->head_len + m->body_len;
        /* a message joins the batch if it goes the same way and GSO can take it */
        if (first && (m->route != first->route || m->dst != first->dst ||
                      !oc_gso_joins(end, segment, len))) {
            emit(ctx, first->route, first->dst, batch, end, segment);
            first = NULL;
            end = 0;
        }
        size_t n = oc_seal_parts(s, batch + end, sizeof batch - end, m->kind, m->seq, m->dst,
                                 m->chunk, m->head, m->head_len, oc_outbox_body(o, m),
                                 m->body_len);
        if (!n) {
            dropped++;
            continue;
        }
        if (!first) {
            first = m;
            segment = n;
        }
        end += n;
    }
    if (first) emit(ctx, first->route, first->dst, batch, end, segment);
    oc_outbox_clear(o);
    return dropped;
}
