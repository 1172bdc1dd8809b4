/* Converters for PyArg_Parse's "O&": a whole number within a C type's range, or OverflowError.
 * The "I", "K" and "H" formats take any int modulo 2^n, so a negative or too large value would
 * silently become another, valid-looking one (a kind, a destination, a port). */
#ifndef OC_PYARGS_H
#define OC_PYARGS_H

#include <Python.h>
#include <stdint.h>

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

#endif
