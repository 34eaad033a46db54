/*
 * kalos._native: the one native helper of Kalos.
 *
 * Pure Python cannot order memory on weakly ordered CPUs (ARM64 hosts such as
 * Grace), and it cannot sleep on a futex. This module supplies exactly that and
 * nothing more: acquire/release loads and stores of 64-bit sequence words, a
 * fence, futex wait/wake, and the two halves of the channel handshake
 * (publish, and a spin-then-park wait with the GIL released), with a publish
 * whose wake another thread makes. Everything else in Kalos stays Python.
 *
 * Addresses are raw virtual addresses passed as Python ints (no Py_buffer
 * acquisition: these calls sit on a ~2 µs round trip). Each word address must
 * be 8-byte aligned and non-zero; beyond that the caller owns its validity, as
 * with ctypes. The memory is a shared mapping used by several processes, so
 * the futex calls are the non-PRIVATE variants.
 *
 * Linux only, little-endian x86_64 or aarch64; GCC __atomic builtins.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE 1 /* syscall(); same value as pyconfig.h, so no redefinition */
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if !defined(__linux__)
#error "kalos._native needs Linux (futex)"
#endif
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kalos._native assumes little-endian: the futex word is the low half of a u64"
#endif

/* ------------------------------------------------------------------------ */
/* Small helpers                                                             */
/* ------------------------------------------------------------------------ */

/* One spin-loop hint: lets the sibling hyperthread run and saves power. */
static inline void
cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

/* CLOCK_MONOTONIC in ns (vDSO, ~20 ns). */
static inline int64_t
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* start + delta, saturating at INT64_MAX (delta >= 0). */
static inline int64_t
deadline_after(int64_t start, int64_t delta)
{
    return delta > INT64_MAX - start ? INT64_MAX : start + delta;
}

/*
 * FUTEX_WAIT on the 32-bit word at addr while it equals expected, for at most
 * timeout_ns (< 0: forever). Not FUTEX_PRIVATE_FLAG: the word lives in a
 * mapping shared between processes. Returns 0 or -1 with errno set (EAGAIN:
 * value differed, ETIMEDOUT, EINTR). Call without the GIL.
 */
static inline long
futex_wait_raw(uint32_t *addr, uint32_t expected, int64_t timeout_ns)
{
    struct timespec ts, *tsp = NULL;
    if (timeout_ns >= 0) {
        ts.tv_sec = (time_t)(timeout_ns / 1000000000);
        ts.tv_nsec = (long)(timeout_ns % 1000000000);
        tsp = &ts;
    }
    return syscall(SYS_futex, addr, FUTEX_WAIT, expected, tsp, NULL, 0);
}

static inline long
futex_wake_raw(uint32_t *addr, int count)
{
    return syscall(SYS_futex, addr, FUTEX_WAKE, count, NULL, NULL, 0);
}

/*
 * Convert an int (or an object with __index__, e.g. numpy.uint64) to a u64.
 * PyLong_AsUnsignedLongLong neither calls __index__ nor accepts negatives, so
 * do both here; exact ints (the hot path) skip the __index__ call.
 */
static int
as_u64(PyObject *obj, const char *name, uint64_t *out)
{
    PyObject *num;
    unsigned long long v;

    if (PyLong_CheckExact(obj)) {
        num = obj;
        Py_INCREF(num);
    }
    else {
        num = PyNumber_Index(obj);
        if (num == NULL) {
            if (PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Format(PyExc_TypeError, "%s must be an int, not %.200s", name,
                             Py_TYPE(obj)->tp_name);
            }
            return -1;
        }
    }
    v = PyLong_AsUnsignedLongLong(num);
    Py_DECREF(num);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Format(PyExc_ValueError, "%s must be in [0, 2**64)", name);
        }
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static int
as_i64(PyObject *obj, const char *name, int64_t *out)
{
    long long v = PyLong_AsLongLong(obj); /* calls __index__ itself */
    if (v == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Format(PyExc_ValueError, "%s must fit in a signed 64-bit int", name);
        }
        else if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Format(PyExc_TypeError, "%s must be an int, not %.200s", name,
                         Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

/* A word address: a non-zero, 8-byte aligned int. */
static int
as_word(PyObject *obj, const char *name, uint64_t **out)
{
    uint64_t a;
    if (as_u64(obj, name, &a) < 0) {
        return -1;
    }
    if (a == 0 || (a & 7) != 0) {
        char hex[24]; /* PyErr_Format has no %llx before 3.12 */
        snprintf(hex, sizeof hex, "0x%llx", (unsigned long long)a);
        PyErr_Format(PyExc_ValueError, "%s must be a non-zero 8-byte aligned address, got %s", name,
                     hex);
        return -1;
    }
    *out = (uint64_t *)(uintptr_t)a;
    return 0;
}

static int
check_nargs(const char *fname, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd positional arguments (%zd given)",
                     fname, want, nargs);
        return -1;
    }
    return 0;
}

/* The futex word of a u64: its low half (little-endian, so at the same address). */
static inline uint32_t *
futex_word(uint64_t *word)
{
    return (uint32_t *)word;
}

/* ------------------------------------------------------------------------ */
/* Atomics                                                                   */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(load_acquire_doc,
"load_acquire($module, addr, /)\n--\n\n"
"Atomically load the u64 at addr with acquire ordering and return it.\n\n"
"Reads made after this call see everything the writer stored before its\n"
"matching store_release (the reader side of \"payload, then sequence\").\n"
"addr: 8-byte aligned address (int). Raises ValueError if misaligned or 0.");

static PyObject *
load_acquire(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t *addr;
    (void)module;
    if (check_nargs("load_acquire", nargs, 1) < 0 || as_word(args[0], "addr", &addr) < 0) {
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(__atomic_load_n(addr, __ATOMIC_ACQUIRE));
}

PyDoc_STRVAR(store_release_doc,
"store_release($module, addr, value, /)\n--\n\n"
"Atomically store the u64 value at addr with release ordering.\n\n"
"Everything stored before this call is visible to a reader whose\n"
"load_acquire sees value (the writer side of \"payload, then sequence\").\n"
"addr: 8-byte aligned address; value: 0 <= value < 2**64.");

static PyObject *
store_release(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t *addr, value;
    (void)module;
    if (check_nargs("store_release", nargs, 2) < 0 || as_word(args[0], "addr", &addr) < 0 ||
        as_u64(args[1], "value", &value) < 0) {
        return NULL;
    }
    __atomic_store_n(addr, value, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(fetch_add_doc,
"fetch_add($module, addr, delta, /)\n--\n\n"
"Atomically add delta to the u64 at addr (seq_cst, wrapping modulo 2**64)\n"
"and return the old value.\n\n"
"addr: 8-byte aligned address; delta: 0 <= delta < 2**64.");

static PyObject *
fetch_add(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t *addr, delta;
    (void)module;
    if (check_nargs("fetch_add", nargs, 2) < 0 || as_word(args[0], "addr", &addr) < 0 ||
        as_u64(args[1], "delta", &delta) < 0) {
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(__atomic_fetch_add(addr, delta, __ATOMIC_SEQ_CST));
}

PyDoc_STRVAR(fence_doc,
"fence($module, /)\n--\n\n"
"Sequentially consistent thread fence (orders stores before it against loads\n"
"after it, which acquire/release alone do not).");

static PyObject *
fence(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    (void)args;
    if (check_nargs("fence", nargs, 0) < 0) {
        return NULL;
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------ */
/* Futex                                                                     */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(futex_wait_doc,
"futex_wait($module, addr, expected, timeout_ns, /)\n--\n\n"
"Sleep (FUTEX_WAIT, shared) on the 32-bit word at addr while it equals\n"
"expected & 0xffffffff; the word is the low half of the little-endian u64 at\n"
"addr. The GIL is released while blocked.\n\n"
"timeout_ns: nanoseconds, < 0 for no timeout.\n"
"Returns False if the timeout elapsed, True otherwise (woken, the value\n"
"already differed, or a spurious or signal wake-up: re-check the condition).\n"
"A signal handler that raises propagates its exception.");

static PyObject *
futex_wait(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t *addr, expected;
    int64_t timeout_ns;
    long rc;
    int err;
    (void)module;
    if (check_nargs("futex_wait", nargs, 3) < 0 || as_word(args[0], "addr", &addr) < 0 ||
        as_u64(args[1], "expected", &expected) < 0 ||
        as_i64(args[2], "timeout_ns", &timeout_ns) < 0) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = futex_wait_raw(futex_word(addr), (uint32_t)expected, timeout_ns);
    err = errno;
    Py_END_ALLOW_THREADS
    if (rc == 0 || err == EAGAIN) {
        Py_RETURN_TRUE;
    }
    if (err == ETIMEDOUT) {
        Py_RETURN_FALSE;
    }
    if (err == EINTR) {
        /* Python's handlers are installed without SA_RESTART: run them now. */
        if (PyErr_CheckSignals() < 0) {
            return NULL;
        }
        Py_RETURN_TRUE;
    }
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

PyDoc_STRVAR(futex_wake_doc,
"futex_wake($module, addr, count, /)\n--\n\n"
"Wake up to count waiters (FUTEX_WAKE, shared) sleeping on the 32-bit word\n"
"at addr and return how many were woken. count: >= 0, clamped to INT_MAX.");

static PyObject *
futex_wake(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t *addr;
    int64_t count;
    long rc;
    (void)module;
    if (check_nargs("futex_wake", nargs, 2) < 0 || as_word(args[0], "addr", &addr) < 0 ||
        as_i64(args[1], "count", &count) < 0) {
        return NULL;
    }
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "count must be >= 0");
        return NULL;
    }
    rc = futex_wake_raw(futex_word(addr), count > INT_MAX ? INT_MAX : (int)count);
    if (rc < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(rc);
}

/* ------------------------------------------------------------------------ */
/* Channel handshake: publish / wait_seq                                     */
/* ------------------------------------------------------------------------ */
/*
 * Three u64 words per direction: seq (written by the publisher), parked (set
 * by the waiter while it may sleep) and bell (the futex word, bumped by the
 * publisher to wake). A Dekker pattern makes lost wake-ups impossible:
 *
 *   waiter:    b = bell;  parked = 1;  fence;  if seq >= target: done;
 *              futex_wait(bell, b)
 *   publisher: seq = value;  fence;  if parked: bell += 1; futex_wake(bell)
 *
 * With both fences seq_cst, either the waiter sees the new seq or the
 * publisher sees parked == 1. In the second case the publisher's bell
 * increment comes after the waiter read b (b was read before parked was set),
 * so the kernel's atomic compare in FUTEX_WAIT fails, or the waiter is already
 * queued and the wake reaches it. While the waiter spins, parked is 0 and the
 * publisher makes no syscall.
 */

PyDoc_STRVAR(publish_doc,
"publish($module, seq_addr, value, parked_addr, bell_addr, /)\n--\n\n"
"Publish value at seq_addr (release) and wake the peer only if it is parked.\n\n"
"Write the payload first, then call this. Returns True if the peer was\n"
"parked (the bell was rung and a FUTEX_WAKE issued), False otherwise (no\n"
"syscall). All three addresses are 8-byte aligned u64 words in shared memory;\n"
"the peer waits with wait_seq on the same three words.");

static PyObject *
publish(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t *seq, *parked, *bell, value;
    (void)module;
    if (check_nargs("publish", nargs, 4) < 0 || as_word(args[0], "seq_addr", &seq) < 0 ||
        as_u64(args[1], "value", &value) < 0 || as_word(args[2], "parked_addr", &parked) < 0 ||
        as_word(args[3], "bell_addr", &bell) < 0) {
        return NULL;
    }
    __atomic_store_n(seq, value, __ATOMIC_RELEASE);
    /* Store seq before loading parked: the half of Dekker that release/acquire lacks. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(parked, __ATOMIC_ACQUIRE) == 0) {
        Py_RETURN_FALSE;
    }
    __atomic_fetch_add(bell, 1, __ATOMIC_SEQ_CST);
    /* FUTEX_WAKE never blocks (one short syscall), so it keeps the GIL. */
    if (futex_wake_raw(futex_word(bell), INT_MAX) < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(wait_seq_doc,
"wait_seq($module, seq_addr, target, parked_addr, bell_addr, spin_ns, timeout_ns, /)\n--\n\n"
"Wait until the u64 at seq_addr (acquire) is >= target, then return True;\n"
"return False if timeout_ns elapsed first. Read the payload after it returns.\n\n"
"The GIL is released for the whole wait. First spin for up to spin_ns\n"
"(only worth it when the peer has its own core: a futex wake costs ~3-25 µs\n"
"by host, two spinners sharing a core cost milliseconds), then park on the futex\n"
"at bell_addr with the flag at parked_addr set, so the peer's publish wakes\n"
"us. The parked flag is 0 again when this returns, on every path.\n\n"
"spin_ns: nanoseconds, >= 0. timeout_ns: nanoseconds; < 0 waits forever,\n"
"0 checks once. A signal handler that raises propagates its exception.");

static PyObject *
wait_seq(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t *seq, *parked, *bell, target;
    int64_t spin_ns, timeout_ns, start = 0, deadline = INT64_MAX, spin_end;
    PyThreadState *ts;
    int reached = 0;
    (void)module;
    if (check_nargs("wait_seq", nargs, 6) < 0 || as_word(args[0], "seq_addr", &seq) < 0 ||
        as_u64(args[1], "target", &target) < 0 || as_word(args[2], "parked_addr", &parked) < 0 ||
        as_word(args[3], "bell_addr", &bell) < 0 || as_i64(args[4], "spin_ns", &spin_ns) < 0 ||
        as_i64(args[5], "timeout_ns", &timeout_ns) < 0) {
        return NULL;
    }
    if (spin_ns < 0) {
        PyErr_SetString(PyExc_ValueError, "spin_ns must be >= 0");
        return NULL;
    }

    /* Already there (or a zero timeout): no GIL round trip, no clock read. */
    if (__atomic_load_n(seq, __ATOMIC_ACQUIRE) >= target) {
        Py_RETURN_TRUE;
    }
    if (timeout_ns == 0) {
        Py_RETURN_FALSE;
    }

    ts = PyEval_SaveThread();

    if (spin_ns > 0 || timeout_ns > 0) {
        start = now_ns();
    }
    if (timeout_ns > 0) {
        deadline = deadline_after(start, timeout_ns);
    }

    /* Spin: a tight load + pause loop that reads the clock (vDSO, ~20 ns) only
     * every 64 iterations, so it may overrun spin_ns by up to 64 pauses (a few
     * µs on CPUs with a slow pause). */
    if (spin_ns > 0) {
        spin_end = deadline_after(start, spin_ns);
        if (spin_end > deadline) {
            spin_end = deadline;
        }
        for (unsigned i = 1;; i++) {
            if (__atomic_load_n(seq, __ATOMIC_ACQUIRE) >= target) {
                PyEval_RestoreThread(ts);
                Py_RETURN_TRUE;
            }
            cpu_relax();
            if ((i & 63) == 0 && now_ns() >= spin_end) {
                break;
            }
        }
    }

    /* Park. Re-checks seq after every wake-up (woken, value changed, timeout,
     * signal, spurious), so the last look at seq is always after the deadline. */
    for (;;) {
        uint64_t b = __atomic_load_n(bell, __ATOMIC_ACQUIRE);
        int64_t remaining = -1;
        __atomic_store_n(parked, 1, __ATOMIC_SEQ_CST);
        /* Store parked before loading seq: pairs with the fence in publish. */
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (__atomic_load_n(seq, __ATOMIC_ACQUIRE) >= target) {
            reached = 1;
            break;
        }
        if (timeout_ns > 0) {
            remaining = deadline - now_ns();
            if (remaining <= 0) {
                break;
            }
        }
        if (futex_wait_raw(futex_word(bell), (uint32_t)b, remaining) < 0 && errno == EINTR) {
            PyEval_RestoreThread(ts);
            if (PyErr_CheckSignals() < 0) {
                __atomic_store_n(parked, 0, __ATOMIC_RELEASE);
                return NULL;
            }
            ts = PyEval_SaveThread();
        }
        /* Other errors (EAGAIN: bell moved; ETIMEDOUT) just loop: the next
         * pass re-checks seq and the deadline. */
    }
    /* Only a hint for the publisher: a stale 1 costs it one needless wake. */
    __atomic_store_n(parked, 0, __ATOMIC_RELEASE);
    PyEval_RestoreThread(ts);
    return PyBool_FromLong(reached);
}

/* ------------------------------------------------------------------------ */
/* Wakes off the publisher's thread: publish_deferred / wake_loop            */
/* ------------------------------------------------------------------------ */

/*
 * A FUTEX_WAKE of a parked peer costs its caller ~3-10 µs (a syscall and an
 * interrupt to the peer's CPU). A sidecar answering a batch of 64 searches
 * whose callers parked would spend that 64 times on its one thread. Instead it
 * stores each sequence word (spinning peers see it at once), rings each
 * parked peer's bell, and queues the bell's address on a ring; another thread
 * (wake_loop, the GIL released for its whole life) issues the syscalls.
 *
 * The ring: u64 words, each field on its own cache line; one producer thread
 * (publish_deferred), one consumer (wake_loop).
 */
#define RING_TAIL 0      /* bells queued (the producer's) */
#define RING_HEAD 8      /* bells woken (the consumer's) */
#define RING_PARKED 16   /* the consumer sleeps: the producer must wake it */
#define RING_BELL 24     /* the consumer's futex word */
#define RING_STOP 32     /* non-zero: the consumer returns once the ring is empty */
#define RING_CAPACITY 40 /* slots, a power of two (set before either side runs) */
#define RING_SLOTS 64    /* the first slot */

static int
as_ring(PyObject *obj, uint64_t **out)
{
    uint64_t cap;
    if (as_word(obj, "ring_addr", out) < 0) {
        return -1;
    }
    cap = (*out)[RING_CAPACITY];
    if (cap == 0 || (cap & (cap - 1)) != 0) {
        PyErr_SetString(PyExc_ValueError, "the ring's capacity must be a power of two");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(publish_deferred_doc,
"publish_deferred($module, seq_addr, value, parked_addr, bell_addr, ring_addr, /)\n--\n\n"
"publish, with the wake left to wake_loop's thread: stores value at seq_addr\n"
"(release); if the peer is parked, rings its bell and queues the bell's\n"
"address on the ring at ring_addr (waking wake_loop if it sleeps, or making\n"
"the wake here when the ring is full). Returns True if the peer was parked.\n\n"
"One thread only may publish through a ring. wake_loop makes its syscall on\n"
"the bell's address after this returns: a bell whose mapping has gone since\n"
"costs it an EFAULT, nothing else.");

static PyObject *
publish_deferred(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t *seq, *parked, *bell, *ring, value, tail, head;
    (void)module;
    if (check_nargs("publish_deferred", nargs, 5) < 0 ||
        as_word(args[0], "seq_addr", &seq) < 0 || as_u64(args[1], "value", &value) < 0 ||
        as_word(args[2], "parked_addr", &parked) < 0 ||
        as_word(args[3], "bell_addr", &bell) < 0 || as_ring(args[4], &ring) < 0) {
        return NULL;
    }
    __atomic_store_n(seq, value, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* as in publish */
    if (__atomic_load_n(parked, __ATOMIC_ACQUIRE) == 0) {
        Py_RETURN_FALSE;
    }
    __atomic_fetch_add(bell, 1, __ATOMIC_SEQ_CST);
    tail = __atomic_load_n(ring + RING_TAIL, __ATOMIC_RELAXED);
    head = __atomic_load_n(ring + RING_HEAD, __ATOMIC_ACQUIRE);
    if (tail - head >= ring[RING_CAPACITY]) { /* full: this one wakes here */
        if (futex_wake_raw(futex_word(bell), INT_MAX) < 0) {
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        Py_RETURN_TRUE;
    }
    ring[RING_SLOTS + (tail & (ring[RING_CAPACITY] - 1))] = (uint64_t)(uintptr_t)bell;
    __atomic_store_n(ring + RING_TAIL, tail + 1, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the tail before the consumer's flag */
    if (__atomic_load_n(ring + RING_PARKED, __ATOMIC_ACQUIRE) != 0) {
        __atomic_fetch_add(ring + RING_BELL, 1, __ATOMIC_SEQ_CST);
        if (futex_wake_raw(futex_word(ring + RING_BELL), 1) < 0) {
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(wake_loop_doc,
"wake_loop($module, ring_addr, spin_ns, /)\n--\n\n"
"The consumer of publish_deferred's ring: makes each queued bell's\n"
"FUTEX_WAKE, in order, and advances the ring's head past it; with the ring\n"
"empty, spins up to spin_ns, then sleeps until the producer queues another.\n"
"Returns once the ring's stop word is non-zero and the ring is empty (the\n"
"stopper stores the stop word, then rings the ring's bell). The GIL is\n"
"released until it returns: run it on a thread of its own.");

static PyObject *
wake_loop(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t *ring, mask, head;
    int64_t spin_ns;
    (void)module;
    if (check_nargs("wake_loop", nargs, 2) < 0 || as_ring(args[0], &ring) < 0 ||
        as_i64(args[1], "spin_ns", &spin_ns) < 0) {
        return NULL;
    }
    mask = ring[RING_CAPACITY] - 1;
    Py_BEGIN_ALLOW_THREADS
    head = __atomic_load_n(ring + RING_HEAD, __ATOMIC_RELAXED);
    for (;;) {
        uint64_t tail = __atomic_load_n(ring + RING_TAIL, __ATOMIC_ACQUIRE);
        if (tail != head) {
            uint64_t *bell = (uint64_t *)(uintptr_t)ring[RING_SLOTS + (head & mask)];
            (void)futex_wake_raw(futex_word(bell), INT_MAX); /* EFAULT: its peer has gone */
            __atomic_store_n(ring + RING_HEAD, ++head, __ATOMIC_RELEASE);
            continue;
        }
        if (__atomic_load_n(ring + RING_STOP, __ATOMIC_ACQUIRE) != 0) {
            break;
        }
        if (spin_ns > 0) {
            int64_t end = deadline_after(now_ns(), spin_ns);
            unsigned i = 1;
            while (__atomic_load_n(ring + RING_TAIL, __ATOMIC_ACQUIRE) == head &&
                   __atomic_load_n(ring + RING_STOP, __ATOMIC_ACQUIRE) == 0) {
                cpu_relax();
                if ((i++ & 63) == 0 && now_ns() >= end) {
                    break;
                }
            }
        }
        { /* sleep: the Dekker handshake of wait_seq, on the tail and the stop word */
            uint64_t b = __atomic_load_n(ring + RING_BELL, __ATOMIC_ACQUIRE);
            __atomic_store_n(ring + RING_PARKED, 1, __ATOMIC_SEQ_CST);
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
            if (__atomic_load_n(ring + RING_TAIL, __ATOMIC_ACQUIRE) == head &&
                __atomic_load_n(ring + RING_STOP, __ATOMIC_ACQUIRE) == 0) {
                (void)futex_wait_raw(futex_word(ring + RING_BELL), (uint32_t)b, -1);
            }
            __atomic_store_n(ring + RING_PARKED, 0, __ATOMIC_RELEASE);
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------ */
/* Module                                                                    */
/* ------------------------------------------------------------------------ */

/* Cast through void(*)(void) so -Wcast-function-type accepts METH_FASTCALL. */
#define FASTCALL(name) \
    {#name, (PyCFunction)(void (*)(void))name, METH_FASTCALL, name##_doc}

static PyMethodDef native_methods[] = {
    FASTCALL(load_acquire),
    FASTCALL(store_release),
    FASTCALL(fetch_add),
    FASTCALL(fence),
    FASTCALL(futex_wait),
    FASTCALL(futex_wake),
    FASTCALL(publish),
    FASTCALL(wait_seq),
    FASTCALL(publish_deferred),
    FASTCALL(wake_loop),
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot native_slots[] = {
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#ifdef Py_mod_gil
    /* No module state and every operation is atomic: safe without a GIL. */
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

PyDoc_STRVAR(native_doc,
"Memory ordering and futex waits for Kalos channels (the one native helper).\n\n"
"Pure Python cannot order memory on weakly ordered CPUs (ARM64) or sleep on a\n"
"futex, so the sequence words of the shared-memory channels go through here:\n"
"load_acquire / store_release / fetch_add / fence on u64 words, futex_wait /\n"
"futex_wake on the low 32 bits of a u64 word, and publish / wait_seq, the two\n"
"halves of a lost-wake-up-free handshake (spin, then park with the GIL\n"
"released; the publisher makes a syscall only when the waiter is parked), and\n"
"publish_deferred / wake_loop, a publish whose wake another thread makes.\n\n"
"Addresses are raw virtual addresses as ints, e.g.\n"
"ctypes.addressof(ctypes.c_char.from_buffer(mm)) + offset, 8-byte aligned and\n"
"non-zero (ValueError otherwise); the caller keeps the mapping alive. Values\n"
"are unsigned 64-bit; times are nanoseconds. Linux only.");

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kalos._native",
    .m_doc = native_doc,
    .m_size = 0,
    .m_methods = native_methods,
    .m_slots = native_slots,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModuleDef_Init(&native_module);
}
