/* What a front end asks of a pool's upstream beyond the upstream contract (mp_core.h).
 *
 * The glue reaches upstreams only through the core: a capture-safe upstream for a CUDA
 * graph's private pool and peer access exist only on the cuda upstream, so the core asks
 * it here, and answers for the others that they have none.
 */
#include "mp_cuda.h"
#include "mp_internal.h"

int mp_pool_plain_upstream(mp_pool *p, mp_upstream *out) {
    if (!p || !out) return MP_EINVAL;
    return mp_cuda_owns(&p->up) ? mp_cuda_plain_upstream(&p->up, out) : MP_EINVAL;
}

int mp_pool_enable_peer_access(mp_pool *p, int peer, char *err, size_t errlen) {
    if (errlen) err[0] = '\0';
    if (!p) return MP_EINVAL;
    if (!mp_cuda_owns(&p->up)) return MP_EUNSUPPORTED;
    return mp_cuda_enable_peer_access(&p->up, peer, err, errlen);
}
