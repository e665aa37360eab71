/* The threads behind kvlab_run_parallel (declared in cpu_common.h).
 *
 * Where torch runs on an OpenMP runtime, the kernels run on torch's own OpenMP threads:
 * kernels/cpu_build.py hands over the runtime's GOMP_parallel (kvlab_use_openmp). After
 * each of torch's parallel ops those threads keep spinning for a while, waiting for the
 * next; a thread of ours woken then would wait behind the spinner for the core, which
 * measured here doubles a decode call that follows a matmul. Torch's threads instead take
 * the call at once.
 *
 * Without a runtime to share, a pool of our own: helper pthreads, started on first need
 * and kept, that sleep on `start` between calls, never spinning, since torch's threads
 * run between calls. A sleeper woken by the OS runs sooner than a freshly created thread,
 * which waits behind whatever holds the core (such as an OpenMP thread still spinning
 * after torch's last matmul). One call at a time (`call`); fork() waits for a running
 * call, and the child starts with no helpers.
 */

#include <pthread.h>

#include "cpu_common.h"

static struct {
    pthread_mutex_t call, lock; /* lock guards the fields below */
    pthread_cond_t start, done;
    int helpers;                /* started so far */
    int wanted, busy;           /* helpers in this call, and those still working on it */
    uint64_t generation;        /* one per call */
    uint64_t first_seen[MAX_THREADS]; /* a new helper's generation when it was started */
    kvlab_work work;            /* this call's work and its argument */
    void *ctx;
    int status;
} pool = {.call = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER,
          .start = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void before_fork(void) { pthread_mutex_lock(&pool.call); }
static void after_fork_parent(void) { pthread_mutex_unlock(&pool.call); }
static void after_fork_child(void) { /* the helpers did not come along */
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.start, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.helpers = 0;
    pthread_mutex_unlock(&pool.call);
}
static void pool_init(void) { pthread_atfork(before_fork, after_fork_parent, after_fork_child); }

static void *helper(void *arg) {
    const int index = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.lock);
    uint64_t seen = pool.first_seen[index];
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.start, &pool.lock);
        seen = pool.generation;
        if (index >= pool.wanted) continue; /* not needed in this call */
        kvlab_work work = pool.work;
        void *ctx = pool.ctx;
        pthread_mutex_unlock(&pool.lock);
        const int status = work(ctx);
        pthread_mutex_lock(&pool.lock);
        pool.status = pool.status ? pool.status : status;
        if (--pool.busy == 0) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

/* Starts helpers until there are `n` (fewer if the system says no); called under lock. */
static void start_helpers(int n) {
    pthread_attr_t attr;
    if (pthread_attr_init(&attr)) return;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (pool.helpers < n) {
        pthread_t id;
        pool.first_seen[pool.helpers] = pool.generation;
        if (pthread_create(&id, &attr, helper, (void *)(intptr_t)pool.helpers)) break;
        pool.helpers++;
    }
    pthread_attr_destroy(&attr);
}

/* GOMP_parallel(fn, data, num_threads, flags): fn(data) on num_threads threads, the caller
 * one of them; returns when all are done. The same entry point in libgomp, LLVM's libomp
 * and Intel's libiomp5. */
typedef void (*gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads,
                                 unsigned flags);
static gomp_parallel_fn gomp_parallel;

void kvlab_use_openmp(void *gomp_parallel_entry) {
    gomp_parallel = (gomp_parallel_fn)gomp_parallel_entry;
}

typedef struct {
    kvlab_work work;
    void *ctx;
    int status;
} OmpCall;

static void omp_body(void *arg) {
    OmpCall *call = arg;
    const int status = call->work(call->ctx);
    if (status) __atomic_store_n(&call->status, status, __ATOMIC_RELAXED);
}

int kvlab_run_parallel(int num_threads, kvlab_work work, void *ctx) {
    const int n = num_threads < MAX_THREADS ? num_threads : MAX_THREADS;
    if (n <= 1) return work(ctx);
    if (gomp_parallel) {
        OmpCall call = {work, ctx, KVLAB_OK};
        gomp_parallel(omp_body, &call, (unsigned)n, 0);
        return call.status;
    }
    pthread_once(&pool_once, pool_init);
    pthread_mutex_lock(&pool.call);
    pthread_mutex_lock(&pool.lock);
    start_helpers(n - 1);
    pool.wanted = pool.busy = n - 1 < pool.helpers ? n - 1 : pool.helpers;
    pool.work = work;
    pool.ctx = ctx;
    pool.status = KVLAB_OK;
    pool.generation++;
    pthread_cond_broadcast(&pool.start);
    pthread_mutex_unlock(&pool.lock);
    int status = work(ctx);
    pthread_mutex_lock(&pool.lock);
    while (pool.busy) pthread_cond_wait(&pool.done, &pool.lock);
    status = status ? status : pool.status;
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.call);
    return status;
}
