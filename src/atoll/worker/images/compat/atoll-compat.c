/*
 * atoll compatibility shim for gVisor (runsc 20221219), preloaded into every dynamically linked
 * program of a template through /etc/ld.so.preload.
 *
 * Why: this runsc rejects the AT_NO_AUTOMOUNT flag with EINVAL in statx(2) and newfstatat(2)
 * before it looks at the path, and Debian 12's coreutils pass it on every call
 * (`statx(AT_FDCWD, "/", AT_NO_AUTOMOUNT, ...)`), so `ls` and `stat` fail with "Invalid argument".
 * AT_NO_AUTOMOUNT only tells the kernel not to trigger an automount point; gVisor has none, so
 * clearing the flag changes nothing else. Linux accepts it for these two calls only (fchownat and
 * friends reject it on Linux too), so only these are covered.
 *
 * What: statx(), fstatat()/fstatat64() and their pre-2.33 glibc forms __fxstatat()/__fxstatat64(),
 * and syscall() itself (libuv, Rust's std and Go's cgo callers issue statx through it), all with
 * AT_NO_AUTOMOUNT cleared. Each issues the system call directly (no dlsym, no libc internals), so the
 * library depends on nothing newer than glibc 2.2.5's __errno_location and loads into any glibc
 * program. Statically linked programs and programs that issue the `syscall` instruction themselves
 * (Go without cgo) are not covered.
 *
 * Built on the host with gcc when the template layer is built (atoll.worker.images.templates); the layer's
 * content hash includes this file, so editing it rebuilds every cached layer.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <sys/stat.h>
#include <sys/syscall.h>

#ifndef AT_NO_AUTOMOUNT
#define AT_NO_AUTOMOUNT 0x800
#endif

#define EXPORT __attribute__((visibility("default")))

#if defined(__x86_64__)
static long raw_syscall6(long n, long a1, long a2, long a3, long a4, long a5, long a6)
{
    long ret;
    register long r10 __asm__("r10") = a4;
    register long r8 __asm__("r8") = a5;
    register long r9 __asm__("r9") = a6;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(n), "D"(a1), "S"(a2), "d"(a3), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret;
}
#elif defined(__aarch64__)
static long raw_syscall6(long n, long a1, long a2, long a3, long a4, long a5, long a6)
{
    register long x8 __asm__("x8") = n;
    register long x0 __asm__("x0") = a1;
    register long x1 __asm__("x1") = a2;
    register long x2 __asm__("x2") = a3;
    register long x3 __asm__("x3") = a4;
    register long x4 __asm__("x4") = a5;
    register long x5 __asm__("x5") = a6;
    __asm__ volatile("svc 0"
                     : "+r"(x0)
                     : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5)
                     : "memory", "cc");
    return x0;
}
#else
#error "atoll-compat supports x86_64 and aarch64 (struct stat must match the kernel's newfstatat)"
#endif

/* The libc convention: -1 with errno set for a kernel error (-4095..-1), else the value. */
static long ret_errno(long r)
{
    if ((unsigned long)r > -4096UL) {
        errno = (int)-r;
        return -1;
    }
    return r;
}

static long clear_automount(long flags)
{
    return flags & ~(long)AT_NO_AUTOMOUNT;
}

EXPORT long syscall(long number, ...)
{
    va_list ap;
    long a[6];
    va_start(ap, number);
    for (int i = 0; i < 6; i++)
        a[i] = va_arg(ap, long);
    va_end(ap);
    /* statx(dirfd, path, flags, mask, buf); newfstatat(dirfd, path, buf, flags) */
    if (number == SYS_statx)
        a[2] = clear_automount(a[2]);
    else if (number == SYS_newfstatat)
        a[3] = clear_automount(a[3]);
    return ret_errno(raw_syscall6(number, a[0], a[1], a[2], a[3], a[4], a[5]));
}

EXPORT int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf)
{
    return (int)ret_errno(raw_syscall6(SYS_statx, dirfd, (long)path, clear_automount(flags),
                                       (long)mask, (long)buf, 0));
}

/* On x86_64 and aarch64, glibc's struct stat and struct stat64 are the kernel's newfstatat layout. */
EXPORT int fstatat(int dirfd, const char *path, struct stat *buf, int flags)
{
    return (int)ret_errno(raw_syscall6(SYS_newfstatat, dirfd, (long)path, (long)buf,
                                       clear_automount(flags), 0, 0));
}

EXPORT int fstatat64(int dirfd, const char *path, struct stat64 *buf, int flags)
{
    return fstatat(dirfd, path, (struct stat *)buf, flags);
}

/* Programs linked against glibc < 2.33 call these; every stat version glibc accepts on these two
   architectures (_STAT_VER_KERNEL 0, _STAT_VER_LINUX 1 on x86_64, 0 on aarch64) is the kernel layout. */
EXPORT int __fxstatat(int ver, int dirfd, const char *path, struct stat *buf, int flags)
{
    if (ver != 0 && ver != 1) {
        errno = EINVAL;
        return -1;
    }
    return fstatat(dirfd, path, buf, flags);
}

EXPORT int __fxstatat64(int ver, int dirfd, const char *path, struct stat64 *buf, int flags)
{
    return __fxstatat(ver, dirfd, path, (struct stat *)buf, flags);
}
