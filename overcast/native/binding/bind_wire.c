/* Sealer (a communicator key's sender side and its one counter) and TagCheck (its receiver
 * side), the Python face of wire.h and stream.h. A Sealer lent to a serving plane refuses every
 * call: two sealings at once would spend one counter twice. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "binding.h"
#include "rank/stream.h"
#include "common/wire.h"

/* -- Sealer ------------------------------------------------------------------------------- */


/* Two sealings at once would spend the same counter: the GCM nonce, repeated under one key. */
static int sealer_lent(Sealer *self) {
    if (self->lent)
        PyErr_SetString(PyExc_RuntimeError, "the sealer is in use by a plane serving on another "
                                            "thread");
    return self->lent;
}

/* Set `g` up under `key` (released here) for sealing or opening: 0, or -1 with an error. */
static int keyed(oc_gmac *g, Py_buffer *key, int sealing) {
    int bad = key->len != OC_KEY_BYTES;
    int failed = bad || oc_gmac_init(g, key->buf, sealing) != 0;
    PyBuffer_Release(key);
    if (bad)
        PyErr_Format(PyExc_ValueError, "a communicator key has %d bytes", OC_KEY_BYTES);
    else if (failed)
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL could not set up AES-GCM");
    return failed ? -1 : 0;
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
    self->ready = keyed(&self->s.gmac, &key, 1) == 0;
    if (!self->ready) return -1;
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

/* 1 if the sealer may seal now (keyed, and not lent to a serving plane); 0 with an error. */
static int can_seal(Sealer *self) {
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "the sealer has no key");
        return 0;
    }
    return !sealer_lent(self);
}

/* seal_into(buf, offset, kind, seq, dst, chunk, payload): returns the message's end in buf. */
static PyObject *Sealer_seal_into(Sealer *self, PyObject *args) {
    Py_buffer buf;
    Py_ssize_t offset;
    uint8_t kind;
    uint16_t dst;
    uint32_t seq, chunk;
    PyObject *payload;
    if (!can_seal(self)) return NULL;
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
    if (!can_seal(self)) return NULL;
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
OC_PY_TYPE(Sealer, (destructor)Sealer_dealloc, Sealer_getset,
           "Sealer(key, job, comm, src): AES-GMAC sealing under one key, one counter.");

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
    if (self->ready) oc_gmac_free(&self->g);
    self->ready = keyed(&self->g, &key, 0) == 0;
    if (!self->ready) return -1;
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
OC_PY_TYPE(TagCheck, (destructor)TagCheck_dealloc, NULL,
           "TagCheck(key): AES-GMAC tags checked under one key, set once.");
