/* What the binding's files (bind_*.c, module.c) share: the objects one type's methods reach in
 * another's, the types, and the helpers every type uses: argument converters, the guard against
 * a call while the GIL-free loop runs, counters as a dict, an IPv4 address.
 *
 * Converters for PyArg_Parse's "O&": a whole number within a C type's range, or OverflowError.
 * The "I", "K" and "H" formats take any int modulo 2^n, so a negative or too large value would
 * silently become another, valid-looking one (a kind, a destination, a port).
 *
 * Ownership: each object owns its C state (a Sealer its oc_sealer, a Budget its oc_budget),
 * freed with it; another type's object that uses it (a Plane) holds a reference meanwhile. */
#ifndef OC_BINDING_H
#define OC_BINDING_H

#include <Python.h>
#include <arpa/inet.h>
#include <stdint.h>

#include "rank/budget.h"
#include "common/wire.h"

static inline int oc_arg_unsigned(PyObject *o, unsigned long long max, unsigned long long *out) {
    PyObject *index = PyNumber_Index(o);
    if (index == NULL) return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(index); /* OverflowError if negative */
    Py_DECREF(index);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return 0;
    if (v > max) {
        PyErr_Format(PyExc_OverflowError, "%llu is out of range (at most %llu)", v, max);
        return 0;
    }
    *out = v;
    return 1;
}

#define OC_ARG_CONVERTER(name, type, max)                                                     \
    static inline int name(PyObject *o, void *p) {                                           \
        unsigned long long v;                                                                 \
        if (!oc_arg_unsigned(o, max, &v)) return 0;                                           \
        *(type *)p = (type)v;                                                                 \
        return 1;                                                                             \
    }
OC_ARG_CONVERTER(oc_arg_u8, uint8_t, UINT8_MAX)
OC_ARG_CONVERTER(oc_arg_u16, uint16_t, UINT16_MAX)
OC_ARG_CONVERTER(oc_arg_u32, uint32_t, UINT32_MAX)
OC_ARG_CONVERTER(oc_arg_u64, uint64_t, UINT64_MAX)
#undef OC_ARG_CONVERTER

/* An IPv4 address, "a.b.c.d" or its 4 bytes, in network order. */
static inline int oc_arg_ipv4(PyObject *o, void *p) {
    struct in_addr a;
    if (PyUnicode_Check(o)) {
        const char *text = PyUnicode_AsUTF8(o);
        if (text == NULL) return 0;
        if (inet_pton(AF_INET, text, &a) != 1) {
            PyErr_Format(PyExc_ValueError, "%s is not an IPv4 address", text);
            return 0;
        }
    } else {
        Py_buffer b;
        if (PyObject_GetBuffer(o, &b, PyBUF_SIMPLE) < 0) return 0;
        int fits = b.len == 4;
        if (fits) memcpy(&a.s_addr, b.buf, 4);
        PyBuffer_Release(&b);
        if (!fits) {
            PyErr_SetString(PyExc_ValueError, "an IPv4 address is \"a.b.c.d\" or 4 bytes");
            return 0;
        }
    }
    *(uint32_t *)p = a.s_addr;
    return 1;
}

/* 1 if a core object (`made`) may be called now; 0 with RuntimeError if it was never made or
 * its loop is running without the GIL on another thread (`serving`). */
static inline int oc_py_usable(int made, int serving, const char *what) {
    if (!made) {
        PyErr_Format(PyExc_RuntimeError, "the %s was not initialised", what);
        return 0;
    }
    if (serving) {
        PyErr_Format(PyExc_RuntimeError, "the %s is serving on another thread", what);
        return 0;
    }
    return 1;
}

/* Counters as a dict by name; with `nonzero` those that are not zero only. */
static inline PyObject *oc_py_counts(const uint64_t *values, const char *const *names, int n,
                                     int nonzero) {
    PyObject *d = PyDict_New();
    for (int i = 0; d && i < n; i++) {
        if (nonzero && !values[i]) continue;
        PyObject *v = PyLong_FromUnsignedLongLong(values[i]);
        if (v == NULL || PyDict_SetItemString(d, names[i], v)) Py_CLEAR(d);
        Py_XDECREF(v);
    }
    return d;
}

/* Objects another type's methods reach into (a Plane seals with a Sealer, paces with a Budget). */
typedef struct {
    PyObject_HEAD
    oc_sealer s;
    int ready;
    int lent;  /* its plane seals with it now, the GIL released: its counter is the plane's */
    int owned; /* a plane seals with it: no other plane may (their sealing would race) */
} Sealer;

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

extern PyTypeObject AggregatorType, ShardsType, SealerType, TagCheckType, BudgetType, PlaneType;

/* The type object of Name (its struct Name, its Name_init and Name_methods), named
 * overcast.native._core.Name; dealloc and getset may be NULL. */
#define OC_PY_TYPE(Name, dealloc, getset, doc)                                                 \
    PyTypeObject Name##Type = {                                                               \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "overcast.native._core." #Name,              \
        .tp_doc = doc,                                                                        \
        .tp_basicsize = sizeof(Name),                                                         \
        .tp_flags = Py_TPFLAGS_DEFAULT,                                                       \
        .tp_new = PyType_GenericNew,                                                          \
        .tp_init = (initproc)Name##_init,                                                     \
        .tp_dealloc = dealloc,                                                                \
        .tp_methods = Name##_methods,                                                         \
        .tp_getset = getset,                                                                  \
    }

#endif
