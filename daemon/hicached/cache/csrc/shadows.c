/* hicached.cache._shadows: the reuse eviction policy's shadows (reuse_lru._Shadow), several
 * margins at once, in C, on a thread of their own: a pool's call only hashes its keys and
 * queues the sampled ids; the shadows replay them off the call's path, with the GIL free.
 *
 * Shadows(thetas, max_capacity, lag=0): one shadow per margin, each holding at most
 * max_capacity ids. A stream of events, replayed in order: set_capacity(c) (1 <= c <=
 * max_capacity: evicts lazily, on the next store, as the Python shadow does) and batches,
 * submit(ids) or submit_keys(keys, limit) (the keys' ids below limit; none: no batch). Each
 * batch's result is (ids, hits per shadow...); a submit returns, oldest first, the results of
 * every batch up to lag batches before it not yet returned, waiting (the GIL released) while
 * the thread has not replayed them: so what a caller learns is the same whatever the
 * thread's pace, and the thread trails the calls by at most lag batches. With lag 0 there is
 * no thread: a submit replays its batch and returns its result. held(i) waits until every
 * batch is replayed. Where the thread cannot start the batches are replayed inline, with the
 * same results. A child process after a fork has no thread (and the parent's may have been
 * in the middle of a batch): its shadows start over, empty, replayed inline, and the batches
 * queued before the fork come back as results of no ids.
 *
 * The shadow's semantics are exactly reuse_lru._Shadow's (tests/daemon/test_reuse_lru.py
 * compares them on random streams, and PyShadows is this object in Python): two queues,
 * oldest first (used once, reused); a batch's ids get the batch's time and are taken deepest
 * first; a held id is a hit and moves to reused; a missing one is stored (evicting while
 * full: the once head unless the reused head plus theta * capacity is older), as reused if its
 * id is in the ghost (the last GHOST * capacity ids evicted), else as used once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hashing.h"
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#define GHOST 4
#define NIL (-1)

/* id -> int64 value, open addressing with linear probing and backward-shift deletion; a
 * slot is one 16-byte record, so a probe touches one cache line */
typedef struct {
    int64_t val;
    uint32_t key;
    uint32_t used;
} Slot;

typedef struct {
    Slot *slots;
    uint32_t mask;
} Map;

static int map_init(Map *m, uint32_t slots) {
    m->mask = slots - 1;
    m->slots = calloc(slots, sizeof(Slot));
    return m->slots ? 0 : -1;
}

static void map_free(Map *m) { free(m->slots); }

static int64_t *map_get(Map *m, uint32_t k) {
    for (uint32_t i = mix(k) & m->mask;; i = (i + 1) & m->mask) {
        Slot *x = &m->slots[i];
        if (!x->used) return NULL;
        if (x->key == k) return &x->val;
    }
}

static void map_put(Map *m, uint32_t k, int64_t v) {
    uint32_t i = mix(k) & m->mask;
    while (m->slots[i].used && m->slots[i].key != k) i = (i + 1) & m->mask;
    m->slots[i].used = 1; m->slots[i].key = k; m->slots[i].val = v;
}

static void map_del(Map *m, uint32_t k) {
    uint32_t i = mix(k) & m->mask;
    while (1) {
        if (!m->slots[i].used) return;
        if (m->slots[i].key == k) break;
        i = (i + 1) & m->mask;
    }
    uint32_t j = i;
    while (1) {  /* backward shift (fills_hole) */
        j = (j + 1) & m->mask;
        if (!m->slots[j].used) break;
        if (fills_hole(i, j, mix(m->slots[j].key) & m->mask)) {
            m->slots[i] = m->slots[j]; i = j;
        }
    }
    m->slots[i].used = 0;
}

typedef struct {
    uint32_t id;
    int32_t prev, next;
    int64_t t;
    uint8_t q;
} Entry;

typedef struct {
    double theta;
    int64_t time;
    int64_t n[2];
    int32_t head[2], tail[2];   /* oldest, newest of each queue */
    Entry *entries;
    int32_t *free_list;
    int32_t nfree;
    Map held;                   /* id -> entry index */
    Map ghost;                  /* id -> stamp of its ring slot */
    uint32_t *ring_id;          /* the ghost in eviction order, dead slots skipped */
    int64_t *ring_stamp;
    int64_t ring_size, ring_head, ring_len, live, stamp;
} Shadow;

static int shadow_init(Shadow *s, double theta, int64_t maxcap) {
    memset(s, 0, sizeof(*s));
    s->theta = theta;
    s->head[0] = s->head[1] = s->tail[0] = s->tail[1] = NIL;
    s->entries = calloc((size_t)maxcap + 1, sizeof(Entry));
    s->free_list = calloc((size_t)maxcap + 1, sizeof(int32_t));
    if (!s->entries || !s->free_list) return -1;
    for (int64_t i = 0; i <= maxcap; i++) s->free_list[i] = (int32_t)(maxcap - i);
    s->nfree = (int32_t)maxcap + 1;
    s->ring_size = 2 * (GHOST * maxcap + 1);
    s->ring_id = calloc((size_t)s->ring_size, sizeof(uint32_t));
    s->ring_stamp = calloc((size_t)s->ring_size, sizeof(int64_t));
    if (!s->ring_id || !s->ring_stamp) return -1;
    if (map_init(&s->held, pow2_at_least(2 * (maxcap + 1))) < 0) return -1;
    if (map_init(&s->ghost, pow2_at_least(2 * (GHOST * maxcap + 1))) < 0) return -1;
    return 0;
}

static void shadow_free(Shadow *s) {
    free(s->entries); free(s->free_list); free(s->ring_id); free(s->ring_stamp);
    map_free(&s->held); map_free(&s->ghost);
}

static void unlink_entry(Shadow *s, int32_t e) {
    Entry *x = &s->entries[e];
    if (x->prev != NIL) s->entries[x->prev].next = x->next; else s->head[x->q] = x->next;
    if (x->next != NIL) s->entries[x->next].prev = x->prev; else s->tail[x->q] = x->prev;
    s->n[x->q]--;
}

static void append_entry(Shadow *s, int32_t e, uint8_t q, int64_t t) {
    Entry *x = &s->entries[e];
    x->q = q; x->t = t; x->next = NIL; x->prev = s->tail[q];
    if (s->tail[q] != NIL) s->entries[s->tail[q]].next = e; else s->head[q] = e;
    s->tail[q] = e;
    s->n[q]++;
}

static void ring_compact(Shadow *s) {
    int64_t out = 0;
    for (int64_t k = 0; k < s->ring_len; k++) {
        int64_t at = (s->ring_head + k) % s->ring_size;
        int64_t *v = map_get(&s->ghost, s->ring_id[at]);
        if (v && *v == s->ring_stamp[at]) {
            s->ring_id[out] = s->ring_id[at]; s->ring_stamp[out] = s->ring_stamp[at]; out++;
        }
    }
    s->ring_head = 0; s->ring_len = out;
}

static void ghost_add(Shadow *s, uint32_t id, int64_t capacity) {
    if (map_get(&s->ghost, id)) return;  /* kept where it is (an OrderedDict's assignment) */
    if (s->ring_len == s->ring_size) ring_compact(s);
    int64_t at = (s->ring_head + s->ring_len) % s->ring_size;
    s->ring_id[at] = id; s->ring_stamp[at] = ++s->stamp; s->ring_len++;
    map_put(&s->ghost, id, s->stamp);
    s->live++;
    if (s->live > GHOST * capacity) {  /* the oldest live one goes */
        while (s->ring_len) {
            int64_t h = s->ring_head;
            s->ring_head = (h + 1) % s->ring_size; s->ring_len--;
            int64_t *v = map_get(&s->ghost, s->ring_id[h]);
            if (v && *v == s->ring_stamp[h]) {
                map_del(&s->ghost, s->ring_id[h]); s->live--; break;
            }
        }
    }
}

static void evict(Shadow *s, int64_t capacity) {
    int q;
    if (s->n[0] && (!s->n[1] || (double)s->entries[s->head[0]].t
                    <= (double)s->entries[s->head[1]].t + s->theta * (double)capacity)) q = 0;
    else q = 1;
    int32_t e = s->head[q];
    uint32_t id = s->entries[e].id;
    unlink_entry(s, e);
    map_del(&s->held, id);
    s->free_list[s->nfree++] = e;
    ghost_add(s, id, capacity);
}

static int64_t shadow_access(Shadow *s, const uint32_t *ids, Py_ssize_t n, int64_t capacity) {
    int64_t t = s->time, hits = 0;
    s->time = t + n;
    for (Py_ssize_t k = n - 1; k >= 0; k--) {
        uint32_t id = ids[k];
        int64_t *at = map_get(&s->held, id);
        if (at) {
            int32_t e = (int32_t)*at;
            unlink_entry(s, e);
            append_entry(s, e, 1, t);
            hits++;
            continue;
        }
        while (s->n[0] + s->n[1] >= capacity) evict(s, capacity);
        uint8_t q = 0;
        if (map_get(&s->ghost, id)) {
            map_del(&s->ghost, id); s->live--; q = 1;
        }
        int32_t e = s->free_list[--s->nfree];
        s->entries[e].id = id;
        append_entry(s, e, q, t);
        map_put(&s->held, id, e);
    }
    return hits;
}

/* One queued event: a batch of n sampled ids, or (n < 0) a new capacity. */
typedef struct Batch {
    struct Batch *next;
    Py_ssize_t n;
    int64_t capacity;
    uint32_t ids[];
} Batch;

typedef struct {
    PyObject_HEAD
    Py_ssize_t count;
    int64_t max_capacity;
    int64_t capacity;           /* the replay's: set by the events, in order */
    int64_t last_capacity;      /* the stream's: the last set_capacity */
    int64_t lag;
    Shadow *shadows;
    /* the queue and the results, under mu */
    pthread_mutex_t mu;
    pthread_cond_t work, done_cv;
    Batch *qhead, *qtail;
    int64_t submitted;          /* batches queued so far */
    int64_t done;               /* batches replayed */
    int64_t returned;           /* batches whose results went back */
    int64_t *results;           /* ring of ring_len results, count + 1 values each */
    int64_t ring_len;
    int stop, paused, threaded, sync_init;
    pthread_t thread;
    pid_t pid;
} ShadowsObject;

static void replay(ShadowsObject *self, Batch *b) {
    if (b->n < 0) { self->capacity = b->capacity; return; }
    int64_t *r = &self->results[(self->done % self->ring_len) * (self->count + 1)];
    r[0] = b->n;
    for (Py_ssize_t i = 0; i < self->count; i++)
        r[i + 1] = shadow_access(&self->shadows[i], b->ids, b->n, self->capacity);
}

static void *worker(void *arg) {
    ShadowsObject *self = arg;
    pthread_mutex_lock(&self->mu);
    while (1) {
        while ((!self->qhead || self->paused) && !self->stop)
            pthread_cond_wait(&self->work, &self->mu);
        if (!self->qhead) break;  /* stopped, nothing left */
        Batch *b = self->qhead;
        self->qhead = b->next;
        if (!self->qhead) self->qtail = NULL;
        pthread_mutex_unlock(&self->mu);
        replay(self, b);  /* the shadows and capacity are this thread's alone */
        pthread_mutex_lock(&self->mu);
        if (b->n >= 0) { self->done++; pthread_cond_broadcast(&self->done_cv); }
        free(b);
    }
    pthread_mutex_unlock(&self->mu);
    return NULL;
}

/* Replay whatever is queued on the calling thread (no worker runs). */
static void drain_inline(ShadowsObject *self) {
    while (self->qhead) {
        Batch *b = self->qhead;
        self->qhead = b->next;
        if (!self->qhead) self->qtail = NULL;
        replay(self, b);
        if (b->n >= 0) self->done++;
        free(b);
    }
}

/* After a fork the worker is gone, perhaps in the middle of a batch (mu held, a shadow half
 * updated): the child's shadows start over, empty, replayed inline from here; the batches
 * queued before the fork and not yet returned come back as results of no ids. 0, or -1
 * with a Python error set. */
static int adopt_after_fork(ShadowsObject *self) {
    if (!self->threaded || self->pid == getpid()) return 0;
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->work, NULL);
    pthread_cond_init(&self->done_cv, NULL);
    self->threaded = 0; self->paused = 0; self->pid = getpid();
    self->qhead = self->qtail = NULL;  /* the parent's: left to it */
    for (Py_ssize_t i = 0; i < self->count; i++) {
        double theta = self->shadows[i].theta;
        shadow_free(&self->shadows[i]);
        if (shadow_init(&self->shadows[i], theta, self->max_capacity) < 0) {
            for (Py_ssize_t j = 0; j <= i; j++) shadow_free(&self->shadows[j]);
            free(self->shadows);
            self->shadows = NULL; self->count = 0;
            PyErr_NoMemory();
            return -1;
        }
    }
    for (int64_t k = self->returned; k < self->submitted; k++)
        memset(&self->results[(k % self->ring_len) * (self->count + 1)], 0,
               (size_t)(self->count + 1) * sizeof(int64_t));
    self->done = self->submitted;
    self->capacity = self->last_capacity;
    return 0;
}

static void enqueue(ShadowsObject *self, Batch *b) {
    b->next = NULL;
    if (!self->threaded) {
        int batch = b->n >= 0;
        self->qhead = self->qtail = b;
        drain_inline(self);  /* frees b */
        if (batch) self->submitted++;
        return;
    }
    pthread_mutex_lock(&self->mu);
    if (self->qtail) self->qtail->next = b; else self->qhead = b;
    self->qtail = b;
    if (b->n >= 0) self->submitted++;
    /* Waking a sleeping thread costs the caller microseconds (an interrupt to another CPU,
     * dearer still in a VM): it is woken once half the lag is queued, and then replays all
     * there is; a submit waiting on it, or held(), wakes it at once. */
    if (self->submitted - self->done >= (self->lag + 1) / 2) pthread_cond_signal(&self->work);
    pthread_mutex_unlock(&self->mu);
}

/* b into the stream (after a fork: into the child's); 0, or -1 with a Python error set and b
 * freed. */
static int push(ShadowsObject *self, Batch *b) {
    if (adopt_after_fork(self) < 0) { free(b); return -1; }
    enqueue(self, b);
    return 0;
}

/* Wait until batch `upto` (exclusive count) is replayed; the GIL is released while waiting. */
static void wait_done(ShadowsObject *self, int64_t upto) {
    if (!self->threaded) return;
    pthread_mutex_lock(&self->mu);
    if (self->done < upto) {
        pthread_cond_signal(&self->work);
        Py_BEGIN_ALLOW_THREADS
        while (self->done < upto) pthread_cond_wait(&self->done_cv, &self->mu);
        Py_END_ALLOW_THREADS
    }
    pthread_mutex_unlock(&self->mu);
}

/* The results of the batches due (up to `submitted - lag`), oldest first, as a list. */
static PyObject *collect(ShadowsObject *self) {
    int64_t due = self->submitted - self->lag;
    if (due < self->returned) due = self->returned;
    wait_done(self, due);
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (; self->returned < due; self->returned++) {
        const int64_t *r = &self->results[(self->returned % self->ring_len) * (self->count + 1)];
        PyObject *t = PyTuple_New(self->count + 1);
        if (!t) { Py_DECREF(out); return NULL; }
        for (Py_ssize_t i = 0; i <= self->count; i++) {
            PyObject *v = PyLong_FromLongLong(r[i]);
            if (!v) { Py_DECREF(t); Py_DECREF(out); return NULL; }
            PyTuple_SET_ITEM(t, i, v);
        }
        if (PyList_Append(out, t) < 0) { Py_DECREF(t); Py_DECREF(out); return NULL; }
        Py_DECREF(t);
    }
    return out;
}

static void Shadows_dealloc(ShadowsObject *self) {
    if (self->threaded && self->pid == getpid()) {
        pthread_mutex_lock(&self->mu);
        self->stop = 1;
        pthread_cond_signal(&self->work);
        pthread_mutex_unlock(&self->mu);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(self->thread, NULL);
        Py_END_ALLOW_THREADS
    }
    while (self->qhead) { Batch *b = self->qhead; self->qhead = b->next; free(b); }
    if (self->sync_init && !(self->threaded && self->pid != getpid())) {
        pthread_mutex_destroy(&self->mu);
        pthread_cond_destroy(&self->work);
        pthread_cond_destroy(&self->done_cv);
    }
    if (self->shadows) {
        for (Py_ssize_t i = 0; i < self->count; i++) shadow_free(&self->shadows[i]);
        free(self->shadows);
    }
    free(self->results);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Shadows_init(ShadowsObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"thetas", "max_capacity", "lag", NULL};
    PyObject *thetas;
    long long maxcap, lag = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OL|L", kwlist, &thetas, &maxcap, &lag))
        return -1;
    if (self->shadows) {
        PyErr_SetString(PyExc_RuntimeError, "Shadows are initialized once");
        return -1;
    }
    if (maxcap < 1 || maxcap > (1LL << 24)) {
        PyErr_SetString(PyExc_ValueError, "max_capacity is 1 to 2**24");
        return -1;
    }
    if (lag < 0 || lag > 4096) {
        PyErr_SetString(PyExc_ValueError, "lag is 0 to 4096 batches");
        return -1;
    }
    PyObject *seq = PySequence_Fast(thetas, "thetas: a sequence of floats");
    if (!seq) return -1;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    self->shadows = calloc((size_t)(count ? count : 1), sizeof(Shadow));
    if (!self->shadows) { Py_DECREF(seq); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < count; i++) {
        double theta = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
        if (theta == -1.0 && PyErr_Occurred()) { Py_DECREF(seq); return -1; }
        if (shadow_init(&self->shadows[i], theta, maxcap) < 0) {
            self->count = i + 1;
            Py_DECREF(seq); PyErr_NoMemory(); return -1;
        }
        self->count = i + 1;
    }
    Py_DECREF(seq);
    self->max_capacity = maxcap;
    self->capacity = self->last_capacity = maxcap;
    self->lag = lag;
    self->ring_len = lag + 2;  /* results not yet returned: at most lag + 1 */
    self->results = calloc((size_t)self->ring_len * (size_t)(count + 1), sizeof(int64_t));
    if (!self->results) { PyErr_NoMemory(); return -1; }
    if (pthread_mutex_init(&self->mu, NULL) || pthread_cond_init(&self->work, NULL)
        || pthread_cond_init(&self->done_cv, NULL)) {
        PyErr_SetString(PyExc_OSError, "cannot make the shadows' lock");
        return -1;
    }
    self->sync_init = 1;
    self->pid = getpid();
    /* lag 0, or no thread to be had: replayed inline, the same results. The thread blocks
     * every signal: the process's signals go to the threads that handle them. */
    if (lag > 0) {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        pthread_attr_t attr;  /* a small stack: the replay uses a few hundred bytes */
        int attr_ok = pthread_attr_init(&attr) == 0;
        if (attr_ok) pthread_attr_setstacksize(&attr, 256 << 10);
        self->threaded = pthread_create(&self->thread, attr_ok ? &attr : NULL, worker, self) == 0;
        if (attr_ok) pthread_attr_destroy(&attr);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    return 0;
}

static PyObject *Shadows_set_capacity(ShadowsObject *self, PyObject *arg) {
    long long c = PyLong_AsLongLong(arg);
    if (c == -1 && PyErr_Occurred()) return NULL;
    if (c < 1 || c > self->max_capacity) {
        PyErr_SetString(PyExc_ValueError, "capacity is 1 to max_capacity");
        return NULL;
    }
    Batch *b = malloc(sizeof(Batch));
    if (!b) return PyErr_NoMemory();
    b->n = -1; b->capacity = c;
    if (push(self, b) < 0) return NULL;
    self->last_capacity = c;
    Py_RETURN_NONE;
}

static Batch *new_batch(Py_ssize_t n) {
    Batch *b = malloc(sizeof(Batch) + (size_t)(n ? n : 1) * sizeof(uint32_t));
    if (b) { b->n = n; b->capacity = 0; }
    return b;
}

static PyObject *Shadows_submit(ShadowsObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "ids: a sequence of 32-bit ints");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Batch *b = new_batch(n);
    if (!b) { Py_DECREF(seq); return PyErr_NoMemory(); }
    for (Py_ssize_t k = 0; k < n; k++) {
        unsigned long v = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq, k));
        if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > 0xffffffffUL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "an id over 32 bits");
            free(b);
            Py_DECREF(seq);
            return NULL;
        }
        b->ids[k] = (uint32_t)v;
    }
    Py_DECREF(seq);
    if (push(self, b) < 0) return NULL;
    return collect(self);
}

/* FNV-1a over the key's bytes, then mix: the id a key is sampled and known by */
static uint32_t key_hash(const unsigned char *p, Py_ssize_t n) {
    uint32_t h = 0x811c9dc5U;
    for (Py_ssize_t i = 0; i < n; i++) { h ^= p[i]; h *= 0x01000193U; }
    return mix(h);
}

static PyObject *Shadows_submit_keys(ShadowsObject *self, PyObject *args) {
    PyObject *keys;
    unsigned long long limit;
    if (!PyArg_ParseTuple(args, "OK", &keys, &limit)) return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys: a sequence of bytes");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), m = 0;
    Batch *b = new_batch(n);
    if (!b) { Py_DECREF(seq); return PyErr_NoMemory(); }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, k);
        if (!PyBytes_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "keys are bytes");
            free(b);
            Py_DECREF(seq);
            return NULL;
        }
        uint32_t h = key_hash((const unsigned char *)PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
        if ((unsigned long long)h < limit) b->ids[m++] = h;
    }
    Py_DECREF(seq);
    if (!m) { free(b); return PyList_New(0); }  /* nothing sampled: no batch */
    b->n = m;
    if (push(self, b) < 0) return NULL;
    return collect(self);
}

static PyObject *Shadows_key_id(PyObject *cls, PyObject *arg) {
    (void)cls;
    if (!PyBytes_Check(arg)) { PyErr_SetString(PyExc_TypeError, "a key is bytes"); return NULL; }
    return PyLong_FromUnsignedLong(key_hash((const unsigned char *)PyBytes_AS_STRING(arg),
                                            PyBytes_GET_SIZE(arg)));
}

static PyObject *Shadows_held(ShadowsObject *self, PyObject *arg) {
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < 0 || i >= self->count) { PyErr_SetString(PyExc_IndexError, "no such shadow"); return NULL; }
    if (adopt_after_fork(self) < 0) return NULL;
    wait_done(self, self->submitted);
    Shadow *s = &self->shadows[i];
    return Py_BuildValue("(LL)", (long long)s->n[0], (long long)s->n[1]);
}

static PyObject *Shadows_pause(ShadowsObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    if (adopt_after_fork(self) < 0) return NULL;
    if (!self->threaded) Py_RETURN_FALSE;
    pthread_mutex_lock(&self->mu);
    self->paused = on;
    pthread_cond_signal(&self->work);
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_TRUE;
}

static PyObject *Shadows_nbytes(ShadowsObject *self, PyObject *unused) {
    (void)unused;
    size_t b = sizeof(*self) + (size_t)self->ring_len * (size_t)(self->count + 1) * sizeof(int64_t);
    for (Py_ssize_t i = 0; i < self->count; i++) {
        const Shadow *x = &self->shadows[i];
        b += (size_t)(self->max_capacity + 1) * (sizeof(Entry) + sizeof(int32_t))
            + (size_t)x->ring_size * (sizeof(uint32_t) + sizeof(int64_t))
            + ((size_t)x->held.mask + 1 + (size_t)x->ghost.mask + 1) * sizeof(Slot);
    }
    return PyLong_FromSize_t(b);
}

static PyObject *Shadows_get_lag(ShadowsObject *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(self->lag);
}

static PyGetSetDef Shadows_getset[] = {
    {"lag", (getter)Shadows_get_lag, NULL,
     "How many batches a submit's results trail it by.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Shadows_methods[] = {
    {"submit", (PyCFunction)Shadows_submit, METH_O,
     "submit(ids) -> [(ids, hits per shadow...)]: one batch's sampled ids (chain order) "
     "queued; the results due (of the batches up to lag before it), oldest first."},
    {"submit_keys", (PyCFunction)Shadows_submit_keys, METH_VARARGS,
     "submit_keys(keys, limit) -> results due: submit() of the ids below limit of the keys, "
     "or nothing queued and [] when there is none."},
    {"set_capacity", (PyCFunction)Shadows_set_capacity, METH_O,
     "set_capacity(c): every shadow holds at most c ids from the next batch on."},
    {"key_id", (PyCFunction)Shadows_key_id, METH_O | METH_STATIC,
     "key_id(key) -> the 32-bit id a key is sampled and known by."},
    {"pause", (PyCFunction)Shadows_pause, METH_O,
     "pause(on) -> whether there is a thread: it takes no batch while paused (tests use it "
     "to stop it between batches)."},
    {"nbytes", (PyCFunction)Shadows_nbytes, METH_NOARGS,
     "nbytes() -> the bytes its tables hold."},
    {"held", (PyCFunction)Shadows_held, METH_O,
     "held(i) -> (used once, reused): the ids shadow i holds once every batch is replayed."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ShadowsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hicached.cache._shadows.Shadows",
    .tp_basicsize = sizeof(ShadowsObject),
    .tp_dealloc = (destructor)Shadows_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Shadows(thetas, max_capacity, lag=0): the reuse policy's shadows, one per margin.",
    .tp_methods = Shadows_methods,
    .tp_getset = Shadows_getset,
    .tp_init = (initproc)Shadows_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_shadows",
    "The reuse eviction policy's shadows in C (hicached.cache.reuse_lru).", -1, NULL,
};

PyMODINIT_FUNC PyInit__shadows(void) {
    if (PyType_Ready(&ShadowsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&ShadowsType);
    if (PyModule_AddObject(m, "Shadows", (PyObject *)&ShadowsType) < 0) {
        Py_DECREF(&ShadowsType); Py_DECREF(m); return NULL;
    }
    return m;
}
