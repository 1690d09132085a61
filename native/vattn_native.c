/* Batched page mapping for the host backend (and, further down, the CUDA backend).
 *
 * One call maps, unmaps or pre-faults a whole batch of pages, so a page group of a
 * 30-layer model (60 pages) costs one foreign call instead of 60. Python loads this
 * with ctypes.CDLL, which releases the GIL for the duration of each call, so the
 * background mapper thread does not stall the model loop.
 *
 * Each function returns how many pages it finished; on a failure it stops there and
 * stores errno in *err, so the caller can roll back exactly the pages that were done.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* Maps pool pages (memfd offsets) at fixed addresses inside a reservation. */
long vattn_map_pages(int fd, long count, const uint64_t *addrs, const uint64_t *offsets,
                     uint64_t page_size, int *err) {
    for (long i = 0; i < count; i++) {
        void *want = (void *)(uintptr_t)addrs[i];
        void *got = mmap(want, page_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
                         (off_t)offsets[i]);
        if (got == MAP_FAILED) {
            *err = errno;
            return i;
        }
    }
    return count;
}

/* Puts PROT_NONE reservation back over pages; `flags` must be the reservation's own
 * flags (plus MAP_FIXED) so the kernel merges the range back into one mapping. */
long vattn_unmap_pages(long count, const uint64_t *addrs, uint64_t page_size, int flags,
                       int *err) {
    for (long i = 0; i < count; i++) {
        void *want = (void *)(uintptr_t)addrs[i];
        if (mmap(want, page_size, PROT_NONE, flags, -1, 0) == MAP_FAILED) {
            *err = errno;
            return i;
        }
    }
    return count;
}

/* Pre-faults mapped pages writable, so the model's first write does not fault. */
long vattn_populate_pages(long count, const uint64_t *addrs, uint64_t page_size, int *err) {
    for (long i = 0; i < count; i++) {
        if (madvise((void *)(uintptr_t)addrs[i], page_size, MADV_POPULATE_WRITE) != 0) {
            *err = errno;
            return i;
        }
    }
    return count;
}

/* ------------------------------------------------------------------------------------
 * Batched page mapping for the CUDA backend.
 *
 * The driver library is opened at run time and the few entry points are declared here, so
 * this library builds (and the host functions above work) on machines with no CUDA at all.
 * Each vattn_cuda_open returns its own table of entry points, so one process can hold the
 * real libcuda and a stand-in (the tests' fake driver) side by side. CUresult codes come
 * back through *err; 0 is CUDA_SUCCESS.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

typedef int cu_result;
typedef unsigned long long cu_deviceptr;
typedef unsigned long long cu_handle;
typedef struct {
    int type; /* CUmemLocationType: 1 = device */
    int id;
} cu_location;
typedef struct {
    cu_location location;
    int flags; /* CUmemAccess_flags: 3 = read-write */
} cu_access_desc;

enum { CU_LOCATION_DEVICE = 1, CU_ACCESS_READ_WRITE = 3 };

typedef struct {
    void *library;
    cu_result (*ctx_set_current)(void *ctx);
    cu_result (*event_synchronize)(void *event);
    cu_result (*mem_map)(cu_deviceptr, size_t, size_t, cu_handle, unsigned long long);
    cu_result (*mem_set_access)(cu_deviceptr, size_t, const cu_access_desc *, size_t);
    cu_result (*mem_unmap)(cu_deviceptr, size_t);
} cuda_api;

static int cuda_symbol(cuda_api *api, void **slot, const char *name, char *why, size_t why_size) {
    *slot = dlsym(api->library, name);
    if (!*slot) snprintf(why, why_size, "the driver library has no %s", name);
    return *slot != NULL;
}

/* Opens the driver library at `path` (libcuda.so.1 in production); NULL with the reason
 * in `why` when it cannot be loaded. */
cuda_api *vattn_cuda_open(const char *path, char *why, size_t why_size) {
    cuda_api *api = calloc(1, sizeof *api);
    if (!api) {
        snprintf(why, why_size, "out of memory");
        return NULL;
    }
    api->library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!api->library) {
        snprintf(why, why_size, "%s", dlerror());
        free(api);
        return NULL;
    }
    if (cuda_symbol(api, (void **)&api->ctx_set_current, "cuCtxSetCurrent", why, why_size) &&
        cuda_symbol(api, (void **)&api->event_synchronize, "cuEventSynchronize", why, why_size) &&
        cuda_symbol(api, (void **)&api->mem_map, "cuMemMap", why, why_size) &&
        cuda_symbol(api, (void **)&api->mem_set_access, "cuMemSetAccess", why, why_size) &&
        cuda_symbol(api, (void **)&api->mem_unmap, "cuMemUnmap", why, why_size))
        return api;
    dlclose(api->library);
    free(api);
    return NULL;
}

void vattn_cuda_close(cuda_api *api) {
    if (!api) return;
    dlclose(api->library);
    free(api);
}

/* Maps handles[i] read-write for `device` at addrs[i], in context `ctx` (made current
 * in the calling thread first, so the background thread needs no setup of its own).
 * A page whose access cannot be set is unmapped again before returning. */
long vattn_cuda_map_pages(const cuda_api *api, void *ctx, int device, long count, const uint64_t *addrs,
                          const uint64_t *handles, uint64_t page_size, int *err) {
    if ((*err = api->ctx_set_current(ctx)) != 0) return 0;
    cu_access_desc access = {{CU_LOCATION_DEVICE, device}, CU_ACCESS_READ_WRITE};
    for (long i = 0; i < count; i++) {
        if ((*err = api->mem_map(addrs[i], page_size, 0, handles[i], 0)) != 0) return i;
        if ((*err = api->mem_set_access(addrs[i], page_size, &access, 1)) != 0) {
            api->mem_unmap(addrs[i], page_size);
            return i;
        }
    }
    return count;
}

/* Unmaps pages; the addresses go back to being bare reservation. First waits for each of
 * `events` (CUevents recorded after the work that may still read these pages: the driver
 * does not promise that cuMemUnmap waits for it), and for no other work. */
long vattn_cuda_unmap_pages(const cuda_api *api, void *ctx, long nevents, const uint64_t *events, long count,
                            const uint64_t *addrs, uint64_t page_size, int *err) {
    if ((*err = api->ctx_set_current(ctx)) != 0) return 0;
    for (long i = 0; i < nevents; i++)
        if ((*err = api->event_synchronize((void *)(uintptr_t)events[i])) != 0) return 0;
    for (long i = 0; i < count; i++)
        if ((*err = api->mem_unmap(addrs[i], page_size)) != 0) return i;
    return count;
}
