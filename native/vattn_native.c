/* Batched page mapping for the host backend.
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
