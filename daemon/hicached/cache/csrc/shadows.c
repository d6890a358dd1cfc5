/* hicached.cache._shadows: the reuse eviction policy's shadows (reuse_lru._Shadow), several
 * margins at once, in C: a sampled key costs each shadow a few hash probes here instead of a
 * few dictionary updates in Python.
 *
 * Shadows(thetas, max_capacity): one shadow per margin, each holding at most max_capacity
 * ids. set_capacity(c) (1 <= c <= max_capacity: evicts lazily, on the next store, as the
 * Python shadow does); access(ids) -> tuple of hits, one per shadow. Semantics are exactly
 * reuse_lru._Shadow's (tests/daemon/test_reuse_lru.py compares them on random streams): two
 * queues, oldest first (used once, reused); a batch's ids get the batch's time and are taken
 * deepest first; a held id is a hit and moves to reused; a missing one is stored (evicting
 * while full: the once head unless the reused head plus theta * capacity is older), as reused
 * if its id is in the ghost (the last GHOST * capacity ids evicted), else as used once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

static uint32_t mix(uint32_t x) {
    x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
    return x;
}

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
    while (1) {  /* backward shift: keep every later probe chain unbroken */
        j = (j + 1) & m->mask;
        if (!m->slots[j].used) break;
        uint32_t home = mix(m->slots[j].key) & m->mask;
        /* move j into the hole i unless its home lies cyclically in (i, j] */
        if ((i <= j) ? (home <= i || home > j) : (home <= i && home > j)) {
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

typedef struct {
    PyObject_HEAD
    Py_ssize_t count;
    int64_t capacity, max_capacity;
    Shadow *shadows;
} ShadowsObject;

static uint32_t pow2_at_least(int64_t n) {
    uint32_t p = 16;
    while ((int64_t)p < n) p <<= 1;
    return p;
}

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

static void Shadows_dealloc(ShadowsObject *self) {
    if (self->shadows) {
        for (Py_ssize_t i = 0; i < self->count; i++) shadow_free(&self->shadows[i]);
        free(self->shadows);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Shadows_init(ShadowsObject *self, PyObject *args, PyObject *kwds) {
    (void)kwds;
    PyObject *thetas;
    long long maxcap;
    if (!PyArg_ParseTuple(args, "OL", &thetas, &maxcap)) return -1;
    if (self->shadows) {
        PyErr_SetString(PyExc_RuntimeError, "Shadows are initialized once");
        return -1;
    }
    if (maxcap < 1 || maxcap > (1LL << 24)) {
        PyErr_SetString(PyExc_ValueError, "max_capacity is 1 to 2**24");
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
    self->capacity = maxcap;
    return 0;
}

static PyObject *Shadows_set_capacity(ShadowsObject *self, PyObject *arg) {
    long long c = PyLong_AsLongLong(arg);
    if (c == -1 && PyErr_Occurred()) return NULL;
    if (c < 1 || c > self->max_capacity) {
        PyErr_SetString(PyExc_ValueError, "capacity is 1 to max_capacity");
        return NULL;
    }
    self->capacity = c;
    Py_RETURN_NONE;
}

static PyObject *Shadows_access(ShadowsObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "ids: a sequence of 32-bit ints");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uint32_t stack[256];
    uint32_t *ids = n <= 256 ? stack : malloc((size_t)n * sizeof(uint32_t));
    if (!ids) { Py_DECREF(seq); return PyErr_NoMemory(); }
    for (Py_ssize_t k = 0; k < n; k++) {
        unsigned long v = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq, k));
        if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > 0xffffffffUL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "an id over 32 bits");
            if (ids != stack) free(ids);
            Py_DECREF(seq);
            return NULL;
        }
        ids[k] = (uint32_t)v;
    }
    Py_DECREF(seq);
    PyObject *out = PyTuple_New(self->count);
    if (!out) { if (ids != stack) free(ids); return NULL; }
    for (Py_ssize_t i = 0; i < self->count; i++) {
        int64_t h = shadow_access(&self->shadows[i], ids, n, self->capacity);
        PyTuple_SET_ITEM(out, i, PyLong_FromLongLong(h));
    }
    if (ids != stack) free(ids);
    return out;
}

/* FNV-1a over the key's bytes, then mix: the id a key is sampled and known by */
static uint32_t key_hash(const unsigned char *p, Py_ssize_t n) {
    uint32_t h = 0x811c9dc5U;
    for (Py_ssize_t i = 0; i < n; i++) { h ^= p[i]; h *= 0x01000193U; }
    return mix(h);
}

static PyObject *Shadows_access_keys(ShadowsObject *self, PyObject *args) {
    PyObject *keys;
    unsigned long long limit;
    if (!PyArg_ParseTuple(args, "OK", &keys, &limit)) return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys: a sequence of bytes");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), m = 0;
    uint32_t stack[256];
    uint32_t *ids = n <= 256 ? stack : malloc((size_t)n * sizeof(uint32_t));
    if (!ids) { Py_DECREF(seq); return PyErr_NoMemory(); }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, k);
        if (!PyBytes_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "keys are bytes");
            if (ids != stack) free(ids);
            Py_DECREF(seq);
            return NULL;
        }
        uint32_t h = key_hash((const unsigned char *)PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
        if ((unsigned long long)h < limit) ids[m++] = h;
    }
    Py_DECREF(seq);
    if (!m) { if (ids != stack) free(ids); Py_RETURN_NONE; }
    PyObject *out = PyTuple_New(self->count + 1);
    if (!out) { if (ids != stack) free(ids); return NULL; }
    PyTuple_SET_ITEM(out, 0, PyLong_FromSsize_t(m));
    for (Py_ssize_t i = 0; i < self->count; i++) {
        int64_t h = shadow_access(&self->shadows[i], ids, m, self->capacity);
        PyTuple_SET_ITEM(out, i + 1, PyLong_FromLongLong(h));
    }
    if (ids != stack) free(ids);
    return out;
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
    Shadow *s = &self->shadows[i];
    return Py_BuildValue("(LL)", (long long)s->n[0], (long long)s->n[1]);
}

static PyMethodDef Shadows_methods[] = {
    {"access", (PyCFunction)Shadows_access, METH_O,
     "access(ids) -> hits per shadow: one batch's sampled ids (chain order) used."},
    {"set_capacity", (PyCFunction)Shadows_set_capacity, METH_O,
     "set_capacity(c): every shadow holds at most c ids from its next store."},
    {"access_keys", (PyCFunction)Shadows_access_keys, METH_VARARGS,
     "access_keys(keys, limit) -> None when no key's id is below limit, else (ids sampled, "
     "hits per shadow...): access() of the sampled keys' ids."},
    {"key_id", (PyCFunction)Shadows_key_id, METH_O | METH_STATIC,
     "key_id(key) -> the 32-bit id a key is sampled and known by."},
    {"held", (PyCFunction)Shadows_held, METH_O,
     "held(i) -> (used once, reused): the ids shadow i holds."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ShadowsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hicached.cache._shadows.Shadows",
    .tp_basicsize = sizeof(ShadowsObject),
    .tp_dealloc = (destructor)Shadows_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Shadows(thetas, max_capacity): the reuse policy's shadows, one per margin.",
    .tp_methods = Shadows_methods,
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
