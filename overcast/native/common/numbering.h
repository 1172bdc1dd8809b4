/* How in-network ReduceScatter numbers its chunks (tests/native/test_core.c checks it): each of
 * the P blocks is cut into k chunks, numbered `group` chunks of block 0, then as many of block 1, and
 * so on, round after round; where `group` does not divide k the last round holds the k mod
 * group chunks left of each block. The ranks and the aggregator both follow it. Callers keep
 * g < world * k, k >= 1 and group >= 1. Arithmetic only: nothing is kept. */
#ifndef OVERCAST_NATIVE_NUMBERING_H
#define OVERCAST_NATIVE_NUMBERING_H

#include <stdint.h>

/* The block (its owner's rank) of chunk g, and *c, the chunk's place within the block. */
static inline uint32_t oc_chunk_place(uint64_t g, uint64_t world, uint64_t k, uint64_t group,
                                      uint64_t *c) {
    uint64_t whole = k - k % group;
    if (g < whole * world) {
        uint64_t turn = g / (world * group), rest = g % (world * group);
        *c = turn * group + rest % group;
        return (uint32_t)(rest / group);
    }
    uint64_t r = g - whole * world, per = k - whole;
    *c = whole + r % per;
    return (uint32_t)(r / per);
}

/* g's owner, and the chunks *first .. *end - 1 around g that are all that owner's. */
static inline uint32_t oc_owner_span(uint64_t g, uint64_t world, uint64_t k, uint64_t group,
                                     uint32_t *first, uint32_t *end) {
    uint64_t c, whole = k - k % group, j, size;
    uint32_t block = oc_chunk_place(g, world, k, group, &c);
    if (c < whole) {
        j = c % group;
        size = group;
    } else {
        j = c - whole;
        size = k - whole;
    }
    *first = (uint32_t)(g - j);
    *end = (uint32_t)(g - j + size);
    return block;
}

/* Striping over `stripes` aggregator endpoints: runs of `group` chunks go to the lanes in turn
 * (chunk g to lane (g / group) mod stripes), so a batch of one owner's contributions goes to one
 * endpoint. Collective seq's lane l is endpoint (l + seq) mod stripes, so collectives of a
 * single run start on every endpoint in turn. Each endpoint numbers its own chunks h = 0, 1, ...
 * in the order of g, and the wire between a rank and an endpoint speaks that numbering. */
static inline uint32_t oc_stripe_of_chunk(uint64_t g, uint64_t group, uint64_t stripes) {
    return (uint32_t)(g / group % stripes);
}

static inline uint64_t oc_stripe_local(uint64_t g, uint64_t group, uint64_t stripes) {
    return g / (group * stripes) * group + g % group;
}

/* Lane `lane`'s chunk h in the whole. */
static inline uint64_t oc_stripe_global(uint64_t h, uint64_t group, uint64_t stripes,
                                        uint64_t lane) {
    return h / group * group * stripes + lane * group + h % group;
}

static inline uint32_t oc_stripe_lane(uint32_t endpoint, uint32_t seq, uint32_t stripes) {
    return (endpoint + stripes - seq % stripes) % stripes;
}

/* How many of the chunks below g are the lane's. */
static inline uint64_t oc_stripe_count(uint64_t g, uint64_t group, uint64_t stripes,
                                       uint64_t lane) {
    uint64_t round = group * stripes, rest = g % round, low = lane * group;
    uint64_t tail = rest <= low ? 0 : rest - low < group ? rest - low : group;
    return g / round * group + tail;
}

/* The same by endpoint, for collective seq: the endpoint chunk g goes to, how many of the
 * chunks below g are the endpoint's, and the endpoint's chunk h in the whole. */
static inline uint32_t oc_endpoint_of_chunk(uint64_t g, uint64_t group, uint32_t stripes,
                                            uint32_t seq) {
    return (oc_stripe_of_chunk(g, group, stripes) + seq % stripes) % stripes;
}

static inline uint64_t oc_endpoint_count(uint64_t g, uint64_t group, uint32_t stripes,
                                         uint32_t endpoint, uint32_t seq) {
    return oc_stripe_count(g, group, stripes, oc_stripe_lane(endpoint, seq, stripes));
}

static inline uint64_t oc_endpoint_global(uint64_t h, uint64_t group, uint32_t stripes,
                                          uint32_t endpoint, uint32_t seq) {
    return oc_stripe_global(h, group, stripes, oc_stripe_lane(endpoint, seq, stripes));
}

#endif
