/* Counts the main thread's heap allocations between two calls of
 * heap_pages_enable (loaded with LD_PRELOAD by benchmarks/heap_pages.py;
 * glibc only).
 *
 * Every allocation is served by glibc itself (__libc_*); this only records,
 * for the thread that enabled counting:
 * - for requests below 64 KiB (the bench's mmap threshold): the count and
 *   bytes per power-of-two size class, and a bitmap of the 4 KiB pages they
 *   occupy within 128 GiB of the program break (the main heap);
 * - for every request that glibc served from the main heap (small ones, and
 *   larger ones that fit a free chunk there, which glibc prefers to a new
 *   mapping): the distinct pages under it that were not resident when
 *   malloc returned (mincore), i.e. pages that malloc_trim had given back
 *   and that writing the allocation makes resident again; small and large
 *   requests apart, with the number of large requests served from the heap.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

#define SMALL (64 * 1024)
#define SPAN_PAGES ((uintptr_t)1 << 25) /* 128 GiB of 4 KiB pages */

static __thread int counting __attribute__((tls_model("initial-exec"))); /* this thread counts */
static unsigned long count[32], bytes[32], distinct_pages;
static unsigned char *bitmap, *retouched; /* SPAN_PAGES bits each */
static uintptr_t first_page, heap_lo;
static unsigned long retouched_small, retouched_large, large_in_heap;

/* Mark page i (relative to first_page) in map; whether it was new. */
static int mark(unsigned char *map, uintptr_t i) {
    if (i >= SPAN_PAGES || (map[i >> 3] & (1u << (i & 7)))) return 0;
    map[i >> 3] |= (unsigned char)(1u << (i & 7));
    return 1;
}

/* Pages under [a, a + n) in the main heap that are not resident now. */
static void record_retouch(uintptr_t a, size_t n) {
    if (heap_lo == 0 || a < heap_lo || a >= (uintptr_t)sbrk(0)) return;
    if (n >= SMALL) large_in_heap++;
    unsigned char vec[256];
    uintptr_t page = a & ~(uintptr_t)4095, end = a + n;
    while (page < end) {
        size_t np = (end - page + 4095) >> 12;
        if (np > sizeof vec) np = sizeof vec;
        if (mincore((void *)page, np << 12, vec) != 0) return;
        for (size_t k = 0; k < np; k++)
            if (!(vec[k] & 1) && mark(retouched, (page >> 12) + k - first_page)) {
                if (n >= SMALL) retouched_large++;
                else retouched_small++;
            }
        page += np << 12;
    }
}

static void record(void *p, size_t n) {
    if (!counting || p == NULL) return;
    record_retouch((uintptr_t)p, n);
    if (n >= SMALL) return;
    int c = 0;
    while (((size_t)1 << c) < n && c < 31) c++;
    count[c]++;
    bytes[c] += n;
    uintptr_t a = (uintptr_t)p;
    for (uintptr_t page = a >> 12; page <= (a + n - 1) >> 12; page++)
        distinct_pages += mark(bitmap, page - first_page);
}

void *malloc(size_t n) { void *p = __libc_malloc(n); record(p, n); return p; }
void *calloc(size_t a, size_t b) { void *p = __libc_calloc(a, b); record(p, a * b); return p; }
void *realloc(void *o, size_t n) { void *p = __libc_realloc(o, n); record(p, n); return p; }
void *memalign(size_t al, size_t n) { void *p = __libc_memalign(al, n); record(p, n); return p; }
void *aligned_alloc(size_t al, size_t n) { void *p = __libc_memalign(al, n); record(p, n); return p; }
int posix_memalign(void **out, size_t al, size_t n) {
    void *p = __libc_memalign(al, n);
    if (p == NULL) return ENOMEM;
    *out = p;
    record(p, n);
    return 0;
}

/* Start (on != 0) counting this thread's allocations from zero, or stop. */
void heap_pages_enable(int on) {
    if (on) {
        counting = 0;
        memset(count, 0, sizeof count);
        memset(bytes, 0, sizeof bytes);
        distinct_pages = retouched_small = retouched_large = large_in_heap = 0;
        if (bitmap == NULL) {
            bitmap = __libc_calloc(SPAN_PAGES / 8, 1);
            retouched = __libc_calloc(SPAN_PAGES / 8, 1);
        } else {
            memset(bitmap, 0, SPAN_PAGES / 8);
            memset(retouched, 0, SPAN_PAGES / 8);
        }
        if (heap_lo == 0) { /* the start of [heap] in /proc/self/maps */
            FILE *maps = fopen("/proc/self/maps", "r");
            char line[512];
            while (maps != NULL && fgets(line, sizeof line, maps) != NULL)
                if (strstr(line, "[heap]") != NULL) {
                    heap_lo = (uintptr_t)strtoull(line, NULL, 16);
                    break;
                }
            if (maps != NULL) fclose(maps);
        }
        uintptr_t brk_page = (uintptr_t)sbrk(0) >> 12;
        first_page = brk_page > SPAN_PAGES / 2 ? brk_page - SPAN_PAGES / 2 : 0;
    }
    counting = on && bitmap != NULL && retouched != NULL;
}

/* Write "class count bytes" lines, a "pages N" line and a
 * "retouched SMALL LARGE LARGE_ALLOCATIONS" line to path. */
int heap_pages_report(const char *path) {
    FILE *f = fopen(path, "w");
    if (f == NULL) return -1;
    for (int c = 0; c < 32; c++)
        if (count[c]) fprintf(f, "%d %lu %lu\n", c, count[c], bytes[c]);
    fprintf(f, "pages %lu\n", distinct_pages);
    fprintf(f, "retouched %lu %lu %lu\n", retouched_small, retouched_large, large_in_heap);
    return fclose(f);
}
