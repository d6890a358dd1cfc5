/*
 * hicached._copykernel: page-granular strided copies between raw host addresses.
 *
 * One call copies a list of segments. A segment is a run of `npages` consecutive pages; a page is
 * `units` rows of `unit_bytes` bytes. Rows inside a page are `stride` bytes apart and pages
 * `pitch` bytes apart, separately for the destination and the source. When a side's rows are
 * contiguous (stride == unit_bytes) a page is one memcpy; when pages are contiguous too, a whole
 * run is one memcpy. The work is split over threads by pages, with the GIL released.
 *
 * Addresses are trusted: the Python planner derives them from validated indices and checks every
 * segment against its buffer bounds before calling.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const int64_t *dst;
    const int64_t *src;
    const int64_t *npages;
    Py_ssize_t nseg;
    int64_t unit_bytes, units, dst_pitch, src_pitch, dst_stride, src_stride;
} plan_t;

typedef struct {
    const plan_t *plan;
    int64_t first_page; /* global page range [first_page, last_page) */
    int64_t last_page;
} work_t;

static void copy_pages(const plan_t *p, int64_t seg, int64_t p0, int64_t p1) {
    char *dst = (char *)(intptr_t)p->dst[seg];
    const char *src = (const char *)(intptr_t)p->src[seg];
    const int64_t ub = p->unit_bytes;
    const int64_t page_bytes = ub * p->units;
    const int dst_rows = p->dst_stride == ub, src_rows = p->src_stride == ub;
    if (dst_rows && src_rows && p->dst_pitch == page_bytes && p->src_pitch == page_bytes) {
        memcpy(dst + p0 * page_bytes, src + p0 * page_bytes, (size_t)((p1 - p0) * page_bytes));
        return;
    }
    for (int64_t i = p0; i < p1; i++) {
        char *d = dst + i * p->dst_pitch;
        const char *s = src + i * p->src_pitch;
        if (dst_rows && src_rows) {
            memcpy(d, s, (size_t)page_bytes);
        } else {
            for (int64_t r = 0; r < p->units; r++) {
                memcpy(d + r * p->dst_stride, s + r * p->src_stride, (size_t)ub);
            }
        }
    }
}

static void run_range(const plan_t *p, int64_t first, int64_t last) {
    int64_t base = 0;
    for (Py_ssize_t seg = 0; seg < p->nseg && base < last; seg++) {
        int64_t n = p->npages[seg];
        int64_t lo = first > base ? first - base : 0;
        int64_t hi = last - base < n ? last - base : n;
        if (lo < hi) copy_pages(p, seg, lo, hi);
        base += n;
    }
}

static void *worker(void *arg) {
    work_t *w = (work_t *)arg;
    run_range(w->plan, w->first_page, w->last_page);
    return NULL;
}

#define MAX_THREADS 64

static int get_i64_buffer(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != 8 || view->format == NULL ||
        (strcmp(view->format, "q") != 0 && strcmp(view->format, "l") != 0 &&
         strcmp(view->format, "<q") != 0 && strcmp(view->format, "<l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 buffer", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *copy_segments(PyObject *self, PyObject *args) {
    PyObject *dst_o, *src_o, *np_o;
    plan_t p;
    int nthreads;
    long long min_parallel_bytes;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOLLLLLLiL", &dst_o, &src_o, &np_o, &p.unit_bytes, &p.units,
                          &p.dst_pitch, &p.src_pitch, &p.dst_stride, &p.src_stride, &nthreads,
                          &min_parallel_bytes))
        return NULL;
    Py_buffer dv, sv, nv;
    if (get_i64_buffer(dst_o, &dv, "dst") < 0) return NULL;
    if (get_i64_buffer(src_o, &sv, "src") < 0) {
        PyBuffer_Release(&dv);
        return NULL;
    }
    if (get_i64_buffer(np_o, &nv, "npages") < 0) {
        PyBuffer_Release(&dv);
        PyBuffer_Release(&sv);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t nseg = dv.len / 8;
    if (sv.len / 8 != nseg || nv.len / 8 != nseg) {
        PyErr_SetString(PyExc_ValueError, "dst, src and npages must have equal length");
        goto done;
    }
    if (p.unit_bytes <= 0 || p.units <= 0) {
        PyErr_SetString(PyExc_ValueError, "unit_bytes and units must be positive");
        goto done;
    }
    p.dst = (const int64_t *)dv.buf;
    p.src = (const int64_t *)sv.buf;
    p.npages = (const int64_t *)nv.buf;
    p.nseg = nseg;
    int64_t total_pages = 0;
    for (Py_ssize_t i = 0; i < nseg; i++) {
        if (p.npages[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "npages must be non-negative");
            goto done;
        }
        total_pages += p.npages[i];
    }
    int64_t total_bytes = total_pages * p.units * p.unit_bytes;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if (total_bytes < min_parallel_bytes || total_pages < nthreads) nthreads = 1;

    Py_BEGIN_ALLOW_THREADS
    if (nthreads == 1) {
        run_range(&p, 0, total_pages);
    } else {
        pthread_t tids[MAX_THREADS];
        work_t work[MAX_THREADS];
        int started[MAX_THREADS];
        for (int t = 0; t < nthreads; t++) {
            work[t].plan = &p;
            work[t].first_page = total_pages * t / nthreads;
            work[t].last_page = total_pages * (t + 1) / nthreads;
            /* thread 0's share runs on this thread */
            started[t] = t > 0 && pthread_create(&tids[t], NULL, worker, &work[t]) == 0;
        }
        run_range(&p, work[0].first_page, work[0].last_page);
        for (int t = 1; t < nthreads; t++) {
            if (started[t]) pthread_join(tids[t], NULL);
            else run_range(&p, work[t].first_page, work[t].last_page);
        }
    }
    Py_END_ALLOW_THREADS

    result = PyLong_FromLongLong((long long)total_bytes);
done:
    PyBuffer_Release(&dv);
    PyBuffer_Release(&sv);
    PyBuffer_Release(&nv);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_segments", copy_segments, METH_VARARGS,
     "copy_segments(dst, src, npages, unit_bytes, units, dst_pitch, src_pitch, dst_stride, "
     "src_stride, nthreads, min_parallel_bytes) -> bytes copied"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copykernel",
                                    "Strided page copies between raw addresses.", -1, methods};

PyMODINIT_FUNC PyInit__copykernel(void) { return PyModule_Create(&module); }
