/* One direction of a host's link, shared by every collective in flight on it: a token bucket at
 * the link's rate times the pacing share (overcast.protocols.budget is its Python face).
 * Multicast streams take from it at their own pace, into debt if need be (they keep their
 * schedule); in-network contributions go only when it holds their batch, so they fill what the
 * multicast leaves. It also counts the in-network reductions in flight, so a multicast knows to
 * leave receivers room for the results, and the multicast gathers whose streams have not all
 * ended, which share the streams' rate between them. Plain data: the owner frees it, nothing
 * inside is allocated. */
#ifndef OVERCAST_NATIVE_BUDGET_H
#define OVERCAST_NATIVE_BUDGET_H

#include <stdint.h>

typedef struct {
    double rate;            /* bytes per second; 0: unpaced */
    double burst, tokens, updated;
    int fresh;              /* nothing taken yet: `updated` means nothing */
    uint32_t batch;         /* datagrams a multicast pacer releases per wake-up */
    uint32_t reduction_batch; /* what an in-network sender releases (at least `batch`) */
    int32_t reductions_in_flight;
    /* multicast gathers posted whose streams have not all ended (oc_gather_streams_ended):
     * every rank posts the same collectives in the same order and hears of every root's end,
     * so every root divides its streams' pace by the same count, a notice's latency aside */
    int32_t gathers_in_flight;
} oc_budget;

/* The bucket holds `burst_seconds` at the rate, and at least two of the larger batches of
 * `datagram_bytes`: a sender that waits for a whole batch must find one. */
void oc_budget_init(oc_budget *b, double rate, double burst_seconds, uint32_t batch,
                    uint32_t datagram_bytes, uint32_t reduction_batch);
/* Spend `nbytes` whatever the balance. */
void oc_budget_take(oc_budget *b, double nbytes, double now);
/* Spend `nbytes` if the bucket holds them: 1, else 0. */
int oc_budget_try_take(oc_budget *b, double nbytes, double now);
/* When oc_budget_try_take(nbytes) can next succeed. */
double oc_budget_ready_at(oc_budget *b, double nbytes, double now);

#endif
