/* Plane's multicast gathers (gather.h): posting one, its segments, what it stored and what it
 * asks to be sent again. A gather holds its buffer and budget until released (bind_plane.c). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "bind_plane.h"
#include "rank/gather.h"

static oc_gather *gather_of(Plane *self, uint32_t seq) {
    oc_gather *g = oc_plane_gatherer(self->plane, seq);
    if (g == NULL) PyErr_Format(PyExc_KeyError, "no gather #%u posted", seq);
    return g;
}

/* gather(seq, buffer, [(root, offset)], segment_bytes, chunk_bytes, mine, concurrent, budget) */
PyObject *Plane_gather(Plane *self, PyObject *args) {
    uint32_t seq, chunk_bytes, concurrent;
    uint64_t segment_bytes;
    int mine;
    PyObject *buffer, *segments, *budget;
    if (!plane_usable(self) ||
        !PyArg_ParseTuple(args, "O&OOO&O&iO&O!", oc_arg_u32, &seq, &buffer, &segments, oc_arg_u64,
                          &segment_bytes, oc_arg_u32, &chunk_bytes, &mine, oc_arg_u32,
                          &concurrent, &BudgetType, &budget))
        return NULL;
    PyObject *seqf = PySequence_Tuple(segments); /* a list changed meanwhile cannot move it */
    if (seqf == NULL) return NULL;
    if (plane_hold_budget(self, budget)) {
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
    if (ok && plane_room_to_hold(self)) ok = 0;
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
        plane_release_held(&h);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad gather");
        return NULL;
    }
    self->held[self->nheld++] = h;
    Py_RETURN_NONE;
}

PyObject *Plane_gather_activate(Plane *self, PyObject *args) {
    uint32_t seq;
    double now;
    if (!plane_usable(self) || !PyArg_ParseTuple(args, "O&d", oc_arg_u32, &seq, &now)) return NULL;
    oc_gather *g = gather_of(self, seq);
    if (g == NULL) return NULL;
    oc_gather_activate(g, oc_plane_outbox(self->plane), now);
    Py_RETURN_NONE;
}

PyObject *Plane_gather_streams_ended(Plane *self, PyObject *args) {
    uint32_t seq;
    if (!plane_usable(self) || !PyArg_ParseTuple(args, "O&", oc_arg_u32, &seq)) return NULL;
    oc_gather *g = gather_of(self, seq);
    if (g == NULL) return NULL;
    return PyBool_FromLong(oc_gather_streams_ended(g));
}

PyObject *Plane_gather_store(Plane *self, PyObject *args) {
    uint32_t seq, first;
    Py_buffer payload;
    double now;
    if (!plane_usable(self) ||
        !PyArg_ParseTuple(args, "O&O&y*d", oc_arg_u32, &seq, oc_arg_u32, &first, &payload, &now))
        return NULL;
    oc_gather *g = gather_of(self, seq);
    uint32_t fresh = 0;
    int why = g ? oc_gather_store(g, first, payload.buf, (size_t)payload.len, now, &fresh) : 0;
    PyBuffer_Release(&payload);
    if (g == NULL) return NULL;
    return Py_BuildValue("(iI)", why, fresh);
}

PyObject *Plane_gather_have(Plane *self, PyObject *args) {
    uint32_t seq, first, count;
    if (!plane_usable(self) || !PyArg_ParseTuple(args, "O&O&O&", oc_arg_u32, &seq, oc_arg_u32, &first,
                                           oc_arg_u32, &count))
        return NULL;
    oc_gather *g = gather_of(self, seq);
    if (g == NULL) return NULL;
    return PyLong_FromLong(oc_gather_have(g, first, count));
}

PyObject *Plane_gather_request(Plane *self, PyObject *args) {
    uint32_t seq, s, lo, hi;
    if (!plane_usable(self) || !PyArg_ParseTuple(args, "O&O&O&O&", oc_arg_u32, &seq, oc_arg_u32, &s,
                                           oc_arg_u32, &lo, oc_arg_u32, &hi))
        return NULL;
    oc_gather *g = gather_of(self, seq);
    if (g == NULL) return NULL;
    return PyBool_FromLong(oc_gather_request(g, s, lo, hi) == 0);
}

PyObject *Plane_gather_requests(Plane *self, PyObject *arg) {
    uint32_t seq;
    if (!oc_arg_u32(arg, &seq) || !plane_usable(self)) return NULL;
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

PyObject *Plane_gather_state(Plane *self, PyObject *arg) {
    uint32_t seq;
    if (!oc_arg_u32(arg, &seq) || !plane_usable(self)) return NULL;
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
