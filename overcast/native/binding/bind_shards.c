/* Shards: the aggregator service's data path over cores (shards.h). Python keeps the sockets
 * and the registration connections; every call here pauses the shards, does its work on every
 * engine, and lets them go, the GIL released while it waits for them to park. One thread drives
 * them (pauses do not nest): a call from another thread meanwhile raises RuntimeError. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>

#include "binding.h"
#include "aggregator/shards.h"

typedef struct {
    PyObject_HEAD
    oc_shards *shards;
    int pausing; /* a call waits, the GIL released, for the shards to park */
} Shards;

static int Shards_init(Shards *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"slots", "expiry", "fds", NULL};
    uint32_t slots;
    double expiry;
    PyObject *fds;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&dO", names, oc_arg_u32, &slots, &expiry, &fds))
        return -1;
    if (self->shards != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the shards are initialised already");
        return -1;
    }
    if (slots == 0 || !(expiry > 0)) {
        PyErr_SetString(PyExc_ValueError, "shards need at least 1 slot and an expiry above 0");
        return -1;
    }
    PyObject *fast = PySequence_Fast(fds, "the shards' sockets are a sequence of descriptors");
    if (fast == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n < 1 || n > OC_MAX_STRIPES) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "1 to %u shards, not %zd", OC_MAX_STRIPES, n);
        return -1;
    }
    int ints[OC_MAX_STRIPES];
    for (Py_ssize_t i = 0; i < n; i++)
        if ((ints[i] = PyObject_AsFileDescriptor(PySequence_Fast_GET_ITEM(fast, i))) < 0) {
            Py_DECREF(fast);
            return -1;
        }
    Py_DECREF(fast);
    self->shards = oc_shards_new((uint32_t)n, slots, expiry, ints);
    if (self->shards == NULL) { /* out of memory, or of descriptors (EMFILE) */
        if (errno == ENOMEM) PyErr_NoMemory();
        else PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static void Shards_dealloc(Shards *self) {
    if (self->shards) {
        Py_BEGIN_ALLOW_THREADS
        oc_shards_free(self->shards);
        Py_END_ALLOW_THREADS
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int made(Shards *self) {
    return oc_py_usable(self->shards != NULL, self->pausing, "shards");
}

/* Every engine to itself (the shards parked, at once if none has started), with the GIL
 * released while they park. */
static void pause_all(Shards *self) {
    self->pausing = 1;
    Py_BEGIN_ALLOW_THREADS
    oc_shards_pause(self->shards);
    Py_END_ALLOW_THREADS
}

static void resume_all(Shards *self) {
    oc_shards_resume(self->shards);
    self->pausing = 0;
}

/* Starts the threads not started yet. */
static PyObject *Shards_start(Shards *self, PyObject *Py_UNUSED(ignored)) {
    if (!made(self)) return NULL;
    if (oc_shards_start(self->shards)) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* register(job, comm, world, first, slots, key, counter, max_row) -> (handle, slots granted):
 * shard i takes it as the job's endpoint first + i. */
static PyObject *Shards_register(Shards *self, PyObject *args) {
    uint32_t job, comm, world, first, slots, max_row;
    uint64_t counter;
    Py_buffer key;
    if (!made(self) ||
        !PyArg_ParseTuple(args, "O&O&O&O&O&y*O&O&", oc_arg_u32, &job, oc_arg_u32, &comm,
                          oc_arg_u32, &world, oc_arg_u32, &first, oc_arg_u32, &slots, &key,
                          oc_arg_u64, &counter, oc_arg_u32, &max_row))
        return NULL;
    uint32_t n = oc_shards_count(self->shards);
    if (key.len != OC_KEY_BYTES || world == 0 || world > OC_MAX_WORLD ||
        first > OC_MAX_STRIPES - n) {
        PyBuffer_Release(&key);
        return PyErr_Format(PyExc_ValueError, "cannot register a world of %u ranks with a "
                            "%zd-byte key as endpoints %u to %u", world, key.len, first,
                            first + n - 1);
    }
    int handle = -1, failed = 0;
    uint32_t granted = 0;
    pause_all(self);
    for (uint32_t i = 0; i < n && !failed; i++) {
        uint32_t got;
        int h = oc_agg_register(oc_shards_engine(self->shards, i), job, comm, world, first + i,
                                slots, max_row, key.buf, counter, &got);
        /* every shard holds the same communicators in the same places */
        failed = h < 0 || (i > 0 && h != handle);
        handle = i == 0 ? h : handle;
        granted = got;
    }
    if (failed && handle >= 0)
        for (uint32_t i = 0; i < n; i++) oc_agg_unregister(oc_shards_engine(self->shards, i), handle);
    resume_all(self);
    PyBuffer_Release(&key);
    if (failed) return PyErr_NoMemory();
    return Py_BuildValue("iI", handle, granted);
}

/* comm_bytes(world, slots, max_row) -> the most a communicator can make every shard's engine
 * hold together, its keys' contexts aside (oc_agg_comm_bytes): linear in slots. */
static PyObject *Shards_comm_bytes(Shards *self, PyObject *args) {
    uint32_t world, slots, max_row;
    if (!made(self) || !PyArg_ParseTuple(args, "O&O&O&", oc_arg_u32, &world, oc_arg_u32, &slots,
                                         oc_arg_u32, &max_row))
        return NULL;
    return PyLong_FromUnsignedLongLong(oc_shards_count(self->shards) *
                                       oc_agg_comm_bytes(world, slots, max_row));
}

static PyObject *Shards_unregister(Shards *self, PyObject *arg) {
    int h;
    if (!made(self) || !PyArg_Parse(arg, "i", &h)) return NULL;
    pause_all(self);
    for (uint32_t i = 0; i < oc_shards_count(self->shards); i++)
        oc_agg_unregister(oc_shards_engine(self->shards, i), h);
    resume_all(self);
    Py_RETURN_NONE;
}

static PyObject *Shards_set_address(Shards *self, PyObject *args) {
    int h, hears, failed = 0;
    uint32_t rank, addr;
    uint16_t port;
    if (!made(self) || !PyArg_ParseTuple(args, "iO&O&O&p", &h, oc_arg_u32, &rank, oc_arg_ipv4,
                                         &addr, oc_arg_u16, &port, &hears))
        return NULL;
    pause_all(self);
    for (uint32_t i = 0; i < oc_shards_count(self->shards); i++)
        failed |= oc_agg_set_address(oc_shards_engine(self->shards, i), h, rank, addr,
                                     htons(port), hears);
    resume_all(self);
    if (failed) return PyErr_Format(PyExc_ValueError, "no rank %u in communicator %d", rank, h);
    Py_RETURN_NONE;
}

static PyObject *Shards_set_group(Shards *self, PyObject *args) {
    int h, failed = 0;
    uint16_t port;
    uint32_t addr;
    if (!made(self) ||
        !PyArg_ParseTuple(args, "iO&O&", &h, oc_arg_ipv4, &addr, oc_arg_u16, &port))
        return NULL;
    pause_all(self);
    for (uint32_t i = 0; i < oc_shards_count(self->shards); i++)
        failed |= oc_agg_set_group(oc_shards_engine(self->shards, i), h, addr, htons(port));
    resume_all(self);
    if (failed) return PyErr_Format(PyExc_ValueError, "no communicator %d", h);
    Py_RETURN_NONE;
}

/* What every shard counted, summed: (drops, stats, memory, io), io's data-path CPU and
 * contributions taken per shard. */
static PyObject *Shards_counters(Shards *self, PyObject *Py_UNUSED(ignored)) {
    if (!made(self)) return NULL;
    uint64_t drops[OC_DROP_COUNT] = {0}, stats[OC_STAT_COUNT] = {0}, pool = 0, peak = 0, kept = 0;
    uint32_t comms = 0; /* every shard holds the same ones */
    uint64_t reads = 0, sends = 0, in = 0, out = 0, wakeups = 0;
    int gro = 1, gso = 1;
    uint32_t n = oc_shards_count(self->shards);
    double cpu[OC_MAX_STRIPES];
    uint64_t taken[OC_MAX_STRIPES];
    pause_all(self);
    comms = oc_agg_communicators(oc_shards_engine(self->shards, 0));
    for (uint32_t i = 0; i < n; i++) {
        const oc_agg *a = oc_shards_engine(self->shards, i);
        for (int j = 0; j < OC_DROP_COUNT; j++) drops[j] += oc_agg_drops(a)[j];
        for (int j = 0; j < OC_STAT_COUNT; j++) stats[j] += oc_agg_stats(a)[j];
        pool += oc_agg_pool_bytes(a);
        peak += oc_agg_peak_pool_bytes(a); /* a bound: the shards' peaks need not coincide */
        kept += oc_agg_kept_pool_bytes(a);
        const oc_udp *u = oc_shards_udp(self->shards, i);
        reads += u->reads;
        sends += u->sends;
        in += u->datagrams_in;
        out += u->datagrams_out;
        gro &= u->gro;
        gso &= u->gso;
        cpu[i] = oc_shards_serve_stats(self->shards, i)->cpu_seconds;
        taken[i] = oc_agg_stats(a)[OC_STAT_contributions];
        wakeups += oc_shards_serve_stats(self->shards, i)->wakeups;
    }
    resume_all(self);
    PyObject *cpus = PyList_New(n), *takens = PyList_New(n);
    for (uint32_t i = 0; cpus && takens && i < n; i++) {
        PyObject *c = PyFloat_FromDouble(cpu[i]), *t = PyLong_FromUnsignedLongLong(taken[i]);
        if (c) PyList_SET_ITEM(cpus, i, c);
        if (t) PyList_SET_ITEM(takens, i, t);
        if (c == NULL || t == NULL) Py_CLEAR(cpus);
    }
    PyObject *d = oc_py_counts(drops, oc_drop_names, OC_DROP_COUNT, 1);
    PyObject *s = oc_py_counts(stats, oc_stat_names, OC_STAT_COUNT, 1);
    PyObject *result = NULL;
    if (cpus && takens && d && s)
        result = Py_BuildValue(
            "(OO{sKsKsKsI}{sKsKsKsKsKsisisOsO})", d, s, "pool_bytes", (unsigned long long)pool,
            "peak_pool_bytes", (unsigned long long)peak, "kept_pool_bytes",
            (unsigned long long)kept, "engine_communicators", comms, "reads", (unsigned long long)reads, "sends",
            (unsigned long long)sends, "datagrams_in", (unsigned long long)in, "datagrams_out",
            (unsigned long long)out, "wakeups", (unsigned long long)wakeups, "gro", gro, "gso",
            gso, "serve_cpu_seconds", cpus, "serve_contributions", takens);
    Py_XDECREF(cpus);
    Py_XDECREF(takens);
    Py_XDECREF(d);
    Py_XDECREF(s);
    return result;
}

/* Stop the threads and free the engines; the sockets stay the caller's. */
static PyObject *Shards_close(Shards *self, PyObject *Py_UNUSED(ignored)) {
    if (!oc_py_usable(1, self->pausing, "shards")) return NULL;
    if (self->shards) {
        oc_shards *s = self->shards;
        self->shards = NULL;
        Py_BEGIN_ALLOW_THREADS
        oc_shards_free(s);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyMethodDef Shards_methods[] = {
    {"start", (PyCFunction)Shards_start, METH_NOARGS, "start the shard threads"},
    {"register", (PyCFunction)Shards_register, METH_VARARGS,
     "register(job, comm, world, first, slots, key, counter, max_row) -> (handle, granted)"},
    {"unregister", (PyCFunction)Shards_unregister, METH_O, "unregister(handle)"},
    {"comm_bytes", (PyCFunction)Shards_comm_bytes, METH_VARARGS,
     "comm_bytes(world, slots, max_row) -> what a communicator can make the shards hold"},
    {"set_address", (PyCFunction)Shards_set_address, METH_VARARGS,
     "set_address(handle, rank, 'a.b.c.d' or its 4 bytes, port, hears_group)"},
    {"set_group", (PyCFunction)Shards_set_group, METH_VARARGS,
     "set_group(handle, 'a.b.c.d' or its 4 bytes, port)"},
    {"counters", (PyCFunction)Shards_counters, METH_NOARGS,
     "(drops, stats, memory, io) summed over the shards; io's serve_cpu_seconds per shard"},
    {"close", (PyCFunction)Shards_close, METH_NOARGS, "stop the threads, free the engines"},
    {NULL, NULL, 0, NULL},
};

OC_PY_TYPE(Shards, (destructor)Shards_dealloc, NULL,
           "The aggregator's data path over cores: shard threads "
           "(overcast/native/aggregator/shards.h).");
