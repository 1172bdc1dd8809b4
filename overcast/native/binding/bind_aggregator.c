/* Aggregator: one reduction engine (aggregator.h), sans I/O, for the protocol tests and the
 * in-memory fabric; the service runs engines on its shards' threads (bind_shards.c). A call
 * takes a run or a whole read of datagrams, or a timer tick. Buffers passed in are read during
 * the call only (the engine copies what it keeps). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>

#include "aggregator/aggregator.h"
#include "binding.h"

typedef struct {
    PyObject_HEAD
    oc_agg *agg;
} Aggregator;

static int Aggregator_init(Aggregator *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"slots", "expiry", NULL};
    uint32_t slots;
    double expiry = OC_EXPIRY_SECONDS;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&|d", names, oc_arg_u32, &slots, &expiry))
        return -1;
    if (self->agg != NULL) { /* its communicators, sockets and counters would be lost */
        PyErr_SetString(PyExc_RuntimeError, "the aggregator is initialised already");
        return -1;
    }
    if (slots == 0) {
        PyErr_SetString(PyExc_ValueError, "an aggregator needs at least 1 slot");
        return -1;
    }
    if (!(expiry > 0)) {
        PyErr_SetString(PyExc_ValueError, "a reduction's expiry is a number of seconds above 0");
        return -1;
    }
    self->agg = oc_agg_new(slots);
    if (self->agg == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    oc_agg_set_expiry(self->agg, expiry);
    return 0;
}

static void Aggregator_dealloc(Aggregator *self) {
    oc_agg_free(self->agg);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int ready(Aggregator *self) {
    return oc_py_usable(self->agg != NULL, 0, "aggregator");
}

static PyObject *Aggregator_register(Aggregator *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"job", "comm", "world", "slots", "key", "counter", "max_row",
                            "stripe", NULL};
    uint32_t job, comm, world, slots = 0, max_row = OC_MAX_DATAGRAM, stripe = 0;
    uint64_t counter = 0;
    Py_buffer key = {0};
    if (!ready(self) ||
        !PyArg_ParseTupleAndKeywords(args, kw, "O&O&O&|O&z*O&O&O&", names, oc_arg_u32, &job,
                                     oc_arg_u32, &comm, oc_arg_u32, &world, oc_arg_u32, &slots,
                                     &key, oc_arg_u64, &counter, oc_arg_u32, &max_row,
                                     oc_arg_u32, &stripe))
        return NULL;
    if (key.buf && key.len != OC_KEY_BYTES) {
        PyBuffer_Release(&key);
        return PyErr_Format(PyExc_ValueError, "a communicator key has %d bytes, not %zd",
                            OC_KEY_BYTES, key.len);
    }
    uint32_t granted = 0;
    int h = oc_agg_register(self->agg, job, comm, world, stripe, slots, max_row, key.buf,
                            counter, &granted);
    if (key.buf) PyBuffer_Release(&key);
    if (h < 0 && (world == 0 || world > OC_MAX_WORLD))
        return PyErr_Format(PyExc_ValueError, "cannot register a world of %u ranks", world);
    if (h < 0 && stripe >= OC_MAX_STRIPES)
        return PyErr_Format(PyExc_ValueError, "an aggregator endpoint's stripe is below %u, "
                            "not %u", OC_MAX_STRIPES, stripe);
    if (h < 0) return PyErr_NoMemory();
    return Py_BuildValue("iI", h, granted);
}

static PyObject *Aggregator_unregister(Aggregator *self, PyObject *arg) {
    int h;
    if (!ready(self) || !PyArg_Parse(arg, "i", &h)) return NULL;
    oc_agg_unregister(self->agg, h);
    Py_RETURN_NONE;
}

static PyObject *Aggregator_set_address(Aggregator *self, PyObject *args) {
    int h, hears;
    uint32_t rank, addr;
    uint16_t port;
    if (!ready(self) || !PyArg_ParseTuple(args, "iO&O&O&p", &h, oc_arg_u32, &rank, oc_arg_ipv4,
                                          &addr, oc_arg_u16, &port, &hears))
        return NULL;
    if (oc_agg_set_address(self->agg, h, rank, addr, htons(port), hears))
        return PyErr_Format(PyExc_ValueError, "no rank %u in communicator %d", rank, h);
    Py_RETURN_NONE;
}

static PyObject *Aggregator_set_group(Aggregator *self, PyObject *args) {
    int h;
    uint16_t port;
    uint32_t addr;
    if (!ready(self) || !PyArg_ParseTuple(args, "iO&O&", &h, oc_arg_ipv4, &addr, oc_arg_u16, &port))
        return NULL;
    if (oc_agg_set_group(self->agg, h, addr, htons(port)))
        return PyErr_Format(PyExc_ValueError, "no communicator %d", h);
    Py_RETURN_NONE;
}

/* receive_run(handle, kind, seq, src, dst, length, chunks, data, offset, stride, now) */
static PyObject *Aggregator_receive_run(Aggregator *self, PyObject *args) {
    int h;
    uint8_t kind;
    uint16_t src, dst;
    uint32_t seq, length;
    PyObject *chunks;
    Py_buffer data;
    Py_ssize_t offset, stride;
    double now;
    if (!ready(self) || !PyArg_ParseTuple(args, "iO&O&O&O&O&Oy*nnd", &h, oc_arg_u8, &kind,
                                          oc_arg_u32, &seq, oc_arg_u16, &src, oc_arg_u16, &dst,
                                          oc_arg_u32, &length, &chunks, &data, &offset, &stride,
                                          &now))
        return NULL;
    PyObject *seq_fast = PySequence_Tuple(chunks); /* a list changed meanwhile cannot move it */
    PyObject *result = NULL;
    uint32_t *gs = NULL;
    if (seq_fast == NULL) goto done;
    Py_ssize_t count = PyTuple_GET_SIZE(seq_fast);
    if (count == 0) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    /* the run must lie inside the buffer: every payload, at its stride */
    if (offset < 0 || stride < 0 || offset > data.len || (Py_ssize_t)length > data.len - offset ||
        (count > 1 && (stride == 0 || stride < (Py_ssize_t)length ||
                       (data.len - offset - (Py_ssize_t)length) / stride < count - 1))) {
        PyErr_SetString(PyExc_ValueError, "the run does not lie inside its buffer");
        goto done;
    }
    gs = PyMem_Malloc(sizeof(uint32_t) * (size_t)count);
    if (gs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++)
        if (!oc_arg_u32(PyTuple_GET_ITEM(seq_fast, i), &gs[i])) goto done;
    oc_header hdr = {kind, 0, 0, seq, src, dst, gs[0], length, 0};
    oc_agg_receive_run(self->agg, h, &hdr, gs, (size_t)count, data.buf, (size_t)offset,
                       (size_t)stride, now);
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(gs);
    Py_XDECREF(seq_fast);
    PyBuffer_Release(&data);
    return result;
}

static PyObject *Aggregator_feed(Aggregator *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t segment;
    double now;
    if (!ready(self) || !PyArg_ParseTuple(args, "y*nd", &data, &segment, &now)) return NULL;
    if (segment <= 0) {
        PyBuffer_Release(&data);
        return PyErr_Format(PyExc_ValueError, "segment size %zd", segment);
    }
    oc_agg_feed(self->agg, data.buf, (size_t)data.len, (size_t)segment, now);
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
}

static PyObject *Aggregator_timer(Aggregator *self, PyObject *Py_UNUSED(ignored)) {
    if (!ready(self)) return NULL;
    double t = oc_agg_timer(self->agg);
    if (t < 0) Py_RETURN_NONE;
    return PyFloat_FromDouble(t);
}

static PyObject *Aggregator_handle_timer(Aggregator *self, PyObject *arg) {
    double now = PyFloat_AsDouble(arg);
    if (!ready(self) || (now == -1.0 && PyErr_Occurred())) return NULL;
    oc_agg_handle_timer(self->agg, now);
    Py_RETURN_NONE;
}

/* [(handle, dst, kind, seq, chunk, payload bytes)], the outbox emptied */
static PyObject *Aggregator_take_outbox(Aggregator *self, PyObject *Py_UNUSED(ignored)) {
    if (!ready(self)) return NULL;
    size_t n = oc_agg_outbox_count(self->agg);
    PyObject *list = PyList_New(0);
    if (list == NULL) return NULL;
    for (size_t i = 0; i < n; i++) {
        const oc_out *o = oc_agg_outbox(self->agg, i);
        const uint8_t *payload = oc_agg_payload(self->agg, o);
        if (payload == NULL) continue; /* a result no longer to be sent */
        PyObject *item = Py_BuildValue("iIIIIy#", o->handle, o->dst, o->kind, o->seq, o->chunk,
                                       (const char *)payload, (Py_ssize_t)o->len);
        if (item == NULL || PyList_Append(list, item)) {
            Py_XDECREF(item);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(item);
    }
    oc_agg_outbox_clear(self->agg);
    return list;
}

static void collect(void *ctx, int handle, uint16_t dst, const uint8_t *data, size_t len,
                    size_t segment) {
    PyObject *list = ctx;
    PyObject *item = Py_BuildValue("iIy#n", handle, dst, (const char *)data, (Py_ssize_t)len,
                                   (Py_ssize_t)segment);
    if (item == NULL || PyList_Append(list, item)) PyErr_Clear(); /* raised after the flush */
    Py_XDECREF(item);
}

/* [(handle, dst, sealed datagrams back to back, segment size)]: what a shard would send */
static PyObject *Aggregator_flush(Aggregator *self, PyObject *Py_UNUSED(ignored)) {
    if (!ready(self)) return NULL;
    PyObject *list = PyList_New(0);
    if (list == NULL) return NULL;
    oc_agg_flush(self->agg, collect, list);
    return list;
}

/* (drops, stats): each a dict of the counters that are not zero, by name */
static PyObject *Aggregator_counters(Aggregator *self, PyObject *Py_UNUSED(ignored)) {
    if (!ready(self)) return NULL;
    PyObject *drops = oc_py_counts(oc_agg_drops(self->agg), oc_drop_names, OC_DROP_COUNT, 1);
    PyObject *stats = oc_py_counts(oc_agg_stats(self->agg), oc_stat_names, OC_STAT_COUNT, 1);
    PyObject *pair = drops && stats ? PyTuple_Pack(2, drops, stats) : NULL;
    Py_XDECREF(drops);
    Py_XDECREF(stats);
    return pair;
}

static PyObject *Aggregator_memory(Aggregator *self, PyObject *Py_UNUSED(ignored)) {
    if (!ready(self)) return NULL;
    return Py_BuildValue("KKK", (unsigned long long)oc_agg_pool_bytes(self->agg),
                         (unsigned long long)oc_agg_peak_pool_bytes(self->agg),
                         (unsigned long long)oc_agg_kept_pool_bytes(self->agg));
}

static PyObject *Aggregator_resend_timeout(Aggregator *self, PyObject *args) {
    int h;
    uint32_t owner;
    if (!ready(self) || !PyArg_ParseTuple(args, "iO&", &h, oc_arg_u32, &owner)) return NULL;
    double t = oc_agg_resend_timeout(self->agg, h, owner);
    if (t < 0) return PyErr_Format(PyExc_ValueError, "no rank %u in communicator %d", owner, h);
    return PyFloat_FromDouble(t);
}

/* [(seq, chunks released)] of a communicator's reductions in flight */
static PyObject *Aggregator_reductions(Aggregator *self, PyObject *arg) {
    int h;
    if (!ready(self) || !PyArg_Parse(arg, "i", &h)) return NULL;
    uint32_t seqs[OC_MAX_REDUCTIONS], released[OC_MAX_REDUCTIONS];
    int n = oc_agg_reductions(self->agg, h, seqs, released, OC_MAX_REDUCTIONS);
    if (n < 0) return PyErr_Format(PyExc_ValueError, "no communicator %d", h);
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        PyObject *item = Py_BuildValue("II", seqs[i], released[i]);
        if (item == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

static PyMethodDef Aggregator_methods[] = {
    {"register", (PyCFunction)(void (*)(void))Aggregator_register, METH_VARARGS | METH_KEYWORDS,
     "register(job, comm, world, slots=0, key=None, counter=0) -> (handle, slots granted)"},
    {"unregister", (PyCFunction)Aggregator_unregister, METH_O, "unregister(handle)"},
    {"set_address", (PyCFunction)Aggregator_set_address, METH_VARARGS,
     "set_address(handle, rank, 'a.b.c.d' or its 4 bytes, port, hears_group)"},
    {"set_group", (PyCFunction)Aggregator_set_group, METH_VARARGS,
     "set_group(handle, 'a.b.c.d' or its 4 bytes, port)"},
    {"receive_run", (PyCFunction)Aggregator_receive_run, METH_VARARGS,
     "receive_run(handle, kind, seq, src, dst, length, chunks, data, offset, stride, now)"},
    {"feed", (PyCFunction)Aggregator_feed, METH_VARARGS, "feed(datagrams, segment, now)"},
    {"timer", (PyCFunction)Aggregator_timer, METH_NOARGS, "when to call handle_timer, or None"},
    {"handle_timer", (PyCFunction)Aggregator_handle_timer, METH_O, "handle_timer(now)"},
    {"take_outbox", (PyCFunction)Aggregator_take_outbox, METH_NOARGS,
     "the messages waiting, unsealed: [(handle, dst, kind, seq, chunk, payload)]"},
    {"flush", (PyCFunction)Aggregator_flush, METH_NOARGS,
     "the messages waiting, sealed in batches: [(handle, dst, datagrams, segment)]"},
    {"counters", (PyCFunction)Aggregator_counters, METH_NOARGS, "(drops, stats) by name"},
    {"memory", (PyCFunction)Aggregator_memory, METH_NOARGS, "(pool bytes, peak pool bytes, bytes of the pool kept for the next reduction)"},
    {"resend_timeout", (PyCFunction)Aggregator_resend_timeout, METH_VARARGS,
     "resend_timeout(handle, owner) -> seconds"},
    {"reductions", (PyCFunction)Aggregator_reductions, METH_O,
     "reductions(handle) -> [(seq, released)]"},
    {NULL, NULL, 0, NULL},
};

OC_PY_TYPE(Aggregator, (destructor)Aggregator_dealloc, NULL,
           "The aggregator's reduction engine and data path "
           "(overcast/native/aggregator/aggregator.h).");
