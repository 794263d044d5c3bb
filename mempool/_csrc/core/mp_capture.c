/* CUDA graph capture: the tests the core makes before a call a capture would refuse, and
 * the pool's capture counter (mp_capture_begin/end). See Note [Graph capture] in
 * mp_capture.h. */
#include "mp_capture.h"

int mp_capture_handle(mp_pool *p, uintptr_t handle) {
    if (!p->up.stream_capturing) return 0;
    int capturing = 1;
    if (p->up.stream_capturing(p->up.ctx, handle, &capturing) != MP_OK) return 1;
    return capturing != 0;
}

/* The stream last found capturing still captures (asked again; forgotten once it stops). A
 * capture forbids calls on other streams too (the driver's global mode), and the pool keeps
 * seeing it this way while the capture's own calls hit the free lists and ask nothing. */
static int seen_capturing_locked(mp_pool *p, mp_stream *except) {
    mp_stream *c = p->capture_seen;
    if (!c || c == except) return 0;
    if (mp_capture_handle(p, c->handle)) return 1;
    p->capture_seen = NULL;
    return 0;
}

int mp_capture_stream_locked(mp_pool *p, mp_stream *s) {
    if (p->captures) return 1;
    if (s && mp_capture_handle(p, s->handle)) {
        p->capture_seen = s;
        return 1;
    }
    return seen_capturing_locked(p, s);
}

int mp_capture_call_locked(mp_pool *p, mp_release_list *rel) {
    if (p->captures) return 1;
    if (!rel->capture) rel->capture = mp_capture_stream_locked(p, rel->stream) ? 2 : 1;
    return rel->capture == 2;
}

int mp_capture_segment_locked(mp_pool *p, mp_release_list *rel, mp_segment *seg) {
    if (mp_capture_call_locked(p, rel)) return 1;
    if (seg->stream != rel->stream && mp_capture_stream_locked(p, seg->stream)) return 1;
    for (mp_block *b = seg->first; b; b = b->next) {
        if (b->stream == seg->stream || b->stream == rel->stream) continue;   /* asked above */
        if (mp_capture_stream_locked(p, b->stream)) return 1;
    }
    return 0;
}

int mp_capture_uses_locked(mp_pool *p, const mp_block *b) {
    if (mp_capture_stream_locked(p, b->stream)) return 1;
    for (uint16_t i = 0; i < b->nuses; i++)
        if (mp_capture_stream_locked(p, b->uses[i])) return 1;
    return 0;
}

int mp_capture_begin(mp_pool *p) {
    mp_lock_acquire(&p->lock);
    int rc = p->captures == INT32_MAX ? MP_EINVAL : MP_OK;
    if (rc == MP_OK) p->captures++;
    mp_lock_release(&p->lock);
    return rc;
}

int mp_capture_end(mp_pool *p) {
    mp_release_list rel = {0};
    mp_lock_acquire(&p->lock);
    int rc = p->captures > 0 ? MP_OK : MP_EINVAL;
    if (rc == MP_OK) p->captures--;
    /* The last capture is over: frees deferred during it get their events, and what the
     * threshold held back goes, as it would have at the frees made meanwhile (streams still
     * capturing keep theirs: the tests above ask them). */
    if (rc == MP_OK && !p->captures) {
        if (p->npending) mp_process_pending_locked(p);
        mp_apply_release_threshold_locked(p, &rel);
    }
    mp_lock_release(&p->lock);
    mp_release_finish(p, &rel);
    return rc;
}

int mp_capture_active(mp_pool *p, uintptr_t stream) {
    mp_lock_acquire(&p->lock);
    int told = p->captures > 0;
    mp_lock_release(&p->lock);
    return told || mp_capture_handle(p, stream);
}

int mp_capture_known(mp_pool *p) {
    mp_lock_acquire(&p->lock);
    int found = p->captures > 0;
    for (size_t i = 0; !found && i < p->nstreams; i++)
        found = mp_capture_stream_locked(p, p->streams[i]);
    mp_lock_release(&p->lock);
    return found;
}
