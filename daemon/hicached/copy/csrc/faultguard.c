/*
 * The SIGBUS guard of hicached.copy._copykernel: a worker that truncates the shared-memory file
 * it handed over makes the daemon's next access to the lost pages raise SIGBUS. Copies run with
 * a per-thread jump buffer armed (`fault_guard`, see kernel.h); the handler jumps back to it, the
 * copy reports a fault instead of killing the process, and the caller fails that request and
 * ends that session. A SIGBUS anywhere else is handed on unchanged: the handler restores the
 * previous disposition and returns, so the faulting instruction raises it again there.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <setjmp.h>
#include <stddef.h>
#include <string.h>
#include "kernel.h"

_Thread_local sigjmp_buf *fault_guard = NULL;
static struct sigaction previous;
static int installed = 0;

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    (void)info;
    (void)context;
    sigjmp_buf *guard = fault_guard;
    if (guard != NULL) {
        fault_guard = NULL;
        siglongjmp(*guard, 1);
    }
    (void)sig;
    sigaction(SIGBUS, &previous, NULL); /* not a guarded copy: let it fault as before */
}

int fault_guard_install(void) {
    if (installed) return 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &previous) != 0) return -1;
    installed = 1;
    return 0;
}
