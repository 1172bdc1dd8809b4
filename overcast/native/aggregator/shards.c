#define _GNU_SOURCE
#include "shards.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"

/* A shard's loop hands back now and then even when nothing wakes it (a pause wakes it sooner). */
#define TURN_SECONDS 1.0

typedef struct {
    oc_shards *all;
    oc_agg *agg;
    oc_udp udp;
    int wake;                 /* eventfd: the control thread wants the loop to look up */
    int waiter;               /* epoll on the socket and `wake`, for the shard's whole life */
    pthread_t thread;
    oc_serve_stats stats;
} shard_t;

struct oc_shards {
    uint32_t n, started;
    shard_t *shard;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int pausing, stopping;    /* under lock */
    uint32_t parked;          /* under lock: shards waiting for the pause to end */
};

static void wake(const shard_t *sh) {
    uint64_t one = 1;
    /* a full counter already wakes it: nothing is lost if this write fails */
    ssize_t unused = write(sh->wake, &one, sizeof one);
    (void)unused;
}

/* Park while the control thread holds a pause; 1 once the shards are to stop. */
static int look_up(shard_t *sh) {
    oc_shards *s = sh->all;
    pthread_mutex_lock(&s->lock);
    if (s->pausing && !s->stopping) {
        s->parked++;
        pthread_cond_broadcast(&s->cond);
        while (s->pausing && !s->stopping) pthread_cond_wait(&s->cond, &s->lock);
        s->parked--;
    }
    int stop = s->stopping;
    pthread_mutex_unlock(&s->lock);
    return stop;
}

static void *serve_shard(void *arg) {
    shard_t *sh = arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    for (;;) {
        if (oc_serve(sh->agg, &sh->udp, sh->waiter, oc_monotonic() + TURN_SECONDS,
                     &sh->stats) == 0) {
            uint64_t count;
            ssize_t unused = read(sh->wake, &count, sizeof count);
            (void)unused;
        }
        if (look_up(sh)) return NULL;
    }
}

oc_shards *oc_shards_new(uint32_t n, uint32_t slots, double expiry, const int *fds) {
    if (n == 0 || n > OC_MAX_STRIPES) return NULL;
    oc_shards *s = calloc(1, sizeof *s);
    if (s == NULL) return NULL;
    s->shard = calloc(n, sizeof(shard_t));
    if (s->shard == NULL || pthread_mutex_init(&s->lock, NULL)) {
        free(s->shard);
        free(s);
        return NULL;
    }
    pthread_cond_init(&s->cond, NULL);
    int failed = 0;
    for (uint32_t i = 0; i < n; i++) {
        shard_t *sh = &s->shard[i];
        sh->all = s;
        sh->wake = sh->waiter = -1;
        if (failed) continue;
        s->n = i + 1; /* what oc_shards_free frees */
        sh->agg = oc_agg_new(slots);
        sh->wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        failed = sh->agg == NULL || sh->wake < 0 || oc_udp_init(&sh->udp, fds[i]) ||
                 (sh->waiter = oc_serve_waiter(&sh->udp, &sh->wake, 1)) < 0;
        if (!failed) oc_agg_set_expiry(sh->agg, expiry);
    }
    if (failed) {
        int why = errno;
        oc_shards_free(s);
        errno = why;
        return NULL;
    }
    return s;
}

/* Stop and join the threads started; they may be started again. */
static void stop(oc_shards *s) {
    pthread_mutex_lock(&s->lock);
    s->stopping = 1;
    pthread_cond_broadcast(&s->cond);
    for (uint32_t i = 0; i < s->started; i++) wake(&s->shard[i]);
    pthread_mutex_unlock(&s->lock);
    for (uint32_t i = 0; i < s->started; i++) pthread_join(s->shard[i].thread, NULL);
    s->started = 0;
    s->stopping = 0;
}

int oc_shards_start(oc_shards *s) {
    for (; s->started < s->n; s->started++) {
        int failed = pthread_create(&s->shard[s->started].thread, NULL, serve_shard,
                                    &s->shard[s->started]);
        if (failed) {
            stop(s);
            errno = failed; /* pthread_create returns its error, leaving errno as it was */
            return -1;
        }
        /* named for top -H and perf; a name that does not take costs nothing else */
        char name[16];
        snprintf(name, sizeof name, "oc-shard-%u", s->started);
        pthread_setname_np(s->shard[s->started].thread, name);
    }
    return 0;
}

void oc_shards_pause(oc_shards *s) {
    pthread_mutex_lock(&s->lock);
    s->pausing = 1;
    for (uint32_t i = 0; i < s->started; i++) wake(&s->shard[i]);
    while (s->parked < s->started) pthread_cond_wait(&s->cond, &s->lock);
    pthread_mutex_unlock(&s->lock);
}

void oc_shards_resume(oc_shards *s) {
    pthread_mutex_lock(&s->lock);
    s->pausing = 0;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
}

uint32_t oc_shards_count(const oc_shards *s) { return s->n; }
oc_agg *oc_shards_engine(oc_shards *s, uint32_t i) { return s->shard[i].agg; }
const oc_udp *oc_shards_udp(const oc_shards *s, uint32_t i) { return &s->shard[i].udp; }
const oc_serve_stats *oc_shards_serve_stats(const oc_shards *s, uint32_t i) {
    return &s->shard[i].stats;
}

void oc_shards_free(oc_shards *s) {
    if (s == NULL) return;
    stop(s);
    for (uint32_t i = 0; i < s->n; i++) {
        shard_t *sh = &s->shard[i];
        oc_agg_free(sh->agg);
        oc_udp_free(&sh->udp);
        if (sh->wake >= 0) close(sh->wake);
        if (sh->waiter >= 0) close(sh->waiter);
    }
    pthread_cond_destroy(&s->cond);
    pthread_mutex_destroy(&s->lock);
    free(s->shard);
    free(s);
}
