//go:build cgo && !gonixl_noucx

/* gxshm.c: the "shm" data path (see gxucx.h). Plain Linux calls only; nothing
 * here touches UCX, so every function may run without the agent mutex. */
#define _GNU_SOURCE
#include "gxucx.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

static size_t page_size(void)
{
    static size_t p;
    if (p == 0) {
        long v = sysconf(_SC_PAGESIZE);
        p = v > 0 ? (size_t)v : 4096;
    }
    return p;
}

size_t gx_page_size(void)
{
    return page_size();
}

static int all_zero(const void *p, size_t n)
{
    const uint64_t *w = (const uint64_t *)p;
    size_t i, k = n / sizeof(uint64_t);
    uint64_t acc = 0;
    /* n is a multiple of the page size; OR in blocks so the loop vectorises
     * and stops early on the first non-zero block. */
    for (i = 0; i < k; i += 64) {
        size_t j, e = i + 64 < k ? i + 64 : k;
        for (j = i; j < e; j++) {
            acc |= w[j];
        }
        if (acc) {
            return 0;
        }
    }
    return 1;
}

static int pwrite_all(int fd, const char *p, size_t n, off_t off)
{
    while (n > 0) {
        ssize_t w = pwrite(fd, p, n, off);
        if (w < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -1;
        }
        p += w;
        n -= (size_t)w;
        off += w;
    }
    return 0;
}

static int pread_all(int fd, char *p, size_t n, off_t off)
{
    while (n > 0) {
        ssize_t r = pread(fd, p, n, off);
        if (r < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -1;
        }
        if (r == 0) {
            errno = EIO;
            return -1;
        }
        p += r;
        n -= (size_t)r;
        off += r;
    }
    return 0;
}

/* Copies the data ranges (not the holes) of the memfd's [off, off+n) into
 * p, which is fresh zero-filled memory. */
static int restore_chunk(int fd, char *p, size_t n, off_t off)
{
    off_t end = off + (off_t)n, pos = off;
    while (pos < end) {
        off_t d = lseek(fd, pos, SEEK_DATA), h;
        if (d < 0) {
            if (errno == ENXIO) {
                return 0; /* only holes after pos */
            }
            /* SEEK_DATA unsupported: copy everything. */
            return pread_all(fd, p + (pos - off), (size_t)(end - pos), pos);
        }
        if (d >= end) {
            return 0;
        }
        h = lseek(fd, d, SEEK_HOLE);
        if (h < 0 || h > end) {
            h = end;
        }
        if (pread_all(fd, p + (d - off), (size_t)(h - d), d) != 0) {
            return -1;
        }
        pos = h;
    }
    return 0;
}

static void restore_range(int fd, uint64_t base, uint64_t upto, size_t chunk, int punch)
{
    size_t pg = page_size();
    uint64_t off;
    for (off = 0; off < upto; off += chunk) {
        size_t n = (size_t)(upto - off < chunk ? upto - off : chunk);
        void *p = (void *)(uintptr_t)(base + off);
        if (mmap(p, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) ==
            p) {
            (void)restore_chunk(fd, (char *)p, n, (off_t)(pg + off));
        }
        if (punch) {
            (void)fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(pg + off),
                            (off_t)n);
        }
    }
}

int gx_shm_share(uint64_t base, uint64_t len, uint64_t token, size_t chunk, gx_shm_local *out,
                 char *err, size_t errlen)
{
    size_t pg = page_size();
    gx_shm_ctl *ctl;
    struct stat st;
    uint64_t off;
    int fd;

    memset(out, 0, sizeof(*out));
    out->fd = -1;
    if (len == 0 || base % pg != 0 || len % pg != 0) {
        snprintf(err, errlen, "range %#llx+%llu is not page aligned", (unsigned long long)base,
                 (unsigned long long)len);
        return -1;
    }
    if (chunk < pg) {
        chunk = pg;
    }
    chunk -= chunk % pg;
    fd = memfd_create("gonixl-kv", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) {
        snprintf(err, errlen, "memfd_create: %s", strerror(errno));
        return -1;
    }
    if (ftruncate(fd, (off_t)(pg + len)) != 0) {
        snprintf(err, errlen, "ftruncate(%llu): %s", (unsigned long long)(pg + len),
                 strerror(errno));
        close(fd);
        return -1;
    }
    ctl = mmap(NULL, pg, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (ctl == MAP_FAILED) {
        snprintf(err, errlen, "mmap control page: %s", strerror(errno));
        close(fd);
        return -1;
    }
    ctl->magic = GX_SHM_MAGIC;
    ctl->token = token;
    ctl->len = len;
    __atomic_store_n(&ctl->state, GX_SHM_ACTIVE, __ATOMIC_RELEASE);

    /* Chunk by chunk: copy what is not zero into the file, then map the
     * file over the chunk. At most one chunk exists twice at a time. */
    for (off = 0; off < len; off += chunk) {
        size_t n = (size_t)(len - off < chunk ? len - off : chunk);
        void *p = (void *)(uintptr_t)(base + off);
        if (!all_zero(p, n) && pwrite_all(fd, (const char *)p, n, (off_t)(pg + off)) != 0) {
            snprintf(err, errlen, "copy into memfd at %llu: %s", (unsigned long long)off,
                     strerror(errno));
            goto undo;
        }
        if (mmap(p, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, (off_t)(pg + off)) !=
            p) {
            snprintf(err, errlen, "mmap(MAP_FIXED) at %p: %s", p, strerror(errno));
            goto undo;
        }
    }
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        snprintf(err, errlen, "seal memfd: %s", strerror(errno));
        goto undo;
    }
    if (fstat(fd, &st) != 0) {
        snprintf(err, errlen, "fstat memfd: %s", strerror(errno));
        goto undo;
    }
    out->fd = fd;
    out->ino = (uint64_t)st.st_ino;
    out->dev = (uint64_t)st.st_dev;
    out->ctl = ctl;
    return 0;
undo:
    /* The chunks before off are file-backed now: give them back as private
     * memory with their contents. */
    __atomic_store_n(&ctl->state, GX_SHM_REVOKED, __ATOMIC_RELEASE);
    restore_range(fd, base, off, chunk, 0);
    munmap(ctl, pg);
    close(fd);
    return -1;
}

void gx_shm_revoke(gx_shm_local *l)
{
    if (l->ctl) {
        __atomic_store_n(&l->ctl->state, GX_SHM_REVOKED, __ATOMIC_RELEASE);
    }
}

void gx_shm_unshare(gx_shm_local *l, uint64_t base, uint64_t len, size_t chunk, int restore)
{
    size_t pg = page_size();
    if (l->fd < 0) {
        return;
    }
    gx_shm_revoke(l);
    if (chunk < pg) {
        chunk = pg;
    }
    chunk -= chunk % pg;
    if (restore) {
        restore_range(l->fd, base, len, chunk, 1);
    }
    if (l->ctl) {
        munmap(l->ctl, pg);
    }
    close(l->fd);
    l->fd = -1;
    l->ctl = NULL;
}

int gx_shm_attach(int pid, int fd, uint64_t ino, uint64_t dev, uint64_t len, uint64_t token,
                  void **map, char *err, size_t errlen)
{
    size_t pg = page_size();
    char path[64];
    struct stat st;
    gx_shm_ctl *ctl;
    void *m;
    int f, seals;

    *map = NULL;
    snprintf(path, sizeof(path), "/proc/%d/fd/%d", pid, fd);
    f = open(path, O_RDWR | O_CLOEXEC);
    if (f < 0) {
        snprintf(err, errlen, "open %s: %s", path, strerror(errno));
        return -1;
    }
    if (fstat(f, &st) != 0) {
        snprintf(err, errlen, "fstat %s: %s", path, strerror(errno));
        goto fail;
    }
    if (!S_ISREG(st.st_mode) || (uint64_t)st.st_ino != ino || (uint64_t)st.st_dev != dev) {
        snprintf(err, errlen,
                 "%s is not the advertised memfd (inode %llu dev %llu, want %llu %llu)", path,
                 (unsigned long long)st.st_ino, (unsigned long long)st.st_dev,
                 (unsigned long long)ino, (unsigned long long)dev);
        goto fail;
    }
    if ((uint64_t)st.st_size != pg + len) {
        snprintf(err, errlen, "%s has %lld bytes, want %llu", path, (long long)st.st_size,
                 (unsigned long long)(pg + len));
        goto fail;
    }
    seals = fcntl(f, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
        /* Unsealed, the owner could shrink it under our mapping (SIGBUS). */
        snprintf(err, errlen, "%s is not sealed against shrinking", path);
        goto fail;
    }
    m = mmap(NULL, pg + len, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
    if (m == MAP_FAILED) {
        snprintf(err, errlen, "mmap %s: %s", path, strerror(errno));
        goto fail;
    }
    close(f);
    ctl = (gx_shm_ctl *)m;
    if (ctl->magic != GX_SHM_MAGIC || ctl->token != token || ctl->len != len ||
        __atomic_load_n(&ctl->state, __ATOMIC_ACQUIRE) != GX_SHM_ACTIVE) {
        snprintf(err, errlen,
                 "%s: control page does not match the metadata (or the region was deregistered)",
                 path);
        munmap(m, pg + len);
        return -1;
    }
    *map = m;
    return 0;
fail:
    close(f);
    return -1;
}

void gx_shm_detach(void *map, uint64_t len)
{
    if (map) {
        munmap(map, page_size() + len);
    }
}

int gx_pidfd_open(int pid)
{
    long fd = syscall(SYS_pidfd_open, pid, 0);
    return fd < 0 ? -1 : (int)fd;
}

int gx_pidfd_exited(int pidfd)
{
    struct pollfd p;
    if (pidfd < 0) {
        return 0;
    }
    p.fd = pidfd;
    p.events = POLLIN;
    p.revents = 0;
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP)) != 0;
}

static int all_active(void *const *ctls, size_t nctl)
{
    size_t i;
    for (i = 0; i < nctl; i++) {
        const gx_shm_ctl *c = (const gx_shm_ctl *)ctls[i];
        if (__atomic_load_n(&c->state, __ATOMIC_ACQUIRE) != GX_SHM_ACTIVE) {
            return 0;
        }
    }
    return 1;
}

int gx_shm_post(int pid, int pidfd, int op, const gx_iov *shm, size_t nshm, const gx_iov *cma,
                size_t ncma, void *const *ctls, size_t nctl)
{
    size_t i;
    if (gx_pidfd_exited(pidfd)) {
        return GX_ERR_EP_FAILED;
    }
    if (!all_active(ctls, nctl)) {
        return GX_ERR_SHM_REVOKED;
    }
    for (i = 0; i < nshm; i++) {
        void *l = (void *)(uintptr_t)shm[i].laddr, *r = (void *)(uintptr_t)shm[i].raddr;
        if (op == 0) {
            memcpy(l, r, (size_t)shm[i].len);
        } else {
            memcpy(r, l, (size_t)shm[i].len);
        }
    }
    if (ncma > 0) {
        int rc = gx_cma(pid, op, cma, ncma);
        if (rc != 0) {
            return rc;
        }
    }
    /* Checked after the copy: a region deregistered, or an owner that died,
     * while we copied fails the transfer rather than reporting bytes that
     * may already have been reused. */
    if (!all_active(ctls, nctl)) {
        return GX_ERR_SHM_REVOKED;
    }
    if (gx_pidfd_exited(pidfd)) {
        return GX_ERR_EP_FAILED;
    }
    return 0;
}
