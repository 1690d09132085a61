/* Batched page mapping for the host backend (and, further down, the CUDA backend).
 *
 * One call maps, unmaps or pre-faults a whole batch of pages, so a page step of a
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
 * libcuda is loaded at run time and the few entry points are declared here, so the
 * library builds (and the host functions above work) on machines with no CUDA at all.
 * CUresult codes come back through *err; 0 is CUDA_SUCCESS.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

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

static cu_result (*cu_ctx_set_current)(void *ctx);
static cu_result (*cu_mem_map)(cu_deviceptr, size_t, size_t, cu_handle, unsigned long long);
static cu_result (*cu_mem_set_access)(cu_deviceptr, size_t, const cu_access_desc *, size_t);
static cu_result (*cu_mem_unmap)(cu_deviceptr, size_t);
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static char cuda_error[512];

static void *cuda_symbol(void *lib, const char *name) {
    void *symbol = dlsym(lib, name);
    if (!symbol && !cuda_error[0])
        snprintf(cuda_error, sizeof cuda_error, "libcuda.so.1 has no %s", name);
    return symbol;
}

static void load_cuda(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(cuda_error, sizeof cuda_error, "%s", dlerror());
        return;
    }
    *(void **)&cu_ctx_set_current = cuda_symbol(lib, "cuCtxSetCurrent");
    *(void **)&cu_mem_map = cuda_symbol(lib, "cuMemMap");
    *(void **)&cu_mem_set_access = cuda_symbol(lib, "cuMemSetAccess");
    *(void **)&cu_mem_unmap = cuda_symbol(lib, "cuMemUnmap");
}

/* Loads libcuda once; NULL when ready, else why it is not. */
const char *vattn_cuda_load(void) {
    pthread_once(&cuda_once, load_cuda);
    return cuda_error[0] ? cuda_error : NULL;
}

/* CUDA_ERROR_NOT_INITIALIZED (3) when libcuda is missing, else cuCtxSetCurrent's result. */
static cu_result enter_context(void *ctx) {
    return vattn_cuda_load() ? 3 : cu_ctx_set_current(ctx);
}

/* Maps handles[i] read-write for `device` at addrs[i], in context `ctx` (made current
 * in the calling thread first, so the background thread needs no setup of its own).
 * A page whose access cannot be set is unmapped again before returning. */
long vattn_cuda_map_pages(void *ctx, int device, long count, const uint64_t *addrs,
                          const uint64_t *handles, uint64_t page_size, int *err) {
    if ((*err = enter_context(ctx)) != 0) return 0;
    cu_access_desc access = {{CU_LOCATION_DEVICE, device}, CU_ACCESS_READ_WRITE};
    for (long i = 0; i < count; i++) {
        if ((*err = cu_mem_map(addrs[i], page_size, 0, handles[i], 0)) != 0) return i;
        if ((*err = cu_mem_set_access(addrs[i], page_size, &access, 1)) != 0) {
            cu_mem_unmap(addrs[i], page_size);
            return i;
        }
    }
    return count;
}

/* Unmaps pages; the addresses go back to being bare reservation. */
long vattn_cuda_unmap_pages(void *ctx, long count, const uint64_t *addrs, uint64_t page_size,
                            int *err) {
    if ((*err = enter_context(ctx)) != 0) return 0;
    for (long i = 0; i < count; i++)
        if ((*err = cu_mem_unmap(addrs[i], page_size)) != 0) return i;
    return count;
}
