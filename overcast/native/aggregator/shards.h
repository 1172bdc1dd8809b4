/* The aggregator over cores: S shard threads, each serving an engine of its own (aggregator.h)
 * on a socket of its own (service.h's loop), shared-nothing as SwitchML's worker threads are.
 * A communicator is registered in every shard, shard i as the job's endpoint first + i
 * (numbering.h): ranks stripe their chunks over the shards' ports, so every contribution to
 * one chunk reaches the same thread, and each shard seals under its own source id, so no two
 * threads share a nonce space. Nothing on the per-datagram path takes a lock or touches
 * another shard's memory.
 *
 * The control thread (registration, reports) reaches the engines only while every shard is
 * parked: oc_shards_pause wakes each shard (an eventfd among its control descriptors), which
 * parks between two turns of its loop, so a pause costs a shard at most one burst of reads.
 * The lock and condition variable order the shards' work before the control thread's and
 * back again; registration is rare, so that is all the locking there is.
 *
 * Each shard makes every descriptor it needs (its eventfd and the epoll its loop waits on) when
 * it is made, and keeps them for its life: running out of descriptors later stalls nothing.
 *
 * Ownership: the shards own their engines, eventfds, epoll descriptors and read buffers; the
 * sockets are the caller's and must outlive oc_shards_free. Signals are blocked in the shard
 * threads, so they reach the caller's. */
#ifndef OVERCAST_NATIVE_SHARDS_H
#define OVERCAST_NATIVE_SHARDS_H

#include <stdint.h>

#include "aggregator.h"
#include "service.h"

typedef struct oc_shards oc_shards;

/* `n` shards (1 to OC_MAX_STRIPES), shard i on the bound UDP socket fds[i], engines of `slots`
 * slots whose reductions expire after `expiry` seconds; NULL with errno set if memory or
 * descriptors ran out.
 * The threads start with oc_shards_start. */
oc_shards *oc_shards_new(uint32_t n, uint32_t slots, double expiry, const int *fds);
/* Starts the threads not started yet: 0, or -1 with errno set if one could not be (those that
 * were are stopped again). */
int oc_shards_start(oc_shards *s);
/* Returns once every shard started is parked (at once if none is): until oc_shards_resume, the
 * caller alone touches the engines (oc_shards_engine). Pauses do not nest. */
void oc_shards_pause(oc_shards *s);
void oc_shards_resume(oc_shards *s);
uint32_t oc_shards_count(const oc_shards *s);
oc_agg *oc_shards_engine(oc_shards *s, uint32_t i);
const oc_udp *oc_shards_udp(const oc_shards *s, uint32_t i);
const oc_serve_stats *oc_shards_serve_stats(const oc_shards *s, uint32_t i);
/* Stops and joins the threads (if started) and frees everything. */
void oc_shards_free(oc_shards *s);

#endif
