/*
 * hicache._poll: wait for a socket to become readable by polling, without the interpreter lock.
 *
 * A thread that sleeps in recv() on a virtual machine whose idle CPUs halt pays a VM exit and
 * an interrupt to wake: tens of microseconds, more than a small request's work. Polling for a
 * short window first avoids that when the bytes come soon (hicache.polling decides how long).
 * The poll loop runs with the interpreter lock released, so the process's other threads run
 * meanwhile; at most `max_pollers` threads of a process poll at once (the others sleep at
 * once), so polling never takes more than that many CPUs, and nothing polls while more
 * threads of the node want to run than it has CPUs (a poll would take a CPU from one of them).
 *
 * wait_readable(fd, ns) -> 1: readable, closed or failed (recv will say which); 0: nothing
 * within ns; -1: not polled (max_pollers threads already polling); -2: not polled (the node's
 * CPUs are all wanted).
 * set_max_pollers(n) -> the previous limit. set_busy_check(on) -> the previous setting.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

static atomic_int pollers = 0;
static atomic_int max_pollers = 1;

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* More threads want to run on the node than it has CPUs (the "running" count of
 * /proc/loadavg, read at most once a millisecond): a poll would take a CPU from one of them. */
static atomic_llong busy_checked_ns = 0;
static atomic_int busy = 0, busy_check = 1;
static int ncpus = 0;

static int node_busy(long long now) {
    if (!atomic_load(&busy_check)) return 0;
    if (now - atomic_load(&busy_checked_ns) < 1000000LL) return atomic_load(&busy);
    char buf[128];
    int running = 0, fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t n = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (n > 0) {
            buf[n] = 0;
            if (sscanf(buf, "%*f %*f %*f %d/", &running) != 1) running = 0;
        }
    }
    atomic_store(&busy, running > ncpus);
    atomic_store(&busy_checked_ns, now);
    return running > ncpus;
}

static PyObject *wait_readable(PyObject *self, PyObject *args) {
    int fd;
    long long ns;
    (void)self;
    if (!PyArg_ParseTuple(args, "iL", &fd, &ns)) return NULL;
    long long start = now_ns();
    if (node_busy(start)) return PyLong_FromLong(-2);
    if (atomic_fetch_add(&pollers, 1) >= atomic_load(&max_pollers)) {
        atomic_fetch_sub(&pollers, 1);
        return PyLong_FromLong(-1);
    }
    int r;
    Py_BEGIN_ALLOW_THREADS
    struct pollfd p = {.fd = fd, .events = POLLIN, .revents = 0};
    long long deadline = start + ns;
    for (;;) {
        r = poll(&p, 1, 0);
        if (r != 0 || now_ns() >= deadline) break; /* r < 0 (EINTR, EBADF): recv reports */
        for (int i = 0; i < 8; i++) relax();
    }
    Py_END_ALLOW_THREADS
    atomic_fetch_sub(&pollers, 1);
    return PyLong_FromLong(r != 0 ? 1 : 0);
}

static PyObject *set_max_pollers(PyObject *self, PyObject *args) {
    int n;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &n)) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "max_pollers must be >= 0");
        return NULL;
    }
    return PyLong_FromLong(atomic_exchange(&max_pollers, n));
}

static PyObject *set_busy_check(PyObject *self, PyObject *args) {
    int on;
    (void)self;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    atomic_store(&busy_checked_ns, 0);
    return PyBool_FromLong(atomic_exchange(&busy_check, on));
}

static PyMethodDef methods[] = {
    {"wait_readable", wait_readable, METH_VARARGS,
     "wait_readable(fd, ns) -> 1 readable (or closed), 0 nothing within ns, -1 not polled"},
    {"set_max_pollers", set_max_pollers, METH_VARARGS,
     "set_max_pollers(n) -> the previous limit of threads polling at once"},
    {"set_busy_check", set_busy_check, METH_VARARGS,
     "set_busy_check(on) -> whether waits skipped polling on a busy node before"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_poll", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

/* A child forked while a thread polled inherits its slot but not the thread: free them all. */
static void reset_after_fork(void) { atomic_store(&pollers, 0); }

PyMODINIT_FUNC PyInit__poll(void) {
    static int atfork_registered = 0;
    if (!atfork_registered && pthread_atfork(NULL, NULL, reset_after_fork) == 0)
        atfork_registered = 1;
    cpu_set_t set;
    ncpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
    if (ncpus <= 0) ncpus = (int)sysconf(_SC_NPROCESSORS_ONLN);
    return PyModule_Create(&module);
}
