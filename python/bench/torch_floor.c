/* The floor under PyTorch's pluggable allocator interface, for programs.py's `torch-floor`:
 * malloc and free go straight to the driver's stream-ordered pool (cuMemAllocAsync and
 * cuMemFreeAsync on the stream PyTorch passes, the device's default pool with its release
 * threshold raised so that freed memory stays cached), with nothing around them. PyTorch's
 * own `backend:cudaMallocAsync` runs the same driver pool behind its native interface
 * (programs.py's `torch-async`), so the two differ by the pluggable interface alone.
 *
 *     cc -O2 -shared -fPIC -o libtorch_floor.so torch_floor.c -ldl
 *
 * libcuda.so.1 is opened at the first call (PyTorch has loaded it by then); a failed call
 * returns a null pointer, which PyTorch's pluggable allocator reports as out of memory.
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

/* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD in cuda.h. */
#define RELEASE_THRESHOLD 4

static alloc_async_t alloc_async;
static free_async_t free_async;
static pthread_once_t once = PTHREAD_ONCE_INIT;

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
    free_async = (free_async_t)dlsym(lib, "cuMemFreeAsync");
    alloc_async = (alloc_async_t)dlsym(lib, "cuMemAllocAsync");
}

void *floor_malloc(ssize_t size, int device, void *stream) {
    (void)device;
    pthread_once(&once, load);
    unsigned long long ptr = 0;
    if (!alloc_async || alloc_async(&ptr, (size_t)size, stream) != 0) {
        return NULL;
    }
    return (void *)(uintptr_t)ptr;
}

void floor_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)size;
    (void)device;
    pthread_once(&once, load);
    if (free_async) {
        free_async((unsigned long long)(uintptr_t)ptr, stream);
    }
}
