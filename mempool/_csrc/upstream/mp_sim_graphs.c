/* CUDA graph capture on the simulated device: the calls a capture refuses, and the graphs
 * captured work makes (see mp_sim.h, Note [Graph capture] in core/mp_capture.h). */
#include "mp_sim_internal.h"

#include <stdlib.h>

/* A call that CUDA refuses during a capture, or that invalidates it (the driver's global
 * capture mode, the strictest): it fails, is counted, and every capture under way is
 * invalidated, as the driver invalidates them. */
int sim_capture_violation(mp_sim *s) {
    s->capture_violations++;
    for (size_t i = 0; i < s->nstreams; i++)
        if (s->streams[i].capturing) s->streams[i].broken = 1;
    return MP_EUPSTREAM;
}

int sim_is_capturing(mp_sim *s, uintptr_t stream) {
    sim_stream *st = sim_live_stream(s, stream);
    return st ? st->capturing : 0;
}

int sim_stream_capturing(void *ctx, uintptr_t stream, int *capturing) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    *capturing = sim_is_capturing(s, stream);
    pthread_mutex_unlock(&s->mu);
    return MP_OK;
}

/* Note [Sim capture graphs]
 * What the driver's graph says of the order of captured work, for Note [Capture reuse]
 * (core/mp_stream.c): a stream that captures has a frontier, the nodes its next captured
 * work depends on (cudaStreamGetCaptureInfo's dependencies). mp_sim_launch on it adds a node
 * that depends on the frontier and becomes it; mp_sim_capture_join(stream, from), the
 * capture's form of `stream` waiting for `from` (an event recorded on `from`, waited on by
 * `stream`), adds from's frontier to stream's, and makes a stream that did not capture
 * join from's capture (as the driver does); ending the capture ends it on every stream
 * that joined. capture_follows walks the dependencies back from the frontier. */

int sim_capture_frontier(void *ctx, uintptr_t stream, uint64_t *graph, uintptr_t *nodes,
                                size_t cap, size_t *n) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    sim_stream *st = sim_live_stream(s, stream);
    int rc = st && st->capturing ? MP_OK : MP_EINVAL;
    if (rc == MP_OK) {
        *graph = st->capture_id;
        *n = st->nfrontier;
        for (size_t i = 0; i < cap && i < st->nfrontier; i++) nodes[i] = st->frontier[i];
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int sim_capture_follows(void *ctx, uintptr_t stream, const uintptr_t *nodes, size_t n,
                               unsigned char *followed) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    sim_stream *st = sim_live_stream(s, stream);
    int rc = st && st->capturing ? MP_OK : MP_EINVAL;
    unsigned char *seen = rc == MP_OK ? calloc(s->nnodes + 1, 1) : NULL;
    uint32_t *stack = rc == MP_OK ? malloc((s->nnodes + 1) * sizeof *stack) : NULL;
    if (rc == MP_OK && (!seen || !stack)) rc = MP_ENOMEM;
    if (rc == MP_OK) {
        size_t top = 0;
        for (size_t i = 0; i < st->nfrontier; i++) {
            uint32_t v = st->frontier[i];
            if (!seen[v]) {
                seen[v] = 1;
                stack[top++] = v;
            }
        }
        while (top) {
            struct sim_node *node = &s->nodes[stack[--top] - 1];
            for (uint32_t j = 0; j < node->nparents; j++) {
                uint32_t u = node->parents[j];
                if (!seen[u]) {
                    seen[u] = 1;
                    stack[top++] = u;
                }
            }
        }
        for (size_t i = 0; i < n; i++)
            followed[i] = nodes[i] >= 1 && nodes[i] <= s->nnodes && seen[nodes[i]];
    }
    free(seen);
    free(stack);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* st's frontier := the nodes given (replace) or ∪= them (merge). 0 when out of memory. */
static int frontier_set(sim_stream *st, const uint32_t *nodes, size_t n, int merge) {
    if (!merge) st->nfrontier = 0;
    if (st->nfrontier + n > st->cap_frontier) {
        size_t cap = (st->nfrontier + n) * 2;
        uint32_t *grown = realloc(st->frontier, cap * sizeof *grown);
        if (!grown) return 0;
        st->frontier = grown;
        st->cap_frontier = cap;
    }
    for (size_t i = 0; i < n; i++) {
        size_t k = 0;
        while (k < st->nfrontier && st->frontier[k] != nodes[i]) k++;
        if (k == st->nfrontier) st->frontier[st->nfrontier++] = nodes[i];
    }
    return 1;
}

/* A captured node on stream si, after its frontier, which it becomes. */
void sim_capture_node(mp_sim *s, size_t si) {
    sim_stream *st = &s->streams[si];
    if (s->nnodes == s->cap_nodes) {
        size_t cap = s->cap_nodes ? 2 * s->cap_nodes : 64;
        struct sim_node *grown = realloc(s->nodes, cap * sizeof *grown);
        if (!grown) return;
        s->nodes = grown;
        s->cap_nodes = cap;
    }
    struct sim_node *node = &s->nodes[s->nnodes];
    node->nparents = 0;
    node->parents = st->nfrontier ? malloc(st->nfrontier * sizeof *node->parents) : NULL;
    if (st->nfrontier && !node->parents) return;
    for (size_t i = 0; i < st->nfrontier; i++) node->parents[node->nparents++] = st->frontier[i];
    uint32_t id = (uint32_t)++s->nnodes;
    frontier_set(st, &id, 1, 0);
}

int mp_sim_begin_capture(mp_sim *s, uintptr_t stream) {
    if (stream == 0 || stream == 1) return MP_EINVAL;   /* the legacy stream cannot capture */
    pthread_mutex_lock(&s->mu);
    size_t si = sim_stream_index(s, stream);
    int rc = si == SIZE_MAX ? MP_ENOMEM : s->streams[si].capturing ? MP_EBUSY : MP_OK;
    if (rc == MP_OK) {
        s->streams[si].capturing = 1;
        s->streams[si].broken = 0;
        s->streams[si].capture_id = ++s->last_capture;
        s->streams[si].nfrontier = 0;
        s->ncapturing++;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int mp_sim_end_capture(mp_sim *s, uintptr_t stream) {
    pthread_mutex_lock(&s->mu);
    int rc = MP_EINVAL;
    sim_stream *st = sim_live_stream(s, stream);
    if (st && st->capturing) {
        uint64_t id = st->capture_id;
        rc = st->broken ? MP_EUPSTREAM : MP_OK;
        for (size_t i = 0; i < s->nstreams; i++) {   /* and the streams that joined it */
            sim_stream *o = &s->streams[i];
            if (!o->capturing || o->capture_id != id) continue;
            o->capturing = 0;
            o->broken = 0;
            o->nfrontier = 0;
            s->ncapturing--;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int mp_sim_capture_join(mp_sim *s, uintptr_t stream, uintptr_t from) {
    if (stream == 0 || stream == 1 || stream == from) return MP_EINVAL;
    pthread_mutex_lock(&s->mu);
    size_t si = sim_stream_index(s, stream), fi = sim_stream_index(s, from);
    int rc = si == SIZE_MAX || fi == SIZE_MAX ? MP_ENOMEM : MP_OK;
    if (rc == MP_OK && !s->streams[fi].capturing) rc = MP_EINVAL;
    if (rc == MP_OK && s->streams[si].capturing &&
        s->streams[si].capture_id != s->streams[fi].capture_id)
        rc = MP_EINVAL;   /* two captures cannot be ordered against each other */
    if (rc == MP_OK) {
        sim_stream *st = &s->streams[si], *f = &s->streams[fi];
        if (!st->capturing) {
            st->capturing = 1;
            st->broken = f->broken;
            st->capture_id = f->capture_id;
            st->nfrontier = 0;
            s->ncapturing++;
        }
        if (!frontier_set(st, f->frontier, f->nfrontier, 1)) rc = MP_ENOMEM;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int mp_sim_is_capturing(mp_sim *s, uintptr_t stream) {
    int capturing = 0;
    sim_stream_capturing(s, stream, &capturing);
    return capturing;
}

void mp_sim_capture_counts(mp_sim *s, uint64_t *violations, uint64_t *allocs) {
    pthread_mutex_lock(&s->mu);
    *violations = s->capture_violations;
    *allocs = s->capture_allocs;
    pthread_mutex_unlock(&s->mu);
}
