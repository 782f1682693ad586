/* atoll-init: PID 1 of the child PID namespace in which every user command of a sandbox runs, so
 * that user code cannot see or signal the guest agent (issue 5: `pkill python3`, `kill -9 1`,
 * `kill -STOP 1` used to end or hang the whole sandbox).
 *
 * Compiled on the host by the worker (worker/host/agent_pack.py: gcc -static, so it runs on any
 * template's libc) into the agent's directory, /opt/atoll/atoll-init in every sandbox. The agent
 * (guest/agent/zygote.py) starts it at start-up and again after it died, as
 * `atoll-init FD` with FD one end of an AF_UNIX SOCK_SEQPACKET socketpair. It is a C program, not
 * a Python one, because of memory: a Python init cost ~8 MB of guest memory per sandbox (a fresh
 * interpreter with the modules it needs; a fork of the agent copied most of the agent's heap, since
 * gVisor copies the 2 MiB-aligned chunk around every page written after a fork), saved into every
 * snapshot, and a restored sentry keeps ~2-3x an image's memory as Go garbage for minutes. This
 * one holds a few hundred KB.
 *
 * The process started unshares CLONE_NEWPID and forks; the child is init of the new namespace and
 * is reparented to the agent, whose reaper sees it stop (then sends SIGCONT) or die (then starts a
 * new one; the agent reports the commands it ran as killed). The init:
 *
 * - mounts a fresh proc on /proc (this gVisor has no per-process mount namespaces: the agent sees
 *   it too and reads its own from /dev/.atoll-proc), so `ps`/`pkill` show only user processes;
 * - is named `atoll-init` (comm and the whole argv block), installs a no-op handler for every
 *   catchable signal (handlers, unlike SIG_IGN, are not inherited across exec), reaps every orphan
 *   of the namespace;
 * - keeps user processes under this gVisor's own pids cgroup (mounted at CGROUP_MOUNT): all of them
 *   at most USER_PIDS_MAX tasks, each command tree at most COMMAND_PIDS_MAX (a pool of ready
 *   cgroups, reused), so a flood or a fork bomb gets EAGAIN instead of exhausting the host-side
 *   pids cgroup that would kill the sentry; a command's cgroup is also how its whole tree is found
 *   (a `setsid` daemon, an orphan): `kill` and a command's deadline kill what is in it;
 * - serves the agent over the socket, one request per message, blocking (poll, no epoll: the
 *   checkpoint gate), single-threaded. Requests are NUL-terminated fields (strings as the agent's
 *   os.fsencode made them, numbers in decimal), the first one the operation:
 *     spawn ID FLAGS DEADLINE_S CWD UID GID NGROUPS GROUP... ARGC ARG... ENVC NAME=VALUE...
 *           + 3 descriptors (stdin, stdout, stderr) by SCM_RIGHTS. FLAGS "c": stdin is a terminal's
 *           slave, made the new session's controlling tty. Empty DEADLINE_S, CWD, UID: none.
 *     kill PID ROOT_ALIVE        the command's tree (session, group, descendants) and its cgroup
 *     signal PID SIG             killpg, or kill when its group is gone (a terminal's ^C)
 *     identity SANDBOX_ID CPUS   ATOLL_SANDBOX_ID rewritten in its environ; CPU affinity narrowed
 *   and answers in JSON (ASCII only):
 *     {"init": PID} | {"error": "why"}         once, from the process the agent started
 *     {"id": ID, "pid": PID}                    a spawn started (before any exit message of PID)
 *     {"id": ID, "error": {"kind": "os", "errno": E, "step": "exec"|"chdir"|"setup"}}
 *     {"id": ID, "error": {"kind": "value"|"other", "message": "..."}}
 *     {"exit": PID, "code": CODE[, "signal": N]} a spawned command ended (killed by signal N: CODE
 *                                               128+N and "signal": N, so that an `exit 137` differs)
 * Pids are the child namespace's: what `ps` shows and what the API reports.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CGROUP_MOUNT "/dev/.atoll-cgroup"
#define USER_PIDS_MAX 1024
#define COMMAND_PIDS_MAX 512
#define MAX_LINGERING 4096
#define POOL 8 /* command cgroups kept ready */
#define MAX_MESSAGE (1 << 20)
#define KILL_WITHIN_S 2.0
#define PATH_LEN 128

extern char **environ;

static int sock = -1;    /* to the agent */
static int wake[2];      /* written by the SIGCHLD handler */
static pid_t self;

/* ---- small helpers ------------------------------------------------------------------------ */

/* A line for the agent's log, sent as {"log": "..."} on the socket: the init's own stdout and
 * stderr are /dev/null (commands can write to /proc/1/fd/1, and the agent's are the host's log
 * file, outside the sandbox's disk quota). Before the socket exists it goes nowhere. */
static void logf_(const char *fmt, ...) {
    char text[512], msg[sizeof text * 6 + 16];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    if (n < 0 || sock < 0) return;
    if (n >= (int)sizeof text) n = sizeof text - 1;
    size_t m = 0;
    m += (size_t)snprintf(msg, sizeof msg, "{\"log\": \"");
    for (int i = 0; i < n; i++) {
        unsigned char c = (unsigned char)text[i];
        if (c == '"' || c == '\\') {
            msg[m++] = '\\';
            msg[m++] = (char)c;
        } else if (c < 0x20 || c >= 0x7f) { /* JSON asks only for < 0x20; the rest keeps it ASCII */
            m += (size_t)snprintf(msg + m, sizeof msg - m, "\\u%04x", c);
        } else {
            msg[m++] = (char)c;
        }
    }
    m += (size_t)snprintf(msg + m, sizeof msg - m, "\"}");
    while (send(sock, msg, m, MSG_NOSIGNAL) < 0 && errno == EINTR) {
    }
}

static void send_msg(const char *fmt, ...) {
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0 || n >= (int)sizeof buf) return;
    while (send(sock, buf, n, MSG_NOSIGNAL) < 0) {
        if (errno != EINTR) _exit(0); /* the agent is gone: so are we (and with us the namespace) */
    }
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void sleep_s(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
    }
}

static int write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = write(fd, text, strlen(text));
    int err = errno;
    close(fd);
    errno = err;
    return n < 0 ? -1 : 0;
}

/* Read a small file into buf (NUL-terminated); returns its length or -1. */
static ssize_t read_file(const char *path, char *buf, size_t size) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    size_t len = 0;
    while (len < size - 1) {
        ssize_t n = read(fd, buf + len, size - 1 - len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        len += n;
    }
    close(fd);
    buf[len] = 0;
    return len;
}

static int parse_int(const char *s, long *out) {
    char *end;
    if (!s || !*s) return -1;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end) return -1;
    *out = v;
    return 0;
}

/* A growable list of pids. */
struct pids {
    int *v;
    size_t n, cap;
};

static void pids_add(struct pids *p, int pid) {
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 64;
        int *v = realloc(p->v, cap * sizeof *v);
        if (!v) return;
        p->v = v;
        p->cap = cap;
    }
    p->v[p->n++] = pid;
}

static int pids_has(const struct pids *p, int pid) {
    for (size_t i = 0; i < p->n; i++)
        if (p->v[i] == pid) return 1;
    return 0;
}

static int pids_remove(struct pids *p, int pid) {
    for (size_t i = 0; i < p->n; i++)
        if (p->v[i] == pid) {
            p->v[i] = p->v[--p->n];
            return 1;
        }
    return 0;
}

/* ---- the command cgroups (gVisor's own pids controller) ------------------------------------ */

struct slot {
    long key; /* a command's pid; negative: a reused pid's earlier cgroup, kept until empty */
    char path[PATH_LEN];
};

static struct {
    int enabled;
    char root[96]; /* CGROUP_MOUNT, or ATOLL_INIT_CGROUP (tests: a directory of plain files) */
    char user[112];
    char ready[POOL][PATH_LEN];
    int nready;
    struct slot *in_use; /* command pid -> its cgroup */
    size_t n_in_use, cap_in_use;
    struct slot *lingering; /* exited command's pid -> its cgroup, leftovers still run (oldest first) */
    size_t n_lingering, cap_lingering;
    long next_name, next_spare;
} lim;

static struct slot *slot_find(struct slot *v, size_t n, long key) {
    for (size_t i = 0; i < n; i++)
        if (v[i].key == key) return &v[i];
    return NULL;
}

static void slot_append(struct slot **v, size_t *n, size_t *cap, long key, const char *path) {
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 64;
        struct slot *nv = realloc(*v, c * sizeof **v);
        if (!nv) return;
        *v = nv;
        *cap = c;
    }
    (*v)[*n].key = key;
    snprintf((*v)[*n].path, PATH_LEN, "%s", path);
    (*n)++;
}

static void slot_delete(struct slot *v, size_t *n, size_t i) { /* keeps the order */
    memmove(&v[i], &v[i + 1], (*n - i - 1) * sizeof *v);
    (*n)--;
}

static int cg_make(void) {
    char path[PATH_LEN], file[PATH_LEN + 16], max[16];
    for (;;) {
        snprintf(path, sizeof path, "%s/c%ld", lim.user, lim.next_name++);
        if (mkdir(path, 0755) == 0) break;
        if (errno != EEXIST) goto fail; /* EEXIST: pooled by an earlier init of this sandbox */
    }
    snprintf(file, sizeof file, "%s/pids.max", path);
    snprintf(max, sizeof max, "%d", COMMAND_PIDS_MAX);
    if (write_file(file, max) < 0) goto fail;
    snprintf(lim.ready[lim.nready++], PATH_LEN, "%s", path);
    return 1;
fail:
    logf_("atoll-init: cannot make a command cgroup: %s", strerror(errno));
    return 0;
}

/* Back to the pool (or removed, past POOL) if no process is left in it. */
static int cg_recycle(const char *path) {
    char file[PATH_LEN + 16], buf[64];
    snprintf(file, sizeof file, "%s/cgroup.procs", path);
    if (read_file(file, buf, sizeof buf) < 0) return errno == ENOENT;
    for (char *c = buf; *c; c++)
        if (*c > ' ') return 0;
    if (lim.nready < POOL)
        snprintf(lim.ready[lim.nready++], PATH_LEN, "%s", path);
    else if (rmdir(path) < 0 && errno != ENOENT)
        return 0;
    return 1;
}

static void limits_setup(void) {
    char max[16], file[PATH_LEN + 16];
    struct stat st;
    const char *root = getenv("ATOLL_INIT_CGROUP");
    snprintf(lim.root, sizeof lim.root, "%s", root && *root ? root : CGROUP_MOUNT);
    snprintf(lim.user, sizeof lim.user, "%s/user", lim.root);
    snprintf(file, sizeof file, "%s/cgroup.procs", lim.root);
    if (stat(file, &st) < 0) {
        mkdir(lim.root, 0755);
        if (mount("cgroup", lim.root, "cgroup", 0, "pids") < 0) {
            logf_("atoll-init: no process limits inside the sandbox: mount cgroup (pids) on %s failed: %s",
                  lim.root, strerror(errno));
            return;
        }
    }
    snprintf(max, sizeof max, "%d", USER_PIDS_MAX);
    int bad = mkdir(lim.user, 0755) < 0 && errno != EEXIST;
    snprintf(file, sizeof file, "%s/pids.max", lim.user);
    bad = bad || write_file(file, max) < 0;
    snprintf(file, sizeof file, "%s/cgroup.procs", lim.user);
    if (bad || write_file(file, "0") < 0) {
        logf_("atoll-init: no process limits inside the sandbox: %s", strerror(errno));
        return;
    }
    lim.enabled = 1;
    /* cgroups a previous init left (it was killed): their processes died with its namespace */
    DIR *d = opendir(lim.user);
    if (d) {
        struct dirent *e;
        char path[PATH_LEN];
        while ((e = readdir(d))) {
            if (e->d_type != DT_DIR || e->d_name[0] == '.') continue;
            if (snprintf(path, sizeof path, "%s/%s", lim.user, e->d_name) >= (int)sizeof path) continue;
            cg_recycle(path);
        }
        closedir(d);
    }
    while (lim.nready < POOL)
        if (!cg_make()) break;
}

/* The cgroup (COMMAND_PIDS_MAX) for the next command, taken from the pool into `out`; "" when
 * there are no limits. The child moves itself into it before its exec (see child), so that
 * nothing it starts can be outside it; `limits_confined` or `limits_unused` follow. */
static void limits_take(char out[PATH_LEN]) {
    out[0] = 0;
    if (!lim.enabled) return;
    if (!lim.nready && !cg_make()) return;
    snprintf(out, PATH_LEN, "%s", lim.ready[--lim.nready]);
}

/* The command `pid` runs in `path` (from limits_take). */
static void limits_confined(pid_t pid, const char *path) {
    if (*path) slot_append(&lim.in_use, &lim.n_in_use, &lim.cap_in_use, pid, path);
}

/* The command did not start: its cgroup goes back to the pool. */
static void limits_unused(const char *path) {
    if (*path && !cg_recycle(path)) logf_("atoll-init: a command cgroup is not empty: %s", path);
}

static const char *limits_path_of(pid_t pid) {
    struct slot *s = slot_find(lim.in_use, lim.n_in_use, pid);
    if (!s) s = slot_find(lim.lingering, lim.n_lingering, pid);
    return s ? s->path : NULL;
}

/* The command's first process exited: its cgroup is reused once its leftovers are gone. */
static void limits_release(pid_t pid) {
    struct slot *s = slot_find(lim.in_use, lim.n_in_use, pid);
    if (s) {
        char path[PATH_LEN];
        snprintf(path, sizeof path, "%s", s->path);
        slot_delete(lim.in_use, &lim.n_in_use, s - lim.in_use);
        struct slot *earlier = slot_find(lim.lingering, lim.n_lingering, pid);
        if (earlier && strcmp(earlier->path, path) != 0)
            earlier->key = -(++lim.next_spare); /* the pid was reused: keep the earlier one until empty */
        else if (earlier)
            slot_delete(lim.lingering, &lim.n_lingering, earlier - lim.lingering);
        slot_append(&lim.lingering, &lim.n_lingering, &lim.cap_lingering, pid, path);
    }
    for (size_t i = 0; i < lim.n_lingering;) {
        if (cg_recycle(lim.lingering[i].path))
            slot_delete(lim.lingering, &lim.n_lingering, i);
        else
            i++;
    }
    while (lim.n_lingering > MAX_LINGERING) slot_delete(lim.lingering, &lim.n_lingering, 0);
    if (lim.nready < POOL) cg_make();
}

/* Every process of the command started as `pid` (itself included while it runs). */
static void limits_members(pid_t pid, struct pids *out) {
    const char *path = limits_path_of(pid);
    char file[PATH_LEN + 16];
    if (!path) return;
    snprintf(file, sizeof file, "%s/cgroup.procs", path);
    int fd = open(file, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    char buf[4096], num[16];
    size_t k = 0;
    ssize_t n;
    while ((n = read(fd, buf, sizeof buf)) > 0 || (n < 0 && errno == EINTR)) {
        for (ssize_t i = 0; i < n; i++) {
            if (buf[i] >= '0' && buf[i] <= '9') {
                if (k < sizeof num - 1) num[k++] = buf[i];
            } else if (k) {
                num[k] = 0;
                pids_add(out, atoi(num));
                k = 0;
            }
        }
    }
    if (k) {
        num[k] = 0;
        pids_add(out, atoi(num));
    }
    close(fd);
}

/* SIGKILL every process of the command started as `pid`, again until its cgroup is empty (a fork
 * bomb forks between a read and the kills; a killed process forks no more) or KILL_WITHIN_S
 * passed. Returns how many kills were sent. */
static int limits_kill_command(pid_t pid) {
    int sent = 0;
    double deadline = now_s() + KILL_WITHIN_S;
    if (limits_path_of(pid)) killpg(pid, SIGKILL); /* its group at once, as one call */
    while (now_s() < deadline) {
        struct pids victims = {0};
        limits_members(pid, &victims);
        pids_remove(&victims, self);
        if (!victims.n) {
            free(victims.v);
            break;
        }
        for (size_t i = 0; i < victims.n; i++)
            if (kill(victims.v[i], SIGKILL) == 0) sent++;
        free(victims.v);
        sleep_s(0.005);
    }
    return sent;
}

/* ---- deadlines: what a command with a timeout started dies with its timeout ---------------- */

struct deadline {
    double at;
    pid_t pid;
    char path[PATH_LEN];
};
static struct deadline *dl;
static size_t n_dl, cap_dl;

static void deadlines_add(pid_t pid, double timeout_s) {
    const char *path = limits_path_of(pid);
    if (!path) return;
    if (n_dl == cap_dl) {
        size_t c = cap_dl ? cap_dl * 2 : 16;
        struct deadline *v = realloc(dl, c * sizeof *v);
        if (!v) return;
        dl = v;
        cap_dl = c;
    }
    dl[n_dl].at = now_s() + timeout_s;
    dl[n_dl].pid = pid;
    snprintf(dl[n_dl].path, PATH_LEN, "%s", path);
    n_dl++;
}

/* Milliseconds until the next deadline, -1 if none. */
static int deadlines_wait_ms(void) {
    if (!n_dl) return -1;
    double first = dl[0].at;
    for (size_t i = 1; i < n_dl; i++)
        if (dl[i].at < first) first = dl[i].at;
    double ms = (first - now_s()) * 1000 + 1;
    return ms < 0 ? 0 : ms > 3600000 ? 3600000 : (int)ms;
}

static void deadlines_run(void) {
    double t = now_s();
    for (size_t i = 0; i < n_dl;) {
        if (dl[i].at > t) {
            i++;
            continue;
        }
        struct deadline d = dl[i];
        dl[i] = dl[--n_dl];
        /* unless its cgroup went back to the pool (empty: nothing to kill) or serves another command */
        const char *now_path = limits_path_of(d.pid);
        if (now_path && strcmp(now_path, d.path) == 0) {
            int n = limits_kill_command(d.pid);
            if (n) logf_("atoll-init: command %d reached its timeout; killed %d process(es) it left", d.pid, n);
        }
    }
}

/* ---- killing a command's tree: its session, its group and every descendant via /proc -------- */

struct pstat {
    int pid, ppid, pgrp, sid;
    char state;
};

static size_t scan_proc(struct pstat **out) {
    size_t n = 0, cap = 0;
    *out = NULL;
    DIR *d = opendir("/proc");
    if (!d) return 0;
    struct dirent *e;
    char path[64], buf[1024];
    while ((e = readdir(d))) {
        long pid;
        if (parse_int(e->d_name, &pid) < 0) continue;
        snprintf(path, sizeof path, "/proc/%ld/stat", pid);
        if (read_file(path, buf, sizeof buf) <= 0) continue;
        char *rp = strrchr(buf, ')');
        struct pstat s = {.pid = (int)pid};
        if (!rp || sscanf(rp + 1, " %c %d %d %d", &s.state, &s.ppid, &s.pgrp, &s.sid) != 4) continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 256;
            struct pstat *v = realloc(*out, cap * sizeof *v);
            if (!v) break;
            *out = v;
        }
        (*out)[n++] = s;
    }
    closedir(d);
    return n;
}

/* Live processes in root's session or process group, plus their descendants by ppid (the root's
 * own descendants only while it is alive: a dead root's pid could be reused). */
static void tree_members(int root, int root_alive, struct pids *out) {
    struct pstat *st;
    size_t n = scan_proc(&st);
    struct pids stack = {0}, seen = {0};
    for (size_t i = 0; i < n; i++)
        if (st[i].state != 'Z' && st[i].state != 'X' && (st[i].pgrp == root || st[i].sid == root))
            pids_add(&stack, st[i].pid);
    if (root_alive) pids_add(&stack, root);
    for (size_t i = 0; i < stack.n; i++) pids_add(&seen, stack.v[i]);
    while (stack.n) {
        int parent = stack.v[--stack.n];
        for (size_t i = 0; i < n; i++)
            if (st[i].ppid == parent && st[i].state != 'Z' && st[i].state != 'X' && !pids_has(&seen, st[i].pid)) {
                pids_add(&seen, st[i].pid);
                pids_add(&stack, st[i].pid);
            }
    }
    for (size_t i = 0; i < seen.n; i++) {
        int pid = seen.v[i], live = 0;
        for (size_t j = 0; j < n; j++)
            if (st[j].pid == pid) live = st[j].state != 'Z' && st[j].state != 'X';
        if (live && pid != self && pid != 1) pids_add(out, pid);
    }
    free(st);
    free(stack.v);
    free(seen.v);
}

/* SIGKILL a command's session/process group and every descendant (re-scanned for forks). */
static void kill_tree(int root, int root_alive) {
    for (int round = 0; round < 3; round++) {
        struct pids victims = {0};
        tree_members(root, root_alive, &victims);
        if (root_alive && !pids_has(&victims, root)) pids_add(&victims, root);
        killpg(root, SIGKILL);
        if (!victims.n) {
            free(victims.v);
            return;
        }
        for (size_t i = 0; i < victims.n; i++) kill(victims.v[i], SIGKILL);
        free(victims.v);
        root_alive = 0; /* it has been sent SIGKILL; later rounds only sweep up stragglers */
    }
}

/* ---- identity ------------------------------------------------------------------------------ */

/* Overwrite NAME= in this process's original environ block (what /proc/<pid>/environ shows) if
 * the new value has the same length (sandbox ids do). */
static void set_environ_in_place(const char *name, const char *value) {
    size_t nl = strlen(name), vl = strlen(value);
    for (char **e = environ; e && *e; e++) {
        if (strncmp(*e, name, nl) == 0 && (*e)[nl] == '=') {
            if (strlen(*e + nl + 1) == vl) memcpy(*e + nl + 1, value, vl);
            return;
        }
    }
}

/* Narrow the CPU affinity (which commands inherit) to ceil(cpus) CPUs, so that `nproc` matches the
 * sandbox's quota. Empty or bad: left alone. */
static void limit_cpus(const char *cpus) {
    char *end;
    if (!cpus || !*cpus) return;
    double x = strtod(cpus, &end);
    if (*end || !(x >= 0 && x < 1e6)) return;
    long n = (long)x;
    if ((double)n < x) n++;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) return;
    if (online < 1) online = 1;
    if (n > online) n = online;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (long i = 0; i < n && i < CPU_SETSIZE; i++) CPU_SET(i, &set);
    if (sched_setaffinity(0, sizeof set, &set) < 0)
        logf_("cannot narrow the CPU affinity to %ld CPUs: %s", n, strerror(errno));
}

/* ---- spawning a command -------------------------------------------------------------------- */

static struct pids spawned;

struct child_error {
    int err;
    char step[8]; /* "exec", "chdir", "setup"; "ctty": the controlling terminal could not be set */
};

static void child_fail(int pipe_w, const char *step) {
    struct child_error ce = {.err = errno};
    snprintf(ce.step, sizeof ce.step, "%s", step);
    (void)!write(pipe_w, &ce, sizeof ce);
    _exit(255);
}

/* In the child: the command's descriptors, directory, session, user and terminal, then exec the
 * program, searched in the command's own PATH when its name has no slash (as subprocess does). */
static void child(int pipe_w, const char *cg, int fds[3], const char *cwd, int ctty, long uid, long gid,
                  gid_t *groups, size_t ngroups, char **argv, char **envp) {
    if (*cg) { /* its cgroup first: nothing it starts may be outside it (as root, before the user) */
        char file[PATH_LEN + 16];
        snprintf(file, sizeof file, "%s/cgroup.procs", cg);
        if (write_file(file, "0") < 0)
            logf_("atoll-init: cannot limit command %d: %s", (int)getpid(), strerror(errno));
    }
    for (int i = 0; i < 3; i++) /* none of them is 0-2 (see serve): dup2 cannot clobber another */
        if (dup2(fds[i], i) < 0) child_fail(pipe_w, "setup");
    if (cwd && chdir(cwd) < 0) child_fail(pipe_w, "chdir");
    if (setsid() < 0) child_fail(pipe_w, "setup");
    if (uid >= 0) {
        if (setgroups(ngroups, groups) < 0 || setregid(gid, gid) < 0 || setreuid(uid, uid) < 0)
            child_fail(pipe_w, "setup");
    }
    if (ctty && ioctl(0, TIOCSCTTY, 0) < 0) child_fail(pipe_w, "ctty");
    if (strchr(argv[0], '/')) {
        execve(argv[0], argv, envp);
        child_fail(pipe_w, "exec");
    }
    const char *path = "/bin:/usr/bin"; /* subprocess's default (os.defpath) */
    for (char **e = envp; *e; e++)
        if (strncmp(*e, "PATH=", 5) == 0) {
            path = *e + 5;
            break;
        }
    int first = 0;
    static char full[4096];
    for (const char *p = path;; p++) {
        const char *colon = strchrnul(p, ':');
        size_t dl = colon - p;
        if (dl) {
            if (dl + 1 + strlen(argv[0]) + 1 > sizeof full) {
                errno = ENAMETOOLONG;
            } else {
                memcpy(full, p, dl);
                full[dl] = '/';
                strcpy(full + dl + 1, argv[0]);
                /* A miss is skipped after access(): in gVisor a failed execve costs ~0.6 ms, an
                 * access() ~0.14 ms (three misses before /usr/bin were ~2 ms of every `true`).
                 * Any other answer goes to execve, whose error is the one reported. */
                if (access(full, X_OK) == 0 || (errno != ENOENT && errno != ENOTDIR))
                    execve(full, argv, envp);
            }
        } else {
            execve(argv[0], argv, envp); /* an empty entry: the current directory */
        }
        if (errno != ENOENT && errno != ENOTDIR && !first) first = errno; /* report the first real error */
        if (!*colon) break;
        p = colon;
    }
    if (first) errno = first;
    child_fail(pipe_w, "exec");
}

static void spawn_error(long id, const char *kind, const char *message) {
    send_msg("{\"id\": %ld, \"error\": {\"kind\": \"%s\", \"message\": \"%s\"}}", id, kind, message);
}

static void os_error(long id, int err, const char *step) {
    send_msg("{\"id\": %ld, \"error\": {\"kind\": \"os\", \"errno\": %d, \"step\": \"%s\"}}", id, err, step);
}

static void do_spawn(char **f, size_t nf, int *fds, size_t nfds) {
    long id, uid = -1, gid = -1, ng, argc, envc, v;
    double deadline_s = 0;
    gid_t *groups = NULL;
    char **argv = NULL, **envp = NULL;
    size_t i = 1;
    if (nf < 9 || parse_int(f[i++], &id) < 0) {
        logf_("atoll-init: a malformed spawn request");
        return;
    }
    int ctty = strchr(f[i++], 'c') != NULL;
    if (*f[i]) deadline_s = strtod(f[i], NULL);
    i++;
    const char *cwd = *f[i] ? f[i] : NULL;
    i++;
    if (*f[i] && (parse_int(f[i], &uid) < 0 || parse_int(f[i + 1], &gid) < 0)) goto malformed;
    i += 2;
    if (parse_int(f[i++], &ng) < 0 || ng < 0 || (size_t)ng > nf - i) goto malformed;
    if (!(groups = calloc(ng + 1, sizeof *groups))) goto malformed;
    for (long g = 0; g < ng; g++) {
        if (parse_int(f[i++], &v) < 0) goto malformed;
        groups[g] = (gid_t)v;
    }
    if (i >= nf || parse_int(f[i++], &argc) < 0 || argc < 1 || (size_t)argc > nf - i) goto malformed;
    if (!(argv = calloc(argc + 1, sizeof *argv))) goto malformed;
    for (long a = 0; a < argc; a++) argv[a] = f[i++];
    if (i >= nf || parse_int(f[i++], &envc) < 0 || envc < 0 || (size_t)envc > nf - i) goto malformed;
    if (!(envp = calloc(envc + 1, sizeof *envp))) goto malformed;
    for (long e = 0; e < envc; e++) envp[e] = f[i++];
    if (nfds != 3) {
        char m[64];
        snprintf(m, sizeof m, "spawn needs 3 descriptors, got %zu", nfds);
        spawn_error(id, "value", m);
        goto done;
    }
    if (!*argv[0]) {
        os_error(id, ENOENT, "exec");
        goto done;
    }
    int ep[2];
    if (pipe2(ep, O_CLOEXEC) < 0) {
        os_error(id, errno, "setup");
        goto done;
    }
    char cg[PATH_LEN];
    limits_take(cg);
    pid_t pid = fork();
    if (pid == 0) {
        close(ep[0]);
        child(ep[1], cg, fds, cwd, ctty, uid, gid, groups, ng, argv, envp);
    }
    int fork_errno = errno;
    close(ep[1]);
    if (pid < 0) {
        close(ep[0]);
        limits_unused(cg);
        os_error(id, fork_errno, "setup");
        goto done;
    }
    struct child_error ce;
    ssize_t n;
    while ((n = read(ep[0], &ce, sizeof ce)) < 0 && errno == EINTR) {
    }
    close(ep[0]);
    if (n == (ssize_t)sizeof ce) { /* it failed before its exec: reap it here, it ran nothing */
        while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
        }
        limits_unused(cg);
        if (strcmp(ce.step, "ctty") == 0)
            spawn_error(id, "other", "Exception occurred in preexec_fn.");
        else
            os_error(id, ce.err, ce.step);
        goto done;
    }
    pids_add(&spawned, pid);
    /* answer first: the agent waits for the pid, the cgroup write need not delay it */
    send_msg("{\"id\": %ld, \"pid\": %d}", id, pid);
    limits_confined(pid, cg);
    if (deadline_s > 0) deadlines_add(pid, deadline_s);
    goto done;
malformed:
    logf_("atoll-init: a malformed spawn request");
    spawn_error(id, "value", "malformed spawn request");
done:
    free(groups);
    free(argv);
    free(envp);
}

/* ---- serving the agent --------------------------------------------------------------------- */

static void serve_one(void) {
    /* mapped per request and unmapped after: what a large request touched does not stay */
    char *buf = mmap(NULL, MAX_MESSAGE + 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char cbuf[CMSG_SPACE(4 * sizeof(int))];
    int fds[4];
    size_t nfds = 0;
    if (buf == MAP_FAILED) return;
    struct iovec iov = {buf, MAX_MESSAGE};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0) {
        munmap(buf, MAX_MESSAGE + 1);
        if (errno == EINTR || errno == EAGAIN) return;
        logf_("atoll-init: reading the agent's socket failed: %s", strerror(errno));
        _exit(70);
    }
    if (n == 0) _exit(0); /* the agent is gone */
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        int *got = (int *)CMSG_DATA(c);
        for (size_t j = 0; j < k; j++) {
            if (nfds < 4) {
                fds[nfds++] = got[j];
            } else {
                close(got[j]);
            }
        }
    }
    for (size_t j = 0; j < nfds; j++) {
        fcntl(fds[j], F_SETFD, FD_CLOEXEC); /* this gVisor ignores MSG_CMSG_CLOEXEC (measured) */
        if (fds[j] < 3) { /* never expected (0-2 are open): keep dup2 in the child simple */
            int moved = fcntl(fds[j], F_DUPFD_CLOEXEC, 3);
            close(fds[j]);
            fds[j] = moved;
        }
    }
    buf[n] = 0;
    /* split into NUL-terminated fields */
    size_t nf = 0;
    for (ssize_t j = 0; j < n; j++)
        if (!buf[j]) nf++;
    char **f = calloc(nf + 1, sizeof *f);
    if (f && nf) {
        size_t k = 0;
        f[k++] = buf;
        for (ssize_t j = 0; j < n - 1 && k < nf; j++)
            if (!buf[j]) f[k++] = buf + j + 1;
        long a, b;
        if ((msg.msg_flags & MSG_TRUNC) != 0) {
            logf_("atoll-init: a request over %d bytes was cut", MAX_MESSAGE);
        } else if (strcmp(f[0], "spawn") == 0) {
            do_spawn(f, nf, fds, nfds);
        } else if (strcmp(f[0], "kill") == 0 && nf >= 3 && parse_int(f[1], &a) == 0) {
            kill_tree((int)a, strcmp(f[2], "0") != 0);
            limits_kill_command((int)a); /* what left its session and group (setsid, orphans) */
        } else if (strcmp(f[0], "signal") == 0 && nf >= 3 && parse_int(f[1], &a) == 0 &&
                   parse_int(f[2], &b) == 0) {
            if (killpg((pid_t)a, (int)b) < 0 && errno == ESRCH) kill((pid_t)a, (int)b);
        } else if (strcmp(f[0], "identity") == 0 && nf >= 3) {
            set_environ_in_place("ATOLL_SANDBOX_ID", f[1]);
            limit_cpus(f[2]);
        } else {
            logf_("atoll-init: request failed: unknown request %.40s", f[0]);
        }
    }
    for (size_t j = 0; j < nfds; j++) close(fds[j]);
    free(f);
    munmap(buf, MAX_MESSAGE + 1);
}

/* Reap every child that ended: report the commands the agent started, release their cgroups. */
static void reap(void) {
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0) {
            if (pid < 0 && errno == EINTR) continue;
            return;
        }
        if (!pids_remove(&spawned, pid)) continue; /* an orphan of the namespace */
        int code = WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 255;
        if (WIFSIGNALED(status))
            send_msg("{\"exit\": %d, \"code\": %d, \"signal\": %d}", pid, code, WTERMSIG(status));
        else
            send_msg("{\"exit\": %d, \"code\": %d}", pid, code);
        limits_release(pid);
    }
}

static void on_sigchld(int sig) {
    (void)sig;
    int saved = errno;
    (void)!write(wake[1], "", 1);
    errno = saved;
}

static void noop(int sig) { (void)sig; }

static void run_init(int argc, char **argv) {
    /* name: comm, and the whole argv block, so `pkill python3` / `pkill -f atoll` see only this */
    prctl(PR_SET_NAME, "atoll-init", 0, 0, 0);
    char *start = argv[0], *end = argv[argc - 1] + strlen(argv[argc - 1]) + 1;
    memset(start, 0, end - start);
    memcpy(start, "atoll-init", end - start > 10 ? 10 : end - start - 1);
    self = getpid();
    struct sigaction sa = {.sa_handler = noop};
    sigemptyset(&sa.sa_mask);
    for (int sig = 1; sig < NSIG; sig++) {
        if (sig == SIGKILL || sig == SIGSTOP || sig == SIGCHLD || sig == SIGCONT) continue;
        sigaction(sig, &sa, NULL);
    }
    if (pipe2(wake, O_CLOEXEC | O_NONBLOCK) < 0) {
        logf_("atoll-init failed: pipe: %s", strerror(errno));
        _exit(70);
    }
    struct sigaction chld = {.sa_handler = on_sigchld, .sa_flags = SA_NOCLDSTOP};
    sigemptyset(&chld.sa_mask);
    sigaction(SIGCHLD, &chld, NULL);
    if (mount("proc", "/proc", "proc", 0, NULL) < 0)
        logf_("atoll-init: mount proc on /proc: %s; ps in the sandbox lists the agent too", strerror(errno));
    const char *sid = getenv("ATOLL_SANDBOX_ID");
    if (sid && *sid) set_environ_in_place("ATOLL_SANDBOX_ID", sid);
    limit_cpus(getenv("ATOLL_CPUS"));
    limits_setup();
    for (;;) {
        struct pollfd p[2] = {{.fd = sock, .events = POLLIN}, {.fd = wake[0], .events = POLLIN}};
        int r = poll(p, 2, deadlines_wait_ms());
        if (r < 0 && errno != EINTR) {
            logf_("atoll-init: poll failed: %s", strerror(errno));
            sleep_s(0.05);
        }
        char drain[64];
        while (read(wake[0], drain, sizeof drain) > 0) {
        }
        reap();
        if (r > 0 && (p[0].revents & (POLLIN | POLLHUP | POLLERR))) serve_one();
        deadlines_run();
    }
}

int main(int argc, char **argv) {
    long fd;
    if (argc != 2 || parse_int(argv[1], &fd) < 0) {
        dprintf(2, "usage: atoll-init FD (started by the atoll guest agent)\n");
        return 2;
    }
    sock = (int)fd;
    fcntl(sock, F_SETFD, FD_CLOEXEC); /* commands must inherit only 0, 1, 2 */
    /* This process unshares the PID namespace and forks the init, reports its pid and exits. */
    if (unshare(CLONE_NEWPID) < 0) {
        send_msg("{\"error\": \"unshare(CLONE_NEWPID): %s\"}", strerror(errno));
        _exit(71);
    }
    pid_t pid = fork();
    if (pid < 0) {
        send_msg("{\"error\": \"fork: %s\"}", strerror(errno));
        _exit(71);
    }
    if (pid > 0) {
        send_msg("{\"init\": %d}", pid);
        _exit(0);
    }
    run_init(argc, argv);
    return 70;
}
