/* hicached.cache._queues: the reuse eviction policy's queues and ghost (reuse_lru.PyQueues)
 * in C: a key costs a hash probe and a few links here instead of several dictionary updates.
 *
 * Queues(): the evictable keys of one pool (bytes), in two queues, each least recently used
 * first: used once (0) and reused (1); each key with the time of its batch (the object's own
 * clock: the count of keys used so far) and its last wall time. The ghost: 32-bit ids (the
 * low half of the key's hash) of the keys evicted last, oldest first.
 *
 * add(keys, wall), back(keys, wall), touch(keys, wall): one batch, in chain order, given the
 * batch's time and taken deepest first. add: a key whose id is in the ghost leaves it and
 * enters reused, any other enters used once; back: reused; touch: those present move to
 * reused. (A key already present is moved, never doubled.) discard(key). pop(n, margin, busy,
 * used, ghost_bound) -> up to n victims in victim order (the older of the two heads, a reused
 * key counting margin younger), keys in busy passed over while others remain and taken last;
 * removed, their ids into the ghost, which is then cut to ghost_bound ids, oldest first; each
 * victim's wall time appended to the list used (None: not asked). oldest(n, margin) -> the
 * same order, left in place; oldest_use(margin) -> the next victim's wall time or None.
 * len, in, held() -> (used once, reused), nbytes() -> the memory it holds.
 *
 * The semantics are exactly PyQueues' (tests/daemon/test_reuse_lru.py runs both under one
 * state machine). The caller serializes calls (the pool's lock); the object holds a reference
 * to each key it holds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hashing.h"

#define NIL (-1)
#define EMPTY UINT32_MAX

typedef struct {
    PyObject *key;              /* NULL: a free node (next: the free list) */
    Py_hash_t hash;
    int64_t t;
    double wall;
    int32_t prev, next;
    uint8_t q;
} Node;

typedef struct {                /* ghost map slot: id -> its ring index (EMPTY: free) */
    uint32_t id, at;
} GSlot;

typedef struct {
    PyObject_HEAD
    Node *nodes;
    int32_t nnodes, cap_nodes, free_head;
    int32_t *slots;             /* key map: node index, NIL empty; linear probing */
    uint32_t mask;
    int64_t n[2];
    int32_t head[2], tail[2];
    int64_t time;
    GSlot *gslots;              /* ghost map */
    uint32_t gmask;
    uint32_t *ring;             /* ghost ids in eviction order; dead ones skipped */
    uint32_t ring_size, ring_head, ring_len, live;
} QueuesObject;

static uint32_t home(Py_hash_t h, uint32_t mask) {
    uint64_t u = (uint64_t)h;
    return mix((uint32_t)u ^ (uint32_t)(u >> 32)) & mask;
}

static uint32_t ghost_id(Py_hash_t h) { return (uint32_t)((uint64_t)h & 0xffffffffU); }

/* ---- the key map ---------------------------------------------------------------------- */

static int keys_equal(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    Py_ssize_t n = PyBytes_GET_SIZE(a);
    return n == PyBytes_GET_SIZE(b) && memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b),
                                              (size_t)n) == 0;
}

/* the slot holding key, or the empty slot where it would go */
static uint32_t find_slot(QueuesObject *self, PyObject *key, Py_hash_t h) {
    for (uint32_t i = home(h, self->mask);; i = (i + 1) & self->mask) {
        int32_t e = self->slots[i];
        if (e == NIL) return i;
        Node *x = &self->nodes[e];
        if (x->hash == h && keys_equal(x->key, key)) return i;
    }
}

static int32_t find(QueuesObject *self, PyObject *key, Py_hash_t h) {
    return self->slots[find_slot(self, key, h)];
}

static void slot_del(QueuesObject *self, uint32_t i) {
    uint32_t j = i, mask = self->mask;
    while (1) {  /* backward shift (fills_hole) */
        j = (j + 1) & mask;
        int32_t e = self->slots[j];
        if (e == NIL) break;
        if (fills_hole(i, j, home(self->nodes[e].hash, mask))) {
            self->slots[i] = e; i = j;
        }
    }
    self->slots[i] = NIL;
}

static int rehash(QueuesObject *self, uint32_t size) {
    int32_t *slots = malloc((size_t)size * sizeof(int32_t));
    if (!slots) { PyErr_NoMemory(); return -1; }
    for (uint32_t i = 0; i < size; i++) slots[i] = NIL;
    uint32_t mask = size - 1;
    for (int32_t e = 0; e < self->cap_nodes; e++) {
        if (!self->nodes[e].key) continue;
        uint32_t i = home(self->nodes[e].hash, mask);
        while (slots[i] != NIL) i = (i + 1) & mask;
        slots[i] = e;
    }
    free(self->slots);
    self->slots = slots; self->mask = mask;
    return 0;
}

/* room for `more` nodes (and their slots): 0, or -1 with MemoryError */
static int reserve(QueuesObject *self, Py_ssize_t more) {
    int64_t want = (int64_t)self->nnodes + more;
    if (want > (1 << 29)) { PyErr_NoMemory(); return -1; }
    uint64_t size = (uint64_t)self->mask + 1;
    while ((uint64_t)want * 2 > size) size *= 2;
    if (size != (uint64_t)self->mask + 1 && rehash(self, (uint32_t)size) < 0) return -1;
    if (want > self->cap_nodes) {
        int32_t grown = self->cap_nodes ? self->cap_nodes : 64;
        while (grown < want) grown *= 2;
        Node *nodes = realloc(self->nodes, (size_t)grown * sizeof(Node));
        if (!nodes) { PyErr_NoMemory(); return -1; }
        self->nodes = nodes;
        for (int32_t e = grown - 1; e >= self->cap_nodes; e--) {
            nodes[e].key = NULL; nodes[e].next = self->free_head; self->free_head = e;
        }
        self->cap_nodes = grown;
    }
    return 0;
}

/* ---- the queues ----------------------------------------------------------------------- */

static void unlink_node(QueuesObject *self, int32_t e) {
    Node *x = &self->nodes[e];
    if (x->prev != NIL) self->nodes[x->prev].next = x->next; else self->head[x->q] = x->next;
    if (x->next != NIL) self->nodes[x->next].prev = x->prev; else self->tail[x->q] = x->prev;
    self->n[x->q]--;
}

static void append_node(QueuesObject *self, int32_t e, uint8_t q, int64_t t, double wall) {
    Node *x = &self->nodes[e];
    x->q = q; x->t = t; x->wall = wall; x->next = NIL; x->prev = self->tail[q];
    if (self->tail[q] != NIL) self->nodes[self->tail[q]].next = e; else self->head[q] = e;
    self->tail[q] = e;
    self->n[q]++;
}

/* take node e out of the queues and the map, dropping its key's reference */
static void remove_node(QueuesObject *self, int32_t e) {
    Node *x = &self->nodes[e];
    unlink_node(self, e);
    uint32_t i = home(x->hash, self->mask);
    while (self->slots[i] != e) i = (i + 1) & self->mask;
    slot_del(self, i);
    PyObject *key = x->key;
    x->key = NULL; x->next = self->free_head; self->free_head = e;
    self->nnodes--;
    Py_DECREF(key);
}

/* ---- the ghost ------------------------------------------------------------------------ */

static GSlot *ghost_find(QueuesObject *self, uint32_t id) {
    if (!self->gslots) return NULL;
    for (uint32_t i = mix(id) & self->gmask;; i = (i + 1) & self->gmask) {
        GSlot *x = &self->gslots[i];
        if (x->at == EMPTY) return NULL;
        if (x->id == id) return x;
    }
}

static void ghost_put(QueuesObject *self, uint32_t id, uint32_t at) {
    uint32_t i = mix(id) & self->gmask;
    while (self->gslots[i].at != EMPTY && self->gslots[i].id != id) i = (i + 1) & self->gmask;
    self->gslots[i].id = id; self->gslots[i].at = at;
}

static void ghost_del(QueuesObject *self, GSlot *x) {
    uint32_t i = (uint32_t)(x - self->gslots), j = i, mask = self->gmask;
    while (1) {  /* backward shift (fills_hole) */
        j = (j + 1) & mask;
        if (self->gslots[j].at == EMPTY) break;
        if (fills_hole(i, j, mix(self->gslots[j].id) & mask)) {
            self->gslots[i] = self->gslots[j]; i = j;
        }
    }
    self->gslots[i].at = EMPTY;
    self->live--;
}

static int ghost_live_at(QueuesObject *self, uint32_t at) {
    GSlot *x = ghost_find(self, self->ring[at]);
    return x && x->at == at;
}

/* Make the ghost's tables fit `bound` live ids (the ring and the map twice that),
 * keeping its live ids in order; also squeezes the dead out of the ring. */
static int ghost_resize(QueuesObject *self, uint64_t bound) {
    uint32_t ring_size = (uint32_t)(2 * bound + 2);
    uint32_t gsize = pow2_at_least(2 * bound + 2);
    uint32_t *ring = malloc((size_t)ring_size * sizeof(uint32_t));
    GSlot *gslots = malloc((size_t)gsize * sizeof(GSlot));
    if (!ring || !gslots) { free(ring); free(gslots); PyErr_NoMemory(); return -1; }
    uint32_t out = 0;
    for (uint32_t k = 0; k < self->ring_len; k++) {
        uint32_t at = (self->ring_head + k) % self->ring_size;
        if (ghost_live_at(self, at)) ring[out++] = self->ring[at];
    }
    /* more live than the new ring can take: the oldest go */
    uint32_t skip = out > ring_size / 2 ? out - ring_size / 2 : 0;
    for (uint32_t i = 0; i < gsize; i++) gslots[i].at = EMPTY;
    free(self->gslots); free(self->ring);
    self->gslots = gslots; self->gmask = gsize - 1;
    self->ring = ring; self->ring_size = ring_size;
    self->ring_head = 0; self->ring_len = 0; self->live = 0;
    for (uint32_t k = skip; k < out; k++) {
        ring[self->ring_len] = ring[k];
        ghost_put(self, ring[k], self->ring_len);
        self->ring_len++; self->live++;
    }
    return 0;
}

/* id evicted: into the ghost (kept where it is if there already) */
static int ghost_add(QueuesObject *self, uint32_t id) {
    if (ghost_find(self, id)) return 0;
    if (self->ring_len == self->ring_size) {
        /* full of dead and live: squeeze (the live fit: at most half the ring) */
        if (ghost_resize(self, (self->ring_size - 2) / 2) < 0) return -1;
    }
    uint32_t at = (self->ring_head + self->ring_len) % self->ring_size;
    self->ring[at] = id; self->ring_len++;
    ghost_put(self, id, at);
    self->live++;
    return 0;
}

/* cut the ghost to `bound` live ids, the oldest first */
static void ghost_trim(QueuesObject *self, uint64_t bound) {
    while (self->live > bound && self->ring_len) {
        uint32_t at = self->ring_head;
        self->ring_head = (at + 1) % self->ring_size; self->ring_len--;
        GSlot *x = ghost_find(self, self->ring[at]);
        if (x && x->at == at) ghost_del(self, x);
    }
}

/* the ghost holds id: take it out */
static int ghost_take(QueuesObject *self, uint32_t id) {
    GSlot *x = ghost_find(self, id);
    if (!x) return 0;
    ghost_del(self, x);
    return 1;
}

/* ---- the object ----------------------------------------------------------------------- */

static int Queues_init(QueuesObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "", kwlist)) return -1;
    if (self->slots) { PyErr_SetString(PyExc_RuntimeError, "Queues are initialized once"); return -1; }
    self->head[0] = self->head[1] = self->tail[0] = self->tail[1] = NIL;
    self->free_head = NIL;
    if (rehash(self, 64) < 0) return -1;
    return ghost_resize(self, 16);
}

static void Queues_dealloc(QueuesObject *self) {
    for (int32_t e = 0; e < self->cap_nodes; e++) Py_XDECREF(self->nodes[e].key);
    free(self->nodes); free(self->slots); free(self->gslots); free(self->ring);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_key(PyObject *key) {
    if (!PyBytes_Check(key)) { PyErr_SetString(PyExc_TypeError, "keys are bytes"); return -1; }
    return 0;
}

enum { ADD, BACK, TOUCH };

/* one batch: keys given time now and taken deepest first */
static PyObject *batch(QueuesObject *self, PyObject *args, int verb) {
    PyObject *keys;
    double wall;
    if (!PyArg_ParseTuple(args, "Od", &keys, &wall)) return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys: a sequence of bytes");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t k = 0; k < n; k++)  /* all or nothing */
        if (check_key(items[k]) < 0 || PyObject_Hash(items[k]) == -1) { Py_DECREF(seq); return NULL; }
    if (verb != TOUCH && reserve(self, n) < 0) { Py_DECREF(seq); return NULL; }
    int64_t t = self->time;
    self->time = t + n;
    for (Py_ssize_t k = n - 1; k >= 0; k--) {
        PyObject *key = items[k];
        Py_hash_t h = PyObject_Hash(key);  /* cached by bytes */
        uint32_t i = find_slot(self, key, h);
        int32_t e = self->slots[i];
        if (verb == TOUCH) {
            if (e == NIL) continue;
            unlink_node(self, e);
            append_node(self, e, 1, t, wall);
            continue;
        }
        if (e != NIL) {  /* already there: moved, never doubled */
            unlink_node(self, e);
        } else {
            e = self->free_head;  /* reserved above */
            self->free_head = self->nodes[e].next;
            Py_INCREF(key);
            self->nodes[e].key = key; self->nodes[e].hash = h;
            self->slots[i] = e;
            self->nnodes++;
        }
        uint8_t q = 1;
        if (verb == ADD) q = ghost_take(self, ghost_id(h)) ? 1 : 0;
        append_node(self, e, q, t, wall);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *Queues_add(QueuesObject *self, PyObject *args) { return batch(self, args, ADD); }
static PyObject *Queues_back(QueuesObject *self, PyObject *args) { return batch(self, args, BACK); }
static PyObject *Queues_touch(QueuesObject *self, PyObject *args) { return batch(self, args, TOUCH); }

static PyObject *Queues_discard(QueuesObject *self, PyObject *key) {
    if (check_key(key) < 0) return NULL;
    Py_hash_t h = PyObject_Hash(key);
    if (h == -1) return NULL;
    int32_t e = find(self, key, h);
    if (e != NIL) remove_node(self, e);
    Py_RETURN_NONE;
}

/* the victim order: the next node after the cursors a (once) and b (reused) */
static int32_t next_victim(QueuesObject *self, int32_t *a, int32_t *b, double margin) {
    int32_t e;
    if (*b == NIL || (*a != NIL && (double)self->nodes[*a].t
                                   <= (double)self->nodes[*b].t + margin)) {
        e = *a;
        if (e != NIL) *a = self->nodes[e].next;
    } else {
        e = *b;
        *b = self->nodes[e].next;
    }
    return e;
}

static PyObject *Queues_oldest(QueuesObject *self, PyObject *args) {
    Py_ssize_t n;
    double margin;
    if (!PyArg_ParseTuple(args, "nd", &n, &margin)) return NULL;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    int32_t a = self->head[0], b = self->head[1], e;
    while (PyList_GET_SIZE(out) < n && (e = next_victim(self, &a, &b, margin)) != NIL)
        if (PyList_Append(out, self->nodes[e].key) < 0) { Py_DECREF(out); return NULL; }
    return out;
}

static PyObject *Queues_oldest_use(QueuesObject *self, PyObject *arg) {
    double margin = PyFloat_AsDouble(arg);
    if (margin == -1.0 && PyErr_Occurred()) return NULL;
    int32_t a = self->head[0], b = self->head[1];
    int32_t e = next_victim(self, &a, &b, margin);
    if (e == NIL) Py_RETURN_NONE;
    return PyFloat_FromDouble(self->nodes[e].wall);
}

static PyObject *Queues_pop(QueuesObject *self, PyObject *args) {
    Py_ssize_t n;
    double margin;
    PyObject *busy, *used;
    long long bound;
    if (!PyArg_ParseTuple(args, "ndOOL", &n, &margin, &busy, &used, &bound)) return NULL;
    if (used != Py_None && !PyList_Check(used)) {
        PyErr_SetString(PyExc_TypeError, "used: a list or None");
        return NULL;
    }
    if (bound < 0) { PyErr_SetString(PyExc_ValueError, "ghost_bound is not negative"); return NULL; }
    int any_busy = PyObject_IsTrue(busy);
    if (any_busy < 0) return NULL;
    int64_t held = self->n[0] + self->n[1];
    if (n > held) n = (Py_ssize_t)held;
    if (n < 0) n = 0;
    int32_t *out = malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    int32_t *passed = malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    if (!out || !passed) { free(out); free(passed); return PyErr_NoMemory(); }
    Py_ssize_t nout = 0, npassed = 0;
    int32_t a = self->head[0], b = self->head[1], e;
    while (nout < n && (e = next_victim(self, &a, &b, margin)) != NIL) {
        if (any_busy) {
            int in = PySequence_Contains(busy, self->nodes[e].key);
            if (in < 0) { free(out); free(passed); return NULL; }
            if (in) { if (npassed < n) passed[npassed++] = e; continue; }
        }
        out[nout++] = e;
    }
    for (Py_ssize_t k = 0; nout < n && k < npassed; k++) out[nout++] = passed[k];
    free(passed);
    /* everything that can fail, before anything changes */
    PyObject *keys = PyList_New(nout);
    PyObject *walls = used != Py_None ? PyList_New(nout) : NULL;
    if (!keys || (used != Py_None && !walls)) goto fail;
    for (Py_ssize_t k = 0; k < nout; k++) {
        Node *x = &self->nodes[out[k]];
        Py_INCREF(x->key);
        PyList_SET_ITEM(keys, k, x->key);
        if (walls) {
            PyObject *w = PyFloat_FromDouble(x->wall);
            if (!w) goto fail;
            PyList_SET_ITEM(walls, k, w);
        }
    }
    /* room in the ring for what it holds and the victims, so ghost_add never drops one */
    uint64_t need = (uint64_t)self->live + (uint64_t)nout;
    if (need + 2 > (uint64_t)self->ring_size / 2 &&
        ghost_resize(self, (need > (uint64_t)bound ? need : (uint64_t)bound) + 16) < 0) goto fail;
    if (walls) {
        Py_ssize_t have = PyList_GET_SIZE(used);
        if (PyList_SetSlice(used, have, have, walls) < 0) goto fail;
        Py_DECREF(walls);
        walls = NULL;
    }
    for (Py_ssize_t k = 0; k < nout; k++) {
        uint32_t id = ghost_id(self->nodes[out[k]].hash);
        remove_node(self, out[k]);
        ghost_add(self, id);  /* cannot fail: room made above */
    }
    ghost_trim(self, (uint64_t)bound);
    if ((uint64_t)self->ring_size > 8 * (uint64_t)bound + 64)  /* the bound fell: give back */
        ghost_resize(self, (uint64_t)bound + 16);  /* on failure the old tables stay */
    PyErr_Clear();
    free(out);
    return keys;
fail:
    free(out);
    Py_XDECREF(keys);
    Py_XDECREF(walls);
    return NULL;
}

static Py_ssize_t Queues_len(QueuesObject *self) { return (Py_ssize_t)(self->n[0] + self->n[1]); }

static int Queues_contains(QueuesObject *self, PyObject *key) {
    if (!PyBytes_Check(key)) return 0;
    Py_hash_t h = PyObject_Hash(key);
    if (h == -1) return -1;
    return find(self, key, h) != NIL;
}

static PyObject *Queues_held(QueuesObject *self, PyObject *unused) {
    (void)unused;
    return Py_BuildValue("(LL)", (long long)self->n[0], (long long)self->n[1]);
}

static PyObject *Queues_ghost_len(QueuesObject *self, PyObject *unused) {
    (void)unused;
    return PyLong_FromUnsignedLong(self->live);
}

static PyObject *Queues_nbytes(QueuesObject *self, PyObject *unused) {
    (void)unused;
    size_t b = sizeof(*self) + (size_t)self->cap_nodes * sizeof(Node)
        + ((size_t)self->mask + 1) * sizeof(int32_t)
        + ((size_t)self->gmask + 1) * sizeof(GSlot) + (size_t)self->ring_size * sizeof(uint32_t);
    return PyLong_FromSize_t(b);
}

static PySequenceMethods Queues_as_sequence = {
    .sq_length = (lenfunc)Queues_len,
    .sq_contains = (objobjproc)Queues_contains,
};

static PyMethodDef Queues_methods[] = {
    {"add", (PyCFunction)Queues_add, METH_VARARGS,
     "add(keys, wall): newly evictable keys (chain order): reused if their id is in the "
     "ghost (it leaves it), else used once."},
    {"back", (PyCFunction)Queues_back, METH_VARARGS,
     "back(keys, wall): keys evictable again after being read: reused."},
    {"touch", (PyCFunction)Queues_touch, METH_VARARGS,
     "touch(keys, wall): those of keys held become reused, the most recent."},
    {"discard", (PyCFunction)Queues_discard, METH_O, "discard(key): out, if held."},
    {"pop", (PyCFunction)Queues_pop, METH_VARARGS,
     "pop(n, margin, busy, used, ghost_bound) -> up to n victims, removed, their ids into "
     "the ghost."},
    {"oldest", (PyCFunction)Queues_oldest, METH_VARARGS,
     "oldest(n, margin) -> up to n keys in victim order, left in place."},
    {"oldest_use", (PyCFunction)Queues_oldest_use, METH_O,
     "oldest_use(margin) -> the next victim's wall time, or None."},
    {"held", (PyCFunction)Queues_held, METH_NOARGS, "held() -> (used once, reused)."},
    {"ghost_len", (PyCFunction)Queues_ghost_len, METH_NOARGS,
     "ghost_len() -> the ids in the ghost."},
    {"nbytes", (PyCFunction)Queues_nbytes, METH_NOARGS,
     "nbytes() -> the bytes its tables hold (not the keys, which the pool holds)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject QueuesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hicached.cache._queues.Queues",
    .tp_basicsize = sizeof(QueuesObject),
    .tp_dealloc = (destructor)Queues_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Queues(): the reuse policy's two queues and ghost.",
    .tp_methods = Queues_methods,
    .tp_as_sequence = &Queues_as_sequence,
    .tp_init = (initproc)Queues_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_queues",
    "The reuse eviction policy's queues and ghost in C (hicached.cache.reuse_lru).", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__queues(void) {
    if (PyType_Ready(&QueuesType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&QueuesType);
    if (PyModule_AddObject(m, "Queues", (PyObject *)&QueuesType) < 0) {
        Py_DECREF(&QueuesType); Py_DECREF(m); return NULL;
    }
    return m;
}
