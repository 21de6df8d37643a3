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
 * Condition waits of the main thread that yield before they sleep. MLX lets the thread that
 * builds and queues the graph run at most ten tasks (a hundred operations) ahead of its
 * stream thread: beyond that it waits on a condition variable that the stream thread
 * broadcasts at every task's completion. Asleep in the kernel, the builder has to be woken
 * by a system call of the stream thread, on the critical path: counted with an interposed
 * pthread_cond_broadcast, a SmolLM2 plain step made ~200 such wakes at ~6 microseconds each
 * here (a virtual machine's cross-CPU interrupt), 1.3 of its 14 ms, and a 9-node pass ~300.
 * This file's pthread_cond_wait, on the process's main thread (where the CLI, the chat and
 * every benchmark build graphs), first returns without sleeping -- a spurious wakeup, which
 * every caller of a condition wait must handle by checking its condition again -- after
 * yielding its core once, for up to SPECSTREAM_WAIT_SPIN_US microseconds of consecutive
 * waits on the same condition variable (default 300; 0: the C library's wait alone). Only
 * then does it sleep as before. While it yields, a broadcast finds no sleeper and makes no
 * system call; the yield gives the core to the product kernel's worker when that has work.
 * Other threads (MLX's stream thread waiting for work, the BLAS's threads) wait as before.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum { DEFAULT_TRIES = 100, MOST_TRIES = 1 << 20 };
enum { DEFAULT_WAIT_SPIN_US = 300, MOST_WAIT_SPIN_US = 1000000 };

static int (*next_lock)(pthread_mutex_t *);
static int tries = DEFAULT_TRIES;
static int (*next_wait)(pthread_cond_t *, pthread_mutex_t *);
static int wait_spin_us = DEFAULT_WAIT_SPIN_US;

/* A whole number from 0 to most in the variable `name`, else `fallback`. The CLI refuses a
 * bad value in one line before it gets here; anything else keeps the default. */
static int setting(const char *name, int fallback, int most) {
  const char *s = getenv(name);
  if (s == NULL || *s == '\0')
    return fallback;
  char *end;
  long n = strtol(s, &end, 10);
  if (*end != '\0' || n < 0)
    return fallback;
  return n > most ? most : (int)n;
}

__attribute__((constructor)) static void lock_spin_setup(void) {
  next_lock = (int (*)(pthread_mutex_t *))dlsym(RTLD_NEXT, "pthread_mutex_lock");
  tries = setting("SPECSTREAM_LOCK_SPIN", DEFAULT_TRIES, MOST_TRIES);
  wait_spin_us = setting("SPECSTREAM_WAIT_SPIN_US", DEFAULT_WAIT_SPIN_US, MOST_WAIT_SPIN_US);
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
  int n = __atomic_load_n(&tries, __ATOMIC_RELAXED);
  for (int i = 0; i < n; i++) {
    if (pthread_mutex_trylock(m) == 0)
      return 0;
    pause_once();
  }
  return next_lock(m);
}

int pthread_mutex_lock(pthread_mutex_t *m) __attribute__((alias("spin_then_lock")));

/* Sets the tries (negative: unchanged) and returns the previous count: a benchmark
 * alternates settings within one process (examples/lock_spin_ab.py), where the machine's
 * drift between processes would hide a few percent. */
int specstream_lock_spin_set(int n) {
  int before = tries;
  if (n >= 0)
    __atomic_store_n(&tries, n > MOST_TRIES ? MOST_TRIES : n, __ATOMIC_RELAXED);
  return before;
}

/* The tries this process's mutexes make before sleeping: 0 when this library does not
 * serve the process's pthread_mutex_lock (not preloaded) or the setting turned it off. */
int specstream_lock_spins(void) {
  void *served = dlsym(RTLD_DEFAULT, "pthread_mutex_lock");
  return served == (void *)spin_then_lock ? __atomic_load_n(&tries, __ATOMIC_RELAXED) : 0;
}

/* ---- condition waits ------------------------------------------------------------------ */

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

/* Per thread: whether it is the process's main thread (-1: not asked yet), and the episode
 * of yielding returns it is in: the condition variable, when the episode began and when its
 * last return was. A wait more than EPISODE_GAP_US after that return, or on another
 * condition variable, begins a new episode. */
enum { EPISODE_GAP_US = 30 };
static __thread int main_thread = -1;
static __thread pthread_cond_t *episode_cond;
static __thread double episode_start, episode_last;

__attribute__((visibility("hidden"))) int yield_then_wait(pthread_cond_t *c, pthread_mutex_t *m) {
  if (next_wait == NULL) /* called before the constructor ran (another library's threads) */
    next_wait = (int (*)(pthread_cond_t *, pthread_mutex_t *))dlsym(RTLD_NEXT, "pthread_cond_wait");
  int budget = __atomic_load_n(&wait_spin_us, __ATOMIC_RELAXED);
  if (budget > 0) {
    if (main_thread < 0)
      main_thread = syscall(SYS_gettid) == getpid();
    if (main_thread) {
      double t = now_us();
      if (episode_cond != c || t - episode_last > EPISODE_GAP_US) {
        episode_cond = c;
        episode_start = t;
      }
      if (t - episode_start < budget) {
        pthread_mutex_unlock(m);
        sched_yield();
        pthread_mutex_lock(m);
        episode_last = now_us();
        return 0; /* a spurious wakeup: the caller checks its condition and waits again */
      }
      episode_cond = NULL;
    }
  }
  return next_wait(c, m);
}

int pthread_cond_wait(pthread_cond_t *c, pthread_mutex_t *m) __attribute__((alias("yield_then_wait")));

/* Sets the microseconds (negative: unchanged) and returns the previous value, for
 * benchmarks that alternate settings within one process (examples/lock_spin_ab.py). */
int specstream_wait_spin_set(int us) {
  int before = wait_spin_us;
  if (us >= 0)
    __atomic_store_n(&wait_spin_us, us > MOST_WAIT_SPIN_US ? MOST_WAIT_SPIN_US : us, __ATOMIC_RELAXED);
  return before;
}

/* The microseconds the main thread's condition waits yield before they sleep: 0 when this
 * library does not serve the process's pthread_cond_wait or the setting turned it off. */
int specstream_wait_spin_us(void) {
  void *served = dlsym(RTLD_DEFAULT, "pthread_cond_wait");
  return served == (void *)yield_then_wait ? __atomic_load_n(&wait_spin_us, __ATOMIC_RELAXED) : 0;
}
