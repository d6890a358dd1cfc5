/*
 * scan_pages: the native half of validating a batch of page ids (the fast path sends page
 * ids): one pass for the range and the extremes, one more for duplicates when the caller needs
 * the pages unique. A batch of tens of pages costs well under a microsecond here; numpy's
 * equivalent is a dozen calls of a microsecond or more each.
 */
#include "kernel.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The first position whose page appeared earlier in `p[0..n)` (all in [0, upper)), or -1;
 * `*dups` counts the positions that repeat an earlier page. Small batches compare pairwise,
 * larger ones mark a bitmap of `upper` bits. Returns -2 when the bitmap cannot be allocated. */
static int64_t first_repeat(const int64_t *p, int64_t n, int64_t upper, int64_t *dups) {
    int64_t first = -1;
    *dups = 0;
    if (n <= 48) {
        for (int64_t i = 1; i < n; i++)
            for (int64_t j = 0; j < i; j++)
                if (p[j] == p[i]) {
                    if (first < 0) first = i;
                    (*dups)++;
                    break;
                }
        return first;
    }
    size_t words = (size_t)(upper + 63) / 64;
    uint64_t *seen = calloc(words ? words : 1, sizeof(uint64_t));
    if (seen == NULL) return -2;
    for (int64_t i = 0; i < n; i++) {
        uint64_t bit = (uint64_t)1 << (p[i] & 63);
        uint64_t *w = &seen[p[i] >> 6];
        if (*w & bit) {
            if (first < 0) first = i;
            (*dups)++;
        }
        *w |= bit;
    }
    free(seen);
    return first;
}

PyObject *scan_pages(PyObject *self, PyObject *args) {
    PyObject *obj;
    long long upper;
    int unique;
    if (!PyArg_ParseTuple(args, "OLp", &obj, &upper, &unique)) return NULL;
    Py_buffer view;
    if (get_i64_buffer(obj, &view, "pages") < 0) return NULL;
    const int64_t *p = (const int64_t *)view.buf;
    int64_t n = (int64_t)(view.len / 8);
    int64_t bad = -1, nbad = 0, lo = 0, hi = 0, rep = -1, dups = 0;
    if (n > 0) lo = hi = p[0];
    for (int64_t i = 0; i < n; i++) {
        int64_t v = p[i];
        if (v < 0 || v >= upper) {
            if (bad < 0) bad = i;
            nbad++;
        }
        if (v < lo) lo = v;
        if (v > hi) hi = v;
    }
    if (unique && bad < 0 && n > 1) {
        Py_BEGIN_ALLOW_THREADS
        rep = first_repeat(p, n, upper, &dups);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    if (rep == -2) return PyErr_NoMemory();
    return Py_BuildValue("(LLLLLL)", (long long)bad, (long long)nbad, (long long)rep,
                         (long long)dups, (long long)lo, (long long)hi);
}
