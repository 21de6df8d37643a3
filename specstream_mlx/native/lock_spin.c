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
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>

enum { DEFAULT_TRIES = 100, MOST_TRIES = 1 << 20 };

static int (*next_lock)(pthread_mutex_t *);
static int tries = DEFAULT_TRIES;

__attribute__((constructor)) static void lock_spin_setup(void) {
  next_lock = (int (*)(pthread_mutex_t *))dlsym(RTLD_NEXT, "pthread_mutex_lock");
  const char *s = getenv("SPECSTREAM_LOCK_SPIN");
  if (s != NULL && *s != '\0') {
    char *end;
    long n = strtol(s, &end, 10);
    /* The CLI refuses a bad value in one line before it gets here; anything else keeps the default. */
    if (*end == '\0' && n >= 0)
      tries = n > MOST_TRIES ? MOST_TRIES : (int)n;
  }
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
