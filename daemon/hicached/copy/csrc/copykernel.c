/*
 * The CPU copy kernel of hicached.copy._copykernel: page-granular strided copies between raw
 * host addresses (module.c builds the module, cudasubmit.c adds the CUDA batch submission).
 *
 * One call copies page dst_pages[i] <- src_pages[i] at every layer of one component. Page p of
 * layer l starts at base[l] + p * pitch and is `units` rows of `unit_bytes` bytes, `stride` bytes
 * apart, separately for the destination and the source. When a side's rows are contiguous
 * (stride == unit_bytes) a page is one memcpy; runs of pages consecutive on both sides whose
 * pages are contiguous too are one memcpy. The (layer, page) items are split over threads, with
 * the GIL released.
 *
 * Addresses are trusted: the Python planner derives them from validated indices and checks the
 * extreme pages against the buffer bounds before calling.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include "kernel.h"
#include <stdatomic.h>
#include <time.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

typedef struct {
    const int64_t *dst_base; /* per layer */
    const int64_t *src_base;
    const int64_t *dst_pages; /* per page of the batch */
    const int64_t *src_pages;
    int64_t nlayers, npages;
    int64_t unit_bytes, units, dst_pitch, src_pitch, dst_stride, src_stride;
    int streaming; /* non-temporal stores: the destination is not read again soon */
    int layer_inner; /* one side interleaves layers per row (page_first): walk it in order */
} plan_t;

/* memcpy, or with non-temporal stores for transfers far larger than the caches: they skip the
 * read-for-ownership of every destination line, as glibc's memcpy does for huge copies. */
static inline void copy_block(char *d, const char *s, size_t n, int streaming) {
#if defined(__SSE2__)
    if (streaming && n >= 256) {
        size_t head = (16 - ((uintptr_t)d & 15)) & 15;
        memcpy(d, s, head);
        d += head;
        s += head;
        n -= head;
        size_t body = n & ~(size_t)63;
        for (size_t o = 0; o < body; o += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + o));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + o + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + o + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + o + 48));
            _mm_stream_si128((__m128i *)(d + o), a);
            _mm_stream_si128((__m128i *)(d + o + 16), b);
            _mm_stream_si128((__m128i *)(d + o + 32), c);
            _mm_stream_si128((__m128i *)(d + o + 48), e);
        }
        memcpy(d + body, s + body, n - body);
        return;
    }
#endif
    (void)streaming;
    memcpy(d, s, n);
}

static inline void store_fence(int streaming) {
#if defined(__SSE2__)
    if (streaming) _mm_sfence();
#endif
    (void)streaming;
}

typedef struct {
    const plan_t *plan;
    int64_t first; /* work items [first, last): item = layer * npages + page position */
    int64_t last;
    int faulted; /* set by the helper: worker memory vanished under its range */
} work_t;

#define PREFETCH_MAX 4096

/* Ask for the next block's source lines while the current block is copied: random small rows
 * otherwise leave the memory system idle between copies (latency-bound, not bandwidth-bound).
 * Into every cache level (prefetcht0): the non-temporal hint (prefetchnta) kept them out of L2
 * and cost page_size 1 backups half their speed (0.36-0.44 -> 0.72-0.79 of a streaming copy
 * with 64-page batches; benchmarks/RESULTS.md). */
static inline void prefetch(const char *p, int64_t n) {
    if (n > PREFETCH_MAX) n = PREFETCH_MAX;
    for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 3);
}

/* Copy `n` consecutive pages starting at the given addresses. */
static void copy_run(const plan_t *p, char *dst, const char *src, int64_t n) {
    const int64_t ub = p->unit_bytes;
    const int64_t page_bytes = ub * p->units;
    const int dst_rows = p->dst_stride == ub, src_rows = p->src_stride == ub;
    if (dst_rows && src_rows && p->dst_pitch == page_bytes && p->src_pitch == page_bytes) {
        copy_block(dst, src, (size_t)(n * page_bytes), p->streaming);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        char *d = dst + i * p->dst_pitch;
        const char *s = src + i * p->src_pitch;
        if (dst_rows && src_rows) {
            if (i + 1 < n) prefetch(s + p->src_pitch, page_bytes);
            copy_block(d, s, (size_t)page_bytes, p->streaming);
        } else {
            for (int64_t r = 0; r < p->units; r++) {
                if (r + 1 < p->units) prefetch(s + (r + 1) * p->src_stride, ub);
                else if (i + 1 < n) prefetch(s + p->src_pitch, ub);
                copy_block(d + r * p->dst_stride, s + r * p->src_stride, (size_t)ub,
                           p->streaming);
            }
        }
    }
}

/* Layer-inner order for items = pages: row r of every layer before row r + 1, so the side
 * that keeps a token's layers side by side (page_first hosts) is read or written sequentially
 * instead of in unit-sized pieces a layer apart. */
static void run_range_layer_inner(const plan_t *p, int64_t first, int64_t last) {
    const int64_t ub = p->unit_bytes;
    for (int64_t i = first; i < last; i++) {
        int64_t doff = p->dst_pages[i] * p->dst_pitch, soff = p->src_pages[i] * p->src_pitch;
        for (int64_t r = 0; r < p->units; r++) {
            for (int64_t l = 0; l < p->nlayers; l++) {
                copy_block((char *)(intptr_t)(p->dst_base[l] + doff + r * p->dst_stride),
                           (const char *)(intptr_t)(p->src_base[l] + soff + r * p->src_stride),
                           (size_t)ub, p->streaming);
            }
        }
    }
    store_fence(p->streaming);
}

/* Runs of pages that are consecutive on both sides are copied together. */
static void run_range(const plan_t *p, int64_t first, int64_t last) {
    if (p->layer_inner) {
        run_range_layer_inner(p, first, last);
        return;
    }
    int64_t item = first;
    while (item < last) {
        int64_t layer = item / p->npages, i = item % p->npages;
        int64_t end = i + 1, stop = i + (last - item);
        if (stop > p->npages) stop = p->npages;
        while (end < stop && p->dst_pages[end] == p->dst_pages[end - 1] + 1 &&
               p->src_pages[end] == p->src_pages[end - 1] + 1)
            end++;
        char *dst = (char *)(intptr_t)(p->dst_base[layer] + p->dst_pages[i] * p->dst_pitch);
        const char *src =
            (const char *)(intptr_t)(p->src_base[layer] + p->src_pages[i] * p->src_pitch);
        if (item + (end - i) < last) { /* the next run's first row */
            int64_t nl = end < p->npages ? layer : layer + 1, ni = end < p->npages ? end : 0;
            prefetch((const char *)(intptr_t)(p->src_base[nl] + p->src_pages[ni] * p->src_pitch),
                     p->src_stride == p->unit_bytes ? p->unit_bytes * p->units : p->unit_bytes);
        }
        copy_run(p, dst, src, end - i);
        item += end - i;
    }
    store_fence(p->streaming);
}

/* A persistent pool of worker threads: creating threads per call costs more than copying a few
 * MB here (each new stack is fresh memory). After its job a worker sleeps at once, unless
 * set_copy_spin asked it to spin first (waking a sleeping thread costs a VM exit on virtual
 * machines, but a spinning one takes a CPU from the node's inference processes: it is the
 * operator's choice, measured in benchmarks). A dispatcher waiting for its helpers spins up to
 * SPIN_NS while they still copy its items, then sleeps. One caller
 * dispatches at a time; a concurrent caller runs on its own thread instead (it already adds
 * parallelism). Reset in a forked child.
 *
 * Each job is tagged with the generation it was dispatched in, and a worker runs its job only
 * when the tag equals the generation it woke for. A worker that saw a dispatch late (after it
 * had finished and the next one, with more helpers, had begun) therefore skips instead of
 * running the next dispatch's job twice: that double run ended a dispatch early and let a
 * helper read the returned caller's plan. */
#define MAX_THREADS 64
#define SPIN_NS 1000000L
static atomic_long worker_spin_ns = 0; /* spin after a job before sleeping (set_copy_spin) */

static pthread_mutex_t dispatch_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv_work = PTHREAD_COND_INITIALIZER;
static pthread_cond_t cv_done = PTHREAD_COND_INITIALIZER;
static int nworkers = 0, sleepers = 0;
static atomic_int pending = 0;
static atomic_uint_fast64_t generation = 0;
static work_t jobs[MAX_THREADS];
static atomic_uint_fast64_t job_generation[MAX_THREADS]; /* the dispatch each job belongs to */
static uint64_t start_generation[MAX_THREADS]; /* generation a worker was created in */
static int atfork_registered = 0;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* run_range under the SIGBUS guard: 0, or -1 when memory under the range vanished. */
static int guarded_range(const plan_t *p, int64_t first, int64_t last) {
    sigjmp_buf jump;
    if (sigsetjmp(jump, 1) != 0) return -1; /* the handler disarmed the guard */
    fault_guard = &jump;
    run_range(p, first, last);
    fault_guard = NULL;
    return 0;
}

static void *pool_worker(void *arg) {
    int idx = (int)(intptr_t)arg;
    pthread_mutex_lock(&mu);
    uint64_t seen = start_generation[idx];
    pthread_mutex_unlock(&mu);
    for (;;) {
        uint64_t g = atomic_load(&generation);
        long spin = atomic_load(&worker_spin_ns);
        if (g == seen && spin > 0) {
            int64_t deadline = now_ns() + spin;
            for (int i = 0; (g = atomic_load(&generation)) == seen; i++) {
                cpu_relax();
                if ((i & 255) == 0 && now_ns() > deadline) break;
            }
        }
        if (g == seen) {
            pthread_mutex_lock(&mu);
            sleepers++;
            while ((g = atomic_load(&generation)) == seen) pthread_cond_wait(&cv_work, &mu);
            sleepers--;
            pthread_mutex_unlock(&mu);
        }
        seen = g;
        if (atomic_load(&job_generation[idx]) == g) {
            work_t w = jobs[idx];
            jobs[idx].faulted = guarded_range(w.plan, w.first, w.last) != 0;
            if (atomic_fetch_sub(&pending, 1) == 1) {
                pthread_mutex_lock(&mu);
                pthread_cond_signal(&cv_done);
                pthread_mutex_unlock(&mu);
            }
        }
    }
    return NULL;
}

static void reset_after_fork(void) {
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c = PTHREAD_COND_INITIALIZER;
    dispatch_lock = m;
    mu = m;
    cv_work = c;
    cv_done = c;
    nworkers = sleepers = 0;
    atomic_store(&pending, 0);
}

/* Start workers up to `want`; returns how many exist. Called with dispatch_lock held. */
static int ensure_workers(int want) {
    if (!atfork_registered) {
        pthread_atfork(NULL, NULL, reset_after_fork);
        atfork_registered = 1;
    }
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    while (nworkers < want) {
        pthread_t tid;
        start_generation[nworkers] = atomic_load(&generation);
        if (pthread_create(&tid, &attr, pool_worker, (void *)(intptr_t)nworkers) != 0) break;
        nworkers++;
    }
    pthread_attr_destroy(&attr);
    return nworkers;
}

/* Split items [0, items) over the calling thread and up to nthreads - 1 workers; -1 when any
 * part faulted (the others still ran to their end). */
static int run_parallel(const plan_t *p, int64_t items, int nthreads) {
    if (nthreads > 1 && pthread_mutex_trylock(&dispatch_lock) == 0) {
        int helpers = ensure_workers(nthreads - 1);
        if (helpers > nthreads - 1) helpers = nthreads - 1;
        int parts = helpers + 1;
        /* only this dispatcher moves the generation (dispatch_lock is held) */
        uint64_t next = atomic_load(&generation) + 1;
        for (int t = 0; t < helpers; t++) {
            jobs[t].plan = p;
            jobs[t].first = items * (t + 1) / parts;
            jobs[t].last = items * (t + 2) / parts;
            jobs[t].faulted = 0;
            atomic_store(&job_generation[t], next);
        }
        atomic_store(&pending, helpers);
        pthread_mutex_lock(&mu);
        atomic_fetch_add(&generation, 1);
        if (sleepers) pthread_cond_broadcast(&cv_work);
        pthread_mutex_unlock(&mu);
        int faulted = guarded_range(p, 0, items / parts) != 0;
        int64_t deadline = now_ns() + SPIN_NS;
        for (int i = 0; atomic_load(&pending) > 0; i++) {
            cpu_relax();
            if ((i & 255) == 0 && now_ns() > deadline) break;
        }
        pthread_mutex_lock(&mu);
        while (atomic_load(&pending) > 0) pthread_cond_wait(&cv_done, &mu);
        pthread_mutex_unlock(&mu);
        for (int t = 0; t < helpers; t++) faulted |= jobs[t].faulted;
        pthread_mutex_unlock(&dispatch_lock);
        return faulted ? -1 : 0;
    }
    return guarded_range(p, 0, items);
}

PyObject *set_copy_spin(PyObject *self, PyObject *args) {
    long long ns;
    (void)self;
    if (!PyArg_ParseTuple(args, "L", &ns)) return NULL;
    if (ns < 0 || ns > 100000000LL) {
        PyErr_SetString(PyExc_ValueError, "spin must be within 0 .. 100 ms");
        return NULL;
    }
    long old = atomic_exchange(&worker_spin_ns, (long)ns);
    return PyLong_FromLong(old);
}

PyObject *copy_pages(PyObject *self, PyObject *args) {
    PyObject *objs[4];
    plan_t p;
    int nthreads;
    long long min_parallel_bytes, streaming_bytes;
    int layer_inner;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOLLLLLLiLLp", &objs[0], &objs[1], &objs[2], &objs[3],
                          &p.unit_bytes, &p.units, &p.dst_pitch, &p.src_pitch, &p.dst_stride,
                          &p.src_stride, &nthreads, &min_parallel_bytes, &streaming_bytes,
                          &layer_inner))
        return NULL;
    static const char *names[4] = {"dst_base", "src_base", "dst_pages", "src_pages"};
    Py_buffer views[4];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 4; got++) {
        if (get_i64_buffer(objs[got], &views[got], names[got]) < 0) goto done;
    }
    p.dst_base = (const int64_t *)views[0].buf;
    p.src_base = (const int64_t *)views[1].buf;
    p.dst_pages = (const int64_t *)views[2].buf;
    p.src_pages = (const int64_t *)views[3].buf;
    p.nlayers = views[0].len / 8;
    p.npages = views[2].len / 8;
    if (views[1].len / 8 != p.nlayers || views[3].len / 8 != p.npages) {
        PyErr_SetString(PyExc_ValueError, "base and page arrays must pair up");
        goto done;
    }
    if (p.unit_bytes <= 0 || p.units <= 0) {
        PyErr_SetString(PyExc_ValueError, "unit_bytes and units must be positive");
        goto done;
    }
    p.layer_inner = layer_inner;
    int64_t items = layer_inner ? p.npages : p.nlayers * p.npages;
    int64_t total_bytes = p.nlayers * p.npages * p.units * p.unit_bytes;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if (total_bytes < min_parallel_bytes || items < nthreads) nthreads = 1;
    p.streaming = streaming_bytes > 0 && total_bytes >= streaming_bytes;

    int faulted;
    Py_BEGIN_ALLOW_THREADS
    faulted = run_parallel(&p, items, nthreads);
    Py_END_ALLOW_THREADS

    if (faulted)
        PyErr_SetString(BufferFaultError,
                        "memory under the copy vanished (SIGBUS): a shared-memory file it "
                        "reads or writes was truncated");
    else
        result = PyLong_FromLongLong((long long)total_bytes);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    return result;
}
