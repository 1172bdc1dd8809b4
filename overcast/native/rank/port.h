/* A rank's datagram plane on its sockets: reads what the kernel coalesced (GRO) from the unicast
 * and multicast sockets, feeds the plane, seals its outbox into GSO sends, and wakes for its
 * timers; runs until Python has something to do: runs of messages for it (valid until the next
 * call), news of a collective (oc_plane_news), its own descriptor (the engine's selector:
 * streams, submissions) readable, or its deadline; it looks at its sockets once even when the
 * deadline has passed already. It touches no Python object and runs with the GIL released.
 *
 * Ownership: the sockets are the caller's (not closed here); the port owns its epoll
 * descriptor, read buffers and the sealed batches the socket could not take yet. */
#ifndef OVERCAST_NATIVE_PORT_H
#define OVERCAST_NATIVE_PORT_H

#include "plane.h"
#include "common/udp.h"

/* The most sealed bytes kept for a full socket; past it, batches are dropped and counted. */
#define OC_PORT_PENDING_BYTES ((size_t)64 << 20)

enum { OC_PORT_PYTHON = 0, OC_PORT_RUNS = 1, OC_PORT_NEWS = 2, OC_PORT_DEADLINE = 3,
       OC_PORT_INTERRUPTED = 4, OC_PORT_ERROR = 5 };

typedef struct {
    uint8_t route;
    uint16_t dst;
    size_t len, segment;
    uint8_t *data;           /* owned */
} oc_pending;

typedef struct {
    oc_plane *plane;         /* borrowed */
    oc_udp udp, group;       /* group.fd < 0: no multicast socket */
    int epoll, writing;
    oc_pending *pending;
    size_t npending, pending_cap, pending_bytes;
    const uint8_t *runs_data; /* the read buffer the plane's runs for Python point into */
    size_t runs_len;
    double cpu_seconds;      /* this thread's CPU inside oc_port_serve */
    uint64_t wakeups;
} oc_port;

/* 0, or -1 with errno. group_fd may be -1. */
int oc_port_init(oc_port *port, oc_plane *plane, int udp_fd, int group_fd, int python_fd);
void oc_port_free(oc_port *port);
/* Seal the plane's outbox and send it, keeping what the socket cannot take for later: the
 * number of send errors (counted in the plane's drops as send_error). */
void oc_port_flush(oc_port *port);
int oc_port_serve(oc_port *port, double until);

#endif
