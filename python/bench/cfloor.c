/* The floor of CuPy's C-function allocator interface, for bench_alloc.py's `cupy-cfloor`:
 * malloc hands back the one device allocation passed as its parameter, and free does nothing,
 * so a pair measures what CuPy itself does around a CFunctionAllocator's two calls.
 *
 *     cc -O2 -shared -fPIC -o libcfloor.so cfloor.c
 */
#include <stddef.h>
#include <stdint.h>

intptr_t cfloor_malloc(intptr_t param, size_t size, int device_id) {
    (void)size;
    (void)device_id;
    return param;
}

void cfloor_free(intptr_t param, intptr_t ptr, int device_id) {
    (void)param;
    (void)ptr;
    (void)device_id;
}
