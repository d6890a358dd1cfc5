/* What the three sources of hicached.copy._copykernel share. */
#ifndef HICACHED_KERNEL_H
#define HICACHED_KERNEL_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>

/* A contiguous int64 buffer of `obj` in `view` (released by the caller), or -1 with a
 * TypeError naming `name`. */
int get_i64_buffer(PyObject *obj, Py_buffer *view, const char *name);

/* copy_pages(dst_base, src_base, dst_pages, src_pages, unit_bytes, units, dst_pitch,
 * src_pitch, dst_stride, src_stride, nthreads, min_parallel_bytes, streaming_bytes,
 * layer_inner) -> bytes copied */
PyObject *copy_pages(PyObject *self, PyObject *args);
/* set_copy_spin(ns) -> the previous value: how long a copy worker spins after its job before
 * sleeping (0, the default: it sleeps at once). */
PyObject *set_copy_spin(PyObject *self, PyObject *args);

/* scan_pages(pages, upper, unique) -> (first position outside [0, upper) or -1, how many,
 * first position repeating an earlier page or -1 (only checked when `unique` and all are in
 * range), how many repeat, min, max) */
PyObject *scan_pages(PyObject *self, PyObject *args);

/* cuda_submit(memcpy_async, memcpy2d_async, stream, dst, src, dpitch, spitch, width, height)
 * -> (segments submitted, CUresult of the first failure or 0) */
PyObject *cuda_submit(PyObject *self, PyObject *args);

/* faultguard.c: while a thread copies from or to worker memory, `fault_guard` points at its
 * jump buffer and a SIGBUS (a truncated shm file) jumps there instead of killing the daemon.
 * fault_guard_install() sets the handler up once (module init); -1 when sigaction fails. */
extern _Thread_local sigjmp_buf *fault_guard;
int fault_guard_install(void);

/* Raised by copy_pages when worker memory vanished under the copy (an OSError). */
extern PyObject *BufferFaultError;

#endif
