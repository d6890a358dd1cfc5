/*
 * hicached.copy._copykernel: the module table, and the int64 buffer check both halves share.
 * copykernel.c: copy_pages (CPU). pagescan.c: scan_pages (page id batches). cudasubmit.c: cuda_submit (GPU). faultguard.c: the SIGBUS
 * guard copies run under.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include "kernel.h"

int get_i64_buffer(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != 8 || view->format == NULL ||
        (strcmp(view->format, "q") != 0 && strcmp(view->format, "l") != 0 &&
         strcmp(view->format, "<q") != 0 && strcmp(view->format, "<l") != 0 &&
         strcmp(view->format, "=q") != 0 && strcmp(view->format, "=l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 buffer", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyMethodDef methods[] = {
    {"cuda_submit", cuda_submit, METH_VARARGS,
     "cuda_submit(memcpy_async, memcpy2d_async, stream, dst, src, dpitch, spitch, width, "
     "height) -> (segments submitted, CUresult of the first failure or 0)"},
    {"copy_pages", copy_pages, METH_VARARGS,
     "copy_pages(dst_base, src_base, dst_pages, src_pages, unit_bytes, units, dst_pitch, "
     "src_pitch, dst_stride, src_stride, nthreads, min_parallel_bytes, streaming_bytes, "
     "layer_inner) -> bytes copied"},
    {"scan_pages", scan_pages, METH_VARARGS,
     "scan_pages(pages, upper, unique) -> (first out of range, count, first repeat, count, "
     "min, max)"},
    {"set_copy_spin", set_copy_spin, METH_VARARGS,
     "set_copy_spin(ns) -> previous: how long copy workers spin after a job before sleeping"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copykernel",
                                    "Strided page copies between raw addresses.", -1, methods};

PyObject *BufferFaultError = NULL;

PyMODINIT_FUNC PyInit__copykernel(void) {
    if (fault_guard_install() != 0) return PyErr_SetFromErrno(PyExc_OSError);
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    BufferFaultError = PyErr_NewExceptionWithDoc(
        "hicached.copy._copykernel.BufferFault",
        "Worker memory vanished under a copy (SIGBUS: its shared-memory file was truncated).",
        PyExc_OSError, NULL);
    if (BufferFaultError == NULL || PyModule_AddObjectRef(m, "BufferFault", BufferFaultError) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
