/* Budget: a link direction's token bucket (budget.h), shared by the collectives of one plane,
 * which may change it without the GIL while it serves. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "binding.h"
#include "rank/budget.h"

/* -- Budget ------------------------------------------------------------------------------- */


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
OC_PY_TYPE(Budget, NULL, Budget_getset,
           "Budget(rate, burst_seconds, batch, datagram_bytes, reduction_batch): a link "
           "direction's token bucket (overcast/native/rank/budget.h).");
