/* Counts the main thread's small heap allocations and the distinct heap pages
 * they land on, between two calls of heap_pages_enable (loaded with
 * LD_PRELOAD by benchmarks/heap_pages.py; glibc only).
 *
 * Every allocation is served by glibc itself (__libc_*); this only records,
 * for requests below 64 KiB (the bench's mmap threshold, above which glibc
 * maps each allocation on its own) made by the thread that enabled counting:
 * the count and bytes per power-of-two size class, and a bitmap of the 4 KiB
 * pages they occupy within 128 GiB of the program break (the main heap).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

#define SMALL (64 * 1024)
#define SPAN_PAGES ((uintptr_t)1 << 25) /* 128 GiB of 4 KiB pages */

static __thread int counting __attribute__((tls_model("initial-exec"))); /* this thread counts */
static unsigned long count[32], bytes[32], distinct_pages;
static unsigned char *bitmap; /* SPAN_PAGES bits */
static uintptr_t first_page;

static void record(void *p, size_t n) {
    if (!counting || p == NULL || n >= SMALL) return;
    int c = 0;
    while (((size_t)1 << c) < n && c < 31) c++;
    count[c]++;
    bytes[c] += n;
    uintptr_t a = (uintptr_t)p;
    for (uintptr_t page = a >> 12; page <= (a + n - 1) >> 12; page++) {
        uintptr_t i = page - first_page;
        if (i < SPAN_PAGES && !(bitmap[i >> 3] & (1u << (i & 7)))) {
            bitmap[i >> 3] |= (unsigned char)(1u << (i & 7));
            distinct_pages++;
        }
    }
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
        distinct_pages = 0;
        if (bitmap == NULL) bitmap = __libc_calloc(SPAN_PAGES / 8, 1);
        else memset(bitmap, 0, SPAN_PAGES / 8);
        uintptr_t brk_page = (uintptr_t)sbrk(0) >> 12;
        first_page = brk_page > SPAN_PAGES / 2 ? brk_page - SPAN_PAGES / 2 : 0;
    }
    counting = on && bitmap != NULL;
}

/* Write "class count bytes" lines and a "pages N" line to path. */
int heap_pages_report(const char *path) {
    FILE *f = fopen(path, "w");
    if (f == NULL) return -1;
    for (int c = 0; c < 32; c++)
        if (count[c]) fprintf(f, "%d %lu %lu\n", c, count[c], bytes[c]);
    fprintf(f, "pages %lu\n", distinct_pages);
    return fclose(f);
}
