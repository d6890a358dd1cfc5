/*
 * CUDA batch submission of hicached.copy._copykernel: enqueue a batch of 1-D / 2-D async copies
 * through driver entry points handed over as addresses (the module never links or includes
 * CUDA), with the GIL released. cuda_memcpy2d_t mirrors CUDA_MEMCPY2D (v2).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include "kernel.h"

typedef struct {
    size_t srcXInBytes, srcY;
    int srcMemoryType;
    const void *srcHost;
    unsigned long long srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    unsigned long long dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} cuda_memcpy2d_t;

typedef int (*cuda_memcpy_fn)(unsigned long long, unsigned long long, size_t, void *);
typedef int (*cuda_memcpy2d_fn)(const cuda_memcpy2d_t *, void *);

PyObject *cuda_submit(PyObject *self, PyObject *args) {
    unsigned long long f1, f2, stream;
    PyObject *objs[6];
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKOOOOOO", &f1, &f2, &stream, &objs[0], &objs[1], &objs[2],
                          &objs[3], &objs[4], &objs[5]))
        return NULL;
    static const char *names[6] = {"dst", "src", "dpitch", "spitch", "width", "height"};
    Py_buffer views[6];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 6; got++)
        if (get_i64_buffer(objs[got], &views[got], names[got]) < 0) goto done;
    Py_ssize_t n = views[0].len / 8;
    for (int i = 1; i < 6; i++)
        if (views[i].len / 8 != n) {
            PyErr_SetString(PyExc_ValueError, "segment arrays must have one length");
            goto done;
        }
    if (!f1 || !f2) {
        PyErr_SetString(PyExc_ValueError, "null CUDA entry point");
        goto done;
    }
    cuda_memcpy_fn memcpy1 = (cuda_memcpy_fn)(uintptr_t)f1;
    cuda_memcpy2d_fn memcpy2 = (cuda_memcpy2d_fn)(uintptr_t)f2;
    const int64_t *dst = views[0].buf, *src = views[1].buf, *dp = views[2].buf,
                  *sp = views[3].buf, *w = views[4].buf, *h = views[5].buf;
    Py_ssize_t i = 0;
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; i < n; i++) {
        if (h[i] == 1) {
            rc = memcpy1((unsigned long long)dst[i], (unsigned long long)src[i], (size_t)w[i],
                         (void *)(uintptr_t)stream);
        } else {
            cuda_memcpy2d_t c;
            memset(&c, 0, sizeof c);
            c.srcMemoryType = c.dstMemoryType = 4; /* CU_MEMORYTYPE_UNIFIED */
            c.srcDevice = (unsigned long long)src[i];
            c.dstDevice = (unsigned long long)dst[i];
            c.srcPitch = (size_t)sp[i];
            c.dstPitch = (size_t)dp[i];
            c.WidthInBytes = (size_t)w[i];
            c.Height = (size_t)h[i];
            rc = memcpy2((const cuda_memcpy2d_t *)&c, (void *)(uintptr_t)stream);
        }
        if (rc != 0) break;
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(ni)", i, rc);
done:
    for (int k = 0; k < got; k++) PyBuffer_Release(&views[k]);
    return result;
}
