/* The Python face of a rank's native parts (overcast.native._core): Sealer (a communicator key's
 * sender side and its one counter), TagCheck (its receiver side), Budget (a link direction's
 * token bucket) and Plane (the rank's datagram plane and, once attached to its sockets, the loop
 * that runs it without the GIL). The boundary is coarse: a read, a run, a batch to send, a
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

#include "budget.h"
#include "pyargs.h"
#include "plane.h"
#include "port.h"
#include "service.h"
#include "stream.h"
#include "sums.h"
#include "wire.h"

/* -- Sealer ------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    oc_sealer s;
    int ready;
    int lent;  /* its plane seals with it now, the GIL released: its counter is the plane's */
    int owned; /* a plane seals with it: no other plane may (their sealing would race) */
} Sealer;

/* Two sealings at once would spend the same counter: the GCM nonce, repeated under one key. */
static int sealer_lent(Sealer *self) {
    if (self->lent)
        PyErr_SetString(PyExc_RuntimeError, "the sealer is in use by a plane serving on another "
                                            "thread");
    return self->lent;
}

static int Sealer_init(Sealer *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"key", "job", "comm", "src", NULL};
    Py_buffer key;
    uint32_t job, comm;
    uint16_t src;
    if (self->ready) { /* its counter must never go back under the same key */
        PyErr_SetString(PyExc_RuntimeError, "a sealer is keyed once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*O&O&O&", names, &key, oc_arg_u32, &job,
                                     oc_arg_u32, &comm, oc_arg_u16, &src))
        return -1;
    int bad = key.len != OC_KEY_BYTES;
    if (!bad) self->ready = oc_gmac_init(&self->s.gmac, key.buf, 1) == 0;
    PyBuffer_Release(&key);
    if (bad) {
        PyErr_Format(PyExc_ValueError, "a communicator key has %d bytes", OC_KEY_BYTES);
        return -1;
    }
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL could not set up AES-GCM");
        return -1;
    }
    self->s.job = job;
    self->s.comm = comm;
    self->s.src = src;
    self->s.counter = 0;
    return 0;
}

static void Sealer_dealloc(Sealer *self) {
    if (self->ready) oc_gmac_free(&self->s.gmac);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A payload as sealing takes it: a buffer, or a tuple of up to two laid one after the other.
 * Fills parts[0..n) (released by the caller, n set even on failure); 0, or -1 with an error. */
static int payload_parts(PyObject *payload, Py_buffer parts[2], int *n) {
    *n = 0;
    if (!PyTuple_Check(payload)) {
        if (PyObject_GetBuffer(payload, &parts[0], PyBUF_C_CONTIGUOUS) != 0) return -1;
        *n = 1;
        return 0;
    }
    if (PyTuple_GET_SIZE(payload) > 2) {
        PyErr_SetString(PyExc_ValueError, "a payload has at most two parts");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(payload); i++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(payload, i), &parts[i], PyBUF_C_CONTIGUOUS) != 0)
            return -1;
        *n += 1;
    }
    return 0;
}

#define PART(parts, n, i) ((n) > (i) ? (const uint8_t *)(parts)[i].buf : NULL)
#define PART_LEN(parts, n, i) ((n) > (i) ? (size_t)(parts)[i].len : 0)

/* seal_into(buf, offset, kind, seq, dst, chunk, payload): returns the message's end in buf. */
static PyObject *Sealer_seal_into(Sealer *self, PyObject *args) {
    Py_buffer buf;
    Py_ssize_t offset;
    uint8_t kind;
    uint16_t dst;
    uint32_t seq, chunk;
    PyObject *payload;
    if (!self->ready) return PyErr_Format(PyExc_RuntimeError, "the sealer has no key");
    if (sealer_lent(self)) return NULL;
    if (!PyArg_ParseTuple(args, "w*nO&O&O&O&O", &buf, &offset, oc_arg_u8, &kind, oc_arg_u32,
                          &seq, oc_arg_u16, &dst, oc_arg_u32, &chunk, &payload))
        return NULL;
    Py_buffer parts[2] = {{0}, {0}};
    int nparts;
    int ok = payload_parts(payload, parts, &nparts) == 0;
    size_t n = 0;
    if (ok && offset >= 0 && offset <= buf.len)
        n = oc_seal_parts(&self->s, (uint8_t *)buf.buf + offset, (size_t)(buf.len - offset),
                          kind, seq, dst, chunk, PART(parts, nparts, 0),
                          PART_LEN(parts, nparts, 0), PART(parts, nparts, 1),
                          PART_LEN(parts, nparts, 1));
    for (int i = 0; i < nparts; i++) PyBuffer_Release(&parts[i]);
    PyBuffer_Release(&buf);
    if (!ok) return NULL;
    if (!n)
        return PyErr_Format(PyExc_ValueError, "the message does not fit the buffer, or the key "
                            "is spent (its counter at 2^64 - 1)");
    return PyLong_FromSsize_t(offset + (Py_ssize_t)n);
}

/* seal_detached(kind, seq, dst, chunk, payload) -> bytes: the header and the tag (header first)
 * of the message whose payload is sent from where it lies. */
static PyObject *Sealer_seal_detached(Sealer *self, PyObject *args) {
    uint8_t kind;
    uint16_t dst;
    uint32_t seq, chunk;
    PyObject *payload;
    if (!self->ready) return PyErr_Format(PyExc_RuntimeError, "the sealer has no key");
    if (sealer_lent(self)) return NULL;
    if (!PyArg_ParseTuple(args, "O&O&O&O&O", oc_arg_u8, &kind, oc_arg_u32, &seq, oc_arg_u16,
                          &dst, oc_arg_u32, &chunk, &payload))
        return NULL;
    Py_buffer parts[2] = {{0}, {0}};
    int nparts;
    uint8_t out[OC_OVERHEAD_BYTES];
    int ok = payload_parts(payload, parts, &nparts) == 0, sealed = 0;
    if (ok)
        sealed = oc_seal_detached(&self->s, out, kind, seq, dst, chunk,
                                  PART(parts, nparts, 0), PART_LEN(parts, nparts, 0),
                                  PART(parts, nparts, 1), PART_LEN(parts, nparts, 1)) == 0;
    for (int i = 0; i < nparts; i++) PyBuffer_Release(&parts[i]);
    if (!ok) return NULL;
    if (!sealed)
        return PyErr_Format(PyExc_ValueError, "the payload is too large to seal, or the key is "
                            "spent (its counter at 2^64 - 1)");
    return PyBytes_FromStringAndSize((const char *)out, OC_OVERHEAD_BYTES);
}

static PyObject *Sealer_counter(Sealer *self, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->s.counter);
}

static int Sealer_set_counter(Sealer *self, PyObject *value, void *closure) {
    (void)closure;
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "the counter cannot be deleted");
        return -1;
    }
    uint64_t v;
    if (sealer_lent(self) || !oc_arg_u64(value, &v)) return -1;
    if (v < self->s.counter) { /* the counters between would be spent twice: nonces repeated */
        PyErr_Format(PyExc_ValueError, "the counter only moves forward: it is at %llu, not %llu",
                     (unsigned long long)self->s.counter, (unsigned long long)v);
        return -1;
    }
    self->s.counter = v;
    return 0;
}

static PyMethodDef Sealer_methods[] = {
    {"seal_into", (PyCFunction)Sealer_seal_into, METH_VARARGS,
     "seal_into(buf, offset, kind, seq, dst, chunk, payload) -> end"},
    {"seal_detached", (PyCFunction)Sealer_seal_detached, METH_VARARGS,
     "seal_detached(kind, seq, dst, chunk, payload) -> header and tag"},
    {NULL, NULL, 0, NULL},
};
static PyGetSetDef Sealer_getset[] = {
    {"counter", (getter)Sealer_counter, (setter)Sealer_set_counter,
     "the last counter spent (the next message takes the one after); it may be set only "
     "forward", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};
static PyTypeObject SealerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "overcast.native._core.Sealer",
    .tp_doc = "Sealer(key, job, comm, src): AES-GMAC sealing under one key, one counter.",
    .tp_basicsize = sizeof(Sealer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Sealer_init,
    .tp_dealloc = (destructor)Sealer_dealloc,
    .tp_methods = Sealer_methods,
    .tp_getset = Sealer_getset,
};

/* -- TagCheck ----------------------------------------------------------------------------- */

/* One EVP context: open_stream uses it without the GIL, so `busy` turns away any other call
 * meanwhile (from another thread) rather than let two share it or free it under the first. */
typedef struct {
    PyObject_HEAD
    oc_gmac g;
    int ready;
    int busy;
} TagCheck;

static int tag_check_in_use(TagCheck *self) {
    if (self->busy) PyErr_SetString(PyExc_RuntimeError, "the TagCheck is in use by another thread");
    return self->busy;
}

static int TagCheck_init(TagCheck *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"key", NULL};
    Py_buffer key;
    if (tag_check_in_use(self)) return -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*", names, &key)) return -1;
    int bad = key.len != OC_KEY_BYTES;
    if (!bad) {
        if (self->ready) oc_gmac_free(&self->g);
        self->ready = oc_gmac_init(&self->g, key.buf, 0) == 0;
    }
    PyBuffer_Release(&key);
    if (bad) {
        PyErr_Format(PyExc_ValueError, "a communicator key has %d bytes", OC_KEY_BYTES);
        return -1;
    }
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL could not set up AES-GCM");
        return -1;
    }
    return 0;
}

static void TagCheck_dealloc(TagCheck *self) {
    if (self->ready) oc_gmac_free(&self->g);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* check(message, src, counter): whether the message's last 16 bytes are the tag of the rest. */
static PyObject *TagCheck_check(TagCheck *self, PyObject *args) {
    Py_buffer m;
    uint16_t src;
    uint64_t counter;
    if (!self->ready) return PyErr_Format(PyExc_RuntimeError, "no key");
    if (tag_check_in_use(self)) return NULL;
    if (!PyArg_ParseTuple(args, "y*O&O&", &m, oc_arg_u16, &src, oc_arg_u64, &counter))
        return NULL;
    int ok = m.len >= OC_TAG_BYTES &&
             oc_gmac_check(&self->g, src, counter, m.buf, (size_t)m.len - OC_TAG_BYTES,
                           (const uint8_t *)m.buf + m.len - OC_TAG_BYTES);
    PyBuffer_Release(&m);
    return PyBool_FromLong(ok);
}

/* open_stream(buffer, end, job, comm, peer, next_counter): the frames of buffer[0:end], a
 * peer's stream's read (stream.h): (frames, used, need, fault, next_counter, (foreign, bad_mac,
 * replayed)), each frame (kind, job, comm, seq, src, dst, chunk, length, counter, payload
 * offset). The GIL is let go while a large read is opened (its tags are most of the work). */
static PyObject *TagCheck_open_stream(TagCheck *self, PyObject *args) {
    Py_buffer b;
    Py_ssize_t end;
    uint32_t job, comm;
    uint16_t peer;
    uint64_t next;
    if (!self->ready) return PyErr_Format(PyExc_RuntimeError, "no key");
    if (tag_check_in_use(self)) return NULL;
    if (!PyArg_ParseTuple(args, "y*nO&O&O&O&", &b, &end, oc_arg_u32, &job, oc_arg_u32, &comm,
                          oc_arg_u16, &peer, oc_arg_u64, &next))
        return NULL;
    if (end < 0 || end > b.len) {
        PyBuffer_Release(&b);
        return PyErr_Format(PyExc_ValueError, "end %zd is outside the buffer's %zd bytes", end,
                            b.len);
    }
    oc_stream_in in = {.job = job, .comm = comm, .peer = peer, .next_counter = next};
    enum { BATCH = 64 };
    oc_frame frames[BATCH];
    size_t done = 0, need = 0;
    int fault = 0;
    PyObject *list = PyList_New(0);
    while (list != NULL) {
        const uint8_t *at = (const uint8_t *)b.buf + done;
        size_t left = (size_t)end - done, used = 0, n;
        if (left >= (1 << 16)) {
            self->busy = 1;
            Py_BEGIN_ALLOW_THREADS
            n = oc_stream_open(&in, &self->g, at, left, frames, BATCH, &used, &need, &fault);
            Py_END_ALLOW_THREADS
            self->busy = 0;
        } else {
            n = oc_stream_open(&in, &self->g, at, left, frames, BATCH, &used, &need, &fault);
        }
        for (size_t i = 0; i < n; i++) {
            const oc_header *h = &frames[i].h;
            PyObject *t = Py_BuildValue("(BIIIHHIIKn)", h->kind, h->job, h->comm, h->seq,
                                        h->src, h->dst, h->chunk, h->length,
                                        (unsigned long long)h->counter,
                                        (Py_ssize_t)(done + frames[i].payload));
            if (t == NULL || PyList_Append(list, t)) {
                Py_XDECREF(t);
                Py_CLEAR(list);
                break;
            }
            Py_DECREF(t);
        }
        done += used;
        if (n < BATCH || need || fault) break;
    }
    PyBuffer_Release(&b);
    if (list == NULL) return NULL;
    return Py_BuildValue("(NnniK(KKK))", list, (Py_ssize_t)done, (Py_ssize_t)need, fault,
                         (unsigned long long)in.next_counter, (unsigned long long)in.foreign,
                         (unsigned long long)in.bad_mac, (unsigned long long)in.replayed);
}

static PyMethodDef TagCheck_methods[] = {
    {"check", (PyCFunction)TagCheck_check, METH_VARARGS,
     "check(message, src, counter) -> whether its tag is right"},
    {"open_stream", (PyCFunction)TagCheck_open_stream, METH_VARARGS,
     "open_stream(buffer, end, job, comm, peer, next_counter) -> (frames, used, need, fault, "
     "next_counter, (foreign, bad_mac, replayed)): a stream's read, opened"},
    {NULL, NULL, 0, NULL},
};
static PyTypeObject TagCheckType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "overcast.native._core.TagCheck",
    .tp_doc = "TagCheck(key): AES-GMAC tags checked under one key, set once.",
    .tp_basicsize = sizeof(TagCheck),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)TagCheck_init,
    .tp_dealloc = (destructor)TagCheck_dealloc,
    .tp_methods = TagCheck_methods,
};

/* -- Budget ------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    oc_budget b;
    int ready; /* gathers and reductions count themselves in it: it is set up once */
    /* The plane whose collectives pace with it (holds: how many), which changes it without the
     * GIL while it serves: no other plane may take it meanwhile, nor Python touch it. */
    const void *owner;
    const int *owner_serving;
    size_t holds;
} Budget;

static int budget_lent(Budget *self) {
    if (self->owner_serving && *self->owner_serving) {
        PyErr_SetString(PyExc_RuntimeError, "the budget is in use by a plane serving on another "
                                            "thread");
        return 1;
    }
    return 0;
}

static int Budget_init(Budget *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"rate", "burst_seconds", "batch", "datagram_bytes", "reduction_batch",
                            NULL};
    double rate = 0, burst = 0.005;
    uint32_t batch = 1, datagram = 0, reduction = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|ddO&O&O&", names, &rate, &burst, oc_arg_u32,
                                     &batch, oc_arg_u32, &datagram, oc_arg_u32, &reduction))
        return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "a budget is set up once");
        return -1;
    }
    oc_budget_init(&self->b, rate, burst, batch, datagram, reduction);
    self->ready = 1;
    return 0;
}

static PyObject *Budget_take(Budget *self, PyObject *args) {
    double n, now;
    if (budget_lent(self) || !PyArg_ParseTuple(args, "dd", &n, &now)) return NULL;
    oc_budget_take(&self->b, n, now);
    Py_RETURN_NONE;
}

static PyObject *Budget_try_take(Budget *self, PyObject *args) {
    double n, now;
    if (budget_lent(self) || !PyArg_ParseTuple(args, "dd", &n, &now)) return NULL;
    return PyBool_FromLong(oc_budget_try_take(&self->b, n, now));
}

static PyObject *Budget_ready_at(Budget *self, PyObject *args) {
    double n, now;
    if (budget_lent(self) || !PyArg_ParseTuple(args, "dd", &n, &now)) return NULL;
    return PyFloat_FromDouble(oc_budget_ready_at(&self->b, n, now));
}

static PyObject *Budget_get(Budget *self, void *which) {
    if (budget_lent(self)) return NULL;
    switch ((intptr_t)which) {
    case 0: return PyFloat_FromDouble(self->b.rate);
    case 1: return PyLong_FromUnsignedLong(self->b.batch);
    case 2: return PyLong_FromUnsignedLong(self->b.reduction_batch);
    case 3: return PyFloat_FromDouble(self->b.burst);
    case 4: return PyFloat_FromDouble(self->b.tokens);
    case 6: return PyLong_FromLong(self->b.gathers_in_flight);
    default: return PyLong_FromLong(self->b.reductions_in_flight);
    }
}

static PyMethodDef Budget_methods[] = {
    {"take", (PyCFunction)Budget_take, METH_VARARGS, "take(nbytes, now): spend, into debt"},
    {"try_take", (PyCFunction)Budget_try_take, METH_VARARGS,
     "try_take(nbytes, now) -> whether the bucket held them (spent if so)"},
    {"ready_at", (PyCFunction)Budget_ready_at, METH_VARARGS,
     "ready_at(nbytes, now) -> when try_take(nbytes) can next succeed"},
    {NULL, NULL, 0, NULL},
};
static PyGetSetDef Budget_getset[] = {
    {"rate", (getter)Budget_get, NULL, "bytes per second (0: unpaced)", (void *)0},
    {"batch", (getter)Budget_get, NULL, "datagrams per multicast batch", (void *)1},
    {"reduction_batch", (getter)Budget_get, NULL, "datagrams per contribution batch", (void *)2},
    {"burst", (getter)Budget_get, NULL, "the bucket's depth in bytes", (void *)3},
    {"tokens", (getter)Budget_get, NULL, "bytes the bucket holds now", (void *)4},
    {"reductions_in_flight", (getter)Budget_get, NULL,
     "in-network reductions sending on this link", (void *)5},
    {"gathers_in_flight", (getter)Budget_get, NULL,
     "multicast gathers posted on this link whose roots have not all ended their multicast",
     (void *)6},
    {NULL, NULL, NULL, NULL, NULL},
};
static PyTypeObject BudgetType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "overcast.native._core.Budget",
    .tp_doc = "Budget(rate, burst_seconds, batch, datagram_bytes, reduction_batch): a link "
              "direction's token bucket (overcast/native/budget.h).",
    .tp_basicsize = sizeof(Budget),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Budget_init,
    .tp_methods = Budget_methods,
    .tp_getset = Budget_getset,
};

/* -- Plane -------------------------------------------------------------------------------- */

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

/* A collective of `plane` paces with `budget`: 0, or -1 with an error if another plane's do. */
static int hold_budget(Plane *plane, PyObject *budget) {
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

static void release_held(held_t *h) {
    PyBuffer_Release(&h->input);
    PyBuffer_Release(&h->output);
    if (h->budget) {
        Budget *b = (Budget *)h->budget;
        if (--b->holds == 0) b->owner = b->owner_serving = NULL;
    }
    Py_CLEAR(h->budget);
}

static void Plane_dealloc(Plane *self) {
    if (self->attached) oc_port_free(&self->port);
    oc_plane_free(self->plane); /* before the buffers and budgets it points to go */
    for (size_t i = 0; i < self->nheld; i++) release_held(&self->held[i]);
    PyMem_Free(self->held);
    if (self->sealer) ((Sealer *)self->sealer)->owned = 0;
    Py_CLEAR(self->sealer);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int usable(Plane *self) {
    if (self->plane == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the plane was not initialised");
        return 0;
    }
    if (self->serving) {
        PyErr_SetString(PyExc_RuntimeError, "the plane is serving on another thread");
        return 0;
    }
    return 1;
}

/* While the plane works without the GIL no other call may touch it, nor seal with its sealer. */
static void set_serving(Plane *self, int on) {
    self->serving = on;
    if (self->sealer) ((Sealer *)self->sealer)->lent += on ? 1 : -1;
}

static PyObject *Plane_set_loss(Plane *self, PyObject *args) {
    double rate, burst;
    uint64_t seed;
    if (!usable(self) || !PyArg_ParseTuple(args, "ddO&", &rate, &burst, oc_arg_u64, &seed))
        return NULL;
    oc_plane_set_loss(self->plane, rate, burst, seed);
    Py_RETURN_NONE;
}

/* set_address(route, rank, "a.b.c.d", port) */
static PyObject *Plane_set_address(Plane *self, PyObject *args) {
    uint8_t route;
    uint16_t port;
    uint32_t rank;
    const char *ip;
    struct in_addr a;
    if (!usable(self) || !PyArg_ParseTuple(args, "O&O&sO&", oc_arg_u8, &route, oc_arg_u32, &rank,
                                           &ip, oc_arg_u16, &port))
        return NULL;
    if (inet_pton(AF_INET, ip, &a) != 1 ||
        oc_plane_set_address(self->plane, route, rank, a.s_addr, htons(port)))
        return PyErr_Format(PyExc_ValueError, "cannot route %u/%u to %s:%u", (unsigned)route,
                            rank, ip, (unsigned)port);
    Py_RETURN_NONE;
}

static PyObject *Plane_attach(Plane *self, PyObject *args) {
    int udp, group, python;
    if (!usable(self) || !PyArg_ParseTuple(args, "iii", &udp, &group, &python)) return NULL;
    if (self->attached) return PyErr_Format(PyExc_RuntimeError, "the plane is attached already");
    if (oc_port_init(&self->port, self->plane, udp, group, python))
        return PyErr_SetFromErrno(PyExc_OSError);
    self->attached = 1;
    take_snapshot(self);
    Py_RETURN_NONE;
}

static PyObject *Plane_detach(Plane *self, PyObject *unused) {
    (void)unused;
    if (!usable(self)) return NULL;
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
    if (!usable(self)) return NULL;
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
    if (!usable(self)) return NULL;
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
    if (!usable(self) || !PyArg_ParseTuple(args, "y*nd", &data, &segment, &now)) return NULL;
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
    if (!usable(self) ||
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
    if (!usable(self) ||
        !PyArg_ParseTuple(args, "O&O&pO&OOnO&O&O!d", oc_arg_u32, &seq, oc_arg_u32, &dtype, &avg,
                          oc_arg_u64, &count, &in, &out, &chunk_bytes, oc_arg_u32, &slots,
                          oc_arg_u32, &group, &BudgetType, &budget, &now))
        return NULL;
    if (self->nheld == self->held_cap) {
        size_t cap = self->held_cap ? 2 * self->held_cap : 8;
        held_t *h = PyMem_Realloc(self->held, cap * sizeof *h);
        if (h == NULL) return PyErr_NoMemory();
        self->held = h;
        self->held_cap = cap;
    }
    if (hold_budget(self, budget)) return NULL;
    held_t h = {seq, {0}, {0}, budget};
    Py_INCREF(budget);
    if (PyObject_GetBuffer(in, &h.input, PyBUF_C_CONTIGUOUS)) {
        release_held(&h);
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
        release_held(&h);
        return PyErr_Format(PyExc_ValueError, "reduce: dtype %u, %llu elements per rank, input "
                            "of %zd bytes, output of %zd bytes, chunks of %zd bytes do not fit",
                            dtype, count, h.input.len, h.output.len, chunk_bytes);
    }
    if (oc_plane_reduce(self->plane, seq, dtype, avg, count, h.input.buf, h.output.buf,
                        (size_t)chunk_bytes, slots, group, &((Budget *)budget)->b, now)) {
        release_held(&h);
        return PyErr_Format(PyExc_ValueError, "cannot post reduction #%u (posted already, or a "
                            "shape it cannot take)", seq);
    }
    self->held[self->nheld++] = h;
    Py_RETURN_NONE;
}

static PyObject *Plane_news(Plane *self, PyObject *unused) {
    (void)unused;
    if (!usable(self)) return NULL;
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
    if (!usable(self)) return NULL;
    oc_plane_release(self->plane, seq);
    for (size_t i = 0; i < self->nheld; i++)
        if (self->held[i].seq == seq) {
            release_held(&self->held[i]);
            self->held[i] = self->held[--self->nheld];
            break;
        }
    take_snapshot(self);
    Py_RETURN_NONE;
}

/* reducer(seq) -> dict of its state, or None */
static PyObject *Plane_reducer(Plane *self, PyObject *arg) {
    uint32_t seq;
    if (!oc_arg_u32(arg, &seq)) return NULL;
    if (!usable(self)) return NULL;
    const oc_reducer *r = oc_plane_reducer(self->plane, seq);
    if (r == NULL) Py_RETURN_NONE;
    static const char *phases[] = {"sending", "receiving", "drained"};
    return Py_BuildValue("{sssKsdsIsIsIsIsIsnsKsKsKsK}", "phase", phases[r->phase],
                         "progress", (unsigned long long)r->progress,
                         "progress_at", r->progress_at, "results", r->results,
                         "k", r->k, "credit", r->credit, "total", r->total, "cursor", r->cursor,
                         "bytes", (Py_ssize_t)oc_reducer_bytes(r),
                         "duplicate_results", (unsigned long long)r->duplicate_results,
                         "contributions_resent", (unsigned long long)r->contributions_resent,
                         "credit_probes", (unsigned long long)r->credit_probes,
                         "results_in", (unsigned long long)r->results_in);
}

static PyObject *Plane_timer(Plane *self, PyObject *unused) {
    (void)unused;
    if (!usable(self)) return NULL;
    double t = oc_plane_timer(self->plane);
    if (t < 0) Py_RETURN_NONE;
    return PyFloat_FromDouble(t);
}

static PyObject *Plane_handle_timer(Plane *self, PyObject *arg) {
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    if (!usable(self)) return NULL;
    oc_plane_handle_timer(self->plane, now);
    Py_RETURN_NONE;
}

/* take_outbox() -> [(route, dst, kind, seq, chunk, payload bytes)], unsealed; empties it */
static PyObject *Plane_take_outbox(Plane *self, PyObject *unused) {
    (void)unused;
    if (!usable(self)) return NULL;
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
    if (!usable(self) || !PyArg_ParseTuple(args, "O&O", oc_arg_u8, &route, &messages))
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
    if (ok && !usable(self)) ok = 0; /* an attribute's code served or freed it meanwhile */
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

static oc_gather *gather_of(Plane *self, uint32_t seq) {
    oc_gather *g = oc_plane_gatherer(self->plane, seq);
    if (g == NULL) PyErr_Format(PyExc_KeyError, "no gather #%u posted", seq);
    return g;
}

/* gather(seq, buffer, [(root, offset)], segment_bytes, chunk_bytes, mine, concurrent, budget) */
static PyObject *Plane_gather(Plane *self, PyObject *args) {
    uint32_t seq, chunk_bytes, concurrent;
    uint64_t segment_bytes;
    int mine;
    PyObject *buffer, *segments, *budget;
    if (!usable(self) ||
        !PyArg_ParseTuple(args, "O&OOO&O&iO&O!", oc_arg_u32, &seq, &buffer, &segments, oc_arg_u64,
                          &segment_bytes, oc_arg_u32, &chunk_bytes, &mine, oc_arg_u32,
                          &concurrent, &BudgetType, &budget))
        return NULL;
    PyObject *seqf = PySequence_Tuple(segments); /* a list changed meanwhile cannot move it */
    if (seqf == NULL) return NULL;
    if (hold_budget(self, budget)) {
        Py_DECREF(seqf);
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seqf);
    uint32_t *roots = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *roots);
    uint64_t *offsets = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *offsets);
    held_t h = {seq, {0}, {0}, budget};
    Py_INCREF(budget);
    int ok = roots && offsets && n > 0 && self->nheld < ((size_t)1 << 20);
    for (Py_ssize_t i = 0; ok && i < n; i++)
        ok = PyArg_ParseTuple(PyTuple_GET_ITEM(seqf, i), "O&O&", oc_arg_u32, &roots[i], oc_arg_u64,
                              &offsets[i]);
    if (ok && chunk_bytes > OC_MAX_DATAGRAM - OC_OVERHEAD_BYTES) {
        PyErr_Format(PyExc_ValueError, "a chunk of %u bytes does not fit a datagram", chunk_bytes);
        ok = 0;
    }
    if (ok) ok = PyObject_GetBuffer(buffer, &h.output, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) == 0;
    for (Py_ssize_t i = 0; ok && i < n; i++)
        if (offsets[i] > (uint64_t)h.output.len || segment_bytes > (uint64_t)h.output.len - offsets[i]) {
            PyErr_SetString(PyExc_ValueError, "a segment lies outside the buffer");
            ok = 0;
        }
    if (ok && self->nheld == self->held_cap) {
        size_t cap = self->held_cap ? 2 * self->held_cap : 8;
        held_t *more = PyMem_Realloc(self->held, cap * sizeof *more);
        if (more == NULL) {
            PyErr_NoMemory();
            ok = 0;
        } else {
            self->held = more;
            self->held_cap = cap;
        }
    }
    if (ok && oc_plane_gather(self->plane, seq, h.output.buf, (uint32_t)n, roots, offsets,
                              segment_bytes, chunk_bytes, mine, concurrent,
                              &((Budget *)budget)->b)) {
        PyErr_Format(PyExc_ValueError, "cannot post gather #%u (posted already, or a shape it "
                     "cannot take)", seq);
        ok = 0;
    }
    PyMem_Free(roots);
    PyMem_Free(offsets);
    Py_DECREF(seqf);
    if (!ok) {
        release_held(&h);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad gather");
        return NULL;
    }
    self->held[self->nheld++] = h;
    Py_RETURN_NONE;
}

static PyObject *Plane_gather_activate(Plane *self, PyObject *args) {
    uint32_t seq;
    double now;
    if (!usable(self) || !PyArg_ParseTuple(args, "O&d", oc_arg_u32, &seq, &now)) return NULL;
    oc_gather *g = gather_of(self, seq);
    if (g == NULL) return NULL;
    oc_gather_activate(g, oc_plane_outbox(self->plane), now);
    Py_RETURN_NONE;
}

static PyObject *Plane_gather_streams_ended(Plane *self, PyObject *args) {
    uint32_t seq;
    if (!usable(self) || !PyArg_ParseTuple(args, "O&", oc_arg_u32, &seq)) return NULL;
    oc_gather *g = gather_of(self, seq);
    if (g == NULL) return NULL;
    return PyBool_FromLong(oc_gather_streams_ended(g));
}

static PyObject *Plane_gather_store(Plane *self, PyObject *args) {
    uint32_t seq, first;
    Py_buffer payload;
    double now;
    if (!usable(self) ||
        !PyArg_ParseTuple(args, "O&O&y*d", oc_arg_u32, &seq, oc_arg_u32, &first, &payload, &now))
        return NULL;
    oc_gather *g = gather_of(self, seq);
    uint32_t fresh = 0;
    int why = g ? oc_gather_store(g, first, payload.buf, (size_t)payload.len, now, &fresh) : 0;
    PyBuffer_Release(&payload);
    if (g == NULL) return NULL;
    return Py_BuildValue("(iI)", why, fresh);
}

static PyObject *Plane_gather_have(Plane *self, PyObject *args) {
    uint32_t seq, first, count;
    if (!usable(self) || !PyArg_ParseTuple(args, "O&O&O&", oc_arg_u32, &seq, oc_arg_u32, &first,
                                           oc_arg_u32, &count))
        return NULL;
    oc_gather *g = gather_of(self, seq);
    if (g == NULL) return NULL;
    return PyLong_FromLong(oc_gather_have(g, first, count));
}

static PyObject *Plane_gather_request(Plane *self, PyObject *args) {
    uint32_t seq, s, lo, hi;
    if (!usable(self) || !PyArg_ParseTuple(args, "O&O&O&O&", oc_arg_u32, &seq, oc_arg_u32, &s,
                                           oc_arg_u32, &lo, oc_arg_u32, &hi))
        return NULL;
    oc_gather *g = gather_of(self, seq);
    if (g == NULL) return NULL;
    oc_gather_request(g, s, lo, hi);
    Py_RETURN_NONE;
}

static PyObject *Plane_gather_requests(Plane *self, PyObject *arg) {
    uint32_t seq;
    if (!oc_arg_u32(arg, &seq) || !usable(self)) return NULL;
    oc_gather *g = gather_of(self, seq);
    if (g == NULL) return NULL;
    PyObject *list = PyList_New((Py_ssize_t)g->nrequests);
    for (size_t i = 0; list && i < g->nrequests; i++) {
        PyObject *t = Py_BuildValue("(II)", g->requests[i].first, g->requests[i].count);
        if (t == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    if (list) g->nrequests = 0;
    return list;
}

static PyObject *Plane_gather_state(Plane *self, PyObject *arg) {
    uint32_t seq;
    if (!oc_arg_u32(arg, &seq) || !usable(self)) return NULL;
    oc_gather *g = oc_plane_gatherer(self->plane, seq);
    if (g == NULL) Py_RETURN_NONE;
    PyObject *missing = PyList_New(g->nseg);
    for (uint32_t s = 0; missing && s < g->nseg; s++) {
        PyObject *v = PyLong_FromUnsignedLong(g->missing[s]);
        if (v == NULL) Py_CLEAR(missing);
        else PyList_SET_ITEM(missing, s, v);
    }
    if (missing == NULL) return NULL;
    return Py_BuildValue("{sNsisisKsdsKsKsKsn}", "missing", missing, "sent_all", g->sent_all,
                         "complete", oc_gather_complete(g),
                         "progress", (unsigned long long)g->progress,
                         "progress_at", g->progress_at,
                         "multicast_chunks", (unsigned long long)g->multicast_chunks,
                         "duplicate_chunks", (unsigned long long)g->duplicate_chunks,
                         "repaired_chunks", (unsigned long long)g->repaired_chunks,
                         "bytes", (Py_ssize_t)oc_gather_bytes(g));
}

/* The snapshot's drops by name, those that happened. */
static PyObject *drop_dict(const snapshot_t *s) {
    PyObject *drops = PyDict_New();
    for (int i = 0; drops && i < OC_PLANE_DROP_COUNT; i++) {
        if (!s->drops[i]) continue;
        PyObject *v = PyLong_FromUnsignedLongLong(s->drops[i]);
        if (v == NULL || PyDict_SetItemString(drops, oc_plane_drop_names[i], v)) Py_CLEAR(drops);
        Py_XDECREF(v);
    }
    return drops;
}

/* set_trace(bin_seconds): count the plane's own datagrams per collective in bins that wide */
static PyObject *Plane_set_trace(Plane *self, PyObject *arg) {
    double width = PyFloat_AsDouble(arg);
    if (!usable(self) || PyErr_Occurred()) return NULL;
    if (!(width > 0)) return PyErr_Format(PyExc_ValueError, "the bin width must be > 0");
    oc_plane_trace(self->plane)->bin_seconds = width;
    Py_RETURN_NONE;
}

/* trace_bins() -> [(direction, seq, bin, link bytes)] counted since last asked */
static PyObject *Plane_trace_bins(Plane *self, PyObject *unused) {
    (void)unused;
    if (!usable(self)) return NULL;
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
    PyObject *drops = drop_dict(s), *stats = PyDict_New();
    for (int i = 0; stats && i < OC_PLANE_STAT_COUNT; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(s->stats[i]);
        if (v == NULL || PyDict_SetItemString(stats, oc_plane_stat_names[i], v)) Py_CLEAR(stats);
        Py_XDECREF(v);
    }
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
     "gather_request(seq, segment, lo, hi): mark what is missing there requested"},
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
static PyTypeObject PlaneType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "overcast.native._core.Plane",
    .tp_doc = "Plane(rank, world, job=0, comm=0, key=None, sealer=None): a rank's datagram "
              "plane (overcast/native/plane.h, port.h).",
    .tp_basicsize = sizeof(Plane),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Plane_init,
    .tp_dealloc = (destructor)Plane_dealloc,
    .tp_methods = Plane_methods,
    .tp_getset = Plane_getset,
};

int oc_add_rank_types(PyObject *m) {
    PyTypeObject *types[] = {&SealerType, &TagCheckType, &BudgetType, &PlaneType};
    for (int i = 0; i < 4; i++) /* each named by its tp_name's last part */
        if (PyModule_AddType(m, types[i]) < 0) return -1;
    static const struct { const char *name; int value; } constants[] = {
        {"PORT_PYTHON", OC_PORT_PYTHON}, {"PORT_RUNS", OC_PORT_RUNS},
        {"PORT_NEWS", OC_PORT_NEWS}, {"PORT_DEADLINE", OC_PORT_DEADLINE},
        {"PORT_INTERRUPTED", OC_PORT_INTERRUPTED}, {"PORT_ERROR", OC_PORT_ERROR},
        {"ROUTE_AGGREGATOR", OC_ROUTE_AGGREGATOR}, {"ROUTE_GROUP", OC_ROUTE_GROUP},
        {"ROUTE_RANK", OC_ROUTE_RANK},
    };
    for (size_t i = 0; i < sizeof constants / sizeof constants[0]; i++)
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0) return -1;
    return 0;
}
