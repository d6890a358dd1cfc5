/*
 * A stand-in for libcuda.so.1 on hosts without a GPU: the subset of the CUDA driver API that
 * hicached uses, with the same symbols, signatures and error codes, so the IPC lifecycle, the
 * UUID mapping and the copy segmentation run for real in CI.
 *
 * "Device memory" is a memfd mapping; a device pointer is its host address. An IPC memory
 * handle names the exporting process and its fd; opening it maps /proc/PID/fd/FD, so the
 * exporter must be alive, as with CUDA. Copies check that the device side lies inside a live
 * allocation; they run at enqueue, or (fakecuda_set_defer) only when something synchronizes
 * with their stream, as a GPU runs them "later". Events record a sequence number when they
 * run; the copy log and counters (fakecuda_stat) let tests check ordering and that every
 * handle, stream, event and host registration was released.
 *
 * Interprocess events keep their state in a shared page, so a worker waiting on its own event
 * sees the record the daemon made on its import once the daemon's stream has run it.
 * FAKECUDA_DEFER=1 defers from the start.
 *
 * Host registration refuses what Linux refuses to pin long-term: a shared mapping of a file on
 * a filesystem with writeback (ext4, xfs, overlay...); only tmpfs, hugetlbfs and ramfs files
 * (memfds among them) and anonymous memory pin, as cuMemHostRegister finds on a real host.
 *
 * The virtual memory management API (cuMemCreate, cuMemMap...) is real too: a physical
 * allocation is a memfd named "fakecuda-vmm-<device uuid>", 2 MiB granular as on GPUs; an
 * allocation created exportable as a POSIX fd exports a dup of its memfd, and an import
 * accepts only such an fd (it reads /proc/self/fd/N: a plain memfd or a file is refused) and
 * finds the device by the UUID in its name, in this process's numbering; a reservation is a
 * PROT_NONE mapping (of an empty memfd named "fakecuda-reserved", so that /proc/PID/maps shows
 * it), cuMemMap maps the memfd there (MAP_FIXED | MAP_SHARED), and only
 * cuMemSetAccess makes it memory copies may touch (a copy may run across chunks mapped back
 * to back in one reservation, as the GPU's does). cuMemGetAddressRange on VMM memory gives the
 * one mapping holding the address. fakecuda_stat counts what the tests check was released:
 * vmm_handles (handles not released), vmm_imported (imported allocations alive: held by a
 * handle or a mapping), vmm_allocations (every physical allocation alive), vmm_mappings,
 * vmm_reservations.
 *
 * Devices: FAKECUDA_DEVICES="uuid,uuid" (32 hex digits each) in this process's numbering, as
 * CUDA_VISIBLE_DEVICES would reorder them; default one device.
 *
 * Kernels: the daemon's page kernel (hicached/cuda/pages.cu) is compiled into this library as
 * C++ (kernel_emulation.h), and cuModuleGetFunction hands it out for any loaded module;
 * cuLaunchKernel runs it on the CPU when its stream runs: every block, each as up to
 * EMU_THREADS threads one after another (the kernel strides by blockDim, so the bytes are the
 * same). Each fragment it copies is checked first (fakecuda_fragment): the device side inside
 * one allocation, the host side inside one registration mapped into the device (DEVICEMAP, or
 * cuMemHostAlloc); a fragment that is not is skipped and counted (kernel_faults), where a GPU
 * would fault. cuMemcpyBatchAsync is the CUDA 13 one (exported as _v2; FAKECUDA_BATCH_ABI=12
 * builds the 12.8 one instead, FAKECUDA_BATCH_ABI=0 none): each copy checked as cuMemcpyAsync
 * checks it. Timed events stamp the time their record ran, for cuEventElapsedTime.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum {
    OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NO_DEVICE = 100, INVALID_DEVICE = 101,
    INVALID_CONTEXT = 201, ALREADY_MAPPED = 208, INVALID_HANDLE = 400, NOT_FOUND = 500,
    HOST_ALREADY_REGISTERED = 712, HOST_NOT_REGISTERED = 713, NOT_SUPPORTED = 801
};

typedef struct { unsigned char reserved[64]; } ipc_handle_t;
typedef struct { unsigned char bytes[16]; } uuid_t16;
typedef struct {
    size_t srcXInBytes, srcY;
    int srcMemoryType;
    const void *srcHost;
    CUdeviceptr srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    CUdeviceptr dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} memcpy2d_t;

#define MAX_DEV 8
#define MAX_ALLOC 4096
#define MAX_EVENT 4096
#define MAX_REG 8192
#define LOG_MAX (1 << 20)

enum { K_DEVICE = 1, K_VMM = 2, K_MANAGED = 3, K_IMPORTED = 4 };

typedef struct {
    int used, kind, dev, fd;
    uint64_t base, size, id;
    int origin_pid;  /* imported: exporter pid and allocation id */
    uint64_t origin_id;
    int phys, resv;  /* a VMM mapping (kind K_VMM, fd -1): its physical allocation and
                      * reservation; -1 for every other allocation */
    int access;      /* copies may touch it: always, but a VMM mapping only once
                      * cuMemSetAccess granted it */
} alloc_t;

/* state[0] = records enqueued but not run, state[1] = sequence number of the last run; shared
 * (a memfd page) for interprocess events, so the exporter sees records made by an importer */
typedef struct { int used, interprocess, imported, fd, timed; long stream; long *state; long local[2]; double at; } event_t;
typedef struct { uint64_t base, size; int mapped, hostalloc; } reg_t;
typedef struct { long seq; uint64_t dst, src, n; } copy_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int ndev = -1;
static uuid_t16 uuids[MAX_DEV];
static alloc_t allocs[MAX_ALLOC];
static event_t events[MAX_EVENT];
static reg_t regs[MAX_REG];
static copy_t *copy_log;
static long ncopies, ncalls, seq_counter, next_id = 1;
static long n_streams, n_open_handles, n_registered_bytes, n_ctx_retained;
static int defer_mode; /* FAKECUDA_DEFER=1 or fakecuda_set_defer */
static int strict_pinned; /* FAKECUDA_STRICT_PINNED=1 or fakecuda_set_strict_pinned */
static long n_unpinned_copies, n_straddling_copies;
static __thread int ctx_stack[16];
static __thread int ctx_depth;

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static void init_devices(void) {
    if (ndev >= 0) return;
    const char *env = getenv("FAKECUDA_DEVICES");
    const char *defer = getenv("FAKECUDA_DEFER");
    defer_mode = defer && *defer == '1';
    const char *strict = getenv("FAKECUDA_STRICT_PINNED");
    strict_pinned = strict && *strict == '1';
    if (!env || !*env) env = "fa4ec0da000000000000000000000001";
    ndev = 0;
    const char *p = env;
    while (*p && ndev < MAX_DEV) {
        int k = 0;
        unsigned char b[16];
        while (*p && *p != ',' && k < 32) {
            if (*p == '-') { p++; continue; }
            int v = hexval(*p++);
            if (v < 0) break;
            if (k % 2 == 0) b[k / 2] = (unsigned char)(v << 4); else b[k / 2] |= (unsigned char)v;
            k++;
        }
        if (k == 32) memcpy(uuids[ndev++].bytes, b, 16);
        while (*p && *p != ',') p++;
        if (*p == ',') p++;
    }
}

static int current_dev(void) { return ctx_depth > 0 ? ctx_stack[ctx_depth - 1] : -1; }

CUresult cuInit(unsigned flags) { (void)flags; pthread_mutex_lock(&mu); init_devices(); pthread_mutex_unlock(&mu); return OK; }
CUresult cuDriverGetVersion(int *v) { *v = 12080; return OK; }
CUresult cuDeviceGetCount(int *n) { init_devices(); *n = ndev; return OK; }
CUresult cuDeviceGet(int *dev, int ordinal) {
    init_devices();
    if (ordinal < 0 || ordinal >= ndev) return INVALID_DEVICE;
    *dev = ordinal;
    return OK;
}
CUresult cuDeviceGetUuid(uuid_t16 *u, int dev) {
    if (dev < 0 || dev >= ndev) return INVALID_DEVICE;
    *u = uuids[dev];
    return OK;
}
CUresult cuDeviceGetUuid_v2(uuid_t16 *u, int dev) { return cuDeviceGetUuid(u, dev); }
CUresult cuDeviceGetName(char *name, int len, int dev) {
    if (dev < 0 || dev >= ndev) return INVALID_DEVICE;
    snprintf(name, (size_t)len, "Fake GPU %d", dev);
    return OK;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, int dev) {
    if (dev < 0 || dev >= ndev) return INVALID_DEVICE;
    *bytes = (size_t)80 << 30;
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    if (dev < 0 || dev >= ndev) return INVALID_DEVICE;
    *ctx = (void *)(intptr_t)(dev + 1);
    __atomic_add_fetch(&n_ctx_retained, 1, __ATOMIC_SEQ_CST);
    return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(int dev) { (void)dev; __atomic_sub_fetch(&n_ctx_retained, 1, __ATOMIC_SEQ_CST); return OK; }
CUresult cuCtxPushCurrent_v2(void *ctx) {
    intptr_t d = (intptr_t)ctx - 1;
    if (d < 0 || d >= ndev || ctx_depth >= 16) return INVALID_CONTEXT;
    ctx_stack[ctx_depth++] = (int)d;
    return OK;
}
CUresult cuCtxPopCurrent_v2(void **ctx) {
    if (ctx_depth == 0) return INVALID_CONTEXT;
    int d = ctx_stack[--ctx_depth];
    if (ctx) *ctx = (void *)(intptr_t)(d + 1);
    return OK;
}

static const char *names[][2] = {
    {"0", "CUDA_SUCCESS"}, {"1", "CUDA_ERROR_INVALID_VALUE"}, {"2", "CUDA_ERROR_OUT_OF_MEMORY"},
    {"101", "CUDA_ERROR_INVALID_DEVICE"}, {"201", "CUDA_ERROR_INVALID_CONTEXT"},
    {"208", "CUDA_ERROR_ALREADY_MAPPED"}, {"400", "CUDA_ERROR_INVALID_HANDLE"},
    {"500", "CUDA_ERROR_NOT_FOUND"}, {"712", "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"},
    {"713", "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"}, {"801", "CUDA_ERROR_NOT_SUPPORTED"},
};
CUresult cuGetErrorName(CUresult rc, const char **out) {
    char buf[16];
    snprintf(buf, sizeof buf, "%d", rc);
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(names[i][0], buf)) { *out = names[i][1]; return OK; }
    return INVALID_VALUE;
}

/* -- memory -------------------------------------------------------------------------------- */

static alloc_t *find_alloc(uint64_t p) {
    for (int i = 0; i < MAX_ALLOC; i++)
        if (allocs[i].used && p >= allocs[i].base && p < allocs[i].base + allocs[i].size)
            return &allocs[i];
    return NULL;
}

static alloc_t *new_alloc(void) {
    for (int i = 0; i < MAX_ALLOC; i++)
        if (!allocs[i].used) {
            memset(&allocs[i], 0, sizeof allocs[i]);
            allocs[i].used = 1; allocs[i].phys = allocs[i].resv = -1; allocs[i].access = 1;
            return &allocs[i];
        }
    return NULL;
}

static CUresult alloc_kind(CUdeviceptr *out, size_t n, int kind) {
    int dev = current_dev();
    if (dev < 0) return INVALID_CONTEXT;
    if (n == 0) return INVALID_VALUE;
    int fd = memfd_create("fakecuda", MFD_CLOEXEC);
    if (fd < 0) return OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)n) != 0) { close(fd); return OUT_OF_MEMORY; }
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) { close(fd); return OUT_OF_MEMORY; }
    pthread_mutex_lock(&mu);
    alloc_t *a = new_alloc();
    if (!a) { pthread_mutex_unlock(&mu); munmap(p, n); close(fd); return OUT_OF_MEMORY; }
    a->kind = kind; a->dev = dev; a->fd = fd; a->base = (uint64_t)(uintptr_t)p; a->size = n;
    a->id = (uint64_t)next_id++;
    pthread_mutex_unlock(&mu);
    *out = a->base;
    return OK;
}

CUresult cuMemAlloc_v2(CUdeviceptr *out, size_t n) { return alloc_kind(out, n, K_DEVICE); }
/* Allocations CUDA IPC cannot share: managed (the VMM API's: fakecuda_alloc_vmm, below). */
CUresult fakecuda_alloc_managed(CUdeviceptr *out, size_t n) { return alloc_kind(out, n, K_MANAGED); }

CUresult cuMemFree_v2(CUdeviceptr p) {
    pthread_mutex_lock(&mu);
    alloc_t *a = find_alloc(p);
    if (!a || a->base != p || a->kind == K_IMPORTED || a->phys >= 0) { pthread_mutex_unlock(&mu); return INVALID_VALUE; }
    munmap((void *)(uintptr_t)a->base, a->size);
    close(a->fd);
    a->used = 0;
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total) {
    size_t used = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_ALLOC; i++)
        if (allocs[i].used && allocs[i].kind != K_IMPORTED && allocs[i].phys < 0) used += allocs[i].size;
    pthread_mutex_unlock(&mu);
    *total = (size_t)80 << 30;
    *free_b = *total - used;
    return OK;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    pthread_mutex_lock(&mu);
    alloc_t *a = find_alloc(p);
    if (a) { if (base) *base = a->base; if (size) *size = a->size; }
    pthread_mutex_unlock(&mu);
    return a ? OK : NOT_FOUND;
}

CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
    pthread_mutex_lock(&mu);
    alloc_t *a = find_alloc(p);
    CUresult rc = OK;
    if (!a) rc = INVALID_VALUE;
    else switch (attr) {
        case 2: *(unsigned *)data = 2; break;
        case 8: *(unsigned *)data = a->kind == K_MANAGED; break;
        case 9: *(int *)data = a->dev; break;
        case 10: *(unsigned *)data = a->kind == K_DEVICE || a->kind == K_IMPORTED; break;
        case 11: *(uint64_t *)data = a->base; break;
        case 12: *(size_t *)data = a->size; break;
        default: rc = INVALID_VALUE;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

/* handle: "FAKECUDA" | pid | fd | device uuid | size | allocation id */
CUresult cuIpcGetMemHandle(ipc_handle_t *h, CUdeviceptr p) {
    pthread_mutex_lock(&mu);
    alloc_t *a = find_alloc(p);
    if (!a || a->base != p || a->kind != K_DEVICE) { pthread_mutex_unlock(&mu); return INVALID_VALUE; }
    memset(h, 0, sizeof *h);
    memcpy(h->reserved, "FAKECUDA", 8);
    int32_t pid = getpid(), fd = a->fd;
    memcpy(h->reserved + 8, &pid, 4);
    memcpy(h->reserved + 12, &fd, 4);
    memcpy(h->reserved + 16, uuids[a->dev].bytes, 16);
    memcpy(h->reserved + 32, &a->size, 8);
    memcpy(h->reserved + 40, &a->id, 8);
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *out, ipc_handle_t h, unsigned flags) {
    (void)flags;
    int dev = current_dev();
    if (dev < 0) return INVALID_CONTEXT;
    if (memcmp(h.reserved, "FAKECUDA", 8) != 0) return INVALID_VALUE;
    int32_t pid, fd;
    uint64_t size, id;
    memcpy(&pid, h.reserved + 8, 4);
    memcpy(&fd, h.reserved + 12, 4);
    memcpy(&size, h.reserved + 32, 8);
    memcpy(&id, h.reserved + 40, 8);
    if (memcmp(h.reserved + 16, uuids[dev].bytes, 16) != 0) return INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_ALLOC; i++)
        if (allocs[i].used && allocs[i].kind == K_IMPORTED && allocs[i].origin_pid == pid
            && allocs[i].origin_id == id) { pthread_mutex_unlock(&mu); return ALREADY_MAPPED; }
    pthread_mutex_unlock(&mu);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
    int nfd = open(path, O_RDWR | O_CLOEXEC);
    if (nfd < 0) return INVALID_HANDLE;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, nfd, 0);
    if (p == MAP_FAILED) { close(nfd); return INVALID_HANDLE; }
    pthread_mutex_lock(&mu);
    alloc_t *a = new_alloc();
    if (!a) { pthread_mutex_unlock(&mu); munmap(p, size); close(nfd); return OUT_OF_MEMORY; }
    a->kind = K_IMPORTED; a->dev = dev; a->fd = nfd; a->base = (uint64_t)(uintptr_t)p;
    a->size = size; a->origin_pid = pid; a->origin_id = id; a->id = (uint64_t)next_id++;
    n_open_handles++;
    pthread_mutex_unlock(&mu);
    *out = a->base;
    return OK;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    alloc_t *a = find_alloc(p);
    if (!a || a->base != p || a->kind != K_IMPORTED) { pthread_mutex_unlock(&mu); return INVALID_VALUE; }
    munmap((void *)(uintptr_t)a->base, a->size);
    close(a->fd);
    a->used = 0;
    n_open_handles--;
    pthread_mutex_unlock(&mu);
    return OK;
}

/* -- virtual memory management ----------------------------------------------------------------
 * Physical allocations (cuMemCreate, or imported from an exported fd) are memfds; a handle
 * names one (handles counts cuMemCreate / import / retain less cuMemRelease), and it lives
 * while a handle or a mapping holds it, as on a GPU. Layouts as cuda.h (12.x, 13.0) declares
 * them: CUmemAllocationProp is {int type; int requestedHandleTypes; {int type; int id}
 * location; void *win32HandleMetaData; {uchar, uchar, ushort, uchar[4]} allocFlags}. */

#define MAX_PHYS 1024
#define MAX_RESV 1024
#define VMM_GRANULARITY ((uint64_t)2 << 20)
#define VMM_HANDLE_TAG 0xfa4e000000000000ull
#define VMM_NAME "fakecuda-vmm-"
#define GUARD 4096

typedef struct { int type, id; } mem_location_t;
typedef struct {
    int type, requested_handle_types;
    mem_location_t location;
    void *win32;
    unsigned char compression, rdma;
    unsigned short usage;
    unsigned char reserved[4];
} mem_prop_t;
typedef struct { mem_location_t location; int flags; } mem_access_t;

typedef struct { int used, dev, fd, types, imported; uint64_t size; long handles, maps; } phys_t;
typedef struct { int used; uint64_t base, size; } resv_t;
static phys_t physs[MAX_PHYS];
static resv_t resvs[MAX_RESV];

static phys_t *phys_of(unsigned long long h) {  /* a handle not yet released (mu held) */
    if ((h & 0xffff000000000000ull) != VMM_HANDLE_TAG) return NULL;
    unsigned long long i = (h & 0xffffffffull) - 1;
    if (i >= MAX_PHYS || !physs[i].used || physs[i].handles <= 0) return NULL;
    return &physs[i];
}

static unsigned long long handle_of(phys_t *ph) { return VMM_HANDLE_TAG | (unsigned long long)(ph - physs + 1); }

static void phys_drop(phys_t *ph) {  /* free it once neither a handle nor a mapping holds it */
    if (ph->handles > 0 || ph->maps > 0) return;
    close(ph->fd);
    ph->used = 0;
}

static phys_t *new_phys(void) {
    for (int i = 0; i < MAX_PHYS; i++)
        if (!physs[i].used) { memset(&physs[i], 0, sizeof physs[i]); physs[i].used = 1; return &physs[i]; }
    return NULL;
}

/* Reserved ranges map an empty memfd named "fakecuda-reserved" (never touched: PROT_NONE), so
 * another process can see in /proc/PID/maps what a process still has reserved. */
static int reserved_fd = -1;

static void *placeholder(void *at, size_t n) {
    if (reserved_fd < 0) reserved_fd = memfd_create("fakecuda-reserved", MFD_CLOEXEC);
    if (reserved_fd < 0) return MAP_FAILED;
    return mmap(at, n, PROT_NONE, MAP_SHARED | MAP_NORESERVE | (at ? MAP_FIXED : 0), reserved_fd, 0);
}

static int valid_location(const mem_location_t *l) { return l->type == 1 && l->id >= 0 && l->id < ndev; }

CUresult cuMemGetAllocationGranularity(size_t *g, const mem_prop_t *prop, int option) {
    init_devices();
    if (!g || !prop || (option != 0 && option != 1)) return INVALID_VALUE;
    if (prop->type != 1 || !valid_location(&prop->location)) return INVALID_VALUE;
    *g = VMM_GRANULARITY;
    return OK;
}

static CUresult vmm_create(unsigned long long *h, size_t n, int dev, int types) {
    if ((n % VMM_GRANULARITY) || n == 0 || (types & ~1)) return INVALID_VALUE;
    char name[64];
    snprintf(name, sizeof name, VMM_NAME);
    for (int k = 0; k < 16; k++) snprintf(name + strlen(VMM_NAME) + 2 * k, 3, "%02x", uuids[dev].bytes[k]);
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0) return OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)n) != 0) { close(fd); return OUT_OF_MEMORY; }
    phys_t *ph = new_phys();
    if (!ph) { close(fd); return OUT_OF_MEMORY; }
    ph->dev = dev; ph->fd = fd; ph->types = types; ph->size = n; ph->handles = 1;
    *h = handle_of(ph);
    return OK;
}

CUresult cuMemCreate(unsigned long long *h, size_t n, const mem_prop_t *prop, unsigned long long flags) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    if (!h || !prop || flags || prop->type != 1 || !valid_location(&prop->location)) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult rc = vmm_create(h, n, prop->location.id, prop->requested_handle_types);
    pthread_mutex_unlock(&mu);
    return rc;
}

CUresult cuMemRelease(unsigned long long h) {
    pthread_mutex_lock(&mu);
    phys_t *ph = phys_of(h);
    if (ph) { ph->handles--; phys_drop(ph); }
    pthread_mutex_unlock(&mu);
    return ph ? OK : INVALID_VALUE;
}

static alloc_t *vmm_mapping_at(uint64_t p) {  /* the VMM mapping holding p, accessible or not */
    for (int i = 0; i < MAX_ALLOC; i++)
        if (allocs[i].used && allocs[i].phys >= 0 && p >= allocs[i].base
                && p < allocs[i].base + allocs[i].size)
            return &allocs[i];
    return NULL;
}

CUresult cuMemRetainAllocationHandle(unsigned long long *h, void *addr) {
    if (!h) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    alloc_t *a = vmm_mapping_at((uint64_t)(uintptr_t)addr);
    if (a) { physs[a->phys].handles++; *h = handle_of(&physs[a->phys]); }
    pthread_mutex_unlock(&mu);
    return a ? OK : INVALID_VALUE;
}

CUresult cuMemGetAllocationPropertiesFromHandle(mem_prop_t *prop, unsigned long long h) {
    if (!prop) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    phys_t *ph = phys_of(h);
    if (ph) {
        memset(prop, 0, sizeof *prop);
        prop->type = 1; prop->requested_handle_types = ph->types;
        prop->location.type = 1; prop->location.id = ph->dev;
    }
    pthread_mutex_unlock(&mu);
    return ph ? OK : INVALID_VALUE;
}

CUresult cuMemExportToShareableHandle(void *out, unsigned long long h, int type, unsigned long long flags) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    if (!out || flags) return INVALID_VALUE;
    if (type != 1) return NOT_SUPPORTED;
    pthread_mutex_lock(&mu);
    phys_t *ph = phys_of(h);
    CUresult rc = !ph ? INVALID_VALUE : !(ph->types & 1) ? INVALID_VALUE : OK;
    if (rc == OK) {
        int fd = fcntl(ph->fd, F_DUPFD_CLOEXEC, 0);
        if (fd < 0) rc = OUT_OF_MEMORY; else *(int *)out = fd;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

/* An fd is an exported handle when it is a memfd this library named for the VMM API. */
CUresult cuMemImportFromShareableHandle(unsigned long long *h, void *os_handle, int type) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    if (!h || type != 1) return INVALID_VALUE;
    int fd = (int)(intptr_t)os_handle;
    char path[64], target[256];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t len = readlink(path, target, sizeof target - 1);
    if (len < 0) return INVALID_VALUE;
    target[len] = 0;
    const char *prefix = "/memfd:" VMM_NAME;
    if (strncmp(target, prefix, strlen(prefix)) != 0) return INVALID_VALUE;
    unsigned char b[16];
    const char *hex = target + strlen(prefix);
    for (int k = 0; k < 32; k++) {
        int v = hexval(hex[k]);
        if (v < 0) return INVALID_VALUE;
        if (k % 2 == 0) b[k / 2] = (unsigned char)(v << 4); else b[k / 2] |= (unsigned char)v;
    }
    int dev = -1;
    for (int d = 0; d < ndev; d++) if (!memcmp(uuids[d].bytes, b, 16)) dev = d;
    if (dev < 0) return INVALID_DEVICE;  /* memory of a GPU this process does not see */
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size <= 0) return INVALID_VALUE;
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) return OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    phys_t *ph = new_phys();
    if (ph) {
        ph->dev = dev; ph->fd = own; ph->types = 1; ph->imported = 1;
        ph->size = (uint64_t)st.st_size; ph->handles = 1;
        *h = handle_of(ph);
    }
    pthread_mutex_unlock(&mu);
    if (!ph) { close(own); return OUT_OF_MEMORY; }
    return OK;
}

static CUresult vmm_reserve(uint64_t *out, size_t n) {
    if (n == 0 || (n % VMM_GRANULARITY)) return INVALID_VALUE;
    size_t span = n + VMM_GRANULARITY;  /* aligned to the granularity, as the GPU's are */
    void *p = placeholder(NULL, span);
    if (p == MAP_FAILED) return OUT_OF_MEMORY;
    uint64_t lo = (uint64_t)(uintptr_t)p, base = (lo + VMM_GRANULARITY - 1) & ~(VMM_GRANULARITY - 1);
    if (base > lo) munmap(p, base - lo);
    /* one page past the range stays reserved: /proc/PID/maps shows the range even once its
     * every byte is mapped, and two ranges never touch */
    if (base + n + GUARD < lo + span)
        munmap((void *)(uintptr_t)(base + n + GUARD), lo + span - base - n - GUARD);
    for (int i = 0; i < MAX_RESV; i++)
        if (!resvs[i].used) {
            resvs[i].used = 1; resvs[i].base = base; resvs[i].size = n;
            *out = base;
            return OK;
        }
    munmap((void *)(uintptr_t)base, n + GUARD);
    return OUT_OF_MEMORY;
}

CUresult cuMemAddressReserve(CUdeviceptr *out, size_t n, size_t align, CUdeviceptr addr, unsigned long long flags) {
    (void)addr;  /* a hint */
    if (current_dev() < 0) return INVALID_CONTEXT;
    if (!out || flags || (align && (align & (align - 1)))) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    uint64_t base = 0;
    CUresult rc = vmm_reserve(&base, n);
    pthread_mutex_unlock(&mu);
    if (rc == OK) *out = base;
    return rc;
}

static int resv_of(uint64_t p, uint64_t n) {
    for (int i = 0; i < MAX_RESV; i++)
        if (resvs[i].used && p >= resvs[i].base && p + n <= resvs[i].base + resvs[i].size) return i;
    return -1;
}

/* Refused while anything is still mapped in it: the release order is unmap, then free. */
static CUresult vmm_address_free(uint64_t p, uint64_t n) {
    int r = resv_of(p, n);
    if (r < 0 || resvs[r].base != p || resvs[r].size != n) return INVALID_VALUE;
    for (int i = 0; i < MAX_ALLOC; i++)
        if (allocs[i].used && allocs[i].resv == r) return INVALID_VALUE;
    munmap((void *)(uintptr_t)p, n + GUARD);
    resvs[r].used = 0;
    return OK;
}

CUresult cuMemAddressFree(CUdeviceptr p, size_t n) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    CUresult rc = vmm_address_free(p, n);
    pthread_mutex_unlock(&mu);
    return rc;
}

static CUresult vmm_map(uint64_t p, uint64_t n, uint64_t offset, unsigned long long h) {
    phys_t *ph = phys_of(h);
    if (!ph) return INVALID_HANDLE;
    if (offset || n == 0 || (n % VMM_GRANULARITY) || (p % VMM_GRANULARITY) || n > ph->size)
        return INVALID_VALUE;
    int r = resv_of(p, n);
    if (r < 0) return INVALID_VALUE;
    for (int i = 0; i < MAX_ALLOC; i++)
        if (allocs[i].used && p < allocs[i].base + allocs[i].size && allocs[i].base < p + n)
            return ALREADY_MAPPED;
    alloc_t *a = new_alloc();
    if (!a) return OUT_OF_MEMORY;
    if (mmap((void *)(uintptr_t)p, n, PROT_NONE, MAP_SHARED | MAP_FIXED, ph->fd, 0) == MAP_FAILED) {
        a->used = 0;
        return OUT_OF_MEMORY;
    }
    a->kind = K_VMM; a->dev = ph->dev; a->fd = -1; a->base = p; a->size = n;
    a->id = (uint64_t)next_id++; a->phys = (int)(ph - physs); a->resv = r; a->access = 0;
    ph->maps++;
    return OK;
}

CUresult cuMemMap(CUdeviceptr p, size_t n, size_t offset, unsigned long long h, unsigned long long flags) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    if (flags) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult rc = vmm_map(p, n, offset, h);
    pthread_mutex_unlock(&mu);
    return rc;
}

/* [p, p+n) exactly covered by whole VMM mappings */
static int covered(uint64_t p, uint64_t n) {
    if (n == 0) return 0;
    for (uint64_t q = p; q < p + n;) {
        alloc_t *a = vmm_mapping_at(q);
        if (!a || a->base != q || a->base + a->size > p + n) return 0;
        q = a->base + a->size;
    }
    return 1;
}

static CUresult vmm_set_access(uint64_t p, uint64_t n, int prot) {
    if (!covered(p, n)) return INVALID_VALUE;
    if (mprotect((void *)(uintptr_t)p, n, prot) != 0) return INVALID_VALUE;
    for (uint64_t q = p; q < p + n;) {
        alloc_t *a = vmm_mapping_at(q);
        a->access = prot != PROT_NONE;
        q = a->base + a->size;
    }
    return OK;
}

CUresult cuMemSetAccess(CUdeviceptr p, size_t n, const mem_access_t *desc, size_t count) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    if (!desc || count == 0) return INVALID_VALUE;
    int prot = PROT_NONE;
    for (size_t i = 0; i < count; i++) {
        if (!valid_location(&desc[i].location)) return INVALID_DEVICE;
        if (desc[i].flags == 3) prot = PROT_READ | PROT_WRITE;
        else if (desc[i].flags == 1) { if (prot == PROT_NONE) prot = PROT_READ; }
        else if (desc[i].flags != 0) return INVALID_VALUE;
    }
    pthread_mutex_lock(&mu);
    CUresult rc = vmm_set_access(p, n, prot);
    pthread_mutex_unlock(&mu);
    return rc;
}

static CUresult vmm_unmap(uint64_t p, uint64_t n) {
    if (!covered(p, n)) return INVALID_VALUE;
    for (uint64_t q = p; q < p + n;) {
        alloc_t *a = vmm_mapping_at(q);
        q = a->base + a->size;
        /* the reservation's placeholder back in its place */
        placeholder((void *)(uintptr_t)a->base, a->size);
        phys_t *ph = &physs[a->phys];
        a->used = 0;
        ph->maps--;
        phys_drop(ph);
    }
    return OK;
}

CUresult cuMemUnmap(CUdeviceptr p, size_t n) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    CUresult rc = vmm_unmap(p, n);
    pthread_mutex_unlock(&mu);
    return rc;
}

/* VMM memory as PyTorch's expandable segments make it: created without an exportable handle
 * type, mapped in a reservation of its own, the handle released (the mapping holds it); n is
 * rounded up to the granularity. fakecuda_free_vmm undoes it. Needs a current context. */
CUresult fakecuda_alloc_vmm(CUdeviceptr *out, size_t n) {
    int dev = current_dev();
    if (dev < 0) return INVALID_CONTEXT;
    n = (n + VMM_GRANULARITY - 1) & ~(VMM_GRANULARITY - 1);
    pthread_mutex_lock(&mu);
    unsigned long long h;
    uint64_t base = 0;
    CUresult rc = vmm_create(&h, n, dev, 0);
    if (rc == OK) {
        rc = vmm_reserve(&base, n);
        if (rc == OK && (rc = vmm_map(base, n, 0, h)) != OK) vmm_address_free(base, n);
        if (rc == OK) rc = vmm_set_access(base, n, PROT_READ | PROT_WRITE);
        phys_t *ph = phys_of(h);
        ph->handles--;  /* the mapping holds it now */
        phys_drop(ph);
    }
    pthread_mutex_unlock(&mu);
    if (rc == OK) *out = base;
    return rc;
}

CUresult fakecuda_free_vmm(CUdeviceptr p) {
    pthread_mutex_lock(&mu);
    alloc_t *a = vmm_mapping_at(p);
    CUresult rc = INVALID_VALUE;
    if (a && a->base == p) {
        uint64_t rb = resvs[a->resv].base, rs = resvs[a->resv].size;
        rc = vmm_unmap(p, a->size);
        if (rc == OK) rc = vmm_address_free(rb, rs);
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

static long pin_limit = -1; /* bytes that may be registered, as RLIMIT_MEMLOCK would cap */
void fakecuda_set_pin_limit(long bytes) { pthread_mutex_lock(&mu); pin_limit = bytes; pthread_mutex_unlock(&mu); }

/* 1 when [p, p+n) lies in a shared mapping of a file whose filesystem the kernel would not
 * let be pinned long-term (it tracks dirty pages for writeback). */
static int unpinnable_file_mapping(uint64_t p) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return 0;
    char line[4096];
    int refused = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi, inode;
        char perms[8], path[3072] = "";
        if (sscanf(line, "%lx-%lx %7s %*s %*s %lu %3071[^\n]", &lo, &hi, perms, &inode,
                   path) < 4 || p < lo || p >= hi) continue;
        char *deleted = strstr(path, " (deleted)");
        if (deleted) *deleted = 0;
        struct statfs fs;
        if (perms[3] == 's' && inode != 0 && path[0] == '/' && strncmp(path, "/memfd:", 7)
                && statfs(path, &fs) == 0 && fs.f_type != 0x01021994 /* tmpfs */
                && fs.f_type != 0x958458f6 /* hugetlbfs */ && fs.f_type != 0x858458f6)
            refused = 1;
        break;
    }
    fclose(f);
    return refused;
}

static CUresult register_host(void *p, size_t n, int mapped, int hostalloc);

CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    return register_host(p, n, (flags & 2) != 0 /* DEVICEMAP */, 0);
}

static CUresult register_host(void *p, size_t n, int mapped, int hostalloc) {
    if (unpinnable_file_mapping((uint64_t)(uintptr_t)p)) return INVALID_VALUE;
    uint64_t b = (uint64_t)(uintptr_t)p;
    pthread_mutex_lock(&mu);
    if (pin_limit >= 0 && n_registered_bytes + (long)n > pin_limit) {
        pthread_mutex_unlock(&mu);
        return OUT_OF_MEMORY;
    }
    int slot = -1;
    for (int i = 0; i < MAX_REG; i++) {
        if (regs[i].size && b < regs[i].base + regs[i].size && regs[i].base < b + n) {
            pthread_mutex_unlock(&mu);
            return HOST_ALREADY_REGISTERED;
        }
        if (!regs[i].size && slot < 0) slot = i;
    }
    if (slot < 0) { pthread_mutex_unlock(&mu); return OUT_OF_MEMORY; }
    regs[slot].base = b; regs[slot].size = n;
    regs[slot].mapped = mapped; regs[slot].hostalloc = hostalloc;
    n_registered_bytes += (long)n;
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuMemHostUnregister(void *p) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    uint64_t b = (uint64_t)(uintptr_t)p;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_REG; i++)
        if (regs[i].size && regs[i].base == b && !regs[i].hostalloc) {
            n_registered_bytes -= (long)regs[i].size;
            regs[i].size = 0;
            pthread_mutex_unlock(&mu);
            return OK;
        }
    pthread_mutex_unlock(&mu);
    return HOST_NOT_REGISTERED;
}

/* -- streams, events, copies --------------------------------------------------------------
 * By default work runs at enqueue. With fakecuda_set_defer(1) a stream only runs its queue at
 * a synchronization point (cuStreamSynchronize, cuEventSynchronize on an event recorded on it,
 * a stream that waits on such an event, cuStreamDestroy), so a missing synchronize leaves the
 * bytes unmoved, and a copy whose memory was unmapped before it ran counts a deferred error
 * (the sticky error a real GPU would raise). */

#define MAX_STREAM 1024
enum { OP_COPY = 1, OP_RECORD = 2, OP_WAIT = 3, OP_LAUNCH = 4 };
typedef struct { int kind; uint64_t dst, src, n; long ev, other; } op_t;
typedef struct { int used; op_t *ops; long len, cap, head; } stream_t;
static stream_t streams[MAX_STREAM];
static long deferred_errors;

void fakecuda_set_defer(int on) { pthread_mutex_lock(&mu); defer_mode = on; pthread_mutex_unlock(&mu); }

static stream_t *stream_of(void *s) {
    intptr_t i = (intptr_t)s - 0x5001;
    if (i < 0 || i >= MAX_STREAM || !streams[i].used) return NULL;
    return &streams[i];
}

CUresult cuStreamCreate(void **s, unsigned flags) {
    (void)flags;
    if (current_dev() < 0) return INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_STREAM; i++)
        if (!streams[i].used) {
            memset(&streams[i], 0, sizeof streams[i]);
            streams[i].used = 1;
            n_streams++;
            *s = (void *)(intptr_t)(0x5001 + i);
            pthread_mutex_unlock(&mu);
            return OK;
        }
    pthread_mutex_unlock(&mu);
    return OUT_OF_MEMORY;
}

static event_t *ev_of(void *e) {
    intptr_t i = (intptr_t)e - 1;
    if (i < 0 || i >= MAX_EVENT || !events[i].used) return NULL;
    return &events[i];
}

/* The device side of a copy must lie inside one live allocation (as the DMA engine would fault
 * otherwise), or run across VMM mappings that follow each other in one reservation, each
 * accessible; the host side is plain memory. At least one side must be device memory. */
static int inside(uint64_t p, uint64_t n) {
    alloc_t *a = find_alloc(p);
    if (!a || !a->access) return 0;
    while (p + n > a->base + a->size) {
        alloc_t *b = a->phys >= 0 ? find_alloc(a->base + a->size) : NULL;
        if (!b || !b->access || b->phys < 0 || b->resv != a->resv) return 0;
        a = b;
    }
    return 1;
}

/* The host side [p, p+n) of a copy, as the driver sees it: 1 when it lies in one registration,
 * 0 when no byte of it is registered (pageable), -1 when it spans two registrations or
 * registered and unregistered memory, which the driver refuses (CUDA_ERROR_INVALID_VALUE:
 * "memory regions spanning over allocations that are both registered and not registered are
 * not supported"; two adjoining registrations are two allocations). */
static int registered(uint64_t p, uint64_t n) {
    uint64_t end = p + n;
    for (int i = 0; i < MAX_REG; i++)
        if (regs[i].size && regs[i].base < end && p < regs[i].base + regs[i].size)
            return regs[i].base <= p && end <= regs[i].base + regs[i].size ? 1 : -1;
    return 0;
}

/* With fakecuda_set_strict_pinned(1) the host side of every copy must be registered memory,
 * when it is enqueued and when it runs: a pool that gave back locked memory the device still
 * copies to fails here (a refused enqueue, or a deferred error). unpinned_copies counts the
 * copies that were not (strict or not). */
void fakecuda_set_strict_pinned(int on) { pthread_mutex_lock(&mu); strict_pinned = on; pthread_mutex_unlock(&mu); }

static CUresult check_copy(uint64_t dst, uint64_t src, uint64_t n) {
    int d = find_alloc(dst) != NULL, s = find_alloc(src) != NULL;
    if (!d && !s) return INVALID_VALUE;
    if ((d && !inside(dst, n)) || (s && !inside(src, n))) return INVALID_VALUE;
    int host = d && s ? 1 : !d ? registered(dst, n) : registered(src, n);
    if (host < 0) { n_straddling_copies++; return INVALID_VALUE; }
    if (host == 0) {
        n_unpinned_copies++;
        if (strict_pinned) return INVALID_VALUE;
    }
    return OK;
}

static void run_copy(uint64_t dst, uint64_t src, uint64_t n) {
    if (check_copy(dst, src, n) != OK) { deferred_errors++; return; }
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    if (!copy_log) copy_log = calloc(LOG_MAX, sizeof *copy_log);
    if (copy_log && ncopies < LOG_MAX) {
        copy_log[ncopies].seq = seq_counter + 1;
        copy_log[ncopies].dst = dst; copy_log[ncopies].src = src; copy_log[ncopies].n = n;
    }
    ncopies++;
    seq_counter++;
}

static void drain(stream_t *st);
static void run_launch(const op_t *op);

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void run_op(const op_t *op) {
    if (op->kind == OP_COPY) {
        run_copy(op->dst, op->src, op->n);
    } else if (op->kind == OP_LAUNCH) {
        run_launch(op);
    } else if (op->kind == OP_RECORD) {
        event_t *ev = ev_of((void *)(intptr_t)op->ev);
        if (ev) {
            ev->at = now_s();
            __atomic_store_n(&ev->state[1], ++seq_counter, __ATOMIC_SEQ_CST);
            __atomic_sub_fetch(&ev->state[0], 1, __ATOMIC_SEQ_CST);
        }
    } else if (op->kind == OP_WAIT) {
        stream_t *other = stream_of((void *)(intptr_t)op->other);
        if (other) drain(other);
    }
}

static void drain(stream_t *st) {
    while (st->head < st->len) {
        op_t op = st->ops[st->head++];
        run_op(&op);
    }
    st->head = st->len = 0;
}

/* run now, or queue on the stream (the null stream always runs now) */
static CUresult submit(void *s, op_t op) {
    stream_t *st = stream_of(s);
    if (s && !st) return INVALID_HANDLE;
    if (!defer_mode || !st) { run_op(&op); return OK; }
    if (st->len == st->cap) {
        long cap = st->cap ? 2 * st->cap : 1024;
        op_t *ops = realloc(st->ops, (size_t)cap * sizeof *ops);
        if (!ops) return OUT_OF_MEMORY;
        st->ops = ops; st->cap = cap;
    }
    st->ops[st->len++] = op;
    return OK;
}

CUresult cuStreamSynchronize(void *s) {
    pthread_mutex_lock(&mu);
    stream_t *st = stream_of(s);
    if (st) drain(st);
    pthread_mutex_unlock(&mu);
    return s && !st ? INVALID_HANDLE : OK;
}

CUresult cuStreamDestroy_v2(void *s) {
    pthread_mutex_lock(&mu);
    stream_t *st = stream_of(s);
    if (!st) { pthread_mutex_unlock(&mu); return INVALID_HANDLE; }
    drain(st);  /* work already queued still completes */
    free(st->ops);
    memset(st, 0, sizeof *st);
    n_streams--;
    pthread_mutex_unlock(&mu);
    return OK;
}

static long pending_of(event_t *ev) { return __atomic_load_n(&ev->state[0], __ATOMIC_SEQ_CST); }

/* fd >= 0: map that memfd as the shared state (imported); interprocess: a new shared page */
static CUresult new_event(void **out, int interprocess, int imported, int fd) {
    long *state = NULL;
    if (interprocess) {
        int own = fd < 0;
        if (own) {
            fd = memfd_create("fakecuda-event", MFD_CLOEXEC);
            if (fd < 0 || ftruncate(fd, 4096) != 0) return OUT_OF_MEMORY;
        }
        void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) { close(fd); return OUT_OF_MEMORY; }
        state = p;
        if (imported) { close(fd); fd = -1; }
    }
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_EVENT; i++)
        if (!events[i].used) {
            memset(&events[i], 0, sizeof events[i]);
            events[i].used = 1; events[i].interprocess = interprocess;
            events[i].imported = imported; events[i].fd = fd;
            events[i].state = state ? state : events[i].local;
            *out = (void *)(intptr_t)(i + 1);
            pthread_mutex_unlock(&mu);
            return OK;
        }
    pthread_mutex_unlock(&mu);
    if (state) munmap(state, 4096);
    if (fd >= 0) close(fd);
    return OUT_OF_MEMORY;
}

CUresult cuEventCreate(void **e, unsigned flags) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    if ((flags & 4) && !(flags & 2)) return INVALID_VALUE; /* interprocess needs no timing */
    CUresult rc = new_event(e, (flags & 4) != 0, 0, -1);
    if (rc == OK) ev_of(*e)->timed = !(flags & 2);
    return rc;
}
CUresult cuEventRecord(void *e, void *s) {
    pthread_mutex_lock(&mu);
    event_t *ev = ev_of(e);
    CUresult rc = INVALID_HANDLE;
    if (ev) {
        __atomic_add_fetch(&ev->state[0], 1, __ATOMIC_SEQ_CST);
        ev->stream = (long)(intptr_t)s;
        rc = submit(s, (op_t){OP_RECORD, 0, 0, 0, (long)(intptr_t)e, 0});
        if (rc != OK) __atomic_sub_fetch(&ev->state[0], 1, __ATOMIC_SEQ_CST);
    }
    pthread_mutex_unlock(&mu);
    return rc;
}
CUresult cuEventQuery(void *e) {
    pthread_mutex_lock(&mu);
    event_t *ev = ev_of(e);
    CUresult rc = !ev ? INVALID_HANDLE : pending_of(ev) ? 600 /* NOT_READY */ : OK;
    pthread_mutex_unlock(&mu);
    return rc;
}
/* Runs the recording stream if it is ours; a record made in another process (an importer of
 * this event) is waited for until that process runs it, for up to 30 s. */
CUresult cuEventSynchronize(void *e) {
    pthread_mutex_lock(&mu);
    event_t *ev = ev_of(e);
    if (!ev) { pthread_mutex_unlock(&mu); return INVALID_HANDLE; }
    if (pending_of(ev)) {
        stream_t *st = stream_of((void *)(intptr_t)ev->stream);
        if (st) drain(st);
    }
    for (int waited = 0; pending_of(ev) > 0; waited++) {
        if (waited > 150000) { pthread_mutex_unlock(&mu); return 702; /* LAUNCH_TIMEOUT */ }
        pthread_mutex_unlock(&mu);
        usleep(200);
        pthread_mutex_lock(&mu);
    }
    pthread_mutex_unlock(&mu);
    return OK;
}
CUresult cuStreamWaitEvent(void *s, void *e, unsigned flags) {
    (void)flags;
    pthread_mutex_lock(&mu);
    event_t *ev = ev_of(e);
    CUresult rc = INVALID_HANDLE;
    if (ev)
        rc = pending_of(ev) ? submit(s, (op_t){OP_WAIT, 0, 0, 0, 0, ev->stream}) : OK;
    pthread_mutex_unlock(&mu);
    return rc;
}
CUresult cuEventDestroy_v2(void *e) {
    pthread_mutex_lock(&mu);
    event_t *ev = ev_of(e);
    if (ev) {
        ev->used = 0;
        if (ev->state != ev->local) munmap(ev->state, 4096);
        if (ev->fd >= 0) close(ev->fd);
    }
    pthread_mutex_unlock(&mu);
    return ev ? OK : INVALID_HANDLE;
}
/* event handle: "FAKEEVNT" | pid | fd of the shared state page */
CUresult cuIpcGetEventHandle(ipc_handle_t *h, void *e) {
    event_t *ev = ev_of(e);
    if (!ev || !ev->interprocess || ev->imported) return INVALID_VALUE;
    memset(h, 0, sizeof *h);
    memcpy(h->reserved, "FAKEEVNT", 8);
    int32_t pid = getpid(), fd = ev->fd;
    memcpy(h->reserved + 8, &pid, 4);
    memcpy(h->reserved + 12, &fd, 4);
    return OK;
}
CUresult cuIpcOpenEventHandle(void **e, ipc_handle_t h) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    if (memcmp(h.reserved, "FAKEEVNT", 8) != 0) return INVALID_VALUE;
    int32_t pid, fd;
    memcpy(&pid, h.reserved + 8, 4);
    memcpy(&fd, h.reserved + 12, 4);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
    int nfd = open(path, O_RDWR | O_CLOEXEC);
    if (nfd < 0) return INVALID_HANDLE;
    return new_event(e, 1, 1, nfd);
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void *stream) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    ncalls++;
    CUresult rc = check_copy(dst, src, n);
    if (rc == OK) rc = submit(stream, (op_t){OP_COPY, dst, src, n, 0, 0});
    pthread_mutex_unlock(&mu);
    return rc;
}

CUresult cuMemcpy2DAsync_v2(const memcpy2d_t *c, void *stream) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    if (c->srcMemoryType != 4 || c->dstMemoryType != 4) return INVALID_VALUE;
    if (c->WidthInBytes > c->srcPitch || c->WidthInBytes > c->dstPitch) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    ncalls++;
    CUresult rc = OK;
    if (c->Height > 0) {  /* the host side's whole extent, as one range (see registered) */
        int dhost = find_alloc(c->dstDevice) == NULL, shost = find_alloc(c->srcDevice) == NULL;
        uint64_t p = dhost ? c->dstDevice : c->srcDevice;
        uint64_t pitch = dhost ? c->dstPitch : c->srcPitch;
        if ((dhost || shost) && registered(p, (c->Height - 1) * pitch + c->WidthInBytes) < 0) {
            n_straddling_copies++;
            rc = INVALID_VALUE;
        }
    }
    for (size_t r = 0; r < c->Height && rc == OK; r++)
        rc = check_copy(c->dstDevice + r * c->dstPitch, c->srcDevice + r * c->srcPitch,
                        c->WidthInBytes);
    for (size_t r = 0; r < c->Height && rc == OK; r++)
        rc = submit(stream, (op_t){OP_COPY, c->dstDevice + r * c->dstPitch,
                                   c->srcDevice + r * c->srcPitch, c->WidthInBytes, 0, 0});
    pthread_mutex_unlock(&mu);
    return rc;
}

CUresult cuEventElapsedTime(float *ms, void *start, void *end) {
    pthread_mutex_lock(&mu);
    event_t *a = ev_of(start), *b = ev_of(end);
    CUresult rc = !a || !b ? INVALID_HANDLE
                  : !a->timed || !b->timed ? INVALID_HANDLE
                  : pending_of(a) || pending_of(b) ? 600 /* NOT_READY */ : OK;
    if (rc == OK) *ms = (float)((b->at - a->at) * 1e3);
    pthread_mutex_unlock(&mu);
    return rc;
}

/* -- attributes, mapped host memory, modules, launches, batches ---------------------------- */

static int attributes[128];
static int attributes_set;

static void default_attributes(void) {
    if (attributes_set) return;
    attributes[16] = 8;   /* MULTIPROCESSOR_COUNT */
    attributes[41] = 1;   /* UNIFIED_ADDRESSING */
    attributes[75] = 9;   /* COMPUTE_CAPABILITY_MAJOR */
    attributes[76] = 0;   /* COMPUTE_CAPABILITY_MINOR */
    attributes[91] = 1;   /* CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM */
    attributes_set = 1;
}

void fakecuda_set_attribute(int attr, int value) {
    pthread_mutex_lock(&mu);
    default_attributes();
    if (attr >= 0 && attr < 128) attributes[attr] = value;
    pthread_mutex_unlock(&mu);
}

CUresult cuDeviceGetAttribute(int *out, int attr, int dev) {
    if (dev < 0 || dev >= ndev) return INVALID_DEVICE;
    if (attr < 0 || attr >= 128) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    default_attributes();
    *out = attributes[attr];
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    void *m = aligned_alloc(4096, (n + 4095) & ~(size_t)4095);
    if (!m) return OUT_OF_MEMORY;
    memset(m, 0, n);
    CUresult rc = register_host(m, n, (flags & 2) != 0, 1);
    if (rc != OK) { free(m); return rc; }
    *p = m;
    return OK;
}

CUresult cuMemFreeHost(void *p) {
    uint64_t b = (uint64_t)(uintptr_t)p;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_REG; i++)
        if (regs[i].size && regs[i].base == b && regs[i].hostalloc) {
            n_registered_bytes -= (long)regs[i].size;
            regs[i].size = 0;
            pthread_mutex_unlock(&mu);
            free(p);
            return OK;
        }
    pthread_mutex_unlock(&mu);
    return INVALID_VALUE;
}

static reg_t *reg_of(uint64_t p, uint64_t n) {
    for (int i = 0; i < MAX_REG; i++)
        if (regs[i].size && regs[i].base <= p && p + n <= regs[i].base + regs[i].size)
            return &regs[i];
    return NULL;
}

CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *out, void *p, unsigned flags) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    if (flags) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    reg_t *r = reg_of((uint64_t)(uintptr_t)p, 1);
    CUresult rc = r && r->mapped ? OK : INVALID_VALUE;
    if (rc == OK) *out = (CUdeviceptr)(uintptr_t)p; /* unified addressing: the same address */
    pthread_mutex_unlock(&mu);
    return rc;
}

static long n_modules, n_launches, n_kernel_fragments, n_kernel_faults;
#define FAKE_MODULE 0x6001
#define FAKE_PAGES_FN 0x7001

CUresult cuModuleLoadData(void **m, const void *image) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    if (!image || memcmp(image, "\177ELF", 4) != 0) return 200; /* INVALID_IMAGE */
    pthread_mutex_lock(&mu);
    n_modules++;
    pthread_mutex_unlock(&mu);
    *m = (void *)(intptr_t)FAKE_MODULE;
    return OK;
}

CUresult cuModuleUnload(void *m) {
    if ((intptr_t)m != FAKE_MODULE) return INVALID_HANDLE;
    pthread_mutex_lock(&mu);
    n_modules--;
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
    if ((intptr_t)m != FAKE_MODULE) return INVALID_HANDLE;
    if (strcmp(name, "hicache_copy_pages") != 0) return NOT_FOUND;
    *f = (void *)(intptr_t)FAKE_PAGES_FN;
    return OK;
}

/* The emulated kernel's check of one fragment (called with mu held, from run_launch): the
 * device side inside one allocation, the host side inside one mapped registration. */
int fakecuda_fragment(const void *dst, long long dst_bytes, const void *src,
                      long long src_bytes, unsigned thread) {
    const void *side[2] = {dst, src};
    long long bytes[2] = {dst_bytes, src_bytes};
    if (thread == 0) n_kernel_fragments++;  /* each thread checks; one counts */
    for (int k = 0; k < 2; k++) {
        uint64_t p = (uint64_t)(uintptr_t)side[k], n = (uint64_t)bytes[k];
        if (find_alloc(p) ? inside(p, n) : (reg_of(p, n) && reg_of(p, n)->mapped)) continue;
        if (thread == 0) n_kernel_faults++;
        return 0;
    }
    return 1;
}

void fakecuda_run_pages(const long long *table, long long lo, long long hi,
                        unsigned grid, unsigned block);

static void run_launch(const op_t *op) {
    const long long *table = (const long long *)(uintptr_t)op->dst;
    /* the table itself must be readable by the device: mapped host memory or device memory */
    uint64_t t = op->dst;
    if (!(find_alloc(t) ? inside(t, 32) : (reg_of(t, 32) && reg_of(t, 32)->mapped))) {
        n_kernel_faults++;
        return;
    }
    n_launches++;
    fakecuda_run_pages(table, (long long)op->src, (long long)op->n, (unsigned)op->ev,
                       (unsigned)op->other);
    seq_counter++;
}

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shmem, void *stream, void **params,
                        void **extra) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    if ((intptr_t)f != FAKE_PAGES_FN) return INVALID_HANDLE;
    if (!gx || !bx || gy != 1 || gz != 1 || by != 1 || bz != 1 || bx > 1024 || shmem || extra
            || !params)
        return INVALID_VALUE;
    uint64_t table = *(uint64_t *)params[0];
    long long lo = *(long long *)params[1], hi = *(long long *)params[2];
    pthread_mutex_lock(&mu);
    ncalls++;
    CUresult rc = submit(stream, (op_t){OP_LAUNCH, table, (uint64_t)lo, (uint64_t)hi,
                                        (long)gx, (long)bx});
    pthread_mutex_unlock(&mu);
    return rc;
}

#ifndef FAKECUDA_BATCH_ABI
#define FAKECUDA_BATCH_ABI 13
#endif

static long n_batches;

#if FAKECUDA_BATCH_ABI
static CUresult batch_copy(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                           const void *attrs, size_t *idxs, size_t nattrs, void *stream) {
    if (current_dev() < 0) return INVALID_CONTEXT;
    if (!stream || !count || !attrs || !idxs || nattrs < 1 || idxs[0] != 0)
        return INVALID_VALUE;  /* no legacy stream; the first attribute applies from copy 0 */
    pthread_mutex_lock(&mu);
    ncalls++;
    n_batches++;
    CUresult rc = OK;
    for (size_t i = 0; i < count && rc == OK; i++) rc = check_copy(dsts[i], srcs[i], sizes[i]);
    for (size_t i = 0; i < count && rc == OK; i++)
        rc = submit(stream, (op_t){OP_COPY, dsts[i], srcs[i], sizes[i], 0, 0});
    pthread_mutex_unlock(&mu);
    return rc;
}
#endif

#if FAKECUDA_BATCH_ABI == 13
CUresult cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                               size_t count, const void *attrs, size_t *idxs, size_t nattrs,
                               void *stream) {
    return batch_copy(dsts, srcs, sizes, count, attrs, idxs, nattrs, stream);
}
#elif FAKECUDA_BATCH_ABI == 12
CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                            const void *attrs, size_t *idxs, size_t nattrs, size_t *fail,
                            void *stream) {
    CUresult rc = batch_copy(dsts, srcs, sizes, count, attrs, idxs, nattrs, stream);
    if (rc != OK && fail) *fail = 0;
    return rc;
}
#endif

/* -- inspection for tests ------------------------------------------------------------------ */

long fakecuda_stat(const char *what) {
    long out = -1;
    pthread_mutex_lock(&mu);
    if (!strcmp(what, "open_handles")) out = n_open_handles;
    else if (!strcmp(what, "streams")) out = n_streams;
    else if (!strcmp(what, "registered_bytes")) out = n_registered_bytes;
    else if (!strcmp(what, "unpinned_copies")) out = n_unpinned_copies;
    else if (!strcmp(what, "straddling_copies")) out = n_straddling_copies;
    else if (!strcmp(what, "registrations")) {
        out = 0;
        for (int i = 0; i < MAX_REG; i++) out += regs[i].size != 0;
    }
    else if (!strcmp(what, "copies")) out = ncopies;
    else if (!strcmp(what, "calls")) out = ncalls;
    else if (!strcmp(what, "seq")) out = seq_counter;
    else if (!strcmp(what, "deferred_errors")) out = deferred_errors;
    else if (!strcmp(what, "modules")) out = n_modules;
    else if (!strcmp(what, "launches")) out = n_launches;
    else if (!strcmp(what, "kernel_fragments")) out = n_kernel_fragments;
    else if (!strcmp(what, "kernel_faults")) out = n_kernel_faults;
    else if (!strcmp(what, "batches")) out = n_batches;
    else if (!strcmp(what, "queued")) {
        out = 0;
        for (int i = 0; i < MAX_STREAM; i++) out += streams[i].used ? streams[i].len - streams[i].head : 0;
    }
    else if (!strcmp(what, "events")) {
        out = 0;
        for (int i = 0; i < MAX_EVENT; i++) out += events[i].used;
    } else if (!strcmp(what, "device_allocs")) {
        out = 0;
        for (int i = 0; i < MAX_ALLOC; i++) out += allocs[i].used && allocs[i].kind != K_IMPORTED && allocs[i].phys < 0;
    } else if (!strcmp(what, "vmm_handles")) {
        out = 0;
        for (int i = 0; i < MAX_PHYS; i++) out += physs[i].used ? physs[i].handles : 0;
    } else if (!strcmp(what, "vmm_imported")) {
        out = 0;
        for (int i = 0; i < MAX_PHYS; i++) out += physs[i].used && physs[i].imported;
    } else if (!strcmp(what, "vmm_allocations")) {
        out = 0;
        for (int i = 0; i < MAX_PHYS; i++) out += physs[i].used;
    } else if (!strcmp(what, "vmm_mappings")) {
        out = 0;
        for (int i = 0; i < MAX_ALLOC; i++) out += allocs[i].used && allocs[i].phys >= 0;
    } else if (!strcmp(what, "vmm_reservations")) {
        out = 0;
        for (int i = 0; i < MAX_RESV; i++) out += resvs[i].used;
    }
    pthread_mutex_unlock(&mu);
    return out;
}

long fakecuda_event_seq(void *e) {
    event_t *ev = ev_of(e);
    return ev ? __atomic_load_n(&ev->state[1], __ATOMIC_SEQ_CST) : -1;
}

/* copy i of the log: returns its sequence number, fills dst/src/n; -1 past the end */
long fakecuda_copy_at(long i, uint64_t *dst, uint64_t *src, uint64_t *n) {
    if (!copy_log || i < 0 || i >= ncopies || i >= LOG_MAX) return -1;
    *dst = copy_log[i].dst; *src = copy_log[i].src; *n = copy_log[i].n;
    return copy_log[i].seq;
}
