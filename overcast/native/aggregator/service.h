/* The aggregator's data path on its socket: read GRO batches, feed the engine, send what it
 * wants sent in GSO batches, wake for its timer. Runs until a control descriptor (a shard's
 * eventfd) has something to read, a signal interrupts it, or a deadline passes; then the caller
 * handles that and calls it again. It touches no Python object.
 *
 * What it waits on is one epoll descriptor the caller makes once (oc_serve_waiter) and closes
 * when it is done serving: a loop that needed a descriptor per turn would stall whenever the
 * process ran out of them.
 *
 * Ownership: the engine, the socket (not closed here) and the waiter (the caller closes it) are
 * the caller's, borrowed for the call; oc_serve adds to the caller's stats, never resets them. */
#ifndef OVERCAST_NATIVE_SERVICE_H
#define OVERCAST_NATIVE_SERVICE_H

#include "aggregator.h"
#include "common/udp.h"

enum { OC_SERVE_DEADLINE = -1, OC_SERVE_INTERRUPTED = -2, OC_SERVE_ERROR = -3 };

/* The seconds of CPU this thread has spent inside oc_serve (its clock read once per call, at
 * the start and the end: reading it is a system call), and its wake-ups. */
typedef struct {
    double cpu_seconds;
    uint64_t wakeups;
} oc_serve_stats;

/* An epoll descriptor (the caller's to close) watching u's socket and control[0 .. ncontrol - 1]
 * for reading, or -1 with errno set. */
int oc_serve_waiter(const oc_udp *u, const int *control, int ncontrol);
/* The index of a readable control descriptor (its place in the waiter's `control`), or
 * OC_SERVE_DEADLINE when the monotonic clock reaches `until`, OC_SERVE_INTERRUPTED on a signal,
 * OC_SERVE_ERROR if epoll_wait fails otherwise (not a waiter made for u). */
int oc_serve(oc_agg *a, oc_udp *u, int waiter, double until, oc_serve_stats *stats);

#endif
