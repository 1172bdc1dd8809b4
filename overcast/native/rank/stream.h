/* A peer's stream, its received side: the frames a read brought, opened where they lie in the
 * stream's read buffer, in one call per read rather than a Python call per message.
 *
 * A stream carries whole messages back to back (header, payload, tag: wire.h), every one from
 * the one peer at the other end, under strictly rising counters. What a frame's header says
 * decides where the next frame starts, so a header that is not a frame of this stream (not
 * this version, an unknown kind, an oversized payload, another sender) ends the stream: its
 * framing can no longer be trusted. A whole frame that fails only its checks (another job or
 * communicator, a wrong tag, a counter not above the last) is skipped and counted.
 *
 * Ownership: nothing is kept past the call; frames[] point into the caller's buffer by offset. */
#ifndef OVERCAST_NATIVE_STREAM_H
#define OVERCAST_NATIVE_STREAM_H

#include <stddef.h>
#include <stdint.h>

#include "common/wire.h"

typedef struct {
    oc_header h;
    size_t payload; /* the payload's offset in the buffer opened */
} oc_frame;

typedef struct {
    uint32_t job, comm;
    uint16_t peer;
    uint64_t next_counter; /* the least counter the next authentic frame may carry */
    uint64_t foreign, bad_mac, replayed; /* whole frames skipped, by why */
} oc_stream_in;

/* Opens the frames of buf[0..len) in order until one is not whole, `max` authentic frames
 * were written to frames[], or a header ends the stream. Returns the authentic frames written;
 * sets *used to the bytes of the frames consumed (authentic or skipped), *need to the bytes the
 * next frame (or its header) lacks beyond buf[*used..len) (0 when stopped at `max` or a fault),
 * and *fault to 0, or to OC_MISFIT_MALFORMED or OC_MISFIT_WRONG_SENDER at a header that ends
 * the stream (*used then stops before it). */
size_t oc_stream_open(oc_stream_in *in, oc_gmac *g, const uint8_t *buf, size_t len,
                      oc_frame *frames, size_t max, size_t *used, size_t *need, int *fault);

#endif
