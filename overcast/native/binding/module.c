/* overcast.native._core: the native core's Python face, one bind_*.c per type (binding.h has
 * what they share). The boundary is coarse: a call takes a run or a whole read of datagrams, a
 * timer tick, a batch to send, or (serve) the data path until something needs Python; never one
 * call per datagram. Buffers passed in are read during the call only unless a type's file says
 * it holds them. serve releases the GIL and touches no Python object while it runs. One function
 * besides the types: store_u32_fenced, the stream gates' store. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "aggregator/aggregator.h"
#include "binding.h"
#include "rank/port.h"
#include "aggregator/service.h"

/* store_u32_fenced(words, index, value): words[index] = value, every store before it made
 * visible first. A stream gate's word (overcast/staging.py): the GPU polls it in pinned host
 * memory and, once it reads the value, copies what the host wrote before (a collective's result)
 * back. x86 keeps stores in order (the fence there keeps the compiler from moving them); aarch64
 * does not, and its fence must order them for the GPU, an observer outside the CPUs' inner
 * shareable domain: `dmb sy` (Linux orders memory a device reads with `dmb osh`; sy covers it).
 * The fence is cumulative: it orders the stores of the thread that wrote the result too, which
 * this thread saw through the lock that told it the collective was done. `words` is a writable
 * buffer, read during the call only; index is in 32-bit words. */
static PyObject *store_u32_fenced(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b;
    Py_ssize_t index;
    uint32_t value;
    if (!PyArg_ParseTuple(args, "w*nO&", &b, &index, oc_arg_u32, &value)) return NULL;
    if (index < 0 || index >= b.len / 4 || (uintptr_t)b.buf % 4 != 0) {
        PyErr_Format(PyExc_IndexError, "word %zd is not in a 4-aligned buffer of %zd words", index,
                     b.len / 4);
        PyBuffer_Release(&b);
        return NULL;
    }
#if defined(__aarch64__)
    __asm__ __volatile__("dmb sy" ::: "memory");
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
    __atomic_store_n((uint32_t *)b.buf + index, value, __ATOMIC_RELEASE);
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

static PyMethodDef module_functions[] = {
    {"store_u32_fenced", store_u32_fenced, METH_VARARGS,
     "store_u32_fenced(words, index, value): words[index] = value (32-bit), after a full fence."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "overcast.native._core",
    "overcast's native core: the per-datagram data path in C.", -1, module_functions, NULL, NULL,
    NULL, NULL,
};

/* A float constant; the module holds its own reference, whatever happens. */
static int add_float(PyObject *m, const char *name, double value) {
    PyObject *f = PyFloat_FromDouble(value);
    if (f == NULL) return -1;
    int result = PyModule_AddObjectRef(m, name, f);
    Py_DECREF(f);
    return result;
}

/* The types, each named by its tp_name's last part, and the port's and routes' constants. */
static int add_types(PyObject *m) {
    PyTypeObject *types[] = {&AggregatorType, &ShardsType, &SealerType, &TagCheckType,
                             &BudgetType, &PlaneType};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (PyModule_AddType(m, types[i]) < 0) return -1;
    static const struct { const char *name; int value; } constants[] = {
        {"PORT_PYTHON", OC_PORT_PYTHON}, {"PORT_RUNS", OC_PORT_RUNS},
        {"PORT_NEWS", OC_PORT_NEWS}, {"PORT_DEADLINE", OC_PORT_DEADLINE},
        {"PORT_INTERRUPTED", OC_PORT_INTERRUPTED}, {"PORT_ERROR", OC_PORT_ERROR},
        {"ROUTE_AGGREGATOR", OC_ROUTE_AGGREGATOR}, {"ROUTE_GROUP", OC_ROUTE_GROUP},
        {"ROUTE_RANK", OC_ROUTE_RANK}, {"MAX_STRIPES", OC_MAX_STRIPES},
        {"OUTBOX_BYTES", OC_OUTBOX_BYTES},
    };
    for (size_t i = 0; i < sizeof constants / sizeof constants[0]; i++)
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0) return -1;
    return 0;
}

PyMODINIT_FUNC PyInit__core(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (add_types(m) < 0 ||
        PyModule_AddIntConstant(m, "SERVE_DEADLINE", OC_SERVE_DEADLINE) < 0 ||
        PyModule_AddIntConstant(m, "SERVE_INTERRUPTED", OC_SERVE_INTERRUPTED) < 0 ||
        PyModule_AddIntConstant(m, "MAX_REDUCTIONS", OC_MAX_REDUCTIONS) < 0 ||
        add_float(m, "RESEND_SECONDS", OC_RESEND_SECONDS) < 0 ||
        add_float(m, "MAX_RESEND_SECONDS", OC_MAX_RESEND_SECONDS) < 0 ||
        add_float(m, "EXPIRY_SECONDS", OC_EXPIRY_SECONDS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
