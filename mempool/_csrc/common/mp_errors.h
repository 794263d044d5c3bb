/* The error codes of the C data plane: every layer returns them (the core's API, the upstream
 * contract, the glue's entry points), and the Cython layer turns them into exceptions.
 * A shared piece of the common layer: it includes nothing. */
#ifndef MP_ERRORS_H
#define MP_ERRORS_H

enum {
    MP_OK = 0,
    MP_ENOMEM = 1,       /* the upstream (device) has no memory for the request */
    MP_ELIMIT = 2,       /* the pool's own limit refuses the request */
    MP_EINVAL = 3,       /* a bad argument (size, stream, option) */
    MP_ENOTFOUND = 4,    /* a pointer the pool never handed out */
    MP_EINTERIOR = 5,    /* a pointer inside a block, not at its start */
    MP_EDOUBLEFREE = 6,  /* a pointer whose block is already free */
    MP_ENOTREADY = 7,    /* event_query: the event has not completed yet (not an error) */
    MP_EUPSTREAM = 8,    /* any other upstream failure; see mp_upstream.last_error */
    MP_EUNSUPPORTED = 9, /* the upstream lacks the operation (e.g. expandable segments) */
    MP_EBUSY = 10,       /* the pool is in use (e.g. blocks still live at destroy) */
    MP_ERETIRED = 11,    /* mp_alloc_tallied: the tally is closed (the pool left a table) */
};

#endif
