/* Plane: the rank's datagram plane (plane.h) and, once attached to its sockets, the loop that
 * runs it without the GIL (port.h). The boundary is coarse: a read, a run, a batch to send, a
 * collective posted or let go; never a call per datagram on the engine's path.
 *
 * Lifetime: a Plane holds a reference to its Sealer, and to each reduction's input, output
 * (their buffers held) and Budget until the reduction is released, so nothing it points to can
 * go while it may touch it. While serve runs without the GIL, every other call refuses, but the
 * counters and memory, which read a copy taken when serve last returned. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <math.h>

#include "bind_plane.h"
#include "binding.h"
#include "rank/budget.h"
#include "rank/plane.h"
#include "rank/port.h"
#include "common/sums.h"
#include "common/wire.h"

/* A collective of `plane` paces with `budget`: 0, or -1 with an error if another plane's do. */
int plane_hold_budget(Plane *plane, PyObject *budget) {
    Budget *b = (Budget *)budget;
    if (b->holds && b->owner != plane) {
        PyErr_SetString(PyExc_ValueError, "the budget paces another plane's collectives: two "
                                          "planes serving at once would change it together");
        return -1;
    }
    b->owner = plane;
    b->owner_serving = &plane->serving;
    b->holds++;
    return 0;
}

void plane_release_held(held_t *h) {
    PyBuffer_Release(&h->input);
    PyBuffer_Release(&h->output);
    if (h->budget) {
        Budget *b = (Budget *)h->budget;
        if (--b->holds == 0) b->owner = b->owner_serving = NULL;
    }
    Py_CLEAR(h->budget);
}

int plane_room_to_hold(Plane *self) {
    if (self->nheld < self->held_cap) return 0;
    size_t cap = self->held_cap ? 2 * self->held_cap : 8;
    held_t *more = PyMem_Realloc(self->held, cap * sizeof *more);
    if (more == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->held = more;
    self->held_cap = cap;
    return 0;
}

static void take_snapshot(Plane *self) {
    snapshot_t *s = &self->snap;
    memcpy(s->drops, oc_plane_drops(self->plane), sizeof s->drops);
    memcpy(s->stats, oc_plane_stats(self->plane), sizeof s->stats);
    s->bytes = oc_plane_bytes(self->plane);
    if (self->attached) { /* else the counters as they were when it let go */
        const oc_udp *u = &self->port.udp, *g = &self->port.group;
        s->reads = u->reads + (g->fd >= 0 ? g->reads : 0);
        s->datagrams_in = u->datagrams_in + (g->fd >= 0 ? g->datagrams_in : 0);
        s->datagrams_out = u->datagrams_out;
        s->bytes_in = u->bytes_in + (g->fd >= 0 ? g->bytes_in : 0);
        s->truncated = u->truncated + (g->fd >= 0 ? g->truncated : 0);
        s->cpu_seconds = self->port.cpu_seconds;
        s->wakeups = self->port.wakeups;
        s->pending_bytes = self->port.pending_bytes;
        s->gro = u->gro;
        s->gso = u->gso;
        s->bytes += OC_GRO_READ_BYTES * (g->fd >= 0 ? 2 : 1);
    }
}

static int Plane_init(Plane *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"rank", "world", "job", "comm", "key", "sealer", NULL};
    uint16_t rank;
    uint32_t world, job = 0, comm = 0;
    Py_buffer key = {0};
    PyObject *sealer = Py_None;
    if (self->plane) {
        PyErr_SetString(PyExc_RuntimeError, "a plane is made once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&O&|O&O&z*O", names, oc_arg_u16, &rank,
                                     oc_arg_u32, &world, oc_arg_u32, &job, oc_arg_u32, &comm,
                                     &key, &sealer))
        return -1;
    if ((key.buf && key.len != OC_KEY_BYTES) ||
        (sealer != Py_None && !PyObject_TypeCheck(sealer, &SealerType))) {
        if (key.buf) PyBuffer_Release(&key);
        PyErr_SetString(PyExc_ValueError, "key: 16 bytes or None; sealer: a Sealer or None");
        return -1;
    }
    if (rank >= world) {
        if (key.buf) PyBuffer_Release(&key);
        PyErr_Format(PyExc_ValueError, "rank %u of a world of %u", rank, world);
        return -1;
    }
    if (sealer != Py_None && ((Sealer *)sealer)->owned) {
        if (key.buf) PyBuffer_Release(&key);
        PyErr_SetString(PyExc_ValueError, "the sealer seals for another plane already: two "
                                          "planes serving at once would spend one counter twice");
        return -1;
    }
    self->plane = oc_plane_new(rank, world, job, comm, key.buf,
                               sealer == Py_None ? NULL : &((Sealer *)sealer)->s);
    if (key.buf) PyBuffer_Release(&key);
    if (self->plane == NULL) {
        PyErr_Format(PyExc_ValueError, "cannot make the plane of rank %u of %u", rank, world);
        return -1;
    }
    if (sealer != Py_None) {
        Py_INCREF(sealer);
        self->sealer = sealer;
        ((Sealer *)sealer)->owned = 1;
    }
    self->port.epoll = -1;
    take_snapshot(self);
    return 0;
}

static void Plane_dealloc(Plane *self) {
    if (self->attached) oc_port_free(&self->port);
    oc_plane_free(self->plane); /* before the buffers and budgets it points to go */
    for (size_t i = 0; i < self->nheld; i++) plane_release_held(&self->held[i]);
    PyMem_Free(self->held);
    if (self->sealer) ((Sealer *)self->sealer)->owned = 0;
    Py_CLEAR(self->sealer);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* While the plane works without the GIL no other call may touch it, nor seal with its sealer. */
static void set_serving(Plane *self, int on) {
    self->serving = on;
    if (self->sealer) ((Sealer *)self->sealer)->lent += on ? 1 : -1;
}

static PyObject *Plane_set_loss(Plane *self, PyObject *args) {
    double rate, burst;
    uint64_t seed;
    if (!plane_usable(self) || !PyArg_ParseTuple(args, "ddO&", &rate, &burst, oc_arg_u64, &seed))
        return NULL;
    oc_plane_set_loss(self->plane, rate, burst, seed);
    Py_RETURN_NONE;
}

static PyObject *Plane_set_stripes(Plane *self, PyObject *arg) {
    uint32_t stripes;
    if (!plane_usable(self) || !oc_arg_u32(arg, &stripes)) return NULL;
    if (oc_plane_set_stripes(self->plane, stripes))
        return PyErr_Format(PyExc_ValueError, "cannot stripe over %u aggregator endpoints (1 to "
                            "%u, before any reduction)", stripes, OC_MAX_STRIPES);
    Py_RETURN_NONE;
}

/* set_lanes([endpoint, ...]): the endpoints reductions posted from now on are striped over */
static PyObject *Plane_set_lanes(Plane *self, PyObject *arg) {
    uint16_t lanes[OC_MAX_STRIPES];
    if (!plane_usable(self)) return NULL;
    PyObject *seq = PySequence_Fast(arg, "set_lanes takes a sequence of endpoints");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int ok = n >= 1 && n <= (Py_ssize_t)OC_MAX_STRIPES;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        uint32_t e;
        ok = oc_arg_u32(PySequence_Fast_GET_ITEM(seq, i), &e) && e < OC_MAX_STRIPES;
        if (ok) lanes[i] = (uint16_t)e;
    }
    Py_DECREF(seq);
    if (PyErr_Occurred()) return NULL;
    if (!ok || oc_plane_set_lanes(self->plane, lanes, (uint32_t)n))
        return PyErr_Format(PyExc_ValueError, "cannot stripe over those %zd endpoints (each "
                            "one of the stripes set, none twice)", n);
    Py_RETURN_NONE;
}

/* set_address(route, rank, "a.b.c.d", port); for ROUTE_AGGREGATOR, rank is the endpoint */
static PyObject *Plane_set_address(Plane *self, PyObject *args) {
    uint8_t route;
    uint16_t port;
    uint32_t rank, addr;
    if (!plane_usable(self) || !PyArg_ParseTuple(args, "O&O&O&O&", oc_arg_u8, &route, oc_arg_u32, &rank,
                                           oc_arg_ipv4, &addr, oc_arg_u16, &port))
        return NULL;
    if (oc_plane_set_address(self->plane, route, rank, addr, htons(port)))
        return PyErr_Format(PyExc_ValueError, "cannot route %u/%u to port %u", (unsigned)route,
                            rank, (unsigned)port);
    Py_RETURN_NONE;
}

static PyObject *Plane_attach(Plane *self, PyObject *args) {
    int udp, group, python;
    if (!plane_usable(self) || !PyArg_ParseTuple(args, "iii", &udp, &group, &python)) return NULL;
    if (self->attached) return PyErr_Format(PyExc_RuntimeError, "the plane is attached already");
    if (oc_port_init(&self->port, self->plane, udp, group, python))
        return PyErr_SetFromErrno(PyExc_OSError);
    self->attached = 1;
    take_snapshot(self);
    Py_RETURN_NONE;
}

static PyObject *Plane_detach(Plane *self, PyObject *unused) {
    (void)unused;
    if (!plane_usable(self)) return NULL;
    if (self->attached) {
        take_snapshot(self);
        oc_port_free(&self->port);
        self->attached = 0;
    }
    Py_RETURN_NONE;
}

/* serve(until) -> reason (PORT_*): the GIL released while it runs */
static PyObject *Plane_serve(Plane *self, PyObject *arg) {
    double until = PyFloat_AsDouble(arg);
    if (until == -1.0 && PyErr_Occurred()) return NULL;
    if (!isfinite(until)) return PyErr_Format(PyExc_ValueError, "serve needs a finite deadline");
    if (!plane_usable(self)) return NULL;
    if (!self->attached) return PyErr_Format(PyExc_RuntimeError, "the plane has no sockets");
    int reason;
    set_serving(self, 1);
    Py_BEGIN_ALLOW_THREADS
    reason = oc_port_serve(&self->port, until);
    Py_END_ALLOW_THREADS
    set_serving(self, 0);
    take_snapshot(self);
    return PyLong_FromLong(reason);
}

static PyObject *run_list(Plane *self) {
    const oc_run *runs;
    const uint32_t *chunks;
    size_t n = oc_plane_runs(self->plane, &runs, &chunks);
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        const oc_run *r = &runs[i];
        PyObject *cs = PyList_New((Py_ssize_t)r->count);
        for (size_t j = 0; cs && j < r->count; j++) {
            PyObject *c = PyLong_FromUnsignedLong(chunks[r->first + j]);
            if (c == NULL) Py_CLEAR(cs);
            else PyList_SET_ITEM(cs, (Py_ssize_t)j, c);
        }
        PyObject *t = cs ? Py_BuildValue("(IIIIIIIKNnn)", r->hdr.kind, r->hdr.job, r->hdr.comm,
                                         r->hdr.seq, r->hdr.src, r->hdr.dst, r->hdr.length,
                                         (unsigned long long)r->hdr.counter, cs,
                                         (Py_ssize_t)r->offset, (Py_ssize_t)r->stride)
                         : NULL;
        if (t == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    return list;
}

/* runs() -> (a copy of the read, or None after feed; [(kind, job, comm, seq, src,
 * dst, length, counter, chunks, offset, stride)]): the messages of the last read that are
 * Python's, valid until the next serve or feed. */
static PyObject *Plane_runs(Plane *self, PyObject *unused) {
    (void)unused;
    if (!plane_usable(self)) return NULL;
    PyObject *list = run_list(self);
    if (list == NULL) return NULL;
    PyObject *view = Py_None;
    const oc_run *runs;
    const uint32_t *chunks;
    /* a copy: these are rare (messages for collectives not posted yet, kinds that are Python's),
     * and nothing Python keeps may point into a read buffer the port reuses and frees */
    if (self->attached && oc_plane_runs(self->plane, &runs, &chunks) && self->port.runs_data)
        view = PyBytes_FromStringAndSize((const char *)self->port.runs_data,
                                         (Py_ssize_t)self->port.runs_len);
    else
        Py_INCREF(view);
    if (view == NULL) {
        Py_DECREF(list);
        return NULL;
    }
    return Py_BuildValue("(NN)", view, list);
}

/* feed(datagrams, segment, now): one read's sealed datagrams, as serve's reads feed them. */
static PyObject *Plane_feed(Plane *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t segment;
    double now;
    if (!plane_usable(self) || !PyArg_ParseTuple(args, "y*nd", &data, &segment, &now)) return NULL;
    if (segment < 0) segment = 0;
    oc_plane_feed(self->plane, data.buf, (size_t)data.len, (size_t)segment, now);
    if (self->attached) self->port.runs_data = NULL;
    PyBuffer_Release(&data);
    take_snapshot(self);
    Py_RETURN_NONE;
}

/* receive_run(kind, seq, src, dst, length, chunks, data, offset, stride, now) -> taken */
static PyObject *Plane_receive_run(Plane *self, PyObject *args) {
    uint8_t kind;
    uint16_t src, dst;
    uint32_t seq, length;
    PyObject *chunks;
    Py_buffer data;
    Py_ssize_t offset, stride;
    double now;
    if (!plane_usable(self) ||
        !PyArg_ParseTuple(args, "O&O&O&O&O&Oy*nnd", oc_arg_u8, &kind, oc_arg_u32, &seq,
                          oc_arg_u16, &src, oc_arg_u16, &dst, oc_arg_u32, &length, &chunks,
                          &data, &offset, &stride, &now))
        return NULL;
    PyObject *seqf = PySequence_Tuple(chunks); /* a list changed meanwhile cannot move it */
    if (seqf == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seqf);
    uint32_t *cs = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    int ok = cs != NULL;
    for (Py_ssize_t i = 0; ok && i < n; i++) ok = oc_arg_u32(PyTuple_GET_ITEM(seqf, i), &cs[i]);
    /* the payloads must lie within the data */
    if (ok && n && (offset < 0 || stride < 0 || (size_t)offset > (size_t)data.len ||
                    length > (size_t)data.len - (size_t)offset ||
                    (n > 1 && (size_t)stride > ((size_t)data.len - (size_t)offset - length) /
                                                   (size_t)(n - 1)))) {
        PyErr_SetString(PyExc_ValueError, "the run's payloads lie outside its data");
        ok = 0;
    }
    int taken = 0;
    if (ok) {
        oc_header h = {kind, 0, 0, seq, src, dst, n ? cs[0] : 0, length, 0};
        taken = oc_plane_receive_run(self->plane, &h, cs, (size_t)n, data.buf, (size_t)offset,
                                     (size_t)stride, now);
    } else if (!PyErr_Occurred()) {
        PyErr_NoMemory();
    }
    PyMem_Free(cs);
    Py_DECREF(seqf);
    PyBuffer_Release(&data);
    if (!ok) return NULL;
    return PyBool_FromLong(taken);
}

/* reduce(seq, dtype, avg, count, input, output, chunk_bytes, slots, group, budget, now) */
static PyObject *Plane_reduce(Plane *self, PyObject *args) {
    uint32_t seq, dtype, slots, group;
    int avg;
    uint64_t count;
    Py_ssize_t chunk_bytes;
    PyObject *in, *out, *budget;
    double now;
    if (!plane_usable(self) ||
        !PyArg_ParseTuple(args, "O&O&pO&OOnO&O&O!d", oc_arg_u32, &seq, oc_arg_u32, &dtype, &avg,
                          oc_arg_u64, &count, &in, &out, &chunk_bytes, oc_arg_u32, &slots,
                          oc_arg_u32, &group, &BudgetType, &budget, &now))
        return NULL;
    if (plane_room_to_hold(self)) return NULL;
    if (plane_hold_budget(self, budget)) return NULL;
    held_t h = {seq, {0}, {0}, budget};
    Py_INCREF(budget);
    if (PyObject_GetBuffer(in, &h.input, PyBUF_C_CONTIGUOUS)) {
        plane_release_held(&h);
        return NULL;
    }
    if (PyObject_GetBuffer(out, &h.output, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)) {
        PyBuffer_Release(&h.input);
        return NULL;
    }
    size_t item = oc_dtype_size(dtype);
    uint64_t world = oc_plane_world(self->plane);
    if (!item || chunk_bytes <= 0 ||
        (size_t)chunk_bytes > OC_MAX_DATAGRAM - OC_OVERHEAD_BYTES - OC_CONTRIB_PREFIX_BYTES ||
        count > (uint64_t)PY_SSIZE_T_MAX / item / world ||
        (size_t)h.output.len < count * item || (size_t)h.input.len < world * count * item) {
        plane_release_held(&h);
        return PyErr_Format(PyExc_ValueError, "reduce: dtype %u, %llu elements per rank, input "
                            "of %zd bytes, output of %zd bytes, chunks of %zd bytes do not fit",
                            dtype, count, h.input.len, h.output.len, chunk_bytes);
    }
    if (oc_plane_reduce(self->plane, seq, dtype, avg, count, h.input.buf, h.output.buf,
                        (size_t)chunk_bytes, slots, group, &((Budget *)budget)->b, now)) {
        plane_release_held(&h);
        return PyErr_Format(PyExc_ValueError, "cannot post reduction #%u (posted already, or a "
                            "shape it cannot take)", seq);
    }
    self->held[self->nheld++] = h;
    Py_RETURN_NONE;
}

static PyObject *Plane_news(Plane *self, PyObject *unused) {
    (void)unused;
    if (!plane_usable(self)) return NULL;
    uint32_t seqs[64];
    PyObject *list = PyList_New(0);
    size_t n;
    while (list && (n = oc_plane_news(self->plane, seqs, 64)) > 0)
        for (size_t i = 0; i < n; i++) {
            PyObject *v = PyLong_FromUnsignedLong(seqs[i]);
            if (v == NULL || PyList_Append(list, v)) Py_CLEAR(list);
            Py_XDECREF(v);
            if (list == NULL) break;
        }
    return list;
}

static PyObject *Plane_release(Plane *self, PyObject *arg) {
    uint32_t seq;
    if (!oc_arg_u32(arg, &seq)) return NULL;
    if (!plane_usable(self)) return NULL;
    oc_plane_release(self->plane, seq);
    for (size_t i = 0; i < self->nheld; i++)
        if (self->held[i].seq == seq) {
            plane_release_held(&self->held[i]);
            self->held[i] = self->held[--self->nheld];
            break;
        }
    take_snapshot(self);
    Py_RETURN_NONE;
}

/* heard(endpoint) -> when its last authentic datagram came, or None: never */
static PyObject *Plane_heard(Plane *self, PyObject *arg) {
    uint32_t endpoint;
    if (!oc_arg_u32(arg, &endpoint)) return NULL;
    if (!plane_usable(self)) return NULL;
    double at = oc_plane_heard(self->plane, endpoint);
    if (at < 0) Py_RETURN_NONE;
    return PyFloat_FromDouble(at);
}

/* reducer(seq) -> dict of its state, or None */
static PyObject *Plane_reducer(Plane *self, PyObject *arg) {
    uint32_t seq;
    if (!oc_arg_u32(arg, &seq)) return NULL;
    if (!plane_usable(self)) return NULL;
    const oc_reducer *r = oc_plane_reducer(self->plane, seq);
    if (r == NULL) Py_RETURN_NONE;
    static const char *phases[] = {"sending", "receiving", "drained"};
    uint32_t released = 0; /* over every endpoint */
    for (uint32_t e = 0; e < r->stripes; e++) released += r->credit[e];
    return Py_BuildValue("{sssKsdsIsIsIsIsIsIsnsKsKsKsK}", "phase", phases[r->phase],
                         "progress", (unsigned long long)r->progress,
                         "progress_at", r->progress_at, "results", r->results,
                         "k", r->k, "credit", released, "total", r->total, "cursor", r->cursor,
                         "stripes", r->stripes,
                         "bytes", (Py_ssize_t)oc_reducer_bytes(r),
                         "duplicate_results", (unsigned long long)r->duplicate_results,
                         "contributions_resent", (unsigned long long)r->contributions_resent,
                         "credit_probes", (unsigned long long)r->credit_probes,
                         "results_in", (unsigned long long)r->results_in);
}

static PyObject *Plane_timer(Plane *self, PyObject *unused) {
    (void)unused;
    if (!plane_usable(self)) return NULL;
    double t = oc_plane_timer(self->plane);
    if (t < 0) Py_RETURN_NONE;
    return PyFloat_FromDouble(t);
}

static PyObject *Plane_handle_timer(Plane *self, PyObject *arg) {
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    if (!plane_usable(self)) return NULL;
    oc_plane_handle_timer(self->plane, now);
    Py_RETURN_NONE;
}

/* take_outbox() -> [(route, dst, kind, seq, chunk, payload bytes)], unsealed; empties it */
static PyObject *Plane_take_outbox(Plane *self, PyObject *unused) {
    (void)unused;
    if (!plane_usable(self)) return NULL;
    oc_outbox *o = oc_plane_outbox(self->plane);
    PyObject *list = PyList_New((Py_ssize_t)o->n);
    for (size_t i = 0; list && i < o->n; i++) {
        const oc_msg *m = &o->msgs[i];
        PyObject *payload = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(m->head_len + m->body_len));
        if (payload) {
            char *p = PyBytes_AS_STRING(payload);
            if (m->head_len) memcpy(p, m->head, m->head_len);
            if (m->body_len) memcpy(p + m->head_len, oc_outbox_body(o, m), m->body_len);
        }
        PyObject *t = payload ? Py_BuildValue("(IIIIIN)", m->route, m->dst, m->kind, m->seq,
                                              m->chunk, payload) : NULL;
        if (t == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    if (list) oc_outbox_clear(o);
    return list;
}

/* send(route, messages): seal Python's own datagrams (objects with kind, seq, dst, chunk and a
 * payload buffer) after what the plane has queued, and send them now, the GIL released; what
 * the socket cannot take waits, copied, for serve. Every attribute is read (which may run Python
 * code, even a call into this plane) before anything is queued. */
static PyObject *Plane_send(Plane *self, PyObject *args) {
    uint8_t route;
    PyObject *messages;
    if (!plane_usable(self) || !PyArg_ParseTuple(args, "O&O", oc_arg_u8, &route, &messages))
        return NULL;
    if (!self->attached) return PyErr_Format(PyExc_RuntimeError, "the plane has no sockets");
    PyObject *items = PySequence_Tuple(messages); /* a list changed meanwhile cannot move it */
    if (items == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    typedef struct { uint8_t kind; uint16_t dst; uint32_t seq, chunk; Py_buffer view; } message_t;
    message_t *ms = PyMem_Calloc((size_t)(n ? n : 1), sizeof *ms);
    Py_ssize_t got = 0;
    int ok = ms != NULL;
    if (!ok) PyErr_NoMemory();
    for (Py_ssize_t i = 0; ok && i < n; i++, got += ok) {
        PyObject *m = PyTuple_GET_ITEM(items, i);
        PyObject *kind = PyObject_GetAttrString(m, "kind"), *seq = PyObject_GetAttrString(m, "seq"),
                 *dst = PyObject_GetAttrString(m, "dst"), *chunk = PyObject_GetAttrString(m, "chunk"),
                 *payload = PyObject_GetAttrString(m, "payload");
        ok = kind && seq && dst && chunk && payload && oc_arg_u8(kind, &ms[i].kind) &&
             oc_arg_u32(seq, &ms[i].seq) && oc_arg_u16(dst, &ms[i].dst) &&
             oc_arg_u32(chunk, &ms[i].chunk) &&
             PyObject_GetBuffer(payload, &ms[i].view, PyBUF_C_CONTIGUOUS) == 0;
        Py_XDECREF(kind);
        Py_XDECREF(seq);
        Py_XDECREF(dst);
        Py_XDECREF(chunk);
        Py_XDECREF(payload);
    }
    if (ok && !plane_usable(self)) ok = 0; /* an attribute's code served or freed it meanwhile */
    if (ok && !self->attached) { /* ...or detached it: its port is gone */
        PyErr_SetString(PyExc_RuntimeError, "the plane was detached while its messages were read");
        ok = 0;
    }
    if (ok) {
        oc_outbox *o = oc_plane_outbox(self->plane);
        size_t queued = o->n;
        for (Py_ssize_t i = 0; ok && i < n; i++)
            ok = oc_outbox_add(o, route, ms[i].dst, ms[i].kind, ms[i].seq, ms[i].chunk, NULL, 0,
                               ms[i].view.buf, (size_t)ms[i].view.len) == 0;
        if (ok) {
            set_serving(self, 1);
            Py_BEGIN_ALLOW_THREADS
            oc_port_flush(&self->port);
            Py_END_ALLOW_THREADS
            set_serving(self, 0);
        } else {
            o->n = queued; /* nothing borrowed from a released buffer may stay; the plane's do */
            PyErr_NoMemory();
        }
    }
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&ms[i].view);
    PyMem_Free(ms);
    Py_DECREF(items);
    if (self->plane) take_snapshot(self);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* The snapshot's drops by name, those that happened. */
static PyObject *drop_dict(const snapshot_t *s) {
    return oc_py_counts(s->drops, oc_plane_drop_names, OC_PLANE_DROP_COUNT, 1);
}

/* set_trace(bin_seconds): count the plane's own datagrams per collective in bins that wide */
static PyObject *Plane_set_trace(Plane *self, PyObject *arg) {
    double width = PyFloat_AsDouble(arg);
    if (!plane_usable(self) || PyErr_Occurred()) return NULL;
    if (!(width > 0)) return PyErr_Format(PyExc_ValueError, "the bin width must be > 0");
    oc_plane_trace(self->plane)->bin_seconds = width;
    Py_RETURN_NONE;
}

/* trace_bins() -> [(direction, seq, bin, link bytes)] counted since last asked */
static PyObject *Plane_trace_bins(Plane *self, PyObject *unused) {
    (void)unused;
    if (!plane_usable(self)) return NULL;
    oc_trace *t = oc_plane_trace(self->plane);
    PyObject *out = PyList_New((Py_ssize_t)t->n);
    for (size_t i = 0; out && i < t->n; i++) {
        const oc_trace_bin *b = &t->bins[i];
        PyObject *item = Py_BuildValue("(sILK)", b->tx ? "tx" : "rx", (unsigned int)b->seq,
                                       (long long)b->bin, (unsigned long long)b->bytes);
        if (item == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)i, item);
    }
    if (out) oc_trace_clear(t);
    return out;
}

/* drops() -> what the plane dropped, by reason, as of the last return from serve */
static PyObject *Plane_drops(Plane *self, PyObject *unused) {
    (void)unused;
    if (self->plane == NULL) return PyErr_Format(PyExc_RuntimeError, "not initialised");
    return drop_dict(&self->snap);
}

/* counters() -> (drops, stats, io): by name, as of the last return from serve */
static PyObject *Plane_counters(Plane *self, PyObject *unused) {
    (void)unused;
    if (self->plane == NULL) return PyErr_Format(PyExc_RuntimeError, "not initialised");
    const snapshot_t *s = &self->snap;
    PyObject *drops = drop_dict(s);
    PyObject *stats = oc_py_counts(s->stats, oc_plane_stat_names, OC_PLANE_STAT_COUNT, 0);
    PyObject *io = Py_BuildValue("{sKsKsKsKsKsdsKsisi}", "datagram_reads",
                                 (unsigned long long)s->reads,
                                 "datagrams_in", (unsigned long long)s->datagrams_in,
                                 "datagrams_out", (unsigned long long)s->datagrams_out,
                                 "datagram_bytes_in", (unsigned long long)s->bytes_in,
                                 "truncated_reads", (unsigned long long)s->truncated,
                                 "data_path_cpu_seconds", s->cpu_seconds,
                                 "wakeups", (unsigned long long)s->wakeups, "gro", s->gro,
                                 "gso", s->gso);
    if (!drops || !stats || !io) {
        Py_XDECREF(drops);
        Py_XDECREF(stats);
        Py_XDECREF(io);
        return NULL;
    }
    return Py_BuildValue("(NNN)", drops, stats, io);
}

/* memory() -> (bookkeeping bytes, unsent sealed bytes), as of the last return from serve */
static PyObject *Plane_memory(Plane *self, PyObject *unused) {
    (void)unused;
    return Py_BuildValue("(nn)", (Py_ssize_t)self->snap.bytes, (Py_ssize_t)self->snap.pending_bytes);
}

static PyObject *Plane_keyed(Plane *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->sealer != NULL);
}

static PyObject *Plane_attached(Plane *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->attached);
}

static PyMethodDef Plane_methods[] = {
    {"set_loss", (PyCFunction)Plane_set_loss, METH_VARARGS, "set_loss(rate, burst, seed)"},
    {"set_stripes", (PyCFunction)Plane_set_stripes, METH_O,
     "set_stripes(n): the aggregator endpoints its reductions are striped over"},
    {"set_lanes", (PyCFunction)Plane_set_lanes, METH_O,
     "set_lanes(endpoints): the endpoints reductions posted from now on are striped over"},
    {"set_address", (PyCFunction)Plane_set_address, METH_VARARGS,
     "set_address(route, rank, ipv4, port)"},
    {"attach", (PyCFunction)Plane_attach, METH_VARARGS,
     "attach(udp fd, multicast fd or -1, the engine's selector fd)"},
    {"detach", (PyCFunction)Plane_detach, METH_NOARGS,
     "let the sockets go (its own epoll descriptor closed; the sockets are the caller's)"},
    {"serve", (PyCFunction)Plane_serve, METH_O, "serve(until) -> why it returned (PORT_*)"},
    {"runs", (PyCFunction)Plane_runs, METH_NOARGS,
     "(read buffer or None, [(kind, job, comm, seq, src, dst, length, counter, chunks, offset, "
     "stride)]) of the last read"},
    {"feed", (PyCFunction)Plane_feed, METH_VARARGS, "feed(datagrams, segment, now)"},
    {"receive_run", (PyCFunction)Plane_receive_run, METH_VARARGS,
     "receive_run(kind, seq, src, dst, length, chunks, data, offset, stride, now) -> taken"},
    {"reduce", (PyCFunction)Plane_reduce, METH_VARARGS,
     "reduce(seq, dtype code, avg, count, input, output, chunk_bytes, slots, group, budget, now)"},
    {"news", (PyCFunction)Plane_news, METH_NOARGS,
     "collectives with news since last asked (a reduction drained; a gather's requests, own "
     "multicast sent, or every chunk in place)"},
    {"release", (PyCFunction)Plane_release, METH_O, "release(seq): let a collective go"},
    {"heard", (PyCFunction)Plane_heard, METH_O,
     "heard(endpoint) -> when an authentic datagram from it last came, or None"},
    {"gather", (PyCFunction)Plane_gather, METH_VARARGS,
     "gather(seq, buffer, [(root, offset)], segment_bytes, chunk_bytes, mine, concurrent, "
     "budget)"},
    {"gather_activate", (PyCFunction)Plane_gather_activate, METH_VARARGS,
     "gather_activate(seq, now): start multicasting this rank's segment"},
    {"gather_streams_ended", (PyCFunction)Plane_gather_streams_ended, METH_VARARGS,
     "gather_streams_ended(seq) -> whether taken: every other root has ended its multicast; "
     "once this rank's own is all sent too, the gather stops sharing the streams' pace"},
    {"gather_store", (PyCFunction)Plane_gather_store, METH_VARARGS,
     "gather_store(seq, first, payload, now) -> (misfit code, chunks put in place)"},
    {"gather_have", (PyCFunction)Plane_gather_have, METH_VARARGS,
     "gather_have(seq, first, count) -> 1 all here, 0 not, -1 not a range of one segment"},
    {"gather_request", (PyCFunction)Plane_gather_request, METH_VARARGS,
     "gather_request(seq, segment, lo, hi) -> whether all that is missing there is now "
     "requested (False: no memory for the list)"},
    {"gather_requests", (PyCFunction)Plane_gather_requests, METH_O,
     "gather_requests(seq) -> [(first, count)] marked requested since last asked"},
    {"gather_state", (PyCFunction)Plane_gather_state, METH_O, "gather_state(seq) -> dict or None"},
    {"reducer", (PyCFunction)Plane_reducer, METH_O, "reducer(seq) -> its state, or None"},
    {"timer", (PyCFunction)Plane_timer, METH_NOARGS, "when to call handle_timer, or None"},
    {"handle_timer", (PyCFunction)Plane_handle_timer, METH_O, "handle_timer(now)"},
    {"take_outbox", (PyCFunction)Plane_take_outbox, METH_NOARGS,
     "[(route, dst, kind, seq, chunk, payload)] unsealed; empties the outbox"},
    {"send", (PyCFunction)Plane_send, METH_VARARGS, "send(route, messages)"},
    {"set_trace", (PyCFunction)Plane_set_trace, METH_O,
     "set_trace(bin_seconds): count its own datagrams' link bytes per collective in bins"},
    {"trace_bins", (PyCFunction)Plane_trace_bins, METH_NOARGS,
     "[(direction, seq, bin, link bytes)] counted since last asked"},
    {"drops", (PyCFunction)Plane_drops, METH_NOARGS, "what it dropped, by reason"},
    {"counters", (PyCFunction)Plane_counters, METH_NOARGS, "(drops, stats, io) by name"},
    {"memory", (PyCFunction)Plane_memory, METH_NOARGS, "(bookkeeping bytes, unsent bytes)"},
    {NULL, NULL, 0, NULL},
};
static PyGetSetDef Plane_getset[] = {
    {"keyed", (getter)Plane_keyed, NULL, "whether it seals (it has a Sealer)", NULL},
    {"attached", (getter)Plane_attached, NULL, "whether it has sockets", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};
OC_PY_TYPE(Plane, (destructor)Plane_dealloc, Plane_getset,
           "Plane(rank, world, job=0, comm=0, key=None, sealer=None): a rank's datagram "
           "plane (overcast/native/rank/plane.h, port.h).");
