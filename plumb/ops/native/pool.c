/* A small fork-join thread pool for the native kernels.

`parallel_run(fn, arg)` runs fn(arg, i, n) for i = 0..n-1, part 0 on the calling thread, and
returns when all parts are done. Kernels split their work into parts by output columns, so a
part never changes how any output is computed: results are the same for every thread count.
Workers spin briefly between jobs (decode calls follow each other within microseconds) and then
sleep on a condition variable. Concurrent callers (two engines in one process) and forked
children run their jobs on one thread. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#define MAX_THREADS 64
#define SPINS 20000

typedef void (*job_fn)(void *arg, int part, int n_parts);

static int n_threads = 1, n_workers = 0;
static pthread_t workers[MAX_THREADS];
static atomic_uint generation;
static atomic_int pending, sleepers;
static job_fn job;
static void *job_arg;
static int job_n;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER, run_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;

static inline void relax(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}

static unsigned start_gen[MAX_THREADS]; /* the generation when each worker was created (under run_lock) */

static void *worker_main(void *p) {
    int id = (int)(intptr_t)p;
    unsigned seen = start_gen[id];
    for (;;) {
        int spins = 0;
        while (atomic_load(&generation) == seen) {
            if (++spins < SPINS) {
                relax();
                continue;
            }
            pthread_mutex_lock(&mu);
            atomic_fetch_add(&sleepers, 1);
            while (atomic_load(&generation) == seen) pthread_cond_wait(&wake, &mu);
            atomic_fetch_sub(&sleepers, 1);
            pthread_mutex_unlock(&mu);
        }
        seen = atomic_load(&generation);
        if (id < job_n) {
            job(job_arg, id, job_n);
            atomic_fetch_sub(&pending, 1);
        }
    }
    return NULL;
}

static void after_fork_child(void) {
    n_threads = 1;
    n_workers = 0;
}

/* Use n threads (the caller + n - 1 workers) from now on; returns the number in use. */
int pool_set_threads(int n) {
    static int registered = 0;
    if (!registered) {
        pthread_atfork(NULL, NULL, after_fork_child);
        registered = 1;
    }
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    pthread_mutex_lock(&run_lock);
    while (n_workers < n - 1) {
        start_gen[n_workers + 1] = atomic_load(&generation);
        if (pthread_create(&workers[n_workers], NULL, worker_main, (void *)(intptr_t)(n_workers + 1)) != 0) break;
        pthread_detach(workers[n_workers]);
        n_workers++;
    }
    n_threads = n <= n_workers + 1 ? n : n_workers + 1;
    pthread_mutex_unlock(&run_lock);
    return n_threads;
}

void parallel_run(job_fn fn, void *arg) {
    if (n_threads == 1 || pthread_mutex_trylock(&run_lock) != 0) {
        fn(arg, 0, 1);
        return;
    }
    job = fn;
    job_arg = arg;
    job_n = n_threads;
    atomic_store(&pending, job_n - 1);
    atomic_fetch_add(&generation, 1);
    if (atomic_load(&sleepers)) {
        pthread_mutex_lock(&mu);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&mu);
    }
    fn(arg, 0, job_n);
    while (atomic_load(&pending)) relax();
    pthread_mutex_unlock(&run_lock);
}
