/* The floor under PyTorch's pluggable allocator interface, for programs.py's `torch-floor`:
 * malloc and free go straight to the driver's stream-ordered pool (cuMemAllocAsync and
 * cuMemFreeAsync on the stream PyTorch passes, the device's default pool with its release
 * threshold raised so that freed memory stays cached), with nothing around them. PyTorch's
 * own `backend:cudaMallocAsync` runs the same driver pool behind its native interface
 * (programs.py's `torch-async`), so the two differ by the pluggable interface alone.
 *
 *     cc -O2 -shared -fPIC -o libtorch_floor.so torch_floor.c -ldl
 *
 * libcuda.so.1 is opened at the first call (PyTorch has loaded it by then). A thread's first
 * call makes device 0's primary context current when the thread has none: PyTorch's autograd
 * threads may reach the allocator with no driver context current, where the driver's calls
 * fail. A failed call prints the driver's error code once and returns a null pointer, which
 * PyTorch's pluggable allocator reports as out of memory.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

typedef int (*alloc_async_t)(unsigned long long *, size_t, void *);
typedef int (*free_async_t)(unsigned long long, void *);
typedef int (*default_pool_t)(void **, int);
typedef int (*pool_set_t)(void *, int, void *);
typedef int (*ctx_get_t)(void **);
typedef int (*ctx_set_t)(void *);
typedef int (*primary_retain_t)(void **, int);

/* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD in cuda.h. */
#define RELEASE_THRESHOLD 4

static alloc_async_t alloc_async;
static free_async_t free_async;
static ctx_get_t ctx_get;
static ctx_set_t ctx_set;
static void *primary;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static __thread int thread_ready;
static int reported;

static void load(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "torch_floor: cannot open libcuda.so.1: %s\n", dlerror());
        return;
    }
    default_pool_t default_pool = (default_pool_t)dlsym(lib, "cuDeviceGetDefaultMemPool");
    pool_set_t pool_set = (pool_set_t)dlsym(lib, "cuMemPoolSetAttribute");
    void *pool = NULL;
    uint64_t keep = UINT64_MAX;
    if (!default_pool || !pool_set || default_pool(&pool, 0) != 0 ||
        pool_set(pool, RELEASE_THRESHOLD, &keep) != 0) {
        fprintf(stderr, "torch_floor: cannot raise device 0's default pool release threshold\n");
    }
    primary_retain_t retain = (primary_retain_t)dlsym(lib, "cuDevicePrimaryCtxRetain");
    ctx_get = (ctx_get_t)dlsym(lib, "cuCtxGetCurrent");
    ctx_set = (ctx_set_t)dlsym(lib, "cuCtxSetCurrent");
    if (!retain || !ctx_get || !ctx_set || retain(&primary, 0) != 0) {
        fprintf(stderr, "torch_floor: cannot retain device 0's primary context\n");
        primary = NULL;
    }
    free_async = (free_async_t)dlsym(lib, "cuMemFreeAsync");
    alloc_async = (alloc_async_t)dlsym(lib, "cuMemAllocAsync");
}

/* Loads the driver's functions once, and makes the primary context current on a thread that
 * has no context, once per thread. */
static void ready(void) {
    pthread_once(&once, load);
    if (thread_ready) {
        return;
    }
    void *current = NULL;
    if (primary && ctx_get(&current) == 0 && current == NULL) {
        ctx_set(primary);
    }
    thread_ready = 1;
}

void *floor_malloc(ssize_t size, int device, void *stream) {
    (void)device;
    ready();
    unsigned long long ptr = 0;
    int rc = alloc_async ? alloc_async(&ptr, (size_t)size, stream) : -1;
    if (rc != 0) {
        if (!__atomic_exchange_n(&reported, 1, __ATOMIC_RELAXED)) {
            fprintf(stderr, "torch_floor: cuMemAllocAsync of %zd bytes failed with %d\n", size, rc);
        }
        return NULL;
    }
    return (void *)(uintptr_t)ptr;
}

void floor_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)size;
    (void)device;
    ready();
    if (free_async) {
        free_async((unsigned long long)(uintptr_t)ptr, stream);
    }
}
