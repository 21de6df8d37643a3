/* Mutexes that spin briefly before they sleep.
 *
 * MLX's CPU backend runs every operation on its stream thread while the thread that builds
 * the graph allocates the next operations' outputs and queues them; both take the same few
 * mutexes for every operation (the allocator's buffer cache: the builder allocates, the
 * stream thread frees; the stream's task queue; the scheduler's task count). Those are
 * std::mutex, glibc's plain mutex, which sleeps in the kernel at the first sign of
 * contention and wakes the other thread with a second system call when it unlocks. A
 * SmolLM2 plain step (~2,800 queued tasks) made ~900 futex calls here, and each holder
 * keeps such a mutex for well under a microsecond.
 *
 * Preloaded (LD_PRELOAD) in front of the C library, this file's pthread_mutex_lock first
 * tries the mutex a bounded number of times, pausing between tries, and only then calls
 * the C library's lock, which sleeps as before. Taken by a try, a mutex is held exactly as
 * a lock would hold it: pthread_mutex_trylock has the lock's semantics for every mutex kind
 * (a recursive mutex counts, an error-checking one owned by the caller reports EBUSY and
 * the real lock then reports EDEADLK). Loaded any other way (dlopen) it interposes nothing.
 *
 * Setting (read once): SPECSTREAM_LOCK_SPIN, the tries before sleeping (default 100,
 * about two microseconds; 0: the C library's lock alone).
 *
 * Condition waits that spin before they sleep. The graph-building thread may run only ten
 * of MLX's scheduler tasks (a hundred operations' dispatches) ahead of the stream thread;
 * past that it waits on the scheduler's condition variable, and the stream thread wakes it
 * at every task it finishes: a system call on the critical path each time (~250 a SmolLM2
 * plain step, 8% of the stream thread's time in the kernel's wake-up there), and a context
 * switch for the builder. Here pthread_cond_wait first releases the mutex and polls for a
 * broadcast or signal on that condition variable (this library's wrappers count them),
 * yielding the core between looks, for up to SPECSTREAM_COND_SPIN_US microseconds (default
 * 200; 0: the C library's wait alone); a broadcast then finds no sleeper to wake. It returns
 * with the mutex held again, as from a wake-up: POSIX lets a wait return spuriously, so every
 * correct caller checks its condition again (MLX's waits take a predicate). A spin that saw
 * nothing makes the thread's next wait on the same condition variable sleep at once, in the
 * C library's wait, so a long wait costs one spin. Only the default (GLIBC_2.3.2) condition
 * variables are served: programs built against the C library of 2002 are not run here.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

enum { DEFAULT_TRIES = 100, MOST_TRIES = 1 << 20 };

static int (*next_lock)(pthread_mutex_t *);
static long tries = DEFAULT_TRIES;

enum { DEFAULT_COND_SPIN_US = 200, MOST_COND_SPIN_US = 1 << 20 };
static int (*next_wait)(pthread_cond_t *, pthread_mutex_t *);
static int (*next_broadcast)(pthread_cond_t *);
static int (*next_signal)(pthread_cond_t *);
static long cond_spin_us = DEFAULT_COND_SPIN_US;
static long spun_waits; /* waits that a broadcast or signal ended while they spun */

static void cond_symbols(void) {
  next_wait = (int (*)(pthread_cond_t *, pthread_mutex_t *))dlvsym(RTLD_NEXT, "pthread_cond_wait", "GLIBC_2.3.2");
  next_broadcast = (int (*)(pthread_cond_t *))dlvsym(RTLD_NEXT, "pthread_cond_broadcast", "GLIBC_2.3.2");
  next_signal = (int (*)(pthread_cond_t *))dlvsym(RTLD_NEXT, "pthread_cond_signal", "GLIBC_2.3.2");
  if (next_wait == NULL || next_broadcast == NULL || next_signal == NULL) { /* not glibc's versions */
    next_wait = (int (*)(pthread_cond_t *, pthread_mutex_t *))dlsym(RTLD_NEXT, "pthread_cond_wait");
    next_broadcast = (int (*)(pthread_cond_t *))dlsym(RTLD_NEXT, "pthread_cond_broadcast");
    next_signal = (int (*)(pthread_cond_t *))dlsym(RTLD_NEXT, "pthread_cond_signal");
  }
}

static long number_setting(const char *name, long fallback, long most) {
  const char *s = getenv(name);
  if (s == NULL || *s == '\0')
    return fallback;
  char *end;
  long n = strtol(s, &end, 10);
  /* The CLI refuses a bad value in one line before it gets here; anything else keeps the default. */
  if (*end != '\0' || n < 0)
    return fallback;
  return n > most ? most : n;
}

__attribute__((constructor)) static void lock_spin_setup(void) {
  next_lock = (int (*)(pthread_mutex_t *))dlsym(RTLD_NEXT, "pthread_mutex_lock");
  tries = number_setting("SPECSTREAM_LOCK_SPIN", DEFAULT_TRIES, MOST_TRIES);
  if (next_wait == NULL)
    cond_symbols();
  cond_spin_us = number_setting("SPECSTREAM_COND_SPIN_US", DEFAULT_COND_SPIN_US, MOST_COND_SPIN_US);
}

static inline void pause_once(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* The lock itself, under a name of this library's own: what it serves is told by comparing
 * addresses, and the exported name's address is whatever the process resolves it to. */
__attribute__((visibility("hidden"))) int spin_then_lock(pthread_mutex_t *m) {
  if (next_lock == NULL) /* called before the constructor ran (another library's own) */
    next_lock = (int (*)(pthread_mutex_t *))dlsym(RTLD_NEXT, "pthread_mutex_lock");
  long n = __atomic_load_n(&tries, __ATOMIC_RELAXED);
  for (long i = 0; i < n; i++) {
    if (pthread_mutex_trylock(m) == 0)
      return 0;
    pause_once();
  }
  return next_lock(m);
}

int pthread_mutex_lock(pthread_mutex_t *m) __attribute__((alias("spin_then_lock")));

/* Sets a setting to value, at most most (negative: unchanged), and returns the previous one: a
 * benchmark alternates settings within one process (examples/lock_spin_ab.py), where the
 * machine's drift between processes would hide a few percent. */
static long replace_setting(long *setting, long value, long most) {
  long before = __atomic_load_n(setting, __ATOMIC_RELAXED);
  if (value >= 0)
    __atomic_store_n(setting, value > most ? most : value, __ATOMIC_RELAXED);
  return before;
}

/* A setting as the process sees it: 0 where this library's function does not serve the
 * process's symbol (not preloaded), else its value (0 too when the setting turned it off). */
static long served_setting(const char *symbol, void *ours, const long *setting) {
  return dlsym(RTLD_DEFAULT, symbol) == ours ? __atomic_load_n(setting, __ATOMIC_RELAXED) : 0;
}

/* Sets the tries (negative: unchanged) and returns the previous count. */
int specstream_lock_spin_set(int n) { return (int)replace_setting(&tries, n, MOST_TRIES); }

/* The tries this process's mutexes make before sleeping. */
int specstream_lock_spins(void) {
  return (int)served_setting("pthread_mutex_lock", (void *)spin_then_lock, &tries);
}

/* ---- condition waits ------------------------------------------------------------------- */

/* Broadcasts and signals so far, per condition variable (by its address, hashed: two that
 * share a slot only end each other's spins early, a spurious wake-up). */
enum { SEQ_SLOTS = 256 };
static unsigned cond_seq[SEQ_SLOTS];
static inline unsigned *seq_of(const pthread_cond_t *c) {
  return &cond_seq[((uintptr_t)c >> 6) * 0x9E3779B97F4A7C15ull >> 56];
}
/* The condition variable this thread's last spin saw nothing on: its next wait there sleeps. */
static __thread const pthread_cond_t *slept_on;

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

__attribute__((visibility("hidden"))) int counted_broadcast(pthread_cond_t *c) {
  if (next_broadcast == NULL)
    cond_symbols();
  __atomic_fetch_add(seq_of(c), 1, __ATOMIC_RELEASE);
  return next_broadcast(c);
}

__attribute__((visibility("hidden"))) int counted_signal(pthread_cond_t *c) {
  if (next_signal == NULL)
    cond_symbols();
  __atomic_fetch_add(seq_of(c), 1, __ATOMIC_RELEASE);
  return next_signal(c);
}

__attribute__((visibility("hidden"))) int spin_then_wait(pthread_cond_t *c, pthread_mutex_t *m) {
  if (next_wait == NULL)
    cond_symbols();
  long us = __atomic_load_n(&cond_spin_us, __ATOMIC_RELAXED);
  if (us > 0 && slept_on != c) {
    /* Read under the mutex: a broadcast after the caller's last look at its condition comes
     * after this, since the broadcaster changes the condition under the same mutex. */
    unsigned seen = __atomic_load_n(seq_of(c), __ATOMIC_ACQUIRE);
    pthread_mutex_unlock(m);
    double until = now_us() + (double)us;
    int woken = 0;
    while (!(woken = __atomic_load_n(seq_of(c), __ATOMIC_ACQUIRE) != seen) && now_us() < until)
      sched_yield();
    int locked = spin_then_lock(m); /* a robust mutex's EOWNERDEAD, as the wait would report it */
    if (woken)
      __atomic_fetch_add(&spun_waits, 1, __ATOMIC_RELAXED);
    else
      slept_on = c;
    return locked;
  }
  slept_on = NULL;
  return next_wait(c, m);
}

int pthread_cond_wait(pthread_cond_t *c, pthread_mutex_t *m) __attribute__((alias("spin_then_wait")));
int pthread_cond_broadcast(pthread_cond_t *c) __attribute__((alias("counted_broadcast")));
int pthread_cond_signal(pthread_cond_t *c) __attribute__((alias("counted_signal")));

/* Sets how long a condition wait spins, microseconds (negative: unchanged), and returns the
 * previous setting. */
long specstream_cond_spin_set(long us) { return replace_setting(&cond_spin_us, us, MOST_COND_SPIN_US); }

/* How long this process's condition waits spin before they sleep, microseconds. */
long specstream_cond_spin_us(void) {
  return served_setting("pthread_cond_wait", (void *)spin_then_wait, &cond_spin_us);
}

/* Condition waits a broadcast or signal ended while they spun, so far. */
long specstream_cond_spun_waits(void) { return __atomic_load_n(&spun_waits, __ATOMIC_RELAXED); }
