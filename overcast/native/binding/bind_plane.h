/* The Plane object, shared by bind_plane.c (its life, reductions, reads and sends) and
 * bind_gather.c (its multicast gathers): what a collective it runs holds, the counters a
 * serve leaves behind, and the helpers both use.
 *
 * Ownership: a Plane owns its plane and port (freed in its dealloc, before anything they point
 * to) and holds a reference to its Sealer, and to each collective's buffers and Budget (held_t)
 * until the collective is released. */
#ifndef OC_BIND_PLANE_H
#define OC_BIND_PLANE_H

#include <Python.h>

#include "binding.h"
#include "rank/plane.h"
#include "rank/port.h"

typedef struct {
    uint32_t seq;
    Py_buffer input, output;
    PyObject *budget;
} held_t;

typedef struct {
    uint64_t drops[OC_PLANE_DROP_COUNT], stats[OC_PLANE_STAT_COUNT];
    uint64_t reads, datagrams_in, datagrams_out, bytes_in, truncated;
    double cpu_seconds;
    uint64_t wakeups;
    size_t bytes, pending_bytes;
    int gro, gso;
} snapshot_t;

typedef struct {
    PyObject_HEAD
    oc_plane *plane;
    PyObject *sealer;
    oc_port port;
    int attached, serving;
    held_t *held;
    size_t nheld, held_cap;
    snapshot_t snap;
} Plane;

/* 1 if the plane may be called now (made, and not serving on another thread). */
static inline int plane_usable(Plane *self) {
    return oc_py_usable(self->plane != NULL, self->serving, "plane");
}

/* A collective of `plane` paces with `budget`: 0, or -1 with an error if another plane's do. */
int plane_hold_budget(Plane *plane, PyObject *budget);
/* Let go of what a collective held (its buffers and budget). */
void plane_release_held(held_t *h);
/* Room for one more held collective: 0, or -1 with MemoryError. */
int plane_room_to_hold(Plane *self);

/* bind_gather.c: the gather methods of Plane's method table */
PyObject *Plane_gather(Plane *self, PyObject *args);
PyObject *Plane_gather_activate(Plane *self, PyObject *args);
PyObject *Plane_gather_have(Plane *self, PyObject *args);
PyObject *Plane_gather_request(Plane *self, PyObject *args);
PyObject *Plane_gather_requests(Plane *self, PyObject *args);
PyObject *Plane_gather_state(Plane *self, PyObject *args);
PyObject *Plane_gather_store(Plane *self, PyObject *args);
PyObject *Plane_gather_streams_ended(Plane *self, PyObject *args);

#endif
