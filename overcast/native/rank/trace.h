/* What a rank's plane put on the link and took off it, per collective and direction, in small
 * time bins: the data of a timeline (overcast.engine.trace takes the bins in batches). Off (no
 * bins kept) until a bin width is set.
 *
 * Ownership: the trace owns its bins; oc_trace_clear empties them once the caller has read
 * them. */
#ifndef OVERCAST_NATIVE_TRACE_H
#define OVERCAST_NATIVE_TRACE_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t seq;
    uint8_t tx;              /* 1: put on the link, 0: taken off it */
    int64_t bin;             /* the time bin: monotonic seconds / bin_seconds, truncated */
    uint64_t bytes;          /* link bytes (Ethernet frames, as the shaper counts them) */
} oc_trace_bin;

typedef struct {
    double bin_seconds;      /* 0: off */
    oc_trace_bin *bins;
    size_t n, cap;
} oc_trace;

/* Count `datagrams` datagrams of `payload` bytes each for collective `seq` at time `now`. If
 * memory runs out the count is lost (a timeline is best effort), never the datagram. */
void oc_trace_count(oc_trace *t, int tx, uint32_t seq, uint64_t datagrams, size_t payload,
                    double now);
void oc_trace_clear(oc_trace *t);
void oc_trace_free(oc_trace *t);

#endif
