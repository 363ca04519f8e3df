/* Pairs of a CFunctionAllocator's malloc and free called from C in a loop, timed with the
 * monotonic clock: what the two functions cost without CuPy or ctypes around each call.
 * Called through ctypes.PyDLL, so the GIL stays held, as CuPy holds it.
 *
 * cloop_torch_pairs does the same for a PyTorch pluggable allocator's two functions.
 *
 *     cc -O2 -shared -fPIC -o libcloop.so cloop.c
 */
#include <stddef.h>
#include <sys/types.h>
#include <stdint.h>
#include <time.h>

typedef intptr_t (*malloc_fn)(intptr_t param, size_t size, int device_id);
typedef void (*free_fn)(intptr_t param, intptr_t ptr, int device_id);

/* Nanoseconds per pair over `n` pairs of `size` bytes on device 0; -1 if a malloc failed. */
double cloop_pairs(intptr_t param, uintptr_t m, uintptr_t f, size_t size, long n) {
    malloc_fn do_malloc = (malloc_fn)m;
    free_fn do_free = (free_fn)f;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i++) {
        intptr_t p = do_malloc(param, size, 0);
        if (p == -1 || p == 0) {
            return -1.0;
        }
        do_free(param, p, 0);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / (double)n;
}

typedef intptr_t (*getter_fn)(void);

/* Nanoseconds per call of a C function of no arguments (CuPy's current-stream function). */
double cloop_calls(uintptr_t f, long n) {
    getter_fn call = (getter_fn)f;
    volatile intptr_t sink = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i++) {
        sink += call();
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    (void)sink;
    return ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / (double)n;
}

typedef void *(*torch_malloc_fn)(ssize_t size, int device, void *stream);
typedef void (*torch_free_fn)(void *ptr, ssize_t size, int device, void *stream);

/* Nanoseconds per pair over `n` pairs of `size` bytes on device 0 and `stream`, through a
 * PyTorch pluggable allocator's malloc and free (emm_torch_malloc and emm_torch_free, or
 * torch_floor.c's); -1 if a malloc returned null. */
double cloop_torch_pairs(uintptr_t m, uintptr_t f, size_t size, long n, uintptr_t stream) {
    torch_malloc_fn do_malloc = (torch_malloc_fn)m;
    torch_free_fn do_free = (torch_free_fn)f;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i++) {
        void *p = do_malloc((ssize_t)size, 0, (void *)stream);
        if (p == NULL) {
            return -1.0;
        }
        do_free(p, (ssize_t)size, 0, (void *)stream);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / (double)n;
}
