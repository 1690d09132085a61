/* libfakecuda.so: the five driver entry points vattn_native.c opens, forwarded to the
 * tests' Python fake driver (tests/fake_cuda/driver.py), so the C mapping path runs against
 * the same state and the same checks as the cuda-python path. Loaded in place of
 * libcuda.so.1 only by the tests (vattn.backends.cuda_calls.LIBCUDA). Until a fake is
 * installed every call returns CUDA_ERROR_NOT_INITIALIZED (3).
 */
#include <stddef.h>

typedef int (*set_current_fn)(void *ctx);
typedef int (*event_synchronize_fn)(void *event);
typedef int (*map_fn)(unsigned long long ptr, size_t size, size_t offset, unsigned long long handle,
                      unsigned long long flags);
typedef int (*set_access_fn)(unsigned long long ptr, size_t size, const void *desc, size_t count);
typedef int (*unmap_fn)(unsigned long long ptr, size_t size);

static set_current_fn set_current;
static event_synchronize_fn event_synchronize;
static map_fn map;
static set_access_fn set_access;
static unmap_fn unmap;

void fakecuda_install(set_current_fn a, event_synchronize_fn b, map_fn c, set_access_fn d, unmap_fn e) {
    set_current = a;
    event_synchronize = b;
    map = c;
    set_access = d;
    unmap = e;
}

int cuCtxSetCurrent(void *ctx) { return set_current ? set_current(ctx) : 3; }
int cuEventSynchronize(void *event) { return event_synchronize ? event_synchronize(event) : 3; }
int cuMemMap(unsigned long long ptr, size_t size, size_t offset, unsigned long long handle,
             unsigned long long flags) {
    return map ? map(ptr, size, offset, handle, flags) : 3;
}
int cuMemSetAccess(unsigned long long ptr, size_t size, const void *desc, size_t count) {
    return set_access ? set_access(ptr, size, desc, count) : 3;
}
int cuMemUnmap(unsigned long long ptr, size_t size) { return unmap ? unmap(ptr, size) : 3; }
